"""`auto`: the controller that composes drafters and sizes trees from measured cost.

* Lossless: greedy identity over every combination of component drafters, exact
  seeded identity with AR, and the chi-square test of sampled sequences.
* It switches speculation off when every component proposes garbage, and builds
  deep trees when one is an oracle; UCB finds the best arm on synthetic rewards.
* Bad names and incompatible components fail before work.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch

from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.adaptive import AdaptiveDrafter, ThroughputPolicy, UCBPolicy, mamba_reward
from longspec.speculation.drafters.adaptive.cost_fit import RealisedCostScale
from longspec.speculation.drafters.adaptive.acceptance import AcceptanceTable, CrossFittedAcceptance
from longspec.speculation.drafters.adaptive.merge import Source, merge_trees
from longspec.speculation.drafters.adaptive.unverified import UnverifiedNodes
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.longspec import BeamStrategy, LongSpecDrafter
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree
from exactness import PROCESSORS, diverse_model
from oracles import random_draft
from sampling_checks import (
    PROMPT,
    SAMPLING,
    CartesianDrafter,
    SampledChainDrafter,
    exact_distribution,
    goodness_of_fit,
)
from sampling_checks import N as SAMPLES
from sampling_checks import K as SAMPLE_TOKENS
from sampling_checks import model as sampling_model  # noqa: F401 - pytest fixture
from tiny_models import random_ids

OPTIONS = EngineOptions(progress=False, max_tree_nodes=24)


def cheap_trees_cost(step: float = 0.02) -> ForwardCost:
    """A synthetic machine: one forward costs 10 ms plus `step` of that per extra token."""
    ks = (1, 2, 4, 8, 16, 32, 64)
    return ForwardCost({}, ks, tuple(0.01 * (1 + step * (k - 1)) for k in ks))


def run(model, prompt, drafter=None, *, params=SamplingParams(), max_new_tokens=60, seed=None, stats=None):
    engine = SpeculativeEngine(model, OPTIONS)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter,
                                          generator=generator, stats=stats)))


class ReferenceChain(Drafter):
    """An oracle (the true continuation) or, with garbage=True, random tokens."""

    def __init__(self, reference: torch.Tensor, prompt_length: int, *, garbage: bool = False, length: int = 8):
        self.reference, self.prompt_length, self.garbage, self.length = reference, prompt_length, garbage, length
        self.rng = torch.Generator().manual_seed(5)

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        if self.garbage:
            return Tree.chain(context.root, torch.randint(0, 128, (self.length,), generator=self.rng))
        done = context.tokens.numel() - self.prompt_length
        return Tree.chain(context.root, self.reference[done : done + self.length])


def components(model, names):
    makers = {
        "pld": lambda: PromptLookupDrafter(num_tokens=6),
        "ngram": lambda: NgramDrafter(k=4),
        "longspec": lambda: LongSpecDrafter(random_draft(model), BeamStrategy((2, 3, 3))),
    }
    return [(name, makers[name]()) for name in names]


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_greedy_identity_over_every_combination_of_components(family):
    model, extra = diverse_model(family)
    params = SamplingParams(**extra)
    prompt = random_ids(40, seed=3)[0] % 20  # repetitive enough for lookups to hit
    reference = run(model, prompt, params=params, max_new_tokens=80)
    names = ("pld", "ngram", "longspec")
    for size in range(1, len(names) + 1):
        for combo in itertools.combinations(names, size):
            for policy in (ThroughputPolicy(), UCBPolicy()):
                drafter = AdaptiveDrafter(components(model, combo), policy=policy, forward_cost=cheap_trees_cost())
                stats = GenerationStats()
                out = run(model, prompt, drafter, params=params, max_new_tokens=80, stats=stats)
                assert torch.equal(out, reference), f"auto over {combo} with {type(policy).__name__}"
                assert stats.controller["rounds"] == stats.target_forwards - 1  # the last round ends the run unobserved


@pytest.mark.parametrize("processor", ["top_k", "penalty"])
def test_seeded_auto_equals_seeded_autoregressive(processor):
    """Merged trees are deterministic candidates: one draw per emitted token."""
    model, _ = diverse_model("llama")
    params = PROCESSORS[processor]
    prompt = random_ids(30, seed=4)[0] % 24
    reference = run(model, prompt, params=params, max_new_tokens=200, seed=9)
    drafter = AdaptiveDrafter(components(model, ("pld", "ngram", "longspec")), forward_cost=cheap_trees_cost())
    assert torch.equal(run(model, prompt, drafter, params=params, max_new_tokens=200, seed=9), reference)


def test_sampled_sequences_through_auto_follow_the_target_distribution(sampling_model):  # noqa: F811
    exact = exact_distribution(sampling_model, SAMPLING)
    engine = SpeculativeEngine(sampling_model, EngineOptions(max_tree_nodes=32, progress=False))
    generator = torch.Generator().manual_seed(3)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(SAMPLES):
        drafter = AdaptiveDrafter([("cartesian", CartesianDrafter()), ("pld", PromptLookupDrafter(num_tokens=3))],
                                  forward_cost=cheap_trees_cost())
        out = torch.cat(list(engine.generate(PROMPT, params=SAMPLING, max_new_tokens=SAMPLE_TOKENS, drafter=drafter,
                                             generator=generator)))
        counts[tuple(out.tolist())] = counts.get(tuple(out.tolist()), 0) + 1
    assert goodness_of_fit(exact, counts) > 1e-3


class LoggedDrafter(ReferenceChain):
    """The oracle, logging the engine's calls (and `learn`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def begin(self, context: DraftContext) -> None:
        self.calls.append(f"begin {context.learns_while_verifying}")

    def propose(self, context: DraftContext) -> Tree:
        self.calls.append("propose")
        return super().propose(context)

    def learn(self) -> None:
        self.calls.append("learn")

    def observe(self, committed: torch.Tensor) -> None:
        self.calls.append("observe")


