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
