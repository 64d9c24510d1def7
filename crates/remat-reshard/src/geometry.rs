//! N-dimensional boxes of a global tensor, their intersections found by sort and sweep,
//! and the strided byte copies that move one box's part of another.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A box of a global tensor: element offsets and sizes per dimension.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Region {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// The region with these offsets and sizes: the tests' shorthand (here, in `exec` and in
/// `stream`).
#[cfg(test)]
pub(crate) fn r(offsets: &[u64], sizes: &[u64]) -> Region {
    Region {
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
    }
}

impl Region {
    /// The box covering a whole tensor of `shape`.
    pub fn whole(shape: &[u64]) -> Region {
        Region {
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
        }
    }

    /// Number of elements (the caller has checked the global shape does not overflow).
    pub fn volume(&self) -> u64 {
        self.sizes.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.sizes.contains(&0)
    }

    /// The non-empty intersection of two boxes of the same tensor, if any.
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut sizes = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.sizes[d]).min(other.offsets[d] + other.sizes[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            sizes.push(hi - lo);
        }
        Some(Region { offsets, sizes })
    }

    /// Whether two boxes of the same tensor share an element (as `intersect` would find,
    /// without building the intersection).
    pub fn overlaps(&self, other: &Region) -> bool {
        (0..self.offsets.len()).all(|d| {
            self.offsets[d].max(other.offsets[d])
                < (self.offsets[d] + self.sizes[d]).min(other.offsets[d] + other.sizes[d])
        })
    }

    /// Whether global element `index` lies inside this box.
    pub fn contains(&self, index: &[u64]) -> bool {
        index
            .iter()
            .zip(self.offsets.iter().zip(&self.sizes))
            .all(|(&i, (&o, &s))| i >= o && i < o + s)
    }
}

/// PyTorch's split of `n` into `m` parts of `ceil(n/m)`: rank `r`'s `(start, len)`;
/// trailing parts may be smaller or empty.
pub fn split_dim(n: u64, m: u64, r: u64) -> (u64, u64) {
    let chunk = n.div_ceil(m.max(1));
    let start = (r * chunk).min(n);
    let end = ((r + 1) * chunk).min(n);
    (start, end - start)
}

/// The dimension along which boxes differ most, the best axis to sweep.
fn sweep_dim(boxes: &[&Region]) -> Option<usize> {
    let ndim = boxes.first()?.offsets.len();
    if ndim == 0 {
        return Some(0);
    }
    (0..ndim).max_by_key(|&d| {
        let mut starts: Vec<u64> = boxes.iter().map(|b| b.offsets[d]).collect();
        starts.sort_unstable();
        starts.dedup();
        (starts.len(), std::cmp::Reverse(d))
    })
}

/// Every pair `(i, j)` with `a[i]` and `b[j]` intersecting, found by sorting the boxes on
/// one axis and sweeping, so only boxes that overlap on that axis are ever compared.
/// `b = None` pairs `a` with itself (`i < j`). Empty boxes never intersect anything.
///
/// Identical boxes (the M whole-tensor chunks of a tensor replicated on M ranks) are
/// swept once and their pairs expanded afterwards, and boxes leave the sweep's active
/// lists in amortised constant time, so the cost is near-linear in the boxes plus the
/// pairs found rather than quadratic in the replicas.
pub fn intersecting_pairs(a: &[&Region], b: Option<&[&Region]>) -> Vec<(usize, usize)> {
    let ga = group_identical(a);
    let gb = b.map(group_identical);
    let reps_a: Vec<&Region> = ga.iter().map(|g| g.0).collect();
    let reps_b: Option<Vec<&Region>> = gb.as_ref().map(|g| g.iter().map(|g| g.0).collect());
    let unique = sweep(&reps_a, reps_b.as_deref());
    let mut pairs = Vec::new();
    match &gb {
        Some(gb) => {
            for (i, j) in unique {
                for &x in &ga[i].1 {
                    pairs.extend(gb[j].1.iter().map(|&y| (x, y)));
                }
            }
        }
        None => {
            // Identical non-empty boxes intersect one another.
            for (_, members) in &ga {
                for (k, &x) in members.iter().enumerate() {
                    pairs.extend(members[k + 1..].iter().map(|&y| (x.min(y), x.max(y))));
                }
            }
            for (i, j) in unique {
                for &x in &ga[i].1 {
                    pairs.extend(ga[j].1.iter().map(|&y| (x.min(y), x.max(y))));
                }
            }
        }
    }
    pairs.sort_unstable();
    pairs
}

