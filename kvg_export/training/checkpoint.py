"""A training checkpoint: a model folder (config, safetensors weights, tokenizer) that loads like any other, a
FoX one exporting and evaluating as well, plus `trainer_state.pt` (optimizer, step, loss history) to resume from.

Written whole or not at all (kvg_export.folders), so an interrupted run leaves its last complete checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel

import kvg_export.fox  # noqa: F401  (registers FoX with the Auto classes)
from kvg_export.folders import written_whole

STATE_NAME = "trainer_state.pt"


def save_model_folder(folder: Path, model: PreTrainedModel, tokenizer: Tokenizer, preset: Path) -> None:
    """Weights, config and tokenizer, and the preset's generation config: a model folder (a FoX one `load_model`
    takes)."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if (preset / "generation_config.json").is_file():
        shutil.copy2(preset / "generation_config.json", folder / "generation_config.json")


def save_checkpoint(
    folder: Path, model: PreTrainedModel, tokenizer: Tokenizer, preset: Path, optimizer: torch.optim.Optimizer,
    state: dict,
) -> None:  # fmt: skip
    with written_whole(folder) as staging:
        save_model_folder(staging, model, tokenizer, preset)
        torch.save({**state, "optimizer": optimizer.state_dict()}, staging / STATE_NAME)


def load_checkpoint(folder: Path) -> tuple[PreTrainedModel, dict]:
    """The model (float32, train mode) and the trainer state, optimizer state dict included."""
    state = torch.load(folder / STATE_NAME, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.train(), state
