"""The measured cost of one target forward of k new tokens (a speculation tree),
on this machine.

Verifying a tree of k nodes costs about one forward while the forward is bound by
reading the weights, and grows once the matrix products become compute-bound; where
that knee lies depends on the machine, the model, its dtype and the context. Drafters
and controllers size their trees from this measurement, never from a paper's GPU
default. Measuring takes seconds to a minute; results are cached per machine, model,
dtype, context, thread count, kernels and torch version under the longspec cache
directory. Where this machine has none yet, lookups (`forward_cost_at`,
`batch_forward_cost_at`) answer with a conservative default at once and leave the
measurement to a quiet moment (`cost_measurement.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from bisect import bisect_left
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from longspec.runtime.atomic_files import write_atomically
from longspec.runtime.attention import NATIVE_ATTENTION_MAX_QUERIES
from longspec.runtime.batch_cache import BatchKVCache
from longspec.runtime.device import HOST, device_name, synchronize
from longspec.runtime.machine import cores_busy_elsewhere, load_average, machine_identity
from longspec.runtime.model import Decoder
from longspec.runtime.native import kernels_identity
from longspec.runtime.progress import phase
from longspec.runtime.setup_time import one_time
from longspec.speculation.cost_defaults import cpu_kind, default_seconds
from longspec.speculation.tree import Tree

# Every k up to 17, then sparser: a product's cost steps where its rows fill another
# register tile (AVX2: 6 rows, AVX-512: 8), and interpolating between powers of two
# mispriced the trees in between
# (docs/lab-notes/forward-cost.md#the-forward-cost-steps-with-the-products-row-tiles-issues-adaptive-speculation-runtime-speed).
DEFAULT_KS = (*range(1, 18), 20, 24, 28, 32, 48, 64)
BATCH_WIDTHS = (1, 2, 4, 8, 16, 32)  # tokens per row of a batched verification forward
CONTEXT_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384, 32768)  # contexts measured for a sequence's length
CACHE_SUBDIR = "cost-model"
# Other processes using half a core or more while the cost is measured: the measurement
# is warned about (a second job on two cores flattens the curve; see `_warn_if_busy`).
BUSY_ELSEWHERE_CORES = 0.5
FORMAT = "longspec-forward-cost/1"


def binary_tree_parents(k: int) -> torch.Tensor:
    """Parents of a root plus k nodes shaped like a binary heap: depth ~log2 k, the
    middle ground between a chain (depth k) and a star (depth 1)."""
    return torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k + 1)], dtype=torch.long, device=HOST)


@dataclass(frozen=True)
class ForwardCost:
    """seconds[i]: best-of-N wall time of one forward of ks[i] new tokens (root
    included in the count: k = 1 is plain decoding) over `context` committed tokens."""

    key: dict
    ks: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.ks or len(self.ks) != len(self.seconds) or list(self.ks) != sorted(set(self.ks)) or self.ks[0] != 1:
            raise ValueError(f"ks must be increasing, start at 1 and match seconds; got {self.ks}, {self.seconds}")
        # A forward of more tokens does at least the work of fewer: a measured dip is
        # timing noise (a GPU's eager forwards, bound by the host, are flat to within it),
        # and priced as such it made useless nodes look free.
        envelope, highest = [], 0.0
        for seconds in self.seconds:
            highest = max(highest, seconds)
            envelope.append(highest)
        object.__setattr__(self, "_envelope", tuple(envelope))
        object.__setattr__(self, "_memo", {})  # k -> seconds: a controller prices every k of every round

    def seconds_for(self, k: int) -> float:
        """Linear interpolation between measured k (their running maximum: never less for
        more tokens); beyond the last, the last slope."""
        seconds = self._memo.get(k)
        if seconds is None:
            seconds = self._memo[k] = self._interpolated(k)
        return seconds

    def _interpolated(self, k: int) -> float:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        ks, secs = self.ks, self._envelope
        i = bisect_left(ks, k)
        if i < len(ks) and ks[i] == k:
            return secs[i]
        if i == len(ks):
            if len(ks) == 1:
                return secs[0] * k
            slope = (secs[-1] - secs[-2]) / (ks[-1] - ks[-2])
            return secs[-1] + slope * (k - ks[-1])
        lo, hi = i - 1, i
        return secs[lo] + (secs[hi] - secs[lo]) * (k - ks[lo]) / (ks[hi] - ks[lo])

    def relative(self, k: int) -> float:
        """Cost of k tokens in units of one decode forward."""
        return self.seconds_for(k) / self.seconds_for(1)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @staticmethod
    def from_json(text: str) -> "ForwardCost":
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"not a forward-cost file (format {data.get('format')!r})")
        return ForwardCost(data["key"], tuple(data["ks"]), tuple(data["seconds"]))


def cost_key(model: Decoder, context: int, machine: dict) -> dict:
    """Everything the measurement depends on."""
    config = json.dumps(asdict(model.config), sort_keys=True, default=str)
    return {
        "machine": machine, "device": device_name(model.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "model": hashlib.sha256(config.encode()).hexdigest()[:16], "dtype": str(model.dtype), "context": context,
        "kernels": (f"{kernels_identity()}/attention<={NATIVE_ATTENTION_MAX_QUERIES}q"
                    if model.native_kernels and model.device.type == "cpu" and model.dtype == torch.bfloat16 else "none"),
        "steps": "eager" if model.static_steps is None else repr(model.static_steps.options),
        "head": "full" if model.certified_head is None else f"certified/{model.certified_head.group}",
    }


def measure_forward_cost(
    model: Decoder,
    *,
    context: int,
    ks: Sequence[int] = DEFAULT_KS,
    repeats: int = 5,
    parents_for: Callable[[int], torch.Tensor] = binary_tree_parents,
    machine: dict | None = None,
    clock: Callable[[], float] = time.perf_counter,
    pause: Callable[[], bool] | None = None,
) -> ForwardCost:
    """Time one verification forward of k tokens (a tree of k - 1 nodes below a root,
    with every node's decision) over a cache of `context` committed positions; best of
    `repeats` per k after one warm-up (`pause`: see `_best_time`)."""
    ks = tuple(sorted(set(int(k) for k in ks)))
    if not ks or ks[0] != 1:
        ks = (1, *ks)
    if context < 1 or context + ks[-1] > model.config.max_position_embeddings:
        raise ValueError(f"context {context} + {ks[-1]} tokens must fit the model's "
                         f"{model.config.max_position_embeddings} positions")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (ks[-1],), generator=generator, device=HOST)
    cache = model.new_cache(context + ks[-1] + 1, max_forward_tokens=max(512, ks[-1]))  # as the engine makes it
    with torch.inference_mode():
        commit_random_keys(model, cache, context, chunk=512)
        seconds = []
        for k in ks:
            tree = Tree.from_parents(ids[:k], parents_for(k - 1))
            mask = None if tree.is_chain() else tree.ancestor_mask()
            positions = cache.length + tree.depths
            seconds.append(_best_time(lambda: _verify_forward(model, tree.tokens.unsqueeze(0), cache, mask, positions),
                                      cache.drop_pending, model.device, repeats, clock, pause))
    return ForwardCost(cost_key(model, context, machine or machine_identity()), ks, tuple(seconds))


def _verify_forward(model: Decoder, tokens: torch.Tensor, cache, mask, positions):
    """A verification forward as the engine runs it: with the certified head, the hidden
    states and each node's decision from its screen; without, the forward with logits
    (through the compiled static steps where the model has them) and the argmax."""
    if model.certified_head is None:
        return model(tokens, cache, tree_mask=mask, positions=positions).logits[0].argmax(-1)
    return model.decide(model(tokens, cache, tree_mask=mask, positions=positions, with_logits=False).hidden[0])


def commit_random_keys(model: Decoder, cache, context: int, *, chunk: int) -> None:
    """Commit `context` positions of random K/V in every row of `cache` (a `KVCache` or
    a batch's `RowsView`), `chunk` positions per step. A forward's cost depends on how
    many keys it reads, not on their numbers, and this is far quicker than a prefill of
    the same length, which stalled the first batched round of each row count on a new
    machine (docs/lab-notes/forward-cost.md#the-cost-measurement-without-a-prefill-issues-batching-adaptive-speculation)."""
    c = model.config
    generator = torch.Generator().manual_seed(0)
    rows = cache.next_positions(1).numel()  # one position per row
    shape = (rows, c.num_kv_heads, chunk, c.head_dim)
    k = torch.randn(shape, generator=generator, device=HOST).to(device=model.device, dtype=model.dtype)
    v = torch.randn(shape, generator=generator, device=HOST).to(device=model.device, dtype=model.dtype)
    for begin in range(0, context, chunk):
        T = min(chunk, context - begin)
        cache.begin_forward(cache.next_positions(T))
        for layer in range(c.num_layers):
            cache.store(layer, k[:, :, :T], v[:, :, :T])
        cache.commit()


def _best_time(forward: Callable[[], object], reset: Callable[[], None], device, repeats: int,
               clock: Callable[[], float], pause: Callable[[], bool] | None = None) -> float:
    """Best wall time of `repeats` forwards after one warm-up (kernels, allocations),
    the cache reset after each. `pause()`, asked after each forward, True: this
    process decoded meanwhile (a background measurement), so time them all again."""
    best, attempt = float("inf"), 0
    while attempt <= repeats:
        start = clock()
        forward()
        synchronize(device)
        elapsed = clock() - start
        reset()
        if pause is not None and pause():
            best, attempt = float("inf"), 0
            continue
        if attempt:
            best = min(best, elapsed)
        attempt += 1
    return best


def measure_batch_forward_cost(
    model: Decoder,
    *,
    rows: int,
    context: int,
    widths: Sequence[int] = BATCH_WIDTHS,
    repeats: int = 3,
    machine: dict | None = None,
    clock: Callable[[], float] = time.perf_counter,
    pause: Callable[[], bool] | None = None,
) -> ForwardCost:
    """Time one batched verification forward: `rows` rows of `context` committed
    tokens each, every row a chain of w new tokens, all through the output layer (as
    the batched engine verifies them). `ks` of the result are the widths w; best of
    `repeats` after one warm-up. The rows' context is random K/V (`commit_random_keys`)."""
    widths = tuple(sorted(set(int(w) for w in widths) | {1}))
    if rows < 1 or context < 1 or context + widths[-1] > model.config.max_position_embeddings:
        raise ValueError(f"need rows >= 1 and context {context} + {widths[-1]} tokens within the model's "
                         f"{model.config.max_position_embeddings} positions")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (widths[-1],), generator=generator, device=HOST)
    chunk = 256  # the batched engine's prefill chunk, which also sizes its rings
    cache = BatchKVCache(model.config, context + widths[-1] + 1, rows, max_forward_tokens=max(chunk, widths[-1]),
                         dtype=model.dtype, device=model.device)
    for _ in range(rows):
        cache.acquire()
    with torch.inference_mode():
        batch = cache.rows(0, rows)
        commit_random_keys(model, batch, context, chunk=chunk)
        seconds = []
        for w in widths:
            tokens = ids[:w].expand(rows, w)

            def verify(tokens=tokens, w=w):  # every node's decision, as the engine verifies greedy rows
                out = model(tokens, batch, positions=batch.next_positions(w), with_logits=False)
                model.decide(out.hidden.reshape(-1, out.hidden.shape[-1]))

            seconds.append(_best_time(verify, batch.drop_pending, model.device, repeats, clock, pause))
    key = {**cost_key(model, context, machine or machine_identity()), "rows": rows}
    return ForwardCost(key, widths, tuple(seconds))


def cached_batch_forward_cost(model: Decoder, *, rows: int, context: int, directory: Path | None = None,
                              **measure_options) -> ForwardCost:
    """`measure_batch_forward_cost`, cached like `cached_forward_cost` (the row count
    in the key)."""
    machine = measure_options.pop("machine", None) or machine_identity()
    key = {**cost_key(model, context, machine), "rows": rows}
    return _cached(key, directory, measure_options.get("widths"),
                   lambda: measure_batch_forward_cost(model, rows=rows, context=context, machine=machine, **measure_options))


def batch_forward_cost_at(model: Decoder, rows: int, length: int, widths: Sequence[int] = BATCH_WIDTHS) -> ForwardCost:
    """The cached batched measurement for `rows` rows of about `length` committed
    tokens, at the smallest context bucket that holds them; where there is none yet,
    as `forward_cost_at`."""
    context = batch_context_bucket(model, length, widths)
    machine = machine_identity()
    key = {**cost_key(model, context, machine), "rows": rows}
    directory = default_directory()  # now: a queued measurement lands where this lookup looked
    return _measured_or_default(
        key, widths, lambda: cached_batch_forward_cost(model, rows=rows, context=context, widths=widths,
                                                       directory=directory, machine=machine,
                                                       pause=_pause_while_decoding),
        lambda: ForwardCost({**key, "default": cpu_kind(model)}, tuple(sorted(set(widths) | {1})),
                            default_seconds(model, sorted(set(widths) | {1}), context, rows)))


def batch_context_bucket(model: Decoder, length: int, widths: Sequence[int] = BATCH_WIDTHS) -> int:
    """The context `batch_forward_cost_at` measures for rows of `length` tokens."""
    return _bucket(model, length, max(widths))


def cached_forward_cost(model: Decoder, *, context: int, directory: Path | None = None, **measure_options) -> ForwardCost:
    """The measurement for this machine/model/dtype/context/threads, from the cache
    when one was made under the same key, else measured now and stored."""
    machine = measure_options.pop("machine", None) or machine_identity()
    key = cost_key(model, context, machine)
    return _cached(key, directory, measure_options.get("ks"),
                   lambda: measure_forward_cost(model, context=context, machine=machine, **measure_options))


def default_directory() -> Path:
    """Where measured costs are kept unless a caller names a directory."""
    from longspec.runtime.default_model import cache_root

    return cache_root() / CACHE_SUBDIR


def _path(key: dict, directory: Path) -> Path:
    return directory / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")


def _stored(key: dict, directory: Path, ks: Sequence[int] | None) -> ForwardCost | None:
    path = _path(key, directory)
    if path.is_file():
        try:
            cost = ForwardCost.from_json(path.read_text())
            if cost.key == key and (not ks or set(ks) <= set(cost.ks)):
                return cost
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or foreign: measure again and replace it
    return None


def _cached(key: dict, directory: Path | None, ks: Sequence[int] | None, measure: Callable[[], ForwardCost]) -> ForwardCost:
    directory = directory or default_directory()
    stored = _stored(key, directory, ks)
    if stored is not None:
        return stored
    path = _path(key, directory)
    from longspec.speculation import cost_measurement

    _warn_if_busy(path)
    # The background measurement says nothing: its lines would land in the middle of a run's output.
    said = nullcontext() if cost_measurement.in_background() else phase(
        "measuring this machine's forward cost (once per machine, model and context)")
    with one_time("forward_cost"), said:
        cost = measure()
    write_atomically(path, cost.to_json())
    return cost


def _pause_while_decoding() -> bool:
    from longspec.speculation import cost_measurement

    return cost_measurement.pause_while_decoding()


def _warn_if_busy(path: Path) -> None:
    """Other work competing for the cores slows the small forwards far more than the
    wide ones, so the measured curve comes out flat and wide trees look cheap, and the
    measurement is kept for this machine
    (docs/lab-notes/prompt-lookup.md#copies-that-continue-into-their-own-draft-the-cost-model-measured-under-load-issue-adaptive-speculation).
    Other processes' use of the cores is sampled just before; where the operating
    system does not report it, the 1-minute load average stands in (it also counts this
    process's own recent work: a benchmark measuring between its timed runs looked busy)."""
    cores = os.cpu_count() or 1
    elsewhere = cores_busy_elsewhere()
    if elsewhere is not None:
        busy = elsewhere >= BUSY_ELSEWHERE_CORES
        what = f"other processes keep {elsewhere:.1f} of {cores} cores busy"
    else:
        load = load_average()
        busy = load is not None and load > cores
        what = f"1-minute load {load:.1f} on {cores} cores" if busy else ""
    if busy:
        warnings.warn(f"measuring the forward cost while the machine is busy ({what}): trees will be priced too "
                      f"cheap; delete {path} to measure again when it is idle", RuntimeWarning, stacklevel=3)


def forward_cost_at(model: Decoder, length: int, ks: Sequence[int] = DEFAULT_KS) -> ForwardCost:
    """The cached measurement for a sequence of `length` committed tokens: at the
    smallest context bucket that holds it (within the model's positions). Where this
    machine has none yet: measured now under `measurement("now")`; else (the default)
    a conservative curve for this kind of CPU (`cost_defaults`, `is_default`) while the
    measurement waits for a quiet moment of this process (`cost_measurement.py`) or
    for `longspec doctor`."""
    context = _bucket(model, length, max(ks))
    machine = machine_identity()
    key = cost_key(model, context, machine)
    ks = tuple(sorted(set(ks) | {1}))
    directory = default_directory()  # now: a queued measurement lands where this lookup looked
    return _measured_or_default(
        key, ks, lambda: cached_forward_cost(model, context=context, ks=ks, directory=directory, machine=machine,
                                             pause=_pause_while_decoding),
        lambda: ForwardCost({**key, "default": cpu_kind(model)}, ks, default_seconds(model, ks, context)))


def queue_forward_costs(model: Decoder, max_rows: int) -> None:
    """Queue the curves a server's first requests look up (one sequence, and every batch
    row count up to `max_rows`, at the smallest context), so that an idle server measures
    them before they are needed; nothing under the "now" policy, whose lookups measure."""
    from longspec.speculation import cost_measurement

    if cost_measurement.policy() == "now":
        return
    forward_cost_at(model, 1)
    rows = 2
    while rows <= max_rows:
        batch_forward_cost_at(model, rows, 1)
        rows *= 2
    if max_rows > 1 and max_rows & (max_rows - 1):  # the batch engine measures at most max_rows rows
        batch_forward_cost_at(model, max_rows, 1)


# The certified head stays on unless the full head measured this much faster per decode step:
# within it, the two are noise apart (docs/lab-notes/startup.md).
HEAD_OFF_BELOW = 0.97


def certified_head_gain(model: Decoder, context: int = CONTEXT_BUCKETS[0]) -> float | None:
    """A decode step's time with the full head over its time with the certified head, as
    measured on this machine (`longspec doctor` measures both), or None where either
    curve is missing."""
    from longspec.runtime.certified_head import GROUP

    machine = machine_identity()
    bucket = _bucket(model, context, max(DEFAULT_KS))
    key = cost_key(model, bucket, machine)
    certified = _stored({**key, "head": f"certified/{GROUP}"}, default_directory(), None)
    full = _stored({**key, "head": "full"}, default_directory(), None)
    if certified is None or full is None:
        return None
    return full.seconds_for(1) / certified.seconds_for(1)


def measure_full_head(model: Decoder, context: int = CONTEXT_BUCKETS[0]) -> ForwardCost:
    """This machine's forward cost without the certified head (cached), for `certified_head_gain`."""
    head = model.certified_head
    model._certified_head = None
    try:
        return cached_forward_cost(model, context=_bucket(model, context, max(DEFAULT_KS)))
    finally:
        model._certified_head = head


def is_default(cost: ForwardCost) -> bool:
    """Whether `cost` is the default curve standing in for a measurement not made yet."""
    return "default" in cost.key


def _measured_or_default(key: dict, ks: Sequence[int], measure: Callable[[], ForwardCost],
                         default: Callable[[], ForwardCost]) -> ForwardCost:
    from longspec.speculation import cost_measurement

    stored = _stored(key, default_directory(), ks)
    if stored is not None:
        return stored
    if cost_measurement.policy() == "now":
        return measure()
    cost_measurement.request(json.dumps(key, sort_keys=True), measure)
    return default()


def _bucket(model: Decoder, length: int, widest: int) -> int:
    room = model.config.max_position_embeddings - widest - 1
    bucket = next((c for c in CONTEXT_BUCKETS if c >= length), CONTEXT_BUCKETS[-1])
    return max(1, min(bucket, room))