/// The distinct non-empty boxes, in order of first appearance, each with the indices of
/// the boxes equal to it.
fn group_identical<'r>(boxes: &[&'r Region]) -> Vec<(&'r Region, Vec<usize>)> {
    let mut groups: Vec<(&Region, Vec<usize>)> = Vec::new();
    let mut seen: std::collections::HashMap<&Region, usize> = std::collections::HashMap::new();
    for (i, &r) in boxes.iter().enumerate() {
        if r.is_empty() {
            continue;
        }
        let g = *seen.entry(r).or_insert_with(|| {
            groups.push((r, Vec::new()));
            groups.len() - 1
        });
        groups[g].1.push(i);
    }
    groups
}

/// The boxes overlapping the sweep position on one axis. A box whose end the sweep has
/// passed is counted as expired (a heap of ends finds them) and dropped only once the
/// expired make up half the list, so each box is removed in amortised constant time.
struct Active<'r> {
    items: Vec<(usize, &'r Region, u64)>,
    ends: BinaryHeap<Reverse<u64>>,
    expired: usize,
}

impl<'r> Active<'r> {
    fn new() -> Active<'r> {
        Active {
            items: Vec::new(),
            ends: BinaryHeap::new(),
            expired: 0,
        }
    }

    fn push(&mut self, idx: usize, region: &'r Region, end: u64) {
        self.items.push((idx, region, end));
        self.ends.push(Reverse(end));
    }

    /// The sweep has reached `start`: boxes ending at or before it are expired.
    fn advance(&mut self, start: u64) {
        while let Some(&Reverse(end)) = self.ends.peek() {
            if end > start {
                break;
            }
            self.ends.pop();
            self.expired += 1;
        }
        if self.expired * 2 > self.items.len() {
            self.items.retain(|x| x.2 > start);
            self.expired = 0;
        }
    }

    /// The live boxes at sweep position `start`.
    fn live(&self, start: u64) -> impl Iterator<Item = (usize, &'r Region)> + '_ {
        self.items
            .iter()
            .filter(move |x| x.2 > start)
            .map(|x| (x.0, x.1))
    }
}

/// The sort-and-sweep of [`intersecting_pairs`] over non-empty boxes.
fn sweep(a: &[&Region], b: Option<&[&Region]>) -> Vec<(usize, usize)> {
    let mut tagged: Vec<(usize, usize, &Region)> =
        a.iter().enumerate().map(|(i, r)| (0, i, *r)).collect();
    if let Some(b) = b {
        tagged.extend(b.iter().enumerate().map(|(j, r)| (1, j, *r)));
    }
    let all: Vec<&Region> = tagged.iter().map(|t| t.2).collect();
    let Some(d) = sweep_dim(&all) else {
        return Vec::new();
    };
    let ndim = all[0].offsets.len();
    let lo = |r: &Region| if ndim == 0 { 0 } else { r.offsets[d] };
    let hi = |r: &Region| {
        if ndim == 0 {
            1
        } else {
            r.offsets[d] + r.sizes[d]
        }
    };
    tagged.sort_by_key(|t| (lo(t.2), t.0, t.1));
    let mut active = [Active::new(), Active::new()];
    let mut pairs = Vec::new();
    for (tag, idx, region) in tagged {
        let start = lo(region);
        for list in active.iter_mut() {
            list.advance(start);
        }
        let other = if b.is_some() { 1 - tag } else { 0 };
        for (j, r) in active[other].live(start) {
            if region.overlaps(r) {
                pairs.push(match (b.is_some(), tag) {
                    (true, 0) => (idx, j),
                    (true, _) => (j, idx),
                    (false, _) => (j.min(idx), j.max(idx)),
                });
            }
        }
        active[tag].push(idx, region, hi(region));
    }
    pairs
}

/// A copy of an n-d box between two row-major buffers: `counts` outer iterations with
/// byte strides on each side, each moving one contiguous run of `run` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StridedCopy {
    pub src_file: usize,
    /// Absolute byte offset in the source file of the first run.
    pub src_start: u64,
    /// Byte offset in the destination of the first run.
    pub dst_start: u64,
    pub run: u64,
    pub counts: Vec<u64>,
    pub src_strides: Vec<u64>,
    pub dst_strides: Vec<u64>,
}

impl StridedCopy {
    /// Number of contiguous runs.
    pub fn runs(&self) -> u64 {
        self.counts.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        self.runs() * self.run
    }

    /// One past the last destination byte written.
    pub fn dst_end(&self) -> u64 {
        self.dst_start + self.last_offset(&self.dst_strides) + self.run
    }

    /// Span of source bytes touched, first to last.
    pub fn src_span(&self) -> u64 {
        self.last_offset(&self.src_strides) + self.run
    }

    fn last_offset(&self, strides: &[u64]) -> u64 {
        self.counts
            .iter()
            .zip(strides)
            .map(|(c, s)| (c - 1) * s)
            .sum()
    }
}

