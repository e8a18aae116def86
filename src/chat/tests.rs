//! Rendering as Jinja2 renders for transformers, the template's sources in a checkpoint, and
//! each error naming what failed.

#![allow(clippy::unwrap_used)]

use serde_json::json;

use super::*;

fn template(source: &str) -> ChatTemplate {
    ChatTemplate::new(source)
        .expect("compiles")
        .bos_token("<s>")
        .eos_token("</s>")
}

#[test]
fn renders_like_jinja2_with_trimmed_blocks_and_python_methods() {
    let t = template(
        "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'system' %}\n[{{ m.content.strip() }}]\n  {% else %}\n<{{ m.role }}>{{ m.content }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}<assistant>{% endif %}",
    );
    let messages = [ChatMessage::system("  be brief "), ChatMessage::user("hi")];
    let out = t.render(&messages, &ChatOptions::default()).unwrap();
    assert_eq!(out, "<s>[be brief]\n<user>hi</s>\n<assistant>");
    let no_prompt = ChatOptions::default().add_generation_prompt(false);
    assert_eq!(
        t.render(&messages, &no_prompt).unwrap(),
        "<s>[be brief]\n<user>hi</s>\n"
    );
}

#[test]
fn tool_and_reasoning_fields_reach_the_template_only_when_set() {
    let t = template(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\
         {% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}\
         {% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }}]{% endfor %}{% endif %}\
         {% if m.tool_call_id is defined %}#{{ m.tool_call_id }}{% endif %}\
         {{ m.lang | default('') }};{% endfor %}{{ tools | length }}",
    );
    let call =
        json!({"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}});
    let messages = [
        ChatMessage::user("time?").extra("lang", "en"),
        ChatMessage::assistant("")
            .reasoning_content("ask the clock")
            .tool_calls(vec![call]),
        ChatMessage::new("tool", "12:00").tool_call_id("c1"),
    ];
    let options = ChatOptions::default().kwarg("tools", json!([{"name": "now"}]));
    assert_eq!(
        t.render(&messages, &options).unwrap(),
        "user:time?en;assistant:<think>ask the clock</think>[now];tool:12:00#c1;1"
    );
}

#[test]
fn raise_exception_kwargs_and_empty_conversations() {
    let t = template(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok{{ flag }}",
    );
    let e = t
        .render(&[ChatMessage::assistant("x")], &ChatOptions::default())
        .expect_err("raises");
    assert!(matches!(e, ChatTemplateError::Render { .. }), "{e:?}");
    assert!(e.to_string().contains("first must be user"), "{e}");
    let options = ChatOptions::default().kwarg("flag", 7);
    assert_eq!(t.render(&[ChatMessage::user("")], &options).unwrap(), "ok7");
    assert!(matches!(
        t.render(&[], &options),
        Err(ChatTemplateError::NoMessages)
    ));
}

#[test]
fn messages_deserialize_from_openai_json_with_extra_fields_kept() {
    let m: ChatMessage = serde_json::from_value(json!({
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"id": "1"}],
        "reasoning_content": "because",
        "weight": 2,
    }))
    .unwrap();
    let want = ChatMessage::assistant("ok")
        .tool_calls(vec![json!({"id": "1"})])
        .reasoning_content("because")
        .extra("weight", 2);
    assert_eq!(m, want);
    let bare: ChatMessage = serde_json::from_value(json!({"role": "user"})).unwrap();
    assert_eq!(bare, ChatMessage::user(""));
    assert!(serde_json::from_value::<ChatMessage>(json!({"content": "x"})).is_err());
}

#[test]
fn a_template_that_does_not_compile_is_refused_naming_its_file() {
    let e = ChatTemplate::new("{% for %}").expect_err("syntax error");
    assert!(matches!(e, ChatTemplateError::Compile { .. }), "{e:?}");

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tokenizer_config.json");
    std::fs::write(&config, json!({"chat_template": "{% if %}"}).to_string()).unwrap();
    let e = ChatTemplate::load(dir.path()).expect_err("syntax error");
    assert!(e.to_string().contains("tokenizer_config.json"), "{e}");
}

#[test]
fn a_checkpoint_s_template_and_special_tokens_come_from_its_files() {
    let dir = tempfile::tempdir().unwrap();
    assert!(ChatTemplate::load(dir.path()).unwrap().is_none());

    // chat_template.jinja, when tokenizer_config.json has no template.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
    )
    .unwrap();
    let config = dir.path().join("tokenizer_config.json");
    let tokens = json!({"bos_token": "<b>", "eos_token": {"content": "<e>", "special": true}});
    std::fs::write(&config, tokens.to_string()).unwrap();
    let t = ChatTemplate::load(dir.path()).unwrap().unwrap();
    let hi = [ChatMessage::user("hi")];
    assert_eq!(t.render(&hi, &ChatOptions::default()).unwrap(), "<b>hi<e>");
    assert_eq!((t.bos(), t.eos()), ("<b>", "<e>"));

    // tokenizer_config.json's template wins; of a list, the one named `default`.
    let listed = json!({"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ messages | length }}"},
    ]});
    std::fs::write(&config, listed.to_string()).unwrap();
    let t = ChatTemplate::load(dir.path()).unwrap().unwrap();
    assert_eq!(t.render(&hi, &ChatOptions::default()).unwrap(), "default 1");

    for (bad, names) in [
        (json!({"chat_template": 3}), "`chat_template`"),
        (
            json!({"chat_template": [{"name": "x", "template": "y"}]}),
            "`default`",
        ),
        (json!({"chat_template": "x", "eos_token": 5}), "`eos_token`"),
        (
            json!({"chat_template": "x", "bos_token": {"content": 1}}),
            "`bos_token.content`",
        ),
    ] {
        std::fs::write(&config, bad.to_string()).unwrap();
        let e = ChatTemplate::load(dir.path()).expect_err("bad config");
        assert!(matches!(e, ChatTemplateError::Config { .. }), "{e:?}");
        assert!(e.to_string().contains(names), "{e}");
    }
    std::fs::write(&config, "[1, 2]").unwrap();
    let e = ChatTemplate::load(dir.path()).expect_err("not an object");
    assert!(e.to_string().contains("not a JSON object"), "{e}");
}
