"""Prompts' prefixes kept between requests, so that a prompt that begins like a recent one is prefilled from there.

A block is one prefill chunk of a prompt: the keys, values and gates of its slots, and the shift states after it
(a FoX-Pro layer's token shift carries its last token into the next chunk, so a prefix can only resume where a
chunk ended). Blocks are keyed by every token up to their end and chained to the block before them, so a prefix
is found by its longest cached end and restored from the first block on. Slots hold what a token computed
whatever row or slot it was in (a key's RoPE position counts the row's own tokens, and gates are per slot), and
a resumed prompt is prefilled in the same chunks as it was, so its tokens and log-probabilities are those of a
prefill from nothing. The least recently used blocks go first when the blocks pass the memory budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Block:
    end: int  # the prompt position after its last token
    begin: int  # the position of its first token (the previous block's end)
    slots: dict[str, np.ndarray]  # per key, value and gate tensor: its slots `[heads, end - begin, ...]`
    states: dict[str, np.ndarray]  # per shift state: the state after the block's last token

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.slots.values()) + sum(a.nbytes for a in self.states.values())


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.blocks: OrderedDict[tuple[int, ...], Block] = OrderedDict()  # least recently used first
        self.held_bytes = 0
        self.looked_up = 0  # prompt tokens looked up
        self.reused = 0  # of those, tokens restored from a cached prefix

    def longest(self, prompt: list[int], most: int) -> list[Block]:
        """The blocks of the longest cached prefix of `prompt` no longer than `most` tokens, first block first."""
        self.looked_up += len(prompt)
        ends = sorted({block.end for block in self.blocks.values() if block.end <= most}, reverse=True)
        for end in ends:
            chain, key = [], tuple(prompt[:end])
            while key in self.blocks:
                chain.append(self.blocks[key])
                key = key[: chain[-1].begin]
            if chain and chain[-1].begin == 0:
                self._touch(prompt, end)
                self.reused += end
                return chain[::-1]
        return []

    def _touch(self, prompt: list[int], end: int) -> None:
        """Make the block ending at `end` and those before it the most recently used, the first block most of all:
        eviction then takes a chain's last blocks before its first, which the others need."""
        key = tuple(prompt[:end])
        while key in self.blocks:
            self.blocks.move_to_end(key)
            key = key[: self.blocks[key].begin]

    def add(self, prompt: list[int], block: Block) -> None:
        """Keep `block`, the prompt's tokens [block.begin, block.end), evicting the least recently used past the
        budget (a block larger than the whole budget is not kept)."""
        key = tuple(prompt[: block.end])
        if key in self.blocks or block.nbytes > self.budget_bytes:
            return
        self.blocks[key] = block
        self.held_bytes += block.nbytes
        self._touch(prompt, block.end)
        while self.held_bytes > self.budget_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.held_bytes -= evicted.nbytes

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens looked up that a cached prefix supplied."""
        return self.reused / self.looked_up if self.looked_up else 0.0
