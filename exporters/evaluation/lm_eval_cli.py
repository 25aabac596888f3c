"""`kvg-lm-eval ARTIFACT`: EleutherAI's lm-evaluation-harness against kvg-serve on a static artifact (its
`local-completions` model, requests as token ids), against eager PyTorch on the checkpoint it was exported
from (its `hf` model), or both, so that the served model is scored as the harness scores any other and
the two scores can be compared. Tasks: the project's `kvg_stdlib` (exporters/evaluation/lm_eval_tasks, no download)
or any the harness knows. Both tokenize with the artifact's tokenizer through transformers (the released FoX
checkpoints' JSONGPT2Tokenizer is registered by importing kvg_export), with its BOS first where the manifest's
`text` puts one there, as the official evaluation passes `add_bos_token=True`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import kvg_export  # noqa: F401  (registers FoX's model and tokenizer classes with transformers' Auto classes)
from runtime.artifact import ArtifactError, read_manifest
from runtime.decode.engine import check_servable
from runtime.serving.serve_process import kvg_serve
from runtime.text.tokenizer import TextRules

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"


def tokenizer_folder(folder: Path, scratch: Path) -> Path:
    """A folder transformers' AutoTokenizer loads as `folder`'s tokenizer: `folder` itself when it has a
    tokenizer_config.json, else `scratch` with its tokenizer.json and the special tokens its config.json
    names (the presets ship tokenizer.json alone, which AutoTokenizer cannot place)."""
    if (folder / "tokenizer_config.json").is_file():
        return folder
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for role in ("bos", "eos", "pad"):
        if config.get(f"{role}_token_id") is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(config[f"{role}_token_id"]))
    tokenizer.save_pretrained(scratch)
    return scratch


def serve_flags(rows: int, provider: str, threads: int) -> list[str]:
    return ["--max-batch", str(rows), "--provider", provider, "--threads", str(threads)]


def server_model(url: str, tokenizer: Path, max_length: int, batch_size: int, add_bos_token: bool = False):
    """The harness's `local-completions` model of the server whose base URL is `url`. `max_length` is the
    artifact's max_cache_len: the harness keeps a slot for the token it asks for beyond each prompt. A refused
    request fails at once (the harness would retry it, with back-off)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(base_url=f"{url}/v1/completions", tokenizer_backend="huggingface",
                               tokenizer=str(tokenizer), max_length=max_length, batch_size=batch_size,
                               max_retries=1, add_bos_token=add_bos_token)  # fmt: skip


def eager_model(model: str, tokenizer: Path, max_length: int, batch_size: int, add_bos_token: bool = False):
    """The harness's `hf` model of the checkpoint `model` names (kvg_export/presets.py), on the CPU. Its
    max_length is two below the server model's, so that both cut text into the same segments (the `hf` model
    scores max_length + 1 tokens at a time, the API model max_length - 1). Prompts to generate from are
    then cut one token shorter than the server's, which matters only for a prompt that long."""
    from lm_eval.models.huggingface import HFLM

    from kvg_export.presets import load_model

    eager = load_model(model)
    eager.generation_config.max_new_tokens = None  # else it overrides the max_length each request's generation gets
    return HFLM(pretrained=eager, backend="causal", tokenizer=str(tokenizer), max_length=max_length - 2,
                batch_size=batch_size, device="cpu", add_bos_token=add_bos_token)  # fmt: skip


def task_manager(tasks: list[str]):
    """The harness's index of the project's tasks, and of its own only if `tasks` asks for one of them
    (indexing its thousands of task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    own = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return own if set(tasks) <= set(own.all_tasks) else TaskManager(include_path=str(TASKS_DIR))


def evaluate(lm, tasks: list[str], limit: int | None, bootstrap_iters: int) -> dict:
    """lm_eval's simple_evaluate of `lm` on `tasks`, samples kept."""
    from lm_eval import simple_evaluate

    return simple_evaluate(lm, tasks=tasks, task_manager=task_manager(tasks), limit=limit,
                           bootstrap_iters=bootstrap_iters, log_samples=True)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvg-lm-eval", description=__doc__)
    parser.add_argument("artifact", type=Path, help="a folder made by `kvg-export MODEL --cache static`")
    parser.add_argument("--tasks", default="kvg_stdlib", help="comma-separated lm_eval tasks or groups")
    parser.add_argument("--backend", choices=("server", "hf", "both"), default="server")
    parser.add_argument("--model", help="the checkpoint the artifact was exported from (preset or folder), for hf")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request, and the server's rows")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000, help="for standard errors (0: none)")
    parser.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto", help="kvg-serve's")
    parser.add_argument("--threads", type=int, default=0, help="kvg-serve's onnxruntime threads (0: its default)")
    parser.add_argument("--output", type=Path, help="write each backend's lm_eval results here as JSON")
    args = parser.parse_args(argv)
    if args.backend != "server" and args.model is None:
        parser.error(f"--backend {args.backend} needs --model")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from lm_eval.utils import make_table
    except ImportError as missing:
        print(
            f"kvg-lm-eval: error: {missing.name} is not installed: pip install 'kvg-export[lm-eval]'", file=sys.stderr
        )
        return 2
    try:
        manifest = read_manifest(args.artifact)
        check_servable(args.artifact, manifest, args.batch_size)
    except ArtifactError as error:
        print(f"kvg-lm-eval: error: {error}", file=sys.stderr)
        return 2
    max_length, tasks = manifest["cache"]["max_cache_len"], args.tasks.split(",")
    bos = TextRules.of(manifest).bos is not None
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = tokenizer_folder(args.artifact, Path(scratch))
        if args.backend in ("server", "both"):
            with kvg_serve(args.artifact, serve_flags(args.batch_size, args.provider, args.threads)) as (_, url):
                lm = server_model(url, tokenizer, max_length, args.batch_size, bos)
                results["server"] = evaluate(lm, tasks, args.limit, args.bootstrap_iters)
        if args.backend in ("hf", "both"):
            lm = eager_model(args.model, tokenizer, max_length, args.batch_size, bos)
            results["hf"] = evaluate(lm, tasks, args.limit, args.bootstrap_iters)
    for backend, result in results.items():
        print(f"\n{backend}: {args.artifact if backend == 'server' else args.model}\n{make_table(result)}")
    if args.output:
        args.output.write_text(json.dumps({backend: r["results"] for backend, r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
