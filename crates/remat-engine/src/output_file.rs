//! Writing an output file safely. [`check_target`] refuses a path that cannot be a regular
//! file, before the work that produces the file starts. [`write_atomically`] writes a
//! unique temporary file beside the target (`create_new`, so it never follows or clobbers
//! anything already there), syncs it, renames it over the target and removes it on every
//! error path: the user's path is either untouched or the complete new file.
//!
//! Used for gradient dumps (`models::gpt::hf`) and by the CLI for every file it writes.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why an output file was refused or not written. The OS error is part of each message,
/// not a `source()`, so a chain prints it once.
#[derive(Debug, thiserror::Error)]
pub enum OutputFileError {
    #[error("{path}: {reason}")]
    Target { path: PathBuf, reason: String },
    #[error("{path}: cannot inspect the path: {error}")]
    Inspect {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {action} the temporary file {tmp}: {error}")]
    Temp {
        path: PathBuf,
        tmp: PathBuf,
        action: &'static str,
        error: std::io::Error,
    },
}

/// Refuses `path` as an output file when it is empty, ends in `/`, has no file name (`.`,
/// `..`), or exists and is not a regular file (a directory, a device such as `/dev/full`, a
/// FIFO, or a symlink to one of those).
pub fn check_target(path: &Path) -> Result<(), OutputFileError> {
    let refuse = |reason: String| {
        Err(OutputFileError::Target {
            path: path.into(),
            reason,
        })
    };
    let text = path.as_os_str().as_encoded_bytes();
    if text.is_empty() {
        return refuse("the output path is empty".into());
    }
    if text.ends_with(b"/") {
        return refuse("ends in '/', so it names a directory, not a file".into());
    }
    if !matches!(path.file_name(), Some(n) if n != "." && n != "..") {
        return refuse("names a directory, not a file".into());
    }
    // `metadata` follows symlinks: a link to a regular file is fine (the rename replaces
    // the link), a link to a directory or device is refused like the thing itself.
    match fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(meta) => refuse(format!(
            "exists and is {}, not a regular file; refusing to replace it",
            kind(&meta)
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(OutputFileError::Inspect {
            path: path.into(),
            error,
        }),
    }
}

fn kind(meta: &fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

/// Writes `bytes` to `path` atomically (see the module comment).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), OutputFileError> {
    write_with(path, |f| f.write_all(bytes))
}

/// [`write_atomically`] with the body written by `fill` (tests inject failures here).
pub fn write_with(
    path: &Path,
    fill: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<(), OutputFileError> {
    check_target(path)?;
    let (tmp, mut file) = create_temp(path)?;
    let temp = |action: &'static str, error| OutputFileError::Temp {
        path: path.into(),
        tmp: tmp.clone(),
        action,
        error,
    };
    let result = fill(&mut file)
        .map_err(|e| temp("writing", e))
        .and_then(|()| file.sync_all().map_err(|e| temp("syncing", e)))
        .and_then(|()| {
            drop(file);
            fs::rename(&tmp, path).map_err(|e| temp("renaming to it", e))
        });
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Persist the rename itself; some filesystems refuse to sync a directory.
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// The N of the next temporary name.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Creates `.NAME.tmp-PID-N` beside `path` with `create_new` (never an existing file or
/// symlink), trying the next N while the name is taken.
fn create_temp(path: &Path) -> Result<(PathBuf, File), OutputFileError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default();
    let mut last = None;
    for _ in 0..64 {
        let mut tmp_name = OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(
            ".tmp-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = dir.join(tmp_name);
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(file) => return Ok((tmp, file)),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some((tmp, error));
            }
            Err(error) => {
                return Err(OutputFileError::Temp {
                    path: path.into(),
                    tmp,
                    action: "creating",
                    error,
                });
            }
        }
    }
    let (tmp, error) =
        last.unwrap_or_else(|| (dir.into(), std::io::ErrorKind::AlreadyExists.into()));
    Err(OutputFileError::Temp {
        path: path.into(),
        tmp,
        action: "creating (64 names taken; the last tried)",
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn writes_replaces_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g.json");
        write_atomically(&out, b"one").unwrap();
        write_atomically(&out, b"two").unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"two");
        assert_eq!(entries(dir.path()), ["g.json"]);
    }

    #[test]
    fn refuses_directories_devices_and_trailing_slashes_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        fs::create_dir(&sub).unwrap();
        let slash = format!("{}/", dir.path().join("new").display());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&sub, &link).unwrap();
        let cases: [(&Path, &str); 6] = [
            (&sub, "a directory"),
            (Path::new(&slash), "ends in '/'"),
            (Path::new("."), "names a directory"),
            (&dir.path().join(".."), "names a directory"),
            (Path::new("/dev/full"), "a device"),
            (&link, "a directory"),
        ];
        for (path, needle) in cases {
            let err = write_atomically(path, b"x").unwrap_err().to_string();
            assert!(err.contains(needle), "{}: {err}", path.display());
        }
        assert_eq!(entries(dir.path()), ["link", "sub"]);
        assert!(entries(&sub).is_empty());
        use std::os::unix::fs::FileTypeExt;
        assert!(
            fs::metadata("/dev/full")
                .unwrap()
                .file_type()
                .is_char_device()
        );
    }

    #[test]
    fn a_failed_write_removes_the_temporary_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("spec.toml");
        fs::write(&out, b"old").unwrap();
        let err = write_with(&out, |f| {
            f.write_all(b"partial")?;
            Err(std::io::Error::other("no space left on device (injected)"))
        })
        .unwrap_err();
        let err = err.to_string();
        assert!(err.contains("spec.toml") && err.contains(".tmp-"), "{err}");
        assert_eq!(fs::read(&out).unwrap(), b"old");
        assert_eq!(entries(dir.path()), ["spec.toml"]);
    }

    #[test]
    fn a_symlink_or_directory_at_a_temporary_name_is_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        // Occupy the next few temporary names of this process with a symlink and a
        // directory: create_new skips them instead of writing through or failing.
        let out = dir.path().join("out.json");
        let n = NEXT.load(Ordering::Relaxed);
        for k in n..n + 8 {
            let name = dir
                .path()
                .join(format!(".out.json.tmp-{}-{k}", std::process::id()));
            if k % 2 == 0 {
                std::os::unix::fs::symlink(&victim, &name).unwrap();
            } else {
                fs::create_dir(&name).unwrap();
            }
        }
        write_atomically(&out, b"new").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        assert_eq!(fs::read(&out).unwrap(), b"new");
    }
}
