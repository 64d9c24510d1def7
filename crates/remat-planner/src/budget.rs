//! Budgets, bandwidths and sizes as people write them: `8GiB`, `500MB`, `1e9`, `0.7` (a
//! fraction of the store-all peak), `32GB/s`; and bytes as people read them (`1.50 MiB`).
//!
//! Every front end (the `remat` binary, the Python package) parses through here, so that the
//! same text means the same bytes everywhere. Errors name the value and the flag or
//! argument it came from (`flag`: `--budget` for the binary, `budget` for Python).

use thiserror::Error;

use crate::ir::Graph;

/// Units a size may carry.
const UNITS: &str = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB";

/// A number or size that cannot be read.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SizeError {
    #[error(
        "`{text}` is not a number (expected digits with an optional decimal point and exponent, e.g. 0.7, 1234, 1e9)"
    )]
    NotANumber { text: String },
    #[error("`{text}` is negative")]
    Negative { text: String },
    #[error("`{text}` has too many digits")]
    TooManyDigits { text: String },
    #[error(
        "`{text}` is not a size: expected a number with an optional unit ({UNITS}), e.g. 8GiB or 1e9"
    )]
    NotASize { text: String },
    #[error("`{text}`: unknown unit `{unit}` (use {UNITS})")]
    UnknownUnit { text: String, unit: String },
    #[error("`{text}` is more than 2^64 - 1 bytes")]
    TooLarge { text: String },
}

/// A budget or bandwidth value that cannot be used; `flag` names where it came from.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ValueError {
    #[error("{flag}: an empty value (a stray comma?); give bytes (8GiB) or a fraction (0.7)")]
    EmptyBudget { flag: String },
    #[error("{flag} {text}: {error}")]
    Size {
        flag: String,
        text: String,
        error: SizeError,
    },
    #[error("{flag} {text}: too many digits")]
    FractionDigits { flag: String, text: String },
    #[error(
        "{flag} {text}: a fraction must be in (0, 1]; give bytes with a unit (8GiB) or an integer"
    )]
    FractionRange { flag: String, text: String },
    #[error(
        "{flag} {text}: {text} of the store-all peak ({}) is less than one byte",
        human_bytes(*store_all_peak)
    )]
    BelowOneByte {
        flag: String,
        text: String,
        store_all_peak: u64,
    },
    #[error("{flag} {text}: out of range")]
    OutOfRange { flag: String, text: String },
    #[error("{flag} {text}: comes to 0 bytes; a budget must be at least 1 byte")]
    ZeroBudget { flag: String, text: String },
    #[error("{flag}: an empty value; give bytes per second, e.g. 32GB/s")]
    EmptyBandwidth { flag: String },
    #[error(
        "{flag} {text}: comes to 0 bytes per second; the bandwidth is in bytes per second (32GB/s, 16GiB/s, 1e9) and must be at least 1 B/s"
    )]
    ZeroBandwidth { flag: String, text: String },
}

/// `0.7` (fraction of the store-all peak), `8GiB`, `500MB`, `1234`, `1e9` (bytes).
/// A plain number with a decimal point and no exponent is a fraction. Fractions are applied
/// exactly (decimal digits in integer arithmetic, rounded down), so `1.0` is exactly the
/// store-all peak whatever its size; a budget that comes to 0 bytes is an error.
pub fn parse_budget(text: &str, graph: &Graph, flag: &str) -> Result<u64, ValueError> {
    let t = text.trim();
    let owned = || (flag.to_string(), t.to_string());
    if t.is_empty() {
        return Err(ValueError::EmptyBudget { flag: flag.into() });
    }
    if is_fraction(t) {
        return fraction_of(t, graph.store_all_peak(), flag);
    }
    let bytes = parse_bytes(t).map_err(|error| {
        let (flag, text) = owned();
        ValueError::Size { flag, text, error }
    })?;
    if bytes == 0 {
        let (flag, text) = owned();
        return Err(ValueError::ZeroBudget { flag, text });
    }
    Ok(bytes)
}

/// A plain decimal with a point and no exponent (`0.7`, `.5`, `1.0`): read as a fraction.
fn is_fraction(t: &str) -> bool {
    t.contains('.') && !t.contains(['e', 'E']) && t.chars().all(|c| c.is_ascii_digit() || c == '.')
}

