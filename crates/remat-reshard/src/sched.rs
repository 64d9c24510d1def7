//! Hands the tasks of several output files to worker threads so that, as far as the
//! files allow, no two workers write into the same file at once.
//!
//! Why: a file system serialises buffered writes to one file (Linux takes the inode lock
//! in `write`), so two workers writing into one file run one after the other while a
//! third file waits. Each free worker takes the next task of the file with the fewest
//! workers on it (then the most bytes left), so every file keeps one writer while there
//! are files left, and only the last file is shared.

use std::sync::Mutex;

/// One unit of work: which file it writes and how many bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Job {
    pub file: usize,
    pub bytes: u64,
}

struct FileQueue {
    /// Task indices, in file order (written front to back).
    next: std::collections::VecDeque<usize>,
    bytes_left: u64,
    writers: usize,
}

struct State {
    files: Vec<FileQueue>,
    /// Set after an error: no more tasks are handed out.
    stopped: bool,
}

impl State {
    /// Every task queued on its file, no writers yet.
    fn new(jobs: &[Job]) -> State {
        let n_files = jobs.iter().map(|j| j.file + 1).max().unwrap_or(0);
        let mut files: Vec<FileQueue> = (0..n_files)
            .map(|_| FileQueue {
                next: Default::default(),
                bytes_left: 0,
                writers: 0,
            })
            .collect();
        for (i, j) in jobs.iter().enumerate() {
            files[j.file].next.push_back(i);
            files[j.file].bytes_left += j.bytes;
        }
        State {
            files,
            stopped: false,
        }
    }
}

/// Runs `work(task)` for every task on `threads` workers (rayon's pool) and returns the
/// results in task order. After the first error no new task starts; the error of the
/// lowest-numbered failed task is returned.
pub(crate) fn run_spread<R, E, F>(jobs: &[Job], threads: usize, work: F) -> Result<Vec<R>, E>
where
    R: Send,
    E: Send,
    F: Fn(usize) -> Result<R, E> + Sync,
{
    let state = Mutex::new(State::new(jobs));
    let results: Mutex<Vec<Option<Result<R, E>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let worker = || {
        while let Some(task) = take(&state, jobs) {
            let r = work(task);
            let failed = r.is_err();
            // A poisoned lock means another worker panicked, and the scope re-raises
            // that panic; the data under it is still consistent (plain stores).
            results.lock().unwrap_or_else(|e| e.into_inner())[task] = Some(r);
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            st.files[jobs[task].file].writers -= 1;
            st.stopped |= failed;
        }
    };
    let workers = threads.clamp(1, jobs.len().max(1));
    rayon::scope(|s| {
        for _ in 1..workers {
            s.spawn(|_| worker());
        }
        worker();
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Some(Ok(v)) => out.push(v),
            Some(Err(e)) => return Err(e),
            // Only after an error (no more tasks were started).
            None => continue,
        }
    }
    Ok(out)
}

/// The next task: from the file with the fewest writers, then the most bytes left.
fn take(state: &Mutex<State>, jobs: &[Job]) -> Option<usize> {
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    if st.stopped {
        return None;
    }
    let file = st
        .files
        .iter()
        .enumerate()
        .filter(|(_, f)| !f.next.is_empty())
        .min_by_key(|(_, f)| (f.writers, std::cmp::Reverse(f.bytes_left)))
        .map(|(i, _)| i)?;
    let f = &mut st.files[file];
    let task = f.next.pop_front()?;
    f.bytes_left -= jobs[task].bytes;
    f.writers += 1;
    Some(task)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn jobs(files: &[usize]) -> Vec<Job> {
        files.iter().map(|&file| Job { file, bytes: 10 }).collect()
    }

    #[test]
    fn every_task_runs_once_and_results_keep_task_order() {
        let jobs = jobs(&[0, 0, 1, 1, 1, 2, 0, 2]);
        let runs = AtomicUsize::new(0);
        let out = run_spread::<usize, (), _>(&jobs, 3, |t| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(t * 10)
        })
        .unwrap();
        assert_eq!(out, (0..8).map(|t| t * 10).collect::<Vec<_>>());
        assert_eq!(runs.load(Ordering::SeqCst), 8);
    }

    /// The hand-out rule, step by step (deterministic: no threads, no timing). A worker
    /// that finishes a task releases its file; the next take goes to the file with the
    /// fewest writers, so two workers share a file only once the other file is empty.
    #[test]
    fn two_workers_never_share_a_file_while_another_has_work() {
        let jobs = jobs(&[0, 0, 0, 1, 1, 1]);
        let state = Mutex::new(State::new(&jobs));
        let finish = |task: usize| {
            state.lock().unwrap().files[jobs[task].file].writers -= 1;
        };
        let file = |task: Option<usize>| task.map(|t| jobs[t].file);
        // Two workers start: one per file.
        let a = take(&state, &jobs);
        let b = take(&state, &jobs);
        assert_ne!(file(a), file(b));
        // The worker of `a` finishes, twice: each time it goes back to its own file, since
        // the other one has a writer.
        let mut done = a.unwrap();
        for _ in 0..2 {
            finish(done);
            let next = take(&state, &jobs);
            assert_eq!(file(next), file(a));
            done = next.unwrap();
        }
        finish(done);
        // File of `a` is now empty: its worker joins the other file, which still has a
        // writer (the one sanctioned case of sharing).
        let joined = take(&state, &jobs);
        assert_eq!(file(joined), file(b));
        assert_eq!(state.lock().unwrap().files[file(b).unwrap()].writers, 2);
    }

    #[test]
    fn an_error_stops_new_tasks_and_is_returned() {
        let jobs = jobs(&[0; 20]);
        let runs = AtomicUsize::new(0);
        let err = run_spread::<(), String, _>(&jobs, 1, |t| {
            runs.fetch_add(1, Ordering::SeqCst);
            if t == 3 {
                Err(format!("task {t}"))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert_eq!(err, "task 3");
        assert_eq!(runs.load(Ordering::SeqCst), 4);
    }
}
