//! Training data: the embedded sequence-reversal task, or character-level text from a file.
//! Errors name the `remat train` flags that set what is wrong (`--digits`, `--seq`,
//! `--data`, `--batch`).
//!
//! Reversal: a sequence is `d_1 .. d_n = d_n .. d_1` over the digits 0-9 (`=` is token 10);
//! the model reads it shifted by one and is scored only on the reversed half (the first
//! half is random, so predicting it teaches nothing). Solving it needs attention to the
//! mirrored position, which RoPE makes learnable in a few hundred steps of a small model.

use std::path::Path;
use std::sync::Arc;

use super::error::{Result, SessionError};
use crate::core::kernels::{IGNORE_INDEX, philox_hash};
use crate::models::gpt::Batch;

const SEP: u32 = 10;

/// `Ok` when `holds`, else the refusal `message` says.
fn ensure(holds: bool, message: impl FnOnce() -> String) -> Result<()> {
    if holds {
        Ok(())
    } else {
        Err(SessionError::invalid(message()))
    }
}

/// Where batches come from.
pub enum Task {
    Reverse {
        digits: usize,
    },
    Chars {
        text: Vec<u32>,
        alphabet: Vec<char>,
        seq: usize,
    },
}

impl Task {
    pub fn reverse(digits: usize) -> Result<Task> {
        ensure(digits >= 2, || {
            format!("--digits must be at least 2 (got {digits})")
        })?;
        // The sequence is 2 x digits tokens.
        ensure(digits.checked_mul(2).is_some(), || {
            format!("--digits {digits} is too large: the sequence (2 x digits) overflows")
        })?;
        Ok(Task::Reverse { digits })
    }

    /// Character-level text: the vocabulary is the file's distinct characters.
    pub fn chars(path: &Path, seq: usize) -> Result<Task> {
        ensure(seq >= 1, || "--seq must be at least 1 (got 0)".to_string())?;
        let raw = std::fs::read_to_string(path).map_err(|source| SessionError::ReadData {
            path: path.to_path_buf(),
            source,
        })?;
        let mut alphabet: Vec<char> = raw.chars().collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        let text: Vec<u32> = raw
            .chars()
            .map(|c| alphabet.binary_search(&c).unwrap_or(0) as u32)
            .collect();
        // A sequence and its one-token-later target need seq + 1 characters, and the
        // start is drawn from text.len() - seq - 1 > 0 positions: seq + 2 in all (checked:
        // a --seq near usize::MAX would wrap around to a tiny number).
        let need = seq.checked_add(2).filter(|&n| n <= text.len());
        ensure(need.is_some(), || {
            format!(
                "--data {}: {} characters are too few for --seq {seq} (need at least seq + 2 = {})",
                path.display(),
                text.len(),
                seq as u128 + 2
            )
        })?;
        Ok(Task::Chars {
            text,
            alphabet,
            seq,
        })
    }

    /// Checks that a batch of `batch` sequences can be built: its tokens and targets
    /// (4 bytes each) in checked arithmetic, within `budget` when one is set (every step
    /// holds at least the embedding of those tokens, d_model >= 2 floats each, so a batch
    /// whose tokens exceed the budget can never run), and allocatable at all.
    pub fn check_batch(&self, batch: usize, budget: Option<u64>) -> Result<()> {
        let seq = self.seq();
        let flag = match self {
            Task::Reverse { .. } => "--digits",
            Task::Chars { .. } => "--seq",
        };
        let bytes = batch
            .checked_mul(seq)
            .and_then(|n| n.checked_mul(8))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                SessionError::invalid(format!(
                    "--batch {batch} x sequence length {seq} ({flag}) is more tokens than a \
                     process can address"
                ))
            })?;
        if let Some(budget) = budget.filter(|&b| bytes as u64 > b) {
            return Err(SessionError::invalid(format!(
                "--batch {batch} x sequence length {seq} ({flag}): the batch's tokens and \
                 targets alone take {bytes} bytes, more than --memory-budget {budget}"
            )));
        }
        let mut probe: Vec<u8> = Vec::new();
        probe.try_reserve_exact(bytes).map_err(|e| {
            SessionError::invalid(format!(
                "--batch {batch} x sequence length {seq} ({flag}): cannot allocate the \
                 batch's {bytes} bytes of tokens and targets: {e}"
            ))
        })?;
        Ok(())
    }

    pub fn vocab(&self) -> usize {
        match self {
            Task::Reverse { .. } => 11,
            Task::Chars { alphabet, .. } => alphabet.len(),
        }
    }

    pub fn seq(&self) -> usize {
        match self {
            Task::Reverse { digits } => 2 * digits,
            Task::Chars { seq, .. } => *seq,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Task::Reverse { digits } => {
                format!("reverse {digits} digits (embedded synthetic task)")
            }
            Task::Chars { text, alphabet, .. } => format!(
                "character-level text, {} characters, vocabulary {}",
                text.len(),
                alphabet.len()
            ),
        }
    }

    /// Batch `step` of `batch` sequences, deterministic in `(seed, step)`.
    pub fn batch(&self, seed: u64, step: u64, batch: usize) -> Batch {
        let seq = self.seq();
        let mut tokens = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        for b in 0..batch as u64 {
            let stream = (step << 24 | b) << 16;
            match self {
                Task::Reverse { digits } => {
                    let n = *digits;
                    let d: Vec<u32> = (0..n as u64)
                        .map(|i| (philox_hash(seed, stream + i) % 10) as u32)
                        .collect();
                    let full: Vec<u32> = d
                        .iter()
                        .copied()
                        .chain([SEP])
                        .chain(d.iter().rev().copied())
                        .collect();
                    tokens.extend_from_slice(&full[..2 * n]);
                    targets.extend((1..=2 * n).map(|p| if p > n { full[p] } else { IGNORE_INDEX }));
                }
                Task::Chars { text, .. } => {
                    let start =
                        (philox_hash(seed, stream) % (text.len() - seq - 1) as u64) as usize;
                    tokens.extend_from_slice(&text[start..start + seq]);
                    targets.extend_from_slice(&text[start + 1..start + seq + 1]);
                }
            }
        }
        Batch {
            tokens: Arc::from(tokens),
            targets: Arc::from(targets),
            batch,
            seq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seq_near_usize_max_is_an_error_not_an_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ok.txt");
        std::fs::write(&path, "hello world, hello remat").unwrap();
        for seq in [usize::MAX, usize::MAX - 1, 23] {
            let err = Task::chars(&path, seq).err().unwrap().to_string();
            assert!(err.contains("too few") && err.contains("--seq"), "{err}");
        }
        assert_eq!(Task::chars(&path, 22).unwrap().seq(), 22);
    }

    #[test]
    fn reversal_batches_score_only_the_reversed_half() {
        let t = Task::reverse(4).unwrap();
        let b = t.batch(1, 0, 3);
        assert_eq!((b.tokens.len(), b.seq), (24, 8));
        let (x, y) = (&b.tokens[..8], &b.targets[..8]);
        assert_eq!(x[4], SEP);
        assert_eq!(y[..4], [IGNORE_INDEX; 4]);
        assert_eq!(y[4..], [x[3], x[2], x[1], x[0]]);
        assert_eq!(t.batch(1, 0, 3).tokens, b.tokens);
        assert_ne!(t.batch(1, 1, 3).tokens, b.tokens);
    }
}