/// `t` (a fraction in (0, 1]) of `peak`, rounded down, at least one byte.
fn fraction_of(t: &str, peak: u64, flag: &str) -> Result<u64, ValueError> {
    let owned = || (flag.to_string(), t.to_string());
    let fraction = Decimal::parse(t).map_err(|error| {
        let (flag, text) = owned();
        ValueError::Size { flag, text, error }
    })?;
    // digits * 10^exp with exp <= 0 here (a decimal point and no exponent).
    let digits_error = || {
        let (flag, text) = owned();
        ValueError::FractionDigits { flag, text }
    };
    let denominator = pow10(fraction.exp.unsigned_abs()).ok_or_else(digits_error)?;
    if fraction.digits == 0 || fraction.digits > denominator {
        let (flag, text) = owned();
        return Err(ValueError::FractionRange { flag, text });
    }
    let bytes = u128::from(peak)
        .checked_mul(fraction.digits)
        .map(|p| p / denominator)
        .ok_or_else(digits_error)?;
    if bytes == 0 {
        let (flag, text) = owned();
        return Err(ValueError::BelowOneByte {
            flag,
            text,
            store_all_peak: peak,
        });
    }
    u64::try_from(bytes).map_err(|_| {
        let (flag, text) = owned();
        ValueError::OutOfRange { flag, text }
    })
}

/// `32GB/s`, `16GiB/s`, `1e9`: bytes per second.
pub fn parse_bandwidth(text: &str, flag: &str) -> Result<f64, ValueError> {
    let t = text.trim().trim_end_matches("/s");
    if t.trim().is_empty() {
        return Err(ValueError::EmptyBandwidth { flag: flag.into() });
    }
    let bytes = parse_bytes(t).map_err(|error| ValueError::Size {
        flag: flag.into(),
        text: text.into(),
        error,
    })?;
    if bytes == 0 {
        return Err(ValueError::ZeroBandwidth {
            flag: flag.into(),
            text: text.into(),
        });
    }
    Ok(bytes as f64)
}

/// A non-negative decimal `digits * 10^exp`, read exactly.
#[derive(Debug, PartialEq)]
struct Decimal {
    digits: u128,
    exp: i32,
}

impl Decimal {
    /// `123`, `1.5`, `.5`, `1e9`, `2.5E-3`: digits, an optional point, an optional exponent.
    fn parse(text: &str) -> Result<Decimal, SizeError> {
        let not_a_number = || SizeError::NotANumber { text: text.into() };
        if text.starts_with('-') {
            return Err(SizeError::Negative { text: text.into() });
        }
        let (mantissa, exponent) = match text.find(['e', 'E']) {
            Some(i) => (&text[..i], Some(&text[i + 1..])),
            None => (text, None),
        };
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all_digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
        if whole.is_empty() && fraction.is_empty() || !all_digits(whole) || !all_digits(fraction) {
            return Err(not_a_number());
        }
        let mut exp: i32 = match exponent {
            None => 0,
            Some(e) => {
                let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
                if digits.is_empty() || !all_digits(digits) || digits.len() > 4 {
                    return Err(not_a_number());
                }
                e.parse().map_err(|_| not_a_number())?
            }
        };
        // Trailing zeros of the fraction carry no value; dropping them keeps `1.000...0`
        // exact however many zeros it has.
        let fraction = fraction.trim_end_matches('0');
        let mut digits: u128 = 0;
        for c in whole.chars().chain(fraction.chars()) {
            digits = digits
                .checked_mul(10)
                .and_then(|d| d.checked_add(u128::from(c as u8 - b'0')))
                .ok_or_else(|| SizeError::TooManyDigits { text: text.into() })?;
        }
        exp -= i32::try_from(fraction.len()).unwrap_or(i32::MAX);
        Ok(Decimal { digits, exp })
    }

    /// `self * scale`, rounded to the nearest integer (halves up); `None` above u64::MAX.
    fn times(&self, scale: u128) -> Option<u64> {
        let value = self.digits.checked_mul(scale)?;
        let rounded = if self.digits == 0 {
            0
        } else if self.exp >= 0 {
            value.checked_mul(pow10(self.exp.unsigned_abs())?)?
        } else {
            match pow10(self.exp.unsigned_abs()) {
                Some(d) => value / d + u128::from(value % d >= d.div_ceil(2)),
                // A divisor above 10^38 makes any representable value round to 0.
                None => 0,
            }
        };
        u64::try_from(rounded).ok()
    }
}

fn pow10(exp: u32) -> Option<u128> {
    10u128.checked_pow(exp)
}

/// A number (scientific notation allowed) followed by an optional unit: the unit is the
/// trailing run of letters, so the `e` of `1e9` stays in the number. Exact: the number is
/// read as a decimal and scaled in integers, then rounded to whole bytes.
pub fn parse_bytes(text: &str) -> Result<u64, SizeError> {
    let split = text
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_alphabetic())
        .last()
        .map_or(text.len(), |(i, _)| i);
    let (number, unit) = text.split_at(split);
    let number = number.trim();
    if number.is_empty() {
        return Err(SizeError::NotASize { text: text.into() });
    }
    let scale: u128 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(SizeError::UnknownUnit {
                text: text.into(),
                unit: other.into(),
            });
        }
    };
    Decimal::parse(number)?
        .times(scale)
        .ok_or_else(|| SizeError::TooLarge { text: text.into() })
}

