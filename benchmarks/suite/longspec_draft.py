"""LongSpec draft on long prompts, in one run: AR, PLD, LongSpec chain / CAPE /
beam, LongSpec + prompt lookup merged into one tree; greedy and sampling; plus the
verification knee (cost of verifying k tokens relative to 1) that sizes the trees,
and the draft's cost with and without its reduced vocabulary.

    python benchmarks/suite/longspec_draft.py --draft src/longspec/weights/longspec-gemma-3-270m.safetensors \
        --shards RUN/shards --context 4096 --new-tokens 128

Prompts: code = the first `context` tokens of the longest held-out standard-library
file of the draft's training split (a file it never saw); prose = a LongBench
Multi-News document (not in the training corpus).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import hf_generate, machine, transformers_peer, write_results
from longspec.api import parse_dtype
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.drafters.longspec import (
    BeamStrategy, CapeStrategy, ChainStrategy, DraftConfig, DraftModel, LongSpecDrafter, SampledChainStrategy, load_draft,
)
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from longspec.training.data import stdlib_dir

MULTI_NEWS = Path(__file__).resolve().parents[3] / "shared" / "data" / "longbench" / "multi_news.jsonl"


def code_prompt(tokenizer, shards: Path, tokens: int) -> tuple[str, torch.Tensor]:
    index = json.loads((shards / "index.json").read_text())
    root = stdlib_dir().parent
    held = [root / name for name in index["files"]["heldout"] if name.endswith(".py") and (root / name).is_file()]
    for path in sorted(held, key=lambda p: -p.stat().st_size):
        ids = tokenizer(path.read_text()).input_ids
        if len(ids) >= tokens:
            return path.name, torch.tensor(ids[:tokens])
    raise ValueError(f"no held-out code file has {tokens} tokens")


def prose_prompt(tokenizer, tokens: int) -> tuple[str, torch.Tensor]:
    for number, line in enumerate(MULTI_NEWS.read_text().splitlines()):
        ids = tokenizer(json.loads(line)["context"]).input_ids
        if len(ids) >= tokens:
            return f"multi_news row {number}", torch.tensor(ids[:tokens])
    raise ValueError(f"no Multi-News document has {tokens} tokens")


def verification_knee(decoder, ids: torch.Tensor, ks=(1, 2, 4, 8, 16, 32, 48, 64), repeats: int = 5) -> dict[int, float]:
    """Best-of-N seconds of one forward of k new tokens after a len(ids) cache."""
    cache = decoder.new_cache(ids.numel() + max(ks) + 1, max_forward_tokens=512)
    for begin in range(0, ids.numel(), 512):
        decoder(ids[begin : begin + 512].unsqueeze(0), cache, logits_rows=slice(0, 0))
        cache.commit()
    times = {}
    for k in ks:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            decoder(ids[:k].unsqueeze(0), cache)
            best = min(best, time.perf_counter() - start)
            cache.drop_pending()
        times[k] = best
    return times


def full_vocab_copy(draft: DraftModel) -> DraftModel:
    config = DraftConfig.from_dict({**draft.config.to_dict(), "draft_vocab_size": None})
    copy = DraftModel(config)
    copy.load_state_dict({k: v for k, v in draft.state_dict().items() if k != "vocab_ids"}, strict=False)
    return copy.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="draft .safetensors (with its .json)")
    parser.add_argument("--shards", type=Path, required=True, help="the draft's training shards (for held-out files)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--beam-widths", default="2,4,4,4,4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers generate baseline")
    parser.add_argument("--out", type=Path, default=Path("bench-out/longspec.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype("bfloat16")
    model = longspec.load(None, dtype=dtype)
    draft = load_draft(args.draft, model.config)
    widths = tuple(int(w) for w in args.beam_widths.split(","))
    tasks = dict([code_prompt(model.tokenizer, args.shards, args.context), prose_prompt(model.tokenizer, args.context)])
    task_kind = dict(zip(tasks, ("code", "prose")))

    knee = verification_knee(model.target.model, next(iter(tasks.values())))
    knee_ratio = {k: t / knee[1] for k, t in knee.items()}
    print("verification knee (k tokens / 1 token):", {k: round(r, 2) for k, r in knee_ratio.items()}, flush=True)

    g = args.gamma
    greedy_methods = {
        "pld": lambda: PromptLookupDrafter(num_tokens=10),
        "longspec-chain": lambda: LongSpecDrafter(draft, ChainStrategy(g)),
        "longspec-chain full-vocab": lambda: LongSpecDrafter(full_vocab_copy(draft), ChainStrategy(g)),
        "longspec-cape": lambda: LongSpecDrafter(draft, CapeStrategy(g)),
        "longspec-beam": lambda: LongSpecDrafter(draft, BeamStrategy(widths)),
        "longspec-beam+pld": lambda: LongSpecDrafter(draft, BeamStrategy(widths), retrieval=PromptLookupDrafter(num_tokens=10)),
        "longspec-chain+pld": lambda: LongSpecDrafter(draft, ChainStrategy(g), retrieval=PromptLookupDrafter(num_tokens=10)),
    }
    sampled_methods = {
        "pld": greedy_methods["pld"],
        "longspec-sampled-chain": lambda: LongSpecDrafter(draft, SampledChainStrategy(g, 1.0), seed=1),
        "longspec-cape": greedy_methods["longspec-cape"],
        "longspec-beam": greedy_methods["longspec-beam"],
        "longspec-beam+pld": greedy_methods["longspec-beam+pld"],
    }
    settings = {"greedy": SamplingParams(), "sampling": SamplingParams(temperature=1.0, top_p=0.9)}
    peer = None if args.no_transformers else transformers_peer(model.target.source, dtype)

    def run(ids, drafter, params):
        stats = GenerationStats()
        generator = torch.Generator().manual_seed(0)
        rounds = model.engine.generate(ids, params=params, max_new_tokens=args.new_tokens, drafter=drafter, stats=stats, generator=generator)
        return torch.cat(list(rounds)), stats

    run(next(iter(tasks.values()))[:64], None, SamplingParams())  # warm-up
    rows = []
    for setting, params in settings.items():
        methods = greedy_methods if setting == "greedy" else sampled_methods
        for task, ids in tasks.items():
            ar_tokens, ar = run(ids, None, params)
            base = {"setting": setting, "task": task_kind[task], "prompt": task, "context": ids.numel(), "new_tokens": args.new_tokens}
            hf_tps = None
            if peer is not None:
                hf_kwargs = {} if setting == "greedy" else {"do_sample": True, "temperature": 1.0, "top_p": 0.9, "top_k": 0}
                _, prefill_s = hf_generate(peer, ids, 1, **hf_kwargs)
                _, hf_s = hf_generate(peer, ids, args.new_tokens, **hf_kwargs)
                hf_tps = args.new_tokens / (hf_s - prefill_s)
            rows.append({**base, "method": "ar", "tps": ar.decode_tokens_per_s, "vs_ar": 1.0, "tau": ar.tau, "hf_tps": hf_tps})
            print(rows[-1], flush=True)
            for name, factory in methods.items():
                drafter = factory()
                tokens, stats = run(ids, drafter, params)
                state = getattr(drafter, "state", None)
                rows.append({
                    **base, "method": name, "tps": stats.decode_tokens_per_s, "vs_ar": stats.decode_tokens_per_s / ar.decode_tokens_per_s,
                    "vs_hf": stats.decode_tokens_per_s / hf_tps if hf_tps else None, "tau": stats.tau,
                    "acceptance": [round(a, 3) for a in stats.acceptance_by_depth[:8]],
                    "draft_ms_per_round": 1e3 * stats.draft_s / max(stats.target_forwards, 1),
                    "verify_ms_per_round": 1e3 * stats.verify_s / max(stats.target_forwards, 1),
                    "draft_state_bytes": state.nbytes() if state is not None else None,
                    "equals_ar": bool(torch.equal(tokens, ar_tokens)) if setting == "greedy" else None,
                })
                print(rows[-1], flush=True)
    header = {
        "benchmark": "longspec", "machine": machine(), "draft": str(args.draft), "draft_config": draft.config.to_dict(),
        "knee_seconds": knee, "knee_ratio": knee_ratio, "beam_widths": widths, "gamma": g, "time": time.ctime(),
        "threads": torch.get_num_threads(),
    }
    write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}\n")
    print("| setting | task | method | tok/s | × AR | × transformers | τ | acceptance by depth | draft ms/round | verify ms/round | draft state | = AR |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        state = r.get("draft_state_bytes")
        state = "" if state is None else f"{state / 2**20:.2f} MiB"
        equal = "" if r.get("equals_ar") is None else ("yes" if r["equals_ar"] else "no")
        hf = r.get("vs_hf") if r["method"] != "ar" else (r["tps"] / r["hf_tps"] if r.get("hf_tps") else None)
        print(
            f"| {r['setting']} | {r['task']} | {r['method']} | {r['tps']:.1f} | {r['vs_ar']:.2f} | "
            f"{'' if hf is None else round(hf, 2)} | {r['tau']:.2f} | {r.get('acceptance', '')} | "
            f"{r.get('draft_ms_per_round', 0):.1f} | {r.get('verify_ms_per_round', 0):.1f} | "
            f"{state} | {equal} |"
        )


if __name__ == "__main__":
    main()
