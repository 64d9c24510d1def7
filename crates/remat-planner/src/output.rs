//! Output files of a planning request (the plan's JSON, its timeline image), written all or
//! nothing: [`check_outputs`] refuses unusable paths before any work (planning can take
//! minutes), [`write_all_atomic`] writes every file to a unique temporary name beside it,
//! syncs them all, then renames them all, and removes the temporaries on any error.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;

/// An output path that cannot be written, or a write that failed. `path` is the user's
/// path as given.
#[derive(Debug, Error)]
pub enum OutputError {
    #[error("{path}: ends with `/`, so it names a directory; give a file name")]
    TrailingSlash { path: String },
    #[error("{path}: does not name a file")]
    NoFileName { path: String },
    #[error("{path}: directory {dir} does not exist: {error}")]
    NoDirectory {
        path: String,
        dir: String,
        error: std::io::Error,
    },
    #[error("{path}: {dir} is not a directory")]
    NotADirectory { path: String, dir: String },
    #[error("{path}: is a directory; give a file name")]
    IsADirectory { path: String },
    #[error(
        "{path}: exists and is not a regular file (a device, pipe or socket); refusing to replace it"
    )]
    NotARegularFile { path: String },
    #[error("{path}: cannot inspect: {error}")]
    Inspect { path: String, error: std::io::Error },
    #[error("{path} and {first} are the same file: give {first_flag} and {flag} different paths")]
    SameFile {
        path: String,
        first: String,
        flag: String,
        first_flag: String,
    },
    #[error("{path}: cannot create its temporary file {temp}: {error}")]
    CreateTemp {
        path: String,
        temp: String,
        error: std::io::Error,
    },
    #[error("{path}: cannot write: {error}")]
    Write { path: String, error: std::io::Error },
    #[error("{path}: cannot rename into place: {error}")]
    Rename { path: String, error: std::io::Error },
}

/// Checks output paths before any work: each names a file (not a path ending in `/`) in an
/// existing directory, and is either absent or a regular file, which the write replaces (a
/// rename would replace a device node or fail on a directory only after planning). Two
/// outputs naming the same file are refused, since one would silently overwrite the other;
/// `targets` pairs each path with the flag or argument it came from, for that message.
pub fn check_outputs(targets: &[(&str, &Path)]) -> Result<(), OutputError> {
    let mut seen: Vec<(PathBuf, &str, &Path)> = Vec::new();
    for &(flag, path) in targets {
        let key = check_output(path)?;
        if let Some((_, first_flag, first)) = seen.iter().find(|(k, _, _)| *k == key) {
            return Err(OutputError::SameFile {
                path: path.display().to_string(),
                first: first.display().to_string(),
                flag: flag.to_string(),
                first_flag: first_flag.to_string(),
            });
        }
        seen.push((key, flag, path));
    }
    Ok(())
}

/// One path of [`check_outputs`]; returns the file's canonical location, to find repeats.
fn check_output(path: &Path) -> Result<PathBuf, OutputError> {
    let shown = || path.display().to_string();
    let text = path.as_os_str().to_string_lossy();
    if text.ends_with('/') || text.ends_with(std::path::MAIN_SEPARATOR) {
        return Err(OutputError::TrailingSlash { path: shown() });
    }
    let Some(name) = path.file_name() else {
        return Err(OutputError::NoFileName { path: shown() });
    };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = std::fs::canonicalize(parent).map_err(|error| OutputError::NoDirectory {
        path: shown(),
        dir: parent.display().to_string(),
        error,
    })?;
    if !dir.is_dir() {
        return Err(OutputError::NotADirectory {
            path: shown(),
            dir: parent.display().to_string(),
        });
    }
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => return Err(OutputError::IsADirectory { path: shown() }),
        Ok(meta) if !meta.is_file() => {
            return Err(OutputError::NotARegularFile { path: shown() });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            return Err(OutputError::Inspect {
                path: shown(),
                error,
            });
        }
    }
    Ok(dir.join(name))
}

