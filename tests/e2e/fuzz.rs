//! Fuzzing the parsers of what the daemon reads from disk, a bounded number of executions each
//! (`inferd_e2e::fuzz`): GGUF files, safetensors headers, `config.json`, `tokenizer.json` and
//! chat templates (compiled and rendered with messages and tools); and the response formats a
//! request brings (JSON schemas and Lark grammars, compiled for the default model's vocabulary
//! and masked once). Every input is an error or a model, never a panic. (Request bodies and
//! D-Bus options are fuzzed against a running daemon, in the daemon's tests.)

use inferd_e2e::fuzz::{self, Report};
use inferd_e2e::{temp_dir, write_tiny_gguf, write_tiny_hf, TinySpec};
use inferd_engine::chat::{ChatMessage, ChatTemplate};
use inferd_engine::model::Model;
use inferd_engine::tokenizer::Tokenizer;
use inferd_kernels::DType;

/// The bytes of a file's first `head` bytes are mutated; the rest stays (the header is where a
/// parser can go wrong; the tensor data is only ever sized and mapped).
const HEAD: usize = 8192;

fn no_crashes(reports: &[Report]) {
    let crashed: Vec<String> = reports.iter().flat_map(|r| r.crashes.iter().map(|p| p.display().to_string())).collect();
    assert!(crashed.is_empty(), "inputs that panicked (saved for replay): {crashed:?}");
}

