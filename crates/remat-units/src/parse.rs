//! The one parser: sizes, budgets and bandwidths (the meaning is in the crate docs).

use crate::error::{Kind, MIN_STEP_BUDGET, Problem, UnitError};
use crate::number::{Decimal, pow10};

/// Bytes per unit, by the unit's lower-case spelling (units are read in any case).
fn unit_scale(unit: &str) -> Option<u128> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    })
}

/// Bytes of a size: a number (point and exponent allowed) and an optional unit, rounded to
/// the nearest whole byte. The unit is the trailing run of letters, so the `e` of `1e9`
/// stays in the number.
fn bytes_of(text: &str) -> Result<u64, Problem> {
    let split = text
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_alphabetic())
        .last()
        .map_or(text.len(), |(i, _)| i);
    let (number, unit) = text.split_at(split);
    let number = number.trim();
    if number.is_empty() {
        return Err(Problem::NotASize);
    }
    // The number first: `-5MiB` is negative before anything else.
    let number = Decimal::parse(number)?;
    let scale = unit_scale(unit).ok_or_else(|| Problem::UnknownUnit(unit.to_string()))?;
    number.times(scale).ok_or(Problem::TooLarge)
}

/// A size in bytes, 0 allowed: `256MiB`, `1.5GB`, `1e9`, `4096`. Errors name `field`.
pub fn parse_size(text: &str, field: &str) -> Result<u64, UnitError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(UnitError::new(field, t, Problem::Empty(Kind::Size)));
    }
    bytes_of(t).map_err(|problem| UnitError::new(field, t, problem))
}

/// A size of at least one byte, where 0 bytes would do nothing (`remat reshard
/// --max-buffer`: a buffer of 0 bytes holds no data to copy). Errors name `field`.
pub fn parse_nonzero_size(text: &str, field: &str) -> Result<u64, UnitError> {
    match parse_size(text, field)? {
        0 => Err(UnitError::new(field, text, Problem::ZeroSize)),
        bytes => Ok(bytes),
    }
}

/// A whole number of at least `min` (`--world-size 3`, `--steps 800`; `1_000` allowed):
/// where 0 would do nothing, `min` is 1. Errors name `field`.
pub fn parse_count(text: &str, field: &str, min: u64) -> Result<u64, UnitError> {
    let t = text.trim();
    let error = |problem| UnitError::new(field, t, problem);
    if t.is_empty() {
        return Err(error(Problem::Empty(Kind::Count)));
    }
    if t.starts_with('-') {
        return Err(error(Problem::NegativeOf(Kind::Count)));
    }
    let digits = t.replace('_', "");
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) || t.contains("__") {
        return Err(error(Problem::NotAWholeNumber(Kind::Count)));
    }
    let n: u64 = digits.parse().map_err(|_| error(Problem::OutOfRange))?;
    if n < min {
        return Err(error(Problem::TooFew(min)));
    }
    Ok(n)
}

/// A number of seconds above 0 and at most `max` (`--time-limit 0.5`, `1e3`). Errors
/// name `field`.
pub fn parse_seconds(text: &str, field: &str, max: u64) -> Result<f64, UnitError> {
    let t = text.trim();
    let error = |problem| UnitError::new(field, t, problem);
    if t.is_empty() {
        return Err(error(Problem::Empty(Kind::Seconds)));
    }
    if t.starts_with('-') {
        return Err(error(Problem::NegativeOf(Kind::Seconds)));
    }
    // Digits, a point and an exponent only: Rust would read `inf` and `NaN` too.
    if !t
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'))
    {
        return Err(error(Problem::NotANumber));
    }
    let seconds: f64 = t.parse().map_err(|_| error(Problem::NotANumber))?;
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= max as f64) {
        return Err(error(Problem::SecondsRange(max)));
    }
    Ok(seconds)
}

/// Bytes per second, at least 1: `32GB/s`, `16GiB/s`, `1e9` (the `/s` optional).
pub fn parse_bandwidth(text: &str, field: &str) -> Result<f64, UnitError> {
    let t = text.trim();
    let error = |problem| UnitError::new(field, t, problem);
    let size = t.strip_suffix("/s").or_else(|| t.strip_suffix("/S"));
    let size = size.unwrap_or(t).trim();
    if size.is_empty() {
        return Err(error(Problem::Empty(Kind::Bandwidth)));
    }
    match bytes_of(size).map_err(error)? {
        0 => Err(error(Problem::ZeroBandwidth)),
        bytes => Ok(bytes as f64),
    }
}

/// A budget as written: bytes, or a fraction of a reference peak not known yet.
/// [`Budget::of`] resolves it against the peak; [`Budget::bytes`] where there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    field: String,
    text: String,
    amount: Amount,
}

