"""The drafter protocol: what the engine asks of every drafter.

A drafter proposes a `Tree` rooted at the current root token and is told which
tokens were committed. It may read the target through the read-only `DraftContext`
the engine hands it, and owns only bounded state of its own. Drafters may also
offer ``check_target(config)``, which the engine calls before any work (prefill) so
that weights that do not fit the target fail first, naming the mismatch; and
``state_nbytes() -> int``, the bytes of their per-sequence state (caches, rings,
indexes; not weights), which benchmarks report beside the target's cache; and
``prefill_hidden_rows`` (an int), how many of the prompt's last final hidden states
the engine keeps from prefill for them (`TargetView.prefill_hidden`); and
``runs_model = True`` when each proposal runs a neural network (a draft model), so
that a controller composing drafters (`auto`) treats it as costly before it has
measured it; and ``widen(context, nodes) -> Tree``, the tree of the last
``propose`` grown toward ``nodes`` speculative nodes, which the batched engine asks
for (with ``BatchOptions.fill_padding``) when another row's tree is wider (its padding
slots turned into speculation); and ``sizes_tree_from_cost = True`` when it sizes its
trees from the measured forward cost at the batch's width itself (`auto`), so that the
batched engine's joint budget leaves its trees whole; and ``learn()``, work that can
wait for the target (updating statistics from the last rounds' verdicts): an engine that
says so in `DraftContext.learns_while_verifying` calls it each round after queuing the
verification forward and before reading its result, where a GPU computes meanwhile; and
``plain_rounds() -> int``, how many coming rounds it would propose nothing in whatever
they commit (speculation switched off): the engines then run them as plain decoding,
without `propose` and `observe`, and afterwards call `observe` once with their tokens
(`TargetView.last_hidden` holding the states of all their roots; `plain_rounds.py`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from longspec.speculation.tree import Tree


@dataclass(frozen=True)
class DraftContext:
    """Read-only view handed to drafters each round.

    tokens: every committed token so far (prompt + output), 1-D int64; the last one
        is the root of the next tree (its K/V is not yet in the target cache).
    target: read-only view of the target model and cache (drafters that cross-attend
        the target's K/V use it; n-gram drafters ignore it).
    max_nodes: the most speculative nodes (root excluded) the engine will verify.
        In `begin`, the most any round of the sequence may ask for (a batch's cap
        loosens as rows leave): what buffers sized by the tree must hold.
    generator: the random stream a drafter that samples must draw from. The engine
        derives it from the request's seed, apart from the verifier's stream, so one
        seed gives one output for every method (None: the global torch stream).
    rows_in_forward: how many sequences share the verification forward (a batch);
        a drafter that sizes its tree from cost sees that its nodes are verified
        beside the other rows' nodes.
    learns_while_verifying: the engine calls the drafter's ``learn()`` each round while
        the verification forward runs (a device that computes asynchronously), so
        work that can wait may be left to it: it then overlaps the forward, and the
        next ``propose`` sees statistics one round older.
    """

    tokens: torch.Tensor
    target: Any = None
    max_nodes: int = 64
    generator: torch.Generator | None = None
    rows_in_forward: int = 1
    learns_while_verifying: bool = False

    @property
    def root(self) -> int:
        return int(self.tokens[-1])


@runtime_checkable
class Drafter(Protocol):
    def begin(self, context: DraftContext) -> None:
        """Start a new sequence (called once after prefill)."""

    def propose(self, context: DraftContext) -> Tree:
        """A tree rooted at ``context.root`` (a root-only tree proposes nothing)."""

    def observe(self, committed: torch.Tensor) -> None:
        """The tokens appended to the sequence this round (accepted nodes, then the bonus)."""


def container_nbytes(root: object) -> int:
    """Bytes held by a structure of dicts, lists, tuples and ints (an n-gram index),
    each distinct object counted once. Small ints are interpreter-cached, so this is
    an upper bound of what the structure adds; it is for reporting, not the hot path."""
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


class TargetView:
    """Read-only access to the target for drafters: its config, its embedding/head
    weights, and the committed part of its KV cache (never the pending tokens)."""

    def __init__(self, model, cache) -> None:
        self._model = model
        self._cache = cache
        # Final-norm hidden states [a + 1, H] of the last verification's accepted
        # path (root first), for drafters that read the target's features.
        self.last_hidden: torch.Tensor | None = None
        # Final-norm hidden states [c, H] of the last c prefilled prompt tokens (positions
        # committed_length - c .. committed_length - 1 after prefill), c being what the
        # drafter asked for with `prefill_hidden_rows`; None when it asked for none.
        self.prefill_hidden: torch.Tensor | None = None

    @property
    def model(self):
        """The target decoder, for self-drafting with a cache of the drafter's own.
        Never pass it the engine's cache."""
        return self._model

    @property
    def config(self):
        return self._model.config

    @property
    def device(self) -> torch.device:
        """Where the target computes: a drafter's weights and tensor state belong here."""
        return self._model.device

    @property
    def committed_length(self) -> int:
        return self._cache.length

    @property
    def embedding(self) -> torch.Tensor:
        return self._model.embed_weight

    @property
    def head(self) -> torch.Tensor:
        return self._model.head_weight

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed K/V [B, Hkv, length, D] of a full-attention layer, as views."""
        if self._model.config.layer_is_sliding[layer]:
            raise ValueError(f"layer {layer} is a sliding-window layer; its ring holds only a window")
        return self._cache.prefix(layer)