/// Row-major element strides of a box.
fn strides(sizes: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; sizes.len()];
    for d in (0..sizes.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * sizes[d + 1];
    }
    s
}

fn to_bytes(bits: u64, elements: u64) -> Result<u64, String> {
    let b = elements * bits;
    if b.is_multiple_of(8) {
        Ok(b / 8)
    } else {
        Err(format!(
            "a split falls at element {elements} inside a byte of this {bits}-bit dtype; choose a split whose parts hold whole bytes"
        ))
    }
}

/// The copy of `inter` (inside both boxes) from `src` (stored at `src_start` in
/// `src_file`) to `dst` (stored at `dst_start`): dimensions that both boxes and the
/// intersection span entirely fold into the contiguous run, so runs are maximal.
pub fn strided_copy(
    (src_file, src, src_start): (usize, &Region, u64),
    (dst, dst_start): (&Region, u64),
    inter: &Region,
    bits: u64,
) -> Result<StridedCopy, String> {
    let ndim = inter.sizes.len();
    let ss = strides(&src.sizes);
    let ds = strides(&dst.sizes);
    let mut k = ndim;
    while k > 0 && inter.sizes[k - 1] == src.sizes[k - 1] && inter.sizes[k - 1] == dst.sizes[k - 1]
    {
        k -= 1;
    }
    // Dimensions k.. are full on every side; dimension k-1 contributes a partial extent.
    let inner = k.saturating_sub(1);
    let run_elems: u64 = inter.sizes[inner.min(ndim)..].iter().product();
    let src_off: u64 = (0..ndim)
        .map(|d| (inter.offsets[d] - src.offsets[d]) * ss[d])
        .sum();
    let dst_off: u64 = (0..ndim)
        .map(|d| (inter.offsets[d] - dst.offsets[d]) * ds[d])
        .sum();
    let mut copy = StridedCopy {
        src_file,
        src_start: src_start + to_bytes(bits, src_off)?,
        dst_start: dst_start + to_bytes(bits, dst_off)?,
        run: to_bytes(bits, run_elems)?,
        counts: Vec::new(),
        src_strides: Vec::new(),
        dst_strides: Vec::new(),
    };
    for d in 0..inner {
        if inter.sizes[d] > 1 {
            copy.counts.push(inter.sizes[d]);
            copy.src_strides.push(to_bytes(bits, ss[d])?);
            copy.dst_strides.push(to_bytes(bits, ds[d])?);
        }
    }
    Ok(copy)
}

