//! The grammar of a forced tool call: for `ToolChoice::Required` (any declared function, one
//! call or, with parallel calls, several) and `ToolChoice::Function` (that one, once), a Lark
//! grammar (llguidance's dialect) of the `<tool_call>` markup in the checkpoint's format around
//! arguments that follow the function's parameter schema:
//! - JSON (Qwen3): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, the object a
//!   `%json` schema whose `name` is the function's and whose `arguments` is its parameters'
//!   (declared parameters only, unless the schema sets `additionalProperties`);
//! - XML (Qwen3.5): `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n...
//!   </function>\n</tool_call>`, the declared parameters in order (the required ones always),
//!   a string's value one line of text without `<` (a forced call's strings hold no line
//!   break: the line break before `</parameter>` ends them), any other value JSON under its
//!   schema.
//!
//! When the prompt opened a think block, the answer first closes it (`</think>\n\n`).

use serde_json::{Value, json};

use super::output::ToolCallFormat;
use super::request::Tool;

/// The grammar of calls of `tools` in `format`: one call, or one or more when `several`.
pub(crate) fn tool_call_grammar(
    tools: &[&Tool],
    format: ToolCallFormat,
    several: bool,
    in_reasoning: bool,
) -> String {
    let mut g = String::new();
    let calls = if several {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    let open = if in_reasoning {
        "\"</think>\\n\\n\" "
    } else {
        ""
    };
    g.push_str(&format!("start: {open}{calls}\n"));
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for (i, tool) in tools.iter().enumerate() {
        match format {
            ToolCallFormat::Xml => xml_call(&mut g, i, tool),
            _ => json_call(&mut g, i, tool),
        }
    }
    g
}

/// A Lark string literal of `text`.
fn lit(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

fn json_call(g: &mut String, i: usize, tool: &Tool) {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": parameters(tool),
        },
        "required": ["name", "arguments"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
    });
    g.push_str(&format!(
        "call_{i}: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n"
    ));
}

/// The tool's parameters schema; a function without one takes an empty object. Where the
/// schema does not say, a forced call passes the declared parameters only
/// (`additionalProperties: false`, as OpenAI's strict function calling).
fn parameters(tool: &Tool) -> Value {
    let mut p = match &tool.parameters {
        Value::Null => json!({"type": "object", "properties": {}}),
        p => p.clone(),
    };
    if let Value::Object(o) = &mut p
        && !o.contains_key("additionalProperties")
    {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    p
}

fn xml_call(g: &mut String, i: usize, tool: &Tool) {
    let params = parameters(tool);
    let empty = serde_json::Map::new();
    let props = params
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let required: Vec<&str> = (params.get("required").and_then(Value::as_array))
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut body = Vec::new();
    for (j, (name, schema)) in props.iter().enumerate() {
        let value = if schema.get("type").and_then(Value::as_str) == Some("string") {
            format!("XML_TEXT_{i}_{j}")
        } else {
            let mut s = schema.clone();
            if let Value::Object(o) = &mut s {
                o.insert(
                    "x-guidance".into(),
                    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                );
            }
            format!("%json {s}")
        };
        let rule = format!("param_{i}_{j}");
        g.push_str(&format!(
            "{rule}: {} {value} \"\\n</parameter>\\n\"\n",
            lit(&format!("<parameter={name}>\n"))
        ));
        if value.starts_with("XML_TEXT") {
            g.push_str(&format!("XML_TEXT_{i}_{j}: /[^<\\n]*/\n"));
        }
        body.push(if required.contains(&name.as_str()) {
            rule
        } else {
            format!("{rule}?")
        });
    }
    g.push_str(&format!(
        "call_{i}: \"<tool_call>\\n\" {} {} \"</function>\\n</tool_call>\"\n",
        lit(&format!("<function={}>\n", tool.name)),
        body.join(" ")
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_grammar_names_each_function_and_its_parameters() {
        let a = Tool::function("get_weather").parameters(
            json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        );
        let b = Tool::function("now");
        let g = tool_call_grammar(&[&a, &b], ToolCallFormat::Json, true, false);
        assert!(
            g.starts_with("start: call (\"\\n\" call)*\ncall: call_0 | call_1\n"),
            "{g}"
        );
        assert!(g.contains(r#"{"const":"get_weather"}"#), "{g}");
        assert!(g.contains(r#""required":["city"]"#), "{g}");
        let one = tool_call_grammar(&[&b], ToolCallFormat::Xml, false, true);
        assert!(one.starts_with("start: \"</think>\\n\\n\" call\n"), "{one}");
        assert!(one.contains(r#""<function=now>\n""#), "{one}");
    }
}
