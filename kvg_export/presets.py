"""Resolve `MODEL=` (a preset name, a preset folder, or any local checkpoint folder) to a loaded FoX model.

The model hub is unreachable, so presets in `models/` (which a wheel carries as kvg_export/models) are made here.
A trained preset (`fox-py`, `fox-pro-py`) holds its committed weights and is a checkpoint folder as it is. A
random-weight preset holds a configuration and a tokenizer; its weights are made on first use from a fixed seed,
saved as safetensors under the cache directory (`$KVG_CACHE_DIR`, default `~/.cache/kvg-export`) and reused after
that.

Resolving a name needs no torch (the exporter's own process resolves without it); building and loading import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from kvg_export.fla_format import FLA_MODEL_TYPE, OFFICIAL_MODEL_TYPE, is_fla, official_config, official_state_dict

if TYPE_CHECKING:
    import torch

    from kvg_export.fox import FoxForCausalLM

PRESET_FILES = ("config.json", "generation_config.json", "tokenizer.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _models_dir() -> Path:
    """Where the presets live: KVG_MODELS_DIR, else an installed wheel's copy (package data beside this module,
    kvg_export/models), else a checkout's models/."""
    if os.environ.get("KVG_MODELS_DIR"):
        return Path(os.environ["KVG_MODELS_DIR"])
    installed = Path(__file__).resolve().parent / "models"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "models"


MODELS_DIR = _models_dir()


def cache_dir() -> Path:
    return Path(os.environ.get("KVG_CACHE_DIR", Path.home() / ".cache" / "kvg-export"))


def preset_names() -> list[str]:
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "preset.json").is_file()) if MODELS_DIR.is_dir() else []


def _has_weights(folder: Path) -> bool:
    return any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())


def preset_folder(model: str | os.PathLike) -> Path | None:
    """The preset folder `model` names (by name or by path), or None if it is not a preset."""
    as_path = Path(model)
    if (as_path / "preset.json").is_file():
        return as_path
    if (MODELS_DIR / str(model) / "preset.json").is_file():
        return MODELS_DIR / str(model)
    return None


def _build_preset(preset: Path, target: Path) -> None:
    """Write the preset's checkpoint folder: seeded random weights plus its config and tokenizer files."""
    recipe = json.loads((preset / "preset.json").read_text())
    if "seed" not in recipe:  # a trained preset, whose committed weights are missing
        raise FileNotFoundError(
            f"{preset} has no weights (model.safetensors); restore them with git, or retrain them with "
            f"`make train PRESET={preset.name} TRAIN_FLAGS=--publish`"
        )
    import torch

    from kvg_export.fox import FoxConfig, FoxForCausalLM

    seed = recipe["seed"]
    config = FoxConfig.from_pretrained(preset)
    torch.manual_seed(seed)
    model = FoxForCausalLM(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        for name in PRESET_FILES:
            if (preset / name).is_file():
                shutil.copy2(preset / name, staging / name)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise


def resolve_checkpoint(model: str | os.PathLike, build: bool = True) -> Path | None:
    """A local folder with config.json and weights for `model`; preset weights are built once and cached (None
    where they are not built yet and `build` is False)."""
    preset = preset_folder(model)
    if preset is not None and _has_weights(_fox_only(preset)):
        return preset  # a trained preset: a checkpoint folder as it is
    if preset is not None:
        digest = hashlib.sha256()
        for name in (*PRESET_FILES, "preset.json"):
            if (preset / name).is_file():
                digest.update((preset / name).read_bytes())
        digest.update(version("torch").encode())
        target = cache_dir() / "presets" / f"{preset.name}-{digest.hexdigest()[:16]}"
        if not (target / "config.json").is_file():
            if not build:
                return None
            _build_preset(preset, target)
        return target
    folder = Path(model)
    if folder.is_dir() and (folder / "config.json").is_file() and _has_weights(folder):
        return _fox_only(folder)
    if folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder: it needs config.json and weight files")
    raise ValueError(
        f"unknown model {str(model)!r}: not a preset ({', '.join(preset_names()) or 'none found'}) "
        "and not a local checkpoint folder"
    )


def _fox_only(folder: Path) -> Path:
    """`folder`, refused by name where its config.json is another architecture's (transformers would load it as
    FoX's with a traceback deep inside)."""
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in (OFFICIAL_MODEL_TYPE, FLA_MODEL_TYPE):
        raise ValueError(
            f"{folder} holds a {model_type!r} model (its config.json's model_type), not a FoX: this project takes "
            f"FoX checkpoints, model_type {OFFICIAL_MODEL_TYPE!r} (official) or {FLA_MODEL_TYPE!r} (FLA)"
        )
    return folder


def load_model(
    model: str | os.PathLike, dtype: torch.dtype | None = None, allow_pickle: bool = False
) -> FoxForCausalLM:
    """The FoX model for a preset name or folder, or a local checkpoint folder (official or FLA format), in eval
    mode (float32 unless `dtype` says otherwise)."""
    import torch

    from kvg_export.fox import FoxForCausalLM

    folder = resolve_checkpoint(model)
    dtype = dtype or torch.float32
    config = json.loads((folder / "config.json").read_text())
    if is_fla(config):
        return _load_fla(folder, config, dtype)
    return FoxForCausalLM.from_pretrained(folder, dtype=dtype, allow_pickle=allow_pickle).eval()


def _load_fla(folder: Path, fla: dict, dtype: torch.dtype) -> FoxForCausalLM:
    """An FLA-format checkpoint folder (safetensors weights) as the official FoX it maps onto: every tensor used,
    none missing."""
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    from kvg_export.fox import FoxConfig, FoxForCausalLM

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise OSError(f"{folder} is an FLA-format FoX checkpoint without safetensors weights, which it is read from")
    fla_state = {name: tensor for path in files for name, tensor in load_file(path).items()}
    model = FoxForCausalLM(FoxConfig(**official_config(fla))).to(dtype)
    model.load_state_dict(official_state_dict(fla_state, fla), strict=True)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()
