"""Our tokenizer (runtime/tokenizer.py, Rust `tokenizers` alone) against `transformers`'
AutoTokenizer on the same checkpoint directory, in turns in one process: construction,
encoding a long text, and decoding token by token as a stream does. Outputs are checked
equal on every pair.

    python benchmarks/ab/tokenizer_ab.py --pairs 3 [--model DIR]

--model: a checkpoint directory (default: the embedded Gemma 3 270M's converted one).
`transformers` is imported once, before the first pair, and that import is timed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def timed(function):
    start = time.perf_counter()
    value = function()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    from longspec.runtime.tokenizer import read_fast

    directory = args.model
    if directory is None:
        from longspec.runtime.default_model import default_checkpoint_dir

        directory = default_checkpoint_dir()
    import_s, auto = timed(lambda: __import__("transformers").AutoTokenizer)
    print(f"import transformers (AutoTokenizer): {import_s:.2f} s")
    text = Path(__file__).resolve().parents[2].joinpath("src/longspec/api.py").read_text() * 4
    results: dict[str, dict[str, list[float]]] = {"ours": {}, "transformers": {}}
    makers = {"ours": lambda: read_fast(directory)[0],
              "transformers": lambda: auto.from_pretrained(directory, local_files_only=True)}
    reference = None
    for pair in range(args.pairs):
        for name in (("ours", "transformers") if pair % 2 == 0 else ("transformers", "ours")):
            load = os.getloadavg()[0]
            build_s, tokenizer = timed(makers[name])
            encode_s, ids = timed(lambda t=tokenizer: t(text).input_ids)
            decode_s, pieces = timed(lambda t=tokenizer, ids=ids: [t.decode(ids[: i + 1], skip_special_tokens=True)
                                                                  for i in range(min(len(ids), 2000))])
            reference = reference or (ids, pieces)
            assert (ids, pieces) == reference, f"{name} differs"
            for key, value in (("construct_s", build_s), ("encode_s", encode_s), ("decode_2000_s", decode_s)):
                results[name].setdefault(key, []).append(value)
            print(f"{name:12s} construct {build_s:6.2f} s  encode {len(ids)} tokens {encode_s:6.3f} s  "
                  f"2000 prefix decodes {decode_s:6.2f} s  (load {load:.1f})", flush=True)
    for key in results["ours"]:
        ours, theirs = (statistics.median(results[n][key]) for n in ("ours", "transformers"))
        print(f"{key:14s} ours {ours:7.3f}  transformers {theirs:7.3f}  transformers/ours {theirs / ours:5.2f}")


if __name__ == "__main__":
    main()
