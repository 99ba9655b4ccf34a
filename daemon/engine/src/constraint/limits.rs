//! Bounds on what a client may ask the grammar compiler to build, checked before it runs.
//!
//! The compiler's work and its stack grow with a schema's size: one object of 4,300 required
//! properties needs more than the 2 MiB stack of a runtime thread, and overflowing a stack aborts
//! the whole daemon. So a schema is measured first, by an iterative walk that needs no stack of
//! its own (nesting depth, nodes, object properties, enumerated values, text), against bounds
//! near OpenAI's structured-output limits (5,000 properties in all, a few levels of nesting,
//! 1,000 enum values), and the compiler then runs on a thread of its own whose stack is sized
//! for the largest schema these bounds let through (`Vocabulary::compile`). A Lark grammar is
//! bounded in length and in bracket nesting; its `%json` schemas count in that length.

use super::ConstraintError;
use serde_json::Value;

/// Nesting of objects and arrays in one schema (a schema's own object is level one; each
/// keyword's value one deeper). Real schemas nest a dozen levels; the compiler recurses by it.
pub const MAX_DEPTH: usize = 64;
/// Objects, arrays and values of all kinds in one schema.
pub const MAX_NODES: usize = 100_000;
/// `properties` entries summed over every object of one schema.
pub const MAX_PROPERTIES: usize = 5_000;
/// Values of `enum` (and alternatives of `anyOf`/`oneOf`) summed over one schema.
pub const MAX_ALTERNATIVES: usize = 5_000;
/// Bytes of a schema's strings and keys, or of a Lark grammar's text.
pub const MAX_TEXT: usize = 1 << 20;
/// Brackets open at once in a Lark grammar (`(`, `[`, `{`).
pub const MAX_LARK_NESTING: usize = 64;

fn refuse(what: String) -> ConstraintError {
    ConstraintError::Compile(what)
}

/// Totals over one schema, kept across several (a request's tools count together).
#[derive(Debug, Default)]
pub struct SchemaBudget {
    nodes: usize,
    properties: usize,
    alternatives: usize,
    text: usize,
}

impl SchemaBudget {
    /// Measures `schema` against the bounds, adding to what earlier schemas used.
    pub fn check(&mut self, schema: &Value) -> Result<(), ConstraintError> {
        let mut stack: Vec<(&Value, usize)> = vec![(schema, 1)];
        while let Some((v, depth)) = stack.pop() {
            self.nodes += 1;
            if self.nodes > MAX_NODES {
                return Err(refuse(format!("the schema has more than {MAX_NODES} values")));
            }
            match v {
                Value::Object(m) => {
                    if depth > MAX_DEPTH {
                        return Err(refuse(format!("the schema nests deeper than {MAX_DEPTH} levels")));
                    }
                    for (k, x) in m {
                        self.text += k.len();
                        match (k.as_str(), x) {
                            ("properties" | "patternProperties", Value::Object(p)) => self.properties += p.len(),
                            ("enum" | "anyOf" | "oneOf" | "allOf", Value::Array(a)) => self.alternatives += a.len(),
                            _ => {}
                        }
                        stack.push((x, depth + 1));
                    }
                }
                Value::Array(a) => {
                    if depth > MAX_DEPTH {
                        return Err(refuse(format!("the schema nests deeper than {MAX_DEPTH} levels")));
                    }
                    stack.extend(a.iter().map(|x| (x, depth + 1)));
                }
                Value::String(s) => self.text += s.len(),
                _ => {}
            }
            if self.properties > MAX_PROPERTIES {
                return Err(refuse(format!("the schema has more than {MAX_PROPERTIES} properties in all")));
            }
            if self.alternatives > MAX_ALTERNATIVES {
                return Err(refuse(format!(
                    "the schema has more than {MAX_ALTERNATIVES} enum values and alternatives in all"
                )));
            }
            if self.text > MAX_TEXT {
                return Err(refuse(format!("the schema's text passes {MAX_TEXT} bytes")));
            }
        }
        Ok(())
    }
}

/// Bounds a Lark grammar's length and bracket nesting (outside quoted strings and regexes).
pub fn check_lark(src: &str) -> Result<(), ConstraintError> {
    if src.len() > MAX_TEXT {
        return Err(refuse(format!("the grammar passes {MAX_TEXT} bytes")));
    }
    let (mut depth, mut quote, mut escaped) = (0usize, None::<u8>, false);
    for &b in src.as_bytes() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == q || b == b'\n' {
                quote = None;
            }
            continue;
        }
        match b {
            b'"' | b'/' => quote = Some(b),
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > MAX_LARK_NESTING {
                    return Err(refuse(format!("the grammar nests deeper than {MAX_LARK_NESTING} brackets")));
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: &Value) -> Result<(), ConstraintError> {
        SchemaBudget::default().check(v)
    }

    fn object(n: usize) -> Value {
        let props: serde_json::Map<String, Value> =
            (0..n).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
        json!({"type": "object", "properties": props})
    }

    #[test]
    fn each_bound_refuses_one_past_it() {
        assert!(check(&object(MAX_PROPERTIES)).is_ok());
        let e = check(&object(MAX_PROPERTIES + 1)).unwrap_err();
        assert!(e.to_string().contains("properties"), "{e}");
        let mut deep = json!({"type": "string"});
        for _ in 0..MAX_DEPTH - 1 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(check(&deep).is_ok());
        let e = check(&json!({"type": "array", "items": deep})).unwrap_err();
        assert!(e.to_string().contains("nests"), "{e}");
        let e = check(&json!({"enum": (0..=MAX_ALTERNATIVES).collect::<Vec<_>>()})).unwrap_err();
        assert!(e.to_string().contains("enum"), "{e}");
        let e = check(&json!({"description": "x".repeat(MAX_TEXT + 1)})).unwrap_err();
        assert!(e.to_string().contains("text"), "{e}");
        // Several schemas (a request's tools) share one budget.
        let mut b = SchemaBudget::default();
        b.check(&object(MAX_PROPERTIES / 2)).unwrap();
        b.check(&object(MAX_PROPERTIES / 2)).unwrap();
        assert!(b.check(&object(1)).is_err());
    }

    #[test]
    fn lark_nesting_counts_brackets_outside_strings_and_regexes() {
        assert!(check_lark(&format!("start: {}\"a\"{}", "(".repeat(64), ")".repeat(64))).is_ok());
        assert!(check_lark(&format!("start: {}\"a\"{}", "(".repeat(65), ")".repeat(65))).is_err());
        assert!(check_lark(&format!("start: \"{}\" /[(]{{3}}/", "(".repeat(1000))).is_ok());
        assert!(check_lark(&"a".repeat(MAX_TEXT + 1)).is_err());
    }
}
