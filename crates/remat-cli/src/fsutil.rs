//! Output files of the CLI, written through [`remat_engine::output_file`] (checked before
//! the work, unique temporary, synced, renamed, nothing left behind on error); errors are
//! prefixed with the flag the path came from.

use std::path::Path;

use remat_engine::output_file::{self, OutputFileError};

fn with_flag(flag: &str) -> impl FnOnce(OutputFileError) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("{flag} {e}")
}

/// Refuses `path` for `flag` (e.g. `--out`) when it cannot be a regular output file.
pub fn check_target(flag: &str, path: &Path) -> anyhow::Result<()> {
    output_file::check_target(path).map_err(with_flag(flag))
}

/// Writes `bytes` to `path` atomically; errors name `flag`, `path` and any temporary.
pub fn write_atomically(flag: &str, path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    output_file::write_atomically(path, bytes).map_err(with_flag(flag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_flag_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_atomically("--out", dir.path(), b"x")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--out ") && err.contains("a directory"),
            "{err}"
        );
        let err = check_target("--dump-grads", Path::new("/dev/full"))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--dump-grads /dev/full: "), "{err}");
    }
}
