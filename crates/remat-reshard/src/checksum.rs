//! Chunk checksums: xxh3-64 over fixed blocks, then over the blocks' digests.
//!
//! xxh3 because it hashes at tens of GB/s on one core (SSE2/AVX2), far above the copy
//! rate, so checksumming while writing costs little; the checksums guard against
//! corruption and bugs, not adversaries, so a cryptographic hash would only be slower.
//! Hashing in blocks lets the pieces of a large chunk be written, and hashed, in parallel
//! while the result stays independent of how the work was split.

use xxhash_rust::xxh3::xxh3_64;

/// Block size of the two-level checksum (recorded in the index).
pub const BLOCK_BYTES: u64 = 16 << 20;

/// The name recorded in the index.
pub const ALGORITHM: &str = "xxh3-64-blocks";

/// Digest of one block.
pub fn block_digest(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Combines the block digests of a chunk, in order, into the chunk checksum.
pub fn combine(digests: &[u64]) -> u64 {
    let mut bytes = Vec::with_capacity(digests.len() * 8);
    for d in digests {
        bytes.extend_from_slice(&d.to_le_bytes());
    }
    xxh3_64(&bytes)
}

/// Checksum of a chunk held in memory (or in a map) with blocks of `block` bytes.
pub fn chunk_checksum(bytes: &[u8], block: u64) -> u64 {
    let digests: Vec<u64> = bytes
        .chunks(block.max(1) as usize)
        .map(block_digest)
        .collect();
    combine(&digests)
}

/// Formats a checksum the way the index stores it.
pub fn to_hex(sum: u64) -> String {
    format!("{sum:016x}")
}

/// Parses an index checksum.
pub fn from_hex(s: &str) -> Option<u64> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_split_does_not_depend_on_who_hashes_what() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let whole = chunk_checksum(&data, 64);
        let by_hand: Vec<u64> = data.chunks(64).map(block_digest).collect();
        assert_eq!(whole, combine(&by_hand));
        // The format the index documents, against the reference C xxHash (python-xxhash
        // 4.1.0, libxxhash 0.8.4): XXH3_64bits of each block, then of the little-endian
        // digests. XXH3_64bits("") is the well-known 2d06800538d394c2.
        assert_eq!(to_hex(block_digest(&[])), "2d06800538d394c2");
        assert_eq!(to_hex(block_digest(&data[..64])), "6efb76ff16f37561");
        assert_eq!(to_hex(whole), "9210fddead4f85cb");
        assert_eq!(to_hex(chunk_checksum(&data, 1000)), "22dd2cb378f8f462");
        assert_eq!(to_hex(chunk_checksum(&[], 64)), "2d06800538d394c2");
        assert_ne!(whole, chunk_checksum(&data[1..], 64));
        assert_eq!(from_hex(&to_hex(whole)), Some(whole));
        assert_eq!(from_hex("xyz"), None);
    }
}
