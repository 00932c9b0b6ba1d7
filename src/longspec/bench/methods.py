"""The method matrix: every decoding method of our engine (picked up from the
method registry, so drafters registered later appear without edits here) and the
`transformers` peers users would otherwise pick, run in the same process.

A `BenchMethod` turns (prompt ids, sampling setting, max new tokens) into a
`RunOutput`: the new tokens, prefill and decode times, a timeline of (tokens,
decode seconds) for speedup-vs-output-length plots, and whatever statistics the
method can give (τ, acceptance by depth, time split, cache bytes).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from longspec.runtime.cache import KVCache
from longspec.speculation.drafters.base import Drafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import METHODS, make_drafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams

OURS = "longspec"
TRANSFORMERS = "transformers"
# Timeline points kept per run: enough for a smooth speedup-vs-length curve.
_TIMELINE_POINTS = 64


@dataclass(frozen=True)
class Setting:
    """One decoding setting of the matrix: greedy, or sampled with a seed."""

    name: str
    params: SamplingParams
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0


def default_settings(seeds: Sequence[int], *, temperature: float = 1.0, top_p: float | None = 0.95,
                     min_p: float | None = 0.05) -> list[Setting]:
    """Greedy, plus sampling (temperature 1 with top-p and min-p) once per seed:
    greedy continuations of small models loop, which flatters retrieval drafters."""
    sampled = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p)
    return [Setting("greedy", SamplingParams())] + [Setting("sample", sampled, seed) for seed in seeds]


@dataclass
class RunOutput:
    tokens: list[int]
    prefill_s: float
    decode_s: float
    total_s: float
    timeline: list[tuple[int, float]] = field(default_factory=list)  # (tokens so far, decode seconds)
    stats: dict | None = None  # GenerationStats.to_dict() for our engine
    cache_bytes: int | None = None  # target KV cache allocated for this request
    draft_state_bytes: int | None = None


class BenchMethod(Protocol):
    name: str
    library: str

    def run(self, prompt: torch.Tensor, setting: Setting, max_new_tokens: int, eos_token_ids: Sequence[int]) -> RunOutput:
        ...


class Unavailable(Exception):
    """A method cannot run here (reason in the message); the report lists it."""


def _thin(timeline: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(timeline) <= _TIMELINE_POINTS:
        return timeline
    step = len(timeline) / _TIMELINE_POINTS
    picked = [timeline[int(i * step)] for i in range(_TIMELINE_POINTS - 1)]
    return picked + [timeline[-1]]


class EngineMethod:
    """One of our methods: a fresh drafter per run from `make`, through our engine."""

    library = OURS

    def __init__(self, name: str, target, make: Callable[[], Drafter | None], options: EngineOptions) -> None:
        self.name = name
        self.target = target
        self.make = make
        self.options = options
        self.engine = SpeculativeEngine(target, options)

    def cache_bytes(self, prompt_tokens: int, max_new_tokens: int, speculative: bool) -> int:
        # The engine's allocation (engine.generate), sized on the meta device: no memory used.
        budget = self.options.max_tree_nodes if speculative else 0
        cache = KVCache(self.target.config, prompt_tokens + max_new_tokens + budget + 1,
                        max_forward_tokens=max(self.options.prefill_chunk, budget + 1), dtype=self.target.dtype,
                        device="meta")
        return cache.nbytes()

    def run(self, prompt, setting, max_new_tokens, eos_token_ids) -> RunOutput:
        drafter = self.make()
        stats = GenerationStats(method=self.name)
        generator = torch.Generator(device=self.target.device).manual_seed(setting.seed)
        tokens: list[int] = []
        timeline = []
        start = time.perf_counter()
        for new in self.engine.generate(prompt, params=setting.params, max_new_tokens=max_new_tokens, drafter=drafter,
                                        eos_token_ids=eos_token_ids, generator=generator, stats=stats):
            tokens.extend(new.tolist())
            timeline.append((len(tokens), time.perf_counter() - start - stats.prefill_s))
        total = time.perf_counter() - start
        return RunOutput(
            tokens, stats.prefill_s, stats.decode_s, total, _thin(timeline), stats.to_dict(),
            self.cache_bytes(prompt.numel(), max_new_tokens, drafter is not None),
            drafter.state_nbytes() if drafter is not None else None,
        )


class _Clock:
    """transformers streamer that timestamps each put: the first put is the
    prompt, the second the first new token (the end of prefill)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.events.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass


