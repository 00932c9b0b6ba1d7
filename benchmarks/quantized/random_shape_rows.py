"""Rows on the random-weight files of real shapes (`random_gguf`): per file and depth,
AR decode and one 16-token verification forward over the cache (ours vs one
`llama-bench -p 16 -n N -d depth`, whose depth is prefilled once for both tests) and
prefill (ours' prefill of the decoding call vs `llama-bench -p depth -n 0`), in turns. A file our loader refuses
becomes a row naming the error, with its traceback in the results."""

from __future__ import annotations

import gc
import traceback
from pathlib import Path

import llama_cpp
import ours
import torch
from gemma_rows import Settings
from random_gguf import random_gguf
from rows import alternate, load_average, median_rate, row
from shapes import SHAPES

VERIFY_TOKENS = 16


def random_ids(vocab: int, count: int, seed: int = 0) -> list[int]:
    """Ordinary tokens (below the control tokens at the end of the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(256, vocab - 512, (count,), generator=generator).tolist()


def shape_rows(s: Settings, shape_names: list[str], kinds: list[str], contexts: list[int], gguf_dir: Path) -> list[dict]:
    import longspec

    out = []
    for name in shape_names:
        files = random_gguf(SHAPES[name], gguf_dir, s.bin_dir, kinds=tuple(kinds), threads=s.threads)
        for kind, path in files.items():
            fields = {"file": f"{name} {kind}"}
            try:
                model = longspec.load(path, suffix_cache_mb=0)
            except Exception as error:  # noqa: BLE001  reported as the row, not hidden: the loader is what is being judged
                out.append({"row": "load", **fields, "error": "".join(traceback.format_exception(error))})
                print(out[-1]["error"], flush=True)
                continue
            ids = random_ids(model.config.vocab_size, max(contexts))
            ours.warm_up(model, ids[:64])
            for context in contexts:
                out += depth_rows(s, model, path, ids[:context], fields)
            del model
            gc.collect()
    return out


def depth_rows(s: Settings, model, path: Path, prompt: list[int], fields: dict) -> list[dict]:
    context = len(prompt)
    bench = {"threads": s.threads}
    load = load_average()
    samples = alternate(s.repeats, {
        "ours": lambda: ours.decode(model, prompt, new_tokens=s.ar_new_tokens),
        # one depth prefill serves both tests: 16 tokens in one batch, then N decoded one by one
        "llama": lambda: llama_cpp.bench(s.bin_dir, path, prompt=VERIFY_TOKENS, generate=s.ar_new_tokens,
                                         depth=context, **bench),
        "llama_prefill": lambda: llama_cpp.bench(s.bin_dir, path, prompt=context, generate=0, depth=0, warmup=False,
                                                 **bench),
        "ours_verify": lambda: {"prompt_tokens_per_s": VERIFY_TOKENS / ours.verification_seconds(
            model, context=context, tokens=VERIFY_TOKENS)},
    })
    fields = {**fields, "context": context, "prompt": "random ids"}
    goal = 1.0 if fields["file"] == "llama-3.1-8b Q4_K_M" and context >= 4096 else None
    rows = [
        row("ar", ours=median_rate(samples["ours"]), peer=median_rate(samples["llama"]), peer_name="llama-bench AR",
            load=load, goal=goal, samples={"ours": samples["ours"], "llama": samples["llama"]}, **fields),
        row("prefill", ours=median_rate(samples["ours"], "prefill_tokens_per_s"),
            peer=median_rate(samples["llama_prefill"], "prompt_tokens_per_s"), peer_name="llama-bench pp",
            load=load, goal=None, samples={"ours": samples["ours"], "llama": samples["llama_prefill"]}, **fields),
        row(f"verify {VERIFY_TOKENS}", ours=median_rate(samples["ours_verify"], "prompt_tokens_per_s"),
            peer=median_rate(samples["llama"], "prompt_tokens_per_s"),
            peer_name=f"llama-bench pp{VERIFY_TOKENS} at depth", load=load, goal=None,
            samples={"ours": samples["ours_verify"], "llama": samples["llama"]}, **fields),
    ]
    for r in rows:
        print(r["row"], r["file"], context, f"{r['ratio']:.2f}", flush=True)
    return rows
