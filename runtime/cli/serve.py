"""`kvg-serve ARTIFACT`: serve an exported model over an OpenAI-compatible HTTP API, many clients at once,
from this process or from replicas on a Ray cluster (`--ray --replicas N`)."""

from __future__ import annotations

import argparse
import os
import sys

from runtime.cache.pruning import describe
from runtime.decode.engine import PREFILL_BUDGET, PREFIX_CACHE_MB, SPECULATIVE_MAX_ROWS
from runtime.errors import ArtifactError, RequestError
from runtime.serving.drain import DEFAULT_GRACE_S
from runtime.speculative.proposers import add_speculative_arguments

RAY_ONLY = {"--replicas": "replicas", "--autoscale": "autoscale", "--autoscale-config": "autoscale_config"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvg-serve", description=__doc__)
    parser.add_argument("artifact", help="a folder made by `kvg-export MODEL --cache static`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=8, help="cache rows: requests decoded together")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row before 429")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take, queue included")
    parser.add_argument("--model-name", help="the id clients send as `model` (default: the folder's name)")
    parser.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    parser.add_argument(
        "--api-key", default=os.environ.get("KVG_API_KEY") or None,
        help="require the header `Authorization: Bearer KEY` on the /v1 routes, else 401 (default: $KVG_API_KEY, "
        "else no key); /health and /metrics stay open",
    )  # fmt: skip
    parser.add_argument(
        "--max-body-bytes", type=int,
        help="refuse a larger request body with 413 (default: 1 MiB + 64 bytes x max_cache_len x --max-batch)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-budget", type=int, default=PREFILL_BUDGET,
        help="prompt tokens prefilled between two decode steps: a new prompt delays the running streams by at most "
        "one such chunk a step (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB,
        help="memory for recent prompts' prefixes, by whole prefill chunks: a prompt that begins like one of them is "
        "prefilled from there (0: off; default: %(default)s)",
    )  # fmt: skip
    add_speculative_arguments(parser)
    speculating = (
        "with --speculative, the most requests running for a step to verify drafts (default: any number with ngram, 1 "
        "with a draft model, which drafts a run a request)"
    )
    parser.add_argument("--speculative-max-rows", type=int, default=SPECULATIVE_MAX_ROWS, help=speculating)
    parser.add_argument(
        "--shutdown-grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
        help="on SIGTERM or SIGINT, refuse new requests (503) and let those in flight finish for up to this long, "
        "then end the rest with an event that says why and exit; a second signal exits at once (default: %(default)s)",
    )  # fmt: skip
    ray = parser.add_argument_group("Ray Serve (pip install 'kvg-export[ray]')")
    ray.add_argument(
        "--ray", action="store_true", help="serve from Ray replicas (RAY_ADDRESS's cluster, else a local one)"
    )
    ray.add_argument("--replicas", type=int, help="replicas, each with its own engine and --max-batch rows (default 1)")
    ray.add_argument(
        "--autoscale", metavar="MIN:MAX",
        help="instead of --replicas: from MIN to MAX replicas as the load asks (Ray Serve's autoscaling, aiming at "
        "--max-batch requests in flight a replica)",
    )  # fmt: skip
    ray.add_argument(
        "--autoscale-config", metavar="JSON",
        help="other fields of Ray Serve's autoscaling_config for --autoscale, e.g. "
        "'{\"upscale_delay_s\": 10, \"downscale_delay_s\": 120}' (default: Ray Serve's: 30 and 600)",
    )  # fmt: skip
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = "ray" if args.ray else "serve"
    try:
        import uvicorn

        from runtime.serving.drain import DrainingServer
        from runtime.serving.server import ServeOptions, open_app

        if args.ray:
            from runtime.serving.ray_app import serve_forever
            from runtime.serving.ray_scaling import scaling
    except ImportError as missing:
        print(f"kvg-serve: error: {missing.name} is not installed: pip install 'kvg-export[{extra}]'", file=sys.stderr)
        return 2
    options = ServeOptions(args.artifact, args.max_batch, args.max_queue, args.timeout, args.model_name, args.provider,
                           args.threads, args.api_key, args.max_body_bytes, args.prefill_budget,
                           args.prefix_cache_mb, args.shutdown_grace, args.speculative, args.draft_tokens,
                           args.lookup_ngram, args.lookup_min_ngram, args.speculative_max_rows)  # fmt: skip
    try:
        options.check()
        if args.replica_cpus < 0:
            raise RequestError("--replica-cpus must be >= 0")
        if args.ray:
            scale = scaling(args.replicas, args.autoscale, args.autoscale_config, args.max_batch)
            print(f"kvg-serve: {serve_forever(options, scale, args.replica_cpus, args.host, args.port)}",
                  file=sys.stderr)  # fmt: skip
            return 0
        if given := [flag for flag, value in RAY_ONLY.items() if getattr(args, value) is not None]:
            raise RequestError(f"{', '.join(given)}: Ray replicas only; add --ray")
        app = open_app(options)
    except (ArtifactError, RequestError) as error:
        print(f"kvg-serve: error: {error}", file=sys.stderr)
        return 2
    state = app.state.kvg
    model = state.engine.model
    speculating = f", speculative decoding by {args.speculative}" if args.speculative else ""
    print(f"kvg-serve: {options.name} on {model.artifact.device.upper()}, {args.max_batch} rows, "
          f"{describe(model.pruning)}{speculating}, http://{args.host}:{args.port}/v1",
          file=sys.stderr)  # fmt: skip
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    DrainingServer(config, state.drain, state.engine.close).run()
    print(f"kvg-serve: {state.drain.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
