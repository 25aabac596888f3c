"""The cache checks a quantized artifact gets instead of elementwise parity with eager: its graph still keeps
the cache contract, and the runtime's in-place binding still computes what a plain `session.run` does.

A left-padded batch is generated greedily by the runtime (cache buffers bound on the device, written in place
or fed back as the artifact's kind asks) and replayed step by step through `session.run` with fresh numpy
arrays, every present fed back as the next past. Each present must have the contract's shape and dtype, and
each step's logits must agree between the two within the dtype's tolerance: the same graph on the same
kernels, so any larger difference means the binding read or wrote the wrong cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from exporters.checks.validate import DECODE_STEPS, PROMPT_LENGTH, TOLERANCES, validation_prompt
from runtime import contract
from runtime.artifact import SessionOptions
from runtime.cache.buffers import HOST_TYPES
from runtime.decode.generator import GenerationConfig, Generator


@dataclass
class CacheCheck:
    batch: int
    prompt_length: int
    decode_steps: int
    presents_checked: int
    max_logits_diff: float
    tolerance: float
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def check_cache(folder: Path, batch: int = 2) -> CacheCheck:
    """Generate with the runtime and replay through `session.run`; see the module docstring."""
    generator = Generator.open(folder, SessionOptions(provider="cpu"), None)  # against session.run: every key
    manifest, session = generator.model.artifact.manifest, generator.model.artifact.session
    static = generator.model.artifact.static
    ids, mask = validation_prompt(manifest["model"]["vocab_size"], batch, generator.model.pad)
    prompts = [row[kept == 1].tolist() for row, kept in zip(ids, mask, strict=True)]  # the runtime pads them again
    no_stop = GenerationConfig(DECODE_STEPS + 1, min_new_tokens=DECODE_STEPS + 1)  # every row runs every step
    result = generator.generate(prompts, no_stop, keep_logits=True)
    tolerance = TOLERANCES[manifest["dtype"]]
    check = CacheCheck(batch, PROMPT_LENGTH, DECODE_STEPS, 0, 0.0, tolerance)

    empty = {contract.BATCH_AXIS: batch, contract.PAST_AXIS: 0}
    pasts = {
        entry["name"]: np.zeros([empty.get(a, a) for a in entry["axes"]], dtype=HOST_TYPES[entry["dtype"]])
        for entry in manifest["inputs"] if entry["name"].startswith(contract.PAST_PREFIX)
    }  # fmt: skip
    presents = [entry for entry in manifest["outputs"] if entry["name"] != contract.LOGITS]  # and any shift states
    filled = 0
    for step, want in enumerate(result.step_logits):
        feeds = {contract.INPUT_IDS: ids, contract.ATTENTION_MASK: mask, **pasts}
        if static:
            feeds[contract.CACHE_POSITION] = np.arange(filled, filled + ids.shape[1], dtype=np.int64)
        logits, *outputs = session.run(None, feeds)
        for entry, value in zip(presents, outputs, strict=True):
            # At the default window offsets a pruned graph folds no heads into rows
            rows = {contract.ROWS_AXIS: batch, contract.ROW_HEADS_AXIS: manifest["model"]["num_kv_heads"]}
            sizes = {
                contract.BATCH_AXIS: batch,
                contract.SEQ_AXIS: ids.shape[1],
                contract.TOTAL_AXIS: filled + ids.shape[1],
                **rows,
            }
            shape = tuple(sizes.get(a, a) for a in entry["axes"])
            if value.shape != shape or value.dtype != HOST_TYPES[entry["dtype"]]:
                check.failure = (
                    f"step {step}: {entry['name']} is {value.dtype}{list(value.shape)}, the contract says "
                    f"{entry['dtype']}{list(shape)}"
                )
                return check
            check.presents_checked += 1
        diff = float(np.abs(logits[:, -1] - want).max())
        check.max_logits_diff = max(check.max_logits_diff, diff)
        if diff > tolerance:
            check.failure = (
                f"step {step}: the runtime's logits (cache bound in place) differ from session.run's by {diff:.2e} "
                f"> {tolerance:.0e}"
            )
            return check
        filled += ids.shape[1]
        named = zip((e["name"] for e in presents), outputs, strict=True)
        pasts = {contract.past_of(name): value for name, value in named if name.startswith(contract.PRESENT_PREFIX)}
        ids = np.array([[row[step]] for row in result.tokens], dtype=np.int64)  # no row stops early
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
    return check