def test_the_engine_calls_learn_during_each_verification_where_asked():
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=30)
    for setting, called in ((True, True), (False, False), (None, False)):  # None: not on the CPU
        drafter = LoggedDrafter(reference, prompt.numel())
        engine = SpeculativeEngine(model, dataclasses.replace(OPTIONS, learn_while_verifying=setting))
        assert torch.equal(torch.cat(list(engine.generate(prompt, max_new_tokens=30, drafter=drafter))), reference)
        rounds = drafter.calls.count("propose")
        each = ["propose", "learn", "observe"] if called else ["propose", "observe"]
        assert drafter.calls == [f"begin {called}", *each * (rounds - 1), *each[:-1]], setting  # the last round: no observe
    with pytest.raises(ValueError, match="learn_while_verifying must be True, False or None"):
        EngineOptions(learn_while_verifying="yes")


def test_auto_learning_while_the_target_verifies_stays_exact_and_still_learns():
    """With `learn` called during each verification forward (a GPU's setting, forced on
    the CPU here), the acceptance statistics lag a round: the output is still the
    target's, greedy and seeded, the garbage is still dropped and the oracle verified deep."""
    model, _ = diverse_model("qwen2")
    engine = SpeculativeEngine(model, dataclasses.replace(OPTIONS, learn_while_verifying=True))
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=300)
    results = {}
    for name, chains in (("garbage", [("garbage", ReferenceChain(reference, prompt.numel(), garbage=True))]),
                         ("oracle", [("garbage", ReferenceChain(reference, prompt.numel(), garbage=True)),
                                     ("oracle", ReferenceChain(reference, prompt.numel()))])):
        drafter = AdaptiveDrafter(chains, forward_cost=cheap_trees_cost(0.1), clock=FakeClock())
        stats = GenerationStats()
        out = torch.cat(list(engine.generate(prompt, max_new_tokens=300, drafter=drafter, stats=stats)))
        assert torch.equal(out, reference), name
        results[name] = stats
    garbage, oracle = results["garbage"].controller, results["oracle"]
    assert garbage["speculation_off_rounds"] >= 0.8 * garbage["rounds"], garbage
    assert oracle.tau > 5 and oracle.controller["credited_tokens"]["oracle"] > 10 * oracle.controller["credited_tokens"]["garbage"]
    lookups = AdaptiveDrafter(components(model, ("pld", "ngram")), forward_cost=cheap_trees_cost())
    repetitive = random_ids(30, seed=4)[0] % 24
    params = PROCESSORS["top_k"]
    seeded = run(model, repetitive, params=params, max_new_tokens=150, seed=9)
    generator = torch.Generator().manual_seed(9)
    assert torch.equal(torch.cat(list(engine.generate(repetitive, params=params, max_new_tokens=150, drafter=lookups,
                                                      generator=generator))), seeded)


def test_garbage_components_switch_speculation_off_and_an_oracle_gets_deep_trees():
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=400)
    # Each extra node costs 10% of a forward (a CPU-like knee): a node must be
    # accepted more often than that to pay.
    # A frozen clock: the synthetic costs alone size the trees (with the real one, a
    # loaded machine's slow proposals and forwards would move the decisions).
    garbage = AdaptiveDrafter([("garbage", ReferenceChain(reference, prompt.numel(), garbage=True))],
                              forward_cost=cheap_trees_cost(0.1), clock=FakeClock())
    stats = GenerationStats()
    assert torch.equal(run(model, prompt, garbage, max_new_tokens=400, stats=stats), reference)
    telemetry = stats.controller
    assert telemetry["speculation_off_rounds"] >= 0.8 * telemetry["rounds"], telemetry
    assert telemetry["rounds_without_proposals"] == 0  # on the frozen clock the controller's own work is free

    oracle = AdaptiveDrafter([("garbage", ReferenceChain(reference, prompt.numel(), garbage=True)),
                              ("oracle", ReferenceChain(reference, prompt.numel()))], forward_cost=cheap_trees_cost(),
                             clock=FakeClock())
    stats = GenerationStats()
    assert torch.equal(run(model, prompt, oracle, max_new_tokens=400, stats=stats), reference)
    assert stats.tau > 6 and stats.controller["speculation_off_rounds"] == 0
    assert stats.controller["credited_tokens"]["oracle"] > 10 * stats.controller["credited_tokens"]["garbage"]
    # Calibration: once learned (a second sequence; telemetry is per sequence), the
    # predicted acceptance tracks the realised one.
    stats = GenerationStats()
    assert torch.equal(run(model, prompt, oracle, max_new_tokens=400, stats=stats), reference)
    predicted = stats.controller["predicted_accepted_per_round"]
    assert abs(predicted - stats.controller["realised_accepted_per_round"]) < 0.25 * predicted


