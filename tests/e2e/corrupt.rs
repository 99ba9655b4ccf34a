//! Hostile and damaged model files: every one is an error with a message, never a panic.

use inferd_e2e::{temp_dir, write_tiny_gguf, TinySpec};
use inferd_engine::model::Model;
use inferd_kernels::DType;

fn load_bytes(dir: &std::path::Path, name: &str, bytes: &[u8]) -> Result<Model, String> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    Model::load(&p).map_err(|e| e.to_string())
}

#[test]
fn truncated_files_are_errors() {
    let dir = temp_dir("trunc");
    let good =
        std::fs::read(write_tiny_gguf(&dir.join("good.gguf"), &TinySpec::default(), DType::Q4_1, DType::Q8_0)).unwrap();
    assert!(load_bytes(&dir, "ok.gguf", &good).is_ok());
    let mut cuts: Vec<usize> = (0..200).collect();
    cuts.extend((200..good.len()).step_by(997));
    cuts.push(good.len() - 1);
    for cut in cuts {
        let err = load_bytes(&dir, "cut.gguf", &good[..cut]).err();
        assert!(err.is_some(), "a file cut at {cut} of {} bytes loaded", good.len());
    }
}

#[test]
fn corrupted_headers_never_panic() {
    let dir = temp_dir("flip");
    let good =
        std::fs::read(write_tiny_gguf(&dir.join("good.gguf"), &TinySpec::default(), DType::Q8_0, DType::Q8_0)).unwrap();
    let mut x = 12345u64;
    for _ in 0..300 {
        let mut bad = good.clone();
        for _ in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let at = (x as usize) % 4096.min(bad.len());
            bad[at] ^= (x >> 32) as u8 | 1;
        }
        // Either it loads (the flip hit a value that is still valid) or it is an error.
        let r = std::panic::catch_unwind(|| load_bytes(&dir, "bad.gguf", &bad));
        assert!(r.is_ok(), "loading a corrupted file panicked");
    }
}

#[test]
fn hostile_counts_and_unsupported_content_are_named() {
    let dir = temp_dir("hostile");
    // A header claiming 2^60 tensors and metadata entries.
    let mut h = b"GGUF".to_vec();
    h.extend(3u32.to_le_bytes());
    h.extend((1u64 << 60).to_le_bytes());
    h.extend((1u64 << 60).to_le_bytes());
    let e = load_bytes(&dir, "huge.gguf", &h).unwrap_err();
    assert!(e.contains("exceeds the file"), "{e}");
    assert!(load_bytes(&dir, "magic.gguf", b"NOPE and more bytes").unwrap_err().contains("magic"));
    let mut v = b"GGUF".to_vec();
    v.extend(99u32.to_le_bytes());
    assert!(load_bytes(&dir, "ver.gguf", &v).unwrap_err().contains("version 99"));

    // Another architecture is refused by name.
    let good =
        std::fs::read(write_tiny_gguf(&dir.join("g.gguf"), &TinySpec::default(), DType::F32, DType::F32)).unwrap();
    let pos = good.windows(5).position(|w| w == b"llama").unwrap();
    let mut other = good.clone();
    other[pos..pos + 5].copy_from_slice(b"gemma");
    let e = load_bytes(&dir, "arch.gguf", &other).unwrap_err();
    assert!(e.contains("gemma"), "{e}");

    // A tensor type without kernels (IQ2_XXS = 16) is named, with its tensor; so is a number
    // GGML has no type for.
    let name = b"blk.0.attn_q.weight";
    let at = good.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let ty = at + 4 + 2 * 8; // n_dims, two dims, then the type
    for (number, named) in [(16u32, "IQ2_XXS"), (77, "ggml type 77")] {
        let mut bad = good.clone();
        bad[ty..ty + 4].copy_from_slice(&number.to_le_bytes());
        let e = load_bytes(&dir, "type.gguf", &bad).unwrap_err();
        assert!(e.contains(named) && e.contains("blk.0.attn_q.weight") && e.contains("Q4_K"), "{e}");
    }

    // A missing directory and a directory without config.json are I/O errors naming the path.
    assert!(Model::load(&dir.join("nope")).unwrap_err().to_string().contains("nope"));
    std::fs::create_dir_all(dir.join("emptyhf")).unwrap();
    assert!(Model::load(&dir.join("emptyhf")).unwrap_err().to_string().contains("config.json"));
}

