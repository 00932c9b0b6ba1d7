"""Shared pieces of the benchmark scripts: machine description, memory-bandwidth
measurement, the AR floor, real prompts from local corpora, and a transformers
peer built from the same checkpoint."""

from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path

import torch

from longspec.bench.floor import decode_bytes_per_forward, machine, read_bandwidth_gbs  # noqa: F401  (re-exported)
from longspec.speculation import cost_measurement
from longspec.speculation.drafters.base import Drafter
from longspec.speculation.tree import Tree

# Benchmarks time after their warm-up: a forward cost this machine lacks is measured then,
# not left to the default curve a user's first run decides with (cost_measurement.py).
cost_measurement.set_policy("now")


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
    batch = ids.unsqueeze(0)
    with torch.inference_mode():
        # An explicit mask: without one, transformers hides prompt tokens equal to the pad id.
        out = model.generate(
            batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=0, **kwargs
        )
    return out[0, ids.numel():], time.perf_counter() - start


def call_seconds(call) -> float:
    """Wall seconds of one call (alternating A/B scripts time each side call by call)."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def write_results(path: Path, header: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")


def baseline_library(source: Path, library: str):
    """The native ops of another kernel source (e.g. `git show REV:src/longspec/runtime/kernels/X.cpp`),
    built under their own library name so that they load beside the current ones."""
    import re
    import tempfile

    from torch.utils.cpp_extension import load

    from longspec.runtime.native import KERNELS

    text = re.sub(r"TORCH_LIBRARY_FRAGMENT\(longspec_native", f"TORCH_LIBRARY({library}", source.read_text())
    copy = Path(tempfile.mkdtemp()) / f"{library}.cpp"
    copy.write_text(text)
    load(name=library, sources=[str(copy)], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
         extra_include_paths=[str(KERNELS)], is_python_module=False, verbose=False)
    return getattr(torch.ops, library)


class GarbageDrafter(Drafter):
    """Proposes `length` random tokens every round: none is ever accepted (what `auto`
    must switch off)."""

    def __init__(self, vocab_size: int, length: int = 8, seed: int = 7) -> None:
        self.vocab_size, self.length = vocab_size, length
        self.generator = torch.Generator().manual_seed(seed)

    def begin(self, context) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context) -> Tree:
        count = min(self.length, context.max_nodes)
        return Tree.chain(context.root, torch.randint(0, self.vocab_size, (count,), generator=self.generator).tolist())

