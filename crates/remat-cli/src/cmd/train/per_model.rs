//! Flags that take one value for every model or a comma list of one value per model
//! (`--lr 3e-3,1e-3`, `--seed 0,1`, `--dropout 0.1`, `--d-model 64,32`).

use std::fmt;

/// One value for all models, or one per model (never empty: the parser refuses that).
#[derive(Clone, Debug, PartialEq)]
pub struct PerModel<T> {
    values: Vec<T>,
}

impl<T: Clone + fmt::Display> PerModel<T> {
    /// The value of a single-model run (the first; single-model runs refuse lists first,
    /// see [`PerModel::check_single`]).
    pub fn one(&self) -> T {
        self.values[0].clone()
    }

    /// The values of `models` models: one value repeated, or exactly `models` values.
    pub fn for_models(&self, models: usize, flag: &str) -> anyhow::Result<Vec<T>> {
        match self.values.len() {
            1 => Ok(vec![self.values[0].clone(); models]),
            n if n == models => Ok(self.values.clone()),
            n => anyhow::bail!(
                "{flag} has {n} values ({}) but --models is {models}: give one value for every \
                 model or exactly {models}, separated by commas",
                self.joined()
            ),
        }
    }

    /// A single-model run takes one value: a list is an error naming the flag.
    pub fn check_single(&self, flag: &str) -> anyhow::Result<()> {
        if self.values.len() > 1 {
            anyhow::bail!(
                "{flag} has {} values ({}): a list gives one value per model and needs \
                 --models {}",
                self.values.len(),
                self.joined(),
                self.values.len()
            );
        }
        Ok(())
    }

    fn joined(&self) -> String {
        self.values
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Parses `a` or `a,b,c` with `one` for each value; in a list, the error names the bad
/// value and its place (one value is named by the flag's own error: `--seed -1: ...`).
pub fn parse_list<T>(
    s: &str,
    one: impl Fn(&str) -> Result<T, String>,
) -> Result<PerModel<T>, String> {
    let list = s.contains(',');
    let mut values = Vec::new();
    for (i, part) in s.split(',').enumerate() {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("value {} of the list is empty", i + 1));
        }
        let value = one(part).map_err(|e| match list {
            true => format!("value {} ({part}): {e}", i + 1),
            false => e,
        })?;
        values.push(value);
    }
    Ok(PerModel { values })
}

/// Seeds: whole numbers from 0.
pub fn parse_seeds(s: &str) -> Result<PerModel<u64>, String> {
    parse_list(s, |v| {
        remat_units::parse_count(v, "", 0).map_err(|e| e.problem.to_string())
    })
}

/// Widths: whole numbers from 1.
pub fn parse_widths(s: &str) -> Result<PerModel<usize>, String> {
    parse_list(s, crate::units::count_arg::<usize>)
}

pub fn parse_dropouts(s: &str) -> Result<PerModel<f32>, String> {
    parse_list(s, crate::units::dropout_arg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_or_one_per_model() {
        let seeds = parse_seeds("3").unwrap();
        assert_eq!(seeds.for_models(3, "--seed").unwrap(), vec![3, 3, 3]);
        let seeds = parse_seeds("0, 1,2").unwrap();
        assert_eq!(seeds.for_models(3, "--seed").unwrap(), vec![0, 1, 2]);
        let err = seeds.for_models(2, "--seed").unwrap_err().to_string();
        assert!(
            err.contains("--seed has 3 values") && err.contains("--models is 2"),
            "{err}"
        );
        let err = seeds.check_single("--seed").unwrap_err().to_string();
        assert!(err.contains("needs --models 3"), "{err}");
        assert!(
            parse_seeds("1,,2")
                .unwrap_err()
                .contains("value 2 of the list is empty")
        );
        assert_eq!(
            parse_seeds("1,x").unwrap_err(),
            "value 2 (x): not a whole number; give a whole number, e.g. 4"
        );
        assert!(
            parse_seeds("-1")
                .unwrap_err()
                .starts_with("the value is negative")
        );
        assert_eq!(parse_widths("0").unwrap_err(), "must be at least 1");
        assert!(
            parse_dropouts("0.1,1.5")
                .unwrap_err()
                .contains("value 2 (1.5): must be in [0, 1)")
        );
    }
}
