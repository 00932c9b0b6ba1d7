"""Both engines take one `DecodingRequest` (or its fields as keywords) and decode the same
tokens either way; a wrong argument is refused before any work."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.decoding_request import DecodingRequest
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from tiny_models import random_ids, tiny_decoder


def _engine_tokens(engine, prompt, request=None, **keywords):
    return torch.cat(list(engine.generate(prompt, request, **keywords))).tolist()


def test_request_object_and_keywords_decode_the_same_tokens():
    model = tiny_decoder("llama")
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    prompt = random_ids(48, seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    as_object = _engine_tokens(engine, prompt, DecodingRequest(
        params, 24, PromptLookupDrafter(), generator=torch.Generator().manual_seed(5)))
    as_keywords = _engine_tokens(engine, prompt, params=params, max_new_tokens=24, drafter=PromptLookupDrafter(),
                                 generator=torch.Generator().manual_seed(5))
    assert as_object == as_keywords and len(as_object) == 24

    batch = BatchEngine(model, EngineOptions(progress=False), BatchOptions(max_rows=2, row_capacity=160))
    handle = batch.submit(prompt, DecodingRequest(params, 24, PromptLookupDrafter(),
                                                  generator=torch.Generator().manual_seed(5)))
    while batch.has_work:
        batch.step()
    assert handle.tokens.tolist() == as_object


def test_wrong_arguments_fail_before_work():
    model = tiny_decoder("llama")
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    batch = BatchEngine(model, EngineOptions(progress=False), BatchOptions(max_rows=1, row_capacity=128))
    prompt = random_ids(8, seed=1)
    for submit in (lambda *a, **k: next(engine.generate(*a, **k)), batch.submit):
        with pytest.raises(TypeError, match="unknown decoding option.*temprature"):
            submit(prompt, temprature=0.5)
        with pytest.raises(TypeError, match="not both"):
            submit(prompt, DecodingRequest(), max_new_tokens=4)
        with pytest.raises(TypeError, match="must be a DecodingRequest"):
            submit(prompt, {"max_new_tokens": 4})
    assert not batch.has_work
