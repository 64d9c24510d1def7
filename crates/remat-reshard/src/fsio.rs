//! File-system plumbing: read-only maps that can give pages back, crash-safe writes.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};

use crate::error::{Result, io_err};

/// A read-only memory map of a whole file.
pub struct Map {
    map: Mmap,
}

impl Map {
    /// Maps `path` read-only.
    pub fn open(path: &Path) -> Result<Map> {
        let file = File::open(path).map_err(io_err(path))?;
        // A directory opens but cannot be mapped ("No such device"): say what it is.
        if file.metadata().map_err(io_err(path))?.is_dir() {
            return Err(io_err(path)(std::io::Error::other(
                "is a directory, not a safetensors file",
            )));
        }
        // SAFETY: the map is read-only; inputs are checkpoints nobody should be rewriting
        // while we read them. A concurrent truncation could still raise SIGBUS, which is
        // the accepted cost of memory-mapped reads.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        Ok(Map { map })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Drops our page-table entries for a byte range: the pages stay in the page cache,
    /// but stop counting towards this process's resident memory. This keeps peak RSS
    /// bounded while streaming through inputs larger than memory.
    pub fn release(&self, start: u64, len: u64) {
        let end = (start + len).min(self.map.len() as u64);
        if start >= end {
            return;
        }
        // SAFETY: DONTNEED on a shared, read-only file mapping only discards page-table
        // entries; later reads fault the unchanged file contents back in.
        let _ = unsafe {
            self.map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                start as usize,
                (end - start) as usize,
            )
        };
    }
}

/// Fsyncs a directory so that renames inside it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir))
}

/// The parent directory of `path`, `.` for bare names.
pub fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes `bytes` to `path` crash-safely: temporary name, fsync, rename, fsync directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_name(path);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        f.write_all(bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err(path))?;
        sync_dir(&parent_of(path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `dir/.name.partial`: the name a file has while it is being written.
pub fn temp_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    parent_of(path).join(format!(".{name}.partial"))
}

/// Creates (or truncates) `path` for reading and writing, sized to `len` bytes.
pub fn create_sized(path: &Path, len: u64) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io_err(path))?;
    file.set_len(len).map_err(io_err(path))?;
    Ok(file)
}

/// Copies `bytes` into a new file at `path` through a shared mapping (allocated with
/// `fallocate`, mapped, one user-space `memcpy`), without syncing. The benchmark measures
/// it beside `write` into a new file: on tmpfs the mapped copy is the slower of the two
/// (every fresh page is zeroed at its fault before being overwritten, where `write`
/// fills new pages directly), which is why the executor writes with `pwritev`. Falls back
/// to `write` where the file system cannot allocate ahead.
pub fn copy_into_fresh_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::fd::AsRawFd;
    let len = bytes.len() as u64;
    let file = create_sized(path, len)?;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if rc != 0 || len == 0 {
        use std::os::unix::fs::FileExt;
        return file.write_all_at(bytes, 0).map_err(io_err(path));
    }
    // SAFETY: a file we just created and sized; nothing else maps or truncates it.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(io_err(path))?;
    map.copy_from_slice(bytes);
    Ok(())
}
