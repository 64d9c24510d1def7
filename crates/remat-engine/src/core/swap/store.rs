//! [`HostStore`]: where swapped-out buffers live, with exact byte accounting.

use super::SwapError;
use memmap2::{MmapMut, MmapOptions};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Regions of the swap file start on page boundaries so that each slot's mapping is its own
/// set of pages (no two slots share a page that two threads write at once).
const FILE_ALIGN: u64 = 4096;

/// Handle of one buffer held by a [`HostStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u64);

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where the store keeps its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostBacking {
    /// Ordinary heap memory of this process.
    Memory,
    /// One memory-mapped file in this directory, removed when the store is dropped.
    File(PathBuf),
}

/// Byte accounting of a host store: counted in requested bytes exactly, like the device pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    pub live_bytes: u64,
    pub peak_bytes: u64,
    pub live_slots: usize,
    /// Size of the swap file (0 in memory); regions are page aligned so it can exceed `peak`.
    pub file_bytes: u64,
}

enum SlotBytes {
    Heap(Vec<u8>),
    Mapped(MmapMut),
}

impl SlotBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            SlotBytes::Heap(v) => v,
            SlotBytes::Mapped(m) => m,
        }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            SlotBytes::Heap(v) => v,
            SlotBytes::Mapped(m) => m,
        }
    }
}

/// One slot: its bytes behind their own lock so a copy into one slot never blocks the store.
type SlotCell = Arc<Mutex<SlotBytes>>;

struct Slot {
    cell: SlotCell,
    len: u64,
    /// File region (offset, aligned length) for file-backed slots.
    region: Option<(u64, u64)>,
}

/// The swap file: regions are handed out first-fit from a free list, appended otherwise.
struct SwapFile {
    path: PathBuf,
    file: File,
    /// Free regions, offset -> length, coalesced on release.
    free: BTreeMap<u64, u64>,
    end: u64,
}

impl SwapFile {
    fn create(dir: &Path) -> Result<Self, SwapError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("remat-swap-{}-{n}.bin", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| io_err(&path, "create", source))?;
        // Unlinked at once: the open handle and the mappings keep the bytes, and no exit
        // path (an error, a panic, a kill) can leave the file behind in `dir`.
        std::fs::remove_file(&path).map_err(|source| io_err(&path, "unlink", source))?;
        Ok(SwapFile {
            path,
            file,
            free: BTreeMap::new(),
            end: 0,
        })
    }

    fn allocate(&mut self, len: u64) -> Result<(u64, u64), SwapError> {
        let size = len.div_ceil(FILE_ALIGN) * FILE_ALIGN;
        let fit = self
            .free
            .iter()
            .find(|&(_, &free_len)| free_len >= size)
            .map(|(&off, &free_len)| (off, free_len));
        if let Some((off, free_len)) = fit {
            self.free.remove(&off);
            if free_len > size {
                self.free.insert(off + size, free_len - size);
            }
            return Ok((off, size));
        }
        let off = self.end;
        // Really reserve the blocks: a sparse `set_len` succeeds on a full filesystem and
        // the first write through the mapping then dies of SIGBUS.
        if let Err(source) = reserve_space(&self.file, off, size) {
            // Give back whatever a partial reservation took (best effort).
            let _ = self.file.set_len(self.end);
            return Err(io_err(
                &self.path,
                "reserving disk space for a region",
                source,
            ));
        }
        self.end = off + size;
        Ok((off, size))
    }

    fn map(&self, offset: u64, len: u64) -> Result<MmapMut, SwapError> {
        // SAFETY: the file is private to this store (created with create_new under a unique
        // name) and each region is mapped exactly once, by the slot that owns it.
        unsafe {
            MmapOptions::new()
                .offset(offset)
                .len(len as usize)
                .map_mut(&self.file)
        }
        .map_err(|source| io_err(&self.path, "mmap", source))
    }

    fn release(&mut self, offset: u64, len: u64) {
        let (mut off, mut size) = (offset, len);
        if let Some((&next, &next_len)) = self.free.range(off + size..).next()
            && next == off + size
        {
            self.free.remove(&next);
            size += next_len;
        }
        if let Some((&prev, &prev_len)) = self.free.range(..off).next_back()
            && prev + prev_len == off
        {
            self.free.remove(&prev);
            off = prev;
            size += prev_len;
        }
        self.free.insert(off, size);
    }
}

