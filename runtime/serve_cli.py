"""`kvg-serve ARTIFACT`: serve an exported model over an OpenAI-compatible HTTP API, many clients at once."""

from __future__ import annotations

import argparse
import sys

from runtime.artifact import ArtifactError, SessionOptions
from runtime.engine import Engine
from runtime.generator import Generator


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn

        from runtime.server import create_app
    except ImportError as missing:
        print(f"kvg-serve: error: {missing.name} is not installed: pip install 'kvg-export[serve]'", file=sys.stderr)
        return 2
    try:
        if args.timeout <= 0 or args.max_queue < 0:
            raise ArtifactError("--timeout must be > 0 and --max-queue >= 0")
        generator = Generator.open(args.artifact, SessionOptions(args.provider, args.threads))
        engine = Engine(generator, args.max_batch, args.max_queue, args.timeout)
    except (ArtifactError, ValueError) as error:
        print(f"kvg-serve: error: {error}", file=sys.stderr)
        return 2
    name = args.model_name or generator.artifact.folder.resolve().name
    print(
        f"kvg-serve: {name} on {generator.artifact.device.upper()}, {args.max_batch} rows, "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
