"""`longspec serve --ray`: the server's own app (`create_app`) behind Ray Serve's HTTP
proxy. Each replica is a Ray actor that loads its own model and runs its own batch
engine and generation thread (the app's lifespan, which Ray's ingress runs at replica
start); Ray routes requests between replicas, restarts a replica that dies, and scales
them from its own config (`num_replicas`, `autoscaling_config`).

Routing: Ray's default power-of-two-choices (the less loaded of two replicas). Its
prefix-aware router reads `.prompt`/`.messages` of Python handle arguments, which an
HTTP ingress does not have (it gets raw ASGI messages); its session router
(experimental `ConsistentHashRouter`, keyed by the `x-session-id` header) does work
over HTTP and is `session_affinity=True` here: it sends a session's requests to the
replica whose suffix cache holds its earlier outputs, at some cost in balance
(docs/serving.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ray import serve

from longspec.serve.options import ServeOptions

__all__ = ["ReplicaSpec", "app_builder", "deployment"]

# /health, /metrics and /v1/models are requests too: room for them beside the generation
# requests, so a full replica answers its probes and the app's own 429 is the limit.
PROBE_HEADROOM = 8
SESSION_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads: sent to the actor, so plain values only."""

    model: str | None = None  # None: the embedded Gemma 3 270M
    dtype: str | None = None  # None: bf16, and a GGUF file's own quantization (`longspec.load`)
    device: str | None = None
    threads: int = 1  # torch threads, and the CPUs Ray reserves for the replica
    chat_template: str | None = None  # the template's text (read where the flag was given)
    suffix_cache_mb: float | None = None  # None: `longspec.load`'s default; each replica keeps its own

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads per replica must be >= 1, got {self.threads}")
        if self.suffix_cache_mb is not None:
            from longspec.speculation.drafters.suffix_cache.index import SuffixCache

            SuffixCache.of_megabytes(self.suffix_cache_mb)  # a bad size fails here, not in every replica
        looks_like_path = self.model is not None and (self.model.startswith(("/", ".", "~")) or self.model.endswith(".gguf"))
        if looks_like_path and not os.path.exists(os.path.expanduser(self.model)):
            raise ValueError(f"model {self.model!r} does not exist: give a checkpoint directory, a .gguf file or "
                             "a cached HF id (every replica loads it, so the path must exist on every node)")


class LongSpecReplica:
    """One replica: the model, its batch engine and the app around them."""

    def __init__(self, spec: ReplicaSpec, options: ServeOptions) -> None:
        import torch

        import longspec
        from longspec.serve.app import create_app
        from longspec.speculation.engine import EngineOptions

        torch.set_num_threads(spec.threads)
        cache = {} if spec.suffix_cache_mb is None else {"suffix_cache_mb": spec.suffix_cache_mb}
        model = longspec.load(spec.model, dtype=spec.dtype, engine=EngineOptions(progress=False), device=spec.device,
                              **cache)
        if spec.chat_template is not None:
            model.set_chat_template(spec.chat_template)
        self._app = create_app(model, options)

    def __serve_build_asgi_app__(self):
        return self._app  # Ray runs its lifespan next: the generation thread starts there

    def check_health(self) -> None:
        """Ray's health probe: a replica whose generation thread has died is replaced."""
        worker = self._app.state.service.worker
        if worker is not None and not worker.alive:
            raise RuntimeError(f"the generation thread has stopped ({worker.died})")


def deployment(spec: ReplicaSpec, options: ServeOptions, *, replicas: int | None = 1,
               autoscaling: dict[str, Any] | None = None, session_affinity: bool = False,
               name: str = "longspec") -> serve.Application:
    """The bound application for `serve.run`: `replicas` fixed, or Ray's
    `autoscaling_config` (then `replicas` must be None)."""
    if (replicas is None) == (autoscaling is None):
        raise ValueError("give either a replica count or an autoscaling config, not both or neither")
    if replicas is not None and replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    settings: dict[str, Any] = {
        "name": name, "ray_actor_options": {"num_cpus": spec.threads},
        "max_ongoing_requests": options.max_concurrent + PROBE_HEADROOM,
        "logging_config": {"enable_access_log": False},  # as `longspec serve`, which logs warnings only
    }
    if autoscaling is not None:
        settings["autoscaling_config"] = autoscaling
    else:
        settings["num_replicas"] = replicas
    if session_affinity:
        settings["request_router_config"] = {"request_router_class": SESSION_ROUTER}
    return serve.deployment(**settings)(serve.ingress()(LongSpecReplica)).bind(spec, options)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """`serve run` / `serve deploy` entry (`import_path: longspec.serve.ray_deployment:app_builder`):
    `args` holds ReplicaSpec's fields, ServeOptions' fields (`model_name` defaults to the
    model's name) and `replicas`, `autoscaling`, `session_affinity`. Deployment settings
    in the config file's `deployments:` section override these (Ray's rule)."""
    args = dict(args)
    spec_fields = {k: args.pop(k) for k in list(args) if k in ReplicaSpec.__dataclass_fields__}
    placement = {k: args.pop(k) for k in ("replicas", "autoscaling", "session_affinity") if k in args}
    if "autoscaling" in placement:
        placement.setdefault("replicas", None)
    unknown = sorted(set(args) - set(ServeOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown args {', '.join(unknown)}: use ReplicaSpec's ({', '.join(ReplicaSpec.__dataclass_fields__)}), "
                         "ServeOptions' fields, replicas, autoscaling or session_affinity")
    if "limits" in args:
        from longspec.serve.limits import RequestLimits

        args["limits"] = RequestLimits(**args["limits"])
    if "model_name" not in args:
        from longspec.cli.serve import served_name

        args["model_name"] = served_name(spec_fields.get("model"))
    return deployment(ReplicaSpec(**spec_fields), ServeOptions(**args), **placement)
