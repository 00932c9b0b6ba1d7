"""Load test of `longspec serve` on loopback: C concurrent clients (the official
`openai` client, streaming) × R requests each, bounded in count and time. Every
greedy response must equal the offline generation of the same prompt; the report
gives requests/s, generated tokens/s and p50/p95 time to first token.

    python benchmarks/serving/serve_load.py --clients 16 --requests 2 --max-tokens 48 --max-batch 8 [--model PATH] [--method pld]

The server batches up to --max-batch requests per forward (--max-batch 1 serves them
one at a time, the earlier baseline). In bfloat16 a batched forward may round a
near-tie differently from the single-sequence one, so a served greedy output can
differ from the offline run there; the report counts equal outputs, and the run
fails on any difference in float32/float64, where batching is exact.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine
from longspec.serve import ServeOptions, create_app
from longspec.speculation.engine import EngineOptions

NAME = "served"
TOPICS = ("a linked list", "binary search", "a web server", "quicksort", "a JSON parser", "matrix multiplication",
          "a hash map", "merge sort", "a tokenizer", "an LRU cache", "a priority queue", "a trie", "Dijkstra's algorithm",
          "a bloom filter", "a rate limiter", "a ring buffer")


def start_server(model, options: ServeOptions) -> tuple[uvicorn.Server, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(model, options), host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--method", default="pld")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole load phase")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=8, help="requests decoded together (1: one at a time)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = longspec.load(args.model, dtype=args.dtype, engine=EngineOptions(progress=False))
    prompts = [f"Write a short Python implementation of {TOPICS[i % len(TOPICS)]}.\n\n```python\n"
               for i in range(args.clients)]
    offline_start = time.perf_counter()
    offline = {p: model.generate(p, max_new_tokens=args.max_tokens, method=args.method) for p in prompts}
    offline_s = time.perf_counter() - offline_start
    expected = {p: result.text for p, result in offline.items()}

    server, url = start_server(model, ServeOptions(model_name=NAME, method=args.method,
                                                   max_concurrent=args.clients * args.requests,
                                                   max_new_tokens=args.max_tokens, max_batch=args.max_batch,
                                                   max_prompt_tokens=512))

    def session(prompt: str) -> list[dict]:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=args.timeout)
        results = []
        for _ in range(args.requests):
            sent = time.perf_counter()
            first, pieces, usage = None, [], None
            for chunk in client.completions.create(model=NAME, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.perf_counter()
                    pieces.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    usage = chunk.usage
            results.append({"ttft": (first or time.perf_counter()) - sent, "tokens": usage.completion_tokens,
                            "equal": "".join(pieces) == expected[prompt]})
        return results

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        sessions = list(pool.map(session, prompts, timeout=args.timeout))
    elapsed = time.perf_counter() - start
    server.should_exit = True
    results = [r for s in sessions for r in s]
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    report = {
        "benchmark": "serve_load", "machine": machine(), "method": args.method, "clients": args.clients,
        "requests": len(results), "max_tokens": args.max_tokens, "max_batch": args.max_batch, "dtype": args.dtype,
        "equal_offline": sum(r["equal"] for r in results),
        "requests_per_s": len(results) / elapsed, "tokens_per_s": tokens / elapsed,
        "offline_tokens_per_s": sum(len(r.token_ids) for r in offline.values()) / offline_s,
        "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "elapsed_s": elapsed,
    }
    print(json.dumps(report, indent=1))
    if report["equal_offline"] < len(results) and args.dtype in ("float32", "fp32", "float64"):
        raise SystemExit("some served outputs differ from offline generation")


if __name__ == "__main__":
    main()
