"""kvg-serve on Ray Serve: the same HTTP API from N replicas, each with its own engine over the artifact, so
more replicas on more nodes is configuration, not code.

`kvg-serve DIR --ray --replicas N`, or with Ray's own CLI:
`serve run runtime.ray_app:app_builder artifact=DIR replicas=N [max_batch=8 ...]`.
"""

from __future__ import annotations

import dataclasses

import ray
from ray import serve
from ray.serve import Application

from runtime.server import ServeOptions, open_app

DEPLOYMENT = "kvg-serve"
# app_builder's arguments arrive as text: their types, and the two that are the deployment's own
TYPES = {"max_batch": int, "max_queue": int, "timeout_s": float, "threads": int, "max_body_bytes": int,
         "prefill_budget": int, "prefix_cache_mb": int, "replicas": int, "replica_cpus": float}  # fmt: skip


def application(options: ServeOptions, replicas: int = 1, replica_cpus: float = 1.0) -> Application:
    """Each replica opens the artifact itself (the app is built on the replica) and takes as many requests
    at once as its engine holds rows and queue places, so its own 429 tells Ray's proxy it is full."""

    def build():
        return open_app(options)

    ingress = serve.ingress(build)()
    deployment = serve.deployment(
        ingress, name=DEPLOYMENT, num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=options.max_batch + options.max_queue,
    )  # fmt: skip
    return deployment.bind()


def app_builder(args: dict[str, str]) -> Application:
    """The application `serve run runtime.ray_app:app_builder artifact=DIR replicas=N` deploys."""
    known = {field.name for field in dataclasses.fields(ServeOptions)} | {"replicas", "replica_cpus"}
    if unknown := sorted(set(args) - known):
        raise ValueError(f"unknown arguments {unknown}; known: {sorted(known)}")
    values = {key: TYPES.get(key, str)(value) for key, value in args.items()}
    replicas, replica_cpus = values.pop("replicas", 1), values.pop("replica_cpus", 1.0)
    options = ServeOptions(**values)
    options.check()
    return application(options, replicas, replica_cpus)


def serve_forever(options: ServeOptions, replicas: int, replica_cpus: float, host: str, port: int) -> None:
    ray.init()  # the cluster RAY_ADDRESS names, else a local one
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(options, replicas, replica_cpus), name=DEPLOYMENT, route_prefix="/", blocking=True)