def test_unmeasured_deep_nodes_start_from_the_deepest_measured_rate_above_them():
    """A chain that keeps matching is accepted more often the deeper it goes: depths
    nobody measured yet borrow the rate of the depth above, not the pooled rate that
    the hard first token dominates."""
    table = AcceptanceTable(drafters=1)
    for depth, accepted in ((1, 5), (2, 9), (3, 10)):
        for i in range(10):
            table.record(Source(drafter=0, depth=depth, rank=0), accepted=i < accepted)
    rate = [table.rate(Source(drafter=0, depth=d, rank=0)) for d in range(1, 9)]
    assert rate[0] < rate[1] < rate[2]  # measured: 0.5, 0.9, 1.0 shrunk by two pseudo-observations
    assert rate[5] == rate[4] == rate[3] == rate[2] > 0.9  # never proposed: the depth-3 rate carries down
    pooled = (5 + 9 + 10 + 1) / (30 + 2)
    assert rate[5] > pooled + 0.1


def test_rates_follow_the_recent_rounds_and_fall_back_on_the_whole_sequence():
    """Acceptance moves with the text: after a long stretch of rejected copies, a copied
    passage lifts the cell's rate within a few rounds (a table of every round would stay
    near its 9% average); once the cell goes unobserved, its recent counts fade and
    the whole-sequence rate is back."""
    table = AcceptanceTable(drafters=1)
    source = Source(drafter=0, depth=1, rank=0)
    for accepted in [False] * 200 + [True] * 20:
        table.record(source, accepted=accepted)
        table.end_round()
    assert table.rate(source) > 0.75
    for _ in range(100):
        table.end_round()
    whole = table.rate(source)
    assert 0.05 < whole < 0.15
    unused = AcceptanceTable(drafters=1)  # end_round alone changes nothing
    unused.end_round()
    assert unused.rate(source) == pytest.approx(0.5)


def reference_rates(table: AcceptanceTable) -> np.ndarray:
    """The table's posterior means walked cell by cell down every level (no shortcut)."""
    m, w = table.PRIOR_WEIGHT, table.RECENT_PRIOR_WEIGHT
    continues = table.SAMPLED_COPY_CONTINUES_PRIOR if table.sampled else table.COPY_CONTINUES_PRIOR
    prior = np.array([[table.FLAT_PRIOR, continues if copying else table.FLAT_PRIOR]
                      for copying in table.copying])[:, None, None]  # [drafters, 1, 1, continues, 2]
    rate = (table.accepted.sum(axis=1) + prior[..., 0]) / (table.proposed.sum(axis=1) + prior.sum(axis=-1))
    means = np.empty_like(table.accepted)
    for level in range(table.accepted.shape[1]):
        whole = (table.accepted[:, level] + m * rate) / (table.proposed[:, level] + m)
        rate = (table.recent_accepted[:, level] + w * whole) / (table.recent_proposed[:, level] + w)
        means[:, level] = rate
    return np.clip(means, 0.0, 1.0)


@pytest.mark.parametrize("sampled", [False, True])
def test_rates_stop_walking_at_the_deepest_measured_level_and_equal_the_full_walk(sampled):
    table = AcceptanceTable(drafters=2)
    table.note_copying(1)
    table.expect_sampling(sampled)
    rng = np.random.default_rng(0)
    assert np.allclose(table.rates(), reference_rates(table), rtol=0, atol=1e-15)  # nothing measured
    for i in range(300):
        source = Source(int(rng.integers(0, 2)), int(rng.integers(1, 14)), int(rng.integers(0, 3)),
                        int(rng.integers(0, 20)))
        table.record(source, accepted=bool(rng.random() < 0.7), agreed=bool(rng.random() < 0.2))
        if i % 7 == 0:
            table.end_round()
    assert np.allclose(table.rates(), reference_rates(table), rtol=0, atol=1e-12)


def test_a_fresh_table_expects_a_started_copy_to_go_on():
    """Before a sequence has measured anything, a first token is a coin flip, but a node
    continuing a copy (prompt lookup) starts from the prior that copies keep going
    (replayed full preset, Spec-Bench and AIME outputs: 0.81-0.99 of them were accepted),
    so a fresh request verifies a long copy early instead of growing its trees from
    2-node chains while the first copies are accepted whole (BENCHMARKS.md, "A fresh
    request's prior"). A drafter that does not copy keeps the flat prior."""
    copier = CopiedRuns()
    drafter = AdaptiveDrafter([("copy", copier), ("model", ReferenceChain(torch.arange(100), 4))],
                              forward_cost=cheap_trees_cost(0.1), clock=FakeClock())
    context = DraftContext(tokens=torch.zeros(4, dtype=torch.long), max_nodes=24)
    drafter.begin(context)
    drafter.propose(context)  # the copier's tree carries copied runs
    table = drafter.table
    accepted, rejected = AcceptanceTable.COPY_CONTINUES_PRIOR
    assert table.rate(Source(0, depth=1, rank=0, run=5)) == pytest.approx(0.5)
    continuing = [table.rate(Source(0, depth=d, rank=0, run=5 + d)) for d in range(2, 12)]
    assert continuing == pytest.approx([accepted / (accepted + rejected)] * 10)
    assert [table.rate(Source(1, depth=d, rank=0)) for d in range(1, 12)] == pytest.approx([0.5] * 11)
    for _ in range(30):  # evidence outweighs the prior
        table.record(Source(0, depth=2, rank=0, run=7), accepted=False)
    assert table.rate(Source(0, depth=2, rank=0, run=7)) < 0.2


