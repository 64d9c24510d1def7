//! How much of the machine a benchmark really had. On a virtual machine the hypervisor
//! runs other guests on the same physical cores and counts the time it took from this one
//! as "steal" (`/proc/stat`, Linux). A benchmark prints the share of CPU time stolen while
//! it ran, so a reader can tell a slow run on a busy host from a slow program; ratios
//! measured side by side in the same rounds stay comparable either way, absolute times do
//! not.

use std::time::Instant;

/// Cumulative CPU time of all cores, in the kernel's clock ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTicks {
    /// Every state: user, nice, system, idle, iowait, irq, softirq, steal.
    pub total: u64,
    pub steal: u64,
}

/// Reads the aggregate `cpu` line of a `/proc/stat` text; `None` when it has none or it
/// is malformed (then nothing is reported).
pub fn parse_proc_stat(text: &str) -> Option<CpuTicks> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    if fields.len() < 8 {
        return None;
    }
    Some(CpuTicks {
        total: fields.iter().sum(),
        steal: fields[7],
    })
}

/// Steal measured from a start point.
pub struct StealMeter {
    start: Option<CpuTicks>,
    started: Instant,
}

impl StealMeter {
    pub fn start() -> Self {
        StealMeter {
            start: read(),
            started: Instant::now(),
        }
    }

    /// Share of all CPU time stolen since the start, when `/proc/stat` is readable and
    /// some time was counted.
    pub fn stolen(&self) -> Option<f64> {
        stolen_between(self.start?, read()?)
    }

    /// A line for a benchmark's output, or `None` where steal cannot be read.
    pub fn report(&self) -> Option<String> {
        let share = self.stolen()?;
        Some(format!(
            "host: {:.1}% of this machine's CPU time was taken by the hypervisor for other guests during the {:.0} s run (steal); absolute times vary with it, ratios from the same rounds much less",
            100.0 * share,
            self.started.elapsed().as_secs_f64()
        ))
    }
}

fn read() -> Option<CpuTicks> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn stolen_between(a: CpuTicks, b: CpuTicks) -> Option<f64> {
    let total = b.total.checked_sub(a.total)?;
    let steal = b.steal.checked_sub(a.steal)?;
    (total > 0).then(|| steal as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "cpu  4240926 0 232061 1203204 25811 0 2160 238340 0 0\n\
                          cpu0 2072032 0 114465 658898 8397 0 286 117159 0 0\n\
                          intr 1 2 3\n";

    #[test]
    fn reads_the_aggregate_line() {
        let t = parse_proc_stat(SAMPLE).unwrap();
        assert_eq!(t.steal, 238340);
        assert_eq!(t.total, 4240926 + 232061 + 1203204 + 25811 + 2160 + 238340);
    }

    #[test]
    fn malformed_or_missing_lines_give_nothing() {
        assert_eq!(parse_proc_stat(""), None);
        assert_eq!(parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2 x 4 5 6 7 8\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2 3\n"), None);
    }

    #[test]
    fn share_is_stolen_ticks_over_all_ticks() {
        let a = CpuTicks {
            total: 1000,
            steal: 10,
        };
        let b = CpuTicks {
            total: 1400,
            steal: 110,
        };
        assert_eq!(stolen_between(a, b), Some(0.25));
        assert_eq!(stolen_between(a, a), None);
        assert_eq!(stolen_between(b, a), None);
    }
}
