"""The matrix runner: every prompt × setting × method, with warm-up, separate
prefill and decode timing, equality checks of greedy outputs against our AR and
`transformers`, Distinct-n, and rows appended to a JSON-lines file as they
finish (so `resume` loses nothing when a long run stops).

The runner works on token ids: the target is an already-loaded `Decoder` and a
tokenizer is optional, so tests inject tiny random models.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from longspec.bench.methods import BenchMethod, RunOutput, Setting, SkippedMethod, Unavailable
from longspec.bench.tasks import Prompt
from longspec.runtime.atomic_files import trim_torn_tail, write_atomically
from longspec.speculation.metrics import distinct_n

AR_REFERENCE = "ar"  # our autoregressive decoding
HF_REFERENCE = "hf"  # transformers greedy generate


@dataclass(frozen=True)
class RunnerOptions:
    max_new_tokens: int = 256
    ignore_eos: bool = True  # fixed output length: tokens/s and speedups compare equal work
    warmup_tokens: int = 8
    warmup_prompt_tokens: int = 64
    # A divergence where both tokens are the target's top two and their logits are
    # within this many units in the last place (of the model dtype, at the top logit's
    # magnitude) is reported as a near-tie: the same math rounded differently by a
    # 1-token and a k-token forward (a few roundings). Anything else is a bug.
    near_tie_ulps: float = 4.0
    progress: bool = True
    # Timed runs of each method per prompt and setting. A shared VM's speed drifts from
    # minute to minute (docs/benchmarks.md#running-the-benchmarks); repeats run interleaved
    # (every method once, then again, the order rotated) and reports keep each method's
    # median run.
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def next_token_logits(model, ids: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """The target's logits for the token after `ids` (one plain prefill)."""
    cache = model.new_cache(ids.numel(), max_forward_tokens=min(chunk, ids.numel()))
    out = None
    for begin in range(0, ids.numel(), chunk):
        piece = ids[begin : begin + chunk]
        last = begin + chunk >= ids.numel()
        out = model(piece.unsqueeze(0), cache, logits_rows=slice(-1, None) if last else slice(0, 0))
        cache.commit()
    return out.logits[0, -1]


def ulp(dtype: torch.dtype, value: float) -> float:
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(value), info.tiny)))


@dataclass
class _References:
    ar: list[int] | None = None
    hf: list[int] | None = None

    def complete(self, present: set[str]) -> bool:
        return (self.ar is not None or AR_REFERENCE not in present) and (
            self.hf is not None or HF_REFERENCE not in present)


