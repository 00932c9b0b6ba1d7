"""Issue 67's goals measured against llama.cpp in one run: ours on a quantized GGUF target
(`longspec.load(path)`, dtype unset) beside llama.cpp's tools on the same file, each row's
sides alternated (A, B, A, B ...) and the median of each side's decode rates compared
(prefill excluded on both sides; ours' one-time setup excluded by `GenerationStats`).

    # once: llama.cpp into /tmp/llama.cpp/build/bin (benchmarks/quantized/build_llama_cpp.sh)
    python benchmarks/suite/quantized_peers.py --llama-bin /tmp/llama.cpp/build/bin        # the Gemma rows
    python benchmarks/suite/quantized_peers.py --llama-bin /tmp/llama.cpp/build/bin --random-shapes \\
        --shapes llama-3.2-1b qwen2.5-1.5b llama-3.2-3b llama-3.1-8b                       # the bigger shapes
    ... --quick                                                                            # a smoke run

Gemma rows (the embedded Gemma 3 270M Q4_K_M, and a Q8_0 file requantized from it once
with `llama-quantize --allow-requantize`, kept under --work):
  ar            ours AR greedy after 1k and 4k tokens vs `llama-bench -p 0 -n N -d depth`, both files
  auto sampled  `auto`, T = 1, top-p 0.95, each seed, on a 4k-token prompt cut from each book in
                --books (held-out prose) vs `llama-completion` on the same prompt file with the same sampler
  auto greedy   greedy `auto` on the same prompts vs llama-completion greedy and `llama-lookup`
                (llama.cpp's prompt-lookup speculation; `--speculation llama-lookup llama-lookahead`
                adds its lookahead decoding), all in turns
--random-shapes rows: see benchmarks/quantized/random_shape_rows.py.

Every process runs on --threads threads (torch and OpenMP here, -t and -tb there). The
header records the CPU (lscpu model and flags), the commit, llama.cpp's version; each row
the load average before it. Writes JSON lines and a CSV to --out, and a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # common.py
sys.path.insert(0, str(ROOT / "benchmarks" / "quantized"))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, default=Path("/tmp/llama.cpp/build/bin"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="turns per row (the median of each side is compared)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ar-new-tokens", type=int, default=128)
    parser.add_argument("--book-context", type=int, default=4096, help="prompt tokens cut from each book")
    parser.add_argument("--book-new-tokens", type=int, default=256)
    parser.add_argument("--books", type=Path, default=ROOT.parent / "shared" / "data" / "books")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--speculation", nargs="+", default=["llama-lookup"], choices=["llama-lookup", "llama-lookahead"],
                        help="llama.cpp's lossless speculation to compare greedy auto with (lookahead verifies "
                             "~120-token batches per step: on 2 cores several times slower than its own AR)")
    parser.add_argument("--random-shapes", action="store_true", help="the random-weight files of real shapes instead")
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "qwen2.5-1.5b", "llama-3.2-3b", "llama-3.1-8b"])
    parser.add_argument("--kinds", nargs="+", default=["Q4_K_M", "Q8_0"])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 turn, 16 tokens, one book, one seed, 1k prompts")
    parser.add_argument("--ar-only", action="store_true", help="Gemma's AR rows only (no book rows): a kernel change's check")
    parser.add_argument("--work", type=Path, default=Path("bench-out/quantized-peers"), help="GGUF files and prompt files")
    parser.add_argument("--out", type=Path, default=None, help="results prefix (default: <work>/results)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.ar_new_tokens, args.book_new_tokens, args.seeds = 1, 16, 16, args.seeds[:1]
        args.book_context = min(args.book_context, 1024)
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be at least 1")
    if not args.random_shapes and not sorted(args.books.glob("*.txt")):
        parser.error(f"no .txt books under {args.books}: pass --books")
    return args


def header(args, bin_dir: Path) -> dict:
    import llama_cpp
    from common import machine

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"benchmark": "quantized_peers", "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
            "machine": machine(), "cpu": fields.get("Model name", "").strip(),
            "cpu_flags": fields.get("Flags", "").split(), "llama_cpp": llama_cpp.version(bin_dir),
            "threads": args.threads, "options": {k: str(v) for k, v in vars(args).items()}}


def book_prompts(tokenizer, books: Path, tokens: int, limit: int | None) -> dict[str, list[int]]:
    """`tokens` tokens from a third of the way into each book (past the front matter)."""
    prompts = {}
    for path in [p for p in sorted(books.glob("*.txt")) if "README" not in p.name][:limit]:
        text = path.read_text(errors="replace")
        text = text[len(text) // 3:][: tokens * 8]
        ids = tokenizer(text).input_ids[:tokens]
        if len(ids) < tokens:
            raise SystemExit(f"{path} gives only {len(ids)} tokens after its first third; pass a smaller --book-context")
        prompts[path.stem] = ids
    return prompts


def gemma(args, settings) -> list[dict]:
    import gemma_rows
    import llama_cpp
    import ours
    from peers import shipped_gguf

    import longspec

    q4 = shipped_gguf(args.work)
    files = {"Q4_K_M": q4, "Q8_0": llama_cpp.requantized(args.llama_bin, q4, args.work, "Q8_0")}
    models = {kind: longspec.load(path, suffix_cache_mb=0) for kind, path in files.items()}  # no earlier outputs to draft from
    books = book_prompts(models["Q4_K_M"].tokenizer, args.books, max(args.book_context, max(args.contexts)),
                         2 if args.quick else None)
    text_ids = next(iter(books.values()))
    for model in models.values():
        ours.warm_up(model, text_ids[:max(args.contexts)])
    rows = gemma_rows.ar_rows(settings, models, files, text_ids, args.contexts)
    if args.ar_only:
        return rows
    prompts = {name: ids[:args.book_context] for name, ids in list(books.items())[: 1 if args.quick else None]}
    ours.warm_up(models["Q4_K_M"], next(iter(prompts.values())))
    return rows + gemma_rows.book_rows(settings, models["Q4_K_M"], q4, prompts, args.seeds)


def main() -> None:
    args = arguments()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import llama_cpp
    import torch
    from common import write_results
    from gemma_rows import Settings
    from rows import markdown

    llama_cpp.check_tools(args.llama_bin)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or args.work / ("results-quick" if args.quick else "results")
    settings = Settings(args.llama_bin, args.threads, args.repeats, args.ar_new_tokens, args.book_new_tokens, args.work,
                        tuple(args.speculation))
    info = header(args, args.llama_bin)
    if args.random_shapes:
        from random_shape_rows import shape_rows

        rows = shape_rows(settings, args.shapes, args.kinds, args.contexts, args.work / "random-gguf")
    else:
        rows = gemma(args, settings)
    write_results(out.with_suffix(".jsonl"), info, rows)
    with out.with_suffix(".csv").open("w", newline="") as f:
        columns = ["row", "file", "context", "prompt", "ours_tokens_per_s", "peer", "peer_tokens_per_s", "ratio", "goal",
                   "load_before", "error"]
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = markdown(rows)
    out.with_suffix(".md").write_text(f"{info['cpu']}, {args.threads} threads, commit {info['commit']}, "
                                      f"llama.cpp {info['llama_cpp']}\n\n{table}\n")
    print(f"\n{info['cpu']}, {args.threads} threads, commit {info['commit']}\n\n{table}")


if __name__ == "__main__":
    main()
