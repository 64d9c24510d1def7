//! The flags that take sizes, budgets, bandwidths, counts and seconds, for every command,
//! read by [`remat_units`] (one meaning of `GB`, `GiB`, fractions, and one set of words for
//! what is wrong, for every front end). The value parsers return only what is wrong; `main`
//! prints it after the flag and the value (`--max-buffer 0: ...`), as the readers that run
//! after parsing (`--budget`, which needs the graph) print their [`UnitError`]. Every flag
//! here takes hyphen values (`allow_hyphen_values`), so `-1GB` reaches the reader, which
//! says it is negative, rather than clap, which would take it for a flag.

use remat_planner::{Graph, budget};
use remat_units::{Budget, UnitError};

/// Why `remat train --memory-budget` takes no fraction.
const TRAIN_HAS_NO_REFERENCE: &str = "`remat train` has none: its pool budget holds from the first step, before anything is measured";

fn problem(error: UnitError) -> String {
    error.problem.to_string()
}

/// A buffer's size, at least one byte (`--max-buffer 256MiB`; 0 would hold nothing).
pub fn buffer_arg(text: &str) -> Result<u64, String> {
    remat_units::flag::buffer(text)
}

/// A count of at least 1, where 0 would do nothing (`--steps`, `--world-size`, `--batch`).
pub fn count_arg<T: TryFrom<u64>>(text: &str) -> Result<T, String> {
    remat_units::flag::count(text)
}

/// A dropout probability in [0, 1) (`--dropout 0.1`).
pub fn dropout_arg(text: &str) -> Result<f32, String> {
    let p: f32 = text
        .trim()
        .parse()
        .map_err(|_| "not a number; give a probability in [0, 1), e.g. 0.1".to_string())?;
    if (0.0..1.0).contains(&p) {
        Ok(p)
    } else {
        Err("must be in [0, 1)".to_string())
    }
}

/// Seconds above 0, at most [`remat_units::flag::MAX_SECONDS`] (`--time-limit 0.5`).
pub fn seconds_arg(text: &str) -> Result<f64, String> {
    remat_units::flag::seconds(text)
}

/// A budget in bytes where no reference peak exists (`remat train --memory-budget 2GiB`);
/// under 1 KiB it cannot hold a step and is refused.
pub fn train_budget_arg(text: &str) -> Result<u64, String> {
    remat_units::parse_budget(text, "--memory-budget")
        .and_then(|b| b.bytes(TRAIN_HAS_NO_REFERENCE))
        .map_err(problem)
}

/// A budget resolved later against a reference peak (`remat spec inspect --memory-budget
/// 0.5`); errors that only the peak reveals name `--memory-budget` themselves. A budget in
/// bytes under 1 KiB cannot hold a step and is refused now.
pub fn budget_arg(text: &str) -> Result<Budget, String> {
    remat_units::parse_budget(text, "--memory-budget")
        .and_then(|b| b.check_step().map(|()| b))
        .map_err(problem)
}

/// `0.7` (fraction of the store-all peak), `8GiB`, `500MB`, `1234`, `1e9` (bytes): see
/// [`budget::parse_budget`] and, for the units, [`remat_units`].
pub fn parse_budget(text: &str, graph: &Graph) -> anyhow::Result<u64> {
    Ok(budget::parse_budget(text, graph, "--budget")?)
}

