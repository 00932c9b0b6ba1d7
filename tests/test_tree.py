"""Tree construction and derived views against brute-force references."""

import pytest
import torch

from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree
from longspec.speculation.verification import NodeScores, verify_greedy


def random_tree(n: int, seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
    tokens = torch.randint(0, 50, (n,), generator=g)
    return Tree.from_parents(tokens, torch.tensor(parents))


def brute_ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_depths_mask_and_paths_match_brute_force(seed):
    tree = random_tree(1 + seed * 3, seed)
    parents = tree.parents.tolist()
    mask = tree.ancestor_mask()
    for i in range(tree.size):
        anc = brute_ancestors(parents, i)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == anc
        assert int(tree.depths[i]) == len(anc) - 1
        path = tree.path_to(i).tolist()
        assert path[0] == 0 and path[-1] == i and set(path) == anc
        assert all(parents[b] == a for a, b in zip(path, path[1:]))


def test_chain_is_a_tree():
    tree = Tree.chain(7, [1, 2, 3])
    assert tree.tokens.tolist() == [7, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.is_chain() and tree.max_depth == 3
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert Tree.chain(7, []).size == 1


def test_cartesian_tree_shape():
    tree = Tree.cartesian(9, [torch.tensor([1]), torch.tensor([2, 3, 4]), torch.tensor([5, 6, 7])])
    assert tree.size == 1 + 1 + 3 + 9
    assert (tree.depths == 3).sum() == 9
    leaves = [i for i in range(tree.size) if tree.children(i).numel() == 0]
    spelled = {tuple(tree.tokens[tree.path_to(leaf)].tolist()) for leaf in leaves}
    assert spelled == {(9, 1, b, c) for b in (2, 3, 4) for c in (5, 6, 7)}


def test_with_chains_reuses_prefixes_and_never_duplicates_siblings():
    tree = Tree.chain(0, [1, 2]).with_chains([torch.tensor([1, 2, 3]), torch.tensor([1, 5]), torch.tensor([1, 5]), torch.tensor([4])])
    siblings = {}
    for i in range(1, tree.size):
        key = (int(tree.parents[i]), int(tree.tokens[i]))
        assert key not in siblings
        siblings[key] = i
    leaves = [i for i in range(tree.size) if tree.children(i).numel() == 0]
    spelled = {tuple(tree.tokens[tree.path_to(leaf)].tolist()) for leaf in leaves}
    assert spelled == {(0, 1, 2, 3), (0, 1, 5), (0, 4)}


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError, match="root"):
        Tree.from_parents(torch.tensor([1, 2]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="precede"):
        Tree.from_parents(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="draft_probs"):
        Tree.chain(1, [2], children_sampled=True)
    sampled = Tree.chain(1, [2], draft_probs=torch.full((2, 4), 0.25), children_sampled=True)
    with pytest.raises(ValueError, match="sampled"):
        sampled.with_chains([torch.tensor([3])])
    with pytest.raises(ValueError, match="copied_runs"):
        CopiedTree.of(Tree.chain(1, [2, 3]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="copied_runs"):
        CopiedTree.of(Tree.chain(1, [2]), torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("seed", range(10))
def test_a_chain_is_verified_greedily_as_any_tree(seed):
    """The chain's shortcut (up to the first node that misses its parent's target) against
    the general rule (the deepest node whose whole path matches) on the same nodes plus a
    leaf below the root that never matches, which makes the tree no chain."""
    g = torch.Generator().manual_seed(seed)
    n = 2 + seed
    tokens = torch.randint(0, 3, (n,), generator=g)
    targets = torch.randint(0, 3, (n,), generator=g)
    chain = Tree.chain(int(tokens[0]), tokens[1:].tolist())
    tree = Tree.from_parents(torch.cat([tokens, torch.tensor([99])]), torch.tensor(list(range(-1, n - 1)) + [0]))
    assert chain.is_chain() and not tree.is_chain()
    verdict = verify_greedy(chain, NodeScores(argmax=targets, logits=torch.zeros(n, 3)), None, SamplingParams())
    reference = verify_greedy(tree, NodeScores(argmax=torch.cat([targets, torch.tensor([0])]),
                                               logits=torch.zeros(n + 1, 3)), None, SamplingParams())
    assert verdict.path.tolist() == reference.path.tolist() and verdict.bonus == reference.bonus
    leading = 0
    while leading < n - 1 and int(tokens[leading + 1]) == int(targets[leading]):
        leading += 1
    assert verdict.path.tolist() == list(range(leading + 1)) and verdict.bonus == int(targets[leading])
