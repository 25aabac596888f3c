"""The released FoX checkpoints as released: a slow GPT-2 tokenizer (vocab.json, merges.txt) whose text is
JSON-escaped first (`JSONGPT2Tokenizer`), with `<|endoftext|>` first (`add_bos_token`), and a config that names no
bos or eos id. Every path a text takes (the Generator, kvg-serve, kvg-eval, lm-eval's models, transformers on the
artifact) is held to transformers' GPT2Tokenizer with the official escaping applied here."""

import json
import re
import shutil
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_serve import CPU, MODEL, serving, streamed_text
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GPT2Tokenizer, GPT2TokenizerFast

from exporters.checkpoint_tokenizer import read_tokenizer
from exporters.evaluation.evaluate import run_eager
from exporters.evaluation.lm_eval_cli import eager_model, server_model, tokenizer_folder
from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportOptions
from kvg_export import FoxConfig, FoxForCausalLM
from kvg_export.corpus import read_split
from kvg_export.onnx_model import OnnxFoxForCausalLM
from kvg_export.presets import load_model
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import SamplingConfig
from runtime.speculative.prompt_lookup import PromptLookup
from runtime.structured.constraints import Constraint
from runtime.text.text_stream import TextStream
from runtime.text.tokenizer import TextTokenizer

END = "<|endoftext|>"
PROMPTS = [
    'def main():\n\tprint("hello")\n',
    "a path: C:\\temp\\new\\x and a quote \" and ' too",
    "caf\u00e9, na\u00efve \u2013 \u201cquoted\u201d \u65e5\u672c\u8a9e",
    "emoji \U0001f600\U0001f680 end\r\n",
    "  leading spaces, trailing tab\t",
    f"an {END} in the text",
]
# A greedy chain of tokens that split escapes, as GPT-2's split does (punctuation and letters in separate
# tokens): `x`, then \u015f (s with cedilla) a character a token, then `:\` `n` (a colon and a newline), `\"` and `y`
CHAIN = ["x", "\\", "u", "0", "1", "5", "f", ":\\", "n", '\\"', "y"]
CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_heads=4, intermediate_size=128, use_k_shift=True, use_v_shift=True,
    qk_norm=True, qk_norm_share_param_across_head=True, use_output_gate=True, use_output_norm=True,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip


def official_escape(text: str) -> str:
    return json.dumps(text)[1:-1]


def official_ids(gpt2: GPT2Tokenizer, text: str) -> list[int]:
    return [gpt2.convert_tokens_to_ids(END), *gpt2.encode(official_escape(text))]


def official_decode(gpt2: GPT2Tokenizer, ids: list[int]) -> str:
    text = gpt2.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    try:
        return json.loads(f'"{text}"')
    except json.JSONDecodeError:
        return text.encode().decode("unicode_escape", "ignore")


def write_tokenizer(folder: Path) -> int:
    """A GPT-2-format byte-level BPE trained here on escaped text, <|endoftext|> its last id; returns the vocab size."""
    texts = [document.text for document in read_split("test")[:12]] + PROMPTS * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    bpe.train_from_iterator([official_escape(text) for text in texts], trainer)
    bpe.model.save(str(folder))
    vocab = json.loads((folder / "vocab.json").read_text())
    end = len(vocab)
    (folder / "vocab.json").write_text(json.dumps({**vocab, END: end}))
    added = {"content": END, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "JSONGPT2Tokenizer", "add_bos_token": True, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "bos_token": END, "eos_token": END, "unk_token": END,
        "pad_token": None, "errors": "replace", "model_max_length": 16384,
        "added_tokens_decoder": {str(end): {**added, "special": True}},
    }))  # fmt: skip
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": END, "eos_token": END, "unk_token": END}))
    return end + 1


def write_released(folder: Path) -> Path:
    """A checkpoint folder laid out as the released ones: official config (every FoX-Pro option, no token ids),
    safetensors weights, and the slow JSON-escaping GPT-2 tokenizer; no tokenizer.json."""
    folder.mkdir(parents=True)
    vocab = write_tokenizer(folder)
    torch.manual_seed(0)
    FoxForCausalLM(FoxConfig(vocab_size=vocab, **CONFIG)).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    return write_released(tmp_path_factory.mktemp("released") / "fox-pro-released")


