"""How many replicas kvg-serve runs on Ray: a fixed number (`--replicas N`), or as many as the load asks between two
bounds (`--autoscale MIN:MAX`, Ray Serve's autoscaling, tuned by `--autoscale-config`), checked before Ray starts."""

from __future__ import annotations

import dataclasses
import json
import re

from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig

from runtime.errors import RequestError


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How many replicas: `replicas`, or with `autoscaling` (Ray Serve's autoscaling_config) as the load asks."""

    replicas: int = 1
    autoscaling: dict | None = None

    @property
    def most(self) -> int:
        return self.replicas if self.autoscaling is None else self.autoscaling["max_replicas"]

    def options(self) -> dict:
        """The replicas' deployment options that say how many."""
        return {"num_replicas": self.replicas} if self.autoscaling is None else {"autoscaling_config": self.autoscaling}


def scaling(replicas: int | None, autoscale: str | None, autoscale_config: str | None, max_batch: int) -> Scaling:
    """`--replicas N`, or `--autoscale MIN:MAX` aiming at `max_batch` requests in flight a replica (a replica whose
    rows are all busy asks for another), with `--autoscale-config` (JSON) setting any other field of Ray Serve's
    autoscaling_config; RequestError naming the fix for what does not parse."""
    if autoscale is None:
        if autoscale_config is not None:
            raise RequestError("--autoscale-config tunes --autoscale: give --autoscale MIN:MAX too")
        if replicas is not None and replicas < 1:
            raise RequestError(f"--replicas {replicas}: a deployment needs at least 1 replica")
        return Scaling(1 if replicas is None else replicas)
    if replicas is not None:
        raise RequestError("give --replicas N (a fixed number) or --autoscale MIN:MAX (as the load asks), not both")
    bounds = re.fullmatch(r"(\d+):(\d+)", autoscale.strip())
    if bounds is None or not 1 <= int(bounds[1]) <= int(bounds[2]):
        raise RequestError(f"--autoscale {autoscale!r}: give MIN:MAX, the fewest and the most replicas, whole numbers "
                           "with 1 <= MIN <= MAX (e.g. --autoscale 1:4)")  # fmt: skip
    config = {"min_replicas": int(bounds[1]), "max_replicas": int(bounds[2]), "target_ongoing_requests": max_batch}
    return Scaling(autoscaling={**config, **_tuning(autoscale_config)})


def _tuning(text: str | None) -> dict:
    """--autoscale-config's fields of Ray Serve's autoscaling_config, checked by Ray's own model."""
    if text is None:
        return {}
    try:
        tuning = json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(f"--autoscale-config is not JSON ({error}): give an object, e.g. "
                           '\'{"upscale_delay_s": 10, "downscale_delay_s": 120}\'') from None  # fmt: skip
    if not isinstance(tuning, dict):
        raise RequestError("--autoscale-config must be a JSON object of Ray Serve's autoscaling_config fields")
    fields = set(AutoscalingConfig.model_fields)
    if unknown := sorted(set(tuning) - fields):
        raise RequestError(f"--autoscale-config: unknown fields {unknown}; Ray Serve's autoscaling_config has "
                           f"{sorted(fields)}")  # fmt: skip
    if bounds := sorted({"min_replicas", "max_replicas"} & set(tuning)):
        raise RequestError(f"--autoscale-config: {bounds} come from --autoscale MIN:MAX; set them there")
    try:
        AutoscalingConfig(**tuning)
    except ValidationError as error:
        first = error.errors()[0]
        raise RequestError(f"--autoscale-config: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return tuning
