"""The drafter contract (docs/design.md, "The drafter contract"): a drafter written from
that section alone — a bigram drafter — is exact against plain decoding in one
sequence and in a batch; the optional capabilities have neutral defaults; an object
that does not subclass `Drafter` is refused before any work."""

from __future__ import annotations

import pytest
import torch

import longspec
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from tiny_models import random_ids, tiny_decoder

OPTIONS = EngineOptions(progress=False, max_tree_nodes=8, prefill_chunk=16)


class BigramDrafter(longspec.Drafter):
    """Proposes the chain that followed the root's last earlier occurrence, token by
    token through a table of each token's most recent successor."""

    def __init__(self, length: int = 4) -> None:
        self.length = length
        self.successor: dict[int, int] = {}
        self.previous: int | None = None

    def begin(self, context: longspec.DraftContext) -> None:
        self.successor.clear()
        self.previous = None
        self.observe(context.tokens)

    def observe(self, committed: torch.Tensor) -> None:
        for token in committed.tolist():
            if self.previous is not None:
                self.successor[self.previous] = token
            self.previous = token

    def propose(self, context: longspec.DraftContext) -> longspec.Tree:
        chain, token = [], context.root
        while len(chain) < min(self.length, context.max_nodes) and token in self.successor:
            token = self.successor[token]
            chain.append(token)
        return longspec.Tree.chain(context.root, chain)


def plain(model, prompt, **kwargs) -> torch.Tensor:
    return torch.cat(list(SpeculativeEngine(model, OPTIONS).generate(prompt, **kwargs)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_drafter_written_from_the_design_doc_is_exact(family):
    model = tiny_decoder(family, dtype=torch.float64)
    prompt = random_ids(6, seed=1)[0].repeat(3)  # repeats: the bigram table has something to propose
    reference = plain(model, prompt, max_new_tokens=40)
    engine = SpeculativeEngine(model, OPTIONS)
    stats = GenerationStats()
    drafted = torch.cat(list(engine.generate(prompt, max_new_tokens=40, drafter=BigramDrafter(), stats=stats)))
    assert torch.equal(drafted, reference)
    assert stats.draft_tokens > 0  # it really proposed

    seeded = SamplingParams(temperature=0.9, top_p=0.9)
    sampled_reference = plain(model, prompt, max_new_tokens=30, params=seeded,
                              generator=torch.Generator().manual_seed(3))
    sampled = torch.cat(list(engine.generate(prompt, max_new_tokens=30, params=seeded, drafter=BigramDrafter(),
                                             generator=torch.Generator().manual_seed(3))))
    assert torch.equal(sampled, sampled_reference)  # deterministic candidates: one draw a token, as AR

    batch = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=256))
    handles = [batch.submit(prompt, max_new_tokens=40, drafter=BigramDrafter()),
               batch.submit(prompt[:10], max_new_tokens=40, drafter=BigramDrafter())]
    batch.run()
    assert torch.equal(handles[0].tokens, reference)
    assert torch.equal(handles[1].tokens, plain(model, prompt[:10], max_new_tokens=40))


def test_optional_capabilities_have_neutral_defaults():
    drafter = BigramDrafter()
    context = longspec.DraftContext(torch.tensor([1, 2, 3]))
    assert drafter.check_target(None) is None
    assert drafter.state_nbytes() == 0 and drafter.prefill_hidden_rows == 0 and drafter.plain_rounds() == 0
    assert drafter.widen(context, 8) is None and drafter.telemetry() is None and drafter.learn() is None
    assert not drafter.runs_model and not drafter.sizes_tree_from_cost


def test_an_object_that_is_not_a_drafter_is_refused_before_prefill():
    class Duck:  # the three methods, but not the contract's type
        def begin(self, context): ...
        def propose(self, context): ...
        def observe(self, committed): ...

    model = tiny_decoder("llama", dtype=torch.float64)
    with pytest.raises(TypeError, match="must subclass longspec.Drafter"):
        next(SpeculativeEngine(model, OPTIONS).generate(random_ids(8)[0], max_new_tokens=4, drafter=Duck()))
    with pytest.raises(TypeError, match="must subclass longspec.Drafter"):
        BatchEngine(model, OPTIONS, BatchOptions(max_rows=1, row_capacity=64)).submit(
            random_ids(8)[0], max_new_tokens=4, drafter=Duck())
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (longspec.Drafter,), {"begin": lambda self, c: None})()
