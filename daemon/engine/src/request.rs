//! One typed request, whatever the edge: what a client asks of a model, with no protocol in
//! it. The HTTP edge builds it from OpenAI-style JSON, the D-Bus edge straight from its `a{sv}`
//! options, an embedding program by hand; the daemon's request path checks it the same way
//! for all of them. The engine sees JSON only where the plugin ABI defines it: a strategy's
//! parameters ([`Request::strategy`]).

use crate::sched::Priority;

/// A request for completions of one prompt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// Tokens generated per choice, at most (the model's context and the daemon's limit cap it).
    pub max_tokens: Option<u64>,
    /// Choices (completions of the same prompt).
    pub n: Option<u64>,
    /// The seed of the strategy's randomness; a random one when absent.
    pub seed: Option<u64>,
    /// Text that ends a choice when generated (not included).
    pub stop: Vec<String>,
    pub priority: Priority,
    pub sampling: Sampling,
    /// A strategy by name, with its own parameters; the sampling fields choose one otherwise.
    pub decoder: Option<Decoder>,
    /// Report each generated token's log-probability, with this many of the most probable
    /// alternatives (0..=20; OpenAI's `top_logprobs`, completions' `logprobs: N`).
    pub logprobs: Option<u32>,
    /// What the output must be (a JSON object, JSON under a schema, a grammar); free text
    /// when absent.
    pub response_format: Option<crate::constraint::ResponseFormat>,
}

/// OpenAI's sampling fields and the common extensions, each absent unless the client set it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u64>,
    pub min_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    /// llama.cpp's repetition penalty (Ollama's `repeat_penalty`; 1 is off) and its window.
    pub repeat_penalty: Option<f64>,
    pub repeat_last_n: Option<u64>,
    /// Added to a token's logit before sampling, by token id.
    pub logit_bias: Vec<(u32, f64)>,
}

/// A decoding strategy named by the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoder {
    pub name: String,
    /// Its parameters as a JSON object (the plugin ABI's format), `{}` when absent.
    pub params: Option<String>,
}

impl Sampling {
    /// The numeric fields by name, for checks and for the plugin's parameters.
    fn numbers(&self) -> [(&'static str, Option<f64>); 8] {
        [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k.map(|k| k as f64)),
            ("min_p", self.min_p),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
            ("repeat_penalty", self.repeat_penalty),
            ("repeat_last_n", self.repeat_last_n.map(|n| n as f64)),
        ]
    }

    /// The first field that is not a finite number (D-Bus doubles can be NaN or infinite).
    pub fn non_finite(&self) -> Option<&'static str> {
        self.numbers()
            .into_iter()
            .find(|(_, v)| v.is_some_and(|x| !x.is_finite()))
            .map(|(k, _)| k)
            .or_else(|| self.logit_bias.iter().any(|(_, b)| !b.is_finite()).then_some("logit_bias"))
    }
}

impl Request {
    /// The strategy and its parameters (a JSON object for the plugin): the decoder named, with
    /// every sampling field the client set merged into its parameters (`decoder_params` win
    /// where both set a key; a strategy that cannot honour a field refuses it by name, as
    /// plugins refuse unknown parameters); otherwise greedy at temperature 0, min-p when
    /// `min_p` is set, nucleus sampling else, with the sampling fields that strategy reads.
    /// Range checks are the plugin's (`validate`), so every strategy states its own.
    pub fn strategy(&self) -> (String, String) {
        if let Some(d) = &self.decoder {
            let params = d.params.clone().unwrap_or_else(|| "{}".into());
            return (d.name.clone(), merge(&self.sampling.fields(ALL_SAMPLING), &params));
        }
        let s = &self.sampling;
        // Temperature 0 is greedy decoding, unless the logits are edited first (penalties, a
        // bias): OpenAI applies those at temperature 0 too, and nucleus's temperature 0 is
        // the argmax of the edited logits.
        let edited = s.frequency_penalty.is_some_and(|x| x != 0.0)
            || s.presence_penalty.is_some_and(|x| x != 0.0)
            || s.repeat_penalty.is_some_and(|x| x != 1.0)
            || !s.logit_bias.is_empty();
        let name = if s.temperature == Some(0.0) && !edited {
            "greedy"
        } else if s.min_p.is_some() {
            "min-p"
        } else {
            "nucleus"
        };
        // Each strategy reads every sampling field but the truncations it does not do.
        let unread: &[&str] = match name {
            "greedy" => ALL_SAMPLING,
            "min-p" => &["top_p", "top_k"],
            _ => &["min_p"],
        };
        let keys: Vec<&str> = ALL_SAMPLING.iter().copied().filter(|k| !unread.contains(k)).collect();
        (name.to_owned(), format!("{{{}}}", s.fields(&keys).join(", ")))
    }
}

/// Every sampling field, in the order they are written.
const ALL_SAMPLING: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "logit_bias",
];

