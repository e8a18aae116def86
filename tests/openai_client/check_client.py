"""The official `openai` Python client against `metrale serve`, as users drive it: a plain chat,
a streamed chat, a forced tool call (whole and streamed), and a `json_schema` response format.

Usage: check_client.py BASE_URL MODEL. Exits non-zero on the first failed check; prints
'N passed, 0 failed' at the end.
"""

import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused")
passed = 0


def check(ok, what):
    global passed
    if not ok:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    passed += 1


messages = [{"role": "user", "content": "Weather in Paris?"}]
tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}]

plain = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=1)
check(plain.choices[0].message.role == "assistant", "a plain chat answers as the assistant")
check(plain.usage.completion_tokens <= 8, "max_tokens holds")

chunks = list(client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, seed=1, stream=True))
check(chunks[-1].choices[0].finish_reason in ("stop", "length"), "a stream ends with a reason")

forced = {"type": "function", "function": {"name": "get_weather"}}
reply = client.chat.completions.create(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=96, seed=2)
choice = reply.choices[0]
check(choice.finish_reason == "tool_calls", "a forced call finishes with tool_calls")
call = choice.message.tool_calls[0]
args = json.loads(call.function.arguments)
check(call.id.startswith("call_") and call.type == "function", "the call's id and type")
check(call.function.name == "get_weather", "the forced function is called")
check(set(args) == {"city", "days"} and 1 <= args["days"] <= 7, "the arguments follow the schema")

name, arguments, finish = None, "", None
for chunk in client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=96, seed=2,
        stream=True):
    delta = chunk.choices[0].delta if chunk.choices else None
    if delta is not None and delta.tool_calls:
        for piece in delta.tool_calls:
            name = piece.function.name or name
            arguments += piece.function.arguments or ""
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
check(name == "get_weather" and json.loads(arguments) == args, "the streamed call is the same")
check(finish == "tool_calls", "the streamed call finishes with tool_calls")

schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
reply = client.chat.completions.create(
    model=model, messages=messages, max_tokens=32, seed=3,
    response_format={"type": "json_schema",
                     "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
check(json.loads(reply.choices[0].message.content)["answer"] in ("yes", "no"),
      "a json_schema answer is valid")

several = client.completions.create(model=model, prompt="hello", max_tokens=4, n=3, seed=4,
                                    temperature=1.0, extra_body={"ignore_eos": True})
check([c.index for c in several.choices] == [0, 1, 2], "n choices come back indexed 0..n")
check(several.usage.completion_tokens == 12, "the usage counts every choice's tokens")
ended = set()
for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, seed=5, n=2, stream=True):
    for c in chunk.choices:
        if c.finish_reason:
            ended.add(c.index)
check(ended == {0, 1}, "each streamed chat choice ends with its own finish reason")
ranked = client.completions.create(model=model, prompt="hello", max_tokens=4, n=2, best_of=4,
                                   seed=6, temperature=1.0)
check(len(ranked.choices) == 2, "best_of returns n choices")
try:
    client.completions.create(model=model, prompt="hello", n=1, best_of=2, stream=True)
    check(False, "best_of with stream is refused")
except openai.BadRequestError as e:
    check(e.status_code == 400, "best_of with stream is a 400")

try:
    client.chat.completions.create(
        model=model, messages=messages, tools=tools,
        tool_choice={"type": "function", "function": {"name": "nope"}})
    check(False, "an undeclared function is refused")
except openai.BadRequestError as e:
    check(e.status_code == 400, "an undeclared function is a 400")

print(f"{passed} passed, 0 failed")
