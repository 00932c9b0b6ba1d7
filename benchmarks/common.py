"""Shared pieces of the benchmark scripts: machine description, memory-bandwidth
measurement, the AR floor, real prompts from local corpora, and a transformers
peer built from the same checkpoint."""

from __future__ import annotations

import json
import os
import platform
import sysconfig
import time
from pathlib import Path

import torch


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best-of-N read bandwidth: summing a large buffer reads every byte once."""
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def decode_bytes_per_forward(model, context_tokens: int) -> int:
    """Bytes one decode forward must read: every weight once (the embedding lookup
    reads one row, but a tied head reads the whole matrix) plus the K/V it attends."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * c.num_kv_heads * c.head_dim * model.embed_weight.element_size()
    attended = sum(
        min(context_tokens, c.sliding_window) if sliding else context_tokens for sliding in c.layer_is_sliding
    )
    return weights + kv_per_token * attended


def stdlib_source_text(min_chars: int, *, skip: int = 0) -> str:
    """Concatenated Python standard-library modules, a corpus on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[skip:]
    parts, total = [], 0
    for path in files:
        text = path.read_text(errors="replace")
        parts.append(f"# file: {path.name}\n{text}")
        total += len(text)
        if total >= min_chars:
            break
    return "\n".join(parts)


def prose_text(min_chars: int) -> str:
    """English prose: Python's own documentation topics (pydoc_data), on every machine."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return text[: max(min_chars, 1)]


def code_file_prompt(tokenizer, tokens: int, *, file_name: str = "argparse.py") -> torch.Tensor:
    """The first `tokens` tokens of one long standard-library file (to be continued)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / file_name
    ids = tokenizer(path.read_text()).input_ids
    if len(ids) < tokens:
        raise ValueError(f"{path} has only {len(ids)} tokens, fewer than {tokens}")
    return torch.tensor(ids[:tokens])


def prompt_ids(tokenizer, text: str, tokens: int) -> torch.Tensor:
    ids = tokenizer(text).input_ids
    if len(ids) < tokens:
        raise ValueError(f"corpus has only {len(ids)} tokens, fewer than the {tokens} asked for")
    return torch.tensor(ids[:tokens])


def transformers_peer(checkpoint_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype)
    return model.eval()


def hf_generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> tuple[torch.Tensor, float]:
    """(new token ids, seconds) of one transformers generate call, greedy unless told."""
    kwargs.setdefault("do_sample", False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids.unsqueeze(0), max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **kwargs
        )
    return out[0, ids.numel():], time.perf_counter() - start


def write_results(path: Path, header: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
