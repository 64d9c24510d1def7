//! The model config a spec is compiled against: a flat map of scalars. Reads TOML or JSON
//! (a Hugging Face `config.json` works as is: nested tables are flattened with dots and
//! arrays are skipped) and `key=value` overrides.

use std::collections::BTreeMap;
use std::path::Path;

use super::error::{Result, SpecError};
use super::types::Value;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelConfig {
    /// Where the values came from, for error messages.
    pub source: String,
    pub values: BTreeMap<String, Value>,
}

impl ModelConfig {
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            values: BTreeMap::new(),
        }
    }

    pub fn set(mut self, key: impl Into<String>, value: Value) -> Self {
        self.values.insert(key.into(), value);
        self
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let source = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| SpecError::BadConfig {
            source_name: source.clone(),
            reason: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, &source)
    }

    /// Parses TOML or JSON (chosen by a `.json` suffix of `source`).
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let bad = |reason: String| SpecError::BadConfig {
            source_name: source.to_string(),
            reason,
        };
        let json: serde_json::Value = if source.ends_with(".json") {
            serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?
        } else {
            let table: toml::Table =
                toml::from_str(text).map_err(|e| bad(format!("invalid TOML: {e}")))?;
            serde_json::to_value(table).map_err(|e| bad(e.to_string()))?
        };
        let mut config = Self::new(source);
        // Explicit stack of (prefix, object) so nested configs never recurse.
        let mut stack = vec![(String::new(), json)];
        while let Some((prefix, value)) = stack.pop() {
            match value {
                serde_json::Value::Object(map) => {
                    for (key, child) in map {
                        let name = if prefix.is_empty() {
                            key
                        } else {
                            format!("{prefix}.{key}")
                        };
                        stack.push((name, child));
                    }
                }
                serde_json::Value::Bool(b) => {
                    config.values.insert(prefix, Value::Bool(b));
                }
                serde_json::Value::Number(n) => {
                    let v = match n.as_i64() {
                        Some(i) => Value::Int(i),
                        None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
                    };
                    config.values.insert(prefix, v);
                }
                serde_json::Value::String(s) => {
                    config.values.insert(prefix, Value::Str(s));
                }
                serde_json::Value::Null | serde_json::Value::Array(_) => {}
            }
        }
        if config.values.is_empty() {
            return Err(bad("no scalar values".into()));
        }
        Ok(config)
    }

    /// Applies one `key=value` override; the value is read as bool, integer, float, or else a
    /// string.
    pub fn apply_override(&mut self, assignment: &str) -> Result<()> {
        let (key, raw) = assignment
            .split_once('=')
            .ok_or_else(|| SpecError::BadConfig {
                source_name: "--set".into(),
                reason: format!("`{assignment}` is not KEY=VALUE"),
            })?;
        let raw = raw.trim();
        let value = if let Ok(b) = raw.parse::<bool>() {
            Value::Bool(b)
        } else if let Ok(i) = raw.parse::<i64>() {
            Value::Int(i)
        } else if let Ok(x) = raw.parse::<f64>() {
            Value::Float(x)
        } else {
            Value::Str(raw.trim_matches('"').to_string())
        };
        self.values.insert(key.trim().to_string(), value);
        Ok(())
    }

    /// A positive integer value, or an error naming `owner` (the field that needs it).
    pub fn usize_of(&self, key: &str, owner: &str) -> Result<usize> {
        let bad = |reason: String| SpecError::BadConfig {
            source_name: self.source.clone(),
            reason: format!("{owner}: {reason}"),
        };
        match self.values.get(key) {
            Some(Value::Int(i)) if *i >= 0 => Ok(*i as usize),
            Some(other) => Err(bad(format!(
                "`{key}` = {other} is not a non-negative integer"
            ))),
            None => Err(bad(format!("`{key}` is not set"))),
        }
    }

    /// Number of layers: `num_hidden_layers` (Hugging Face) or `num_layers`.
    pub fn num_layers(&self) -> Result<usize> {
        if self.values.contains_key("num_hidden_layers") {
            self.usize_of("num_hidden_layers", "layer count")
        } else {
            self.usize_of(
                "num_layers",
                "layer count (num_hidden_layers or num_layers)",
            )
        }
    }

    /// Fills in keys this config does not set.
    pub fn with_defaults(mut self, defaults: &BTreeMap<String, Value>) -> Self {
        for (key, value) in defaults {
            self.values
                .entry(key.clone())
                .or_insert_with(|| value.clone());
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_hugging_face_json_and_flattens_nesting() {
        let text = r#"{"hidden_size": 64, "attention_bias": false, "rms_norm_eps": 1e-6,
            "rope_scaling": {"factor": 2.0}, "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3"}"#;
        let c = ModelConfig::parse(text, "config.json").unwrap();
        assert_eq!(c.get("hidden_size"), Some(&Value::Int(64)));
        assert_eq!(c.get("attention_bias"), Some(&Value::Bool(false)));
        assert_eq!(c.get("rope_scaling.factor"), Some(&Value::Float(2.0)));
        assert_eq!(c.get("model_type"), Some(&Value::Str("qwen3".into())));
        assert!(c.get("architectures").is_none());
    }

    #[test]
    fn reads_toml_and_overrides() {
        let mut c = ModelConfig::parse("num_layers = 4\nuse_qk_norm = true\n", "m.toml").unwrap();
        c.apply_override("use_qk_norm=false").unwrap();
        c.apply_override("act=silu").unwrap();
        assert_eq!(c.get("use_qk_norm"), Some(&Value::Bool(false)));
        assert_eq!(c.get("act"), Some(&Value::Str("silu".into())));
        assert_eq!(c.num_layers().unwrap(), 4);
        assert!(c.apply_override("nonsense").is_err());
        let err = c.usize_of("act", "dim D").unwrap_err().to_string();
        assert!(err.contains("dim D") && err.contains("`act`"), "{err}");
    }

    #[test]
    fn rejects_bad_files() {
        assert!(ModelConfig::parse("{", "c.json").is_err());
        assert!(ModelConfig::parse("= 3", "c.toml").is_err());
        assert!(ModelConfig::parse("{}", "c.json").is_err());
    }
}