class BenchRunner:
    def __init__(self, target, methods: Sequence[BenchMethod], *, options: RunnerOptions = RunnerOptions(),
                 eos_token_ids: Sequence[int] = (), skipped: Sequence[SkippedMethod] = ()) -> None:
        names = [m.name for m in methods]
        if len(set(names)) != len(names):
            raise ValueError(f"method names must be unique, got {names}")
        # References first, so every other method's greedy row can be checked against them.
        order = {AR_REFERENCE: 0, HF_REFERENCE: 1}
        self.methods = sorted(methods, key=lambda m: order.get(m.name, 2))
        self.target = target
        self.options = options
        self.eos_token_ids = () if options.ignore_eos else tuple(eos_token_ids)
        self.skipped = list(skipped)

    # ------------------------------------------------------------------ public
    def run(self, prompts: Sequence[Prompt], settings: Sequence[Setting], out_path: Path, *,
            header: dict | None = None, resume: bool = False) -> list[dict]:
        """Run the matrix, appending one JSON row per run to out_path (first line: the
        header). With resume, rows already in out_path are kept and not re-run."""
        if not prompts:
            raise ValueError("no prompts to run: check the tasks, --limit and --context-buckets")
        for p in prompts:
            room = self.target.config.max_position_embeddings - p.context_tokens
            if room < self.options.max_new_tokens:
                raise ValueError(
                    f"{p.task} item {p.item_id}: {p.context_tokens} prompt tokens + max_new_tokens="
                    f"{self.options.max_new_tokens} exceed the model's context of "
                    f"{self.target.config.max_position_embeddings}; use smaller context buckets or fewer new tokens"
                )
        out_path = Path(out_path)
        done = []
        if resume and out_path.is_file():
            trim_torn_tail(out_path, _is_json)  # a row cut off by a killed run is run again
            done = load_rows(out_path)
            check_same_run(done, header or {}, out_path)
        done_keys = {row_key(r) for r in done if r.get("kind") == "run"}
        if not done:
            done = [{"kind": "header", **(header or {})}]
            done += [{"kind": "skipped", "method": s.name, "reason": s.reason} for s in self.skipped]
            write_atomically(out_path, "".join(json.dumps(r) + "\n" for r in done))
        plan = [(p, s, repeat, m) for p in prompts for s in settings
                for repeat in range(self.options.repeats) for m in self._rotated(repeat)]
        todo = [job for job in plan if self._key(*job) not in done_keys]
        rows = list(done)
        if todo:
            self._warm_up(prompts[0], settings, out_path, rows)
        references = self._references_from(done)
        present = {m.name for m in self.methods} & {AR_REFERENCE, HF_REFERENCE}
        waiting: list[tuple] = []  # greedy rows held until every reference of their prompt has run
        bar = tqdm(total=len(todo), desc="bench", unit="run", disable=not self.options.progress)
        with bar, out_path.open("a") as f:
            for prompt, setting, repeat, method in todo:
                if any(s.name == method.name for s in self.skipped):
                    bar.update(1)
                    continue
                bar.set_postfix_str(f"{prompt.task}@{prompt.context_tokens} {setting.name} {method.name}")
                refs = references.setdefault((prompt.key, prompt.context_tokens, setting.name, setting.seed),
                                             _References())
                try:
                    out = method.run(prompt.ids, setting, self.options.max_new_tokens, self.eos_token_ids)
                except Unavailable as why:
                    waiting.append((self._base(prompt, setting, repeat, method)
                                    | {"kind": "unavailable", "reason": str(why)},))
                else:
                    if setting.greedy and method.name in present:
                        setattr(refs, "ar" if method.name == AR_REFERENCE else "hf", out.tokens)
                    waiting.append((prompt, setting, repeat, method, out, refs))
                ready = [w for w in waiting if len(w) == 1 or not w[1].greedy or w[5].complete(present)]
                for job in ready:
                    waiting.remove(job)
                    row = job[0] if len(job) == 1 else self._row(*job)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    rows.append(row)
                bar.update(1)
            for job in waiting:  # a reference failed to produce output: check against what exists
                row = job[0] if len(job) == 1 else self._row(*job)
                f.write(json.dumps(row) + "\n")
                rows.append(row)
        return rows

    # ------------------------------------------------------------------ internals
    def _base(self, prompt: Prompt, setting: Setting, repeat: int, method: BenchMethod) -> dict:
        p = setting.params
        return {
            "task": prompt.task, "item": prompt.item_id, "category": prompt.category, "bucket": prompt.bucket,
            "context_tokens": prompt.context_tokens, "setting": setting.name, "seed": setting.seed,
            "sampling": {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p},
            "method": method.name, "library": method.library, "max_new_tokens": self.options.max_new_tokens,
            "repeat": repeat,
        }

    def _key(self, prompt: Prompt, setting: Setting, repeat: int, method: BenchMethod) -> tuple:
        return row_key(self._base(prompt, setting, repeat, method))

    def _rotated(self, repeat: int) -> list[BenchMethod]:
        """The methods in the order of one repeat: rotated by one each repeat, so no method
        always runs first (after a switch of method) or last."""
        if not self.methods:
            return []
        shift = repeat % len(self.methods)
        return self.methods[shift:] + self.methods[:shift]

    def _warm_up(self, prompt: Prompt, settings: Sequence[Setting], out_path: Path, rows: list[dict]) -> None:
        """One short untimed run of every method and setting kind (first calls pay for
        allocation and kernel selection); a method that fails here is skipped with its reason."""
        ids = prompt.ids[: self.options.warmup_prompt_tokens]
        kinds = {s.name: s for s in settings}.values()
        for method in list(self.methods):
            for setting in kinds:
                try:
                    method.run(ids, setting, self.options.warmup_tokens, self.eos_token_ids)
                except Unavailable:
                    continue  # recorded per row
                except Exception as error:  # noqa: BLE001 - any failure removes the method, loudly
                    reason = f"failed during warm-up: {type(error).__name__}: {error}"
                    self.skipped.append(SkippedMethod(method.name, reason))
                    self.methods.remove(method)
                    row = {"kind": "skipped", "method": method.name, "reason": reason}
                    with out_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    rows.append(row)
                    break

    @staticmethod
    def _references_from(rows: list[dict]) -> dict:
        refs: dict = {}
        for r in rows:
            if r.get("kind") != "run" or r["setting"] != "greedy" or r["method"] not in (AR_REFERENCE, HF_REFERENCE):
                continue
            key = ((r["task"], r["item"], r["bucket"]), r["context_tokens"], r["setting"], r["seed"])
            ref = refs.setdefault(key, _References())
            setattr(ref, "ar" if r["method"] == AR_REFERENCE else "hf", r["output_ids"])
        return refs

    def _row(self, prompt: Prompt, setting: Setting, repeat: int, method: BenchMethod, out: RunOutput,
             refs: _References) -> dict:
        tokens = out.tokens
        new = len(tokens)
        row = self._base(prompt, setting, repeat, method) | {
            "kind": "run",
            "new_tokens": new,
            "prefill_s": out.prefill_s,
            "decode_s": out.decode_s,
            "total_s": out.total_s,
            "prefill_tokens_per_s": prompt.context_tokens / out.prefill_s if out.prefill_s > 0 else None,
            # transformers' first token comes out of its prefill, so its decode covers new - 1 tokens.
            "decode_tokens_per_s": self._decode_rate(method, out),
            "timeline": out.timeline,
            "cache_bytes": out.cache_bytes,
            "draft_state_bytes": out.draft_state_bytes,
            **{f"distinct_{n}": distinct_n(tokens, n) for n in (1, 2, 3, 4)},
            "output_ids": tokens,
        }
        if out.stats is not None:
            s = out.stats
            row |= {"tau": s["tau"], "target_forwards": s["target_forwards"],
                    "acceptance_by_depth": s["acceptance_by_depth"], "proposed_by_depth": s["proposed_by_depth"],
                    "draft_s": s["draft_s"], "verify_s": s["verify_s"], "bookkeeping_s": s["bookkeeping_s"]}
            if s.get("controller"):  # auto's account: rounds off, nodes, predicted vs realised acceptance
                row["controller"] = s["controller"]
        if setting.greedy:
            row["check_ar"] = self._check(prompt, tokens, refs.ar)
            row["check_hf"] = self._check(prompt, tokens, refs.hf)
        return row

    @staticmethod
    def _decode_rate(method: BenchMethod, out: RunOutput) -> float | None:
        counted = len(out.tokens) - (0 if out.stats is not None else 1)
        return counted / out.decode_s if out.decode_s > 0 and counted > 0 else None

    def _check(self, prompt: Prompt, tokens: list[int], reference: list[int] | None) -> dict | None:
        """Token identity with a reference greedy output; on a mismatch, the first
        divergent position and the target's top-2 logit gap there."""
        if reference is None:
            return None
        position = first_divergence(tokens, reference)
        if position is None:
            return {"equal": True}
        result = {"equal": False, "position": position,
                  "ours": tokens[position] if position < len(tokens) else None,
                  "reference": reference[position] if position < len(reference) else None}
        context = torch.cat([prompt.ids, torch.tensor(reference[:position], dtype=torch.long, device=prompt.ids.device)])
        logits = next_token_logits(self.target, context)
        top = torch.topk(logits.float(), 2)
        gap = float(top.values[0] - top.values[1])
        tie = self.options.near_tie_ulps * ulp(self.target.dtype, float(top.values[0]))
        candidates = {int(t) for t in top.indices}
        both_top2 = result["ours"] in candidates and result["reference"] in candidates
        result |= {"top2_gap": gap, "top2_tokens": top.indices.tolist(), "near_tie_threshold": tie,
                   "verdict": "near-tie" if both_top2 and gap <= tie else "MISMATCH"}
        return result