def test_a_sampled_request_expects_shorter_copies():
    """A request that samples accepts a drafted token only where the draw lands on it:
    its fresh table expects a started copy to go on less often than a greedy request's
    (a first token is a coin flip in both); evidence then decides alike. The engines say
    which in every context they hand a drafter."""
    def fresh_rates(sampled: bool) -> tuple[float, float]:
        drafter = AdaptiveDrafter([("copy", CopiedRuns())], forward_cost=cheap_trees_cost(0.1), clock=FakeClock())
        context = DraftContext(tokens=torch.zeros(4, dtype=torch.long), max_nodes=24, sampled=sampled)
        drafter.begin(context)
        drafter.propose(context)
        return (drafter.table.rate(Source(0, depth=1, rank=0, run=5)),
                drafter.table.rate(Source(0, depth=3, rank=0, run=8)))

    def mean(prior: tuple[float, float]) -> float:
        return prior[0] / sum(prior)

    table = AcceptanceTable
    assert fresh_rates(False) == pytest.approx((mean(table.FLAT_PRIOR), mean(table.COPY_CONTINUES_PRIOR)))
    assert fresh_rates(True) == pytest.approx((mean(table.FLAT_PRIOR), mean(table.SAMPLED_COPY_CONTINUES_PRIOR)))
    assert mean(table.SAMPLED_COPY_CONTINUES_PRIOR) < mean(table.COPY_CONTINUES_PRIOR)

    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    for params, sampled in ((SamplingParams(), False), (PROCESSORS["top_k"], True)):
        drafter = ContextLog()
        run(model, prompt, drafter, params=params, max_new_tokens=6, seed=3)
        batched = ContextLog()
        engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=64))
        engine.submit(prompt, params=params, max_new_tokens=6, drafter=batched,
                      generator=torch.Generator().manual_seed(3))
        engine.run()
        for log in (drafter.sampled, batched.sampled):
            assert len(log) >= 2 and set(log) == {sampled}, (params, log)


class ContextLog(Drafter):
    """Proposes nothing; logs whether each context it is handed says the request samples."""

    def __init__(self) -> None:
        self.sampled: list[bool] = []

    def begin(self, context: DraftContext) -> None:
        self.sampled.append(context.sampled)

    def propose(self, context: DraftContext) -> Tree:
        self.sampled.append(context.sampled)
        return Tree.chain(context.root, [])

    def observe(self, committed: torch.Tensor) -> None:
        pass


class CopiedRuns(Drafter):
    """A copying drafter's chain of `length` tokens whose first node extends a copied
    run of `run` tokens (set by the caller before each round)."""

    length = 12

    def __init__(self) -> None:
        self.run = 1

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        chain = Tree.chain(context.root, list(range(1, self.length + 1)))
        return CopiedTree.of(chain, [0] + [self.run + d for d in range(self.length)])


def test_copied_runs_size_the_tree_whatever_the_depth():
    """Copies that have matched for 30 tokens are accepted whole, copies of a single
    matching token never: the controller learns it from the copied runs, verifies the
    whole chain after a long run and nothing after a short one."""
    copier = CopiedRuns()
    # A frozen clock: with the synthetic costs, a real one would weigh this machine's load
    # (a descheduled propose() made the copier look costly and sit a round out).
    drafter = AdaptiveDrafter([("copy", copier)], forward_cost=cheap_trees_cost(0.1), clock=FakeClock())
    context = DraftContext(tokens=torch.zeros(4, dtype=torch.long), max_nodes=24)
    drafter.begin(context)
    rng = random.Random(0)
    chosen = {1: [], 30: []}
    for _ in range(300):
        copier.run = rng.choice([1, 30])
        tree = drafter.propose(context)
        chosen[copier.run].append(tree.size - 1)
        right = copier.length if copier.run == 30 else 0
        drafter.observe(torch.tensor(list(range(1, right + 1)) + [999]))
    assert min(chosen[30][-50:]) == copier.length and max(chosen[1][-50:]) == 0, chosen
    assert AcceptanceTable(drafters=1).cell(Source(drafter=0, depth=2, rank=0, run=31), agreed=False) == (0, 30, 0, 0, 1)


def test_first_tokens_and_continuing_tokens_are_counted_apart():
    """At the same copied-run level, the first token after the bonus (a fresh guess)
    and a token that continues a speculative parent keep their own rates; pooled (the
    table before the split) they share one."""
    def filled(table):
        for i in range(40):
            table.record(Source(0, depth=1, rank=0, run=8), accepted=i % 4 == 0)  # 25%
            table.record(Source(0, depth=3, rank=0, run=8), accepted=i % 10 != 0)  # 90%
        return table.rate(Source(0, 1, 0, run=8)), table.rate(Source(0, 3, 0, run=8))
    first, continuing = filled(AcceptanceTable(drafters=1))
    assert first < 0.35 and continuing > 0.8
    pooled = AcceptanceTable(drafters=1)
    pooled.SEPARATE_FIRST_TOKEN = False
    first, continuing = filled(pooled)
    assert first == continuing and 0.5 < first < 0.65


