//! Sizes, budgets and bandwidths as people write them (`8GiB`, `0.7`, `32GB/s`), and bytes
//! as people read them (`1.50 MiB`).
//!
//! Every remat front end reads and prints units here: the `remat` binary's flags
//! (`--budget`, `--memory-budget`, `--bandwidth`, `--max-buffer`, `--stage-policy
//! memory:BYTES`), the Python package (`budget=`, `bandwidth=`, `max_buffer=`) and the
//! engine's pipeline stage policies. So the same text means the same bytes everywhere, and
//! a bad value gets the same message everywhere. This crate depends on no other remat crate.
//!
//! # Sizes
//! A number, then an optional unit:
//!
//! | unit | bytes |
//! |---|---|
//! | none, `B` | 1 |
//! | `kB` (also `KB`, `k`) | 10^3 |
//! | `MB` (also `M`) | 10^6 |
//! | `GB` (also `G`) | 10^9 |
//! | `TB` (also `T`) | 10^12 |
//! | `KiB` | 2^10 |
//! | `MiB` | 2^20 |
//! | `GiB` | 2^30 |
//! | `TiB` | 2^40 |
//!
//! Units without an `i` are powers of 1000, units with one powers of 1024: `1GB` is
//! 1,000,000,000 bytes and `1GiB` 1,073,741,824.
//!
//! **Case:** units are read in any case: `gb`, `Gb` and `GB` are all 10^9 bytes, `gib`,
//! `GIB` and `GiB` all 2^30; there are no bits (`Gb` is gigabytes) and no milli-bytes (`mb`
//! is megabytes).
//!
//! **Numbers:** digits with an optional decimal point and exponent (`1.5GiB`, `.5MB`, `1e9`,
//! `2.5e3MB`), `_` allowed between digits (`1_048_576`), spaces allowed around the unit
//! (`1.5 kB`). The number is read exactly (no float rounding) and rounded to the nearest
//! whole byte, halves up: `1.5GiB` is 1,610,612,736 bytes, `2.5` is 3 bytes, `1e-5` is 0. A
//! size is at most 2^64 - 1 bytes; a negative one is an error. See [`parse_size`].
//!
//! # Budgets
//! A budget is a size of at least one byte, or a **fraction** in (0, 1] of a reference peak:
//! a plain number with a decimal point and no exponent or unit (`0.7`, `.5`, `1.0`). The
//! reference is the front end's: the graph's store-all peak for `remat plan --budget` and
//! Python's `remat.plan`, the predicted peak of the fastest allowed mix for `remat spec
//! inspect --memory-budget`. A fraction is applied exactly (at most 19 digits after the
//! point, rounded down, so `1.0` is exactly the reference); one that comes to 0 bytes is an
//! error. A budget in bytes under 1 KiB ([`MIN_STEP_BUDGET`]) is refused as a slip
//! (`memory_budget=1` meant `1.0` or `1GiB`: no training step fits in it), unless the
//! reference it is resolved against is itself under 1 KiB (a small synthetic graph given to
//! the planner, which may be planned at any budget); see [`Budget::check_step`]. Where a front end has no reference peak (`remat train --memory-budget`, whose pool
//! budget holds from the first step, before anything is measured), a fraction is an error
//! that says so. See [`parse_budget`] and [`Budget`].
//!
//! # Bandwidths
//! Bytes per second: a size with an optional `/s` (`32GB/s`, `16GiB/s`, `1e9`), at least
//! 1 B/s. See [`parse_bandwidth`].
//!
//! # Counts and seconds
//! Whole numbers (`--world-size 3`, `--steps 800`) and seconds (`--time-limit 0.5`) are
//! read here too, so that `-1`, `0` and `x` get the same words from every front end:
//! [`parse_count`] (at least a minimum, 1 where 0 would do nothing), [`parse_seconds`]
//! (above 0), and [`parse_nonzero_size`] for a size where 0 bytes would do nothing
//! (`--max-buffer`).
//!
//! # Printing
//! [`human_bytes`] prints binary units with two decimals (`1.50 MiB`, `1000 B` below 1 KiB);
//! [`exact_bytes`] prints text [`parse_size`] reads back to the same bytes (`256MiB`,
//! `1537`); [`human_bandwidth`] prints decimal units per second (`32.00 GB/s`);
//! [`plural`] counts things (`1 file`, `3 files`).
//!
//! # Measurements
//! [`median`] and [`upper_median`] read the middle of repeated timings, so every crate that
//! times something (the profiler, the spec mixes, the benchmarks, `remat train --compare`)
//! takes it the same way.
//!
//! # Errors
//! One [`UnitError`] for every front end: `{field} {text}: {what is wrong}`, e.g.
//! ``--budget 7x: unknown unit `x` (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, in any case)``
//! or `max_buffer -1: the value is negative; give a number of bytes`.

mod error;
pub mod flag;
mod number;
mod parse;
mod print;
mod stats;

