"""The joint node budget of a batched forward (speculation/joint_budget.py): levels are
ranked across rows by measured acceptance against the measured cost of the forward;
cutting trees keeps them valid; rows stay token-identical to their B = 1 runs when the
budget cuts hard."""

from __future__ import annotations


import pytest
import torch

from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation import batch_engine
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.adaptive import AdaptiveDrafter
from longspec.speculation.engine import EngineOptions
from longspec.speculation.joint_budget import (
    ReachHistory,
    ReachPrior,
    cut_to_depth,
    joint_depths,
    level_sizes,
    tree_levels,
    walk_down,
)
from longspec.speculation.tree import Tree
from exactness import diverse_model, single_run
from sampling_checks import N as SAMPLES
from sampling_checks import K as SAMPLE_TOKENS
from sampling_checks import (
    PROMPT,
    SAMPLING,
    CartesianDrafter,
    SampledChainDrafter,
    SampledTreeDrafter,
    exact_distribution,
    goodness_of_fit,
)
from sampling_checks import model as sampling_model  # noqa: F401 - pytest fixture
from tiny_models import random_ids

# Flat to 8 tokens, then every token costs as much as a decode step: a CPU past its knee.
STEEP = ForwardCost({}, (1, 8, 16, 64), (1.0, 1.0, 9.0, 57.0))
FREE = ForwardCost({}, (1, 512), (1.0, 1.0))
OPTIONS = EngineOptions(progress=False)


def chain(length: int, root: int = 0) -> Tree:
    return Tree.chain(root, list(range(1, length + 1)))


def test_levels_go_to_the_rows_that_accept_them():
    trees = [chain(10), chain(10), chain(10)]
    reach = [[0.95] * 10, [0.3] * 10, [0.6 ** (d + 1) for d in range(10)]]
    depths = joint_depths(trees, reach, STEEP.seconds_for)
    assert depths[0] > depths[2] >= depths[1]
    assert sum(depths) + 3 <= 16  # past the knee a node costs a whole decode step: none pays
    assert joint_depths(trees, reach, FREE.seconds_for) == [10, 10, 10]  # free nodes: keep everything


def test_useless_drafts_are_cut_to_the_root():
    trees = [chain(6), chain(6)]
    assert joint_depths(trees, [[0.0] * 6, [0.0] * 6], FREE.seconds_for) == [0, 0]


def test_rows_that_size_their_own_trees_are_kept_whole_and_counted():
    trees = [chain(12), chain(10)]
    reach = [[0.1] * 12, [0.3] * 10]
    assert joint_depths([chain(10)], [[0.3] * 10], STEEP.seconds_for) == [7]  # alone: every node below the knee pays
    # Beside a row kept whole at 13 tokens the forward is past the knee: its nodes no longer pay.
    assert joint_depths(trees, reach, STEEP.seconds_for, fixed=[True, False]) == [12, 0]


def test_reach_is_learned_from_verified_and_cut_levels():
    history = ReachHistory(ReachPrior(accepted=2, rounds=3))
    tree = chain(4)  # tokens 1, 2, 3, 4 below the root
    assert history.reach([1, 2]) == pytest.approx([2 / 3, 4 / 9])  # the prior alone
    assert history.record(tree, verified_depth=4, committed=[1, 2, 9]) == [(0, True), (1, True), (2, False)]
    # Cut at depth 1; the bonus is the cut child's token: depth 3 is judged by the next round's tokens.
    assert history.record(tree, verified_depth=1, committed=[1, 2]) == [(0, True), (1, True)]
    assert history.record(chain(0), verified_depth=0, committed=[3, 4, 8]) == [(2, True), (3, True)]  # the cut levels
    assert history.record(tree, verified_depth=2, committed=[7]) == [(0, False)]  # nothing deeper is tried
    assert history.tried == [3, 2, 2, 1] and history.accepted == [2, 2, 1, 1]
    history.record(tree, verified_depth=0, committed=[1])  # walks below a cut...
    assert history.record(chain(0), verified_depth=0, committed=[2, 5]) == [(1, True), (2, False)]  # ...and leaves it
    pooled = ReachHistory()
    pooled.add([(0, True), (4, False)])
    assert pooled.tried == [1, 0, 0, 0, 1] and pooled.accepted == [1, 0, 0, 0, 0]
    prior = [0.5, 0.5, 0.5, 0.5, 0.5]
    assert pooled.conditionals([1, 2], prior) == pytest.approx([(1 + 1.5) / 4, 0.5])
    assert walk_down(Tree.from_parents([0, 5, 6, 7], [-1, 0, 0, 2]), 0, [6, 7, 1]) == (2, 3)
    with pytest.raises(ValueError):
        ReachPrior(accepted=3, rounds=2)


