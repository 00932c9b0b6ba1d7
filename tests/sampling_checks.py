"""The chi-square check of sampling losslessness, shared by every test of a sampled
path: a tiny 4-token target (the module-scoped `model` fixture), the *exact*
distribution of its K-token continuations of PROMPT (enumerated with the target
itself), N speculative samples through the engine, and a goodness-of-fit p-value
to compare with ALPHA. Also the sampling parameters and the drafters (q unrelated
to the target, sampled chains and trees, deterministic candidates) those tests use.

Each check draws N sequences of K tokens over a 4-token vocabulary (64 cells) and
rejects at p < ALPHA, so a correct verifier fails a given check with probability
ALPHA (seeds are fixed, so a run is reproducible). Used by tests/test_engine_sampling.py
and the sampling tests of every drafter and engine.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.decode_round import node_histories
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams, processed_probs, sample
from longspec.speculation.tree import Tree
from tiny_models import tiny_decoder

VOCAB = 4
K = 3  # tokens per sampled sequence
N = 3000
ALPHA = 1e-3
PROMPT = torch.tensor([1, 3, 0, 2, 1])


@pytest.fixture(scope="module")
def model():
    # Larger init so the 4-way distributions are far from uniform and differ by context.
    return tiny_decoder("qwen3", dtype=torch.float64, vocab_size=VOCAB, seed=7, initializer_range=0.5)


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1..xK | prompt) by enumerating every sequence with fresh forwards."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=K):
        total = 1.0
        for t in range(K):
            ids = torch.cat([PROMPT, torch.tensor(seq[:t], dtype=torch.long)])
            cache = model.new_cache(ids.numel() + 1)
            logits = model(ids.unsqueeze(0), cache, logits_rows=slice(-1, None)).logits[0]
            root_only = Tree.chain(int(ids[-1]), [])
            hist = node_histories(ids, root_only, params.penalty_window) if params.uses_history else None
            total *= float(processed_probs(logits, hist, params)[0, seq[t]])
        probs[seq] = total
    return probs


# Seed 1 since draws became inverse-CDF (`processors.sample`): that changed every random
# stream, and with seed 0 the top-k deterministic-tree case fell in the 1e-3 tail
# (p = 0.0006); over 28 seeds of that case, the other 27 gave p from 0.003 to 0.90.
def empirical_counts(model, params, drafter_factory, seed=1) -> dict[tuple[int, ...], int]:
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=32, progress=False))
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N):
        drafter = drafter_factory(generator) if drafter_factory else None
        out = torch.cat(list(engine.generate(PROMPT, params=params, max_new_tokens=K, drafter=drafter, generator=generator)))
        key = tuple(out.tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


def goodness_of_fit(exact, counts) -> float:
    cells = sorted(exact)
    expected = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    expected = expected / expected.sum() * N
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    assert sum(counts.values()) == N and set(counts) <= set(cells)
    impossible = expected == 0  # removed by top-p: must never be sampled
    assert observed[impossible].sum() == 0
    expected, observed = expected[~impossible], observed[~impossible]
    # Pool cells expected under 5 draws so the chi-square approximation holds.
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


# ----------------------------------------------------------------------- drafters
class FixedQ(Drafter):
    """A drafter distribution unrelated to the target: fixed per depth."""

    def __init__(self, generator):
        self.table = torch.softmax(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 1.5, -1)
        self.generator = generator

    def q(self, depth):
        return self.table[depth % 8]


class SampledChainDrafter(FixedQ):
    """Chain of 3 tokens sampled from q (speculative sampling with residuals)."""

    def begin(self, context):
        pass

    def observe(self, committed):
        pass

    def propose(self, context: DraftContext) -> Tree:
        qs = torch.stack([self.q(d) for d in range(4)])
        tokens = [int(sample(qs[d : d + 1], self.generator)[0]) for d in range(3)]
        return Tree.chain(context.root, tokens, draft_probs=qs, children_sampled=True)


class SampledTreeDrafter(FixedQ):
    """Two i.i.d. children from q at every node, depth 2 (multi-draft rejection)."""

    def begin(self, context):
        pass

    def observe(self, committed):
        pass

    def propose(self, context: DraftContext) -> Tree:
        tokens, parents, depths = [context.root], [-1], [0]
        frontier = [0]
        for depth in range(2):
            nxt = []
            for node in frontier:
                for x in sample(self.q(depth).expand(2, VOCAB).contiguous(), self.generator).tolist():
                    tokens.append(x)
                    parents.append(node)
                    depths.append(depth + 1)
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        q = torch.stack([self.q(d) for d in depths])
        return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), draft_probs=q, children_sampled=True)


class CartesianDrafter(Drafter):
    """Deterministic candidates: tokens {0, 1} at each of 3 depths (+ an extra chain)."""

    def __init__(self, generator=None):
        pass

    def begin(self, context):
        pass

    def observe(self, committed):
        pass

    def propose(self, context: DraftContext) -> Tree:
        tree = Tree.cartesian(context.root, [torch.tensor([0, 1])] * 3)
        return tree.with_chains([torch.tensor([2, 2, 3])])


SAMPLING = SamplingParams(temperature=1.3, top_p=0.97)
PENALIZED = SamplingParams(temperature=1.0, penalty=2.5, penalty_window=3)