pub use error::{Kind, MIN_STEP_BUDGET, MIN_STEP_BUDGET_TEXT, Problem, UNITS, UnitError, plural};
pub use parse::{
    Amount, Budget, parse_bandwidth, parse_budget, parse_count, parse_nonzero_size, parse_seconds,
    parse_size,
};
pub use print::{exact_bytes, human_bandwidth, human_bytes, human_bytes_exact};
pub use stats::{median, upper_median};

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    /// Every unit as the crate docs list it, with its bytes.
    const UNITS_TABLE: [(&str, u64); 15] = [
        ("", 1),
        ("B", 1),
        ("kB", 1_000),
        ("KB", 1_000),
        ("k", 1_000),
        ("MB", 1_000_000),
        ("M", 1_000_000),
        ("GB", 1_000_000_000),
        ("G", 1_000_000_000),
        ("TB", 1_000_000_000_000),
        ("T", 1_000_000_000_000),
        ("KiB", 1 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("TiB", 1 << 40),
    ];

    /// A count that is often a whole number of some unit, so every unit gets printed.
    fn counts() -> impl Strategy<Value = u64> {
        prop_oneof![
            any::<u64>(),
            (0u64..1 << 20, 0..UNITS_TABLE.len())
                .prop_map(|(n, u)| n.saturating_mul(UNITS_TABLE[u].1)),
        ]
    }

    /// `text` with each letter's case flipped where `flips` says so.
    fn recase(text: &str, flips: &[bool]) -> String {
        text.chars()
            .zip(flips.iter().cycle())
            .map(|(c, &flip)| {
                if flip {
                    c.to_ascii_uppercase()
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect()
    }

    proptest! {
        #[test]
        fn counts_read_back_and_refuse_what_is_under_their_minimum(n in any::<u64>(), min in 0u64..3) {
            let got = parse_count(&n.to_string(), "--n", min);
            if n >= min {
                prop_assert_eq!(got, Ok(n));
            } else {
                prop_assert_eq!(
                    got.map_err(|e| e.to_string()),
                    Err(format!("--n {n}: must be at least {min}"))
                );
            }
        }

        #[test]
        fn printing_exactly_then_parsing_gives_the_bytes_back(bytes in counts()) {
            let text = exact_bytes(bytes);
            prop_assert_eq!(parse_size(&text, "size"), Ok(bytes), "{}", text);
            if bytes >= MIN_STEP_BUDGET {
                let budget = parse_budget(&text, "budget").and_then(|b| b.bytes("none"));
                prop_assert_eq!(budget, Ok(bytes), "{}", text);
                let bandwidth = parse_bandwidth(&format!("{text}/s"), "bandwidth");
                prop_assert_eq!(bandwidth, Ok(bytes as f64), "{}", text);
            }
        }

        #[test]
        fn a_whole_number_of_a_unit_is_that_many_times_its_bytes_in_any_case(
            n in 0u64..1 << 24,
            unit in 0..UNITS_TABLE.len(),
            flips in proptest::collection::vec(any::<bool>(), 1..4),
            space in any::<bool>(),
        ) {
            let (name, scale) = UNITS_TABLE[unit];
            let sep = if space { " " } else { "" };
            let text = format!("{n}{sep}{}", recase(name, &flips));
            prop_assert_eq!(parse_size(&text, "size"), Ok(n * scale), "{}", text);
        }

        #[test]
        fn decimals_round_to_the_nearest_byte(
            whole in 0u64..1 << 20,
            tenths in 0u64..10,
            unit in 0..UNITS_TABLE.len(),
        ) {
            let (name, scale) = UNITS_TABLE[unit];
            let text = format!("{whole}.{tenths}{name}");
            let exact = u128::from(whole * 10 + tenths) * u128::from(scale);
            let rounded = (exact + 5) / 10;
            prop_assert_eq!(parse_size(&text, "size"), Ok(rounded as u64), "{}", text);
        }

        #[test]
        fn fractions_of_a_peak_never_exceed_it_and_round_down(
            peak in 1u64..,
            numerator in 1u64..=1000,
        ) {
            let text = format!("{}.{:03}", numerator / 1000, numerator % 1000);
            let budget = parse_budget(&text, "budget").expect("a fraction in (0, 1]");
            let want = u128::from(peak) * u128::from(numerator) / 1000;
            match budget.of(peak, "the peak") {
                Ok(bytes) => prop_assert_eq!(u128::from(bytes), want),
                Err(e) => {
                    prop_assert_eq!(want, 0);
                    prop_assert!(e.to_string().contains("less than one byte"), "{}", e);
                }
            }
        }

        #[test]
        fn any_text_parses_or_gets_a_named_error(text in "\\PC{0,12}") {
            if let Err(e) = parse_size(&text, "--field") {
                prop_assert!(e.to_string().starts_with("--field"), "{}", e);
            }
            if let Err(e) = parse_budget(&text, "--field") {
                prop_assert!(e.to_string().starts_with("--field"), "{}", e);
            }
            if let Err(e) = parse_count(&text, "--field", 1) {
                prop_assert!(e.to_string().starts_with("--field"), "{}", e);
            }
            if let Err(e) = parse_seconds(&text, "--field", 1_000_000) {
                prop_assert!(e.to_string().starts_with("--field"), "{}", e);
            }
        }
    }
}