/// What a budget's text says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amount {
    /// At least one byte.
    Bytes(u64),
    /// `numerator / denominator` in (0, 1], read exactly (`denominator` a power of ten of
    /// at most 10^19, so `peak * numerator` fits u128).
    Fraction { numerator: u64, denominator: u64 },
}

/// `0.7` (a fraction of a reference peak), `8GiB`, `500MB`, `1234`, `1e9` (bytes). A plain
/// number with a decimal point and no exponent or unit is a fraction; one that comes to 0
/// bytes is an error. Errors name `field`.
pub fn parse_budget(text: &str, field: &str) -> Result<Budget, UnitError> {
    let t = text.trim();
    let error = |problem| UnitError::new(field, t, problem);
    if t.is_empty() {
        return Err(error(Problem::Empty(Kind::Budget)));
    }
    let amount = if is_fraction(t) {
        fraction(t).map_err(error)?
    } else {
        match bytes_of(t).map_err(error)? {
            0 => return Err(error(Problem::ZeroBudget)),
            bytes => Amount::Bytes(bytes),
        }
    };
    Ok(Budget {
        field: field.to_string(),
        text: t.to_string(),
        amount,
    })
}

/// A plain decimal with a point and no exponent (`0.7`, `.5`, `1.0`): read as a fraction.
fn is_fraction(t: &str) -> bool {
    t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.')
}

/// `t` as an exact fraction in (0, 1].
fn fraction(t: &str) -> Result<Amount, Problem> {
    let decimal = Decimal::parse(t)?;
    // A point and no exponent: exp <= 0, one digit of the denominator per digit after
    // the point (trailing zeros dropped).
    let places = decimal.exp.unsigned_abs();
    let denominator = pow10(places)
        .and_then(|d| u64::try_from(d).ok())
        .ok_or(Problem::FractionDigits)?;
    let numerator = u64::try_from(decimal.digits).map_err(|_| Problem::FractionRange)?;
    if numerator == 0 || numerator > denominator {
        return Err(Problem::FractionRange);
    }
    Ok(Amount::Fraction {
        numerator,
        denominator,
    })
}

