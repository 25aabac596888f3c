"""`kvg-generate ARTIFACT --prompt TEXT`: generate with an exported model through onnxruntime, no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.artifact import SessionOptions, unrunnable
from runtime.cache.pruning import AS_EXPORTED, describe, parse_tolerance
from runtime.decode.beam_search import BeamSearch
from runtime.decode.generator import Generator
from runtime.decode.sampling import SamplingConfig
from runtime.decode.search import GenerationConfig
from runtime.errors import ArtifactError, RequestError
from runtime.speculative.proposers import add_speculative_arguments, proposer
from runtime.structured.constraints import Constraint, ConstraintError


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids takes comma-separated integers, got {text!r}") from None


def _bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes ID=BIAS, e.g. 50256=-100, got {text!r}") from None


def _beams(args: argparse.Namespace) -> BeamSearch | None:
    if args.num_beams == 1:
        return None
    stopping = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    return BeamSearch(args.num_beams, args.length_penalty, stopping)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvg-generate", description=__doc__)
    parser.add_argument("artifact", help="a folder made by kvg-export")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    prompt.add_argument("--ids", action="append", type=_ids, help="prompt token ids, e.g. 1,2,3 (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-new-tokens", type=int, default=0)
    parser.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                        help="N answers a prompt, forked from its one prefill (sample: --temperature)")  # fmt: skip
    parser.add_argument("--num-beams", type=int, default=1, metavar="N",
                        help="beam search with N beams, as transformers' generate(num_beams=N) (1: none)")  # fmt: skip
    parser.add_argument("--length-penalty", type=float, default=1.0, help="beam search's (a finished beam scores "
                        "its summed log-probability / length ** this)")  # fmt: skip
    parser.add_argument("--early-stopping", choices=("true", "false", "never"), default="false",
                        help="when beam search ends, as transformers' early_stopping")  # fmt: skip
    parser.add_argument("--stop", type=_ids, default=[], help="extra stop token ids, comma-separated")
    parser.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    parser.add_argument("--logit-bias", action="append", type=_bias, default=[], metavar="ID=BIAS",
                        help="add BIAS in [-100, 100] to token ID's logit, -100 bans it (repeat for each)")  # fmt: skip
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    add_speculative_arguments(parser)
    constrained = parser.add_mutually_exclusive_group()
    constrained.add_argument("--json-schema", metavar="FILE", help="answer JSON valid under the schema in FILE")
    constrained.add_argument("--regex", metavar="R", help="answer text matching the regular expression R whole")
    constrained.add_argument("--choice", action="append", help="answer one of these texts (repeat for each)")
    constrained.add_argument("--grammar", metavar="FILE", help="answer text of the Lark or GBNF grammar in FILE")
    parser.add_argument(
        "--log-pruning-tolerance", type=parse_tolerance, default=argparse.SUPPRESS, metavar="X|none",
        help="drop cached keys whose weight in any later query is provably below e^X (default: as exported)",
    )  # fmt: skip
    return parser.parse_args(argv)


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConstraintError(f"cannot read the {what} {path}: {error}") from None


def constraint(args: argparse.Namespace) -> Constraint | None:
    """The structured output the flags ask for (None: free text)."""
    if args.json_schema is not None:
        text = _read(args.json_schema, "JSON schema")
        try:
            return Constraint.json_schema(json.loads(text))
        except json.JSONDecodeError as error:
            raise ConstraintError(
                f"{args.json_schema} is not JSON ({error}); --json-schema takes a schema file"
            ) from None
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.choice is not None:
        return Constraint.choice(args.choice)
    return None if args.grammar is None else Constraint.grammar(_read(args.grammar, "grammar"))


def _incomplete(result) -> str:
    cut = result.finish_reasons.count("length")
    return f", {cut} answer(s) reached --max-new-tokens before their constraint let them end" if cut else ""


def _acceptance(result) -> str:
    proposed, accepted = result.drafts_proposed, result.drafts_accepted
    rate = f" ({accepted / proposed:.0%})" if proposed else ""
    return f"{accepted} of {proposed} drafts accepted{rate}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingConfig(
        args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed, args.presence_penalty,
        args.frequency_penalty, tuple(dict(args.logit_bias).items()),
    )  # fmt: skip
    try:
        options = SessionOptions(args.provider, args.threads)
        generator = Generator.open(args.artifact, options, getattr(args, "log_pruning_tolerance", AS_EXPORTED))
        speculative = proposer(args.speculative, args.draft_tokens, (args.lookup_ngram, args.lookup_min_ngram), options)
        config = GenerationConfig(
            args.max_new_tokens,
            args.min_new_tokens,
            tuple(args.stop),
            sampling,
            speculative=speculative,
            constraint=constraint(args),
            num_return_sequences=args.num_return_sequences,
            beams=_beams(args),
        )
        prompts = args.prompt or args.ids
        model = generator.model
        device = model.artifact.device.upper()
        why = ""
        if args.provider == "auto" and device == "CPU":
            kernel = "fused FoX attention" if model.artifact.attention == "fused" else "GroupQueryAttention"
            cpu_only = unrunnable("cuda", model.artifact.manifest) is not None
            why = f" (its fp32 {kernel} runs on the CPU provider)" if cpu_only else " (CUDA is not usable here)"
        artifact = model.artifact
        print(
            f"kvg-generate: {artifact.folder} on {device}{why}, {artifact.weights}, {describe(model.pruning)}",
            file=sys.stderr,
        )
        if args.stream and len(prompts) == 1 and args.num_return_sequences == 1 and config.beams is None:
            stream = generator.stream(prompts, config)
            while True:
                try:
                    event = next(stream)
                except StopIteration as done:
                    result = done.value
                    break
                print(event.text if model.tokenizer else f"{event.token} ", end="", flush=True)
            print()
        else:
            result = generator.generate(prompts, config)
            for row, tokens in enumerate(result.tokens):
                print(result.text[row] if result.text is not None else ",".join(map(str, tokens)))
    except (ArtifactError, RequestError) as error:
        print(f"kvg-generate: error: {error}", file=sys.stderr)
        return 2
    first_ms = result.time_to_first_token_s * 1e3
    print(
        f"kvg-generate: {sum(map(len, result.tokens))} tokens, first after {first_ms:.1f} ms, "
        f"decode {result.decode_tokens_per_s:.1f} tokens/s"
        + (f", {_acceptance(result)}" if speculative else "")
        + (_incomplete(result) if config.constraint is not None else "")
        + (f", oldest positions dropped by layer and kv head: {result.pruned_positions}" if model.pruning else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
