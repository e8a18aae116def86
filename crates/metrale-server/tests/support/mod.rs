//! The harness of `serve.rs`: an in-process server on 127.0.0.1 (port 0) over a checkpoint on
//! the CPU, a minimal HTTP/1.1 client, and the comparisons with `Engine::generate`.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale::{
    Engine, EngineMetrics, EngineOptions, GenerateOutput, GenerateRequest, ModelOptions, Prompt,
    SamplingParams,
};
use metrale_server::{AppState, GenerationConfig, ServerOptions, router};
use serde_json::{Value, json};

/// Every socket read gives up after this, so a hung server fails the test instead of hanging it.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Server {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    /// Dropping it stops the server.
    _runtime: tokio::runtime::Runtime,
}

/// The test checkpoint `name`: under `tests/fixtures` of the working directory when there is one
/// (the GPU bundle runs its test binaries from the tree's root), else of the workspace.
pub fn fixture(name: &str) -> PathBuf {
    let here = PathBuf::from("tests/fixtures");
    let root = if here.is_dir() {
        here
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
    };
    root.join(name)
}

/// The tiny dense checkpoint (tokenizer, no chat template).
pub fn tiny() -> PathBuf {
    fixture("qwen3-tiny")
}

pub fn options() -> EngineOptions {
    EngineOptions::default().model(
        ModelOptions::default()
            .max_batch_tokens(32)
            .max_decode_seqs(8),
    )
}

pub fn start_with(dir: &Path, options: EngineOptions) -> Server {
    start_from(dir, options, GenerationConfig::Auto)
}

/// A server whose requests' omitted sampling fields come from `generation`.
pub fn start_from(dir: &Path, options: EngineOptions, generation: GenerationConfig) -> Server {
    let engine = Arc::new(Engine::load(dir, options).unwrap());
    let state = AppState::new(engine.clone(), ServerOptions::new(dir).model_id())
        .generation_config(generation);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_io()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    runtime.spawn(async move { axum::serve(listener, router(Arc::new(state))).await });
    Server {
        addr,
        engine,
        _runtime: runtime,
    }
}

pub fn start() -> Server {
    start_with(&tiny(), options())
}

/// An HTTP response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent-event body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                    .to_string()
            })
            .collect()
    }
}

pub fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(b) = body {
        req += &format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        );
    }
    req += "\r\n";
    req += body.unwrap_or("");
    s.write_all(req.as_bytes()).unwrap();
    s
}

pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Reply {
    let mut s = send(addr, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse_reply(&raw)
}

pub fn post(server: &Server, path: &str, body: &Value) -> Reply {
    http(server.addr, "POST", path, Some(&body.to_string()))
}

pub fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block");
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

pub fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size");
        let size =
            usize::from_str_radix(std::str::from_utf8(&raw[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[eol + 2..eol + 2 + size]);
        raw = &raw[eol + 2 + size + 2..];
    }
}

/// Wait (bounded) until `done` requests have finished (or failed) and nothing runs or waits.
/// The engine records its metrics after each step, a moment after it sends the step's events,
/// so a client can have its whole response before the metrics count it.
pub fn wait_idle(engine: &Engine, done: u64) -> EngineMetrics {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = engine.metrics();
        if m.requests.finished + m.requests.failed >= done
            && m.requests.running == 0
            && m.requests.queued == 0
        {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "the engine never went idle after {done} requests: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn token_ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// A completion response's choice must be `want`.
pub fn assert_completion(reply: &Reply, want: &GenerateOutput, what: &str) {
    assert_eq!(reply.status, 200, "{what}: {}", reply.body);
    let v = reply.json();
    assert_eq!(v["object"], "text_completion", "{what}");
    let choice = &v["choices"][0];
    assert_eq!(
        token_ids(&choice["token_ids"]),
        want.token_ids,
        "{what}: tokens"
    );
    assert_eq!(
        choice["text"].as_str().unwrap(),
        want.text.as_deref().unwrap(),
        "{what}: text"
    );
    assert_eq!(
        choice["finish_reason"],
        want.finish_reason.as_str(),
        "{what}: finish reason"
    );
    assert_eq!(
        v["usage"],
        json!({
            "prompt_tokens": want.prompt_ids.len(),
            "completion_tokens": want.token_ids.len(),
            "total_tokens": want.prompt_ids.len() + want.token_ids.len(),
        }),
        "{what}: usage"
    );
}

pub fn greedy(prompt: Prompt, max_new_tokens: usize) -> GenerateRequest {
    GenerateRequest::new(prompt)
        .max_new_tokens(max_new_tokens)
        .sampling(SamplingParams::default())
}

/// The token ids, text and finish reason of a completion stream, checking its shape.
pub fn collect_stream(reply: &Reply, chat: bool) -> (Vec<u32>, String, String, Option<Value>) {
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        reply
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream"),
        "{:?}",
        reply.headers
    );
    let events = reply.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let (mut ids, mut text, mut finish, mut usage) = (Vec::new(), String::new(), None, None);
    for (i, e) in events[..events.len() - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap();
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        assert_eq!(v["object"], object, "{e}");
        assert!(
            finish.is_none() || v["choices"] == json!([]),
            "a chunk after the last: {e}"
        );
        if v["choices"] == json!([]) {
            usage = Some(v["usage"].clone());
            continue;
        }
        let choice = &v["choices"][0];
        ids.extend(token_ids(&choice["token_ids"]));
        if chat {
            if i == 0 {
                assert_eq!(choice["delta"]["role"], "assistant", "{e}");
            }
            text += choice["delta"]["content"].as_str().unwrap_or("");
        } else {
            text += choice["text"].as_str().unwrap();
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (ids, text, finish.expect("a finish reason"), usage)
}

/// A copy of the bundled checkpoint with a chat template.
pub fn chat_checkpoint(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let config = json!({
        "bos_token": "<s>",
        "eos_token": {"content": "<|endoftext|>", "special": true},
        "chat_template": template,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// Check Prometheus text exposition: HELP/TYPE before each family's samples, valid names,
/// numeric values, counters named `_total`. Returns the samples.
pub fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    let valid_name = |n: &str| {
        !n.is_empty()
            && n.chars().enumerate().all(|(i, c)| {
                c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
            })
    };
    let mut typed: Vec<(String, String)> = Vec::new();
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kw, name, value) = (
                parts.next().unwrap(),
                parts.next().unwrap(),
                parts.next().unwrap_or(""),
            );
            assert!(valid_name(name), "{line}");
            match kw {
                "HELP" => assert!(!value.is_empty(), "{line}"),
                "TYPE" => {
                    assert!(["counter", "gauge"].contains(&value), "{line}");
                    assert_eq!(value == "counter", name.ends_with("_total"), "{line}");
                    typed.push((name.to_string(), value.to_string()));
                }
                _ => panic!("unknown comment: {line}"),
            }
            continue;
        }
        let (name, value) = line.split_once(' ').unwrap_or_else(|| panic!("{line}"));
        assert!(valid_name(name), "{line}");
        assert!(
            typed.iter().any(|(n, _)| n == name),
            "{name} has no TYPE before it"
        );
        let v: f64 = value.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(v.is_finite() && v >= 0.0, "{line}");
        samples.push((name.to_string(), v));
    }
    let names: HashSet<&str> = samples.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), samples.len(), "a sample twice");
    samples
}