def test_optimistic_rates_keep_an_unlucky_depth_in_play_and_fade_with_evidence():
    """Three rejections at depth 6 (one a round, as a chain verifies it) of a chain
    accepted ~95% of the time above it must not bury depth 6 for good: trees are chosen
    with mean + one posterior deviation, which stays above the mean while the cell is
    thin and converges to it, and the recent rejections fade in rounds without it."""
    table = AcceptanceTable(drafters=1)
    chain = Source(drafter=0, depth=1, rank=0)
    for depth in range(1, 6):
        for i in range(20):
            table.record(Source(0, depth, 0), accepted=i != 0)
    for _ in range(3):
        table.record(Source(0, 6, 0), accepted=False)
        table.end_round()
    mean, optimistic = table.rates()[0, :, 0, 0, 1], table.rates(optimistic=True)[0, :, 0, 0, 1]  # depths 2..6
    thin = np.sqrt(mean[5] * (1 - mean[5]) / (3 + AcceptanceTable.PRIOR_WEIGHT + 1))  # 3 observations + the prior's
    assert mean[5] < 0.6 and optimistic[5] == pytest.approx(mean[5] + AcceptanceTable.OPTIMISM * thin)
    assert optimistic[5] > mean[5] + 0.05
    assert (optimistic <= 1.0).all() and (optimistic >= mean).all()
    buried = mean[5]
    for _ in range(10):  # rounds that do not reach depth 6: the recent rejections fade
        table.end_round()
    assert table.rates()[0, 5, 0, 0, 1] > 2 * buried
    for _ in range(400):  # much evidence: the bonus fades
        table.record(Source(0, 6, 0), accepted=False)
    assert table.rates(optimistic=True)[0, 5, 0, 0, 1] - table.rates()[0, 5, 0, 0, 1] < 0.01
    assert table.rate(chain) == pytest.approx(table.rates()[0, 0, 0, 0, 0])


def test_the_cross_fitted_table_predicts_the_nodes_it_chose_without_the_choices_bias():
    """A node accepted 30% of the time is verified only in the rounds where its
    optimistic estimate tops 0.4. One table predicts those rounds from the same lucky
    estimate (~0.44); the half of the evidence that did not choose predicts ~0.3."""
    rng = np.random.default_rng(0)
    node = Source(drafter=0, depth=1, rank=0)
    one, halves = AcceptanceTable(drafters=1), CrossFittedAcceptance(drafters=1)
    cell = one.cell(node, agreed=False)
    chosen = {"one": [], "halves": []}
    for _ in range(6000):
        if one.rates(optimistic=True)[cell] > 0.4:
            chosen["one"].append(one.rates()[cell])
        if halves.deciding_rates()[cell] > 0.4:
            chosen["halves"].append(halves.predicting_rates()[cell])
        for _ in range(2):
            accepted = bool(rng.random() < 0.3)
            one.record(node, accepted)
            halves.record(node, accepted)
        one.end_round()
        halves.end_round()
    assert min(len(c) for c in chosen.values()) > 500
    assert np.mean(chosen["one"]) > 0.4
    assert np.mean(chosen["halves"]) == pytest.approx(0.3, abs=0.02)
    assert halves.proposed[cell] == 12000 and abs(halves.table.proposed[halves.half(0)][cell] - 6000) <= 1


def test_unverified_nodes_are_decided_by_the_tokens_committed_after_them():
    """Nodes left out of the verified tree get their verdict from the continuation, as
    verification would have given it: accepted iff their token is the committed one at
    their depth, untested below a rejected parent, decided once the continuation is long
    enough (over several rounds)."""
    #        root
    #       /    \
    #     1:a    2:b
    #     |       |
    #     3:c    4:d
    #     |
    #     5:e
    nodes = UnverifiedNodes(tokens=[0, 10, 11, 12, 13, 14], parents=[-1, 0, 0, 1, 2, 3], depths=[0, 1, 1, 2, 2, 3],
                            pending=[2, 3, 4, 5])
    assert nodes.resolve([10]) == [(2, False)]  # depth 1 known: b rejected; d is below it, never tested
    assert nodes.pending == [3, 4, 5]
    assert nodes.resolve([12, 99]) == [(3, True), (5, False)]  # a, c committed, then 99 where e was proposed
    assert nodes.pending == []


class Switching(ReferenceChain):
    """Garbage for the first `garbage_rounds` calls, then the true continuation."""

    def __init__(self, *args, garbage_rounds: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.garbage_rounds, self.calls = garbage_rounds, 0

    def propose(self, context: DraftContext) -> Tree:
        self.calls += 1
        self.garbage = self.calls <= self.garbage_rounds
        return super().propose(context)


def test_speculation_switches_back_on_as_soon_as_the_proposals_match():
    """After speculation was switched off, the rounds without verification still measure
    the proposals against the committed tokens, so a drafter that turns good is
    verified again within a few rounds (no probe, no forgetting needed), and the deep
    nodes of the short trees verified meanwhile are measured too."""
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=300)
    drafter = AdaptiveDrafter([("switching", Switching(reference, prompt.numel(), garbage_rounds=60))],
                              forward_cost=cheap_trees_cost(0.1), clock=FakeClock())  # synthetic costs, no load
    stats = GenerationStats()
    assert torch.equal(run(model, prompt, drafter, max_new_tokens=300, stats=stats), reference)
    telemetry = stats.controller
    # 60 garbage rounds (one token each), then the oracle: ~240 tokens in rounds of up to 9.
    off_after_switch = telemetry["speculation_off_rounds"] - 60
    assert -60 < off_after_switch <= 5, telemetry
    assert stats.tau > 2.5, stats.tau
    # Every depth of the oracle's chains was measured, most of them without a verification.
    proposed = drafter.table.proposed[0, :, 0].sum(axis=(-2, -1))
    assert (proposed[:8] > 20).all(), proposed  # the chains are 8 tokens long


