"""Mamba drafter: tree drafting by batched copied states. Greedy identity with plain
decoding (float64), the drafter's state after every round equal to a fresh forward
over the whole committed sequence, tree shapes cut to the node budget, the sampling
test (deterministic top-k candidates under the one-draw rule), a mismatched
vocabulary refused before work."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters.base import DraftContext
from longspec.speculation.drafters.shared.errors import DraftMismatchError
from longspec.speculation.drafters.mamba import PAPER_TREES, MambaDrafter, tree_nodes
from longspec.speculation.drafters.mamba.state import MambaStepper
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import SamplingParams
from oracles import tiny_mamba
from sampling_checks import ALPHA, SAMPLING, VOCAB, empirical_counts, exact_distribution, goodness_of_fit, model  # noqa: F401 - `model` is a pytest fixture
from tiny_models import VOCAB_SIZE, random_ids, tiny_decoder


def generate(target, prompt, drafter=None, max_new_tokens=40, stats=None, params=SamplingParams(), generator=None):
    engine = SpeculativeEngine(target, EngineOptions(prefill_chunk=6, max_tree_nodes=32, progress=False))
    return torch.cat(list(engine.generate(prompt, max_new_tokens=max_new_tokens, drafter=drafter, stats=stats,
                                          params=params, generator=generator)))


class Recording(MambaDrafter):
    """Keeps the root logits of every round it drafted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def propose(self, context):
        tree = super().propose(context)
        if tree.size > 1:
            self.rounds.append((context.tokens.clone(), self._root_logits.clone()))
        return tree


@pytest.mark.parametrize("widths", [PAPER_TREES[0], PAPER_TREES[2], (1, 1, 1, 1)])
def test_greedy_identity_and_state_equals_a_fresh_forward(widths):
    target = tiny_decoder("llama", seed=0)
    mamba = tiny_mamba()
    prompt = torch.cat([random_ids(5, seed=1)[0].repeat(3), random_ids(4, seed=2)[0]])
    drafter = Recording(mamba, widths=widths)
    stats = GenerationStats()
    assert torch.equal(generate(target, prompt, drafter, stats=stats), generate(target, prompt))
    assert len(drafter.rounds) > 5
    for tokens, logits in drafter.rounds:  # the carried state saw exactly the committed tokens
        fresh = mamba(tokens.unsqueeze(0)).logits[0, -1]
        # transformers' Mamba keeps A, D and the time-step bias in float32 even in a
        # float64 model, so its recurrent and scan forms agree to float32 rounding only.
        torch.testing.assert_close(logits, fresh, rtol=1e-5, atol=1e-6)
        skipped = torch.cat([tokens[:-2], tokens[-1:]])  # a state that missed a recent token is far off
        missing_one = mamba(skipped.unsqueeze(0)).logits[0, -1]
        assert (logits - fresh).abs().max() < 1e-2 * (missing_one - fresh).abs().max()


def test_tree_shapes_fit_the_budget():
    assert tree_nodes((3, 3, 2, 1)) == 3 + 9 + 18 + 18
    assert MambaDrafter._fitting_widths((3, 3, 2, 1), 48) == (3, 3, 2, 1)
    assert MambaDrafter._fitting_widths((3, 3, 2, 1), 47) == (3, 3, 2)
    assert MambaDrafter._fitting_widths((3, 3, 2, 1), 2) == ()
    with pytest.raises(ValueError, match="widths"):
        MambaDrafter(tiny_mamba(), widths=(2, 0))


def test_tree_search_tries_every_arm_and_stays_lossless():
    target = tiny_decoder("llama", seed=0)
    prompt = torch.cat([random_ids(5, seed=1)[0].repeat(3), random_ids(4, seed=2)[0]])
    drafter = MambaDrafter(tiny_mamba(), search=PAPER_TREES)
    assert torch.equal(generate(target, prompt, drafter, max_new_tokens=60), generate(target, prompt, max_new_tokens=60))
    counts = drafter.arm_counts
    assert set(counts) == set(PAPER_TREES) and all(c >= 1 for c in counts.values())
    assert drafter._cost_ratio is not None and drafter._cost_ratio > 0


def test_sampling_follows_the_target_distribution(model):  # noqa: F811
    mamba = tiny_mamba(vocab_size=VOCAB, seed=4)
    exact = exact_distribution(model, SAMPLING)
    counts = empirical_counts(model, SAMPLING, lambda g: MambaDrafter(mamba, widths=(2, 2)))
    assert goodness_of_fit(exact, counts) > ALPHA


def test_a_drafter_of_another_vocabulary_is_refused_before_work():
    target = tiny_decoder("llama", seed=0)
    engine = SpeculativeEngine(target, EngineOptions(progress=False))
    drafter = MambaDrafter(tiny_mamba(vocab_size=VOCAB_SIZE + 5))
    with pytest.raises(DraftMismatchError, match="vocabulary"):
        next(iter(engine.generate(random_ids(5)[0], max_new_tokens=4, drafter=drafter)))
    assert isinstance(make_drafter("mamba", model=tiny_mamba(), widths=(2, 1)), MambaDrafter)


