"""One generation request, from the edge to the engine: how tokens are chosen
(`SamplingParams`), when generation stops, the output's constraint, the speculation,
log-probabilities and the seed. Defaults live here once; everything that can be checked
without the model is checked on construction, so the Python API, the CLI and the
server refuse a bad value with the same message before any work.

`GenerationRequest.of(**fields)` takes the flat keywords the API and the server speak
(`temperature=0.8, top_p=0.95, max_new_tokens=64, ...`) and sorts them: the sampling
ones go to `SamplingParams`, whose fields (with their help in `metadata`) are also
what the CLI offers. A new sampling option is a field and its rule in `processors.py`,
and a field in the server's protocol; nothing else spells it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from longspec.speculation.drafters.base import Drafter
from longspec.speculation.grammar import OutputConstraint
from longspec.speculation.logprobs import LogprobRecorder
from longspec.speculation.logprobs import MODES as LOGPROBS_MODES
from longspec.speculation.methods import DEFAULT_METHOD
from longspec.speculation.processors import SamplingParams

MAX_SEED = 2**64 - 1  # torch.Generator seeds are unsigned 64-bit integers
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"constrained"}


def check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """One string is one stop string (as in the OpenAI API), never its characters."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a string or a list of strings, got an element {s!r}")
        if not s:
            raise ValueError("stop strings must be non-empty")
    return stops


@dataclass(frozen=True)
class GenerationRequest:
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    method: str | Drafter = DEFAULT_METHOD  # a registered name, or a drafter object
    method_options: Mapping[str, Any] | None = None  # the named method's drafter options
    seed: int | None = None  # None: a fresh seed per request
    stop: str | Sequence[str] = ()  # stop strings (one string is one stop string)
    chat: bool = False  # wrap a text prompt in the model's chat template
    ignore_eos: bool = False  # generate past end-of-sequence tokens up to max_new_tokens
    logprobs: int | None = None  # report log-probabilities, with this many alternatives (0: the token's alone)
    logprobs_mode: str = "raw"  # "raw": the model's distribution; "processed": the one tokens are drawn from
    constraint: OutputConstraint | None = None  # a grammar the output follows

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        check_int("max_new_tokens", self.max_new_tokens, low=1)
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=MAX_SEED)  # an unsigned 64-bit integer
        object.__setattr__(self, "stop", stop_strings(self.stop))
        if self.logprobs is not None:
            LogprobRecorder(top=self.logprobs)  # its checks, its messages
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.method_options is not None and not isinstance(self.method_options, Mapping):
            raise TypeError(f"method_options must be a dict of drafter options, got {type(self.method_options).__name__}")
        if not isinstance(self.method, (str, Drafter)):
            raise TypeError(f"method must be a method name or a Drafter, got {type(self.method).__name__}")
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise TypeError(f"constraint must be an OutputConstraint, got {type(self.constraint).__name__}")
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot go with a constraint: a finished grammar allows only EOS")
        if self.sampling.constrained != (self.constraint is not None):  # the processors mask by the grammar
            object.__setattr__(self, "sampling", replace(self.sampling, constrained=self.constraint is not None))

    @classmethod
    def of(cls, **keywords) -> "GenerationRequest":
        """From flat keywords: the sampling ones (`SamplingParams`' fields) and this
        class's own; an unknown keyword is refused naming the known ones."""
        own = {f.name for f in fields(cls)} - {"sampling"}
        unknown = sorted(set(keywords) - own - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown generation option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(own | SAMPLING_FIELDS))}")
        sampling = SamplingParams(**{k: v for k, v in keywords.items() if k in SAMPLING_FIELDS})
        return cls(sampling=sampling, **{k: v for k, v in keywords.items() if k in own})

    def but(self, **keywords) -> "GenerationRequest":
        """A copy with some fields changed (sampling ones included), validated again."""
        sampling = {k: v for k, v in keywords.items() if k in SAMPLING_FIELDS}
        rest = {k: v for k, v in keywords.items() if k not in SAMPLING_FIELDS}
        return replace(self, sampling=replace(self.sampling, **sampling) if sampling else self.sampling, **rest)
