"""Structured outputs: every answer under a constraint is what the constraint says, judged by independent checkers
(jsonschema, Python's re, a list), greedy and sampled, in the Generator, the engine and kvg-generate; an
unconstrained request beside a constrained one is unchanged."""

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
from test_engine import served

from runtime.artifact import SessionOptions
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import SamplingConfig
from runtime.speculative.prompt_lookup import PromptLookup
from runtime.structured.constraints import Constraint, ConstraintError

CPU = SessionOptions(provider="cpu")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["module", "class", "function"]},
        "public": {"type": "boolean"},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["io", "net"]}, "maxItems": 2},
    },
    "required": ["name", "kind", "public", "lines", "tags"],
    "additionalProperties": False,
}
PATTERN = r"[a-z]{2,6}-[0-9]{1,3}(\.py)?"
CHOICES = ["yes", "no", "not sure"]
LARK = 'start: item ("," item)? ("," item)? ";"\nitem: "a" | "b" | "cd"'
LARK_AS_REGEX = r"(a|b|cd)(,(a|b|cd))?(,(a|b|cd))?;"  # the same language, written out by hand
GBNF = 'root ::= "x" digit digit\ndigit ::= [0-9]'
PROMPTS = ["def parse_args(argv):\n", "import os\n\n", "class Reader:\n    def"]
SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=1.0, seed=7), SamplingConfig(1.3, top_k=50, seed=11)]
# Whether a finished text is what the constraint asks for, checked without llguidance
CHECKS = {
    "json_schema": (Constraint.json_schema(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) or 1),
    "regex": (Constraint.regex(PATTERN), lambda text: re.fullmatch(PATTERN, text)),
    "choice": (Constraint.choice(CHOICES), lambda text: text in CHOICES),
    "lark": (Constraint.grammar(LARK), lambda text: re.fullmatch(LARK_AS_REGEX, text)),
    "gbnf": (Constraint.grammar(GBNF), lambda text: re.fullmatch(r"x[0-9][0-9]", text)),
}


@pytest.fixture(scope="module", params=["fox-py", "fox-pro-py", "fox-tiny"])
def generator(request, exported):
    """The trained presets, and random weights (the constraint, not the model, makes its answers valid)."""
    return Generator.open(exported(request.param, "static")[0].path, CPU)


@pytest.mark.parametrize("kind", CHECKS)
def test_every_answer_is_what_its_constraint_asks_for(generator, kind):
    constraint, valid = CHECKS[kind]
    for sampling in SAMPLINGS:
        result = generator.generate(PROMPTS, GenerationConfig(80, sampling=sampling, constraint=constraint))
        assert result.finish_reasons == ["stop"] * len(PROMPTS), result.text
        for tokens, text in zip(result.tokens, result.text, strict=True):
            assert tokens[-1] in generator.model.eos and valid(text), (kind, sampling, text)


def test_a_constraint_not_complete_within_max_tokens_ends_with_length(generator):
    result = generator.generate(PROMPTS[:1], GenerationConfig(6, constraint=Constraint.regex("ab{40}")))
    assert result.finish_reasons == ["length"] and len(result.tokens[0]) == 6
    assert result.text[0] and result.text[0] == ("a" + "b" * 40)[: len(result.text[0])]


def test_unconstrained_rows_beside_constrained_ones_get_the_tokens_they_get_alone(exported):
    """In the engine, four requests (two constrained, two not, greedy and sampled) share a batch."""
    generator = Generator.open(exported("fox-py", "static")[0].path, CPU)
    prompts = [generator.model.encode(prompt)[0] for prompt in PROMPTS[:2]]
    free = [GenerationConfig(24, sampling=sampling) for sampling in SAMPLINGS[:2]]
    held = [GenerationConfig(80, sampling=sampling, constraint=CHECKS["json_schema"][0]) for sampling in SAMPLINGS[:2]]
    requests = [(prompts[0], held[0]), (prompts[1], free[0]), (prompts[0], free[1]), (prompts[1], held[1])]
    got = served(Engine(generator.model, 4), requests, {1: (0, 1), 2: (0, 2), 3: (1, 1)})
    for (prompt, config), tokens in zip(requests, got, strict=True):
        alone = generator.generate([prompt], config)
        assert tokens == alone.tokens[0]
        if config.constraint is not None:
            assert alone.finish_reasons == ["stop"] and CHECKS["json_schema"][1](alone.text[0])