/// A model file is parsed within budgets, checked before anything is allocated for them: a
/// 132 MB metadata array (which once took 4.2 GB to parse, during the store listing) is
/// refused at once by the loader and the listing alike; a token past the length bound, an
/// infinite YaRN factor and a vocabulary that does not cover the embedding are refused by name.
#[test]
fn model_files_are_parsed_within_budgets() {
    use inferd_e2e::write_tiny_gguf_with;
    use inferd_engine::model::facts::Facts;
    use inferd_engine::model::gguf_writer::MetaValue;
    let dir = temp_dir("budgets");
    let spec = TinySpec::default();
    let with = |name: &str, extra: &dyn Fn(&mut inferd_engine::model::gguf_writer::GgufWriter)| {
        write_tiny_gguf_with(&dir.join(name), &spec, DType::Q8_0, DType::Q8_0, |w| extra(w))
    };
    let big = with("big-array.gguf", &|w| {
        w.meta("general.junk", MetaValue::I32Array(vec![7; 33 << 20]));
    });
    let t0 = std::time::Instant::now();
    let e = Model::load(&big).unwrap_err().to_string();
    assert!(e.contains("an array of 34603008 values (at most 4194304)"), "{e}");
    assert!(Facts::read(&big).is_err());
    eprintln!("a 132 MB metadata array refused in {:.1} ms (load and listing)", t0.elapsed().as_secs_f64() * 1e3);
    assert!(t0.elapsed() < std::time::Duration::from_secs(2));
    // Big vocabularies' arrays are stepped over by the listing, not kept.
    let (tokens, _) = inferd_e2e::tiny_vocab();
    let long = with("long-token.gguf", &|w| {
        let mut t = tokens.clone();
        t[1] = format!("<|{}|>", "x".repeat(1021));
        w.meta("tokenizer.ggml.tokens", MetaValue::StrArray(t));
    });
    let e = Model::load(&long).unwrap_err().to_string();
    assert!(e.contains("token 1 is 1025 bytes long (at most 1024)"), "{e}");
    let longest = with("longest-token.gguf", &|w| {
        let mut t = tokens.clone();
        t[1] = format!("<|{}|>", "x".repeat(1020));
        w.meta("tokenizer.ggml.tokens", MetaValue::StrArray(t));
    });
    let t0 = std::time::Instant::now();
    let m = Model::load(&longest).unwrap();
    eprintln!("a 1,024-byte special token: the model loads in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    assert_eq!(m.tokenizer.encode(&format!("a<|{}|>b", "x".repeat(1020)), true).unwrap().len(), 3);
    let infinite = with("yarn-inf.gguf", &|w| {
        w.meta("llama.rope.scaling.type", MetaValue::Str("yarn".into()));
        w.meta("llama.rope.scaling.factor", MetaValue::F32(f32::INFINITY));
    });
    let e = Model::load(&infinite).unwrap_err().to_string();
    assert!(e.contains("llama.rope.scaling.factor is not a finite number"), "{e}");
    let short = with("short-vocab.gguf", &|w| {
        w.meta("tokenizer.ggml.tokens", MetaValue::StrArray(tokens[..tokens.len() - 6].to_vec()));
        w.meta("tokenizer.ggml.merges", MetaValue::StrArray(Vec::new()));
    });
    let e = Model::load(&short).unwrap_err().to_string();
    assert!(
        e.contains(&format!("the vocabulary has {} tokens but the embedding {} rows", tokens.len() - 6, tokens.len())),
        "{e}"
    );
    // The same bound in a Hugging Face directory's tokenizer.json, before the library reads it.
    let hf = inferd_e2e::write_tiny_hf(&dir.join("hf"), &spec, safetensors::Dtype::F32);
    let path = hf.join("tokenizer.json");
    let mut j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    j["added_tokens"][0]["content"] = serde_json::json!("y".repeat(65536));
    std::fs::write(&path, j.to_string()).unwrap();
    let t0 = std::time::Instant::now();
    let e = Model::load(&hf).unwrap_err().to_string();
    assert!(e.contains("a token of 65536 bytes (at most 1024)"), "{e}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(2));
    let _ = std::fs::remove_dir_all(dir);
}

/// The costliest metadata the budgets admit: the most values a file may hold (8 Mi), as 4-byte
/// integers in two arrays of nearly the longest length, beside a tiny model. Each is parsed in
/// a process of its own (this test run again, told which file to load) whose peak resident
/// memory is read from the kernel, against the plain tiny model's: what a model file can make
/// the daemon hold, per MiB of the file.
#[test]
fn the_costliest_metadata_the_budgets_admit_costs_a_bounded_memory() {
    use inferd_e2e::write_tiny_gguf_with;
    use inferd_engine::model::gguf_writer::MetaValue;
    if let Ok(p) = std::env::var("INFERD_E2E_PEAK_OF") {
        let loaded = Model::load(std::path::Path::new(&p)).map(|_| ()).map_err(|e| e.to_string());
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let hwm = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap().trim().trim_end_matches(" kB");
        println!("PEAK {hwm} {loaded:?}");
        return;
    }
    let dir = temp_dir("peak");
    let spec = TinySpec::default();
    let plain = write_tiny_gguf(&dir.join("plain.gguf"), &spec, DType::Q8_0, DType::Q8_0);
    let worst = write_tiny_gguf_with(&dir.join("worst.gguf"), &spec, DType::Q8_0, DType::Q8_0, |w| {
        w.meta("general.a", MetaValue::I32Array(vec![7; 4_100_000]));
        w.meta("general.b", MetaValue::I32Array(vec![7; 4_100_000]));
    });
    let peak = |path: &std::path::Path| -> (f64, String) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "corrupt::the_costliest_metadata_the_budgets_admit_costs_a_bounded_memory",
                "--nocapture",
            ])
            .env("INFERD_E2E_PEAK_OF", path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text.lines().find_map(|l| l.strip_prefix("PEAK ")).unwrap_or_else(|| panic!("{text}"));
        let (kib, loaded) = line.split_once(' ').unwrap();
        (kib.parse::<f64>().unwrap() / 1024.0, loaded.to_owned())
    };
    let ((base, plain_loaded), (high, worst_loaded)) = (peak(&plain), peak(&worst));
    assert_eq!(plain_loaded, "Ok(())");
    assert_eq!(worst_loaded, "Ok(())", "the budgets admit it");
    let size = |p: &std::path::Path| std::fs::metadata(p).unwrap().len() as f64 / f64::from(1 << 20);
    let (extra_file, extra_memory) = (size(&worst) - size(&plain), high - base);
    eprintln!(
        "8.2 Mi metadata values ({extra_file:.1} MiB of file): peak {high:.0} MiB against {base:.0} MiB, {:.1} MiB per MiB",
        extra_memory / extra_file
    );
    // 32 bytes a value (the budget's arithmetic), and nothing in proportion beyond it.
    assert!(extra_memory < 8.5 * 32.0 + 32.0, "{extra_memory:.0} MiB for the values");
    let _ = std::fs::remove_dir_all(dir);
}