class TimedSwitching(Switching):
    """`Switching` whose every call takes `seconds` on a fake clock."""

    def __init__(self, clock: FakeClock, seconds: float, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.seconds = clock, seconds

    def propose(self, context: DraftContext) -> Tree:
        self.clock.now += self.seconds
        return super().propose(context)


def run_with_10_ms_forwards(model, prompt, drafter, clock: FakeClock, reference: torch.Tensor) -> dict:
    """The controller's telemetry of a run (which must equal `reference`) in which every
    forward, whatever its width, takes 10 ms on the fake clock."""
    original = model.forward

    def forward_taking_10_ms(*args, **kwargs):
        clock.now += 0.01
        return original(*args, **kwargs)

    stats = GenerationStats()
    model.forward = forward_taking_10_ms
    try:
        assert torch.equal(run(model, prompt, drafter, max_new_tokens=reference.numel(), stats=stats), reference)
    finally:
        model.forward = original
    return stats.controller


def test_rounds_off_skip_the_components_so_the_controller_costs_one_percent_of_plain_decoding():
    """Where a decode step is short beside the controller's own work (a GPU's compiled
    step: ~2.5 ms against ~1 ms), rounds with speculation off skip the components
    between rounds that ask them, and speculation still comes back once they match."""
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=300)
    clock = FakeClock()
    # Each call of the component takes 0.5 ms: 5% of a plain step, so one round in five asks it.
    switching = TimedSwitching(clock, 5e-4, reference, prompt.numel(), garbage_rounds=25)
    drafter = AdaptiveDrafter([("switching", switching)], forward_cost=cheap_trees_cost(0.1), clock=clock)
    telemetry = run_with_10_ms_forwards(model, prompt, drafter, clock, reference)
    # Four rounds or more skipped after each asking round with speculation off (~1% of a
    # step), except around the switch, where a committed token that matches a held
    # proposal ends the wait: speculation is back within three more asking rounds.
    asking_off = telemetry["speculation_off_rounds"] - telemetry["rounds_without_proposals"]
    assert telemetry["rounds_without_proposals"] >= 4 * (asking_off - 3), telemetry
    assert asking_off <= 25 + 3, telemetry
    after_switch = 300 - 25 - telemetry["rounds_without_proposals"]  # tokens, at most: one a round before it
    assert telemetry["credited_tokens"]["switching"] >= 0.75 * after_switch, telemetry


class Intermittent(ReferenceChain):
    """The oracle on even calls, nothing (a lookup's miss) on odd ones; each call takes
    `seconds` on a fake clock."""

    def __init__(self, clock: FakeClock, seconds: float, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def propose(self, context: DraftContext) -> Tree:
        self.clock.now += self.seconds
        self.calls += 1
        return super().propose(context) if self.calls % 2 else Tree.chain(context.root, [])


def test_one_drafters_chain_merges_as_in_the_general_path():
    """The shortcut for one drafter's chain (the common round) gives what merging it
    beside a tree that adds nothing gives."""
    chain = CopiedTree.of(Tree.chain(7, [3, 9, 3, 4]), [0, 5, 6, 7, 8])
    alone = merge_trees(7, [(0, chain)])
    beside = merge_trees(7, [(0, chain), (1, Tree.chain(7, []))])
    assert alone.tree is chain  # the shortcut: no tree built
    assert (alone.tokens, alone.parents, alone.depths, alone.sources) == (
        beside.tokens, beside.parents, beside.depths, beside.sources)
    branching = Tree.from_parents(torch.tensor([7, 3, 4]), torch.tensor([-1, 0, 0]))
    assert merge_trees(7, [(0, branching)]).sources[2] == [Source(0, 1, 1, 0)]  # not a chain: the general path


def test_a_round_whose_components_found_nothing_does_not_switch_speculation_off():
    """Nothing proposed is no verdict on the components: the next round asks them again.
    (Counted as off, such rounds made the controller skip asking for up to 32 rounds
    where its own work is large beside a decode step, as on a GPU: `auto` over prompt
    lookup then fell from 1.48x to 1.09x plain decoding on 2 ms forwards,
    `benchmarks/micro/adaptive_round_cost.py`.)"""
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=120)
    clock = FakeClock()
    # 0.5 ms a call: after a round that chose plain decoding over candidates, four rounds would skip asking.
    lookup = Intermittent(clock, 5e-4, reference, prompt.numel())
    drafter = AdaptiveDrafter([("lookup", lookup)], forward_cost=cheap_trees_cost(0.1), clock=clock)
    telemetry = run_with_10_ms_forwards(model, prompt, drafter, clock, reference)
    assert telemetry["rounds_without_proposals"] == 0, telemetry
    assert lookup.calls >= telemetry["rounds"], telemetry  # every round asked (the last one is not observed)
    assert telemetry["credited_tokens"]["lookup"] > 60, telemetry  # the oracle's rounds verified


class CountingModelDrafter(ReferenceChain):
    """Declares it runs a draft network; counts its calls."""

    runs_model = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def propose(self, context: DraftContext) -> Tree:
        self.calls += 1
        return super().propose(context)


