"""What an export's graph is compared with, made by eager PyTorch: the validation's run (validate.py) recorded in
the export's torch half, and transformers' greedy generate() for the runtime's parity tests and checks."""

from __future__ import annotations

import numpy as np
import torch
from torch.export import ExportedProgram

from exporters.contract import CacheLayout, cache_shape
from exporters.validate import DECODE_STEPS, PROMPT_LENGTH, EagerStep, References, difference, validation_prompt
from exporters.window_offsets import NAME as WINDOW_OFFSETS
from exporters.wrappers import ExportableFox
from kvg_export import FoxForCausalLM


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A float32 copy on the host: a static cache's buffers are written in place by the steps after this one."""
    return np.array(tensor.detach().float().cpu().numpy())


def _filled(present: torch.Tensor, length: int) -> torch.Tensor:
    """A key, value or gate cut to the positions filled so far (shift states have no positions)."""
    return present[:, :, :length] if present.ndim > 2 else present


def record(
    model: FoxForCausalLM,
    layout: CacheLayout,
    program: ExportedProgram,
    max_cache_len: int | None,
    batch: int = 2,
    longer_buffers: bool = False,
) -> References:
    """Run the validation's prefill and DECODE_STEPS greedy steps through eager and the ExportedProgram (eager's
    tokens fed to both, each on its own cache) and keep what validate.validate_onnx compares onnxruntime with;
    `longer_buffers` (gqa dynamic graphs) also starts onnxruntime from buffers longer than the filled positions."""
    config = model.config
    ids, mask = (torch.from_numpy(a) for a in validation_prompt(config.vocab_size, batch, config.pad_token_id or 0))
    eager, exported = ExportableFox(model, layout), program.module()

    def shapes(length: int) -> list[tuple[tuple[int, ...], str]]:
        return [
            (cache_shape(config, name.rsplit(".", 1)[1], batch, length),
             "float32" if name.endswith("gate") else str(model.dtype).removeprefix("torch."))
            for name in layout.past_names()
        ]  # fmt: skip

    empty = shapes(max_cache_len if layout.static else 0)
    starts = {"onnx": empty} | ({"onnx-longer": shapes(2 * (PROMPT_LENGTH + DECODE_STEPS))} if longer_buffers else {})
    references = References(str(model.dtype).removeprefix("torch."), layout, batch, starts | {"onnx-last": empty})
    zeros = [torch.zeros(shape, dtype=getattr(torch, kind)) for shape, kind in empty]
    # Separate buffers per system: a static cache is written in place, by eager and by the program alike.
    pasts = {"eager": zeros, "program": [t.clone() for t in zeros]}
    in_place = any(node.op == "placeholder" and node.name == WINDOW_OFFSETS for node in program.graph.nodes)
    offsets = (
        {WINDOW_OFFSETS: torch.zeros(layout.num_layers, model.config.kv_heads, dtype=torch.long)} if in_place else {}
    )
    tokens, full_mask, start = ids, mask, 0
    for _ in range(DECODE_STEPS + 1):
        stop = full_mask.shape[1]
        head = [tokens, full_mask]
        if layout.static:  # the mask is the attention window, as the runtime passes it
            head = [tokens, full_mask, torch.arange(start, stop)]
        with torch.no_grad():
            want = eager(*head, *pasts["eager"])
            got = exported(*head, *pasts["program"], **offsets)
        references.steps.append(
            EagerStep(
                [t.numpy().copy() for t in head],
                _host(want[0]),
                [_host(_filled(w, stop)) for w in want[1:]],
                difference(_host(got[0]), _host(want[0])),
                [difference(_host(g), _host(w)) for g, w in zip(got[1:], want[1:], strict=True)],
            )
        )
        pasts = {"eager": list(want[1:]), "program": list(got[1:])}
        tokens, start = want[0][:, -1].argmax(-1).unsqueeze(1), stop
        full_mask = torch.cat([full_mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
    return references


def eager_generate(model: FoxForCausalLM, prompts: list[list[int]], new_tokens: int):
    """transformers' generate() on a left-padded batch, greedy, on the model's device: the new tokens and the
    logits of each step `[batch, vocab]` (float32, on the host), what `validate.greedy_disagreement` compares."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    with torch.no_grad():
        out = model.generate(
            ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[:, width:].tolist(), [step.float().cpu().numpy() for step in out.logits]
