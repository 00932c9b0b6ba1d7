"""How `longspec serve`'s throughput grows with concurrent clients: one client, then C
clients at once, each sending one greedy request with a long prompt; generated tokens/s
and the ratio to one client, for each --max-batch asked.

    python benchmarks/serving/serve_scaling.py --clients 8 --prompt-tokens 1000 --max-tokens 128 --max-batch 4 8

The server runs in this process on loopback (uvicorn in a thread) and the official
`openai` client sends the requests; prompts are Python source, distinct per client.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/: live_server.py

import longspec
from common import machine, stdlib_source_text
from live_server import Server
from longspec.serve import ServeOptions
from longspec.speculation.engine import EngineOptions


def tokens_per_second(model, prompts, max_batch: int, clients: int, max_tokens: int, method: str) -> float:
    server = Server(model, ServeOptions(model_name="served", method=method, max_batch=max_batch))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        client.completions.create(model="served", prompt=prompts[0][:32], max_tokens=4, temperature=0)  # warm-up

        def one(i: int) -> int:
            reply = client.completions.create(model="served", prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True})
            return reply.usage.completion_tokens

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            generated = sum(pool.map(one, range(clients)))
        return generated / (time.perf_counter() - start)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--method", default="ar")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load(engine=EngineOptions(progress=False))
    # Built now, not by the first server's startup thread while one client is being timed.
    model.grammar_vocabulary()
    ids = model.tokenizer(stdlib_source_text(300 * args.prompt_tokens)).input_ids
    stride = len(ids) // args.clients
    prompts = [ids[i * stride : i * stride + args.prompt_tokens] for i in range(args.clients)]
    single = tokens_per_second(model, prompts, args.max_batch[0], 1, args.max_tokens, args.method)
    rows = [{"clients": 1, "max_batch": args.max_batch[0], "tokens_per_s": single, "ratio": 1.0}]
    for max_batch in args.max_batch:
        rate = tokens_per_second(model, prompts, max_batch, args.clients, args.max_tokens, args.method)
        rows.append({"clients": args.clients, "max_batch": max_batch, "tokens_per_s": rate, "ratio": rate / single})
    print(f"machine: {machine()}; {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, --method "
          f"{args.method}\n")
    print("| clients | --max-batch | generated tok/s | against one client |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['clients']} | {row['max_batch']} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.jsonl").write_text("".join(json.dumps({**r, "machine": machine()}) + "\n" for r in rows))


if __name__ == "__main__":
    main()