def row_key(row: dict) -> tuple:
    return (row["task"], row["item"], row["bucket"], row["context_tokens"], row["setting"], row["seed"],
            row["method"], row["max_new_tokens"], row.get("repeat", 0))  # files from before repeats: one run


# What must match for rows of one results file to be compared: a resumed run with another
# model, dtype, output length or machine would merge rows that do not belong together.
RESUME_KEYS = ("model", "dtype", "max_new_tokens", "ignore_eos", "repeats", "machine")


def check_same_run(rows: list[dict], header: dict, path: Path) -> None:
    """Refuse to resume `path` with a header that differs where rows would not compare."""
    old = next((r for r in rows if r.get("kind") == "header"), None)
    if old is None:
        raise ValueError(f"{path} has no header line: not a results file of `longspec bench`; pass another --out")
    changed = [key for key in RESUME_KEYS if key in header and old.get(key) != header.get(key)]
    if changed:
        details = "; ".join(f"{key}: {old.get(key)!r} -> {header.get(key)!r}" for key in changed)
        raise ValueError(f"--resume of {path} with a different run ({details}); resume with the same options on the "
                         "same machine, or pass a new --out")


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return True


def load_rows(path: Path) -> list[dict]:
    """Rows of a results file (the header and skipped-method notes included)."""
    rows = []
    with Path(path).open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                # A run killed mid-write leaves a partial last line: resume re-runs that row.
                if number == sum(1 for _ in Path(path).open()):
                    break
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from error
    return rows


def mismatches(rows: Sequence[dict]) -> list[dict]:
    """Greedy rows whose output differs from a reference by more than a near-tie."""
    bad = []
    for r in rows:
        for check in ("check_ar", "check_hf"):
            c = r.get(check)
            if c and not c["equal"] and c["verdict"] != "near-tie":
                bad.append(r)
                break
    return bad


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