/// Writes every file to a temporary name beside it and syncs them all, then renames them
/// all: a failure while writing leaves no output file (temporaries are removed), and the
/// renames come only once every byte is on disk.
pub fn write_all_atomic(files: &[(PathBuf, Vec<u8>)]) -> Result<(), OutputError> {
    let mut temps: Vec<PathBuf> = Vec::with_capacity(files.len());
    let result = (|| {
        for (path, bytes) in files {
            temps.push(write_temp(path, bytes)?);
        }
        for ((path, _), tmp) in files.iter().zip(&temps) {
            std::fs::rename(tmp, path).map_err(|error| OutputError::Rename {
                path: path.display().to_string(),
                error,
            })?;
        }
        Ok(())
    })();
    if result.is_err() {
        for tmp in &temps {
            let _ = std::fs::remove_file(tmp);
        }
    }
    result
}

/// Writes `bytes` to a new temporary file beside `path` and syncs it. The name is unique
/// (process id and a counter, created with `create_new`, retried on a clash), so two
/// outputs, or two runs, never share a temporary. Errors name `path`, the user's file.
fn write_temp(path: &Path, bytes: &[u8]) -> Result<PathBuf, OutputError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let shown = || path.display().to_string();
    let Some(name) = path.file_name() else {
        return Err(OutputError::NoFileName { path: shown() });
    };
    let (tmp, mut file) = loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!(
            ".{}.{}.{n}.tmp",
            name.to_string_lossy(),
            std::process::id()
        ));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(file) => break (tmp, file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => {
                return Err(OutputError::CreateTemp {
                    path: shown(),
                    temp: tmp.display().to_string(),
                    error,
                });
            }
        }
    };
    if let Err(error) = file.write_all(bytes).and_then(|()| file.sync_all()) {
        drop(file);
        let _ = std::fs::remove_file(&tmp);
        return Err(OutputError::Write {
            path: shown(),
            error,
        });
    }
    Ok(tmp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("remat-output-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn files_are_written_whole_and_no_temporary_is_left() {
        let dir = temp_dir("ok");
        let (a, b) = (dir.join("a.json"), dir.join("b.svg"));
        std::fs::write(&a, b"old").unwrap();
        write_all_atomic(&[
            (a.clone(), b"plan".to_vec()),
            (b.clone(), b"<svg/>".to_vec()),
        ])
        .unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"plan");
        assert_eq!(std::fs::read(&b).unwrap(), b"<svg/>");
        assert_eq!(names_in(&dir), ["a.json", "b.svg"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_no_file_at_all() {
        let dir = temp_dir("fail");
        let good = dir.join("plan.json");
        // The second target's directory does not exist: its temporary cannot be created.
        let bad = dir.join("missing").join("plot.svg");
        let err = write_all_atomic(&[(good.clone(), b"x".to_vec()), (bad, b"y".to_vec())])
            .expect_err("missing directory");
        assert!(
            err.to_string().contains("cannot create its temporary file"),
            "{err}"
        );
        assert!(names_in(&dir).is_empty(), "{:?}", names_in(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unusable_targets_are_refused_before_any_work() {
        let dir = temp_dir("check");
        let check = |flag: &str, p: &Path| check_outputs(&[(flag, p)]).map_err(|e| e.to_string());
        assert!(check("--out", &dir).unwrap_err().contains("is a directory"));
        let slash = PathBuf::from(format!("{}/", dir.join("x").display()));
        assert!(
            check("--out", &slash)
                .unwrap_err()
                .contains("ends with `/`")
        );
        let missing = dir.join("nope").join("p.json");
        assert!(
            check("--out", &missing)
                .unwrap_err()
                .contains("does not exist")
        );
        assert!(
            check("--out", Path::new("/dev/null"))
                .unwrap_err()
                .contains("not a regular file")
        );
        let p = dir.join("p.json");
        let twice = check_outputs(&[("--out", &p), ("--plot", &dir.join(".").join("p.json"))])
            .expect_err("same file")
            .to_string();
        assert!(
            twice.ends_with("give --out and --plot different paths"),
            "{twice}"
        );
        check_outputs(&[("--out", &p)]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
