//! Chat templates through the engine: `Engine::load` finds the checkpoint's template and special
//! tokens, `apply_chat_template` renders a conversation as transformers would, and a checkpoint
//! without a template, or with one that does not compile, gets a typed error naming it.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;

use metrale::chat::{ChatMessage, ChatOptions, ChatTemplateError};
use metrale::{Engine, EngineError, EngineOptions, GenerateRequest};
use serde_json::json;
use support::fixtures_dir;

/// A copy of the tiny checkpoint with `tokenizer_config` as its `tokenizer_config.json`.
fn with_config(tokenizer_config: serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
    dir
}

fn copy_tiny(dst: &Path) {
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(fixtures_dir().join("qwen3-tiny").join(name), dst.join(name)).unwrap();
    }
}

#[test]
fn the_engine_renders_the_checkpoint_s_template_with_its_special_tokens() {
    let template = "{{ bos_token }}{% for m in messages %}\n<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}{% endfor %}\n{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is false %}<think></think>{% endif %}{% endif %}";
    let dir = with_config(json!({
        "bos_token": "<s>",
        "eos_token": {"content": "<|endoftext|>", "special": true},
        "chat_template": template,
    }));
    let engine = Engine::load(dir.path(), EngineOptions::default()).unwrap();
    let t = engine.chat_template().expect("the checkpoint's template");
    assert_eq!((t.bos(), t.eos()), ("<s>", "<|endoftext|>"));
    let messages = [
        ChatMessage::system("Be terse. "),
        ChatMessage::user("Name a colour"),
    ];
    let rendered = engine
        .apply_chat_template(&messages, &ChatOptions::default())
        .unwrap();
    let conversation = "<s><|system|>Be terse.<|endoftext|><|user|>Name a colour<|endoftext|>";
    assert_eq!(rendered, format!("{conversation}<|assistant|>"));
    let no_thinking = ChatOptions::default().kwarg("enable_thinking", false);
    assert_eq!(
        engine.apply_chat_template(&messages, &no_thinking).unwrap(),
        format!("{conversation}<|assistant|><think></think>")
    );
    let no_prompt = ChatOptions::default().add_generation_prompt(false);
    assert_eq!(
        engine.apply_chat_template(&messages, &no_prompt).unwrap(),
        conversation
    );
    // The rendered text is a prompt like any other.
    let out = engine
        .generate(
            &GenerateRequest::new(rendered.as_str())
                .max_new_tokens(3)
                .ignore_eos(true),
        )
        .unwrap();
    assert_eq!(out.prompt_ids, engine.encode(&rendered).unwrap());
    assert_eq!(out.token_ids.len(), 3);
}

#[test]
fn no_template_and_a_broken_template_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    let engine = Engine::load(dir.path(), EngineOptions::default()).unwrap();
    assert!(engine.chat_template().is_none());
    let e = engine
        .apply_chat_template(&[ChatMessage::user("hi")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(e, ChatTemplateError::NoTemplate), "{e:?}");
    drop(engine);

    let broken = with_config(json!({"chat_template": "{% for m in messages %}"}));
    match Engine::load(broken.path(), EngineOptions::default()) {
        Err(EngineError::ChatTemplate(e @ ChatTemplateError::Compile { .. })) => {
            assert!(e.to_string().contains("tokenizer_config.json"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

/// The real Qwen3 template (`tests/fixtures/qwen3-chat`) renders every conversation of
/// `rendered.json` (tools, assistant tool calls, tool results, reasoning, thinking off) byte for
/// byte as transformers' `apply_chat_template` does, and teaches the JSON tool-call format.
#[test]
fn the_real_qwen3_template_renders_tools_and_calls_as_transformers_does() {
    use metrale::chat::{ChatTemplate, ToolCallFormat};
    let dir = fixtures_dir().join("qwen3-chat");
    let template = ChatTemplate::load(&dir).unwrap().expect("a template");
    let source: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let format = ToolCallFormat::of_template(source["chat_template"].as_str().unwrap());
    assert_eq!(format, Some(ToolCallFormat::Json));
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rendered.json")).unwrap()).unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let text = |k: &str| m[k].as_str().unwrap_or_default().to_string();
                let mut message = ChatMessage::new(text("role"), text("content"));
                if let Some(calls) = m["tool_calls"].as_array() {
                    message = message.tool_calls(calls.clone());
                }
                if m.get("tool_call_id").is_some() {
                    message = message.tool_call_id(text("tool_call_id"));
                }
                if m.get("reasoning_content").is_some() {
                    message = message.reasoning_content(text("reasoning_content"));
                }
                message
            })
            .collect();
        let mut options = ChatOptions::default()
            .add_generation_prompt(case["add_generation_prompt"].as_bool().unwrap())
            .kwargs(case["kwargs"].as_object().unwrap().clone());
        if !case["tools"].is_null() {
            options = options.kwarg("tools", case["tools"].clone());
        }
        let got = template.render(&messages, &options).unwrap();
        assert_eq!(got, case["rendered"].as_str().unwrap(), "{}", case["name"]);
    }
}