@pytest.fixture(scope="module")
def gpt2(released) -> GPT2Tokenizer:
    return GPT2Tokenizer(str(released / "vocab.json"), str(released / "merges.txt"))


def export_static(folder: Path, out: Path) -> Path:
    export_artifact(ExportOptions(str(folder), out, "static", max_cache_len=96, separate_process=False),
                    log=lambda line: None)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def artifact(released, tmp_path_factory) -> Path:
    return export_static(released, tmp_path_factory.mktemp("artifact") / "released-static")


@pytest.fixture(scope="module")
def chained(released, gpt2, tmp_path_factory) -> tuple[Path, list[int]]:
    """The released folder with weights that make greedy decoding follow CHAIN from its first token, then end:
    every layer's output projections are zero, so the logits read the current token's embedding alone, and each
    chain token's embedding is a basis vector that the lm_head row of the token after it reads. Returns the
    artifact and the chain's token ids, the end token last."""
    folder = tmp_path_factory.mktemp("chained") / "fox-pro-chained"
    shutil.copytree(released, folder)
    tokens = [gpt2.convert_tokens_to_ids(token) for token in CHAIN] + [gpt2.convert_tokens_to_ids(END)]
    assert len(set(tokens)) == len(tokens) and gpt2.unk_token_id not in tokens[:-1]
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("attn.o_proj.weight", "mlp.down_proj.weight")) or name == "lm_head.weight":
            tensor.zero_()
    for place, (token, following) in enumerate(pairwise(tokens)):
        weights["model.embeddings.weight"][token] = 0
        weights["model.embeddings.weight"][token, place] = 1.0
        weights["lm_head.weight"][following, place] = 10.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return export_static(folder, tmp_path_factory.mktemp("artifact") / "chained-static"), tokens


def test_the_manifest_says_how_text_is_escaped_and_what_comes_first(artifact, gpt2):
    manifest = json.loads((artifact / "kvg_config.json").read_text())
    end = gpt2.convert_tokens_to_ids(END)
    assert manifest["text"] == {"escape": "json", "bos": end}
    assert manifest["special_tokens"]["eos"] == [end]  # the config names none; the tokenizer's stops a generation
    assert {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"} <= {
        p.name for p in artifact.iterdir()
    }


def test_text_prompts_are_fed_as_the_official_tokenizer_gives_them(artifact, gpt2):
    generator = Generator.open(artifact, CPU)
    assert generator.model.encode(PROMPTS) == [official_ids(gpt2, prompt) for prompt in PROMPTS]


def test_a_tokenizer_json_beside_the_slow_files_gives_the_same_ids(released, gpt2, tmp_path):
    """A folder that also holds a tokenizer.json (transformers' own conversion of the slow files)."""
    folder = tmp_path / "with-tokenizer-json"
    shutil.copytree(released, folder)
    fast = GPT2TokenizerFast(str(folder / "vocab.json"), str(folder / "merges.txt"))
    fast.backend_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "vocab.json").unlink()
    (folder / "merges.txt").unlink()
    found = read_tokenizer(folder)
    assert found.source == "tokenizer.json"
    saved = tmp_path / "carried.json"
    found.bpe().save(str(saved))  # as the artifact carries it, and the runtime reads it
    tokenizer = TextTokenizer(Tokenizer.from_file(str(saved)), found.rules)
    assert tokenizer.encode_batch(PROMPTS) == [official_ids(gpt2, prompt) for prompt in PROMPTS]


def test_greedy_text_is_the_official_decode_of_its_tokens_whole_and_streamed(chained, gpt2):
    folder, chain = chained
    generator = Generator.open(folder, CPU)
    result = generator.generate("x", GenerationConfig(max_new_tokens=20))
    assert result.tokens[0] == chain[1:] and result.finish_reasons == ["stop"]
    assert result.text[0] == official_decode(gpt2, result.tokens[0]) == '\u015f:\n"y'
    assert_released_in_final_pieces([event.text for event in generator.stream("x", GenerationConfig(20))],
                                    result.text[0])  # fmt: skip


