//! OpenAI chat messages as the library's `ChatMessage`s: each message must be an object with a
//! string `role`; its `content` may be a string, null (rendered as "") or a list of text parts
//! (`[{"type": "text", "text": ...}]`, joined); `tool_calls`, `tool_call_id`,
//! `reasoning_content` and `name` keep their meaning, any other field reaches the template as
//! it is. A message that breaks these rules gets a 400 naming its field (`messages[i].content`).

use metrale::chat::ChatMessage;
use serde_json::Value;

use super::error::ApiError;

/// The request's `messages`, checked and converted.
pub fn chat_messages(messages: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(i, m))
        .collect()
}

fn chat_message(i: usize, message: &Value) -> Result<ChatMessage, ApiError> {
    let field = |f: &str| format!("messages[{i}].{f}");
    let Some(obj) = message.as_object() else {
        let at = format!("messages[{i}]");
        return Err(ApiError::invalid(
            format!("{at} is not an object"),
            Some(&at),
        ));
    };
    if !obj.get("role").is_some_and(Value::is_string) {
        let f = field("role");
        return Err(ApiError::invalid(
            format!("`{f}` must be a string"),
            Some(&f),
        ));
    }
    let content = match obj.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_of_parts(parts, |j| field(&format!("content[{j}]")))?,
        Some(_) => {
            let f = field("content");
            return Err(ApiError::invalid(
                format!("`{f}` must be a string or a list of text parts"),
                Some(&f),
            ));
        }
    };
    let mut obj = obj.clone();
    obj.insert("content".into(), Value::String(content));
    serde_path_to_error::deserialize(Value::Object(obj)).map_err(|e| {
        let f = field(&e.path().to_string());
        ApiError::invalid(format!("`{f}`: {}", e.into_inner()), Some(&f))
    })
}

/// The text of `[{"type": "text", "text": ...}, ...]`; `field(j)` names part `j`.
fn text_of_parts(parts: &[Value], field: impl Fn(usize) -> String) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => text.push_str(t),
            _ => {
                let f = field(j);
                return Err(ApiError::invalid(
                    format!("`{f}` must be a text part, {{\"type\": \"text\", \"text\": ...}}"),
                    Some(&f),
                ));
            }
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_are_joined_null_content_is_empty_and_other_fields_are_kept() {
        let got = chat_messages(&[
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c"}], "lang": "en"}),
        ])
        .expect("valid messages");
        let want = vec![
            ChatMessage::system("be brief"),
            ChatMessage::user("hi there"),
            ChatMessage::assistant("")
                .tool_calls(vec![json!({"id": "c"})])
                .extra("lang", "en"),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn a_bad_message_is_a_400_naming_its_field() {
        for (bad, param) in [
            (json!("user"), "messages[0]"),
            (json!({"content": "x"}), "messages[0].role"),
            (json!({"role": "user", "content": 3}), "messages[0].content"),
            (
                json!({"role": "user", "content": [{"type": "image_url"}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"role": "tool", "content": "x", "tool_call_id": 5}),
                "messages[0].tool_call_id",
            ),
        ] {
            let e = chat_messages(std::slice::from_ref(&bad)).expect_err("bad message");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {e}");
        }
        let e = chat_messages(&[]).expect_err("no messages");
        assert_eq!(e.param.as_deref(), Some("messages"));
    }
}