class TransformersMethod:
    """`transformers` generate on the same weights (greedy or sampled), optionally
    with its prompt lookup (`prompt_lookup_num_tokens`)."""

    library = TRANSFORMERS

    def __init__(self, name: str, peer, prompt_lookup_num_tokens: int | None = None) -> None:
        self.name = name
        self.peer = peer
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens

    def generation_config(self, setting: Setting, max_new_tokens: int, eos_token_ids: Sequence[int]):
        p = setting.params
        if p.penalty != 1.0 or p.eta is not None:
            raise Unavailable("transformers has no equivalent of our windowed penalty / eta sampling")
        # Every decoding field is set explicitly: checkpoints ship their own defaults (Gemma: top_k=64).
        config = copy.deepcopy(self.peer.generation_config)
        config.max_new_tokens = max_new_tokens
        config.min_new_tokens = None
        config.do_sample = not setting.greedy
        config.temperature = p.temperature if not setting.greedy else 1.0
        config.top_k = (p.top_k or 0) if not setting.greedy else None  # 0 switches top-k off explicitly
        config.top_p = p.top_p if p.top_p is not None else 1.0
        config.min_p = p.min_p
        config.eos_token_id = list(eos_token_ids) or None
        config.pad_token_id = (list(eos_token_ids) or [0])[0]
        config.prompt_lookup_num_tokens = self.prompt_lookup_num_tokens
        config.return_dict_in_generate = True
        return config

    def run(self, prompt, setting, max_new_tokens, eos_token_ids) -> RunOutput:
        config = self.generation_config(setting, max_new_tokens, eos_token_ids)
        torch.manual_seed(setting.seed)  # transformers samples from the global generator
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            # An explicit mask: otherwise transformers masks every prompt token equal to pad_token_id.
            device = self.peer.device
            out = self.peer.generate(prompt.unsqueeze(0).to(device),
                                     attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long, device=device),
                                     generation_config=config, streamer=clock)
        end = time.perf_counter()
        tokens = out.sequences[0, prompt.numel():].tolist()
        first = clock.events[1][0] if len(clock.events) > 1 else end
        timeline, produced = [], 0
        for t, n in clock.events[1:]:
            produced += n
            timeline.append((produced, t - first))
        cache = getattr(out, "past_key_values", None)
        cache_bytes = None
        if cache is not None and hasattr(cache, "layers"):
            cache_bytes = sum(
                t.numel() * t.element_size()
                for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)
            )
        # Prefill ends with the first new token; decode covers the rest.
        return RunOutput(tokens, first - start, end - first, end - start, _thin(timeline), None, cache_bytes)


@dataclass(frozen=True)
class SkippedMethod:
    name: str
    reason: str


def our_method_names() -> list[str]:
    """Every method the engine registry offers right now (later drafters included)."""
    return list(METHODS)


def build_methods(
    names: Sequence[str],
    target,
    *,
    peer=None,
    engine_options: EngineOptions = EngineOptions(progress=False),
    method_options: dict[str, dict] | None = None,
    prompt_lookup_num_tokens: int = 10,
) -> tuple[list[BenchMethod], list[SkippedMethod]]:
    """Method objects for `names`: our registry names, `hf` (transformers generate)
    and `hf_pld` (its prompt lookup). A method that cannot be built here (a drafter
    without weights for this target, no transformers peer) is returned in the
    skipped list with the reason, never dropped silently."""
    method_options = method_options or {}
    methods: list[BenchMethod] = []
    skipped: list[SkippedMethod] = []
    for name in names:
        if name in ("hf", "hf_pld"):
            if peer is None:
                skipped.append(SkippedMethod(name, "no transformers model of this target was loaded"))
                continue
            methods.append(TransformersMethod(name, peer, prompt_lookup_num_tokens if name == "hf_pld" else None))
            continue
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; available: {', '.join(list(METHODS) + ['hf', 'hf_pld'])}")
        options = method_options.get(name, {})
        try:
            make_drafter(name, **options)  # builds once to surface missing weights before any timing
        except (ValueError, FileNotFoundError, OSError, RuntimeError, ImportError, NotImplementedError) as error:
            skipped.append(SkippedMethod(name, f"{type(error).__name__}: {error}"))
            continue
        methods.append(EngineMethod(name, target, lambda n=name, o=options: make_drafter(n, **o), engine_options))
    return methods, skipped
