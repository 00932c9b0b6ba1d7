"""The engine refuses malformed trees (each broken invariant named with the drafter
and the node), LongSpec checkpoints with repeated vocabulary ids fail at load, and
the request's seed reaches every drafter that samples."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import MalformedTreeError, Tree
from tiny_models import VOCAB_SIZE, random_ids, tiny_decoder


class FixedTree(Drafter):
    """Proposes whatever `build(root)` returns (nodes below the given root)."""

    def __init__(self, build):
        self.build = build

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext):
        return self.build(context.root)


def uniform_rows(n: int) -> torch.Tensor:
    return torch.full((n, VOCAB_SIZE), 1.0 / VOCAB_SIZE, dtype=torch.float64)


def _rows_with(n: int, node: int, row: torch.Tensor) -> torch.Tensor:
    q = uniform_rows(n)
    q[node] = row
    return q


L = torch.long
MALFORMED = {
    # The example: node 2 claims depth 1 under a depth-1 parent.
    "depth": (lambda r: Tree(torch.tensor([r, 5, 6, 7]), torch.tensor([-1, 0, 1, 2]), torch.tensor([0, 1, 1, 2])),
              "node 2 has depth 1 but its parent 1 has depth 1"),
    "root-depth": (lambda r: Tree(torch.tensor([r, 5]), torch.tensor([-1, 0]), torch.tensor([1, 2])),
                   "node 0 must be the root"),
    "parent-after-child": (lambda r: Tree(torch.tensor([r, 5, 6]), torch.tensor([-1, 2, 0]), torch.tensor([0, 2, 1])),
                           "node 1 has parent 2; parents must precede their children"),
    "negative-parent": (lambda r: Tree(torch.tensor([r, 5, 6]), torch.tensor([-1, 0, -1]), torch.tensor([0, 1, 1])),
                        "node 2 has parent -1"),
    "lengths": (lambda r: Tree(torch.tensor([r, 5, 6]), torch.tensor([-1, 0]), torch.tensor([0, 1])),
                "same length"),
    "float-tokens": (lambda r: Tree(torch.tensor([float(r), 5.0]), torch.tensor([-1, 0]), torch.tensor([0, 1])),
                     "tokens must be a 1-D int64 tensor"),
    "token-range": (lambda r: Tree.chain(r, [3, VOCAB_SIZE]), f"node 2 carries token {VOCAB_SIZE}, outside the vocabulary"),
    "negative-token": (lambda r: Tree.chain(r, [-4]), "node 1 carries token -4"),
    "wrong-root": (lambda r: Tree.chain((r + 1) % VOCAB_SIZE, [3]), "but the root (last committed token) is"),
    "probs-shape": (lambda r: Tree.chain(r, [3, 4], draft_probs=torch.full((3, VOCAB_SIZE - 1), 1 / (VOCAB_SIZE - 1))),
                    "draft_probs must be a float tensor of shape"),
    "probs-not-normalised": (lambda r: Tree.chain(r, [3, 4], draft_probs=_rows_with(3, 1, torch.full((VOCAB_SIZE,), 0.5 / VOCAB_SIZE, dtype=torch.float64)),
                                                  children_sampled=True),
                             "node 1: draft_probs row sums to 0.5"),
    "probs-negative": (lambda r: Tree.chain(r, [3], draft_probs=_rows_with(2, 0, torch.cat([torch.tensor([-0.5, 1.5]), torch.zeros(VOCAB_SIZE - 2)]).double())),
                       "node 0: draft_probs row has negative or non-finite entries"),
    "probs-nan": (lambda r: Tree.chain(r, [3], draft_probs=_rows_with(2, 1, torch.full((VOCAB_SIZE,), float("nan"), dtype=torch.float64))),
                  "node 1: draft_probs row has negative or non-finite"),
    "sampled-child-q-zero": (lambda r: Tree.chain(r, [3, 4], draft_probs=_rows_with(3, 1, torch.nn.functional.one_hot(torch.tensor(9), VOCAB_SIZE).double()),
                                                  children_sampled=True),
                             "node 2 was sampled from its parent 1's draft distribution but carries token 4"),
    "sampled-without-probs": (lambda r: Tree.chain(r, [3], children_sampled=True), "must carry draft_probs"),
    # `Tree.assembled` trusts its builder with the three arrays: the engine's check still sees them.
    "assembled-depth": (lambda r: Tree.assembled(torch.tensor([r, 5, 6]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 1])),
                        "node 2 has depth 1 but its parent 1 has depth 1"),
    "assembled-parents": (lambda r: Tree.assembled(torch.tensor([r, 5]), torch.tensor([-1, 1]), torch.tensor([0, 1])),
                          "node 1 has parent 1; parents must precede their children"),
    "assembled-runs": (lambda r: CopiedTree.of(Tree.assembled(torch.tensor([r, 5]), torch.tensor([-1, 0]),
                                                              torch.tensor([0, 1])), torch.tensor([0])),
                       "copied_runs must be a host int64 tensor of one value per node (2)"),
    # The root alone (what a drafter that found nothing proposes) has its own short path.
    "root-only-parent": (lambda r: Tree.assembled(torch.tensor([r]), torch.tensor([0]), torch.tensor([0])),
                         "node 0 must be the root (parent -1, depth 0), got parent 0"),
    "root-only-depth": (lambda r: Tree.assembled(torch.tensor([r]), torch.tensor([-1]), torch.tensor([2])),
                        "node 0 must be the root (parent -1, depth 0), got parent -1, depth 2"),
    "root-only-token-range": (lambda r: Tree.chain(VOCAB_SIZE + 3, []), f"node 0 carries token {VOCAB_SIZE + 3}"),
    "root-only-wrong-root": (lambda r: Tree.chain((r + 1) % VOCAB_SIZE, []), "but the root (last committed token) is"),
    "root-only-runs": (lambda r: CopiedTree.of(Tree.assembled(torch.tensor([r]), torch.tensor([-1]), torch.tensor([0])),
                                               torch.tensor([0, 1])),
                       "copied_runs must be a host int64 tensor of one value per node (1)"),
}


@pytest.fixture(scope="module")
def engine():
    return SpeculativeEngine(tiny_decoder("llama", dtype=torch.float64), EngineOptions(max_tree_nodes=8, progress=False))


@pytest.mark.parametrize("rule", sorted(MALFORMED))
def test_engine_refuses_each_malformed_tree_naming_drafter_node_and_rule(engine, rule):
    build, message = MALFORMED[rule]
    prompt = random_ids(6, seed=1)[0]
    with pytest.raises(MalformedTreeError) as error:
        list(engine.generate(prompt, max_new_tokens=4, drafter=FixedTree(build)))
    assert "drafter FixedTree proposed a malformed tree" in str(error.value)
    assert message in str(error.value)


def test_tree_mutated_after_construction_is_still_caught(engine):
    def build(root):
        tree = Tree.chain(root, [3, 4, 5])
        tree.depths[3] = 1  # the constructor saw a valid tree; the engine checks again
        return tree

    with pytest.raises(MalformedTreeError, match="node 3 has depth 1 but its parent 2 has depth 2"):
        list(engine.generate(random_ids(6, seed=1)[0], max_new_tokens=4, drafter=FixedTree(build)))


def test_budget_and_return_type_are_checked(engine):
    with pytest.raises(MalformedTreeError, match="9 speculative nodes, more than max_tree_nodes=8"):
        list(engine.generate(random_ids(6)[0], max_new_tokens=4, drafter=FixedTree(lambda r: Tree.chain(r, [1] * 9))))
    with pytest.raises(TypeError, match="returned list from propose"):
        list(engine.generate(random_ids(6)[0], max_new_tokens=4, drafter=FixedTree(lambda r: [r, 1])))


def test_valid_trees_pass_every_rule():
    q = uniform_rows(4)
    q[3] = 0  # a leaf's unused row may be all zero
    assert Tree.chain(7, [1, 2, 3], draft_probs=q, children_sampled=True).problem(VOCAB_SIZE) is None
    tree = Tree.cartesian(7, [torch.tensor([1, 2]), torch.tensor([3, 3])])  # duplicate siblings are allowed
    assert tree.problem(VOCAB_SIZE) is None
    assert tree.with_chains([torch.tensor([1, 3, 9])]).problem(VOCAB_SIZE) is None
    assert Tree.chain(7, []).problem(VOCAB_SIZE) is None


# ---------------------------------------------------------------- LongSpec vocab ids
def test_longspec_checkpoint_with_repeated_vocab_ids_fails_at_load(tmp_path):
    from longspec.speculation.drafters.longspec import ChainStrategy, LongSpecDrafter, load_draft, save_draft
    from oracles import random_draft

    model = tiny_decoder("llama", dtype=torch.float64)
    draft = random_draft(model, draft_vocab_size=20)
    draft.vocab_ids.copy_(torch.arange(20))
    draft.vocab_ids[7] = 3
    path = save_draft(draft, tmp_path / "repeated.safetensors")
    with pytest.raises(ValueError, match=r"repeated.safetensors: draft vocabulary ids repeat 1 token\(s\), e.g. \[3\]"):
        load_draft(path, model.config)
    # A draft built in memory is checked before prefill too.
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=8, progress=False))
    with pytest.raises(ValueError, match="repeat"):
        list(engine.generate(random_ids(6)[0], max_new_tokens=2, drafter=LongSpecDrafter(draft, ChainStrategy(2))))
    draft.vocab_ids[7] = VOCAB_SIZE
    with pytest.raises(ValueError, match=rf"must lie in \[0, {VOCAB_SIZE}\)"):
        draft.check_vocab_ids()


# ------------------------------------------------------------------------ seeding
def test_one_seed_gives_one_output_for_sampling_drafters():
    """The sampled chain draws from the stream derived from the request's seed:
    repeated seeded calls agree, and the verifier's stream is not shared (a different
    derived stream changes the draft, not the losslessness)."""
    from longspec.speculation.drafters.longspec import LongSpecDrafter, SampledChainStrategy
    from oracles import random_draft

    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=8, progress=False))
    prompt = random_ids(10, seed=3)[0]
    draft = random_draft(model)
    params = SamplingParams(temperature=1.0)

    def run(seed, global_seed):
        torch.manual_seed(global_seed)  # the global stream must not matter
        drafter = LongSpecDrafter(draft, SampledChainStrategy(4))
        out = engine.generate(prompt, params=params, max_new_tokens=40, drafter=drafter, generator=torch.Generator().manual_seed(seed))
        return torch.cat(list(out))

    first, again, other = run(1, global_seed=10), run(1, global_seed=11), run(2, global_seed=10)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_api_seed_reaches_the_drafter(tmp_path):
    from longspec.api import LongSpecModel
    from longspec.runtime.loading import LoadedTarget
    from longspec.speculation.drafters.longspec import save_draft
    from oracles import random_draft

    decoder = tiny_decoder("gemma3", dtype=torch.float64)
    path = save_draft(random_draft(decoder), tmp_path / "draft.safetensors")
    api = LongSpecModel(LoadedTarget(model=decoder, tokenizer=None, hf_config=None, source="tiny"), EngineOptions(max_tree_nodes=8, progress=False))
    prompt = random_ids(10, seed=3)[0]
    outputs = []
    for call in range(3):
        torch.manual_seed(call)
        result = api.generate(prompt, method="longspec-sampled", method_options={"checkpoint": path}, temperature=1.0,
                              seed=1, max_new_tokens=30, ignore_eos=True)
        outputs.append(result.token_ids)
    assert outputs[0] == outputs[1] == outputs[2]
