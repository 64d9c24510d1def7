//! The one printer: bytes for people (`1.50 MiB`), bytes for the parser (`1536KiB`), and
//! bandwidths (`32.00 GB/s`).

/// Bytes in the largest binary unit that keeps a number of at least one, two decimals
/// (`1.50 MiB`, `8.00 GiB`); below 1 KiB the whole bytes (`1000 B`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// [`human_bytes`], with the exact count beside it where the two decimals round it
/// (`613.28 MiB (643072123 bytes)`, `256.00 MiB`, `1000 B`): for the sizes a reader copies
/// into a budget (a floor, a least peak), where a rounded figure one byte off is the
/// difference between fitting and not.
pub fn human_bytes_exact(bytes: u64) -> String {
    let human = human_bytes(bytes);
    let scale = [1u64 << 40, 1 << 30, 1 << 20, 1 << 10]
        .into_iter()
        .find(|scale| bytes >= *scale);
    match scale {
        Some(scale) if !bytes.is_multiple_of(scale) => format!("{human} ({bytes} bytes)"),
        _ => human,
    }
}

/// Exact units, largest first: the first that divides a count gives the smallest number.
const EXACT: [(&str, u64); 8] = [
    ("TiB", 1 << 40),
    ("TB", 1_000_000_000_000),
    ("GiB", 1 << 30),
    ("GB", 1_000_000_000),
    ("MiB", 1 << 20),
    ("MB", 1_000_000),
    ("KiB", 1 << 10),
    ("kB", 1_000),
];

/// Bytes as text that [`crate::parse_size`] reads back to the same count: a whole number
/// of the largest unit that divides it (`256MiB`, `3kB`), else plain bytes (`1537`).
pub fn exact_bytes(bytes: u64) -> String {
    EXACT
        .iter()
        .find(|(_, scale)| bytes != 0 && bytes.is_multiple_of(*scale))
        .map_or_else(
            || bytes.to_string(),
            |(unit, scale)| format!("{}{unit}", bytes / scale),
        )
}

/// Bytes per second in the largest decimal unit that keeps a number of at least one, two
/// decimals (`32.00 GB/s`, as `--bandwidth 32GB/s` is written); below 1 kB/s the whole
/// bytes (`512 B/s`).
pub fn human_bandwidth(bytes_per_second: f64) -> String {
    const UNITS: [&str; 5] = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    if !(bytes_per_second.is_finite() && bytes_per_second >= 0.0) {
        return format!("{bytes_per_second} B/s");
    }
    let mut value = bytes_per_second;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B/s")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_exact_adds_the_count_only_where_the_figure_is_rounded() {
        assert_eq!(human_bytes_exact(1000), "1000 B");
        assert_eq!(human_bytes_exact(256 << 20), "256.00 MiB");
        assert_eq!(human_bytes_exact(3123), "3.05 KiB (3123 bytes)");
        assert_eq!(
            human_bytes_exact((613 << 20) - 1),
            "613.00 MiB (642777087 bytes)"
        );
    }

    #[test]
    fn human_bytes_picks_the_largest_binary_unit_with_a_whole_number() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1000), "1000 B");
        assert_eq!(human_bytes(1024), "1.00 KiB");
        assert_eq!(human_bytes(3 << 19), "1.50 MiB");
        assert_eq!(human_bytes(8 << 30), "8.00 GiB");
        assert_eq!(human_bytes(5 << 40), "5.00 TiB");
        assert_eq!(human_bytes(u64::MAX), "16777216.00 TiB");
    }

    #[test]
    fn exact_bytes_takes_the_largest_unit_that_divides() {
        assert_eq!(exact_bytes(0), "0");
        assert_eq!(exact_bytes(1537), "1537");
        assert_eq!(exact_bytes(3000), "3kB");
        assert_eq!(exact_bytes(64 << 10), "64KiB");
        assert_eq!(exact_bytes(256 << 20), "256MiB");
        assert_eq!(exact_bytes(1 << 40), "1TiB");
        assert_eq!(exact_bytes(2_000_000_000_000), "2TB");
        assert_eq!(exact_bytes(1536), "1536");
    }

    #[test]
    fn bandwidths_print_in_decimal_units_per_second() {
        assert_eq!(human_bandwidth(32e9), "32.00 GB/s");
        assert_eq!(human_bandwidth(1.5e6), "1.50 MB/s");
        assert_eq!(human_bandwidth(512.0), "512 B/s");
        assert_eq!(human_bandwidth(f64::INFINITY), "inf B/s");
    }
}