class Silent(ReferenceChain):
    def propose(self, context: DraftContext) -> Tree:
        return Tree.chain(context.root, [])


def test_a_drafter_that_runs_a_model_is_asked_only_where_the_lookups_found_nothing():
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=120)
    costly = CountingModelDrafter(reference, prompt.numel())
    # A frozen clock: on a loaded machine a real one can time the lookup's Python call
    # above a fifth of the synthetic 10 ms forward, i.e. as expensive as the model.
    drafter = AdaptiveDrafter([("lookup", ReferenceChain(reference, prompt.numel())), ("model", costly)],
                              forward_cost=cheap_trees_cost(), clock=FakeClock())
    assert torch.equal(run(model, prompt, drafter, max_new_tokens=120), reference)
    assert costly.calls == 0  # the cheap oracle proposes every round
    costly = CountingModelDrafter(reference, prompt.numel())
    drafter = AdaptiveDrafter([("lookup", Silent(reference, prompt.numel())), ("model", costly)],
                              forward_cost=cheap_trees_cost())
    stats = GenerationStats()
    assert torch.equal(run(model, prompt, drafter, max_new_tokens=120, stats=stats), reference)
    assert costly.calls > 0 and stats.controller["credited_tokens"]["model"] > 0


class CostlyGarbage(CountingModelDrafter):
    """A draft network whose proposals are never accepted; each call takes 5 ms."""

    def __init__(self, clock, *args, **kwargs):
        super().__init__(*args, garbage=True, **kwargs)
        self.clock = clock

    def propose(self, context: DraftContext) -> Tree:
        self.clock.now += 5e-3
        return super().propose(context)


class TickingClock:
    """A fake clock on which the controller's own work takes time: each reading is 0.1 ms
    later than the one before."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-4
        return self.now


def test_a_round_in_which_every_component_sat_out_switches_speculation_off():
    """A costly component that adds nothing sits out until its next probe; the rounds in
    between are rounds off (plain decoding, the controller not asked), not rounds that
    ask again and find it sitting out. (Before, in a batch of 16 tiny rows of `auto` over
    garbage, where a row's share of the forward makes even a lookup costly, row 0 ran
    the controller in 178 of its 255 rounds.)"""
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=200)
    clock = TickingClock()
    costly = CostlyGarbage(clock, reference, prompt.numel())
    drafter = AdaptiveDrafter([("model", costly)], forward_cost=cheap_trees_cost(0.1), clock=clock)
    telemetry = run_with_10_ms_forwards(model, prompt, drafter, clock, reference)
    assert costly.calls >= 2, telemetry  # the first call and at least one probe
    asking_rounds = telemetry["rounds"] - telemetry["rounds_without_proposals"]
    # Each asking round's own work (~0.5 ms on this clock) spreads over the next rounds
    # off, for 1% of a 10 ms step: most rounds skip the controller.
    assert telemetry["rounds_without_proposals"] >= 3 * asking_rounds, telemetry


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class OneOffSetup(CountingModelDrafter):
    """A draft network whose first proposal of each sequence also catches up on the
    prompt: it costs 50 (fake) seconds, every later one 1."""

    def __init__(self, clock: FakeClock, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.fresh = clock, True

    def begin(self, context: DraftContext) -> None:
        self.fresh = True

    def propose(self, context: DraftContext) -> Tree:
        self.clock.now += 50.0 if self.fresh else 1.0
        self.fresh = False
        return super().propose(context)


def test_a_sequences_one_off_first_call_is_not_taken_for_the_components_cost():
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=80)
    clock = FakeClock()
    costly = OneOffSetup(clock, reference, prompt.numel())
    drafter = AdaptiveDrafter([("lookup", Silent(reference, prompt.numel())), ("model", costly)],
                              forward_cost=cheap_trees_cost(), probe_every=1, clock=clock)
    for _ in range(2):  # the second sequence's first call must not enter the average either
        calls = costly.calls
        assert torch.equal(run(model, prompt, drafter, max_new_tokens=80), reference)
        # Two calls at least, the second replacing the first's provisional cost (with this
        # costly a drafter, speculation is off between its probes: those rounds skip it).
        assert costly.calls - calls >= 2
        assert drafter.components[1].seconds == pytest.approx(1.0)


def test_expensive_trees_are_cut_to_the_knee():
    """With verification cost growing fast in k, the optimum is a short tree even for an oracle."""
    model, _ = diverse_model("qwen2")
    prompt = random_ids(20, seed=6)[0]
    reference = run(model, prompt, max_new_tokens=200)
    cheap = AdaptiveDrafter([("oracle", ReferenceChain(reference, prompt.numel(), length=20))],
                            forward_cost=cheap_trees_cost(0.02), clock=FakeClock())  # the costs alone decide
    costly = AdaptiveDrafter([("oracle", ReferenceChain(reference, prompt.numel(), length=20))],
                             # Each extra token costs 4 forwards: more than a whole plain round even after the
                             # controller scales the synthetic costs to this tiny model (down to 1/4) and adds the
                             # drafting time every round pays, so no tree pays even when every node is accepted.
                             forward_cost=cheap_trees_cost(4.0), clock=FakeClock())
    for drafter, check in ((cheap, lambda t: t["mean_nodes"] > 10), (costly, lambda t: t["mean_nodes"] < 1.5)):
        stats = GenerationStats()
        assert torch.equal(run(model, prompt, drafter, max_new_tokens=200, stats=stats), reference)
        assert check(stats.controller), stats.controller


def test_the_throughput_policy_grows_a_tree_only_for_a_gain_above_the_costs_resolution():
    flat = lambda k: 0.010  # noqa: E731 - a GPU's eager forward: flat in k to within its noise
    policy = ThroughputPolicy()
    assert policy.choose(torch.full((8,), 1e-5, dtype=torch.float64), flat) == 0  # garbage is not free
    assert policy.choose(torch.tensor([0.5, 0.4, 0.001], dtype=torch.float64), flat) == 2
    rising = lambda k: 0.010 * (1 + 0.1 * k)  # noqa: E731 - each node costs 10% of a forward
    tail = torch.tensor([0.9, 0.8, 0.24], dtype=torch.float64)  # the third node: +0.5% tokens per second
    assert policy.choose(tail, rising) == 2 and ThroughputPolicy(min_gain=0.0).choose(tail, rising) == 3
    assert ThroughputPolicy(min_gain=0.0).choose(torch.full((8,), 1e-5, dtype=torch.float64), flat) == 8
    with pytest.raises(ValueError, match="min_gain"):
        ThroughputPolicy(min_gain=1.5)


def test_the_throughput_policy_stops_early_only_where_no_larger_tree_can_win():
    """It stops once even all nodes at the next tree's cost could not win: the choice
    equals that of a scan over every k, on random rankings and rising costs."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        expected = np.sort(rng.random(n) ** rng.uniform(0.2, 8))[::-1].tolist()
        steps = np.concatenate([[1.0], rng.random(n) * rng.choice([0.0, 0.02, 0.3]) * (rng.random(n) < 0.7)])
        cost = np.cumsum(steps)  # non-decreasing, flat stretches included
        policy = ThroughputPolicy(min_gain=float(rng.choice([0.0, 0.01, 0.05])))
        gains = np.concatenate([[1.0], 1.0 + np.cumsum(expected)])
        best = 0
        for k in range(1, n + 1):  # every k, as before the early stop
            if gains[k] / cost[k] > gains[best] / cost[best] * (1.0 + policy.min_gain):
                best = k
        asked = []
        assert policy.choose(expected, lambda k: asked.append(k) or float(cost[k])) == best, trial
    garbage = []
    assert ThroughputPolicy().choose([1e-5] * 64, lambda k: garbage.append(k) or 1.0 + 0.01 * k) == 0
    assert garbage == [0, 1]  # garbage: one k priced past the root-only tree


