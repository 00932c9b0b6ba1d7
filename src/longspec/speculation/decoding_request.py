"""What an engine decodes beside the prompt's ids: the request as both engines take it
(`SpeculativeEngine.generate`, `BatchEngine.submit`). `LongSpecModel.prepare` makes one
from a validated `GenerationRequest` (`PreparedRequest.decoding`); tests and benchmarks
build one directly. Each engine-side option is spelled here once: a new sampling
option is a `SamplingParams` field and travels inside `params`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from longspec.speculation.drafters.base import Drafter
from longspec.speculation.grammar import GrammarState
from longspec.speculation.logprobs import LogprobRecorder
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams


@dataclass(frozen=True)
class DecodingRequest:
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    drafter: Drafter | None = None  # None: autoregressive decoding
    eos_token_ids: Sequence[int] = ()  # generation stops after any of these (none: only at max_new_tokens)
    generator: torch.Generator | None = None  # the verifier's random stream (a sampling drafter's derives from it)
    stats: GenerationStats | None = None  # filled in place; None: the engine makes one
    logprobs: LogprobRecorder | None = None  # collects the tokens' log-probabilities, when asked
    grammar: GrammarState | None = None  # the grammar the output follows (with params.constrained)

    @classmethod
    def given(cls, request: "DecodingRequest | None", keywords: dict) -> "DecodingRequest":
        """The engines' argument: a request, or its fields as keywords (not both)."""
        if request is None:
            unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
            if unknown:
                raise TypeError(f"unknown decoding option(s) {', '.join(unknown)}; known: "
                                f"{', '.join(f.name for f in fields(cls))}")
            return cls(**keywords)
        if not isinstance(request, DecodingRequest):
            raise TypeError(f"request must be a DecodingRequest, got {type(request).__name__}")
        if keywords:
            raise TypeError(f"give a DecodingRequest or keywords, not both (got {', '.join(sorted(keywords))})")
        return request