impl Budget {
    /// The flag or field the budget was given with.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The text as given, trimmed.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn amount(&self) -> Amount {
        self.amount
    }

    /// Refuses what no training step fits, before the step is known: a budget in bytes
    /// under [`MIN_STEP_BUDGET`] (`memory_budget=1` meant a fraction or a size). A
    /// fraction passes: it is checked against its reference by [`Budget::of`].
    pub fn check_step(&self) -> Result<(), UnitError> {
        match self.amount {
            Amount::Bytes(bytes) if bytes < MIN_STEP_BUDGET => {
                Err(self.error(Problem::TinyBudget(bytes)))
            }
            _ => Ok(()),
        }
    }

    /// Bytes of the budget, a fraction taken of `reference_bytes` (rounded down, so `1.0`
    /// is exactly the reference); `reference` names it in errors ("the store-all peak").
    /// A budget in bytes under [`MIN_STEP_BUDGET`] is refused ([`Budget::check_step`])
    /// unless the reference itself is that small: a small synthetic graph given to the
    /// planner is planned at any budget in bytes.
    pub fn of(&self, reference_bytes: u64, reference: &str) -> Result<u64, UnitError> {
        match self.amount {
            Amount::Bytes(bytes) => {
                if reference_bytes >= MIN_STEP_BUDGET {
                    self.check_step()?;
                }
                Ok(bytes)
            }
            Amount::Fraction {
                numerator,
                denominator,
            } => {
                let bytes =
                    u128::from(reference_bytes) * u128::from(numerator) / u128::from(denominator);
                match u64::try_from(bytes) {
                    Ok(0) => Err(self.error(Problem::BelowOneByte {
                        fraction: self.text.clone(),
                        reference: reference.to_string(),
                        reference_bytes,
                    })),
                    Ok(bytes) => Ok(bytes),
                    // numerator <= denominator: never above the reference.
                    Err(_) => Err(self.error(Problem::TooLarge)),
                }
            }
        }
    }

    /// Bytes of the budget where no reference peak exists; `why` says so for a fraction
    /// ("`remat train` has none before it runs").
    /// A budget in bytes under [`MIN_STEP_BUDGET`] is refused ([`Budget::check_step`]).
    pub fn bytes(&self, why: &str) -> Result<u64, UnitError> {
        match self.amount {
            Amount::Bytes(bytes) => self.check_step().map(|()| bytes),
            Amount::Fraction { .. } => Err(self.error(Problem::NoReference(why.to_string()))),
        }
    }

    fn error(&self, problem: Problem) -> UnitError {
        UnitError::new(&self.field, &self.text, problem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(t: &str) -> Result<u64, UnitError> {
        parse_size(t, "--size")
    }

    fn err<T: std::fmt::Debug>(r: Result<T, UnitError>) -> String {
        r.expect_err("an error").to_string()
    }

    #[test]
    fn decimal_units_are_powers_of_1000_and_binary_units_of_1024() {
        assert_eq!(size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(size("1GiB").unwrap(), 1 << 30);
        assert_eq!(size("3kB").unwrap(), 3_000);
        assert_eq!(size("3KB").unwrap(), 3_000);
        assert_eq!(size("3k").unwrap(), 3_000);
        assert_eq!(size("3G").unwrap(), 3_000_000_000);
        assert_eq!(size("2TB").unwrap(), 2_000_000_000_000);
        assert_eq!(size("2TiB").unwrap(), 2 << 40);
        assert_eq!(size("256MiB").unwrap(), 256 << 20);
        assert_eq!(size("5MB").unwrap(), 5_000_000);
        assert_eq!(size("4096").unwrap(), 4096);
        assert_eq!(size("4096B").unwrap(), 4096);
        assert_eq!(size("0").unwrap(), 0);
    }

    #[test]
    fn units_are_read_in_any_case_with_spaces_around_them() {
        for (a, b) in [
            ("gb", "GB"),
            ("Gb", "GB"),
            ("gib", "GiB"),
            ("GIB", "GiB"),
            ("kib", "KiB"),
            ("mb", "MB"),
            ("b", "B"),
        ] {
            assert_eq!(size(&format!("7{a}")), size(&format!("7{b}")), "{a}");
        }
        assert_eq!(size(" 1.5 kb ").unwrap(), 1500);
    }

    #[test]
    fn decimals_and_exponents_round_to_whole_bytes() {
        assert_eq!(size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(size("1.5e3MB").unwrap(), 1_500_000_000);
        assert_eq!(size("0.5KiB").unwrap(), 512);
        assert_eq!(size("2.5").unwrap(), 3);
        assert_eq!(size("1e-5").unwrap(), 0);
        assert_eq!(size("1_048_576").unwrap(), 1 << 20);
        assert_eq!(size("18446744073709551615").unwrap(), u64::MAX);
    }

    #[test]
    fn bad_sizes_say_what_is_wrong_and_name_the_field() {
        assert_eq!(
            err(size("7x")),
            "--size 7x: unknown unit `x` (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, in any case)"
        );
        assert!(err(size("lots")).starts_with("--size lots: not a size"));
        assert!(err(size("MiB")).contains("not a size"));
        assert!(err(size("x1")).contains("--size x1: not a number"));
        assert!(err(size("-5MiB")).contains("negative"));
        assert!(err(size("16EiB")).contains("unknown unit `EiB`"));
        assert!(err(size("18446744073709551616")).contains("out of range: more than 2^64 - 1"));
        assert!(err(size("20000000TiB")).contains("out of range"));
        assert!(err(size("  ")).starts_with("--size: an empty value; give bytes"));
        assert!(err(size("1e30")).contains("out of range"));
    }

    #[test]
    fn bandwidths_are_sizes_per_second_of_at_least_one_byte() {
        let bw = |t: &str| parse_bandwidth(t, "--bandwidth");
        assert_eq!(bw("32GB/s").unwrap(), 32e9);
        assert_eq!(bw("16GiB/s").unwrap(), (16u64 << 30) as f64);
        assert_eq!(bw("1e9").unwrap(), 1e9);
        assert_eq!(bw("32 gb/S").unwrap(), 32e9);
        let text = err(bw("0.4"));
        assert!(text.starts_with("--bandwidth 0.4: comes to 0 bytes per second"));
        assert!(text.contains("1 B/s"), "{text}");
        assert!(err(bw("/s")).contains("--bandwidth /s: an empty value; give bytes per second"));
        assert!(err(bw("")).starts_with("--bandwidth: an empty value"));
        assert!(err(bw("fast")).starts_with("--bandwidth fast: not a size"));
    }

    fn budget(t: &str) -> Result<Budget, UnitError> {
        parse_budget(t, "--budget")
    }

    #[test]
    fn fraction_budgets_are_exact_on_huge_peaks() {
        // 2^63 + 2^62 + 5 has no exact f64: 1.0 must still be exactly the peak.
        let peak = (1u64 << 63) + (1u64 << 62) + 5;
        let of = |t: &str| budget(t).and_then(|b| b.of(peak, "the store-all peak"));
        assert_eq!(of("1.0").unwrap(), peak);
        assert_eq!(of("1.000000000000000000000000").unwrap(), peak);
        assert_eq!(of(".5").unwrap(), peak / 2);
        assert_eq!(of("0.9999999999999999999").unwrap(), peak - 2);
        assert_eq!(of("8GiB").unwrap(), 8 << 30);
        assert!(err(of("0.123456789012345678901")).contains("at most 19 digits"));
    }

    #[test]
    fn bad_budgets_say_what_is_wrong() {
        let of = |t: &str| budget(t).and_then(|b| b.of(1000, "the store-all peak"));
        assert!(err(of("1.5")).starts_with("--budget 1.5: a fraction must be in (0, 1]"));
        assert!(err(of("0.0")).contains("(0, 1]"));
        assert!(err(of("1e-5")).contains("comes to 0 bytes"));
        assert!(err(of("0")).contains("comes to 0 bytes"));
        // A small reference (a synthetic graph of 1000 B): any budget in bytes is meant.
        assert_eq!(of("45"), Ok(45));
        assert_eq!(
            err(of("0.00000000001")),
            "--budget 0.00000000001: 0.00000000001 of the store-all peak (1000 B) is less than one byte"
        );
        assert!(err(of("")).starts_with("--budget: an empty value"));
        assert!(err(of("-3")).contains("is negative"));
        assert!(err(of("1.5.5")).contains("not a number"));
    }

    #[test]
    fn a_budget_in_bytes_under_a_kib_is_a_slip_where_a_step_is_budgeted() {
        let tiny = "--budget 1: 1 byte cannot hold a training step (a budget in bytes is at least 1 KiB); did you mean a fraction (1.0) or a size (1GiB)?";
        assert_eq!(
            err(budget("1").and_then(|b| b.of(1 << 30, "the peak"))),
            tiny
        );
        assert_eq!(err(budget("1").and_then(|b| b.bytes("none"))), tiny);
        assert_eq!(err(budget("1").and_then(|b| b.check_step())), tiny);
        assert!(err(budget("1023B").and_then(|b| b.check_step())).contains("1023 bytes cannot"));
        assert_eq!(budget("1KiB").unwrap().bytes("none"), Ok(1024));
        assert_eq!(budget("0.5").unwrap().check_step(), Ok(()));
        assert_eq!(
            err(budget("0")),
            "--budget 0: comes to 0 bytes, which holds nothing; give a size (8GiB) or a fraction (0.5)"
        );
    }

    #[test]
    fn counts_are_whole_numbers_of_at_least_their_minimum() {
        let count = |t: &str| parse_count(t, "--world-size", 1);
        assert_eq!(count("3"), Ok(3));
        assert_eq!(count(" 1_000 "), Ok(1000));
        assert_eq!(err(count("0")), "--world-size 0: must be at least 1");
        assert_eq!(
            err(count("-1")),
            "--world-size -1: the value is negative; give a whole number, e.g. 4"
        );
        assert_eq!(
            err(count("2.5")),
            "--world-size 2.5: not a whole number; give a whole number, e.g. 4"
        );
        assert!(err(count("")).starts_with("--world-size: an empty value"));
        assert!(err(count("99999999999999999999")).contains("out of range"));
        assert_eq!(parse_count("0", "--seed", 0), Ok(0));
    }

    #[test]
    fn seconds_are_above_zero_and_finite() {
        let secs = |t: &str| parse_seconds(t, "--time-limit", 1_000_000);
        assert_eq!(secs("0.5"), Ok(0.5));
        assert_eq!(secs("1e3"), Ok(1000.0));
        for bad in ["0", "0.0", "1e7"] {
            assert_eq!(
                err(secs(bad)),
                format!("--time-limit {bad}: must be more than 0 seconds and at most 1000000")
            );
        }
        assert!(err(secs("-1")).contains("negative; give a number of seconds"));
        assert!(err(secs("inf")).contains("not a number"));
        assert!(err(secs("NaN")).contains("not a number"));
    }

    #[test]
    fn a_nonzero_size_refuses_zero_bytes() {
        assert_eq!(parse_nonzero_size("1", "--max-buffer"), Ok(1));
        assert_eq!(
            err(parse_nonzero_size("0", "--max-buffer")),
            "--max-buffer 0: comes to 0 bytes, which holds nothing; give at least 1 byte, e.g. 256MiB"
        );
        assert!(err(parse_nonzero_size("-1", "--max-buffer")).contains("negative"));
    }

    #[test]
    fn a_fraction_without_a_reference_says_so() {
        let why = "`remat train` measures none before it runs";
        assert_eq!(budget("256MiB").unwrap().bytes(why).unwrap(), 256 << 20);
        assert_eq!(
            err(budget("0.5").unwrap().bytes(why)),
            "--budget 0.5: a fraction needs a reference peak, and `remat train` measures none before it runs; give bytes with a unit, e.g. 256MiB"
        );
    }
}
