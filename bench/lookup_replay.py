"""Prompt lookup replayed: what its rule gains on held-out code, and what no rule of its kind could.

    python bench/lookup_replay.py [--prompt-tokens 1024] [--new-tokens 256] [--rounds 5]

Each trained preset's default export continues each of bench/speculative.py's modules greedily. The replay walks
that continuation as speculative decoding does (each run verifies the drafts, keeps the right ones and the token
after them; the draft count adapts as `Search` adapts it) at the cost of a run verifying k drafts, measured on the
same artifact for k = 0 to the rule's most (runs whose drafts are all right, continuing the first module's prompt,
whose positions every module's share; medians of `--rounds`). Beside the
rule, two oracles: its drafts cut to the ones that will be right (the best any sizing of them could do), and at
every run the earlier occurrence of the text's final min_ngram tokens that goes on right longest, cut likewise (the
best any choice among the text's occurrences could do). The timed runs hold the decode loop's Python; a replay
leaves out the lookup's own time and what rewinding rejected drafts costs, which a measured row pays. Writes
results/lookup_replay.json and its table in bench/README.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, replace

from report import record, table_row
from run import artifact, machine
from speculative import LOOKUP, MODULES, PRESETS, held_out_prompt

from exporters.pipeline.options import AS_CONFIG
from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.search import adapted_budget

BEGIN, END = "<!-- lookup-replay:begin -->", "<!-- lookup-replay:end -->"


@dataclass(frozen=True)
class Foreseen:
    """Drafts `tokens` tokens a run, each the one greedy decoding will choose (`truth`, the prompt's continuation):
    every run's drafts are right, so a run's time is that of verifying `tokens`."""

    truth: tuple[int, ...]
    tokens: int
    rows = math.inf

    def check(self, target, prompts, config) -> None:
        """It drafts for the one prompt whose continuation it holds."""

    def start(self, prompt: list[int], config) -> Foresight:
        return Foresight(self.truth, self.tokens)


class Foresight:
    """One run's drafter: the continuation's tokens after those chosen so far."""

    distributions = ()

    def __init__(self, truth: tuple[int, ...], tokens: int):
        self.truth, self.tokens, self.chosen = truth, tokens, 0  # tokens chosen after the prompt

    def push(self, token: int) -> None:
        self.chosen += 1

    def propose(self, most: int) -> list[int]:
        return list(self.truth[self.chosen : self.chosen + min(most, self.tokens)])


def run_costs(generator: Generator, prompt: list[int], truth: list[int], rounds: int) -> list[float]:
    """Seconds a run verifying k right drafts takes, k = 0 to LOOKUP.tokens (medians of `rounds`, in turn)."""
    config = GenerationConfig(len(truth), len(truth))
    settings = [config, *(replace(config, speculative=Foreseen(tuple(truth), k)) for k in range(1, LOOKUP.tokens + 1))]
    times: list[list[float]] = [[] for _ in settings]
    for round_ in range(rounds + 1):  # the first warms up
        for k, setting in enumerate(settings):
            result = generator.generate([prompt], setting)
            if result.tokens[0] != truth or result.drafts_accepted != result.drafts_proposed:
                raise RuntimeError("runs verifying the continuation's own tokens did not keep them all")
            runs = -(-(len(truth) - 1) // (k + 1))  # the first token is the prompt's run's
            if round_:
                times[k].append((len(truth) - 1) / result.decode_tokens_per_s / runs)
    return [statistics.median(t) for t in times]


def right(draft: list[int], truth: list[int], done: int) -> int:
    """How many of `draft`'s first tokens are the continuation's after its first `done`."""
    kept = 0
    while kept < len(draft) and done + kept < len(truth) and draft[kept] == truth[done + kept]:
        kept += 1
    return kept


def rule_time(prompt: list[int], truth: list[int], cost: list[float], cut: bool = False) -> tuple[float, int, int]:
    """Seconds the rule's runs take after the prompt's (`cut`: each draft cut to its right tokens, as an oracle
    would, and so never wasting one), with the drafts made and those right."""
    lookup, budget, done, seconds, proposed, kept_in_all = LOOKUP.start(prompt), LOOKUP.tokens, 1, 0.0, 0, 0
    lookup.push(truth[0])
    while done < len(truth):
        most = min(LOOKUP.tokens if cut else budget, len(truth) - done - 1)
        draft = lookup.propose(most) if most >= 1 else []
        kept = right(draft, truth, done)
        seconds += cost[kept if cut else len(draft)]
        proposed, kept_in_all = proposed + len(draft), kept_in_all + kept
        if draft:  # as Search.accepts adapts it
            budget = adapted_budget(budget, LOOKUP.tokens, whole=kept == len(draft))
        for token in truth[done : done + kept + 1]:
            lookup.push(token)
        done += kept + 1
    return seconds, proposed, kept_in_all


def best_occurrence_time(prompt: list[int], truth: list[int], cost: list[float]) -> float:
    """Seconds the runs take when each drafts what followed the earlier occurrence of the text's final min_ngram
    tokens that goes on right longest, cut to its right tokens."""
    text, done, seconds, low = [*prompt, truth[0]], 1, 0.0, LOOKUP.min_ngram
    while done < len(truth):
        most, final = min(LOOKUP.tokens, len(truth) - done - 1), text[-low:]
        ends = (end for end in range(low, len(text)) if text[end - low : end] == final)
        kept = max((right(text[end : end + most], truth, done) for end in ends), default=0)
        seconds += cost[kept]
        text += truth[done : done + kept + 1]
        done += kept + 1
    return seconds


def table(results: dict) -> str:
    settings = results["settings"]
    lines = [
        BEGIN,
        f"`python bench/lookup_replay.py`, {results['machine']['date']}: each trained preset's default export "
        f"continuing the first {settings['prompt_tokens']} tokens of each held-out module for "
        f"{settings['new_tokens']}, replayed at the preset's run costs there (medians of {settings['rounds']} rounds); "
        "speed-ups over plain decoding's replay. The rule is `--speculative ngram`'s; the oracles cut its drafts to "
        "what will be right, or also choose the earlier occurrence that goes on right longest. The lookup's own time "
        "and rewinds are left out (measured rows, the tables above, run under their replays).",
        "",
        "| preset | module | one-token step us | 1 + 8 tokens us | drafts right | rule | its drafts cut | "
        "best occurrence, cut |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        costs = [f"{seconds * 1e6:.0f}" for seconds in (row["cost_s"][0], row["cost_s"][-1])]
        ratios = [f"{row[name]:.2f}x" for name in ("rule", "cut", "best_occurrence")]
        right = f"{row['right'] / max(row['proposed'], 1):.0%}"
        lines.append(table_row(row["preset"], row["module"], *costs, right, *ratios))
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    for preset in PRESETS:
        folder = artifact(preset, "dynamic", None, "fused", prune=AS_CONFIG)
        generator = Generator.open(folder, SessionOptions("cpu", args.threads))
        cost = None
        for module in MODULES:
            prompt = held_out_prompt(generator, module, args.prompt_tokens)
            truth = generator.generate([prompt], GenerationConfig(args.new_tokens, args.new_tokens)).tokens[0]
            cost = cost or run_costs(generator, prompt, truth, args.rounds)
            plain = (len(truth) - 1) * cost[0]
            seconds, proposed, kept = rule_time(prompt, truth, cost)
            rows.append({
                "preset": preset, "module": module, "cost_s": cost, "proposed": proposed, "right": kept,
                "rule": plain / seconds, "cut": plain / rule_time(prompt, truth, cost, cut=True)[0],
                "best_occurrence": plain / best_occurrence_time(prompt, truth, cost),
            })  # fmt: skip
            print(f"{preset} {module}: rule {rows[-1]['rule']:.2f}x", file=sys.stderr)
    settings = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
                "threads": args.threads}  # fmt: skip
    results = {"machine": machine(), "settings": settings, "rows": rows}
    record("lookup_replay.json", results, BEGIN, END, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