/// Visits the runs of a copy in destination order as `(src_offset, dst_offset)`, using an
/// odometer rather than recursion.
pub fn for_each_run(copy: &StridedCopy, mut f: impl FnMut(u64, u64)) {
    let mut idx = vec![0u64; copy.counts.len()];
    let (mut src, mut dst) = (copy.src_start, copy.dst_start);
    loop {
        f(src, dst);
        let mut d = idx.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            src += copy.src_strides[d];
            dst += copy.dst_strides[d];
            if idx[d] < copy.counts[d] {
                break;
            }
            src -= copy.src_strides[d] * idx[d];
            dst -= copy.dst_strides[d] * idx[d];
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_split_matches_ceil_chunks() {
        let parts: Vec<_> = (0..4).map(|i| split_dim(3, 4, i)).collect();
        assert_eq!(parts, vec![(0, 1), (1, 1), (2, 1), (3, 0)]);
        let parts: Vec<_> = (0..4).map(|i| split_dim(50, 4, i)).collect();
        assert_eq!(parts, vec![(0, 13), (13, 13), (26, 13), (39, 11)]);
        assert_eq!(split_dim(5, 4, 3), (5, 0));
    }

    #[test]
    fn sweep_finds_exactly_the_brute_force_pairs() {
        let a: Vec<Region> = (0..5).map(|i| r(&[i * 3, 0], &[3, 8])).collect();
        let b: Vec<Region> = (0..3)
            .map(|j| r(&[0, j * 3], &[15, 3]))
            .chain([r(&[4, 7], &[9, 1])])
            .collect();
        let ar: Vec<&Region> = a.iter().collect();
        let br: Vec<&Region> = b.iter().collect();
        let mut brute = Vec::new();
        for (i, x) in a.iter().enumerate() {
            for (j, y) in b.iter().enumerate() {
                if x.intersect(y).is_some() {
                    brute.push((i, j));
                }
            }
        }
        assert_eq!(intersecting_pairs(&ar, Some(&br)), brute);
        assert_eq!(intersecting_pairs(&ar, None), vec![]);
        let over = [r(&[0], &[4]), r(&[3], &[4]), r(&[9], &[1])];
        let or: Vec<&Region> = over.iter().collect();
        assert_eq!(intersecting_pairs(&or, None), vec![(0, 1)]);
        let scalar = [r(&[], &[])];
        let sr: Vec<&Region> = scalar.iter().collect();
        assert_eq!(intersecting_pairs(&sr, Some(&sr)), vec![(0, 0)]);
    }

    fn brute(a: &[Region], b: Option<&[Region]>) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (i, x) in a.iter().enumerate() {
            match b {
                Some(b) => out.extend(
                    b.iter()
                        .enumerate()
                        .filter(|(_, y)| x.intersect(y).is_some())
                        .map(|(j, _)| (i, j)),
                ),
                None => out.extend(
                    a.iter()
                        .enumerate()
                        .skip(i + 1)
                        .filter(|(_, y)| x.intersect(y).is_some())
                        .map(|(j, _)| (i, j)),
                ),
            }
        }
        out
    }

    /// Replicas (identical boxes), empty boxes and random overlaps: the sweep finds
    /// exactly the brute-force pairs in both modes.
    #[test]
    fn identical_boxes_give_the_brute_force_pairs() {
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let boxes = |count: u64, next: &mut dyn FnMut(u64) -> u64| -> Vec<Region> {
            let mut v: Vec<Region> = (0..count)
                .map(|_| r(&[next(6), next(6)], &[next(4), 1 + next(4)]))
                .collect();
            // Replicas of some of them.
            for k in 0..v.len() {
                if next(3) == 0 {
                    v.push(v[k].clone());
                }
            }
            v
        };
        for _ in 0..200 {
            let (na, nb) = (1 + next(6), 1 + next(6));
            let (a, b) = (boxes(na, &mut next), boxes(nb, &mut next));
            let ar: Vec<&Region> = a.iter().collect();
            let br: Vec<&Region> = b.iter().collect();
            assert_eq!(intersecting_pairs(&ar, Some(&br)), brute(&a, Some(&b)));
            assert_eq!(intersecting_pairs(&ar, None), brute(&a, None));
        }
    }

    /// A tensor replicated on 2^20 ranks against two source pieces: every replica meets
    /// both pieces. Sweeping each replica against the others made this quadratic (hours);
    /// it is now proportional to the pairs.
    #[test]
    fn a_million_replicas_sweep_in_linear_time() {
        let m = 1usize << 20;
        let whole = r(&[0, 0], &[4, 4]);
        let dst: Vec<&Region> = std::iter::repeat_n(&whole, m).collect();
        let pieces = [r(&[0, 0], &[2, 4]), r(&[2, 0], &[2, 4])];
        let src: Vec<&Region> = pieces.iter().collect();
        let pairs = intersecting_pairs(&src, Some(&dst));
        assert_eq!(pairs.len(), 2 * m);
        assert_eq!((pairs[0], pairs[m]), ((0, 0), (1, 0)));
        assert_eq!(
            intersecting_pairs(&dst[..2000], None).len(),
            2000 * 1999 / 2
        );
    }

    #[test]
    fn copies_fold_full_dimensions_into_one_run() {
        // Row block of a [4, 6] f32 tensor into the whole tensor: one run.
        let c = strided_copy(
            (0, &r(&[2, 0], &[2, 6]), 100),
            (&r(&[0, 0], &[4, 6]), 0),
            &r(&[2, 0], &[2, 6]),
            32,
        )
        .unwrap();
        assert_eq!(
            (c.src_start, c.dst_start, c.run, c.counts.len()),
            (100, 48, 48, 0)
        );
        // Column block into the whole tensor: one run per row.
        let c = strided_copy(
            (0, &r(&[0, 2], &[4, 2]), 0),
            (&r(&[0, 0], &[4, 6]), 0),
            &r(&[0, 2], &[4, 2]),
            32,
        )
        .unwrap();
        assert_eq!(
            (
                c.dst_start,
                c.run,
                c.counts.clone(),
                c.src_strides.clone(),
                c.dst_strides.clone()
            ),
            (8, 8, vec![4], vec![8], vec![24])
        );
        let mut runs = Vec::new();
        for_each_run(&c, |s, d| runs.push((s, d)));
        assert_eq!(runs, vec![(0, 8), (8, 32), (16, 56), (24, 80)]);
        assert_eq!(c.dst_end(), 88);
        // Scalars.
        let c = strided_copy((0, &r(&[], &[]), 8), (&r(&[], &[]), 0), &r(&[], &[]), 64).unwrap();
        assert_eq!((c.src_start, c.run), (8, 8));
        // F4 split inside a byte is refused.
        assert!(
            strided_copy(
                (0, &r(&[0, 0], &[2, 3]), 0),
                (&r(&[0, 0], &[2, 3]), 0),
                &r(&[0, 0], &[1, 3]),
                4
            )
            .is_err()
        );
    }
}
