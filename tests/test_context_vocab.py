"""The context vocabulary: the distinct tokens a sequence used, scored through their
head rows, and the LongSpec draft scoring only those (lossless, approximate drafts)."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters.base import DraftContext, TargetView
from longspec.speculation.drafters.shared.context_vocab import ContextVocabulary
from longspec.speculation.drafters.longspec import BeamStrategy, ChainStrategy, LongSpecDrafter, SampledChainStrategy
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from exactness import run
from oracles import STRATEGIES, random_draft
from sampling_checks import ALPHA, SAMPLING, empirical_counts, exact_distribution, goodness_of_fit
from sampling_checks import model as sampling_model  # noqa: F401 - pytest fixture
from tiny_models import random_ids, tiny_decoder


def test_tokens_are_admitted_once_in_order_of_first_use_and_only_if_allowed():
    head = torch.randn(50, 8, dtype=torch.float64)
    vocab = ContextVocabulary(head, allowed=torch.arange(0, 50, 2))
    vocab.add(torch.tensor([8, 3, 4, 8, 2, 4]))
    vocab.add(torch.tensor([6, 4, 7, 0]))
    assert vocab.ids.tolist() == [8, 4, 2, 6, 0]
    assert len(vocab) == 5


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_scores_are_the_head_rows_of_the_admitted_tokens_across_rebuilds(dtype):
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(4000, 64, generator=generator).to(dtype)
    hidden = torch.randn(3, 64, generator=generator).to(dtype)
    vocab = ContextVocabulary(head)
    assert vocab.scores(hidden).shape == (3, 0)
    rebuilt = 0
    for step in range(12):  # enough new tokens to rebuild the prepared block several times
        block = vocab._block_rows.shape[0]
        vocab.add(torch.randint(0, 4000, (400,), generator=generator))
        rebuilt += vocab._block_rows.shape[0] != block
        reference = (hidden.double() @ head[vocab.ids].double().T)
        tolerance = 1e-12 if dtype == torch.float64 else 0.05 * reference.abs().max().item()
        assert torch.allclose(vocab.scores(hidden).double(), reference, atol=tolerance, rtol=0)
    assert rebuilt >= 2


def _drafter_after_prefill(model, draft, prompt, **options):
    cache = model.new_cache(64)
    prefill = model(prompt[:-1].unsqueeze(0), cache)
    cache.commit()
    view = TargetView(model, cache)
    view.prefill_hidden = prefill.hidden[0]
    drafter = LongSpecDrafter(draft, ChainStrategy(3), **options)
    drafter.begin(DraftContext(prompt, view, 8))
    tree = drafter.propose(DraftContext(prompt, view, 8))
    return drafter, tree


def test_the_draft_scores_its_used_tokens_with_the_full_heads_log_probabilities_renormalised():
    model = tiny_decoder("qwen3", dtype=torch.float64)
    draft = random_draft(model, draft_vocab_size=40, recency_bias=True)
    draft.vocab_ids.copy_(torch.arange(60, 100))
    prompt = torch.cat([torch.arange(55, 75), random_ids(6, seed=2)[0]])
    full, _ = _drafter_after_prefill(model, draft, prompt)
    restricted, tree = _drafter_after_prefill(model, draft, prompt, context_vocab=True)
    used = sorted(set(prompt.tolist()) & set(range(60, 100)), key=prompt.tolist().index)
    assert restricted._vocab.ids.tolist() == used
    expected = torch.log_softmax(full._root_logprobs[torch.tensor(used) - 60], dim=-1)
    assert torch.allclose(restricted._root_logprobs, expected, atol=1e-12)
    assert set(tree.tokens[1:].tolist()) <= set(used)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_greedy_identity_with_the_context_vocabulary(strategy):
    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=7, max_tree_nodes=20, progress=False))
    prompt = torch.cat([random_ids(6, seed=4)[0].repeat(3), random_ids(5, seed=54)[0]])
    reference = run(engine, prompt)
    drafter = LongSpecDrafter(random_draft(model, hidden_input=True), STRATEGIES[strategy](), context_vocab=True)
    assert torch.equal(run(engine, prompt, drafter), reference)


def test_a_sequence_without_a_draft_token_gets_root_only_trees():
    model = tiny_decoder("qwen3", dtype=torch.float64)
    draft = random_draft(model, draft_vocab_size=10)
    draft.vocab_ids.copy_(torch.arange(100, 110))
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=8, progress=False))
    prompt = random_ids(12, seed=1)[0] % 100
    drafter = LongSpecDrafter(draft, BeamStrategy((2, 2)), context_vocab=True)
    _, tree = _drafter_after_prefill(model, draft, prompt, context_vocab=True)
    assert tree.size == 1
    assert torch.equal(run(engine, prompt, drafter, max_new_tokens=10), run(engine, prompt, max_new_tokens=10))


def test_context_vocab_is_validated():
    model = tiny_decoder("qwen3", dtype=torch.float64)
    with pytest.raises(ValueError, match="context_vocab must be true or false"):
        LongSpecDrafter(random_draft(model), ChainStrategy(2), context_vocab="yes")


class _LateVocabulary(LongSpecDrafter):
    """Begins with only the prompt's last two tokens in its context vocabulary (the
    4-token test vocabulary is all in the prompt): q is zero on the others until
    they are committed."""

    def begin(self, context):
        super().begin(context)
        self._vocab = ContextVocabulary(context.target.head)
        self._vocab.add(context.tokens[-2:])


def test_sampled_chain_over_the_context_vocabulary_follows_the_target_distribution(sampling_model):  # noqa: F811
    """q is zero outside the scored tokens, and the scored set grows during the
    sequence: the residual puts the missing mass back."""
    draft = random_draft(sampling_model, window=8, std=0.5)
    factory = lambda g: _LateVocabulary(draft, SampledChainStrategy(3, temperature=0.7), generator=g,  # noqa: E731
                                        context_vocab=True)
    exact = exact_distribution(sampling_model, SAMPLING)
    counts = empirical_counts(sampling_model, SAMPLING, factory)
    assert goodness_of_fit(exact, counts) > ALPHA