#[test]
fn model_files_never_panic_the_loader() {
    let dir = temp_dir("fuzz-models");
    let crashes = dir.join("crashes");
    let mut reports = Vec::new();
    // GGUF: two weight types, the header mutated, the data kept.
    let files: Vec<Vec<u8>> = [(DType::Q8_0, "a.gguf"), (DType::Q4_1, "b.gguf")]
        .iter()
        .map(|(t, n)| std::fs::read(write_tiny_gguf(&dir.join(n), &TinySpec::default(), *t, DType::Q8_0)).unwrap())
        .collect();
    let heads: Vec<Vec<u8>> = files.iter().map(|f| f[..HEAD.min(f.len())].to_vec()).collect();
    let target = dir.join("target.gguf");
    let dict: &[&[u8]] =
        &[b"GGUF", b"general.architecture", b"llama.block_count", b"tokenizer.ggml.tokens", b"blk.0.attn_q.weight"];
    reports.push(fuzz::run("gguf", &heads, dict, fuzz::execs(6000), &crashes, |head| {
        let tail = &files[0][HEAD.min(files[0].len())..];
        let mut bytes = head.to_vec();
        bytes.extend_from_slice(tail);
        std::fs::write(&target, &bytes).unwrap();
        let _ = Model::load(&target);
    }));
    // Hugging Face directories: the safetensors header, config.json, tokenizer.json.
    let hf = write_tiny_hf(&dir.join("hf"), &TinySpec::default(), safetensors::Dtype::F32);
    let st = std::fs::read(hf.join("model.safetensors")).unwrap();
    let header_len = 8 + u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let (st_head, st_data) = st.split_at(header_len);
    let replace = |name: &str, bytes: &[u8]| std::fs::write(hf.join(name), bytes).unwrap();
    let dict: &[&[u8]] =
        &[b"\"dtype\"", b"\"shape\"", b"\"data_offsets\"", b"\"F16\"", b"\"BF16\"", b"[0,0]", b"__metadata__"];
    reports.push(fuzz::run("safetensors", &[st_head.to_vec()], dict, fuzz::execs(4000), &crashes, |head| {
        let mut bytes = head.to_vec();
        bytes.extend_from_slice(st_data);
        replace("model.safetensors", &bytes);
        let _ = Model::load(&hf);
    }));
    replace("model.safetensors", &st);
    let mut configs = fuzz::corpus("config_json");
    configs.push(std::fs::read(hf.join("config.json")).unwrap());
    let good_config = std::fs::read(hf.join("config.json")).unwrap();
    let dict: &[&[u8]] = &[
        b"\"num_hidden_layers\"",
        b"\"head_dim\"",
        b"\"rope_scaling\"",
        b"null",
        b"-1",
        b"1e308",
        b"\"sliding_window\"",
        b"[]",
        b"{}",
    ];
    reports.push(fuzz::run("config_json", &configs, dict, fuzz::execs(4000), &crashes, |text| {
        replace("config.json", text);
        let _ = Model::load(&hf);
    }));
    replace("config.json", &good_config);
    let tokenizer = std::fs::read(hf.join("tokenizer.json")).unwrap();
    let tk_path = dir.join("tokenizer.json");
    let dict: &[&[u8]] = &[
        b"\"added_tokens\"",
        b"\"special\": true",
        b"\"merges\"",
        b"\"Sequence\"",
        b"\"ByteLevel\"",
        b"\"Metaspace\"",
        b"null",
    ];
    let mut tokenizers = fuzz::corpus("tokenizer_json");
    tokenizers.push(tokenizer);
    reports.push(fuzz::run("tokenizer_json", &tokenizers, dict, fuzz::execs(4000), &crashes, |text| {
        std::fs::write(&tk_path, text).unwrap();
        match Tokenizer::from_hf_file(&tk_path, Some(1), vec![2], false) {
            Ok(t) => {
                if let Ok(ids) = t.encode("Hello <|im_start|> wörld 123", true) {
                    let _ = t.decode(&ids, false);
                }
            }
            // The loader's last guard catching a panic of the library counts as a crash: the
            // file should have been refused by a check before it.
            Err(e) => assert!(!e.to_string().contains("gave up on it"), "a caught panic: {e}"),
        }
    }));
    no_crashes(&reports);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn chat_templates_never_panic_and_always_end() {
    let dir = temp_dir("fuzz-templates");
    let mut msgs = vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi <|im_end|> there")];
    let mut answer = ChatMessage::new("assistant", "<think>x</think>\nSure.");
    answer.tool_calls =
        vec![inferd_engine::tools::ToolCall { id: "c1".into(), name: "f".into(), arguments: "{\"x\": 1}".into() }];
    msgs.push(answer);
    msgs.push(ChatMessage {
        tool_call_id: Some("c1".into()),
        name: Some("f".into()),
        ..ChatMessage::new("tool", "42")
    });
    msgs.push(ChatMessage::new("user", "And?"));
    let tools = vec![inferd_engine::tools::Tool {
        name: "f".into(),
        description: Some("adds".into()),
        parameters: serde_json::json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
    }];
    let dict: &[&[u8]] = &[
        b"{% for m in messages %}",
        b"{% endfor %}",
        b"{{ ",
        b" }}",
        b"{%- if ",
        b"{% endif %}",
        b"| tojson",
        b".split(",
        b"range(",
        b"loop.index0",
        b"raise_exception(",
        b"* 1000",
    ];
    let report = fuzz::run(
        "chat_template",
        &fuzz::corpus("chat_template"),
        dict,
        fuzz::execs(20000),
        &dir.join("crashes"),
        |src| {
            let Ok(src) = std::str::from_utf8(src) else { return };
            if let Ok(t) = ChatTemplate::new(Some(src), "<s>".into(), "</s>".into()) {
                let _ = t.render_with_tools(&msgs, &tools, true);
            }
        },
    );
    no_crashes(&[report]);
    let _ = std::fs::remove_dir_all(dir);
}

/// A response format is compiled (within `constraint::limits`) or refused with a reason, and a
/// compiled one masks a first row: the compiler never panics (a panic it caught on its own
/// thread, "the grammar compiler failed", counts as one) and never runs unbounded.
#[test]
fn response_formats_compile_or_are_refused_never_panic() {
    use inferd_engine::constraint::mask::Masker;
    use inferd_engine::constraint::{ResponseFormat, Vocabulary};
    let dir = temp_dir("fuzz-formats");
    let model = Model::load(&inferd_e2e::default_model()).unwrap();
    let vocab = Vocabulary::new(&model.tokenizer).unwrap();
    let n = model.config.vocab;
    // (compiled and masked, refused): the mutants must reach the compiler, not only the parser.
    let seen = std::cell::Cell::new((0usize, 0usize));
    let check = |format: ResponseFormat| match vocab.compile(&format) {
        Ok(g) => {
            let mut m = Masker::new(&g, 0, 0, &[], 1).unwrap();
            let mut row = vec![0f32; n];
            let _ = m.mask(0, &[], &mut row, n);
            seen.set((seen.get().0 + 1, seen.get().1));
        }
        Err(e) => {
            assert!(!e.to_string().contains("the grammar compiler failed"), "a caught panic: {e}");
            seen.set((seen.get().0, seen.get().1 + 1));
        }
    };
    let dict: &[&[u8]] = &[
        b"\"$ref\"",
        b"\"#/$defs/node\"",
        b"\"anyOf\"",
        b"\"allOf\"",
        b"\"pattern\"",
        b"\"(a|b)*c{2,}\"",
        b"\"minItems\"",
        b"\"maxLength\"",
        b"\"format\"",
        b"\"additionalProperties\"",
        b"\"const\"",
    ];
    let schemas =
        fuzz::run("json_schema", &fuzz::corpus("json_schema"), dict, fuzz::execs(6000), &dir.join("crashes"), |b| {
            if let Ok(v) = serde_json::from_slice(b) {
                check(ResponseFormat::JsonSchema(v));
            }
        });
    let dict: &[&[u8]] = &[
        b"start: ",
        b"%json {",
        b"/[a-z]+/",
        b"(",
        b")*",
        b"|",
        b"\"<tool_call>\"",
        b"%ignore ",
        b"NUMBER",
        b"~ 2..5",
    ];
    let lark = fuzz::run("lark", &fuzz::corpus("lark"), dict, fuzz::execs(6000), &dir.join("crashes"), |b| {
        if let Ok(src) = std::str::from_utf8(b) {
            check(ResponseFormat::Lark(src.to_owned()));
        }
    });
    let (compiled, refused) = seen.get();
    eprintln!("response formats: {compiled} compiled and masked, {refused} refused with a reason");
    assert!(compiled > 300 && refused > 300, "the mutants reach both outcomes: {compiled} / {refused}");
    no_crashes(&[schemas, lark]);
    let _ = std::fs::remove_dir_all(dir);
}

/// The corpora the targets start from are where the tests expect them.
#[test]
fn the_committed_corpora_are_there() {
    for t in ["config_json", "chat_template", "http_body", "dbus_options", "json_schema", "lark", "tokenizer_json"] {
        let c = fuzz::corpus(t);
        assert!(c.len() >= 2 && c.iter().all(|x| !x.is_empty()), "{t}");
    }
    assert!(inferd_e2e::tests_dir().join("fuzz/corpus").is_dir());
}
