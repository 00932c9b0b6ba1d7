"""The drafter contract: what the engine asks of every drafter, and what a drafter
may offer beyond it.

A drafter proposes a `Tree` rooted at the current root token and is told which tokens
were committed. It reads the target only through the read-only `DraftContext` the
engine hands it, and owns bounded state of its own. Every drafter subclasses
`Drafter`: three methods are required (`begin`, `propose`, `observe`); the optional
capabilities are methods and class attributes with neutral defaults, so the engines
call them on every drafter alike. docs/design.md#the-drafter-contract says when each
is called, and docs/design.md#adding-a-drafter how to write a new drafter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from longspec.speculation.tree import Tree

if TYPE_CHECKING:  # types only: the drafters' view of the runtime
    from longspec.runtime.attention import AttentionBackend
    from longspec.runtime.batch_cache import CacheRow
    from longspec.runtime.cache import KVCache
    from longspec.runtime.config import DecoderConfig
    from longspec.runtime.linear import PackedWeight
    from longspec.runtime.model import Decoder
    from longspec.speculation.cost_model import ForwardCost


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
    sampled: the request draws its tokens (temperature > 0) rather than taking the
        argmax. A drafted token is accepted far less often then (the draw must land on
        it), which a drafter that sizes its trees from acceptance starts from.
    """

    tokens: torch.Tensor
    target: TargetView | None = None
    max_nodes: int = 64
    generator: torch.Generator | None = None
    rows_in_forward: int = 1
    learns_while_verifying: bool = False
    sampled: bool = False

    @property
    def root(self) -> int:
        return int(self.tokens[-1])


class Drafter(ABC):
    """Proposes trees for one sequence at a time (a fresh drafter per request)."""

    # Each proposal runs a neural network (a draft model): a controller composing
    # drafters (`auto`) treats it as costly before it has measured it.
    runs_model: ClassVar[bool] = False
    # It sizes its trees from the measured forward cost at the batch's width itself
    # (`auto`): the batched engine's joint budget then leaves its trees whole.
    sizes_tree_from_cost: ClassVar[bool] = False
    # How many of the prompt's last final hidden states the engine keeps from prefill
    # for it (`TargetView.prefill_hidden`); a drafter may set it per instance.
    prefill_hidden_rows: int = 0

    @abstractmethod
    def begin(self, context: DraftContext) -> None:
        """Start a new sequence (called once, after prefill)."""

    @abstractmethod
    def propose(self, context: DraftContext) -> Tree:
        """A tree rooted at ``context.root`` (a root-only tree proposes nothing)."""

    @abstractmethod
    def observe(self, committed: torch.Tensor) -> None:
        """The tokens appended to the sequence (accepted nodes, then the bonus)."""

    def check_target(self, config) -> None:
        """Raise, naming the mismatch, when this drafter cannot serve a target of
        `config`; the engines call it before any work (prefill)."""

    def state_nbytes(self) -> int:
        """Bytes of its per-sequence state (caches, rings, indexes; not weights), which
        benchmarks report beside the target's cache."""
        return 0

    def widen(self, context: DraftContext, nodes: int) -> Tree | None:
        """The tree of the last `propose` grown toward `nodes` speculative nodes, or None
        when it cannot grow. The batched engine asks (with `BatchOptions.fill_padding`)
        when another row's tree is wider, turning padding slots into speculation."""
        return None

    def learn(self) -> None:
        """Work that can wait for the target (statistics from the last verdicts). An
        engine that says so in `DraftContext.learns_while_verifying` calls it each round
        after queuing the verification forward and before reading its result."""

    def plain_rounds(self) -> int:
        """How many coming rounds it would propose nothing in, whatever they commit
        (speculation switched off): the engines run them as plain decoding, without
        `propose` and `observe`, then call `observe` once with all their tokens
        (`TargetView.last_hidden` holding the states of all their roots)."""
        return 0

    def telemetry(self) -> dict | None:
        """Its own account of the sequence so far (a controller's), copied into the
        generation's stats after each round it was told of; None: nothing to report."""
        return None


def check_drafter(drafter: object) -> None:
    """Refuse an object that does not subclass `Drafter` before any work."""
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"a drafter must subclass longspec.Drafter (begin, propose, observe; docs/design.md), got "
                        f"{type(drafter).__name__}")


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
    """Read-only access to the target for drafters: its config, dtype and device, its
    embedding and head (weights and the head's prepared product), the committed part of
    its KV cache (never the pending tokens), the final hidden states the engine kept,
    and the measured forward cost. Self-drafting drafters (TokenSwift, MagicDec) also run
    the target's own layers over a cache of their own: `decoder_for_self_drafting`."""

    def __init__(self, model: Decoder, cache: KVCache | CacheRow) -> None:
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
    def config(self) -> DecoderConfig:
        return self._model.config

    @property
    def dtype(self) -> torch.dtype:
        return self._model.dtype

    @property
    def device(self) -> torch.device:
        """Where the target computes: a drafter's weights and tensor state belong here."""
        return self._model.device

    @property
    def native_kernels(self) -> bool:
        """Whether the target runs the native CPU kernels (a drafter's own products follow it)."""
        return self._model.native_kernels

    @property
    def attention(self) -> AttentionBackend:
        """The target's attention backend, for a drafter that attends its K/V."""
        return self._model.attention

    @property
    def committed_length(self) -> int:
        return self._cache.length

    @property
    def embedding(self) -> torch.Tensor:
        return self._model.embed_weight

    @property
    def head(self) -> torch.Tensor:
        return self._model.head_weight

    @property
    def packed_head(self) -> PackedWeight | None:
        """The head's prepared form for `runtime.linear.packed_linear` (None: plain)."""
        return self._model.packed_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of token ids (its scale included)."""
        return self._model.embed(ids)

    @property
    def inv_freq_full(self) -> torch.Tensor:
        """RoPE inverse frequencies of the target's full-attention layers."""
        return self._model.inv_freq_full

    @property
    def rope_scaling(self) -> dict[bool, float]:
        """RoPE attention scaling of the target's layers, by whether they slide."""
        return self._model.rope_scaling

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits of final hidden states [..., H], as the target computes them."""
        return self._model.logits(hidden)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed K/V [B, Hkv, length, D] of a full-attention layer, as views."""
        if self._model.config.layer_is_sliding[layer]:
            raise ValueError(f"layer {layer} is a sliding-window layer; its ring holds only a window")
        return self._cache.prefix(layer)

    def forward_cost(self, context_tokens: int) -> ForwardCost:
        """The target's measured forward cost by speculative nodes at this context
        (`speculation/cost_model.py`; a default curve where this machine has none yet)."""
        from longspec.speculation.cost_model import forward_cost_at

        return forward_cost_at(self._model, context_tokens)

    @property
    def decoder_for_self_drafting(self) -> Decoder:
        """The target decoder itself, for drafters that run its layers as their draft,
        always over a cache of their own (`Decoder.new_cache`): the engine's cache is
        never reachable from here."""
        return self._model
