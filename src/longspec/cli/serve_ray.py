"""`longspec serve --ray`: the same server on Ray Serve replicas (serve/ray_deployment.py).
A local Ray starts unless RAY_ADDRESS names a cluster to join."""

from __future__ import annotations

import os
import sys

# Connection limits belong to Ray's proxy under --ray (its http_options), not to our uvicorn protocol.
UVICORN_ONLY = {"max_connections": 4096, "header_timeout": 10.0}


def add_arguments(p) -> None:
    p.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve replicas, each with its own model and batch engine, behind Ray's HTTP "
                        "proxy (needs the ray extra; docs: serving, Scaling out)")
    p.add_argument("--replicas", type=int, default=None, help="with --ray: a fixed number of replicas (default 1)")
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="with --ray: Ray's autoscaling between MIN and MAX replicas, aiming at --max-batch requests "
                        "per replica")
    p.add_argument("--session-affinity", action="store_true",
                   help="with --ray: requests with the same x-session-id header go to the same replica (Ray's "
                        "experimental consistent-hash router); by default Ray picks the less loaded of two")


def check_arguments(args) -> None:
    """Ray's flags without --ray, or uvicorn's with it, fail before anything loads."""
    if not args.ray:
        given = [flag for flag, value in (("--replicas", args.replicas), ("--autoscale", args.autoscale),
                                          ("--session-affinity", args.session_affinity)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --ray")
        return
    changed = [f"--{name.replace('_', '-')}" for name, default in UVICORN_ONLY.items() if getattr(args, name) != default]
    if changed:
        raise ValueError(f"{', '.join(changed)} set uvicorn's connections; under --ray Ray's proxy holds them "
                         "(set its http_options in a `serve run` config, docs: serving)")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas is not None and args.autoscale is not None:
        raise ValueError("give --replicas or --autoscale, not both")


def autoscaling(spec: str | None, max_batch: int) -> dict | None:
    if spec is None:
        return None
    low, colon, high = spec.partition(":")
    if not (colon and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"--autoscale {spec!r}: write MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4")
    return {"min_replicas": int(low), "max_replicas": int(high), "target_ongoing_requests": max_batch}


def run(args, options, template: str | None, suffix_cache_mb: float) -> int:
    try:
        import ray
        from ray import serve

        from longspec.serve.ray_deployment import ReplicaSpec, deployment
    except ImportError as error:
        raise ValueError(f"`longspec serve --ray` needs the ray extra ({error.name} is missing): "
                         "pip install 'longspec[serve,ray]'") from None
    scaling = autoscaling(args.autoscale, options.max_batch)
    replicas = None if scaling is not None else (1 if args.replicas is None else args.replicas)
    most = replicas or scaling["max_replicas"]
    threads = args.threads or max(1, (os.cpu_count() or 1) // most)
    fewest = replicas or scaling["min_replicas"]
    cluster = os.environ.get("RAY_ADDRESS")
    if cluster is None and fewest * threads > (os.cpu_count() or 1):
        raise ValueError(f"{fewest} replicas x {threads} threads need {fewest * threads} CPUs, this machine has "
                         f"{os.cpu_count()}: lower --replicas or --threads, or join a cluster (RAY_ADDRESS)")
    spec = ReplicaSpec(model=args.model, dtype=args.dtype, device=args.device, threads=threads, chat_template=template,
                       suffix_cache_mb=suffix_cache_mb)
    app = deployment(spec, options, replicas=replicas, autoscaling=scaling, session_affinity=args.session_affinity)
    ray.init(address=cluster)
    serve.start(http_options={"host": args.host, "port": args.port})
    count = f"{replicas} replicas" if replicas is not None else f"{scaling['min_replicas']}-{most} replicas"
    print(f"longspec serve --ray: {options.model_name} on http://{args.host}:{args.port}/v1 ({count} x {threads} "
          f"threads, method {options.method}); replicas are loading", file=sys.stderr, flush=True)
    try:
        serve.run(app, name="longspec", route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Ctrl-C: the replicas and proxy stop with the local Ray
        serve.shutdown()
    return 0
