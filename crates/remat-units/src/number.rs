//! Decimal numbers read exactly: digits, an optional point, an optional exponent, scaled
//! and rounded in integers (a float would round `18446744073709551616`, one past
//! `u64::MAX`, down into range).

use crate::error::Problem;

/// A non-negative decimal `digits * 10^exp`, read exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decimal {
    pub digits: u128,
    pub exp: i32,
}

impl Decimal {
    /// `123`, `1.5`, `.5`, `1e9`, `2.5E-3`, `1_000_000` (`_` only between digits).
    pub fn parse(text: &str) -> Result<Decimal, Problem> {
        if text.starts_with('-') {
            return Err(Problem::Negative);
        }
        let text = without_digit_separators(text).ok_or(Problem::NotANumber)?;
        let (mantissa, exponent) = match text.find(['e', 'E']) {
            Some(i) => (&text[..i], Some(&text[i + 1..])),
            None => (text.as_str(), None),
        };
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all_digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
        if whole.is_empty() && fraction.is_empty() || !all_digits(whole) || !all_digits(fraction) {
            return Err(Problem::NotANumber);
        }
        let mut exp: i32 = match exponent {
            None => 0,
            Some(e) => {
                let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
                if digits.is_empty() || !all_digits(digits) || digits.len() > 4 {
                    return Err(Problem::NotANumber);
                }
                e.parse().map_err(|_| Problem::NotANumber)?
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
                .ok_or(Problem::TooManyDigits)?;
        }
        // At most a few dozen digits fit u128, so the length fits i32.
        exp -= i32::try_from(fraction.len()).map_err(|_| Problem::TooManyDigits)?;
        Ok(Decimal { digits, exp })
    }

    /// `self * scale`, rounded to the nearest integer (halves up); `None` above u64::MAX.
    pub fn times(&self, scale: u128) -> Option<u64> {
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

pub(crate) fn pow10(exp: u32) -> Option<u128> {
    10u128.checked_pow(exp)
}

/// `text` without the `_` that group digits (`1_048_576`); `None` where an `_` does not
/// stand between two digits.
fn without_digit_separators(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'_' {
            let before = i.checked_sub(1).map(|j| bytes[j]);
            let after = bytes.get(i + 1).copied();
            if !(before.is_some_and(|c| c.is_ascii_digit())
                && after.is_some_and(|c| c.is_ascii_digit()))
            {
                return None;
            }
        }
    }
    Some(text.replace('_', ""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Decimal, Problem> {
        Decimal::parse(text)
    }

    #[test]
    fn decimals_are_digits_a_point_and_an_exponent() {
        assert_eq!(
            read("1.50").unwrap(),
            Decimal {
                digits: 15,
                exp: -1
            }
        );
        assert_eq!(read(".5").unwrap(), Decimal { digits: 5, exp: -1 });
        assert_eq!(
            read("2.5E-3").unwrap(),
            Decimal {
                digits: 25,
                exp: -4
            }
        );
        assert_eq!(read("1e9").unwrap(), Decimal { digits: 1, exp: 9 });
        assert_eq!(
            read("1_048_576").unwrap(),
            Decimal {
                digits: 1_048_576,
                exp: 0
            }
        );
    }

    #[test]
    fn words_signs_and_stray_separators_are_not_numbers() {
        for bad in [
            "", ".", "e9", "1e", "1e+", "x1", "+5", "1__0", "_1", "1_", "1_.5", "1e99999",
        ] {
            assert_eq!(read(bad), Err(Problem::NotANumber), "{bad}");
        }
        assert_eq!(read("-5"), Err(Problem::Negative));
        assert_eq!(read(&"9".repeat(40)), Err(Problem::TooManyDigits));
    }

    #[test]
    fn scaling_rounds_halves_up_and_stops_at_u64_max() {
        let times = |t: &str, scale| read(t).unwrap().times(scale);
        assert_eq!(times("2.5", 1), Some(3));
        assert_eq!(times("2.49", 1), Some(2));
        assert_eq!(times("0.5", 1024), Some(512));
        assert_eq!(times("1e-5", 1), Some(0));
        assert_eq!(times("1e-60", 1), Some(0));
        assert_eq!(times("18446744073709551615", 1), Some(u64::MAX));
        assert_eq!(times("18446744073709551616", 1), None);
        assert_eq!(times("16", 1 << 60), None);
    }
}
