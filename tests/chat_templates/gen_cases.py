#!/usr/bin/python3
"""The conversations of the chat template conformance suite, for one model folder.

Usage: gen_cases.py MODEL_DIR. Reads MODEL_DIR/tokenizer_config.json as transformers does (its
chat_template, or the one named "default" of a list; the special tokens of special_tokens_map)
and writes JSON lines {"name", "template", "variables", "now"}: every conversation with
add_generation_prompt off and on, with the variables transformers' apply_chat_template renders
with (messages, tools and documents, None unless the conversation has tools,
add_generation_prompt, and the special tokens).
"""
import json
import os
import sys

SYSTEM = "You are a helpful assistant. Answer briefly."
NOW = 1767225600 + 3 * 86400 + 12 * 3600  # a fixed moment for strftime_now (January 2026)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


CONVERSATIONS = {
    "user": [user("What is the capital of France?")],
    "system-user": [system(SYSTEM), user("What is the capital of France?")],
    "multi-turn": [
        user("Hello, how are you?"),
        assistant("I'm doing great. How can I help you today?"),
        user("I'd like to show off how chat templating works!"),
    ],
    "system-multi-turn": [
        system(SYSTEM),
        user("Name a prime number."),
        assistant("7"),
        user("And another one?"),
        assistant("11 is prime too."),
        user("Thanks! One more, please."),
    ],
    "ends-with-assistant": [
        system(SYSTEM),
        user("Say hello."),
        assistant("Hello!"),
    ],
    "unicode": [
        system("Réponds en français, s'il te plaît. 日本語も大丈夫です。"),
        user("Ünïcödé: 你好，世界！ 😀👍🏽 e\u0301 \u202eRTL\u202c ṩ \U0001F9D1\u200D\U0001F4BB"),
        assistant("Bonjour ! 👋 Привет, мир. مرحبا"),
        user("Ещё раз, пожалуйста: ⟨α, β⟩ ∈ ℝ²"),
    ],
    "whitespace": [
        system("  leading and trailing spaces  "),
        user("\n\nline one\n\tline two with a tab\r\nline three  \n"),
        assistant("   spaced answer   "),
        user("   "),
    ],
    "markup-in-text": [
        user("Quote \"this\" and 'that', a backslash \\ and {{ braces }} {% not a tag %} {# x #}"),
        assistant("<|im_start|> <s> </s> [INST] <|eot_id|> written as text"),
        user("What does <think>reasoning</think> mean?"),
    ],
    "thinking": [
        user("What is 2+2?"),
        assistant("<think>\nTwo plus two is four.\n</think>\n\nIt is 4."),
        user("And 3+3?"),
    ],
    "long": [system(SYSTEM)]
    + [m for i in range(6) for m in (user("Question %d: what is %d squared?" % (i, i)),
                                      assistant("%d squared is %d." % (i, i * i)))]
    + [user("Sum them all.")],
}
# Templates that refuse a system message (Mistral's first ones) still render these.
for _name in ("system-multi-turn", "unicode", "whitespace", "long"):
    CONVERSATIONS[_name + "-without-system"] = [
        m for m in CONVERSATIONS[_name] if m["role"] != "system"]
CONVERSATIONS.update({
    "tools": {
        "messages": [
            user("What's the weather in Zürich?"),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{
                    "id": "call_0001",
                    "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": {"city": "Zürich", "unit": "celsius"}},
                }],
            },
            {"role": "tool", "name": "get_weather", "tool_call_id": "call_0001",
             "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
        ],
        "tools": [WEATHER_TOOL],
    },
})


SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token"]


def content(token):
    # an AddedToken is saved as an object with its text in "content"
    return token["content"] if isinstance(token, dict) else token


def read_config(directory):
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    template = config["chat_template"]
    if isinstance(template, list):
        template = next(t["template"] for t in template if t["name"] == "default")
    # transformers' special_tokens_map keeps the attributes whose value is truthy
    special = {key: content(config[key]) for key in SPECIAL_TOKENS if config.get(key)}
    special = {key: value for key, value in special.items() if value}
    extra = [content(t) for t in config.get("additional_special_tokens") or []]
    if extra:
        special["additional_special_tokens"] = extra
    return template, special


def main():
    template, special = read_config(sys.argv[1])
    for name, conversation in CONVERSATIONS.items():
        tools = None
        if isinstance(conversation, dict):
            tools = conversation["tools"]
            conversation = conversation["messages"]
        for add_generation_prompt in (False, True):
            variables = dict(special)
            variables.update(messages=conversation, tools=tools, documents=None,
                             add_generation_prompt=add_generation_prompt)
            case = {"name": "%s/%s" % (name, "gen" if add_generation_prompt else "nogen"),
                    "template": template, "variables": variables, "now": NOW}
            sys.stdout.write(json.dumps(case, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
