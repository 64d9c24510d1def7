//! A cheap fingerprint of a tensor's exact bits, taken of every slot in forward and checked
//! after every rebuild in backward. A custom recompute op that drifted from the forward
//! code (rebuilding `ln2` from the block input instead of `h`, say) then fails loudly
//! instead of training on wrong gradients: replays are checked against the forward's
//! record, but a custom op's recipe can only be checked by its result.
//!
//! The hash is FNV-1a over 32-bit words in four interleaved lanes (so the multiplies do not
//! wait on one another), folded together with the shape. It is not cryptographic: it only
//! has to tell a drifted op's values from the forward's, and any single flipped bit changes
//! the lane it falls in.

use super::act::Act;

const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

fn mix(h: u64, word: u64) -> u64 {
    (h ^ word).wrapping_mul(PRIME)
}

/// The fingerprint of `act`'s shape and f32 bit patterns.
pub fn fingerprint(act: &Act) -> u64 {
    let mut lanes = [
        OFFSET,
        OFFSET ^ 0x9e37_79b9,
        OFFSET ^ 0x85eb_ca6b,
        OFFSET ^ 0xc2b2_ae35,
    ];
    let chunks = act.data.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for (lane, v) in lanes.iter_mut().zip(c) {
            *lane = mix(*lane, u64::from(v.to_bits()));
        }
    }
    let mut h = OFFSET;
    for v in tail {
        h = mix(h, u64::from(v.to_bits()));
    }
    for d in &act.shape {
        h = mix(h, *d as u64);
    }
    for lane in lanes {
        h = mix(h, lane);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_bits_match_and_any_flipped_bit_does_not() {
        let data: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 3.0).collect();
        let a = Act::new(data.clone(), vec![37]);
        assert_eq!(fingerprint(&a), fingerprint(&a.clone()));
        for i in [0, 5, 35, 36] {
            let mut d = data.clone();
            d[i] = f32::from_bits(d[i].to_bits() ^ 1);
            assert_ne!(fingerprint(&a), fingerprint(&Act::new(d, vec![37])), "{i}");
        }
        // -0.0 and 0.0 compare equal as floats but are different bits.
        let z = Act::new(vec![0.0; 4], vec![4]);
        let nz = Act::new(vec![-0.0, 0.0, 0.0, 0.0], vec![4]);
        assert_ne!(fingerprint(&z), fingerprint(&nz));
        // Same bits, different shape.
        assert_ne!(
            fingerprint(&Act::new(data[..36].to_vec(), vec![6, 6])),
            fingerprint(&Act::new(data[..36].to_vec(), vec![4, 9]))
        );
    }
}
