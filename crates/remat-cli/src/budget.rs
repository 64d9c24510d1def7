//! Sizes on the command line, for every command: byte counts (`256MiB`, `2GiB`, `1.5GB`,
//! `1048576`), the planner's budgets (a fraction of the store-all peak, or bytes) and
//! bandwidths. Reports print sizes with [`remat_report::format_bytes`].

use remat_planner::{Graph, budget};

/// Parses a byte count: a number with an optional unit `B`, `K/KB` (1000), `KiB` (1024),
/// `M/MB`, `MiB`, `G/GB`, `GiB`, `T/TB`, `TiB` (case-insensitive, spaces allowed).
pub fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    let s = text.trim();
    if s.starts_with('-') {
        anyhow::bail!("memory size {text:?} is negative: a size is a positive number of bytes");
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (num, unit) = (
        s[..split].replace('_', ""),
        s[split..].trim().to_ascii_lowercase(),
    );
    // Plain byte counts are read as integers, exactly: a float would round
    // 18446744073709551616 (2^64, one past u64::MAX) down into range.
    if matches!(unit.as_str(), "" | "b") && !num.contains('.') && !num.is_empty() {
        return match num.parse::<u64>() {
            Ok(0) => anyhow::bail!("memory size {text:?} is out of range (at least 1 byte)"),
            Ok(bytes) => Ok(bytes),
            Err(_) => anyhow::bail!(
                "memory size {text:?} is out of range (at most {} bytes)",
                u64::MAX
            ),
        };
    }
    let value: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("memory size {text:?}: {num:?} is not a number"))?;
    let scale: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        _ => anyhow::bail!(
            "memory size {text:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        ),
    };
    let bytes = value * scale;
    // `u64::MAX as f64` is 2^64, itself out of range: hence `>=`.
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        anyhow::bail!("memory size {text:?} is out of range");
    }
    Ok(bytes.round() as u64)
}

/// `0.7` (fraction of the store-all peak), `8GiB`, `500MB`, `1234`, `1e9` (bytes): see
/// [`budget::parse_budget`].
pub fn parse_budget(text: &str, graph: &Graph) -> anyhow::Result<u64> {
    Ok(budget::parse_budget(text, graph, "--budget")?)
}

/// `32GB/s`, `16GiB/s`, `1e9`: bytes per second.
pub fn parse_bandwidth(text: &str) -> anyhow::Result<f64> {
    Ok(budget::parse_bandwidth(text, "--bandwidth")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_bytes("1.5 kb").unwrap(), 1500);
        assert_eq!(parse_bytes("3G").unwrap(), 3_000_000_000);
        assert!(
            parse_bytes("12 parsecs")
                .unwrap_err()
                .to_string()
                .contains("unknown unit")
        );
        assert!(
            parse_bytes("MiB")
                .unwrap_err()
                .to_string()
                .contains("not a number")
        );
        assert!(parse_bytes("0").is_err());
        assert_eq!(parse_bytes("18446744073709551615").unwrap(), u64::MAX);
    }

    #[test]
    fn negative_and_too_large_sizes_say_so() {
        for s in ["-5MiB", " -1", "-0.5GiB"] {
            let err = parse_bytes(s).unwrap_err().to_string();
            assert!(err.contains("negative"), "{s}: {err}");
        }
        for s in [
            "18446744073709551616",
            "99999999999999999999999",
            "16EiB",
            "20000000TiB",
        ] {
            let err = parse_bytes(s).unwrap_err().to_string();
            assert!(
                err.contains("out of range") || err.contains("unknown unit"),
                "{s}: {err}"
            );
        }
        assert!(
            parse_bytes("20000000TiB")
                .unwrap_err()
                .to_string()
                .contains("out of range")
        );
    }

    #[test]
    fn budget_and_bandwidth_errors_name_the_flags() {
        let err = |r: anyhow::Result<f64>| format!("{:#}", r.expect_err("an error"));
        assert!(err(parse_bandwidth("0.4")).starts_with("--bandwidth 0.4: "));
        let node = remat_planner::ir::Node {
            name: "a".into(),
            phase: remat_planner::ir::Phase::Forward,
            compute_time: 1.0,
            output_bytes: 10,
            inputs: vec![],
        };
        let g = Graph::new("g", vec![node], 0, 1.0).unwrap();
        assert_eq!(parse_budget("0.5", &g).unwrap(), 5);
        let text = format!("{:#}", parse_budget("1.5", &g).expect_err("above 1"));
        assert!(
            text.starts_with("--budget 1.5: a fraction must be in (0, 1]"),
            "{text}"
        );
    }
}
