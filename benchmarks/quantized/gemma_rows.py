"""The rows of issue 67's goals on the embedded Gemma 3 270M: AR decode of the Q4_K_M
and Q8_0 files beside llama-bench at each depth; `auto` on book prompts, sampled
(T = 1, top-p 0.95, each seed) and greedy, beside llama.cpp's plain decoding of the same
prompt file with the same sampler; greedy `auto` beside llama-lookup (and llama-lookahead where asked)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import llama_cpp
import ours
from rows import alternate, load_average, median_rate, row


@dataclass(frozen=True)
class Settings:
    bin_dir: Path
    threads: int
    repeats: int
    ar_new_tokens: int  # llama-bench -n and ours' max_new_tokens on the AR rows
    book_new_tokens: int  # on the `auto` rows
    work: Path
    speculation: tuple[str, ...] = ("llama-lookup",)  # llama.cpp's lossless speculation tools compared


def ar_rows(s: Settings, models: dict, files: dict[str, Path], ids: list[int], contexts: list[int]) -> list[dict]:
    """Ours AR greedy after `context` tokens of real text vs llama-bench -p 0 -n N -d context."""
    goals = {"Q4_K_M": 1.15, "Q8_0": 1.1}
    out = []
    for context in contexts:
        prompt = ids[:context]
        for kind, model in models.items():
            load = load_average()
            samples = alternate(s.repeats, {
                "ours": partial(ours.decode, model, prompt, new_tokens=s.ar_new_tokens),
                "llama": partial(llama_cpp.bench, s.bin_dir, files[kind], threads=s.threads, prompt=0,
                                 generate=s.ar_new_tokens, depth=context),
            })
            out.append(row("ar", ours=median_rate(samples["ours"]), peer=median_rate(samples["llama"]),
                           peer_name="llama-bench AR", load=load, goal=goals.get(kind), samples=samples,
                           file=kind, context=context, prompt="book text"))
            print(out[-1]["row"], kind, context, f"{out[-1]['ratio']:.2f}", flush=True)
    return out


def book_rows(s: Settings, model, q4: Path, books: dict[str, list[int]], seeds: list[int]) -> list[dict]:
    """Per book: `auto` sampled per seed vs llama-completion with the same sampler, then greedy
    `auto` vs llama-completion greedy, llama-lookup and llama-lookahead, all on the Q4_K_M file."""
    out = []
    for name, ids in books.items():
        prompt_file = s.work / f"prompt-{name}-{len(ids)}.txt"
        prompt_file.write_text(model.tokenizer.decode(ids, skip_special_tokens=True))  # llama.cpp adds its BOS
        context = len(ids) + s.book_new_tokens + 256  # room for llama.cpp's count of the same text
        fields = {"file": "Q4_K_M", "context": len(ids), "prompt": name}
        for seed in seeds:
            sampling = llama_cpp.Sampling(1.0, 0.95, seed)
            load = load_average()
            samples = alternate(s.repeats, {
                "ours": partial(ours.decode, model, ids, new_tokens=s.book_new_tokens, method="auto",
                                temperature=1.0, top_p=0.95, seed=seed),
                "llama": partial(llama_cpp.completion, s.bin_dir, q4, prompt_file, new_tokens=s.book_new_tokens,
                                 threads=s.threads, context=context, sampling=sampling),
            })
            out.append(row(f"auto sampled seed {seed}", ours=median_rate(samples["ours"]),
                           peer=median_rate(samples["llama"]), peer_name="llama.cpp AR (same sampler)", load=load,
                           goal=1.1, samples=samples, **fields))
            print(out[-1]["row"], name, f"{out[-1]['ratio']:.2f}", flush=True)
        out += greedy_rows(s, model, q4, ids, prompt_file, context, fields)
    return out


def greedy_rows(s: Settings, model, q4: Path, ids: list[int], prompt_file: Path, context: int,
                fields: dict) -> list[dict]:
    spec = {"new_tokens": s.book_new_tokens, "threads": s.threads, "context": context}
    load = load_average()
    sides = {
        "ours": lambda: ours.decode(model, ids, new_tokens=s.book_new_tokens, method="auto"),
        "llama": lambda: llama_cpp.completion(s.bin_dir, q4, prompt_file, sampling=llama_cpp.Sampling(0.0), **spec),
    }
    for tool in s.speculation:
        sides[tool] = lambda tool=tool: llama_cpp.speculation(s.bin_dir, tool, q4, prompt_file, **spec)
    samples = alternate(s.repeats, sides)
    mine = median_rate(samples["ours"])
    out = []
    for peer, goal in (("llama", 2.0), *((tool, 1.3) for tool in s.speculation)):
        label = "llama.cpp AR greedy" if peer == "llama" else peer
        out.append(row("auto greedy", ours=mine, peer=median_rate(samples[peer]), peer_name=label, load=load,
                       goal=goal, samples={"ours": samples["ours"], peer: samples[peer]}, **fields))
        print(out[-1]["row"], fields["prompt"], label, f"{out[-1]['ratio']:.2f}", flush=True)
    return out