/// Allocates `len` bytes of `file` from `offset` (growing it), or fails with the OS error
/// (ENOSPC on a full filesystem, EFBIG past the largest file).
fn reserve_space(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let too_large = || std::io::Error::from_raw_os_error(libc::EFBIG);
    let off = libc::off_t::try_from(offset).map_err(|_| too_large())?;
    let len = libc::off_t::try_from(len).map_err(|_| too_large())?;
    off.checked_add(len).ok_or_else(too_large)?;
    // SAFETY: a plain system call on a file descriptor this store owns.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), off, len) } {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

fn io_err(path: &Path, action: &'static str, source: std::io::Error) -> SwapError {
    SwapError::Io {
        path: path.to_path_buf(),
        action,
        source,
    }
}

struct Inner {
    slots: HashMap<SlotId, Slot>,
    next_id: u64,
    live: u64,
    peak: u64,
    file: Option<SwapFile>,
}

/// Holds swapped-out buffers. Shared between the compute thread and the copy workers
/// (`Arc<HostStore>`); the store-wide lock is held only to look slots up, never during a copy.
pub struct HostStore {
    inner: Mutex<Inner>,
    capacity: Option<u64>,
    backing: HostBacking,
}

impl HostStore {
    /// A store in this process's heap.
    pub fn in_memory() -> Self {
        Self::with_file(None, HostBacking::Memory)
    }

    /// A store in one memory-mapped file created in `dir` (removed when the store drops).
    pub fn on_disk(dir: &Path) -> Result<Self, SwapError> {
        let file = SwapFile::create(dir)?;
        Ok(Self::with_file(
            Some(file),
            HostBacking::File(dir.to_path_buf()),
        ))
    }

    fn with_file(file: Option<SwapFile>, backing: HostBacking) -> Self {
        HostStore {
            inner: Mutex::new(Inner {
                slots: HashMap::new(),
                next_id: 0,
                live: 0,
                peak: 0,
                file,
            }),
            capacity: None,
            backing,
        }
    }

    /// Refuse allocations that would take the live bytes past `bytes`.
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    pub fn backing(&self) -> &HostBacking {
        &self.backing
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked while holding it; the
        // accounting it protects is updated in single statements and stays consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserve a slot of `len` bytes (zeroed). `tag` names the tensor in errors.
    pub fn reserve(&self, len: u64, tag: &str) -> Result<SlotId, SwapError> {
        let mut inner = self.lock();
        if let Some(capacity) = self.capacity
            && inner.live + len > capacity
        {
            return Err(SwapError::HostCapacity {
                tag: tag.to_string(),
                requested: len,
                live: inner.live,
                capacity,
            });
        }
        let (bytes, region) = match inner.file.as_mut() {
            Some(file) if len > 0 => {
                let (offset, size) = file.allocate(len)?;
                match file.map(offset, len) {
                    Ok(map) => (SlotBytes::Mapped(map), Some((offset, size))),
                    Err(e) => {
                        file.release(offset, size);
                        return Err(e);
                    }
                }
            }
            _ => (SlotBytes::Heap(vec![0u8; len as usize]), None),
        };
        let id = SlotId(inner.next_id);
        inner.next_id += 1;
        inner.live += len;
        inner.peak = inner.peak.max(inner.live);
        let cell = Arc::new(Mutex::new(bytes));
        inner.slots.insert(id, Slot { cell, len, region });
        Ok(id)
    }

    /// The slot's bytes and length, for a copy done outside the store lock.
    fn cell(&self, slot: SlotId) -> Result<(SlotCell, u64), SwapError> {
        let inner = self.lock();
        let s = inner
            .slots
            .get(&slot)
            .ok_or(SwapError::UnknownSlot { slot })?;
        Ok((Arc::clone(&s.cell), s.len))
    }

    /// Copy `data` into a reserved slot of exactly its size.
    pub fn write(&self, slot: SlotId, data: &[u8]) -> Result<(), SwapError> {
        let (cell, len) = self.cell(slot)?;
        check_len(slot, "source buffer", len, data.len())?;
        let mut bytes = cell.lock().unwrap_or_else(|e| e.into_inner());
        bytes.as_mut_slice().copy_from_slice(data);
        Ok(())
    }

    /// Copy a slot's bytes into `out`, which must be exactly the slot's size.
    pub fn read(&self, slot: SlotId, out: &mut [u8]) -> Result<(), SwapError> {
        let (cell, len) = self.cell(slot)?;
        check_len(slot, "destination buffer", len, out.len())?;
        let bytes = cell.lock().unwrap_or_else(|e| e.into_inner());
        out.copy_from_slice(bytes.as_slice());
        Ok(())
    }

    /// Reserve a slot and copy `data` into it.
    pub fn put(&self, data: &[u8], tag: &str) -> Result<SlotId, SwapError> {
        let slot = self.reserve(data.len() as u64, tag)?;
        if let Err(e) = self.write(slot, data) {
            let _ = self.release(slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// Size in bytes of a slot.
    pub fn len_of(&self, slot: SlotId) -> Result<u64, SwapError> {
        Ok(self.cell(slot)?.1)
    }

    /// Give a slot's bytes back; returns how many were freed.
    pub fn release(&self, slot: SlotId) -> Result<u64, SwapError> {
        let mut inner = self.lock();
        let s = inner
            .slots
            .remove(&slot)
            .ok_or(SwapError::UnknownSlot { slot })?;
        inner.live -= s.len;
        if let (Some((offset, size)), Some(file)) = (s.region, inner.file.as_mut()) {
            file.release(offset, size);
        }
        Ok(s.len)
    }

    pub fn stats(&self) -> HostStats {
        let inner = self.lock();
        HostStats {
            live_bytes: inner.live,
            peak_bytes: inner.peak,
            live_slots: inner.slots.len(),
            file_bytes: inner.file.as_ref().map_or(0, |f| f.end),
        }
    }

    /// Start a new peak measurement from the current live bytes.
    pub fn reset_peak(&self) {
        let mut inner = self.lock();
        inner.peak = inner.live;
    }
}

fn check_len(slot: SlotId, what: &'static str, stored: u64, given: usize) -> Result<(), SwapError> {
    if stored != given as u64 {
        return Err(SwapError::SizeMismatch {
            slot,
            what,
            stored,
            requested: given as u64,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    fn round_trip(store: &HostStore) {
        let a = pattern(10_000, 1);
        let b = pattern(3, 2);
        let sa = store.put(&a, "a").unwrap();
        let sb = store.put(&b, "b").unwrap();
        assert_eq!(store.stats().live_bytes, 10_003);
        let mut out = vec![0u8; a.len()];
        store.read(sa, &mut out).unwrap();
        assert_eq!(out, a);
        assert_eq!(store.release(sa).unwrap(), 10_000);
        let mut out = vec![0u8; 3];
        store.read(sb, &mut out).unwrap();
        assert_eq!(out, b);
        store.release(sb).unwrap();
        let stats = store.stats();
        assert_eq!(
            (stats.live_bytes, stats.peak_bytes, stats.live_slots),
            (0, 10_003, 0)
        );
    }

    #[test]
    fn memory_round_trip_and_accounting() {
        round_trip(&HostStore::in_memory());
    }

    #[test]
    fn file_round_trip_reuses_regions_and_removes_file() {
        let dir = std::env::temp_dir().join(format!("remat-swap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = HostStore::on_disk(&dir).unwrap();
        round_trip(&store);
        let size_after_first = store.stats().file_bytes;
        round_trip(&store);
        // Freed regions coalesce and are reused: the file does not grow on the second pass.
        assert_eq!(store.stats().file_bytes, size_after_first);
        drop(store);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_slot_and_sizes() {
        let store = HostStore::in_memory().with_capacity(100);
        let s = store.put(&[1, 2, 3], "t").unwrap();
        let err = store.read(s, &mut [0u8; 4]).unwrap_err().to_string();
        assert!(
            err.contains("#0") && err.contains("3 bytes") && err.contains("4 bytes"),
            "{err}"
        );
        let err = store.reserve(98, "layer3.mlp").unwrap_err().to_string();
        assert!(
            err.contains("layer3.mlp") && err.contains("100-byte"),
            "{err}"
        );
        store.release(s).unwrap();
        let err = store.release(s).unwrap_err().to_string();
        assert!(err.contains("no slot #0"), "{err}");
    }

    #[test]
    fn the_swap_file_is_unlinked_as_soon_as_it_is_created() {
        let dir = std::env::temp_dir().join(format!("remat-swap-unlink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = HostStore::on_disk(&dir).unwrap();
        let slot = store.put(&pattern(5000, 3), "t").unwrap();
        // Nothing in the directory while the store is alive: a crash cannot leave a file.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let mut out = vec![0u8; 5000];
        store.read(slot, &mut out).unwrap();
        assert_eq!(out, pattern(5000, 3));
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_region_past_the_largest_file_is_an_error_not_a_sparse_file() {
        let dir = std::env::temp_dir().join(format!("remat-swap-huge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = HostStore::on_disk(&dir).unwrap();
        // 2^62 bytes: no filesystem reserves that; set_len would have made it sparse.
        let err = store.reserve(1 << 62, "layers.0.mlp").err().unwrap();
        let text = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(text.contains("reserving disk space"), "{text}");
        assert_eq!(store.stats().file_bytes, 0);
        assert_eq!(store.stats().live_bytes, 0);
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_directory_is_an_io_error_naming_the_path() {
        let err = HostStore::on_disk(Path::new("/nonexistent/remat-dir"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("/nonexistent/remat-dir") && err.contains("create"),
            "{err}"
        );
    }
}
