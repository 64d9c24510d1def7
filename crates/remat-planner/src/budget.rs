//! A budget for a graph: bytes (`8GiB`, `500MB`, `1e9`) or a fraction of its store-all peak
//! (`0.7`), read by [`remat_units`] (the one meaning of units for every front end) and
//! resolved against the graph here.
//!
//! Every planning front end (`remat plan`, `remat plan-multi`, the Python package) reads
//! its budget through [`parse_budget`], so the same text means the same bytes everywhere.
//! Errors name the value and the flag or argument it came from (`flag`: `--budget` for the
//! binary, `budget` for Python).

use remat_units::UnitError;

use crate::ir::Graph;

/// What a fraction of a budget is taken of, as errors name it.
pub const REFERENCE: &str = "the store-all peak";

/// Bytes of `text` as a budget for `graph`: a fraction is of its store-all peak (exact,
/// rounded down, so `1.0` is exactly store-all); a budget that comes to 0 bytes is an error.
pub fn parse_budget(text: &str, graph: &Graph, flag: &str) -> Result<u64, UnitError> {
    remat_units::parse_budget(text, flag)?.of(graph.store_all_peak(), REFERENCE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(bytes: u64) -> Graph {
        let node = crate::ir::Node {
            name: "a".into(),
            phase: crate::ir::Phase::Forward,
            compute_time: 1.0,
            output_bytes: bytes,
            inputs: vec![],
        };
        Graph::new("g", vec![node], 0, 1.0).unwrap()
    }

    fn err(r: Result<u64, UnitError>) -> String {
        r.expect_err("an error").to_string()
    }

    #[test]
    fn fractions_are_of_the_store_all_peak_and_bytes_are_bytes() {
        let g = graph(1000);
        assert_eq!(g.store_all_peak(), 1000);
        assert_eq!(parse_budget("0.5", &g, "--budget"), Ok(500));
        assert_eq!(parse_budget("1.0", &g, "--budget"), Ok(1000));
        assert_eq!(parse_budget("1GB", &g, "--budget"), Ok(1_000_000_000));
        assert_eq!(parse_budget("1.5gib", &g, "--budget"), Ok(3 << 29));
    }

    #[test]
    fn fraction_budgets_are_exact_on_huge_graphs() {
        // 2^63 + 2^62 + 5 has no exact f64: 1.0 must still be exactly store-all.
        let peak = (1u64 << 63) + (1u64 << 62) + 5;
        let g = graph(peak);
        assert_eq!(parse_budget("1.0", &g, "--budget"), Ok(peak));
        assert_eq!(parse_budget("0.5", &g, "--budget"), Ok(peak / 2));
    }

    #[test]
    fn errors_name_the_flag_they_are_given_and_the_store_all_peak() {
        let g = graph(1000);
        assert_eq!(
            err(parse_budget("7x", &g, "budget")),
            "budget 7x: unknown unit `x` (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, in any case)"
        );
        assert!(err(parse_budget("1.5", &g, "--budget")).starts_with("--budget 1.5: "));
        assert_eq!(
            err(parse_budget("0.0001", &g, "--budget")),
            "--budget 0.0001: 0.0001 of the store-all peak (1000 B) is less than one byte"
        );
        assert!(err(parse_budget("0", &g, "--budget")).contains("0 bytes"));
    }
}
