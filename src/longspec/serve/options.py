"""What a `longspec serve` operator sets: the served name, the default method, the key,
and the limits every request is checked against before any work."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from longspec.serve.limits import RequestLimits
from longspec.speculation.logprobs import MODES as LOGPROBS_MODES
from longspec.speculation.methods import DEFAULT_METHOD, METHODS


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    method: str = DEFAULT_METHOD  # when a request names none
    api_key: str | None = None
    # Choices admitted at once (running + queued; a batch prompt's every prompt times n counts); more get 429.
    # Queued choices cost a few kilobytes each: the rows (`max_batch`) bound the work.
    max_concurrent: int = 64
    max_prompt_tokens: int | None = None  # None: the model's context
    max_new_tokens: int = 1024  # the largest max_tokens, and the default of chat (which has none)
    max_batch: int = 8  # requests decoded together (rows of the batch); the others wait for a row
    limits: RequestLimits = RequestLimits()  # what a request may weigh, checked before any work
    max_n: int = 8  # choices a request may ask for (`n`): each is a row of the batch
    logprobs_mode: str = "raw"  # the distribution `logprobs` report (vLLM's flag): raw or processed
    # Control-token strings in prompts and messages (`<end_of_turn>`, `<eos>`) read as control
    # tokens: only for trusted clients, else a message can forge the assistant's turn.
    allow_special_tokens: bool = False
    # The server's own drafter options per method (paths to weights among them), under
    # the few a request may set (`request_options.REQUEST_OPTIONS`).
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(METHODS)}")
        unknown = sorted(set(self.method_options) - set(METHODS))
        if unknown:
            raise ValueError(f"options for unknown method(s) {', '.join(unknown)}; available: {', '.join(METHODS)}")
        for name in ("max_concurrent", "max_new_tokens", "max_batch", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a real key, or none to serve without one (loopback only)")
