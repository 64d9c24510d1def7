//! PyTorch as a peer in `remat bench engine --torch PYTHON`: the same GPT, run by a Python
//! process that stays up for the whole bench and times one training step per request, so
//! that remat's and PyTorch's steps alternate in the same rounds (on a shared machine the
//! speed drifts by tens of percent over a minute; timing the two programs minutes apart
//! would put that drift into their ratio). While one program runs its step the other waits
//! on a pipe, so the two never compete for the cores.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::thread::JoinHandle;

use remat_engine::models::gpt::GptConfig;

use crate::error::{Context, Result, bail};

/// The Python side, `python/bench_peers/torch_gpt.py` (see its header for the protocol).
const SCRIPT: &str = include_str!("../../../python/bench_peers/torch_gpt.py");

/// A running PyTorch peer.
pub struct TorchPeer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Drains the peer's error output (a full pipe would block it) and returns its tail.
    stderr: Option<JoinHandle<String>>,
    /// What the peer reported when ready (its torch version).
    pub version: String,
}

impl TorchPeer {
    /// Starts `python` on the bench model and waits until it has warmed up.
    pub fn spawn(
        python: &str,
        cfg: &GptConfig,
        batch: usize,
        seq: usize,
        threads: usize,
    ) -> Result<TorchPeer> {
        if cfg.n_kv_heads != cfg.n_heads || cfg.dropout > 0.0 {
            bail!("the PyTorch peer models full multi-head attention without dropout");
        }
        let args = [
            cfg.n_layers,
            cfg.d_model,
            cfg.n_heads,
            cfg.ffn_hidden,
            cfg.vocab,
            batch,
            seq,
            threads,
        ];
        let mut child = Command::new(python)
            .arg("-c")
            .arg(SCRIPT)
            .args(args.iter().map(usize::to_string))
            .env("OMP_NUM_THREADS", threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("--torch: cannot start `{python}`"))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            bail!("--torch: `{python}` started without pipes");
        };
        let mut peer = TorchPeer {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            stderr: Some(std::thread::spawn(move || drain_tail(stderr))),
            version: String::new(),
        };
        let ready = peer.read_line(python)?;
        match ready.strip_prefix("ready ") {
            Some(version) => peer.version = version.to_string(),
            None => bail!("--torch: `{python}` answered {ready:?} instead of ready"),
        }
        Ok(peer)
    }

    /// One training step under `policy` ("store-all" or "per-block"): its wall time.
    pub fn step(&mut self, policy: &str) -> Result<f64> {
        writeln!(self.stdin, "{policy}")
            .and_then(|()| self.stdin.flush())
            .context("--torch: the PyTorch process stopped reading")?;
        let line = self.read_line("the PyTorch process")?;
        line.parse::<f64>()
            .with_context(|| format!("--torch: step time {line:?} is not a number"))
    }

    /// The next line of the peer's output; if it ended, its error output says why.
    fn read_line(&mut self, who: &str) -> Result<String> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .with_context(|| format!("--torch: reading from {who}"))?;
        if n == 0 {
            // The peer closed its output: it has ended, so its error output ends too.
            let err = self
                .stderr
                .take()
                .and_then(|h| h.join().ok())
                .unwrap_or_default();
            let last = err.lines().last().unwrap_or("no error output");
            bail!("--torch: {who} ended early: {last}");
        }
        Ok(line.trim().to_string())
    }
}

/// Reads `stderr` to its end, keeping the last 4 KiB.
fn drain_tail(mut stderr: ChildStderr) -> String {
    const KEEP: usize = 4096;
    let mut tail: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(n) = stderr.read(&mut chunk) {
        if n == 0 {
            break;
        }
        tail.extend_from_slice(&chunk[..n]);
        if tail.len() > 2 * KEEP {
            tail.drain(..tail.len() - KEEP);
        }
    }
    String::from_utf8_lossy(&tail).into_owned()
}

impl Drop for TorchPeer {
    fn drop(&mut self) {
        // An empty line ends the peer's loop; kill it if it does not stop by itself.
        let _ = writeln!(self.stdin,);
        let _ = self.stdin.flush();
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            std::thread::sleep(std::time::Duration::from_millis(200));
            if !matches!(self.child.try_wait(), Ok(Some(_))) {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
    }
}
