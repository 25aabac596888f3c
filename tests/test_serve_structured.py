"""Structured outputs through kvg-serve, as OpenAI's and vLLM's clients ask for them: `response_format` and
`structured_outputs`, on both routes, whole and streamed; a constraint the library refuses is a 400 before anything
is queued."""

import json
import re

import httpx
import jsonschema
import pytest
from test_constraints import CHOICES, PATTERN
from test_serve import client, streamed_text
from test_serve_chat import MESSAGES, RENDERED, server  # noqa: F401 (the fixture)

SAMPLED = {"temperature": 1.0, "seed": 5}
# Small enough to finish within the 45 tokens fox-tiny's 96-slot cache leaves after the chat prompt
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["module", "class"]}, "public": {"type": "boolean"},
                   "name": {"type": "string", "maxLength": 4}},
    "required": ["kind", "public", "name"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED])
def test_a_chat_answer_under_a_json_schema_validates_whole_and_streamed(server, sampling):  # noqa: F811
    url, _engine = server
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    answer = client(url).chat.completions.create(
        model="fox-tiny", messages=MESSAGES, max_tokens=45, response_format=response_format, **sampling
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    body = {"messages": MESSAGES, "max_tokens": 45, "response_format": response_format, **sampling}
    assert streamed_text(url, "chat/completions", body) == (choice.message.content, "stop")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED])
def test_completions_take_vllms_structured_outputs(server, sampling):  # noqa: F811
    url, _engine = server
    checks = [
        ({"regex": PATTERN}, lambda text: re.fullmatch(PATTERN, text)),
        ({"choice": CHOICES}, lambda text: text in CHOICES),
        ({"json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) or 1),
    ]
    for outputs, valid in checks:
        fields = {"prompt": RENDERED, "max_tokens": 45, **sampling}
        answer = client(url).completions.create(model="fox-tiny", **fields, extra_body={"structured_outputs": outputs})
        body = {**fields, "structured_outputs": outputs}
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and valid(choice.text), (outputs, choice.text)
        assert streamed_text(url, "completions", body) == (choice.text, "stop")


def test_a_json_object_answer_is_an_object_or_ends_with_length(server):  # noqa: F811
    url, _engine = server
    for max_tokens in (3, 45):
        body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
                "response_format": {"type": "json_object"}}  # fmt: skip
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        choice = answer["choices"][0]
        content = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert choice["finish_reason"] == "length" and content.startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(content)


@pytest.mark.parametrize(
    "fields, said, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objet"}}}},
         "Invalid type: objet", None),
        ({"structured_outputs": {"regex": "a(b"}}, "unclosed group", None),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "nowhere", None),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "one constraint",
         "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "one constraint", "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a"}, "stop": ["x"]}, "stop cannot be combined", "stop"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_new_tokens cannot be combined", None),
        ({"response_format": {"type": "json_schema"}}, "needs its json_schema", "response_format"),
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_be_held_is_a_400_naming_it(server, fields, said, param):  # noqa: F811
    url, engine = server
    for route, body in [("completions", {"prompt": RENDERED}), ("chat/completions", {"messages": MESSAGES})]:
        answer = httpx.post(f"{url}/v1/{route}", json={**body, "max_tokens": 8, **fields}, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert said in error["message"] and error["param"] == param, error
    assert engine.queue_depth == 0 and engine.busy_rows == 0
