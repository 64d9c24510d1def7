//! What the S3 tests share: the server they run against (an S3-compatible one such as
//! `moto_server`, named by `REMAT_S3_TEST_ENDPOINT`), buckets, requests through
//! [`remat_reshard::run`], and a proxy that injects faults between the client and the
//! server and logs what passes.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use remat_reshard::location::StoreOptions;
use remat_reshard::run::{self, Action, Outcome, Request};
use remat_reshard::{ExecReport, TargetSpec};

/// The server's endpoint, or `None` after saying why the test is skipped.
pub fn endpoint() -> Option<String> {
    let Some(endpoint) = std::env::var("REMAT_S3_TEST_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
    else {
        println!(
            "skipping: REMAT_S3_TEST_ENDPOINT is not set; point it at an S3-compatible server (`moto_server -p 5123`, then REMAT_S3_TEST_ENDPOINT=http://127.0.0.1:5123), as .ci/run does"
        );
        return None;
    };
    if std::env::var("AWS_ACCESS_KEY_ID").is_err()
        || std::env::var("AWS_SECRET_ACCESS_KEY").is_err()
    {
        println!(
            "skipping: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set (any values do for moto)"
        );
        return None;
    }
    Some(endpoint)
}

/// `host:port` of an `http://host:port` endpoint.
pub fn authority(endpoint: &str) -> String {
    endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}

/// Creates a fresh bucket and returns its name.
pub fn bucket(endpoint: &str, what: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "remat-{what}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let host = authority(endpoint);
    let mut s = TcpStream::connect(&host).expect("connect to the S3 server");
    write!(
        s,
        "PUT /{name} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200") || reply.starts_with("HTTP/1.0 200"),
        "{reply}"
    );
    name
}

pub fn store(endpoint: &str) -> StoreOptions {
    StoreOptions {
        endpoint: Some(endpoint.to_string()),
    }
}

/// Runs one reshard `src` -> `dst` (paths or URLs).
pub fn reshard_s3(
    endpoint: &str,
    (src, dst): (&str, &str),
    spec: TargetSpec,
    rank: Option<usize>,
    action: Action,
    max_buffer: u64,
) -> Result<Outcome, run::RunError> {
    let request = Request {
        src: Path::new(src),
        dst: Path::new(dst),
        source_format: None,
        spec,
        max_buffer,
        rank,
        action,
        overwrite: false,
    };
    run::reshard_with(&request, &store(endpoint), |_| {}, None)
}

pub fn written(outcome: Outcome) -> ExecReport {
    match outcome {
        Outcome::Written(r) => r,
        other => panic!("expected a write, got {other:?}"),
    }
}

/// Asserts `a` and `b` (paths or URLs) hold the same tensors, byte for byte.
pub fn same(endpoint: &str, a: &str, b: &str) {
    let report = run::verify_with(
        (Path::new(a), None),
        (Path::new(b), None),
        &store(endpoint),
        |_| {},
        None,
    )
    .unwrap();
    assert_eq!(report.difference, None, "{a} vs {b}");
}

/// Object names (keys) under `prefix` of `bucket`, as the server lists them.
pub fn keys(endpoint: &str, bucket: &str, prefix: &str) -> Vec<String> {
    let host = authority(endpoint);
    let mut s = TcpStream::connect(&host).unwrap();
    write!(
        s,
        "GET /{bucket}?list-type=2&prefix={prefix} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply
        .split("<Key>")
        .skip(1)
        .filter_map(|k| k.split("</Key>").next())
        .map(str::to_string)
        .collect()
}

/// Faults a [`Proxy`] injects, each once per count.
#[derive(Default)]
pub struct Faults {
    /// Part uploads answered `503 Slow Down` without reaching the server.
    pub refuse_parts: usize,
    /// Part uploads whose connection is cut halfway through the body.
    pub drop_parts: usize,
    /// Delay before forwarding each request.
    pub delay: Duration,
}

/// A TCP proxy in front of the S3 server: one request per connection, forwarded whole,
/// with [`Faults`] injected and every request line logged (`DROPPED ...`, `REFUSED ...`
/// for the injected ones).
pub struct Proxy {
    pub endpoint: String,
    pub log: Arc<Mutex<Vec<String>>>,
    pub faults: Arc<Mutex<Faults>>,
}

impl Proxy {
    pub fn start(upstream: &str, faults: Faults) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let faults = Arc::new(Mutex::new(faults));
        let upstream = authority(upstream);
        let (l, f) = (log.clone(), faults.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (l, f, up) = (l.clone(), f.clone(), upstream.clone());
                std::thread::spawn(move || {
                    let _ = serve(client, &up, &l, &f);
                });
            }
        });
        Proxy {
            endpoint,
            log,
            faults,
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

/// Serves one request of `client`.
fn serve(
    client: TcpStream,
    upstream: &str,
    log: &Mutex<Vec<String>>,
    faults: &Mutex<Faults>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut head = Vec::new();
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if lower.starts_with("connection:") {
            continue;
        }
        if line == "\r\n" {
            head.extend_from_slice(b"Connection: close\r\n\r\n");
            break;
        }
        head.extend_from_slice(line.as_bytes());
    }
    let request_line = String::from_utf8_lossy(&head)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    let is_part = request_line.starts_with("PUT ") && request_line.contains("partNumber=");
    let (drop_it, refuse_it, delay) = {
        let mut f = faults.lock().unwrap();
        let drop_it = is_part && f.drop_parts > 0;
        f.drop_parts -= drop_it as usize;
        let refuse_it = is_part && !drop_it && f.refuse_parts > 0;
        f.refuse_parts -= refuse_it as usize;
        (drop_it, refuse_it, f.delay)
    };
    let mut client = client;
    if drop_it {
        let mut half = vec![0u8; len / 2];
        reader.read_exact(&mut half)?;
        log.lock().unwrap().push(format!("DROPPED {request_line}"));
        return client.shutdown(std::net::Shutdown::Both);
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    if refuse_it {
        log.lock().unwrap().push(format!("REFUSED {request_line}"));
        let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
        return write!(
            client,
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{xml}",
            xml.len()
        );
    }
    std::thread::sleep(delay);
    log.lock().unwrap().push(request_line);
    let mut up = TcpStream::connect(upstream)?;
    up.write_all(&head)?;
    up.write_all(&body)?;
    let mut reply = Vec::new();
    up.read_to_end(&mut reply)?;
    client.write_all(&with_close(&reply))?;
    client.flush()
}

/// A response with `Connection: close` in place of whatever the server said.
fn with_close(reply: &[u8]) -> Vec<u8> {
    let Some(end) = reply.windows(4).position(|w| w == b"\r\n\r\n") else {
        return reply.to_vec();
    };
    let head = String::from_utf8_lossy(&reply[..end]);
    let mut out = String::new();
    for line in head.split("\r\n") {
        if !line.to_ascii_lowercase().starts_with("connection:") {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str("Connection: close\r\n\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&reply[end + 4..]);
    bytes
}

/// Request lines that upload (PUT, or POST: multipart create and complete) the object
/// `key` of `bucket`.
pub fn uploads_of<'a>(lines: &'a [String], bucket: &str, key: &str) -> Vec<&'a String> {
    let path = format!("/{bucket}/{key}");
    lines
        .iter()
        .filter(|l| l.starts_with("PUT ") || l.starts_with("POST "))
        .filter(|l| {
            let target = l.split(' ').nth(1).unwrap_or_default();
            target.split('?').next() == Some(path.as_str())
        })
        .collect()
}