@pytest.mark.parametrize("processor", ["sampled", "penalized"])
def test_seeded_output_equals_seeded_plain_decoding(processor):
    """Deterministic candidates draw once per emitted token, as plain decoding does: one
    seed, one output."""
    params = {"sampled": SamplingParams(temperature=1.0, top_p=0.9),
              "penalized": SamplingParams(temperature=0.8, penalty=1.3, penalty_window=8)}[processor]
    target = tiny_decoder("llama", seed=0, initializer_range=0.3)
    prompt = random_ids(11, seed=8)[0]
    reference = generate(target, prompt, params=params, generator=torch.Generator().manual_seed(5))
    out = generate(target, prompt, MambaDrafter(tiny_mamba(), widths=(3, 2, 1)), params=params, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out, reference)


def test_batched_state_drafting_equals_sequential_per_branch_drafts():
    """Every node's children are the top-N tokens of a fresh forward over the committed
    tokens and the node's own path: copying states into a batch changes nothing."""
    mamba = tiny_mamba(seed=5)
    target = tiny_decoder("llama", seed=0)
    prompt = random_ids(13, seed=6)[0]
    widths = (3, 2, 2)
    drafter = MambaDrafter(mamba, widths=widths)
    engine = SpeculativeEngine(target, EngineOptions(max_tree_nodes=32, progress=False))
    rounds = engine.generate(prompt, max_new_tokens=12, drafter=Recording(mamba, widths=widths))
    committed = torch.cat([prompt, next(iter(rounds))])  # one round in: the state was carried over once
    context = DraftContext(committed, None, 32)
    drafter.begin(DraftContext(committed, None, 32))
    tree = drafter.propose(context)
    for node in range(tree.size):
        children = tree.children(node)
        if tree.depths[node] >= len(widths):
            assert children.numel() == 0
            continue
        path = tree.tokens[tree.path_to(node)[1:]]
        fresh = mamba(torch.cat([committed, path]).unsqueeze(0)).logits[0, -1]
        expected = torch.topk(fresh.float(), widths[int(tree.depths[node])]).indices
        assert tree.tokens[children].tolist() == expected.tolist()


def test_state_memory_is_flat_in_the_context():
    sizes = []
    for length in (10, 400):
        drafter = MambaDrafter(tiny_mamba(), widths=(2, 1))
        tokens = random_ids(length, seed=length)[0]
        drafter.begin(DraftContext(tokens, None, 8))
        drafter.propose(DraftContext(tokens, None, 8))
        sizes.append(drafter.state_nbytes())
    assert sizes[0] == sizes[1] > 0


def test_every_path_of_the_stepper_computes_transformers_mamba():
    """The native prompt scan and state step, and the PyTorch fallbacks (the model's own
    forward for the prompt, the recurrence in tensor operations), give the logits of a
    fresh `transformers` forward over each branch's whole sequence."""
    mamba = tiny_mamba(seed=7)
    prompt, branches = random_ids(17, seed=9)[0], torch.tensor([3, 11, 5])
    fallback = MambaStepper(mamba)
    fallback.native = None
    more = random_ids(6, seed=10)[0]
    for stepper in (MambaStepper(mamba), fallback):
        logits, state = stepper.run(prompt)
        torch.testing.assert_close(logits, mamba(prompt.unsqueeze(0)).logits[0, -1], rtol=1e-5, atol=1e-6)
        kept = state.select(torch.zeros(1, dtype=torch.long))
        logits, _ = stepper.run(more, state)  # many tokens after a state, in one pass
        fresh = mamba(torch.cat([prompt, more]).unsqueeze(0)).logits[0, -1]
        torch.testing.assert_close(logits, fresh, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(state.conv + state.ssm, kept.conv + kept.ssm))  # left as it was
        state = state.select(torch.zeros(3, dtype=torch.long))
        for token in range(2):
            logits = stepper.step(state, branches + token)
        for row in range(3):
            sequence = torch.cat([prompt, branches[row : row + 1], branches[row : row + 1] + 1])
            fresh = mamba(sequence.unsqueeze(0)).logits[0, -1]
            torch.testing.assert_close(logits[row], fresh, rtol=1e-5, atol=1e-6)


def test_a_bf16_drafter_keeps_its_recurrence_in_float32():
    mamba = tiny_mamba(seed=7)
    reduced = tiny_mamba(seed=7).to(torch.bfloat16)
    prompt = random_ids(30, seed=9)[0]
    stepper = MambaStepper(reduced)
    logits, state = stepper.run(prompt)
    assert all(t.dtype == torch.float32 for t in state.conv + state.ssm)
    logits = stepper.step(state, torch.tensor([4]))[0]
    exact = mamba(torch.cat([prompt, torch.tensor([4])]).unsqueeze(0)).logits[0, -1]
    assert (logits.double() - exact).abs().max() < 0.05 * exact.abs().max()
