"""The suffix cache across requests: `auto` with the model's cache against `auto`
without it, greedy, on Gemma 3 270M (the embedded default), interleaved request by
request so both see the same machine load.

Workloads:
  templated  50 requests whose outputs repeat across requests: API responses as
             JSON records (the same fields, other values) and Python modules with the
             same boilerplate (other names); no prompt holds the template, so prompt
             lookup alone cannot copy it;
  unrelated  prose continuations on unrelated subjects (the cache must not slow them).

Each request runs with the cache on (one cache across the workload, fed by each
finished request) and off, in alternating order; the outputs must be equal (lossless).

    python benchmarks/suite/suffix_cache.py --out bench-out/suffix_cache.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine
from longspec.speculation.drafters.suffix_cache import SuffixCache

NAMES = ["Alice Smith", "Bruno Diaz", "Chen Wei", "Dana Kowalski", "Emeka Obi", "Fatima Zahra", "Goran Petrov",
         "Hana Sato", "Ivan Horvat", "Julia Costa", "Kofi Mensah", "Lena Fischer", "Mateo Rossi", "Nadia Haddad",
         "Oscar Lind", "Priya Nair", "Quinn Murphy", "Rosa Alvarez", "Sami Korhonen", "Tara Singh", "Umar Farooq",
         "Vera Novak", "Wen Li", "Ximena Ruiz", "Yusuf Demir"]
MODULES = ["invoice", "customer", "shipment", "payment", "product", "warehouse", "order", "supplier", "refund",
           "coupon", "review", "cart", "session", "profile", "address", "ticket", "report", "employee", "contract",
           "delivery", "category", "discount", "subscription", "notification", "inventory"]
SUBJECTS = ["the Roman aqueducts", "photosynthesis in desert plants", "the jazz clubs of 1920s Chicago",
            "plate tectonics", "the invention of the printing press", "coral reef ecology", "medieval Icelandic sagas",
            "the physics of rainbows", "beekeeping in winter", "the Silk Road trade", "volcanoes of Iceland",
            "the life of Marie Curie", "ancient Egyptian astronomy", "how glaciers move", "the origins of chess",
            "the migration of monarch butterflies", "Gothic cathedral architecture", "the Apollo 11 landing",
            "fermentation in bread making", "the geography of Patagonia"]


def json_prompt(i: int) -> str:
    name = NAMES[i % len(NAMES)]
    return f'GET /api/v2/users/{1040 + 7 * i} HTTP/1.1\nHost: api.example.com\n\nHTTP/1.1 200 OK\n' \
           f'Content-Type: application/json\n\n{{"id": {1040 + 7 * i}, "name": "{name}",'


def code_prompt(i: int) -> str:
    module = MODULES[i % len(MODULES)]
    cls = module.capitalize()
    return f'# {module}_service.py\n"""Service layer for {module} records: create, read, update, delete."""\n\n' \
           f'from __future__ import annotations\n\nimport logging\n\n\nclass {cls}Service:'


def templated(count: int) -> list[str]:
    return [json_prompt(i // 2) if i % 2 == 0 else code_prompt(i // 2) for i in range(count)]


def unrelated(count: int) -> list[str]:
    return [f"An introduction to {SUBJECTS[i % len(SUBJECTS)]}.\n\n" for i in range(count)]


def timed(model, prompt: str, new_tokens: int) -> tuple[list[int], float, dict]:
    start = time.perf_counter()
    result = model.generate(prompt, method="auto", max_new_tokens=new_tokens, ignore_eos=True)
    return result.token_ids, time.perf_counter() - start, result.stats.controller or {}


def run_workload(model, cache: SuffixCache, prompts: list[str], new_tokens: int) -> dict:
    seconds = {"on": 0.0, "off": 0.0}
    credited = 0
    for i, prompt in enumerate(prompts):
        outputs = {}
        for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
            model.suffix_cache = cache if arm == "on" else None  # off: auto is prompt lookup alone, nothing stored
            tokens, elapsed, controller = timed(model, prompt, new_tokens)
            outputs[arm] = tokens
            seconds[arm] += elapsed
            if arm == "on":
                credited += controller.get("credited_tokens", {}).get("suffix", 0)
        if outputs["on"] != outputs["off"]:
            raise AssertionError(f"request {i}: the outputs differ with and without the cache")
    tokens = len(prompts) * new_tokens
    return {"requests": len(prompts), "new_tokens": new_tokens, "seconds_on": seconds["on"],
            "seconds_off": seconds["off"], "tokens_per_s_on": tokens / seconds["on"],
            "tokens_per_s_off": tokens / seconds["off"], "speedup": seconds["off"] / seconds["on"],
            "suffix_credited_tokens": credited, "cache": cache.stats()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--unrelated", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--cache-mb", type=float, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-out/suffix_cache.json"))
    args = parser.parse_args()
    model = longspec.load(args.model)
    model.generate("Warm up.", method="auto", max_new_tokens=8)  # kernels, the cost curve
    cache = SuffixCache.of_megabytes(args.cache_mb)
    report = {"command": " ".join(sys.argv), "machine": machine(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "load_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    report["templated"] = run_workload(model, cache, templated(args.requests), args.new_tokens)
    print(json.dumps(report["templated"]), flush=True)
    report["unrelated"] = run_workload(model, cache, unrelated(args.unrelated), args.new_tokens)
    print(json.dumps(report["unrelated"]), flush=True)
    report["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("command", "commit", "load_before", "load_after")}))


if __name__ == "__main__":
    main()
