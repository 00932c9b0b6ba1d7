"""Lossless verification of a speculation tree against one target forward.

`logits[i]` is the target's prediction for the token that follows node i (node 0 is
the root). `histories[i]` is node i's own token history (committed tokens, then the
tree tokens on the path from the root to i), so history-dependent processors such
as the contextual penalty see exactly what autoregressive decoding would see.

Rules (see docs/design.md#verification-precisely):
* greedy: accept the deepest node all of whose path matches the target's argmax;
* deterministic candidates (top-k, beams, n-grams), sampling: at each visited node
  draw ONE token y ~ p; move to a child carrying y, else y is the bonus;
* children sampled from q (a chain with q is the one-child case): multi-draft
  recursive rejection — try children in order, accept c with prob min(1, p(c)/q(c)),
  else p <- norm(max(p - q, 0)); if all are rejected the bonus is drawn from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longspec.runtime.device import HOST
from longspec.speculation.certified_sampling import certified_draw, certified_sampling_applies
from longspec.speculation.processors import NodeHistories, SamplingParams, greedy_tokens, processed_probs, sample
from longspec.speculation.tree import Tree


class NodeScores:
    """The target's prediction at each node of one tree, computed only as far as the
    verifier asks: the logits (the full head, once), each node's argmax, and draws
    from each node's processed distribution. Where the model has a certified head
    (`runtime/certified_head.py`), argmaxes and draws come from its screen and the exact
    recomputation of a few rows, without the full head."""

    def __init__(self, logits: torch.Tensor | None = None, *, model=None, hidden: torch.Tensor | None = None,
                 argmax: torch.Tensor | None = None, screen=None, screen_offset: int = 0) -> None:
        if logits is None and (model is None or hidden is None):
            raise ValueError("NodeScores needs logits, or the model and the hidden states to compute them")
        self._logits, self._model, self._hidden, self._argmax = logits, model, hidden, argmax
        # The certified head's screen of the nodes (rows from `screen_offset` on), for draws.
        self._screen, self._screen_offset = screen, screen_offset

    @property
    def logits(self) -> torch.Tensor:
        """[n, V]: the plain head over every node (computed once, on first use)."""
        if self._logits is None:
            self._logits = self._model.logits(self._hidden)
        return self._logits

    def logits_of(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), V]: the plain head over some nodes (the full head of those rows
        alone, unless the whole tree's logits are already computed)."""
        if self._logits is None:
            return self._model.logits(self._hidden[rows.to(self._hidden.device)])
        return self._logits[rows.to(self._logits.device)]

    def allowed_argmax(self, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor | None:
        """[len(rows)] int64: the first index of the largest plain logit among each row's
        `allowed` tokens ([len(rows), V] bool), through the certified head's screen; None
        where there is none (the caller masks the full logits)."""
        head = self._model.certified_head if self._model is not None and self._logits is None else None
        if head is None:
            return None
        return head.argmax(self._hidden[rows.to(self._hidden.device)], self._model.logits, allowed=allowed)

    def argmax(self) -> torch.Tensor:
        """[n] int64: the first index of each node's largest plain logit."""
        if self._argmax is None:
            if self._logits is None and self._model is not None:
                self._argmax = self._model.decide(self._hidden)
            else:
                self._argmax = greedy_tokens(self.logits, None, SamplingParams())
        return self._argmax

    def draw(self, node: int, histories: torch.Tensor | None, params: SamplingParams,
             generator: torch.Generator | None) -> int:
        """One token from node `node`'s processed distribution."""
        head = self._model.certified_head if self._model is not None and self._logits is None else None
        if head is not None and head.draws and certified_sampling_applies(params):
            if self._screen is None:  # every node in one screen
                self._screen, self._screen_offset = head.screen(self._hidden), 0
            token = certified_draw(self._screen, self._screen_offset + node, self._hidden[node], params, generator,
                                   full_logits=lambda: self._model.logits(self._hidden[node : node + 1])[0])
            if token is not None:
                return token
        history = node_history(histories, node)
        probs = processed_probs(self.logits[node : node + 1], history, params)
        return int(sample(probs, generator)[0])


@dataclass(frozen=True)
class Verdict:
    path: torch.Tensor  # accepted node indices from the root (node 0) on
    bonus: int  # the token the target contributes after the last accepted node

    @property
    def accepted_tokens(self) -> int:
        """Speculative tokens accepted (root excluded)."""
        return self.path.numel() - 1

    def path_rows(self, values: torch.Tensor) -> torch.Tensor:
        """The rows of `values` (one per tree node, on any device) along the accepted
        path. A path that is the tree's first nodes (any chain's; node indices grow
        along a path) is a slice: no index copied to the device."""
        n = self.path.numel()
        if int(self.path[-1]) == n - 1:
            return values[:n]
        return values[self.path.to(values.device)]


def verify(
    tree: Tree,
    scores: NodeScores | torch.Tensor,
    histories: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    """`scores`: the target's logits at every node, or a `NodeScores` that computes only
    what the rules need (greedy without a penalty: the argmax alone)."""
    if not isinstance(scores, NodeScores):
        scores = NodeScores(scores)
    if params.is_greedy:
        return verify_greedy(tree, scores, histories, params)
    if tree.children_sampled:
        return verify_sampled_children(tree, scores.logits, histories, params, generator)
    return verify_deterministic_candidates(tree, scores, histories, params, generator)


def node_history(histories, node: int):
    """Node `node`'s row of the histories (a NodeHistories or a recent-history tensor)."""
    if histories is None:
        return None
    if isinstance(histories, NodeHistories):
        return histories.rows(node, node + 1)
    return histories[node : node + 1]


def needs_argmax_only(params: SamplingParams) -> bool:
    """Whether verification under `params` reads each node's argmax and nothing else (a
    grammar's mask then recomputes only the nodes whose argmax it forbids)."""
    return params.is_greedy and not (params.uses_history or params.counts_outputs or params.logit_bias)


def certified_head_serves(params: SamplingParams, tree: Tree) -> bool:
    """Whether verifying `tree` under `params` can go through a certified head: greedy
    decisions, or draws at nodes whose children are deterministic candidates (sampled
    children need p and the residuals over the whole vocabulary)."""
    return needs_argmax_only(params) or (certified_sampling_applies(params) and not tree.children_sampled)


def verify_greedy(tree: Tree, scores: NodeScores, histories, params) -> Verdict:
    if needs_argmax_only(params):
        targets = scores.argmax().to(HOST)  # the round's one copy back
        if params.constrained:
            targets = _allowed_targets(targets, scores, histories, params)
    else:
        targets = greedy_tokens(scores.logits, histories, params).to(HOST)
    if tree.size == 1:
        return Verdict(torch.zeros(1, dtype=torch.long, device=HOST), int(targets[0]))
    if tree.is_chain():  # the same rule, as the first node that misses its parent's target
        return _verify_greedy_chain(tree, targets)
    matches = tree.tokens == targets[tree.parents.clamp(min=0)]
    matches[0] = True
    # A node is accepted when it and all its ancestors match.
    accepted = ~(tree.ancestor_mask() & ~matches.unsqueeze(0)).any(dim=1)
    score = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1))
    deepest = int(torch.argmax(score))  # first (lowest index) among the deepest
    return Verdict(tree.path_to(deepest), int(targets[deepest]))


