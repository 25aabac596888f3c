"""The peers `make bench` compares the runtime with: what a user would deploy instead, on a LLaMA of the same
size as the FoX model (hidden size, layers, heads, MLP width, vocabulary), random weights from a fixed seed.

- onnxruntime-genai (fp32 and int4, its model builder's CPU recipes) runs in a virtual environment of its
  own, `bench/.peers/venv`: its wheel pulls the CPU `onnxruntime` package, which cannot share a site with
  `onnxruntime-gpu`. Its model builder (0.18) imports classes that only transformers 5 has, while
  optimum-onnx needs transformers < 4.58, so the one-time conversion runs in a third environment,
  `bench/.peers/venv-ogbuild`.
- optimum-onnx's ORTModelForCausalLM (fp32) runs in the project's own environment, exported by its
  `optimum-cli export onnx --task text-generation-with-past`.

Everything is made once under bench/.peers/ (git-ignored) and reused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / ".peers"
RUNTIME_VENV, BUILDER_VENV = PEERS / "venv", PEERS / "venv-ogbuild"
RUNTIME_PACKAGES = ("onnxruntime==1.31.1", "onnxruntime-genai==0.18.0", "numpy>=1.26")
BUILDER_PACKAGES = ("torch==2.13.0+cpu", "transformers==5.24.0", "onnxruntime==1.31.1", "onnxruntime-genai==0.18.0",
                    "onnx_ir==1.1.0", "onnx==1.23.2")  # fmt: skip
GENAI_PRECISIONS = ("fp32", "int4")
BENCH_CONTEXT = 4096  # the LLaMA's max_position_embeddings for `make bench`; longer builds get folders of their own


def _venv(folder: Path, packages: tuple[str, ...]) -> Path:
    python = folder / "bin" / "python"
    stamp = folder / ".ready"
    if not stamp.is_file() or stamp.read_text() != "\n".join(packages):
        print(f"building {folder.relative_to(HERE.parent)} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *packages], check=True)
        stamp.write_text("\n".join(packages))
    return python


def _quietly(command: list[str], cwd: Path | None = None) -> None:
    """Run a conversion step; its output is shown only if it fails."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{' '.join(command[:4])} ... failed (exit {done.returncode}); its output is above")


def genai_python() -> Path:
    """The interpreter that runs onnxruntime-genai."""
    return _venv(RUNTIME_VENV, RUNTIME_PACKAGES)


def _models(model: str, context: int) -> Path:
    """Where the peers of `model` built for `context` positions live: `make bench`'s in .peers/<model>, a longer
    context's in .peers/<model>/context-<n> (the weights are the same, the position limits are not)."""
    return PEERS / model if context == BENCH_CONTEXT else PEERS / model / f"context-{context}"


def _llama(model: str, context: int = BENCH_CONTEXT) -> Path:
    """A random-init LlamaForCausalLM of the FoX model's size for `context` positions, with the FoX model's
    tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from kvg_export.presets import load_model, resolve_checkpoint

    folder = _models(model, context) / "hf"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch

    fox = load_model(model).config
    config = LlamaConfig(
        hidden_size=fox.hidden_size, num_hidden_layers=fox.num_hidden_layers, num_attention_heads=fox.num_heads,
        num_key_value_heads=fox.kv_heads, intermediate_size=fox.mlp_size, vocab_size=fox.vocab_size,
        max_position_embeddings=context, bos_token_id=fox.bos_token_id, eos_token_id=fox.eos_token_id,
        pad_token_id=fox.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(resolve_checkpoint(model) / "tokenizer.json"))
    tokenizer.save_pretrained(folder)
    return folder


def genai_model(model: str, precision: str, threads: int, context: int = BENCH_CONTEXT) -> Path:
    """onnxruntime-genai's model builder output for the LLaMA of `model`'s size (for `context` positions: its
    genai_config's context_length), made once."""
    out = _models(model, context) / f"genai-{precision}"
    return out if _built(out) else _build_genai(_llama(model, context), out, precision, threads)


def trained_genai_model(checkpoint: Path, precision: str, threads: int) -> Path:
    """onnxruntime-genai's model builder output for a trained LLaMA checkpoint folder (bench/peer-models), made
    once and again whenever the checkpoint's weights change."""
    out = PEERS / checkpoint.name / f"genai-{precision}"
    weights = checkpoint / "model.safetensors"
    if _built(out) and (out / "genai_config.json").stat().st_mtime >= weights.stat().st_mtime:
        return out
    return _build_genai(checkpoint, out, precision, threads)


def _built(out: Path) -> bool:
    return (out / "genai_config.json").is_file()


def _build_genai(hf: Path, out: Path, precision: str, threads: int) -> Path:
    python = _venv(BUILDER_VENV, BUILDER_PACKAGES)
    options = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                         "inter_op_num_threads": 1}}}}  # fmt: skip
    print(f"building {out.relative_to(HERE)} ...", flush=True)
    _quietly([str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p",
              precision, "-e", "cpu", "-c", str(PEERS / "builder-cache"), "--runtime_config", json.dumps(options)],
             cwd=PEERS)  # fmt: skip
    return out


def optimum_model(model: str, threads: int) -> Path:
    """optimum-onnx's export of the LLaMA of `model`'s size (text-generation-with-past), made once."""
    out = PEERS / model / "optimum"
    if not (out / "model.onnx").is_file():
        hf = _llama(model)
        print(f"exporting {out.relative_to(HERE)} ...", flush=True)
        cli = Path(sys.executable).parent / "optimum-cli"
        _quietly([str(cli), "export", "onnx", "--model", str(hf), "--task", "text-generation-with-past", str(out)])
    return out
