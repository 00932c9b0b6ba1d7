"""Sampling losslessness: the distribution of speculative samples equals the
autoregressive one, for every verifier, checked by a chi-square goodness-of-fit
test against the *exact* AR distribution (enumerated with the target itself).

Each test draws N sequences of K tokens over a 4-token vocabulary (64 cells) and
rejects at p < ALPHA, so a correct verifier fails a given test with probability
ALPHA (seeds are fixed, so a run is reproducible). A deliberately broken verifier —
TokenSwift's published per-path sampling — must be rejected by the same test.
"""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.native import native_ops
from longspec.speculation import processors, verification
from longspec.speculation.processors import SamplingParams, sample
from longspec.speculation.verification import Verdict
from sampling_checks import (
    ALPHA,
    PENALIZED,
    SAMPLING,
    VOCAB,
    CartesianDrafter,
    SampledChainDrafter,
    SampledTreeDrafter,
    empirical_counts,
    exact_distribution,
    goodness_of_fit,
    model,  # noqa: F401 - pytest fixture
)
from tiny_models import tiny_decoder


def per_path_sampling(tree, scores, histories, params, generator) -> Verdict:
    """The published TokenSwift bug: one independent draw sequence per root-to-leaf
    path, keeping the longest accepted path. It over-accepts tree tokens."""
    logits = scores.logits
    leaves = [i for i in range(tree.size) if tree.children(i).numel() == 0]
    best = None
    for leaf in leaves:
        path = tree.path_to(leaf).tolist()
        accepted = [0]
        bonus = None
        for node, child in zip(path, path[1:] + [None]):
            p = verification._node_probs(logits, histories, params, node)
            y = int(sample(p.unsqueeze(0), generator)[0])
            if child is not None and int(tree.tokens[child]) == y:
                accepted.append(child)
            else:
                bonus = y
                break
        if best is None or len(accepted) > len(best[0]):
            best = (accepted, bonus)
    return Verdict(torch.tensor(best[0]), best[1])


TOP_K = SamplingParams(temperature=1.1, top_k=3)  # p = 0 on one token per context: q keeps mass there
ETA = SamplingParams(temperature=2.0, eta=0.05)  # 13 of 64 sequences survive the cut


@pytest.mark.parametrize(
    "params,drafter",
    [
        (SAMPLING, None),
        (SAMPLING, SampledChainDrafter),
        (SAMPLING, SampledTreeDrafter),
        (SAMPLING, CartesianDrafter),
        (PENALIZED, CartesianDrafter),
        (PENALIZED, SampledChainDrafter),
        (TOP_K, SampledTreeDrafter),
        (TOP_K, CartesianDrafter),
        (ETA, SampledChainDrafter),
        (ETA, CartesianDrafter),
    ],
    ids=["ar", "chain-q", "sampled-tree", "deterministic-tree", "penalty-deterministic-tree", "penalty-chain-q",
         "top-k-sampled-tree", "top-k-deterministic-tree", "eta-chain-q", "eta-deterministic-tree"],
)
def test_sampled_sequences_follow_the_target_distribution(model, params, drafter):  # noqa: F811
    exact = exact_distribution(model, params)
    counts = empirical_counts(model, params, drafter)
    assert goodness_of_fit(exact, counts) > ALPHA


def test_per_path_sampling_is_detected(model, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verification, "verify_deterministic_candidates", per_path_sampling)
    exact = exact_distribution(model, SAMPLING)
    counts = empirical_counts(model, SAMPLING, CartesianDrafter)
    assert goodness_of_fit(exact, counts) < ALPHA


def no_residual_chain(tree, logits, histories, params, generator) -> Verdict:
    """The published LongSpec chain bug: on rejection, resample from p instead of
    norm(max(p - q, 0))."""
    node, path = 0, [0]
    while True:
        p = verification._node_probs(logits, histories, params, node)
        children = tree.children(node)
        if children.numel() == 0:
            return Verdict(torch.tensor(path), int(sample(p.unsqueeze(0), generator)[0]))
        child = int(children[0])
        x = int(tree.tokens[child])
        q = tree.draft_probs[node]
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q[x]) >= float(p[x]):
            return Verdict(torch.tensor(path), int(sample(p.unsqueeze(0), generator)[0]))
        node = child
        path.append(node)


def test_chain_without_residual_resampling_is_detected(model, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verification, "verify_sampled_children", no_residual_chain)
    exact = exact_distribution(model, SAMPLING)
    counts = empirical_counts(model, SAMPLING, SampledChainDrafter)
    assert goodness_of_fit(exact, counts) < ALPHA


# Top-p and min-p cut 57 of the 64 sequences; 7 keep 0.59 down to 0.02 of the mass.
TRUNCATED = SamplingParams(temperature=1.5, top_p=0.9, min_p=0.1)


@pytest.fixture(scope="module")
def model32():
    return tiny_decoder("qwen3", dtype=torch.float32, vocab_size=VOCAB, seed=7, initializer_range=0.5)


@pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable here (reason logged)")
@pytest.mark.parametrize("drafter", [None, SampledChainDrafter, CartesianDrafter],
                         ids=["ar", "chain-q", "deterministic-tree"])
def test_native_truncated_sampling_follows_the_target_distribution(model32, drafter):
    """float32 logits take the native top-p/min-p kernel and draw (float64, above, the
    PyTorch path): the verifiers stay lossless over the distribution it defines."""
    assert processors._native_truncation(torch.zeros(1, VOCAB), TRUNCATED) is not None
    exact = exact_distribution(model32, TRUNCATED)
    assert sum(p == 0 for p in exact.values()) > 0  # the cuts remove sequences
    counts = empirical_counts(model32, TRUNCATED, drafter)
    assert goodness_of_fit(exact, counts) > ALPHA