def test_speculative_decoding_under_a_constraint_keeps_the_constrained_tokens(exported):
    """Prompt lookup's drafts are checked by the grammar and verified by the target under its mask: greedy, the
    tokens of constrained decoding one token a run."""
    generator = Generator.open(exported("fox-py", "dynamic")[0].path, CPU)
    prompt = '{"name":"reader","kind":"class","public":true,"lines":12,"tags":["io"]}\n' * 3
    accepted = []
    for constraint in (CHECKS["json_schema"][0], CHECKS["regex"][0]):
        plain = generator.generate([prompt], GenerationConfig(64, constraint=constraint))
        drafted = generator.generate([prompt], GenerationConfig(64, constraint=constraint, speculative=PromptLookup()))
        assert drafted.tokens == plain.tokens
        accepted.append(drafted.drafts_accepted)
    assert accepted[0] > 0  # the prompt's JSON is drafted again


def test_what_cannot_be_held_to_is_refused_before_any_work(generator):
    for constraint, said in [
        (Constraint.json_schema({"type": "objet"}), "objet"),
        (Constraint.regex("a(b"), "unclosed group"),
        (Constraint.grammar("start: missing_rule"), "missing_rule"),
    ]:
        with pytest.raises(ConstraintError, match=said):
            generator.generate(PROMPTS[:1], GenerationConfig(8, constraint=constraint))
    with pytest.raises(ConstraintError, match="min_new_tokens"):
        generator.generate(PROMPTS[:1], GenerationConfig(8, 2, constraint=CHECKS["regex"][0]))


def test_the_mask_allows_exactly_the_tokens_that_continue_the_text(generator):
    """Independently of llguidance: at the start of (ab|cd)e a token is allowed exactly when its text begins abe or
    cde (a special token, or the end, never)."""
    grammar = generator.model.grammar(Constraint.regex("(ab|cd)e"))
    matching = grammar.start(frozenset(generator.model.eos))
    texts = generator.model.tokenizer.token_texts(list(range(generator.model.artifact.vocab_size)))
    allowed = matching.allowed()
    expected = np.array([bool(t) and any(w.startswith(t) for w in ("abe", "cde")) for t in texts])
    expected[[i for i, added in generator.model.tokenizer.bpe.get_added_tokens_decoder().items() if added.special]] = (
        False
    )
    assert (allowed == expected).all(), np.flatnonzero(allowed != expected)[:8]


def test_kvg_generate_answers_under_a_schema_and_refuses_a_bad_one(exported, tmp_path):
    artifact = str(exported("fox-py", "dynamic")[0].path)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    command = [sys.executable, "-m", "runtime.cli.generate", artifact, "--prompt", "x = ", "--max-new-tokens", "96"]
    done = subprocess.run([*command, "--json-schema", str(schema)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMA)
    schema.write_text('{"type": "objet"}')
    done = subprocess.run([*command, "--json-schema", str(schema)], capture_output=True, text=True)
    assert done.returncode == 2 and "Invalid type: objet" in done.stderr and not done.stdout


def test_a_requests_own_stop_token_may_end_a_row_only_where_the_constraint_is_complete(generator):
    """A chat template's end of turn is a stop token that may also be text: under a constraint it ends the row,
    so it is allowed exactly where the model's eos is."""
    stop = generator.model.tokenizer.token_to_id("a")
    matching = generator.model.grammar(Constraint.regex("a+b")).start(frozenset([*generator.model.eos, stop]))
    assert not matching.allowed()[[stop, *generator.model.eos]].any()  # "a" is the grammar's next text, not an end
    for token in generator.model.tokenizer.encode("aab", bos=False):
        matching.push(token)
    assert matching.allowed()[[stop, *generator.model.eos]].all()