/// Bytes in the largest binary unit that keeps a number of at least one (`1.50 MiB`).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_units_and_scientific_notation() {
        assert_eq!(parse_bytes("1e9").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("1.5e3MB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bandwidth("32GB/s", "--bandwidth").unwrap(), 32e9);
        assert_eq!(parse_bandwidth("1e9", "--bandwidth").unwrap(), 1e9);
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("1e30").is_err());
    }

    fn err<T: std::fmt::Debug, E: std::fmt::Display>(r: Result<T, E>) -> String {
        r.expect_err("an error").to_string()
    }

    #[test]
    fn words_and_empty_values_are_named_as_not_numbers() {
        for bad in ["abc", "NaN", "inf", "x1"] {
            let text = err(parse_bytes(bad));
            assert!(
                text.contains(&format!("`{bad}` is not a")) && !text.contains("empty string"),
                "{bad}: {text}"
            );
        }
        assert!(err(parse_bandwidth("abc", "--bandwidth")).contains("`abc` is not a size"));
        assert!(err(parse_bandwidth("", "--bandwidth")).contains("empty value"));
        assert!(err(parse_bytes("-5")).contains("negative"));
        assert!(err(parse_bytes("3 parsecs")).contains("unknown unit `parsecs`"));
    }

    #[test]
    fn errors_name_the_flag_they_are_given() {
        let g = huge_graph(1000);
        assert_eq!(
            err(parse_budget("7x", &g, "budget")),
            "budget 7x: `7x`: unknown unit `x` (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        );
        assert!(err(parse_budget("1.5", &g, "--budget")).starts_with("--budget 1.5: "));
        assert!(err(parse_bandwidth("0", "bandwidth")).starts_with("bandwidth 0: "));
    }

    #[test]
    fn sizes_are_exact_up_to_u64_max() {
        assert_eq!(parse_bytes("18446744073709551615").unwrap(), u64::MAX);
        assert!(err(parse_bytes("18446744073709551616")).contains("2^64 - 1"));
        assert_eq!(parse_bytes("0.5KiB").unwrap(), 512);
        assert_eq!(parse_bytes("2.5").unwrap(), 3);
        assert_eq!(parse_bytes("1e-5").unwrap(), 0);
        assert_eq!(parse_bytes("1.25e2").unwrap(), 125);
    }

    #[test]
    fn bandwidth_below_one_byte_per_second_says_the_unit() {
        let text = err(parse_bandwidth("0.4", "--bandwidth"));
        assert!(
            text.contains("bytes per second") && text.contains("1 B/s"),
            "{text}"
        );
    }

    fn huge_graph(bytes: u64) -> Graph {
        let node = crate::ir::Node {
            name: "a".into(),
            phase: crate::ir::Phase::Forward,
            compute_time: 1.0,
            output_bytes: bytes,
            inputs: vec![],
        };
        Graph::new("g", vec![node], 0, 1.0).unwrap()
    }

    #[test]
    fn fraction_budgets_are_exact_on_huge_graphs() {
        // 2^63 + 2^62 + 5 has no exact f64: 1.0 must still be exactly store-all.
        let peak = (1u64 << 63) + (1u64 << 62) + 5;
        let g = huge_graph(peak);
        let budget = |t: &str| parse_budget(t, &g, "--budget");
        assert_eq!(budget("1.0").unwrap(), peak);
        assert_eq!(budget("1.000000000000000000000000").unwrap(), peak);
        assert_eq!(budget("0.5").unwrap(), peak / 2);
        assert!(err(budget("1.5")).contains("(0, 1]"));
    }

    #[test]
    fn budgets_that_round_to_zero_bytes_are_errors() {
        let g = huge_graph(1000);
        let budget = |t: &str| parse_budget(t, &g, "--budget");
        assert!(err(budget("1e-5")).contains("0 bytes"));
        assert!(err(budget("0.00000000001")).contains("less than one byte"));
        assert!(err(budget("")).contains("empty value"));
        assert!(err(budget("0")).contains("0 bytes"));
    }

    #[test]
    fn human_bytes_picks_the_largest_unit_with_a_whole_number() {
        assert_eq!(human_bytes(1000), "1000 B");
        assert_eq!(human_bytes(3 << 19), "1.50 MiB");
        assert_eq!(human_bytes(8 << 30), "8.00 GiB");
    }
}
