"""Ray Serve against `longspec serve` on loopback: throughput of 1 replica against the
plain server at --clients concurrent clients, then 2 replicas x 1 thread against 1
replica x 2 threads at 2x --clients. Each client sends --requests short greedy
streamed completions (serve_load.py's prompts); a discarded round warms each server
first (its forward-cost measurements, the first batch shapes). Outputs are compared
with offline generation (in bfloat16 a batched forward may round a near-tie
differently; the report counts equal outputs).

    python benchmarks/serving/serve_ray.py --clients 8 --requests 2 --max-tokens 32 [--method auto] [--out DIR]

One server runs at a time; the plain server in this process (uvicorn in a thread), Ray's
replicas in their own processes on a local Ray with every core.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import sys
import time
from pathlib import Path

import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # live_server.py

import longspec
from common import machine
from live_server import Server
from longspec.serve import ServeOptions
from longspec.speculation.engine import EngineOptions
from serve_load import NAME, TOPICS


def load(url: str, prompts: list[str], requests: int, max_tokens: int, expected: dict[str, str]) -> dict:
    """Every prompt a client of its own, `requests` streamed greedy requests each."""

    def session(prompt: str) -> tuple[int, int]:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        tokens = equal = 0
        for _ in range(requests):
            pieces, usage = [], None
            for chunk in client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].text:
                    pieces.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    usage = chunk.usage
            tokens += usage.completion_tokens
            equal += "".join(pieces) == expected[prompt]
        return tokens, equal

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        sessions = list(pool.map(session, prompts))
    elapsed = time.perf_counter() - start
    done = len(prompts) * requests
    return {"clients": len(prompts), "requests": done, "equal_offline": sum(e for _, e in sessions),
            "requests_per_s": done / elapsed, "tokens_per_s": sum(t for t, _ in sessions) / elapsed,
            "elapsed_s": elapsed}


def measured(url: str, prompts, args, expected) -> dict:
    load(url, prompts, 1, args.max_tokens, expected)  # warm-up, discarded
    return load(url, prompts, args.requests, args.max_tokens, expected)


def on_ray(options: ServeOptions, replicas: int, threads: int, prompts, args, expected) -> dict:
    from ray import serve

    from longspec.serve.ray_deployment import ReplicaSpec, deployment

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        spec = ReplicaSpec(model=args.model, dtype=args.dtype, threads=threads)
        serve.run(deployment(spec, options, replicas=replicas), name="longspec", route_prefix="/")
        return measured(f"http://127.0.0.1:{port}/v1", prompts, args, expected)
    finally:
        serve.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, after the warm-up round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import ray

    cores = os.cpu_count() or 1
    if cores < 2:
        raise SystemExit("the 2-replica comparison needs 2 cores")
    model = longspec.load(args.model, dtype=args.dtype, engine=EngineOptions(progress=False))
    wide = [f"Write a short Python implementation of {TOPICS[i % len(TOPICS)]}.\n\n```python\n"
            for i in range(2 * args.clients)]
    expected = {p: model.generate(p, max_new_tokens=args.max_tokens, method=args.method).text for p in wide}
    narrow = wide[: args.clients]
    options = ServeOptions(model_name=NAME, method=args.method, max_concurrent=4 * args.clients,
                           max_new_tokens=args.max_tokens, max_batch=args.max_batch, max_prompt_tokens=512)
    load_before = os.getloadavg()
    torch.set_num_threads(cores)
    local = Server(model, options)
    try:
        plain = measured(local.url + "/v1", narrow, args, expected)
    finally:
        local.stop()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        one = on_ray(options, 1, cores, narrow, args, expected)
        wide_one = on_ray(options, 1, cores, wide, args, expected)
        wide_two = on_ray(options, 2, cores // 2, wide, args, expected)
    finally:
        ray.shutdown()
    rows = [{"server": "longspec serve", "layout": f"1 x {cores} threads", **plain},
            {"server": "ray serve", "layout": f"1 x {cores} threads", **one},
            {"server": "ray serve", "layout": f"1 x {cores} threads", **wide_one},
            {"server": "ray serve", "layout": f"2 x {cores // 2} threads", **wide_two}]
    context = {"machine": machine(), "method": args.method, "max_tokens": args.max_tokens, "dtype": args.dtype,
               "max_batch": args.max_batch, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(json.dumps(context))
    print("| server | replicas x threads | clients | requests | equal offline | requests/s | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['layout']} | {r['clients']} | {r['requests']} | {r['equal_offline']} | "
              f"{r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} |")
    print(f"ray 1 replica / longspec serve at {args.clients} clients: {one['tokens_per_s'] / plain['tokens_per_s']:.2f}; "
          f"2x{cores // 2} / 1x{cores} at {2 * args.clients} clients: "
          f"{wide_two['tokens_per_s'] / wide_one['tokens_per_s']:.2f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.jsonl").write_text("".join(json.dumps({**r, **context}) + "\n" for r in rows))


if __name__ == "__main__":
    main()
