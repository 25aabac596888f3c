"""What an export's graph is compared with, made by eager PyTorch: the validation's run (validate.py) recorded in
the export's torch half, and transformers' greedy generate() for the runtime's parity tests and checks."""

from __future__ import annotations

import numpy as np
import torch
from torch.export import ExportedProgram

from exporters.checks.validate import (
    DECODE_STEPS,
    PROMPT_LENGTH,
    STAGGER_CHUNK,
    STAGGER_SHIFT,
    EagerStep,
    References,
    StaggeredRun,
    difference,
    validation_prompt,
)
from exporters.graph.wrappers import ExportableFox
from exporters.progress import Progress, untracked
from kvg_export import FoxForCausalLM
from runtime.contract import WINDOW_OFFSETS, CacheLayout, cache_shape


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
    progress: Progress | None = None,
) -> References:
    """Run the validation's prefill and DECODE_STEPS greedy steps through eager and the ExportedProgram (eager's
    tokens fed to both, each on its own cache) and keep what validate.validate_onnx compares onnxruntime with;
    `longer_buffers` (gqa dynamic graphs) also starts onnxruntime from buffers longer than the filled positions.
    A graph that takes window_offsets is also run with each layer's heads staggered (see `_staggered_runs`)."""
    config = model.config
    ids, mask = (torch.from_numpy(a) for a in validation_prompt(config.vocab_size, batch, config.pad_token_id or 0))
    eager, exported = ExportableFox(model, layout), program.module()
    longer = 2 * (PROMPT_LENGTH + DECODE_STEPS)
    empty = _shapes(model, layout, batch, max_cache_len if layout.static else 0)
    starts = {"onnx": empty} | ({"onnx-longer": _shapes(model, layout, batch, longer)} if longer_buffers else {})
    references = References(str(model.dtype).removeprefix("torch."), layout, batch, starts | {"onnx-last": empty})
    in_place = any(node.op == "placeholder" and node.name == WINDOW_OFFSETS for node in program.graph.nodes)
    together = torch.zeros(layout.num_layers, config.kv_heads, dtype=torch.long) if in_place else None
    run = _Run(eager, exported, layout, _zeros(empty))
    tokens, full_mask = ids, mask
    progress = progress or untracked()
    progress.plan(DECODE_STEPS + 1, "steps recorded")
    for _ in range(DECODE_STEPS + 1):
        references.steps.append(run.step(tokens, full_mask, together))
        tokens = run.greedy()
        full_mask = _grown(full_mask, 1)
        progress.advance()
    if in_place and config.kv_heads > 1:  # one kv head cannot be staggered against itself
        buffers = max_cache_len if layout.static else longer  # as the runtime binds them
        references.staggered = _staggered_runs(model, layout, exported, batch, buffers)
    return references


def _shapes(model: FoxForCausalLM, layout: CacheLayout, batch: int, length: int) -> list[tuple[tuple[int, ...], str]]:
    """Each past's shape and dtype name, for `batch` rows of `length` slots."""
    return [
        (cache_shape(model.config, name.rsplit(".", 1)[1], batch, length),
         "float32" if name.endswith("gate") else str(model.dtype).removeprefix("torch."))
        for name in layout.past_names()
    ]  # fmt: skip


def _zeros(shapes: list[tuple[tuple[int, ...], str]]) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=getattr(torch, kind)) for shape, kind in shapes]