impl Sampling {
    /// The fields among `keys` that the client set, as `"key": value` JSON members.
    fn fields(&self, keys: &[&str]) -> Vec<String> {
        let mut fields: Vec<String> = self
            .numbers()
            .into_iter()
            .filter(|(k, _)| keys.contains(k))
            .filter_map(|(k, v)| v.map(|v| format!("\"{k}\": {}", number(v))))
            .collect();
        if keys.contains(&"logit_bias") && !self.logit_bias.is_empty() {
            let bias: Vec<String> = self.logit_bias.iter().map(|(t, b)| format!("\"{t}\": {}", number(*b))).collect();
            fields.push(format!("\"logit_bias\": {{{}}}", bias.join(", ")));
        }
        fields
    }
}

/// `params` (a strategy's JSON object) with the members of `fields` it lacks added (keys in
/// sorted order);
/// text that is not a JSON object is passed on unchanged, for the plugin to refuse.
fn merge(fields: &[String], params: &str) -> String {
    let Ok(serde_json::Value::Object(given)) = serde_json::from_str::<serde_json::Value>(params) else {
        return params.to_owned();
    };
    let Ok(serde_json::Value::Object(mut merged)) =
        serde_json::from_str::<serde_json::Value>(&format!("{{{}}}", fields.join(", ")))
    else {
        return params.to_owned();
    };
    merged.extend(given);
    // Keys in sorted order, whatever order the JSON map keeps.
    let sorted: std::collections::BTreeMap<String, serde_json::Value> = merged.into_iter().collect();
    serde_json::to_string(&sorted).unwrap_or_else(|_| params.to_owned())
}

/// A finite number as JSON (integers without a fraction, as a client would write them).
fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampling_fields_choose_the_strategy_and_its_parameters() {
        let req = |s: Sampling| Request { sampling: s, ..Request::default() };
        let table: Vec<(Request, &str, &str)> = vec![
            (req(Sampling::default()), "nucleus", "{}"),
            (req(Sampling { temperature: Some(0.0), top_p: Some(0.5), ..Default::default() }), "greedy", "{}"),
            // At temperature 0 penalties and a bias still apply (the argmax of edited logits).
            (
                req(Sampling { temperature: Some(0.0), frequency_penalty: Some(0.5), ..Default::default() }),
                "nucleus",
                r#"{"temperature": 0, "frequency_penalty": 0.5}"#,
            ),
            (
                req(Sampling { temperature: Some(0.0), logit_bias: vec![(9, 2.0)], ..Default::default() }),
                "nucleus",
                r#"{"temperature": 0, "logit_bias": {"9": 2}}"#,
            ),
            (
                req(Sampling { temperature: Some(0.7), top_k: Some(40), min_p: None, ..Default::default() }),
                "nucleus",
                r#"{"temperature": 0.7, "top_k": 40}"#,
            ),
            (
                req(Sampling {
                    min_p: Some(0.1),
                    top_p: Some(0.9),
                    logit_bias: vec![(5, -100.0)],
                    ..Default::default()
                }),
                "min-p",
                r#"{"min_p": 0.1, "logit_bias": {"5": -100}}"#,
            ),
            (
                Request {
                    decoder: Some(Decoder { name: "beam".into(), params: Some(r#"{"beam_width": 4}"#.into()) }),
                    ..Request::default()
                },
                "beam",
                r#"{"beam_width":4}"#,
            ),
            // A named strategy gets the client's sampling fields; its own parameters win.
            (
                Request {
                    decoder: Some(Decoder {
                        name: "speculative".into(),
                        params: Some(r#"{"k": 4, "top_p": 0.5}"#.into()),
                    }),
                    sampling: Sampling {
                        temperature: Some(0.0),
                        top_p: Some(0.9),
                        logit_bias: vec![(7, 1.5)],
                        ..Default::default()
                    },
                    ..Request::default()
                },
                "speculative",
                r#"{"k":4,"logit_bias":{"7":1.5},"temperature":0,"top_p":0.5}"#,
            ),
            (
                Request {
                    decoder: Some(Decoder { name: "greedy".into(), params: None }),
                    sampling: Sampling { top_k: Some(3), ..Default::default() },
                    ..Request::default()
                },
                "greedy",
                r#"{"top_k":3}"#,
            ),
        ];
        for (r, name, params) in table {
            assert_eq!(r.strategy(), (name.to_string(), params.to_string()), "{r:?}");
        }
    }

    #[test]
    fn non_finite_numbers_are_named() {
        let s = Sampling { top_p: Some(f64::NAN), ..Default::default() };
        assert_eq!(s.non_finite(), Some("top_p"));
        let s = Sampling { logit_bias: vec![(1, f64::INFINITY)], ..Default::default() };
        assert_eq!(s.non_finite(), Some("logit_bias"));
        assert_eq!(Sampling::default().non_finite(), None);
    }
}
