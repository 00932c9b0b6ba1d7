"""OpenAI's presence and frequency penalties and logit bias as logits processors, applied
per tree node over its own path (speculation/processors.py): their definition, greedy
and seeded identity of speculative decoding with plain decoding for every drafter kind
(the seeded matrix of tests/test_engine_exact.py covers them too), and the server and
the official client taking them."""

from __future__ import annotations

import pytest
import torch

from exactness import diverse_model, real_drafters
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import NodeHistories, SamplingParams, apply_counts, processed_logits
from oracles import OracleGarbageDrafter
from tiny_models import random_ids

ENGINE = EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False)


def test_counts_follow_openais_definition():
    logits = torch.zeros(2, 10, dtype=torch.float64)
    outputs = torch.tensor([[3, 3, 5, -1], [9, -1, -1, -1]])
    scores = apply_counts(logits.clone(), outputs, presence=0.5, frequency=0.25)
    expected = torch.zeros(2, 10, dtype=torch.float64)
    expected[0, 3] = -(0.5 + 2 * 0.25)
    expected[0, 5] = -(0.5 + 0.25)
    expected[1, 9] = -(0.5 + 0.25)
    assert torch.equal(scores, expected)


def test_the_chain_order_bias_repetition_counts():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]], dtype=torch.float64)
    params = SamplingParams(temperature=0.0, penalty=2.0, penalty_window=4, presence_penalty=1.0,
                            logit_bias={0: 1.0})
    histories = NodeHistories(recent=torch.tensor([[0, 1]]), outputs=torch.tensor([[1]]))
    got = processed_logits(logits, histories, params)
    # token 0: (2 + 1) / 2; token 1: -1 * 2 (repetition) - 1 (presence)
    assert got.tolist() == [[1.5, -3.0, 0.5, 3.0]]


@pytest.mark.parametrize("kwargs,message", [
    (dict(presence_penalty=2.5), "presence_penalty must lie in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must lie in"),
    (dict(logit_bias={-1: 1.0}), "logit_bias maps token ids"),
    (dict(logit_bias={1: 101.0}), "logit_bias maps token ids"),
])
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


GREEDY = {
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=1.0, presence_penalty=0.5),
    "bias": SamplingParams(logit_bias={5: 3.0, 9: -100.0}),
}


@pytest.mark.parametrize("name", sorted(GREEDY))
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_greedy_speculation_with_the_processors_equals_plain_decoding(family, name):
    model, _ = diverse_model(family)
    params = GREEDY[name]
    engine = SpeculativeEngine(model, ENGINE)
    prompt = random_ids(20, seed=3)[0]
    reference = torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=300)))
    plain = torch.cat(list(engine.generate(prompt, params=SamplingParams(), max_new_tokens=300)))
    assert not torch.equal(reference, plain)  # the processor changes the output: the test proves something
    oracle = OracleGarbageDrafter(reference, prompt.numel(), seed=7)
    assert torch.equal(torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=300, drafter=oracle))),
                       reference)
    for drafter_name, make in sorted(real_drafters(model).items()):
        got = torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=300, drafter=make())))
        assert torch.equal(got, reference), drafter_name
