"""High-power test of multi-draft recursive rejection (SpecInfer), at the verifier.

A synthetic target over 4 tokens gives a context-dependent distribution p, with
exact zeros in some contexts. At every tree node 3 children are drawn i.i.d. from an
adversarial, context-dependent draft distribution q: zeros where p > 0, mass where
p = 0, q == p, and q concentrated on one token so duplicate siblings are common.
One verification of a depth-2 tree emits 1-3 tokens; the sequence is completed to
3 tokens by plain draws from p, and the distribution of >= 1e5 such sequences is
compared with the exact one (64 cells) by a chi-square test.

The same test rejects three plausible broken verifiers, implemented below: the
residual taken from the original p instead of recursively; later siblings tested
against the original p; duplicate siblings skipped without the residual update.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from longspec.speculation import verification
from longspec.speculation.processors import SamplingParams, sample
from longspec.speculation.tree import Tree
from longspec.speculation.verification import Verdict, verify

VOCAB = 4
LENGTH = 3  # tokens per compared sequence
SIBLINGS = 3  # i.i.d. children per node
N = 100_000
# The broken verifiers are off by far more than the correct one could be: a fifth of
# the draws already gives p-values below 1e-60, and keeps the suite fast.
N_BROKEN = 20_000
ALPHA = 1e-3
PARAMS = SamplingParams(temperature=1.0)


def target_logits(context: tuple[int, ...]) -> torch.Tensor:
    """Context-dependent logits; one token impossible (p = 0) in some contexts."""
    code = sum(token * VOCAB**i for i, token in enumerate(context)) + VOCAB ** len(context)
    generator = torch.Generator().manual_seed(code)
    logits = torch.randn(VOCAB, generator=generator, dtype=torch.float64) * 1.2
    if code % 2 == 0:
        logits[code % VOCAB] = float("-inf")
    return logits


def target_probs(context: tuple[int, ...]) -> torch.Tensor:
    return torch.softmax(target_logits(context), dim=-1)


def draft_probs(context: tuple[int, ...]) -> torch.Tensor:
    """Adversarial q by context. At the root (visited every round) most of q sits on
    the least likely token: it is drawn twice or more in most rounds and usually
    rejected, and the rest of q is spread so that residuals stay positive after a
    rejection (the recursion matters). Below the root, one kind per first token."""
    p = target_probs(context)
    kind = "skewed" if not context else ("zero-where-p", "equal", "concentrated", "random")[context[0]]
    if kind == "skewed":
        q = torch.full((VOCAB,), 0.4 / (VOCAB - 1), dtype=torch.float64)
        q[int(torch.argmin(p))] = 0.6
        return q
    if kind == "zero-where-p":  # zero where p is largest, all mass on the least likely tokens
        q = torch.zeros(VOCAB, dtype=torch.float64)
        q[torch.argsort(p)[:2]] = torch.tensor([0.7, 0.3], dtype=torch.float64)
        return q
    if kind == "equal":
        return p.clone()
    if kind == "concentrated":
        q = torch.full((VOCAB,), 0.02, dtype=torch.float64)
        q[int(torch.argsort(p)[1])] = 1 - 0.02 * (VOCAB - 1)
        return q
    generator = torch.Generator().manual_seed(50 + sum(context))
    return torch.softmax(torch.randn(VOCAB, generator=generator, dtype=torch.float64) * 2, dim=-1)


CONTEXTS = [c for depth in range(LENGTH) for c in itertools.product(range(VOCAB), repeat=depth)]
P = {c: target_probs(c) for c in CONTEXTS}
LOGITS = {c: target_logits(c) for c in CONTEXTS}
Q = {c: draft_probs(c) for c in CONTEXTS}


def exact_distribution() -> dict[tuple[int, ...], float]:
    return {
        seq: float(torch.prod(torch.stack([P[seq[:t]][seq[t]] for t in range(LENGTH)])))
        for seq in itertools.product(range(VOCAB), repeat=LENGTH)
    }


# Every round's tree has the same shape: SIBLINGS children at the root and at each child.
PARENTS = torch.tensor([-1] + [0] * SIBLINGS + [c for c in range(1, SIBLINGS + 1) for _ in range(SIBLINGS)])
DEPTHS = torch.tensor([0] + [1] * SIBLINGS + [2] * SIBLINGS**2)


def sampled_tree(generator: torch.Generator) -> tuple[Tree, torch.Tensor]:
    """A depth-2 tree: SIBLINGS children from q at the root and at each child."""
    tokens, contexts = [0], [()]
    for x in torch.multinomial(Q[()], SIBLINGS, replacement=True, generator=generator).tolist():
        tokens.append(x)
        contexts.append((x,))
    for child in range(1, SIBLINGS + 1):
        context = contexts[child]
        for y in torch.multinomial(Q[context], SIBLINGS, replacement=True, generator=generator).tolist():
            tokens.append(y)
            contexts.append(context + (y,))
    probs = torch.stack([Q[c] for c in contexts])
    logits = torch.stack([LOGITS[c] for c in contexts])
    tree = Tree(torch.tensor(tokens), PARENTS, DEPTHS, draft_probs=probs, children_sampled=True)
    return tree, logits


def sequence_counts(n: int, seed: int = 0) -> dict[tuple[int, ...], int]:
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        tree, logits = sampled_tree(generator)
        verdict = verify(tree, logits, None, PARAMS, generator)
        seq = tuple(tree.tokens[verdict.path[1:]].tolist()) + (verdict.bonus,)
        while len(seq) < LENGTH:  # complete with plain draws from p: exact by construction
            seq += (int(torch.multinomial(P[seq], 1, generator=generator)),)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def p_value(counts) -> float:
    exact = exact_distribution()
    cells = sorted(exact)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    expected = torch.tensor([exact[c] for c in cells], dtype=torch.float64) * observed.sum()
    assert observed[expected == 0].sum() == 0, "a sequence of probability 0 was emitted"
    keep = expected > 0
    assert float(expected[keep].min()) >= 5  # the chi-square approximation holds in every cell
    return float(chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue)


def test_adversarial_q_covers_every_case():
    kinds = {"zero where p > 0": False, "mass where p = 0": False, "q == p": False, "duplicates likely": False}
    for c in CONTEXTS:
        p, q = P[c], Q[c]
        kinds["zero where p > 0"] |= bool(((q == 0) & (p > 0)).any())
        kinds["mass where p = 0"] |= bool(((q > 0) & (p == 0)).any())
        kinds["q == p"] |= bool(torch.equal(p, q))
        kinds["duplicates likely"] |= float((q**2).sum()) > 0.8
    assert all(kinds.values()), kinds


def test_recursive_rejection_matches_the_exact_distribution():
    assert p_value(sequence_counts(N)) > ALPHA


# ------------------------------------------------------------ broken verifiers
def _broken(residual_from_original: bool = False, test_against_original: bool = False, skip_duplicates: bool = False):
    def verify_children(tree, logits, histories, params, generator) -> Verdict:
        node, path = 0, [0]
        while True:
            p = verification._node_probs(logits, histories, params, node)
            original = p
            children = tree.children(node)
            if children.numel() == 0:
                return Verdict(torch.tensor(path), int(sample(p.unsqueeze(0), generator)[0]))
            q = tree.draft_probs[node].to(p.dtype)
            accepted, rejected = None, set()
            for child in children.tolist():
                x = int(tree.tokens[child])
                if skip_duplicates and x in rejected:
                    continue
                u = float(torch.rand((), generator=generator, dtype=torch.float64))
                against = original if test_against_original else p
                if q[x] > 0 and u * float(q[x]) < float(against[x]):
                    accepted = child
                    break
                rejected.add(x)
                residual = ((original if residual_from_original else p) - q).clamp(min=0)
                if residual.sum() > 0:
                    p = residual / residual.sum()
            if accepted is None:
                return Verdict(torch.tensor(path), int(sample(p.unsqueeze(0), generator)[0]))
            node = accepted
            path.append(node)

    return verify_children


@pytest.mark.parametrize(
    "broken",
    [_broken(residual_from_original=True), _broken(test_against_original=True), _broken(skip_duplicates=True)],
    ids=["residual-not-recursive", "siblings-against-original-p", "duplicates-skipped-without-residual"],
)
def test_broken_verifiers_are_rejected(monkeypatch, broken):
    monkeypatch.setattr(verification, "verify_sampled_children", broken)
    assert p_value(sequence_counts(N_BROKEN)) < ALPHA
