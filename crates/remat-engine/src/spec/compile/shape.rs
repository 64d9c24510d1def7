//! Shapes in named dims: each entry is a sum (`+`) of products (`*`) of integers, names from
//! the spec's `[dims]` table and model-config keys; a factor `a/b` divides rounding up (chunk
//! counts).

use std::collections::BTreeMap;

use super::super::config::ModelConfig;
use super::super::error::{Result, SpecError};

pub struct ShapeResolver<'a> {
    pub block: &'a str,
    pub dims: &'a BTreeMap<String, String>,
    pub config: &'a ModelConfig,
}

impl ShapeResolver<'_> {
    pub fn shape(&self, owner: &str, shape: &[String]) -> Result<Vec<usize>> {
        shape.iter().map(|d| self.dim(owner, d)).collect()
    }

    fn dim(&self, owner: &str, text: &str) -> Result<usize> {
        let bad = |reason: String| SpecError::BadShape {
            block: self.block.into(),
            owner: owner.into(),
            dim: text.into(),
            reason,
        };
        let overflow = || SpecError::BadShape {
            block: self.block.into(),
            owner: owner.into(),
            dim: text.into(),
            reason: "overflows".into(),
        };
        let mut sum: usize = 0;
        for term in text.split('+').map(str::trim) {
            let mut product: usize = 1;
            for factor in term.split('*').map(str::trim) {
                let value = self.quotient(factor).map_err(bad)?;
                product = product.checked_mul(value).ok_or_else(overflow)?;
            }
            sum = sum.checked_add(product).ok_or_else(overflow)?;
        }
        Ok(sum)
    }

    /// `a/b` divides rounding up (a number of chunks: `T/L`); otherwise one factor.
    fn quotient(&self, factor: &str) -> std::result::Result<usize, String> {
        let Some((num, den)) = factor.split_once('/') else {
            return self.factor(factor, true);
        };
        let (num, den) = (num.trim(), den.trim());
        let den_value = self.factor(den, true)?;
        if den_value == 0 {
            return Err(format!("`{den}` is 0: `{factor}` divides by zero"));
        }
        Ok(self.factor(num, true)?.div_ceil(den_value))
    }

    /// An integer, a named dim (expanded one level, into config keys and integers), or a
    /// config key.
    fn factor(&self, factor: &str, expand_dims: bool) -> std::result::Result<usize, String> {
        if factor.is_empty() {
            return Err("empty factor".into());
        }
        if let Ok(n) = factor.parse::<usize>() {
            return Ok(n);
        }
        if expand_dims && let Some(expr) = self.dims.get(factor) {
            let mut product: usize = 1;
            for inner in expr.split('*').map(str::trim) {
                let v = self
                    .factor(inner, false)
                    .map_err(|e| format!("dim `{factor}` = `{expr}`: {e}"))?;
                product = product.checked_mul(v).ok_or("overflows")?;
            }
            return Ok(product);
        }
        let is_name = factor
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && factor
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if !is_name {
            return Err(format!(
                "`{factor}` is neither a non-negative integer that fits in 64 bits nor a name (of a dim or a model-config key)"
            ));
        }
        if !expand_dims && self.dims.contains_key(factor) {
            return Err(format!(
                "`{factor}` is a dim of the spec, but a dim's definition expands only into config keys and integers, not other dims (nor itself)"
            ));
        }
        match self.config.get(factor) {
            Some(super::super::types::Value::Int(i)) if *i >= 0 => Ok(*i as usize),
            Some(other) => Err(format!(
                "`{factor}` = {other} is not a non-negative integer"
            )),
            None if matches!(factor, "batch" | "seq_len") => Err(format!(
                "`{factor}` is not in the model config; a Hugging Face config.json has no batch size or sequence length: add them with `--set batch=N --set seq_len=N`"
            )),
            None => Err(format!(
                "`{factor}` is neither a dim of the spec nor a key of the model config (override it with `--set {factor}=N`)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Value;

    #[test]
    fn sums_of_products_and_quotients_rounding_up() {
        let dims = BTreeMap::from([("L".to_string(), "scan_chunk".to_string())]);
        let config = ModelConfig::new("t")
            .set("seq_len", Value::Int(10))
            .set("scan_chunk", Value::Int(4))
            .set("zero", Value::Int(0));
        let r = ShapeResolver {
            block: "b",
            dims: &dims,
            config: &config,
        };
        let shape = [
            "seq_len/L".to_string(),
            "2*seq_len/5".to_string(),
            "L + 2*seq_len".to_string(),
        ];
        assert_eq!(r.shape("s", &shape).unwrap(), vec![3, 4, 24]);
        let err = r
            .shape("s", &["seq_len/zero".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("divides by zero"), "{err}");
    }
}
