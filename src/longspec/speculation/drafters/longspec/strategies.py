"""How a draft's next-token distributions become a speculation tree.

A strategy sees the draft through one callable,

    expand(proposal, nodes) -> log-probs [len(nodes), V_d]

which runs the draft over tree nodes already added to the proposal (whose parents
were run before, or are the root) and returns their next-token log-probabilities
over the draft vocabulary. Strategies return a `Proposal`:
nodes in creation order (parents precede children), tokens as draft-vocabulary
indices, and for sampled strategies the distribution each node's children were
drawn from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from longspec.speculation.processors import sample

Expand = Callable[["Proposal", list[int]], torch.Tensor]


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)  # draft-vocab index per node (root excluded)
    parents: list[int] = field(default_factory=list)  # tree node index per node (0 = root)
    # Sampled strategies: probs[i] is q at tree node i (node 0 = root), draft vocab.
    probs: list[torch.Tensor] | None = None

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        return len(self.tokens)  # the new node's tree index


def _check_length(length: int) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"draft length must be an int >= 1, got {length!r}")
    return length


class ChainStrategy:
    """γ tokens, each the draft's argmax after the previous one."""

    def __init__(self, length: int = 5) -> None:
        self.length = _check_length(length)

    def build(self, expand: Expand, root_logprobs: torch.Tensor, budget: int, generator=None) -> Proposal:
        proposal = Proposal()
        logprobs = root_logprobs
        node = 0
        for depth in range(min(self.length, budget)):
            token = int(logprobs.argmax())
            node = proposal.add(token, node)
            if depth + 1 < min(self.length, budget):
                logprobs = expand(proposal, [node])[0]
        return proposal


class SampledChainStrategy:
    """γ tokens sampled from q = softmax(log-probs / temperature); the tree carries q
    so verification can apply speculative sampling (accept min(1, p/q), residuals)."""

    def __init__(self, length: int = 5, temperature: float = 1.0) -> None:
        self.length = _check_length(length)
        if not temperature > 0:
            raise ValueError(f"draft temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def build(self, expand: Expand, root_logprobs: torch.Tensor, budget: int, generator=None) -> Proposal:
        proposal = Proposal(probs=[])
        logprobs = root_logprobs
        node = 0
        steps = min(self.length, budget)
        for depth in range(steps):
            q = torch.softmax(logprobs.double() / self.temperature, dim=-1)
            proposal.probs.append(q)
            token = int(sample(q.unsqueeze(0), generator)[0])
            node = proposal.add(token, node)
            if depth + 1 < steps:
                logprobs = expand(proposal, [node])[0]
        return proposal


class CapeStrategy:
    """Confidence-Aware Proposal Expansion (GLIDE+CAPE): along the draft's greedy
    chain, each depth also proposes the next-best tokens as leaf alternatives, how
    many set by the top-1 probability's bin: ``bins`` is ((min_confidence, size), ...)
    in decreasing confidence; alternatives are not extended."""

    def __init__(self, length: int = 5, bins: Sequence[tuple[float, int]] = ((0.8, 1), (0.5, 2), (0.2, 3), (0.0, 4))) -> None:
        self.length = _check_length(length)
        bins = tuple((float(c), int(s)) for c, s in bins)
        if not bins or any(s < 1 for _, s in bins) or list(bins) != sorted(bins, reverse=True) or bins[-1][0] > 0:
            raise ValueError(f"bins must be (min_confidence, size >= 1) pairs in decreasing confidence ending at 0, got {bins}")
        self.bins = bins

    def expansion_size(self, confidence: float) -> int:
        return next(size for threshold, size in self.bins if confidence >= threshold)

    def build(self, expand: Expand, root_logprobs: torch.Tensor, budget: int, generator=None) -> Proposal:
        proposal = Proposal()
        logprobs = root_logprobs
        node = 0
        for depth in range(self.length):
            room = budget - len(proposal.tokens)
            if room <= 0:
                break
            size = min(self.expansion_size(float(logprobs.max().exp())), room)
            top = logprobs.topk(size).indices.tolist()
            parent = node
            node = proposal.add(top[0], parent)
            for alternative in top[1:]:
                proposal.add(alternative, parent)
            if depth + 1 < self.length and len(proposal.tokens) < budget:
                logprobs = expand(proposal, [node])[0]
        return proposal


class BeamStrategy:
    """LongSpec's dynamic beam tree: at depth d keep the `widths[d]` best nodes over
    (frontier node × draft vocabulary) by cumulative log-probability; branches that
    fall out of the top simply stop."""

    def __init__(self, widths: Sequence[int] = (4, 16, 16, 16, 16)) -> None:
        widths = tuple(int(w) for w in widths)
        if not widths or any(w < 1 for w in widths):
            raise ValueError(f"beam widths must be ints >= 1, got {widths}")
        self.widths = widths

    def build(self, expand: Expand, root_logprobs: torch.Tensor, budget: int, generator=None) -> Proposal:
        proposal = Proposal()
        frontier = [0]
        cumulative = torch.zeros(1, dtype=torch.float32, device=root_logprobs.device)
        logprobs = root_logprobs.unsqueeze(0)
        for depth, width in enumerate(self.widths):
            width = min(width, budget - len(proposal.tokens), logprobs.numel())
            if width <= 0:
                break
            scores = (cumulative.unsqueeze(1) + logprobs.float()).reshape(-1)
            best = scores.topk(width)
            vocab = logprobs.shape[1]
            rows, tokens = best.indices // vocab, best.indices % vocab
            frontier = [proposal.add(int(t), frontier[int(r)]) for r, t in zip(rows, tokens)]
            cumulative = best.values
            if depth + 1 < len(self.widths) and len(proposal.tokens) < budget:
                logprobs = expand(proposal, frontier)
        return proposal