def _grown(mask: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([mask, torch.ones(mask.shape[0], count, dtype=torch.long)], dim=1)


class _Run:
    """Eager and the ExportedProgram through one sequence of steps, each on its own cache (a static cache is
    written in place, by eager and by the program alike), eager's tokens fed to both."""

    def __init__(self, eager: ExportableFox, exported, layout: CacheLayout, pasts: list[torch.Tensor]):
        self.eager, self.exported, self.layout = eager, exported, layout
        self.pasts = {"eager": pasts, "program": [t.clone() for t in pasts]}
        self.logits = None
        # the presents whose each-token states the graph gives, layout.shift_state_names()'s order
        fields = [name.rpartition(".")[2] for name in layout.present_names()]
        self.shifts = [i for i, field in enumerate(fields) if field in layout.each_token]

    def _head(self, tokens: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """The graph's leading inputs for `tokens` whose window (with the positions before them) is `mask`."""
        stop = mask.shape[1]
        return [tokens, mask, torch.arange(stop - tokens.shape[1], stop)] if self.layout.static else [tokens, mask]

    def _earlier_states(self, tokens: torch.Tensor, mask: torch.Tensor, extra: dict) -> list[list[np.ndarray]]:
        """For each of the run's new tokens but its last, eager's shift states after it: its present after the run's
        tokens up to that one, from a copy of the same cache (eager gives only the last token's)."""
        if not self.shifts:
            return []
        seq, stop = tokens.shape[1], mask.shape[1]
        earlier = []
        for count in range(1, seq):
            pasts = [t.clone() for t in self.pasts["eager"]]  # a static cache is written in place
            with torch.no_grad():
                out = self.eager(*self._head(tokens[:, :count], mask[:, : stop - seq + count]), *pasts, **extra)
            earlier.append([_host(out[1 + i]) for i in self.shifts])
        return earlier

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor | None) -> EagerStep:
        """Feed `tokens` whose window (with the positions before them) is `mask`; `offsets`: the window_offsets
        both take (None: a graph without them)."""
        stop, head = mask.shape[1], self._head(tokens, mask)
        extra = {} if offsets is None else {WINDOW_OFFSETS: offsets}
        earlier = self._earlier_states(tokens, mask, extra)
        with torch.no_grad():
            want = self.eager(*head, *self.pasts["eager"], **extra)
            got = self.exported(*head, *self.pasts["program"], **extra)
        each_token = [np.stack([*(states[k] for states in earlier), _host(want[1 + i])], axis=1)
                      for k, i in enumerate(self.shifts)]  # fmt: skip
        self.pasts = {"eager": list(want[1:]), "program": list(got[1:])}
        self.logits = want[0]
        return EagerStep(
            [t.numpy().copy() for t in head],
            _host(want[0]),
            [_host(_filled(w, stop)) for w in want[1:]],
            difference(_host(got[0]), _host(want[0])),
            [difference(_host(g), _host(w)) for g, w in zip(got[1:], want[1:], strict=True)],
            None if offsets is None else offsets.numpy().copy(),
            each_token,
        )

    def greedy(self) -> torch.Tensor:
        """Eager's next tokens `[batch, 1]`."""
        return self.logits[:, -1].argmax(-1).unsqueeze(1)

    def drop(self, offsets: torch.Tensor, filled: int) -> list[np.ndarray]:
        """Drop each layer's kv head h's first `offsets[layer, h]` of the `filled` slots from both caches, as the
        runtime's pruning does (its kept slots moved to the front, the gate slots after them zeroed); returns
        the cache as it is then, the start onnxruntime takes."""
        group = self.eager.model.config.num_heads // self.eager.model.config.kv_heads
        for pasts in self.pasts.values():
            for name, past in zip(self.layout.past_names(), pasts, strict=True):
                layer, field = name.split(".")[1:]
                if field not in ("key", "value", "gate"):
                    continue  # shift states hold no positions
                for head, count in enumerate(offsets[int(layer)].tolist()):
                    rows = slice(head * group, (head + 1) * group) if field == "gate" else slice(head, head + 1)
                    past[:, rows, : filled - count] = past[:, rows, count:filled].clone()
                    past[:, rows, filled - count : filled] = 0
        return [_host(past).astype(str(past.dtype).removeprefix("torch.")) for past in self.pasts["eager"]]


def _staggered_runs(
    model: FoxForCausalLM, layout: CacheLayout, exported, batch: int, length: int
) -> list[StaggeredRun]:
    """The branches a pruned graph takes once a layer's heads are staggered, each from a prompt prefilled with the heads
    together and then cut by up to STAGGER_SHIFT slots per head (every layer keeps one head whole, so the window does
    not move): decode steps of left-padded rows (the masked step), then of one row without padding (the unmasked
    step) with a prompt chunk among them (the chunk, which runs head by head on one row). Eager attends through
    the in-place op's own form (kvg_export/fox/in_place_attention.py), the one that takes the offsets."""
    config, eager = model.config, ExportableFox(model, layout, in_place_attention=True)
    ids, mask = (torch.from_numpy(a) for a in validation_prompt(config.vocab_size, 2, config.pad_token_id or 0))
    offsets = torch.tensor(
        [[min((head + layer) % config.kv_heads, STAGGER_SHIFT) for head in range(config.kv_heads)]
         for layer in range(layout.num_layers)]
    )  # fmt: skip
    chunk = torch.from_numpy(validation_prompt(config.vocab_size, 1, 0)[0][:, :STAGGER_CHUNK])
    together = torch.zeros_like(offsets)
    runs = []
    for rows, steps in ((slice(0, batch), ["masked"] * 3), (slice(1, 2), ["unmasked", "chunk", "unmasked"])):
        run = _Run(eager, exported, layout, _zeros(_shapes(model, layout, rows.stop - rows.start, length)))
        tokens, window = ids[rows], mask[rows]
        run.step(tokens, window, together)
        staggered = StaggeredRun(run.drop(offsets, window.shape[1]), [], steps)
        for kind in steps:
            tokens = chunk if kind == "chunk" else run.greedy()
            window = _grown(window, tokens.shape[1])
            staggered.steps.append(run.step(tokens, window, offsets))
        runs.append(staggered)
    return runs


def left_padded_tensors(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded with 0 into ids `[batch, width]`, and their attention mask."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    return ids, mask


def eager_generate(model: FoxForCausalLM, prompts: list[list[int]], new_tokens: int):
    """transformers' generate() on a left-padded batch, greedy, on the model's device: the new tokens and the
    logits of each step `[batch, vocab]` (float32, on the host), what `validate.greedy_disagreement` compares."""
    ids, mask = left_padded_tensors(prompts)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[:, width:].tolist(), [step.float().cpu().numpy() for step in out.logits]