def assert_released_in_final_pieces(pieces: list[str], text: str) -> None:
    """Each piece extends what came before it towards `text` (a half escape would have been text that is not)."""
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert text.startswith(so_far), (so_far, text)
    assert so_far == text


def test_a_stream_of_tokens_that_split_escapes_releases_each_character_whole(released, gpt2):
    """Character by character (every escape split into its characters' tokens) and as the BPE splits them."""
    tokenizer = read_tokenizer(released).text_tokenizer()
    for text in PROMPTS:
        escaped = official_escape(text)
        for tokens in ([gpt2.convert_tokens_to_ids(gpt2.byte_encoder[ord(c)]) for c in escaped],
                       official_ids(gpt2, text)[1:]):  # fmt: skip
            stream = TextStream(tokenizer)
            pieces = [stream.push(token) for token in tokens] + [stream.flush()]
            assert_released_in_final_pieces(pieces, official_decode(gpt2, tokens))


def test_kvg_serve_answers_with_the_official_text_whole_and_streamed(chained, gpt2):
    folder, chain = chained
    with serving(Generator.open(folder, CPU)) as (url, _engine):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 0}
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert whole["token_ids"] == chain[1:]
        assert whole["text"] == official_decode(gpt2, chain[1:])
        pieces = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as events:
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    pieces += [choice["text"] for choice in json.loads(line[6:])["choices"]]
        assert_released_in_final_pieces(pieces, whole["text"])


def test_echoed_prompt_logprobs_are_eager_on_the_official_ids(released, artifact, gpt2):
    model = load_model(released)
    with serving(Generator.open(artifact, CPU)) as (url, _engine):
        for prompt in PROMPTS[:4]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            ids = official_ids(gpt2, prompt)
            with torch.no_grad():
                eager = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
            scored = answer["choices"][0]["logprobs"]["token_logprobs"]
            assert answer["usage"]["prompt_tokens"] == len(ids) and scored[0] is None
            assert np.abs(np.array(scored[1:]) - eager[np.arange(len(ids) - 1), ids[1:]]).max() < 1e-4


