//! A remote checkpoint opened from its headers: every object under the prefix becomes a
//! scratch file of the object's size holding only what opening reads (safetensors
//! headers, small index files whole), and the checkpoint is opened from there. Data is
//! fetched later, range by range ([`super::fetch`]). The scratch directory is removed as
//! soon as the checkpoint is open: the files stay reachable through the maps and the
//! handles kept here, and their space is freed when those are dropped.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use futures::{StreamExt, TryStreamExt};

use crate::checkpoint::{Checkpoint, Format};
use crate::error::{ReshardError, Result, io_err};
use crate::location::Remote;
use crate::remote::RemoteCheckpoint;

/// Non-safetensors objects up to this size (indexes, `.metadata`) are fetched whole when
/// the checkpoint is opened; larger ones are left as holes (no reader needs them).
const SMALL_OBJECT: u64 = 64 << 20;
/// Safetensors headers beyond this are refused rather than fetched (the format's own
/// readers refuse headers of 100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// One object listed under the prefix.
struct Object {
    name: String,
    size: u64,
}

/// Opens the checkpoint under `remote`, its layout detected unless given. Messages name
/// the URLs, never the scratch files.
/// Replicas (pieces of one box in several files) are fetched and compared, as opening a
/// local checkpoint compares them, with at most `max_buffer` bytes in flight.
pub fn open(remote: &Remote, format: Option<Format>, max_buffer: u64) -> Result<RemoteCheckpoint> {
    let dir = super::scratch_dir("src")?;
    let result = open_in(remote, format, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let rc = result.map_err(|e| rename_paths(e, &dir, &remote.url))?;
    super::fetch::fetch(&rc, super::fetch::replica_ranges(&rc.ckpt), max_buffer)?;
    rc.ckpt.validate()?;
    Ok(rc)
}

fn open_in(remote: &Remote, format: Option<Format>, dir: &Path) -> Result<RemoteCheckpoint> {
    let objects = super::block_on(list(remote))??;
    if objects.is_empty() {
        return Err(ReshardError::UnknownLayout {
            path: PathBuf::from(&remote.url),
            what: "no objects under this prefix".into(),
        });
    }
    super::block_on(materialize(remote, &objects, dir))??;
    let mut ckpt = Checkpoint::open_unvalidated(dir, format)?;
    let mut files = Vec::with_capacity(ckpt.files.len());
    for f in &mut ckpt.files {
        let name = f
            .path
            .strip_prefix(dir)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let handle = std::fs::OpenOptions::new()
            .write(true)
            .open(&f.path)
            .map_err(io_err(&f.path))?;
        f.path = remote.display(&name);
        files.push((name, handle));
    }
    ckpt.root = PathBuf::from(&remote.url);
    for s in &mut ckpt.skipped {
        if let Ok(rest) = s.path.strip_prefix(dir) {
            s.path = remote.display(&rest.to_string_lossy());
        }
    }
    Ok(RemoteCheckpoint {
        ckpt,
        remote: remote.clone(),
        files,
    })
}

/// The objects directly under the prefix (not in deeper "directories").
async fn list(remote: &Remote) -> Result<Vec<Object>> {
    let metas: Vec<_> = remote
        .store
        .list(Some(&remote.prefix))
        .try_collect()
        .await
        .map_err(|e| remote.err("", e))?;
    let depth = remote.prefix.parts().count();
    let mut out: Vec<Object> = metas
        .into_iter()
        .filter(|m| m.location.parts().count() == depth + 1)
        .filter_map(|m| {
            let name = m.location.filename()?.to_string();
            Some(Object { name, size: m.size })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Creates every object's scratch file, with its header or whole contents.
async fn materialize(remote: &Remote, objects: &[Object], dir: &Path) -> Result<()> {
    futures::stream::iter(objects)
        .map(|o| materialize_one(remote, o, dir))
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .map(|_| ())
}

async fn materialize_one(remote: &Remote, o: &Object, dir: &Path) -> Result<()> {
    let path = dir.join(&o.name);
    let file = crate::fsio::create_sized(&path, o.size)?;
    let key = remote.key(&o.name);
    let get = |range: std::ops::Range<u64>| {
        let key = key.clone();
        async move {
            remote
                .store
                .get_range(&key, range)
                .await
                .map_err(|e| remote.err(&o.name, e))
        }
    };
    let wanted = if o.name.ends_with(".safetensors") {
        if o.size < 8 {
            0..0
        } else {
            let len = get(0..8).await?;
            let mut le = [0u8; 8];
            le.copy_from_slice(&len[..8]);
            let header = u64::from_le_bytes(le);
            if header > MAX_HEADER {
                return Err(remote.err(
                    &o.name,
                    format!(
                        "safetensors header of {header} bytes is beyond the {MAX_HEADER}-byte limit"
                    ),
                ));
            }
            0..(8 + header).min(o.size)
        }
    } else if o.size <= SMALL_OBJECT {
        0..o.size
    } else {
        0..0
    };
    if !wanted.is_empty() {
        let bytes = get(wanted).await?;
        file.write_all_at(&bytes, 0).map_err(io_err(&path))?;
    }
    Ok(())
}

/// An error about scratch files, retold with the URLs they stand for.
fn rename_paths(e: ReshardError, dir: &Path, url: &str) -> ReshardError {
    let text = e.to_string();
    let dir = dir.display().to_string();
    if !text.contains(&dir) {
        return e;
    }
    crate::error::store_err(url, text.replace(&dir, url))
}