def _verify_greedy_chain(tree: Tree, targets: torch.Tensor) -> Verdict:
    """Greedy verification of a chain: its nodes are accepted up to the first whose token
    is not its parent's target (NumPy on the host: a round's few nodes cost a fraction of
    PyTorch's per-operation overhead)."""
    target = targets.numpy()
    misses = np.flatnonzero(tree.tokens.numpy()[1:] != target[:-1])
    deepest = int(misses[0]) if misses.size else tree.size - 1
    return Verdict(torch.arange(deepest + 1, device=HOST), int(target[deepest]))


def _allowed_targets(targets: torch.Tensor, scores: NodeScores, histories: NodeHistories,
                     params: SamplingParams) -> torch.Tensor:
    """Each node's argmax under its grammar mask. Where the mask allows the plain argmax
    (the first largest logit) it is the masked one too; for the other nodes the certified
    head's screen, with the forbidden rows out, finds the largest allowed logit (else the
    full logits are computed and masked)."""
    allowed = histories.allowed.to(HOST)
    rows = torch.arange(targets.numel(), device=HOST)
    forbidden = torch.nonzero(~allowed[rows, targets]).flatten()
    if not forbidden.numel():
        return targets
    targets = targets.clone()
    screened = scores.allowed_argmax(forbidden, allowed[forbidden])
    if screened is not None:
        targets[forbidden] = screened.to(HOST)
    else:
        targets[forbidden] = greedy_tokens(scores.logits_of(forbidden), histories.select(forbidden), params).to(HOST)
    return targets


def verify_deterministic_candidates(tree: Tree, scores: NodeScores, histories, params, generator) -> Verdict:
    node = 0
    path = [0]
    while True:
        y = scores.draw(node, histories, params, generator)
        children = tree.children(node)
        carrying = children[tree.tokens[children] == y]
        if carrying.numel() == 0:
            return Verdict(torch.tensor(path, dtype=torch.long, device=HOST), y)
        # Siblings with equal tokens spell the same text; take the first.
        node = int(carrying[0])
        path.append(node)


def verify_sampled_children(tree: Tree, logits, histories, params, generator) -> Verdict:
    node = 0
    path = [0]
    while True:
        p = _node_probs(logits, histories, params, node)
        children = tree.children(node)
        if children.numel() == 0:
            return Verdict(torch.tensor(path, dtype=torch.long, device=HOST), int(sample(p.unsqueeze(0), generator)[0]))
        q = tree.draft_probs[node].to(device=p.device, dtype=p.dtype)
        draw_device = generator.device if generator is not None else p.device
        accepted = None
        for child in children.tolist():
            x = int(tree.tokens[child])
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=draw_device))
            if q[x] > 0 and u * float(q[x]) < float(p[x]):  # u < min(1, p/q) without dividing
                accepted = child
                break
            residual = (p - q).clamp_(min=0)
            total = residual.sum()
            if total > 0:  # p == q leaves no residual, and then x could not have been rejected
                p = residual / total
        if accepted is None:
            return Verdict(torch.tensor(path, dtype=torch.long, device=HOST), int(sample(p.unsqueeze(0), generator)[0]))
        node = accepted
        path.append(node)


def _node_probs(logits, histories, params, node: int) -> torch.Tensor:
    history = node_history(histories, node)
    return processed_probs(logits[node : node + 1], history, params)[0]