def test_transformers_on_the_artifact_with_its_own_tokenizer_is_the_official_pipeline(released, artifact, gpt2):
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    assert type(tokenizer).__name__ == "JSONGPT2Tokenizer"
    prompt = PROMPTS[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == official_ids(gpt2, prompt)
    onnx = OnnxFoxForCausalLM.from_pretrained(artifact, provider="cpu")
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want = onnx.generate(ids, **options), load_model(released).generate(ids, **options)
    assert torch.equal(got, want)
    assert tokenizer.decode(got[0], skip_special_tokens=True) == official_decode(gpt2, got[0].tolist())


def test_kvg_eval_scores_official_ids_each_segment_after_the_bos(released, gpt2, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(PROMPTS[0] + PROMPTS[2] * 3)
    run = run_eager(load_model(released), released, text_paths=[text], context=16, max_segments=3)
    end = gpt2.convert_tokens_to_ids(END)
    stream = [*official_ids(gpt2, text.read_text())[1:], end]
    assert [s.tolist() for s in run.segments] == [[end, *stream[i : i + 15]] for i in range(0, 45, 15)]


def test_lm_eval_models_tokenize_as_the_official_tokenizer(artifact, released, gpt2, tmp_path):
    folder = tokenizer_folder(artifact, tmp_path)
    for lm in (server_model("http://127.0.0.1:1", folder, 96, 2, add_bos_token=True),
               eager_model(str(released), folder, 96, 2, add_bos_token=True)):  # fmt: skip
        assert lm.tok_encode(PROMPTS[1]) == official_ids(gpt2, PROMPTS[1])


def test_importing_kvg_export_alone_lets_transformers_load_the_released_folder(released):
    """No torch until transformers is imported; then its Auto classes know FoX's model and tokenizer."""
    probe = (
        "import sys, kvg_export\n"
        "print('torch' in sys.modules)\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(released)!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(released)!r})\n"
        "print(type(model).__name__, type(tokenizer).__name__)\n"
        "from safetensors.torch import load_file\n"
        f"saved = load_file({str(released / 'model.safetensors')!r})\n"
        "print(all(model.state_dict()[name].equal(tensor) for name, tensor in saved.items()))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "FoxForCausalLM", "JSONGPT2Tokenizer", "True"]


# Structured outputs over the escaping tokenizer: answers with quotes and newlines, which it writes as escapes
ESCAPED_SCHEMA = {
    "type": "object",
    "properties": {"say": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["say", "ok"],
    "additionalProperties": False,
}
TWO_LINES = r"[a-z]{1,4}\n[a-z]{1,4}"
QUOTED = ['say "hi"', 'say "ho"', "a\\b", "two\nlines"]


def test_structured_answers_hold_in_the_text_the_escaping_tokenizer_writes(artifact):
    generator = Generator.open(artifact, CPU)
    checks = [(Constraint.json_schema(ESCAPED_SCHEMA), lambda text: jsonschema.validate(json.loads(text),
                                                                                       ESCAPED_SCHEMA) or 1),
              (Constraint.regex(TWO_LINES), lambda text: re.fullmatch(TWO_LINES, text)),
              (Constraint.choice(QUOTED), lambda text: text in QUOTED)]  # fmt: skip
    for constraint, valid in checks:
        for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3), SamplingConfig(1.5, seed=4)):
            result = generator.generate(PROMPTS[:2], GenerationConfig(60, sampling=sampling, constraint=constraint))
            assert result.finish_reasons == ["stop", "stop"], result.text
            assert all(valid(text) for text in result.text), (constraint.kind, result.text)
        drafted = GenerationConfig(60, constraint=constraint, speculative=PromptLookup(min_ngram=1))
        assert (
            generator.generate(PROMPTS[:1], drafted).tokens
            == generator.generate(PROMPTS[:1], GenerationConfig(60, constraint=constraint)).tokens
        )  # drafts cut where the grammar refuses them, choices under the mask


def test_an_escaped_tokens_mask_is_every_token_that_continues_an_answer_escaped(artifact, gpt2):
    """Independently of llguidance: a token may come next exactly when the escaped text so far followed by the
    token's text begins the escaping of an answer; the end, exactly when it is one. Walked character by character
    along each answer, so a step begins with a backslash pending."""
    generator = Generator.open(artifact, CPU)
    vocab = generator.model.artifact.vocab_size
    texts = [gpt2.convert_tokens_to_string([gpt2.convert_ids_to_tokens(i)]) for i in range(vocab)]
    word = max((text for text in texts if text.isalpha()), key=len)  # its first three letters forced, then a choice:
    for answers in (QUOTED, [word + "!", word[:3] + "?"], ['{"name":"x"}']):  # a token writes past the forced text;
        check_masks_along(generator, gpt2, answers, texts)  # none does


def check_masks_along(generator: Generator, gpt2: GPT2Tokenizer, answers: list[str], texts: list[str]) -> None:
    end = gpt2.convert_tokens_to_ids(END)
    grammar = generator.model.grammar(Constraint.choice(answers))
    escaped = [official_escape(answer) for answer in answers]
    for answer in escaped:
        matching, written = grammar.start(frozenset(generator.model.eos)), ""
        for char in [*answer, None]:
            expected = np.array([i != end and any(e.startswith(written + t) for e in escaped) for i, t in
                                 enumerate(texts)])  # fmt: skip
            expected[end] = written in escaped
            allowed = matching.allowed()
            assert (allowed == expected).all(), (written, [texts[i] for i in np.flatnonzero(allowed != expected)])
            if char is not None:
                matching.push(gpt2.convert_tokens_to_ids(gpt2.byte_encoder[ord(char)]))
                written += char


def test_kvg_serve_holds_the_escaping_tokenizers_answers_to_a_constraint_whole_and_streamed(artifact):
    with serving(Generator.open(artifact, CPU)) as (url, _engine):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": 2,
                "structured_outputs": {"regex": TWO_LINES}}  # fmt: skip
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert whole["finish_reason"] == "stop" and re.fullmatch(TWO_LINES, whole["text"]), whole
        assert streamed_text(url, "completions", body) == (whole["text"], "stop")
