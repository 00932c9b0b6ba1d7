"""llama.cpp's tools as one measurement each (one repetition per call, so that the
caller can alternate them with ours), and the rates read from their printouts. Every
call gets the same thread count for generation and for batches (-t, -tb)."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("llama-bench", "llama-completion", "llama-lookup", "llama-lookahead", "llama-quantize")


def check_tools(bin_dir: Path) -> None:
    missing = [tool for tool in TOOLS if not (bin_dir / tool).is_file()]
    if missing:
        raise SystemExit(f"{bin_dir} lacks {', '.join(missing)}: build llama.cpp with "
                         "benchmarks/quantized/build_llama_cpp.sh (or pass --llama-bin)")


def version(bin_dir: Path) -> str:
    """The tools' own version line, and the llama-cpp-python release whose llama.cpp they were
    built from (written by build_llama_cpp.sh: the vendored copy reports no commit)."""
    out = subprocess.run([str(bin_dir / "llama-completion"), "--version"], capture_output=True, text=True, check=False)
    line = " ".join((out.stdout + out.stderr).split()[:8])
    release = bin_dir.parents[1] / "LLAMA_CPP_PYTHON_VERSION"
    return f"{line}; llama-cpp-python {release.read_text().strip()}" if release.is_file() else line


def requantized(bin_dir: Path, source: Path, work: Path, kind: str) -> Path:
    """`source` requantized to `kind` once (kept under `work`)."""
    path = work / f"{source.stem.split('-q')[0]}-{kind.lower()}.gguf"
    if not path.is_file():
        partial = path.with_suffix(".partial")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(partial), kind],
                       check=True, capture_output=True)
        partial.rename(path)
    return path


def bench(bin_dir: Path, model: Path, *, threads: int, prompt: int, generate: int, depth: int,
          warmup: bool = True) -> dict:
    """llama-bench's rates of one repetition after `depth` tokens in the cache (computed once
    per call, not timed): `prompt` tokens processed in one batch, and `generate` tokens decoded
    one at a time (either 0: not run). Its warm-up runs the prompt test once more before."""
    command = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt),
               "-n", str(generate), "-d", str(depth), "-r", "1", "-o", "json", *([] if warmup else ["--no-warmup"])]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    rates = {}
    for test in json.loads(result.stdout):
        key = "decode_tokens_per_s" if test["n_gen"] > 0 else "prompt_tokens_per_s"
        rates[key] = float(test["avg_ts"])
    return rates


@dataclass(frozen=True)
class Sampling:
    temperature: float  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def flags(self) -> list[str]:
        if self.temperature == 0:
            return ["--temp", "0"]
        # llama.cpp's defaults also cut at top-k 40 and min-p 0.05: off, as in ours.
        return ["--temp", str(self.temperature), "--top-p", str(self.top_p), "--top-k", "0", "--min-p", "0",
                "--seed", str(self.seed)]


def _common(model: Path, prompt_file: Path, new_tokens: int, threads: int, context: int) -> list[str]:
    return ["-m", str(model), "-f", str(prompt_file), "-n", str(new_tokens), "-c", str(context), "-t", str(threads),
            "-tb", str(threads), "--ignore-eos"]


_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")  # the prompt's line counts "tokens"
_PROMPT = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def completion(bin_dir: Path, model: Path, prompt_file: Path, *, new_tokens: int, threads: int, context: int,
               sampling: Sampling) -> dict:
    """Plain decoding of the prompt file: decode tokens/s from the timing printout
    (prompt processing excluded), and the prompt's length in llama.cpp's tokens."""
    command = [str(bin_dir / "llama-completion"), *_common(model, prompt_file, new_tokens, threads, context),
               "-no-cnv", "--no-display-prompt", *sampling.flags()]
    log = _run(command)
    evals, prompt = _EVAL.findall(log), _PROMPT.search(log)
    if not evals or prompt is None:
        raise RuntimeError(f"no timing printout from llama-completion:\n{log[-2000:]}")
    ms, runs = float(evals[-1][0]), int(evals[-1][1])
    return {"decode_tokens_per_s": runs / (ms / 1000), "decode_runs": runs, "prompt_tokens": int(prompt.group(1))}


def speculation(bin_dir: Path, tool: str, model: Path, prompt_file: Path, *, new_tokens: int, threads: int,
                context: int) -> dict:
    """llama-lookup (prompt n-grams) or llama-lookahead, greedy: decoded tokens/s from its
    printout (the prompt's encoding excluded), and its acceptance counts."""
    # These tools put the whole prompt in one batch: its logical size must hold it (default 2,048).
    command = [str(bin_dir / tool), *_common(model, prompt_file, new_tokens, threads, context), "--temp", "0",
               "-b", str(context)]
    log = _run(command)
    decoded = _DECODED.search(log)
    if decoded is None:
        raise RuntimeError(f"no 'decoded ... tokens in ... seconds' line from {tool}:\n{log[-2000:]}")
    counts = {key: int(value) for key, value in re.findall(r"(n_drafted|n_accept|n_draft)\s*=\s*(\d+)", log)}
    tokens, seconds = int(decoded.group(1)), float(decoded.group(2))
    return {"decode_tokens_per_s": tokens / seconds, "decoded": tokens, **counts}


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout + "\n" + result.stderr
