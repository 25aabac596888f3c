"""`kvg-generate ARTIFACT --prompt TEXT`: generate with an exported model through onnxruntime, no torch."""

from __future__ import annotations

import argparse
import sys

from runtime.artifact import ArtifactError, SessionOptions, unrunnable
from runtime.generator import GenerationConfig, Generator
from runtime.proposers import add_speculative_arguments, proposer
from runtime.pruning import AS_EXPORTED, describe, parse_tolerance
from runtime.sampling import SamplingConfig


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids takes comma-separated integers, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvg-generate", description=__doc__)
    parser.add_argument("artifact", help="a folder made by kvg-export")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    prompt.add_argument("--ids", action="append", type=_ids, help="prompt token ids, e.g. 1,2,3 (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-new-tokens", type=int, default=0)
    parser.add_argument("--stop", type=_ids, default=[], help="extra stop token ids, comma-separated")
    parser.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    add_speculative_arguments(parser)
    parser.add_argument(
        "--log-pruning-tolerance", type=parse_tolerance, default=argparse.SUPPRESS, metavar="X|none",
        help="drop cached keys whose weight in any later query is provably below e^X (default: as exported)",
    )  # fmt: skip
    return parser.parse_args(argv)


def _acceptance(result) -> str:
    proposed, accepted = result.drafts_proposed, result.drafts_accepted
    rate = f" ({accepted / proposed:.0%})" if proposed else ""
    return f"{accepted} of {proposed} drafts accepted{rate}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
    try:
        options = SessionOptions(args.provider, args.threads)
        generator = Generator.open(args.artifact, options, getattr(args, "log_pruning_tolerance", AS_EXPORTED))
        speculative = proposer(args.speculative, args.draft_tokens, (args.lookup_ngram, args.lookup_min_ngram), options)
        config = GenerationConfig(
            args.max_new_tokens, args.min_new_tokens, tuple(args.stop), sampling, speculative=speculative
        )
        prompts = args.prompt or args.ids
        device = generator.artifact.device.upper()
        why = ""
        if args.provider == "auto" and device == "CPU":
            kernel = "fused FoX attention" if generator.artifact.attention == "fused" else "GroupQueryAttention"
            cpu_only = unrunnable("cuda", generator.artifact.manifest) is not None
            why = f" (its fp32 {kernel} runs on the CPU provider)" if cpu_only else " (CUDA is not usable here)"
        artifact = generator.artifact
        print(
            f"kvg-generate: {artifact.folder} on {device}{why}, {artifact.weights}, {describe(generator.pruning)}",
            file=sys.stderr,
        )
        if args.stream and len(prompts) == 1:
            stream = generator.stream(prompts, config)
            while True:
                try:
                    event = next(stream)
                except StopIteration as done:
                    result = done.value
                    break
                print(event.text if generator.tokenizer else f"{event.token} ", end="", flush=True)
            print()
        else:
            result = generator.generate(prompts, config)
            for row, tokens in enumerate(result.tokens):
                print(result.text[row] if result.text is not None else ",".join(map(str, tokens)))
    except (ArtifactError, ValueError) as error:
        print(f"kvg-generate: error: {error}", file=sys.stderr)
        return 2
    first_ms = result.time_to_first_token_s * 1e3
    print(
        f"kvg-generate: {sum(map(len, result.tokens))} tokens, first after {first_ms:.1f} ms, "
        f"decode {result.decode_tokens_per_s:.1f} tokens/s"
        + (f", {_acceptance(result)}" if speculative else "")
        + (f", oldest positions dropped by layer and kv head: {result.pruned_positions}" if generator.pruning else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