/// `32GB/s`, `16GiB/s`, `1e9`: bytes per second (see [`remat_units`]).
pub fn parse_bandwidth(text: &str) -> anyhow::Result<f64> {
    Ok(remat_units::parse_bandwidth(text, "--bandwidth")?)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use remat_engine::pipeline::manager::Strategy as StagePolicy;
    use remat_planner::Graph;

    use super::*;

    fn graph(peak: u64) -> Graph {
        let node = remat_planner::ir::Node {
            name: "a".into(),
            phase: remat_planner::ir::Phase::Forward,
            compute_time: 1.0,
            output_bytes: peak,
            inputs: vec![],
        };
        Graph::new("g", vec![node], 0, 1.0).expect("a one-node graph")
    }

    /// Bytes of `text` through every front end's own entry point: `--max-buffer`,
    /// `train --memory-budget`, `spec inspect --memory-budget`, `plan --budget` (the
    /// planner's `parse_budget`, which Python's `remat.plan` calls too), `--stage-policy
    /// memory:` (the engine's stage policy parser) and `--bandwidth`.
    fn every_front_end(text: &str, peak: u64) -> Vec<(&'static str, Result<u64, String>)> {
        let g = graph(peak);
        // `--stage-policy` is the engine's stage policy parser.
        let stage = |t: &str| match t
            .parse::<StagePolicy>()
            .map_err(|e: remat_engine::pipeline::manager::StrategyParseError| e.to_string())
        {
            Ok(StagePolicy::MemoryBased { threshold_bytes }) => Ok(threshold_bytes as u64),
            Ok(other) => Err(format!("not a memory policy: {other}")),
            Err(e) => Err(e),
        };
        vec![
            ("reshard --max-buffer", buffer_arg(text)),
            ("train --memory-budget", train_budget_arg(text)),
            (
                "spec inspect --memory-budget",
                budget_arg(text).and_then(|b| b.of(peak, "the peak").map_err(problem)),
            ),
            (
                "plan --budget",
                parse_budget(text, &g).map_err(|e| format!("{e:#}")),
            ),
            ("--stage-policy memory:", stage(&format!("memory:{text}"))),
            (
                "--bandwidth",
                parse_bandwidth(&format!("{text}/s"))
                    .map(|b| b as u64)
                    .map_err(|e| format!("{e:#}")),
            ),
        ]
    }

    /// Sizes as people write them: digits, maybe a point and an exponent, a unit in any case.
    fn texts() -> impl Strategy<Value = String> {
        let unit = prop::sample::select(vec![
            "", "B", "kB", "KB", "k", "MB", "M", "GB", "G", "TB", "KiB", "MiB", "GiB", "TiB",
        ]);
        let number = prop_oneof![
            (0u64..1 << 30).prop_map(|n| n.to_string()),
            (0u64..1 << 20, 0u32..1000).prop_map(|(n, d)| format!("{n}.{d:03}")),
            (1u64..100, 0u32..12).prop_map(|(n, e)| format!("{n}e{e}")),
        ];
        (number, unit, any::<bool>(), any::<bool>()).prop_map(|(n, u, lower, space)| {
            let u = if lower {
                u.to_lowercase()
            } else {
                u.to_string()
            };
            format!("{n}{}{u}", if space { " " } else { "" })
        })
    }

    proptest! {
        #[test]
        fn every_front_end_reads_the_same_bytes_from_the_same_text(
            text in texts(),
            peak in 1u64..1 << 40,
        ) {
            let size = remat_units::parse_size(&text, "");
            // A plain decimal is a fraction to a budget, bytes to a size: the budgets are
            // checked against the fraction, the sizes against the bytes.
            let t = text.trim();
            let fraction = t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.');
            for (front_end, got) in every_front_end(&text, peak) {
                let is_budget = front_end.contains("budget");
                match (&size, is_budget && fraction) {
                    (_, true) if front_end.starts_with("train") => {
                        prop_assert!(got.is_err(), "{front_end} {text}: {got:?}");
                    }
                    (_, true) => {
                        let want = remat_units::parse_budget(&text, "")
                            .and_then(|b| b.of(peak, "the peak"))
                            .map_err(|e| e.to_string());
                        prop_assert_eq!(got.is_ok(), want.is_ok(), "{} {}", front_end, text);
                        if let (Ok(got), Ok(want)) = (&got, &want) {
                            prop_assert_eq!(got, want, "{} {}", front_end, text);
                        }
                    }
                    // Budgets, bandwidths and buffers are at least one byte; other sizes may be 0.
                    (Ok(0), false)
                        if is_budget || front_end == "--bandwidth" || front_end.contains("buffer") =>
                    {
                        prop_assert!(got.is_err(), "{front_end} {text}: {got:?}");
                    }
                    // A budget in bytes under 1 KiB cannot hold a step: refused, but where a
                    // graph is planned whose store-all peak is itself that small.
                    (Ok(bytes), false) if is_budget && *bytes < remat_units::MIN_STEP_BUDGET => {
                        let small_graph = front_end.starts_with("plan") && peak < remat_units::MIN_STEP_BUDGET;
                        prop_assert_eq!(got.is_ok(), small_graph, "{} {}: {:?}", front_end, text, got);
                    }
                    // A bandwidth is an f64: exact up to 2^53 B/s, the nearest f64 above.
                    (Ok(bytes), false) if front_end == "--bandwidth" => {
                        prop_assert_eq!(&got, &Ok(*bytes as f64 as u64), "{} {}", front_end, text);
                    }
                    (Ok(bytes), false) => {
                        prop_assert_eq!(&got, &Ok(*bytes), "{} {}", front_end, text);
                    }
                    (Err(_), false) => {
                        prop_assert!(got.is_err(), "{front_end} {text}: {got:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_front_end_means_the_same_by_gb_and_gib() {
        for (text, bytes) in [
            ("1GB", 1_000_000_000),
            ("1gb", 1_000_000_000),
            ("1GiB", 1 << 30),
            ("1.5GiB", 3 << 29),
            ("64k", 64_000),
            ("64KiB", 64 << 10),
        ] {
            for (front_end, got) in every_front_end(text, 1 << 40) {
                assert_eq!(got, Ok(bytes), "{front_end} {text}");
            }
        }
    }

    #[test]
    fn the_same_bad_text_gets_the_same_words_everywhere() {
        for (front_end, got) in every_front_end("7 parsecs", 1000) {
            let text = got.expect_err("an unknown unit");
            assert!(
                text.contains("unknown unit `parsecs` (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, in any case)"),
                "{front_end}: {text}"
            );
        }
    }

    #[test]
    fn train_refuses_a_fraction_saying_it_has_no_reference() {
        let text = train_budget_arg("0.5").expect_err("a fraction");
        assert!(text.starts_with("a fraction needs a reference peak, and `remat train` has none"));
        assert_eq!(train_budget_arg("2GiB"), Ok(2 << 30));
        let text = train_budget_arg("1").expect_err("one byte");
        assert!(
            text.starts_with("1 byte cannot hold a training step"),
            "{text}"
        );
    }

    #[test]
    fn counts_and_seconds_refuse_zero_and_negatives() {
        assert_eq!(count_arg::<usize>("3"), Ok(3));
        assert_eq!(
            count_arg::<usize>("0").expect_err("zero"),
            "must be at least 1"
        );
        assert!(
            count_arg::<u8>("300")
                .expect_err("too big")
                .contains("at most 255")
        );
        assert!(
            count_arg::<u64>("-2")
                .expect_err("negative")
                .contains("negative")
        );
        assert_eq!(seconds_arg("0.5"), Ok(0.5));
        assert!(
            seconds_arg("0")
                .expect_err("zero")
                .contains("more than 0 seconds")
        );
        assert_eq!(buffer_arg("1KiB"), Ok(1024));
        assert!(buffer_arg("0").expect_err("zero").contains("holds nothing"));
    }

    #[test]
    fn budget_and_bandwidth_errors_name_the_flags() {
        let err = |r: anyhow::Result<f64>| format!("{:#}", r.expect_err("an error"));
        assert!(err(parse_bandwidth("0.4")).starts_with("--bandwidth 0.4: "));
        let g = graph(10);
        assert_eq!(parse_budget("0.5", &g).unwrap(), 5);
        let text = format!("{:#}", parse_budget("1.5", &g).expect_err("above 1"));
        assert!(
            text.starts_with("--budget 1.5: a fraction must be in (0, 1]"),
            "{text}"
        );
    }
}
