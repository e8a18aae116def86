//! `metrale serve` driven by the official `openai` Python client (`tests/openai_client/
//! check_client.py`) on a tiny random-weight Qwen3 with the real tokenizer and chat template:
//! chat, streaming, forced tool calls, a JSON-schema response format, `n` choices and `best_of`
//! as users call them.
//!
//! The Python interpreter with `openai` installed is named by `METRALE_OPENAI_PYTHON` (CI makes
//! a virtual environment with a pinned `openai`); without it the test says so and checks nothing
//! else.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

#[test]
fn the_openai_python_client_drives_the_server() {
    let Some(python) = std::env::var_os("METRALE_OPENAI_PYTHON") else {
        eprintln!("METRALE_OPENAI_PYTHON is not set: the openai client check is skipped");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    metrale_testkit::checkpoint::write_qwen3_chat(dir.path(), 13).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args([
            "serve",
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--max-seq-len",
            "1024",
        ])
        .arg("--model")
        .arg(dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(url.starts_with("http://"), "{line}");
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/openai_client/check_client.py");
    let out = Command::new(python)
        .arg(script)
        .arg(format!("{url}/v1"))
        .arg("tiny")
        .output()
        .unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("passed, 0 failed"), "{stdout}");
}
