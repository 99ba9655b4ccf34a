//! Strategy parameters: a JSON object read key by key with range checks, then checked for keys
//! nobody read, so a misspelt parameter is an error rather than silently ignored.

use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::ops::RangeInclusive;

#[derive(Debug)]
pub struct Params {
    map: Map<String, Value>,
    used: BTreeSet<String>,
}

impl Params {
    /// An empty text counts as `{}`; anything but a JSON object is an error.
    pub fn parse(json: &str) -> Result<Params, String> {
        if json.trim().is_empty() {
            return Ok(Params { map: Map::new(), used: BTreeSet::new() });
        }
        match serde_json::from_str::<Value>(json) {
            Ok(Value::Object(map)) => Ok(Params { map, used: BTreeSet::new() }),
            Ok(_) => Err("parameters must be a JSON object".into()),
            Err(e) => Err(format!("parameters are not valid JSON: {e}")),
        }
    }

    /// The raw value of `key` (marked as read); `null` counts as absent.
    pub fn get(&mut self, key: &str) -> Option<&Value> {
        self.used.insert(key.to_owned());
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// A number in `range`, or `default` when absent.
    pub fn f64(&mut self, key: &str, range: RangeInclusive<f64>, default: f64) -> Result<f64, String> {
        let Some(v) = self.get(key) else { return Ok(default) };
        let x = v.as_f64().ok_or_else(|| format!("{key} must be a number, got {v}"))?;
        if !x.is_finite() || !range.contains(&x) {
            return Err(format!("{key} must be between {} and {}, got {x}", range.start(), range.end()));
        }
        Ok(x)
    }

    /// An integer in `range`, or `default` when absent.
    pub fn u64(&mut self, key: &str, range: RangeInclusive<u64>, default: u64) -> Result<u64, String> {
        let Some(v) = self.get(key) else { return Ok(default) };
        let x = v.as_u64().ok_or_else(|| format!("{key} must be a non-negative integer, got {v}"))?;
        if !range.contains(&x) {
            return Err(format!("{key} must be between {} and {}, got {x}", range.start(), range.end()));
        }
        Ok(x)
    }

    /// A boolean, or `default` when absent.
    pub fn bool(&mut self, key: &str, default: bool) -> Result<bool, String> {
        let Some(v) = self.get(key) else { return Ok(default) };
        v.as_bool().ok_or_else(|| format!("{key} must be true or false, got {v}"))
    }

    /// Fails on any key that was never read.
    pub fn finish(self) -> Result<(), String> {
        let unknown: Vec<&str> = self.map.keys().filter(|k| !self.used.contains(*k)).map(String::as_str).collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(format!("unknown parameter{} {}", if unknown.len() > 1 { "s" } else { "" }, unknown.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_types_and_unknown_keys_are_checked() {
        let mut p = Params::parse(r#"{"temperature": 0.7, "top_k": 40, "greedy": true}"#).unwrap();
        assert_eq!(p.f64("temperature", 0.0..=2.0, 1.0), Ok(0.7));
        assert_eq!(p.u64("top_k", 0..=100, 0), Ok(40));
        assert_eq!(p.f64("top_p", 0.0..=1.0, 1.0), Ok(1.0));
        assert!(p.finish().unwrap_err().contains("greedy"));

        let mut p = Params::parse(r#"{"temperature": 3}"#).unwrap();
        assert!(p.f64("temperature", 0.0..=2.0, 1.0).unwrap_err().contains("between 0 and 2"));
        let mut p = Params::parse(r#"{"top_k": -1}"#).unwrap();
        assert!(p.u64("top_k", 0..=10, 0).unwrap_err().contains("non-negative integer"));
        let mut p = Params::parse(r#"{"top_k": "5"}"#).unwrap();
        assert!(p.u64("top_k", 0..=10, 0).is_err());
        assert!(Params::parse("[1]").unwrap_err().contains("JSON object"));
        assert!(Params::parse("{").unwrap_err().contains("not valid JSON"));
        assert!(Params::parse("").unwrap().finish().is_ok());
    }
}
