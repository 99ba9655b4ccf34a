//! Images in prompts, against llama.cpp's libmtmd on the same files: a tiny random-weight
//! Gemma 3 and its projector (`tests/reference/tiny_models.py vision`: SigLIP's form, 16 image
//! tokens), an image of the encoder's size and one resized and letterboxed; a tiny
//! Qwen2.5-VL pair (dynamic resolution, windows, the patch merger; M-RoPE in the language
//! model), an image of whole merged patches and one resized, and Qwen2-VL's projector (layer
//! norms, quick GELU) with the same model; a tiny Qwen3-VL pair (learned
//! positions resized to the grid, deepstack rows), those and an image of its positions' own
//! size. The image embeddings equal
//! `llama-mtmd-cli`'s (its `MTMD_DEBUG_EMBEDDINGS` dump) within a stated tolerance. An image
//! encodes beside the steps (a slow projector for the tiny Gemma 3): text requests keep being
//! answered meanwhile.

use super::*;
use inferd_engine::vision::{self, ImageLimits, VisionEncoder};

/// llama.cpp's multimodal command line, built beside llama-server by tests/build-llama-server.
fn llama_mtmd_cli() -> Option<PathBuf> {
    let p = super::remote::llama_server()?.with_file_name("llama-mtmd-cli");
    p.exists().then_some(p)
}

fn tiny_vision(dir: &Path) -> (PathBuf, PathBuf) {
    tiny_models("vision", dir);
    (dir.join("tiny-gemma3-vision.gguf"), dir.join("tiny-gemma3-vision-mmproj.gguf"))
}

/// The tiny Qwen2.5-VL pair (written beside Gemma 3's by the same script).
fn tiny_qwen_vision(dir: &Path) -> (PathBuf, PathBuf) {
    tiny_models("vision", dir);
    (dir.join("tiny-qwen25vl.gguf"), dir.join("tiny-qwen25vl-mmproj.gguf"))
}

/// The tiny Qwen3-VL pair (written beside the others by the same script).
fn tiny_qwen3_vision(dir: &Path) -> (PathBuf, PathBuf) {
    tiny_models("vision", dir);
    (dir.join("tiny-qwen3vl.gguf"), dir.join("tiny-qwen3vl-mmproj.gguf"))
}

/// The `[[model]]` entry serving the tiny pair as `vis`.
fn vis_entry(model: &Path, mmproj: &Path) -> String {
    format!("[[model]]\nname = \"vis\"\npath = \"{}\"\nmmproj = \"{}\"\n", model.display(), mmproj.display())
}

