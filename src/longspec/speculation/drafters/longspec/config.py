"""The draft model's configuration, and how it must fit its target.

A LongSpec/GLIDE draft is sized by its target: its cross-attention reads the
target's K/V in place, so query heads, KV heads and head dimension are the
target's; its input embedding and output head are the target's own tensors, so
hidden size and vocabulary are the target's too. What the draft chooses freely:
its layer count, sliding window, its own self-attention heads and MLP width, and
which target layers its layers cross-attend.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from longspec.runtime.config import DecoderConfig
from longspec.speculation.drafters.shared.errors import DraftMismatchError


@dataclass(frozen=True)
class DraftConfig:
    # Fixed by the target (checked by `check_fits`).
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    cross_num_heads: int  # = target query heads of the attended layer
    cross_num_kv_heads: int  # = target KV heads
    cross_head_dim: int  # = target head_dim
    target_layers: tuple[int, ...]  # target layer attended by each draft layer
    # The draft's own choices.
    num_layers: int = 1
    window: int = 512  # self-attention window over the draft's own recent tokens
    self_num_heads: int = 4
    self_head_dim: int = 64
    intermediate_size: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0  # the draft's own self-attention RoPE
    draft_vocab_size: int | None = None  # None: score the full vocabulary
    # A fixed ALiBi-style bias on the cross-attention logits, -slope_h * (lag - 1) for
    # a target key `lag` positions before the query, so the most recent target K/V
    # starts with most of the mass (without it, the lag-1 key starts near 0.5% of the
    # mass over hundreds of keys and its gradient dies: the draft reads a blur).
    recency_bias: bool = False
    # EAGLE-style input (a variant of LongSpec): the target's final hidden state at the
    # newest target position a query may see is normalised and fused with the token
    # embedding. Depth-1 drafts then read the target's own prediction state directly.
    hidden_input: bool = False
    # Target keys a draft query reads: the newest `cross_window` keys it may see plus the
    # first `cross_sinks` positions (None: every committed key). Training rows show the
    # draft anchors (BOS + 3 tokens, Anchor-Offset) and at most seq_len recent keys; a
    # window of that size keeps inference within what training taught, and keeps a draft
    # step's cost constant in the context length (the target K/V read does not grow).
    cross_window: int | None = None
    cross_sinks: int = 4

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if len(self.target_layers) != self.num_layers:
            raise ValueError(
                f"target_layers {self.target_layers} must name one target layer per draft layer ({self.num_layers})"
            )
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.cross_window is not None and self.cross_window < 1:
            raise ValueError(f"cross_window must be >= 1 (or None for every key), got {self.cross_window}")
        if self.cross_sinks < 0:
            raise ValueError(f"cross_sinks must be >= 0, got {self.cross_sinks}")
        if self.cross_num_heads % self.cross_num_kv_heads:
            raise ValueError("cross_num_heads must be a multiple of cross_num_kv_heads")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    @staticmethod
    def for_target(target: DecoderConfig, *, num_layers: int = 1, target_layers: tuple[int, ...] | None = None, **options) -> "DraftConfig":
        """A draft for `target`. By default draft layer m attends target layer
        N_T - N_d + m (GLIDE's mapping); when such a layer is a sliding-window layer
        (its ring holds only a window, not the context) the last N_d *full-attention*
        layers are used instead."""
        if target_layers is None:
            target_layers = default_target_layers(target, num_layers)
        return DraftConfig(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            target_num_layers=target.num_layers,
            cross_num_heads=target.num_heads,
            cross_num_kv_heads=target.num_kv_heads,
            cross_head_dim=target.head_dim,
            target_layers=tuple(int(t) for t in target_layers),
            num_layers=num_layers,
            rms_norm_eps=target.rms_norm_eps,
            **options,
        )

    def check_fits(self, target: DecoderConfig) -> None:
        """Raise DraftMismatchError naming every field that disagrees with `target`."""
        problems = []
        for name, mine, theirs in (
            ("hidden size", self.hidden_size, target.hidden_size),
            ("vocabulary size", self.vocab_size, target.vocab_size),
            ("attention heads", self.cross_num_heads, target.num_heads),
            ("KV heads", self.cross_num_kv_heads, target.num_kv_heads),
            ("head dim", self.cross_head_dim, target.head_dim),
            ("target layer count", self.target_num_layers, target.num_layers),
        ):
            if mine != theirs:
                problems.append(f"{name}: draft {mine} vs target {theirs}")
        for layer in self.target_layers:
            if not 0 <= layer < target.num_layers:
                problems.append(f"layer mapping: target layer {layer} does not exist (target has {target.num_layers})")
            elif target.layer_is_sliding[layer]:
                problems.append(f"layer mapping: target layer {layer} is a sliding-window layer, not full attention")
        if problems:
            raise DraftMismatchError(
                "draft checkpoint does not fit this target model ("
                + "; ".join(problems)
                + "); train a draft for this model with `longspec train longspec --model ...`"
            )

    @property
    def cross_attention_masked(self) -> bool:
        """Whether cross-attention logits need a per-key bias or window beyond causality."""
        return self.recency_bias or self.cross_window is not None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_layers"] = list(self.target_layers)
        return data

    @staticmethod
    def from_dict(data: dict) -> "DraftConfig":
        data = dict(data)
        data["target_layers"] = tuple(data["target_layers"])
        return DraftConfig(**data)


def default_target_layers(target: DecoderConfig, num_layers: int) -> tuple[int, ...]:
    glide = tuple(range(target.num_layers - num_layers, target.num_layers))
    if all(not target.layer_is_sliding[i] for i in glide):
        return glide
    full = [i for i, sliding in enumerate(target.layer_is_sliding) if not sliding]
    if len(full) < num_layers:
        raise ValueError(f"the target has {len(full)} full-attention layers; a {num_layers}-layer draft needs one each")
    return tuple(full[-num_layers:])