def test_copied_trees_are_judged_by_the_run_they_extend():
    """A prompt-lookup chain's levels are its copied runs: a row learns that copies
    which matched for 20 tokens keep matching and copies of 1 token do not, where by
    depth the two would share one estimate."""
    assert tree_levels(chain(3)) == [1, 2, 3]
    two_chains = CopiedTree.of(Tree.from_parents([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2]), [0, 2, 5, 3, 6])
    assert tree_levels(two_chains) == [5, 6]  # the longest run at each depth
    assert tree_levels(CopiedTree.of(chain(2), [0, 40, 41])) == [32, 32]
    history = ReachHistory()
    long_copy = CopiedTree.of(chain(4), [0, 20, 21, 22, 23])
    short_copy = CopiedTree.of(chain(4), [0, 1, 2, 3, 4])
    for _ in range(20):
        history.record(long_copy, verified_depth=4, committed=[1, 2, 3, 4, 9])
        history.record(short_copy, verified_depth=4, committed=[9])
    assert min(history.conditionals(tree_levels(long_copy))) > 0.9
    assert max(history.reach(tree_levels(short_copy))) < 0.1
    cut = cut_to_depth(long_copy, 2)
    assert cut.copied_runs.tolist() == [0, 20, 21]


def test_cut_to_depth_keeps_a_valid_subtree_with_its_draft_probabilities():
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6])
    tokens = torch.arange(10, 18)
    probs = torch.softmax(torch.randn(8, 20, dtype=torch.float64), dim=-1)
    tree = Tree.from_parents(tokens, parents, draft_probs=probs, children_sampled=True)
    assert level_sizes(tree) == [2, 3, 1, 1]
    cut = cut_to_depth(tree, 2)
    assert cut.tokens.tolist() == [10, 11, 12, 13, 14, 15] and cut.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert torch.equal(cut.draft_probs, probs[:6]) and cut.children_sampled
    assert cut_to_depth(tree, 0).size == 1 and cut_to_depth(tree, 9) is tree
    Tree.from_parents(cut.tokens, cut.parents)  # the invariants hold


def hard_budget_engine(model, rows: int, monkeypatch) -> BatchEngine:
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=rows, row_capacity=200, joint_budget=True))
    monkeypatch.setattr(engine, "forward_cost", lambda rows, length: STEEP)
    return engine


def test_rows_cut_by_the_joint_budget_equal_their_single_runs(monkeypatch):
    model, _ = diverse_model("llama")
    prompts = [torch.cat([random_ids(5, seed=s)[0].repeat(5), random_ids(4, seed=s + 1)[0]]) % 24 for s in range(4)]
    prompts.append(random_ids(23, seed=9)[0] % 24)
    references = [single_run(model, p, max_new_tokens=40) for p in prompts]
    engine = hard_budget_engine(model, 3, monkeypatch)
    makers = [lambda: PromptLookupDrafter(num_tokens=8), lambda: NgramDrafter(k=4), lambda: PromptLookupDrafter(max_candidates=3),
              lambda: AdaptiveDrafter([("pld", PromptLookupDrafter(num_tokens=5))], forward_cost=STEEP), lambda: None]
    cuts = []
    monkeypatch.setattr(batch_engine, "cut_to_depth", lambda tree, depth: cuts.append((depth, tree.max_depth)) or cut_to_depth(tree, depth))
    handles = [engine.submit(p, max_new_tokens=40, drafter=make()) for p, make in zip(prompts, makers)]
    engine.run()
    for handle, reference in zip(handles, references):
        assert torch.equal(handle.tokens, reference)
    assert any(0 < kept < depth for kept, depth in cuts)  # trees cut below their drafted depth, still speculating
    assert any(h.stats.draft_tokens for h in handles[:3])  # and speculation still ran


def test_sampled_rows_cut_by_the_joint_budget_follow_the_target_distribution(sampling_model, monkeypatch):  # noqa: F811
    """Trees of sampled children (multi-draft rejection) and of deterministic candidates,
    cut below their drafted depth by a steep cost: sequences keep the exact AR distribution."""
    exact = exact_distribution(sampling_model, SAMPLING)
    engine = BatchEngine(sampling_model, EngineOptions(max_tree_nodes=32, progress=False),
                         BatchOptions(max_rows=8, row_capacity=64, joint_budget=True))
    monkeypatch.setattr(engine, "forward_cost", lambda rows, length: ForwardCost({}, (1, 2, 4), (1.0, 1.1, 1.6)))
    drafters = (SampledTreeDrafter, CartesianDrafter, SampledChainDrafter)
    cuts = []
    monkeypatch.setattr(batch_engine, "cut_to_depth", lambda tree, depth: cuts.append((depth, tree.max_depth)) or cut_to_depth(tree, depth))
    handles = []
    for i in range(SAMPLES):
        drafter = drafters[i % len(drafters)](torch.Generator().manual_seed(90000 + i))
        handles.append(engine.submit(PROMPT, params=SAMPLING, max_new_tokens=SAMPLE_TOKENS, drafter=drafter,
                                     generator=torch.Generator().manual_seed(7000 + i)))
        if len(handles) % 8 == 0:
            engine.run()
    engine.run()
    counts: dict[tuple[int, ...], int] = {}
    for handle in handles:
        key = tuple(handle.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
    assert any(0 < kept < depth for kept, depth in cuts)  # trees cut below their drafted depth, still speculating
    assert goodness_of_fit(exact, counts) > 1e-3