def test_ucb_finds_the_best_arm_on_synthetic_rewards():
    policy = UCBPolicy(arms=(0, 4, 16), exploration=0.5)
    means = {0: -1.0, 1: -0.4, 2: -0.7}
    rng = torch.Generator().manual_seed(0)
    for _ in range(600):
        arm = policy.best_arm()
        policy.record(arm, means[arm] + 0.2 * float(torch.randn((), generator=rng)))
    assert max(range(3), key=lambda a: policy.counts[a]) == 1 and policy.counts[1] > 400
    assert mamba_reward(4, 3, 0.1) == pytest.approx(-(1 + 0.3) / 4)
    with pytest.raises(ValueError, match="at least the bonus"):
        mamba_reward(0, 3, 0.1)


def test_bad_names_and_incompatible_components_fail_before_work():
    with pytest.raises(ValueError, match="unknown auto policy 'greedy'"):
        make_drafter("auto", policy="greedy")
    with pytest.raises(ValueError, match=r"unknown auto component.*'medusa'"):
        make_drafter("auto", components="pld,medusa")
    with pytest.raises(ValueError, match="has no option"):
        make_drafter("auto", tree=3)
    with pytest.raises(ValueError, match="distinct"):
        AdaptiveDrafter([("pld", PromptLookupDrafter()), ("pld", PromptLookupDrafter())])
    model, _ = diverse_model("qwen2")
    sampled = AdaptiveDrafter([("sampled", SampledChainDrafter(torch.Generator()))], forward_cost=cheap_trees_cost())
    with pytest.raises(ValueError, match="sampled its children from q"):
        run(model, random_ids(10, seed=1)[0], sampled, params=SamplingParams(temperature=1.0), seed=0)
    # A LongSpec draft made for another target is left out (with the reason), not fatal.
    other, _ = diverse_model("gemma3")
    drafter = AdaptiveDrafter(components(other, ("pld", "longspec")), forward_cost=cheap_trees_cost())
    stats = GenerationStats()
    prompt = random_ids(20, seed=2)[0]
    assert torch.equal(run(model, prompt, drafter, max_new_tokens=30, stats=stats), run(model, prompt, max_new_tokens=30))
    assert "longspec" in stats.controller["unavailable"] and "longspec" not in stats.controller["calls"]


def test_the_measured_cost_is_scaled_to_the_realised_rounds_and_a_stall_is_clipped():
    scale = RealisedCostScale()
    for _ in range(40):
        scale.observe(0.010, 0.004, 1.5 * 0.014)
    assert scale.seconds(0.010, 0.020) == pytest.approx(1.5 * 0.030, rel=1e-3)
    scale.observe(0.010, 0.0, 5.0)  # 500x the measurement: a preempted thread, not the machine
    assert scale.telemetry()["cost_scale"] == pytest.approx(0.8 * 1.5 + 0.2 * 4.0, rel=1e-3)