/// The image embeddings llama-mtmd-cli computes for `image` (rows of the model's width).
fn mtmd_embeddings(bin: &Path, model: &Path, mmproj: &Path, image: &Path, dir: &Path) -> (usize, usize, Vec<f32>) {
    let dump = dir.join("embeddings.bin");
    let out = Command::new(bin)
        .args(["-m", &model.display().to_string(), "--mmproj", &mmproj.display().to_string()])
        .args(["--image", &image.display().to_string(), "-p", "Describe.", "-n", "1", "--temp", "0", "-t", "2"])
        .env("MTMD_DEBUG_EMBEDDINGS", &dump)
        .output()
        .unwrap();
    assert!(out.status.success(), "llama-mtmd-cli: {}", String::from_utf8_lossy(&out.stderr));
    let b = std::fs::read(&dump).unwrap();
    let int = |i: usize| i32::from_le_bytes(b[i..i + 4].try_into().unwrap()) as usize;
    let (n, width) = (int(0), int(4));
    let v: Vec<f32> = b[8..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(v.len(), n * width);
    (n, width, v)
}

/// How far apart the embeddings may be, relative to their root mean square, where the encoder's
/// products run on f16 weights and f32 activations: four times the most measured (Gemma 3's:
/// 0.0013 for square.png, 0.0010 for wide.png; Qwen2.5-VL's, twice the layers and 10 times the
/// values: 0.0030 for landscape.png, 0.0024 for odd.png; Qwen3-VL's, its deepstack rows too:
/// 0.0026 at most; AMD EPYC Zen 4), the two sides
/// rounding differently (llama.cpp's activations in f16, its GELU from a table of f16 inputs).
/// A pixel resampled differently, a position, norm or pooling out of order is several times
/// the rms (Qwen's windows taken as one: 1.6).
const EMBEDDING_TOL: [f32; 3] = [0.005, 0.012, 0.0104];
/// The same where they run in bf16 tiles (AVX-512 BF16 or AVX2, `inferd_kernels::gemm`):
/// activations rounded to 8 significant bits as the checkpoints were trained with (their
/// weights are bf16 values, exact either way), four times the most measured (Gemma 3's 0.0078,
/// Qwen2.5-VL's 0.0234, Qwen3-VL's 0.0172 on Zen 4; at most 0.0079 for Gemma 3 and 0.0238
/// for the Qwen encoders on Zen 3's AVX2).
const EMBEDDING_TOL_BF16: [f32; 3] = [0.03, 0.094, 0.069];

#[test]
fn image_embeddings_match_llama_cpps() {
    let Some(bin) = llama_mtmd_cli() else {
        eprintln!("skipped: no llama-mtmd-cli (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("vision-embeddings");
    let gemma = tiny_vision(&dir);
    let qwen = tiny_qwen_vision(&dir);
    let qwen3 = tiny_qwen3_vision(&dir);
    // Qwen2-VL's projector (layer norms, quick GELU, no windows) on the same language model.
    let qwen2 = (qwen.0.clone(), dir.join("tiny-qwen2vl-mmproj.gguf"));
    let pool = inferd_kernels::pool::ThreadPool::new(2);
    // Gemma 3's fixed square (an image of its size, one letterboxed) and Qwen2.5-VL's dynamic
    // sizes (one whose sides are whole merged patches, in windows whose last ones are cut; one
    // resized to the nearest such size).
    let families = [
        (0, gemma, vec!["square.png", "wide.png"]),
        (1, qwen, vec!["landscape.png", "odd.png"]),
        (2, qwen3, vec!["grid.png", "landscape.png", "odd.png"]),
        (1, qwen2, vec!["landscape.png", "odd.png"]),
    ];
    for (family, (model, mmproj), names) in families {
        let enc = VisionEncoder::load(&mmproj).unwrap();
        for name in names {
            let (n, width, want) = mtmd_embeddings(&bin, &model, &mmproj, &dir.join(name), &dir);
            let img = vision::decode(&std::fs::read(dir.join(name)).unwrap(), ImageLimits::default()).unwrap();
            assert_eq!((n, width), (enc.image_tokens(&img), enc.config.out_width), "{name}");
            let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
            // Every kernel table this processor has: the f16 products and, where present, bf16's.
            for k in inferd_kernels::Kernels::all() {
                let got = enc.encode(&pool, &k, &img);
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / rms;
                let (tol, how) = if k.bf16.is_some() {
                    (EMBEDDING_TOL_BF16[family], "bf16")
                } else {
                    (EMBEDDING_TOL[family], "f16")
                };
                eprintln!("{name} ({:?}, {how}): {n} image tokens of {width}, at most {worst:.5} of their rms ({rms:.3}) from llama.cpp's", k.isa);
                assert!(worst < tol, "{name} ({:?}): {worst}", k.isa);
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A chat body asking `model` about `image` (a PNG, as a data: URL), greedy, with the
/// log-probability of each token.
fn ask(model: &str, image: &Path, question: &str) -> String {
    ask_images(model, &[image], question, 8)
}

/// A chat body asking `model` about `images` (PNGs, as data: URLs, before the question), greedy,
/// `max_tokens` tokens with the log-probability of each and of the two likeliest.
fn ask_images(model: &str, images: &[&Path], question: &str, max_tokens: usize) -> String {
    use base64::Engine as _;
    let mut parts: Vec<Value> = images
        .iter()
        .map(|i| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(std::fs::read(i).unwrap());
            serde_json::json!({ "type": "image_url", "image_url": { "url": format!("data:image/png;base64,{b64}") } })
        })
        .collect();
    parts.push(serde_json::json!({ "type": "text", "text": question }));
    serde_json::json!({
        "model": model,
        "messages": [{ "role": "user", "content": parts }],
        "max_tokens": max_tokens, "temperature": 0, "logprobs": true, "top_logprobs": 2,
    })
    .to_string()
}

/// An answer's tokens and their log-probabilities.
fn tokens(answer: &str) -> Vec<(String, f64)> {
    let v = json(answer);
    let content = v["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default();
    content.iter().map(|t| (t["token"].as_str().unwrap().to_owned(), t["logprob"].as_f64().unwrap())).collect()
}

/// How close each token's log-probability must be to llama-server's: the text tests'
/// tolerance for the tiny models (8-bit activations on both sides), the image embeddings'
/// own difference (at most 0.0078 of their rms) being far below it.
const LOGPROB_TOL: f64 = 0.1;

/// An answer's log-probability entries: each one's bytes, log-probability, and its second
/// likeliest alternative's bytes and log-probability.
fn entries(answer: &str) -> Vec<(Vec<u8>, f64, Vec<u8>, f64)> {
    let v = json(answer);
    let bytes = |t: &Value| -> Vec<u8> {
        t["bytes"]
            .as_array()
            .map(|b| b.iter().filter_map(|x| x.as_u64().map(|x| x as u8)).collect())
            .unwrap_or_default()
    };
    let content = v["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default();
    content
        .iter()
        .map(|t| {
            let second = t["top_logprobs"].get(1).cloned().unwrap_or_default();
            let lp = second["logprob"].as_f64().unwrap_or(f64::NEG_INFINITY);
            (bytes(t), t["logprob"].as_f64().unwrap(), bytes(&second), lp)
        })
        .collect()
}

/// How many of the greedy tokens the two answers share, and the most their log-probabilities
/// differ over those: all of them, or those before a step where llama-server's two likeliest
/// tokens lie within [`LOGPROB_TOL`] of each other and ours is its second (a tie that neither
/// side's rounding decides; it ends the comparison, since the texts differ from there). Any
/// other difference fails. llama-server writes the tokens that end inside a character as one
/// entry with the last one's log-probability, and a control token (such as `<s>`) with no
/// bytes: ours are grouped alike, and an entry without bytes stands for one of ours (its
/// log-probability still compared).
fn compare(name: &str, ours: &str, theirs: &str) -> (usize, f64) {
    let (a, b) = (entries(ours), entries(theirs));
    let (mut i, mut worst) = (0, 0f64);
    for (j, e) in b.iter().enumerate() {
        // Our tokens making up their entry j's bytes.
        let mut end = i;
        let mut got = Vec::new();
        while end < a.len() && got.len() < e.0.len() {
            got.extend_from_slice(&a[end].0);
            end += 1;
        }
        if e.0.is_empty() && i < a.len() {
            (got, end) = (Vec::new(), i + 1);
        }
        if got != e.0 {
            let second = e.2 == a[i].0 || (e.2.is_empty() && a[i].0.starts_with(b"<"));
            let tie = end == i + 1 && second && e.1 - e.3 <= LOGPROB_TOL;
            assert!(tie, "{name}: token {i} (entry {j}) differs and is no tie: {ours} vs {theirs}");
            return (i, worst);
        }
        worst = worst.max((a[end - 1].1 - e.1).abs());
        i = end;
    }
    assert_eq!(i, a.len(), "{name}: {ours} vs {theirs}");
    (i, worst)
}

/// OpenAI chat requests with an image (a `data:` URL content part), to inferd with the
/// projector paired (`[[model]] mmproj`) and to llama-server with `--mmproj`: the same greedy
/// tokens (up to a tie, [`compare`]), log-probabilities within [`LOGPROB_TOL`]; another image answers differently; the
/// same image sent again comes from the prefix cache (its tokens are keyed by its pixels) and
/// answers the same.
#[test]
fn chat_with_an_image_answers_as_llama_server() {
    let Some(bin) = super::remote::llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("vision-chat");
    let (model, mmproj) = tiny_vision(&dir);
    let cfg = vis_entry(&model, &mmproj);
    let d = Daemon::start(&dir, &cfg, &[]);
    let port = super::remote::free_port();
    let _server = super::remote::spawn_llama_server(
        &bin,
        model.to_str().unwrap(),
        port,
        &dir,
        &["-np", "1", "--mmproj", mmproj.to_str().unwrap(), "--no-warmup"],
    );
    let mut answers = Vec::new();
    let (mut worst, mut fewest) = (0f64, usize::MAX);
    for (name, question) in [("square.png", "What is this?"), ("wide.png", "What is this?"), ("square.png", "Again?")] {
        let body = ask("vis", &dir.join(name), question);
        let (st, ours) = d.http("POST", "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{ours}");
        let (st, theirs) = super::remote::tcp_http(port, "POST", "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{theirs}");
        let (shared, apart) = compare(name, &ours, &theirs);
        assert!(shared >= 6, "{name}: only {shared} tokens alike: {ours} vs {theirs}");
        (fewest, worst) = (fewest.min(shared), worst.max(apart));
        answers.push((tokens(&ours), json(&ours)["usage"].clone()));
    }
    eprintln!("vision chat: at least {fewest} of 8 tokens equal to llama-server's (then a tie), log-probabilities at most {worst:.4} apart");
    assert!(worst <= LOGPROB_TOL, "{worst}");
    // The image matters: another one changes the first token's log-probability.
    assert!((answers[0].0[0].1 - answers[1].0[0].1).abs() > 1e-3, "{:?} {:?}", answers[0].0, answers[1].0);
    // The same image again: its blocks are the prefix cache's (BOS, the turn's start, the
    // image's markers and 16 tokens come before the question).
    let cached = answers[2].1["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 16, "{:?}", answers[2].1);
    // The official clients: OpenAI's with a data: URL (chat, and an input_image to the
    // Responses API), Anthropic's with a base64 image block, Ollama's with a file in `images`
    // (chat and generate, the image before the text as llama.cpp places it): the same answer.
    let image = dir.join("square.png");
    let v = super::clients::python_client_with(&d, "vision_clients.py", &["vis", image.to_str().unwrap()]);
    let text: String = answers[0].0.iter().map(|t| t.0.as_str()).collect();
    for k in ["openai", "responses", "anthropic", "ollama_chat", "ollama_generate"] {
        assert_eq!(v[k].as_str(), Some(text.as_str()), "{k}: {v}");
    }
    // Ollama's apps offer images to models that list `vision`.
    assert!(v["capabilities"].as_array().unwrap().contains(&serde_json::json!("vision")), "{v}");
    // inferctl chat --image: the image with the first message (greedy by default).
    let (ok, out, err) = super::clients::inferctl(
        &d.socket,
        &["chat", "--model", "vis", "--max-tokens", "8", "--image", image.to_str().unwrap()],
        "What is this?\n",
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim_end_matches('\n'), text, "{out:?}");
    // A model without a projector refuses an image by name.
    let plain = format!("[[model]]\nname = \"text\"\npath = \"{}\"\n", model.display());
    let t = Daemon::start(&scratch("vision-none"), &plain, &[]);
    let (st, e) = t.http("POST", "/v1/chat/completions", &ask("text", &image, "What is this?"));
    assert!(st == 400 && e.contains("takes no images"), "{st} {e}");
    drop(t);
    drop(d);
    // Prefilled in chunks of 20 tokens, which would cut the image (its 16 positions see each
    // other both ways, so they run in one pass): the same answer, bit for bit (a position's
    // result does not depend on its batch).
    let small = scratch("vision-chunks");
    let d = Daemon::start(&small, &format!("[scheduler]\ntoken_budget = 20\n{cfg}"), &[]);
    let (st, chunked) = d.http("POST", "/v1/chat/completions", &ask("vis", &dir.join("square.png"), "What is this?"));
    assert_eq!(st, 200, "{chunked}");
    assert_eq!(tokens(&chunked), answers[0].0, "{chunked}");
    drop(d);
    let _ = std::fs::remove_dir_all(small);
    let _ = std::fs::remove_dir_all(dir);
}

/// Qwen2.5-VL (the tiny pair: dynamic resolution, windows, the patch merger, M-RoPE in the
/// language model), to inferd and to llama-server with `--mmproj`: the same greedy tokens (up
/// to a tie), log-probabilities within [`LOGPROB_TOL`], for an image of whole merged patches
/// (17 x 10 tokens), one resized (5 x 8), and both in one message, where the second image's
/// positions and the question's come after the first's (an image takes `max(w, h)` rotary
/// positions, not `w * h`: the layout is wrong if the answer matches only one image at a
/// time). The same image again comes from the prefix cache; prefilled 24 tokens a step (the
/// image's causal tokens cut between steps) the answer is the same bit for bit.
#[test]
fn qwen_vl_chat_answers_as_llama_server() {
    let dir = scratch("vision-qwen");
    let pair = tiny_qwen_vision(&dir);
    qwen_chat_as_llama_server("qwen2.5-vl", &dir, pair, (170, 40));
    let _ = std::fs::remove_dir_all(dir);
}

/// The same for Qwen3-VL (the tiny pair: learned positions resized, deepstack rows added
/// after the language model's first two layers, interleaved M-RoPE): landscape.png is 15 x 9
/// image tokens, odd.png 5 x 7. Without the deepstack rows, or with Qwen2-VL's sections, the
/// answers differ from llama-server's.
#[test]
fn qwen3_vl_chat_answers_as_llama_server() {
    let dir = scratch("vision-qwen3");
    let pair = tiny_qwen3_vision(&dir);
    qwen_chat_as_llama_server("qwen3-vl", &dir, pair, (135, 35));
    let _ = std::fs::remove_dir_all(dir);
}

/// [`qwen_vl_chat_answers_as_llama_server`]'s checks for the pair `(model, mmproj)` in `dir`,
/// whose images landscape.png and odd.png take `tokens` image tokens.
fn qwen_chat_as_llama_server(family: &str, dir: &Path, (model, mmproj): (PathBuf, PathBuf), tokens_of: (u64, u64)) {
    let Some(bin) = super::remote::llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let cfg = vis_entry(&model, &mmproj);
    let d = Daemon::start(dir, &cfg, &[]);
    let port = super::remote::free_port();
    let _server = super::remote::spawn_llama_server(
        &bin,
        model.to_str().unwrap(),
        port,
        dir,
        &["-np", "1", "--mmproj", mmproj.to_str().unwrap(), "--no-warmup"],
    );
    let (landscape, odd) = (dir.join("landscape.png"), dir.join("odd.png"));
    let asks: [(&str, Vec<&Path>); 4] = [
        ("landscape", vec![&landscape]),
        ("odd", vec![&odd]),
        ("both", vec![&landscape, &odd]),
        ("landscape again", vec![&landscape]),
    ];
    let (mut worst, mut fewest, mut answers) = (0f64, usize::MAX, Vec::new());
    for (name, images) in &asks {
        let body = ask_images("vis", images, "What is this?", 8);
        let (st, ours) = d.http("POST", "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{ours}");
        let (st, theirs) = super::remote::tcp_http(port, "POST", "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{theirs}");
        let (shared, apart) = compare(name, &ours, &theirs);
        assert!(shared >= 6, "{name}: only {shared} tokens alike: {ours} vs {theirs}");
        (fewest, worst) = (fewest.min(shared), worst.max(apart));
        let usage = &json(&ours)["usage"];
        answers.push((tokens(&ours), usage["prompt_tokens"].as_u64().unwrap_or(0), usage.clone()));
    }
    eprintln!("{family} chat: at least {fewest} of 8 tokens equal to llama-server's (then a tie), log-probabilities at most {worst:.4} apart");
    assert!(worst <= LOGPROB_TOL, "{worst}");
    // Each image takes its own number of tokens.
    assert_eq!(answers[0].1 - answers[1].1, tokens_of.0 - tokens_of.1, "{:?} {:?}", answers[0].2, answers[1].2);
    assert!((answers[0].0[0].1 - answers[1].0[0].1).abs() > 1e-3, "the image matters");
    let cached = answers[3].2["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= tokens_of.0, "{:?}", answers[3].2);
    drop(d);
    let small = scratch(&format!("{family}-chunks"));
    let d = Daemon::start(&small, &format!("[scheduler]\ntoken_budget = 24\n{cfg}"), &[]);
    let (st, chunked) =
        d.http("POST", "/v1/chat/completions", &ask_images("vis", &[&landscape, &odd], "What is this?", 8));
    assert_eq!(st, 200, "{chunked}");
    assert_eq!(tokens(&chunked), answers[2].0, "{chunked}");
    drop(d);
    let _ = std::fs::remove_dir_all(small);
}

/// A hub repository holding a vision model and two projectors: `inferctl pull` installs the
/// model and the F16 projector beside it as `NAME.mmproj.gguf`; the store pairs them (the
/// projector is no model of its own), so a chat with an image is answered and Ollama's show
/// lists `vision`; `inferctl rm` removes both. Ollama's `/api/pull` does the same through the
/// daemon.
#[test]
fn a_pulled_vision_model_brings_its_projector() {
    let dir = scratch("vision-pull");
    let (model, mmproj) = tiny_vision(&dir);
    let repo = dir.join("hub/org/vis-GGUF");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::copy(&model, repo.join("vis-Q8_0.gguf")).unwrap();
    std::fs::copy(&mmproj, repo.join("mmproj-F16.gguf")).unwrap();
    std::fs::write(repo.join("mmproj-F32.gguf"), b"not the one to take").unwrap();
    let (hub, endpoint) = super::store::hub(&dir.join("hub"), None);
    let store = dir.join("store");
    let cfg = format!("[server]\nmodel_store = \"{}\"\n", store.display());
    let d = Daemon::start(&dir, &cfg, &[("HF_ENDPOINT", &endpoint)]);
    let installed = || {
        let m = std::fs::read(store.join("vis-Q8_0.gguf")).ok() == std::fs::read(&model).ok();
        let p = std::fs::read(store.join("vis-Q8_0.mmproj.gguf")).ok() == std::fs::read(&mmproj).ok();
        (m, p)
    };
    let answers = |d: &Daemon| {
        let (st, b) =
            d.http("POST", "/v1/chat/completions", &ask("vis-Q8_0", &dir.join("square.png"), "What is this?"));
        assert_eq!(st, 200, "{b}");
        let (st, show) = d.http("POST", "/api/show", r#"{"model": "vis-Q8_0"}"#);
        assert!(
            st == 200 && json(&show)["capabilities"].as_array().unwrap().contains(&serde_json::json!("vision")),
            "{show}"
        );
        assert_eq!(super::store::ids(d), ["vis-Q8_0"], "the projector is no model");
    };

    let (ok, out, err) = super::store::pull(&["pull", "hf:org/vis-GGUF"], &endpoint, &d.socket);
    assert!(
        ok && out.contains("vis-Q8_0: installed at ") && out.contains("vis-Q8_0.mmproj: installed at "),
        "{out}{err}"
    );
    assert_eq!(installed(), (true, true));
    answers(&d);
    let (ok, out, err) = super::store::pull(&["rm", "vis-Q8_0"], &endpoint, &d.socket);
    assert!(ok, "{out}{err}");
    assert!(!store.join("vis-Q8_0.gguf").exists() && !store.join("vis-Q8_0.mmproj.gguf").exists());

    // Ollama's pull, the daemon fetching both.
    let (st, b) = d.http("POST", "/api/pull", r#"{"model": "hf.co/org/vis-GGUF", "stream": false}"#);
    assert!(st == 200 && b.contains("success"), "{st} {b}");
    assert_eq!(installed(), (true, true));
    answers(&d);
    drop(d);
    drop(hub);
    let _ = std::fs::remove_dir_all(dir);
}

/// A static file server on 127.0.0.1 (Python's), killed when dropped.
struct Files(Child);

impl Drop for Files {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `[server] fetch_images`: off (the default), an `http://` image URL is a 400 that names the
/// setting; on, the daemon fetches it and answers as for the same image sent inline, through
/// OpenAI chat, the Responses API's `input_image` and an Anthropic `url` source; a URL that
/// answers 404 is a 400 naming it.
#[test]
fn image_urls_are_fetched_only_where_the_config_allows() {
    let dir = scratch("vision-fetch");
    let (model, mmproj) = tiny_vision(&dir);
    let port = super::remote::free_port();
    let files = Files(
        Command::new("python3")
            .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the file server", Duration::from_secs(10), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    let url = format!("http://127.0.0.1:{port}/square.png");
    let entry = vis_entry(&model, &mmproj);
    let chat = |url: &str| {
        serde_json::json!({ "model": "vis", "max_tokens": 8, "temperature": 0, "messages": [{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": url } }, { "type": "text", "text": "What is this?" },
        ]}]})
        .to_string()
    };
    let text = |b: &str| json(b)["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();

    let off = Daemon::start(&scratch("vision-fetch-off"), &entry, &[]);
    let (st, b) = off.http("POST", "/v1/chat/completions", &chat(&url));
    assert!(st == 400 && b.contains("fetch_images"), "{st} {b}");
    let (st, inline) = off.http("POST", "/v1/chat/completions", &ask("vis", &dir.join("square.png"), "What is this?"));
    assert_eq!(st, 200, "{inline}");
    let want = text(&inline);
    assert!(!want.is_empty(), "{inline}");
    drop(off);

    let on = Daemon::start(&dir, &format!("[server]\nfetch_images = true\n{entry}"), &[]);
    let (st, b) = on.http("POST", "/v1/chat/completions", &chat(&url));
    assert!(st == 200 && text(&b) == want, "OpenAI chat: {st} {b}");
    let responses = serde_json::json!({ "model": "vis", "max_output_tokens": 8, "temperature": 0, "input": [{ "role": "user",
        "content": [{ "type": "input_image", "image_url": url }, { "type": "input_text", "text": "What is this?" }] }] });
    let (st, b) = on.http("POST", "/v1/responses", &responses.to_string());
    let v = json(&b);
    let said = v["output"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|o| o["type"] == "message")
        .map(|m| m["content"][0]["text"].clone());
    assert!(st == 200 && said == Some(serde_json::json!(want)), "Responses: {st} {b}");
    let anthropic = serde_json::json!({ "model": "vis", "max_tokens": 8, "temperature": 0, "messages": [{ "role": "user",
        "content": [{ "type": "image", "source": { "type": "url", "url": url } }, { "type": "text", "text": "What is this?" }] }] });
    let (st, b) = on.http("POST", "/v1/messages", &anthropic.to_string());
    assert!(st == 200 && json(&b)["content"][0]["text"] == serde_json::json!(want), "Anthropic: {st} {b}");
    let missing = format!("http://127.0.0.1:{port}/missing.png");
    let (st, b) = on.http("POST", "/v1/chat/completions", &chat(&missing));
    assert!(st == 400 && b.contains("missing.png") && b.contains("404"), "{st} {b}");
    drop(on);
    drop(files);
    let _ = std::fs::remove_dir_all(dir);
}

/// Images over D-Bus: Chat's `images` option, `a(uh)` (a message index and a file descriptor),
/// so a sandboxed app passes pixels without a path. A file descriptor of the image answers as
/// HTTP does for the same image; a pipe, a message index past the end and `images` on Generate
/// are refused by name.
#[test]
fn dbus_chat_takes_images_as_file_descriptors() {
    use std::collections::HashMap;
    use std::os::fd::AsFd;
    use zbus::zvariant::{Fd, Value as V};
    let dir = scratch("vision-dbus");
    let (model, mmproj) = tiny_vision(&dir);
    let bus = super::dbus::Bus::start(&dir);
    let entry = vis_entry(&model, &mmproj);
    let d = Daemon::start(&dir, &entry, &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    bus.wait_for_name();
    let (st, http) = d.http("POST", "/v1/chat/completions", &ask("vis", &dir.join("square.png"), "What is this?"));
    assert_eq!(st, 200, "{http}");
    let want = json(&http)["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let question = vec![HashMap::from([("role", "user"), ("content", "What is this?")])];
    let image = std::fs::File::open(dir.join("square.png")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let caller = zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap();
        let with = |fd: Fd<'static>, at: u32| {
            HashMap::from([("max_tokens", V::U32(8)), ("temperature", V::F64(0.0)), ("images", V::new(vec![(at, fd)]))])
        };
        let owned = |f: &dyn AsFd| Fd::from(f.as_fd().try_clone_to_owned().unwrap());
        let heard = super::dbus::signals(&caller, "Chat", &("vis", &question, &with(owned(&image), 0))).await;
        assert_eq!(heard.reason, "length");
        assert_eq!(heard.text, want, "the same answer as HTTP's");
        let call = |method: &'static str, opts: HashMap<&'static str, V<'static>>| {
            let c = caller.clone();
            let q = question.clone();
            async move {
                let r = if method == "Chat" {
                    c.call_method(
                        Some("org.inferd.Inference1"),
                        "/org/inferd/Inference1",
                        Some("org.inferd.Inference1"),
                        method,
                        &("vis", &q, &opts),
                    )
                    .await
                } else {
                    c.call_method(
                        Some("org.inferd.Inference1"),
                        "/org/inferd/Inference1",
                        Some("org.inferd.Inference1"),
                        method,
                        &("vis", "Hi", &opts),
                    )
                    .await
                };
                r.err().map(|e| e.to_string()).unwrap_or_default()
            }
        };
        let (reader, _writer) = std::io::pipe().unwrap();
        let e = call("Chat", with(owned(&reader), 0)).await;
        assert!(e.contains("no file or memfd"), "{e}");
        let e = call("Chat", with(owned(&image), 1)).await;
        assert!(e.contains("names message 1 of 1"), "{e}");
        let e = call("Generate", with(owned(&image), 0)).await;
        assert!(e.contains("images is an option of Chat"), "{e}");
    });
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}

/// Several images and a text request in the same engine steps: two image requests (each image
/// encoded when its prefill reaches it) and a text-only one sent at once get, token for token
/// and log-probability for log-probability, what each gets alone (a position's result does not
/// depend on its batch).
#[test]
fn image_and_text_requests_batch_together_as_each_alone() {
    let dir = scratch("vision-batch");
    let (model, mmproj) = tiny_vision(&dir);
    let entry = vis_entry(&model, &mmproj);
    let text = serde_json::json!({ "model": "vis", "max_tokens": 8, "temperature": 0, "logprobs": true,
        "messages": [{ "role": "user", "content": "Tell me about squares." }] })
    .to_string();
    let bodies =
        [ask("vis", &dir.join("square.png"), "What is this?"), ask("vis", &dir.join("wide.png"), "And this?"), text];
    let answer = |socket: &Path, body: &str| {
        let (st, b) = super::http(socket, "POST", "/v1/chat/completions", body);
        assert_eq!(st, 200, "{b}");
        tokens(&b)
    };
    // Alone: a daemon per request, so none finds another's blocks in its prefix cache.
    let alone: Vec<Vec<(String, f64)>> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let d = Daemon::start(&scratch(&format!("vision-batch-{i}")), &entry, &[]);
            answer(&d.socket, b)
        })
        .collect();
    // Together, prefilled 24 tokens a step, so the three prompts (about 44 tokens each) share
    // steps with each other and with the first answers' decoding.
    let d = Daemon::start(&dir, &format!("[scheduler]\ntoken_budget = 24\n{entry}"), &[]);
    let together: Vec<Vec<(String, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies.iter().map(|b| s.spawn(|| answer(&d.socket, b))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert!(!a.is_empty(), "request {i}");
        assert_eq!(a, t, "request {i}: alone {a:?}, together {t:?}");
    }
    assert_ne!(alone[0], alone[1], "the images answer differently");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// An image encodes on the encoder's own thread, beside the steps: text requests go on being
/// answered while it does (encoded inside a step, everything would stop for the whole encoding,
/// seconds here and 25 seconds for a 4B model's encoder), and the image's answer is the one it
/// gets alone.
#[test]
fn an_image_encoding_holds_up_no_other_request() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::sync::Mutex;
    let dir = scratch("vision-background");
    let (model, _) = tiny_vision(&dir);
    // 4,096 patches through four layers of width 256: seconds on two cores.
    let entry = vis_entry(&model, &dir.join("tiny-gemma3-vision-slow-mmproj.gguf"));
    let image = ask("vis", &dir.join("square.png"), "What is this?");
    let alone = Daemon::start(&scratch("vision-background-alone"), &entry, &[]);
    let t = Instant::now();
    let (st, want) = super::http(&alone.socket, "POST", "/v1/chat/completions", &image);
    let alone_took = t.elapsed();
    assert_eq!(st, 200, "{want}");
    drop(alone);
    let d = Daemon::start(&dir, &entry, &[]);
    // A client asking short text questions one after another, until told to stop.
    let text = serde_json::json!({ "model": "vis", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0 })
        .to_string();
    let (answered, stop) = (Mutex::new(Vec::new()), AtomicBool::new(false));
    let (t0, t1, got) = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Relaxed) {
                let (st, b) = super::http(&d.socket, "POST", "/v1/completions", &text);
                assert_eq!(st, 200, "{b}");
                answered.lock().unwrap().push(Instant::now());
            }
        });
        wait_for("the text client's first answers", Duration::from_secs(30), || answered.lock().unwrap().len() >= 3);
        let t0 = Instant::now();
        let (st, got) = super::http(&d.socket, "POST", "/v1/chat/completions", &image);
        let t1 = Instant::now();
        stop.store(true, Relaxed);
        assert_eq!(st, 200, "{got}");
        (t0, t1, got)
    });
    let during = answered.lock().unwrap().iter().filter(|&&t| t0 < t && t < t1).count();
    eprintln!("image alone {alone_took:.2?}, beside the text client {:.2?}; text answers meanwhile: {during}", t1 - t0);
    assert_eq!(tokens(&got), tokens(&want), "the image's answer beside the text requests");
    // Encoded in a step, the text answers would stop for the whole encoding: the one under
    // way when the image came, perhaps one more.
    assert!(during >= 20, "{during} text answers came while the image request ran");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
