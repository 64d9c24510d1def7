//! Where a checkpoint lives: a local path (plain, or a `file://` URL) or a prefix in an
//! object store (`s3://bucket/prefix`). Credentials and region come from the usual
//! environment variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL`, ...), the endpoint also from [`StoreOptions::endpoint`]; none of
//! them ever appears in a message, which name the URL only.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};

use crate::error::{ReshardError, Result};

/// How object stores are reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// An S3-compatible endpoint (`http://127.0.0.1:9000`), overriding `AWS_ENDPOINT_URL`.
    pub endpoint: Option<String>,
}

/// A checkpoint's place.
#[derive(Clone, Debug)]
pub enum Location {
    Local(PathBuf),
    Remote(Remote),
}

/// A prefix in an object store.
#[derive(Clone, Debug)]
pub struct Remote {
    pub store: Arc<dyn ObjectStore>,
    /// The directory-like prefix the checkpoint's objects live under.
    pub prefix: StorePath,
    /// The URL as given, for messages.
    pub url: String,
}

impl Remote {
    /// A store prefix addressed as `url` in messages.
    pub fn new(store: Arc<dyn ObjectStore>, prefix: &str, url: &str) -> Remote {
        Remote {
            store,
            prefix: StorePath::from(prefix),
            url: url.trim_end_matches('/').to_string(),
        }
    }

    /// A local directory through the object-store interface (the same code paths as a
    /// bucket, on the file system): how tests and `file://` mixed runs reach it.
    pub fn local_dir(dir: &Path) -> Result<Remote> {
        std::fs::create_dir_all(dir).map_err(crate::error::io_err(dir))?;
        let store = LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| crate::error::store_err(dir.display().to_string(), e.to_string()))?;
        Ok(Remote::new(
            Arc::new(store),
            "",
            &format!("file://{}", dir.display()),
        ))
    }

    /// The key of `name` under the prefix.
    pub fn key(&self, name: &str) -> StorePath {
        let mut key = self.prefix.clone();
        for part in name.split('/') {
            key = key.child(part);
        }
        key
    }

    /// `url/name`, for messages and paths in errors.
    pub fn display(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("{}/{name}", self.url))
    }

    /// An error about `name` under this prefix.
    pub fn err(&self, name: &str, e: impl std::fmt::Display) -> ReshardError {
        crate::error::store_err(self.display(name).display().to_string(), e.to_string())
    }
}

impl Location {
    /// Parses a path or URL: `s3://bucket/prefix`, `file:///abs/dir`, or a plain path.
    pub fn parse(text: &str, options: &StoreOptions) -> Result<Location> {
        let Some((scheme, _)) = text.split_once("://") else {
            return Ok(Location::Local(PathBuf::from(text)));
        };
        let bad = |what: String| crate::error::store_err(text, what);
        let url = url::Url::parse(text).map_err(|e| bad(format!("not a URL: {e}")))?;
        match scheme {
            "file" => url
                .to_file_path()
                .map(Location::Local)
                .map_err(|()| bad("a file:// URL needs an absolute path".into())),
            "s3" | "s3a" => Ok(Location::Remote(s3(&url, text, options)?)),
            other => Err(bad(format!(
                "unsupported scheme `{other}://`: use s3://bucket/prefix, file:///dir or a plain path"
            ))),
        }
    }

    /// Whether the checkpoint is in an object store.
    pub fn is_remote(&self) -> bool {
        matches!(self, Location::Remote(_))
    }
}

/// The retry policy of every store request: throttling (429, 503) and dropped
/// connections are retried with exponential backoff, up to 10 times within 3 minutes.
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(10),
            base: 2.0,
        },
        max_retries: 10,
        retry_timeout: Duration::from_secs(180),
    }
}

fn s3(url: &url::Url, text: &str, options: &StoreOptions) -> Result<Remote> {
    let bad = |what: String| crate::error::store_err(text, what);
    let bucket = url
        .host_str()
        .filter(|b| !b.is_empty())
        .ok_or_else(|| bad("no bucket: expected s3://bucket/prefix".into()))?;
    let mut builder = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_retry(retry_config());
    let endpoint = options
        .endpoint
        .clone()
        .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
        .or_else(|| std::env::var("AWS_ENDPOINT").ok());
    if let Some(endpoint) = endpoint {
        // A custom endpoint (MinIO, moto, a gateway) is addressed by path, and may be
        // plain HTTP on a private network.
        builder = builder
            .with_allow_http(endpoint.starts_with("http://"))
            .with_endpoint(endpoint)
            .with_virtual_hosted_style_request(false);
    }
    if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
        builder = builder.with_region("us-east-1");
    }
    let store = builder.build().map_err(|e| bad(e.to_string()))?;
    let prefix = url.path().trim_matches('/');
    Ok(Remote::new(Arc::new(store), prefix, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_file_urls_are_local_and_s3_urls_remote() {
        let o = StoreOptions::default();
        assert!(
            matches!(Location::parse("ckpt/a", &o).unwrap(), Location::Local(p) if p == Path::new("ckpt/a"))
        );
        assert!(
            matches!(Location::parse("file:///tmp/x", &o).unwrap(), Location::Local(p) if p == Path::new("/tmp/x"))
        );
        let o = StoreOptions {
            endpoint: Some("http://127.0.0.1:1".into()),
        };
        let Location::Remote(r) = Location::parse("s3://bkt/ckpt/step-1/", &o).unwrap() else {
            panic!("s3 is remote");
        };
        assert_eq!(r.prefix.as_ref(), "ckpt/step-1");
        assert_eq!(r.key("a.json").as_ref(), "ckpt/step-1/a.json");
        assert_eq!(
            r.display("a.json"),
            Path::new("s3://bkt/ckpt/step-1/a.json")
        );
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        let o = StoreOptions::default();
        let e = Location::parse("gs://b/x", &o).unwrap_err().to_string();
        assert!(e.contains("unsupported scheme `gs://`"), "{e}");
        let e = Location::parse("s3:///x", &o).unwrap_err().to_string();
        assert!(e.contains("no bucket"), "{e}");
    }
}
