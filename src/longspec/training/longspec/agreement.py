"""Held-out quality of a LongSpec draft: how often its top token is the target's.

For held-out sequences (rows that start as served prompts do, see
`data.prefixed_rows`) placed at chosen RoPE positions, the draft runs with the visibility of
drafting depth d (`ShiftVisibility(d)`: each query sees the target's K/V up to d
tokens back, its own inputs teacher-forced), and is compared with the target's
greedy prediction at every position. Depth-1 agreement is the probability that a
greedy chain's first node is accepted; deeper shifts show how fast drafts degrade.

A start position s > 0 places the row the way a long prompt is seen at inference:
its first 4 tokens (BOS and the attention sinks) stay at positions 0..3 and the
rest start at s + 4. (Shifting every position together would change nothing under
RoPE, which sees only differences.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longspec.runtime.model import Decoder
from longspec.speculation.drafters.longspec.model import DraftModel, softcap
from longspec.training.longspec.features import target_features
from longspec.training.longspec.trainer import training_hidden
from longspec.training.longspec.visibility import ANCHORS, shifted_mask


@dataclass(frozen=True)
class DraftAgreement:
    depth: int
    start_position: int
    top1: float  # share of positions where the draft's argmax is the target's argmax
    cross_entropy: float  # nats, against the target's argmax (positions whose label the draft can score)
    positions: int

    def to_dict(self) -> dict:
        return {"depth": self.depth, "start_position": self.start_position, "top1": self.top1,
                "cross_entropy": self.cross_entropy, "positions": self.positions}


@torch.no_grad()
def draft_agreement(
    draft: DraftModel,
    target: Decoder,
    sequences: torch.Tensor,
    *,
    depths: Sequence[int] = (1, 3),
    start_positions: Sequence[int] = (0,),
    feature_store: dict | None = None,
) -> list[DraftAgreement]:
    """sequences: [N, n] held-out token ids. One row per (start position, depth).

    feature_store: a dict the caller keeps to score several drafts on the same
    sequences: the target's features (one target forward per row and start position,
    most of the cost) are computed on first use and reused. Keep one dict per set of
    sequences."""
    if sequences.dim() != 2 or sequences.shape[1] < 2:
        raise ValueError(f"sequences must be [N, n >= 2] token ids, got shape {tuple(sequences.shape)}")
    n = sequences.shape[1]
    limit = target.config.max_position_embeddings
    for start in start_positions:
        if start < 0 or start + n > limit:
            raise ValueError(f"start position {start} + {n} tokens exceeds the target's {limit} positions")
    rows = []
    for start in start_positions:
        positions = torch.arange(n)
        positions[ANCHORS:] += start
        store = {} if feature_store is None else feature_store
        key = (start, tuple(draft.config.target_layers))
        if key not in store:
            store[key] = [target_features(target, ids, positions, draft.config.target_layers, self_distill=True)
                          for ids in sequences]
        features = store[key]
        for depth in depths:
            hits = total = scored = 0
            loss = 0.0
            for ids, row_features in zip(sequences, features):
                logits, labels = _scored_positions(draft, target, ids, positions, row_features, depth)
                hits += int((draft.to_full_vocab(logits.argmax(dim=-1)) == labels).sum())
                total += labels.numel()
                in_vocab = _draft_index(draft, labels)
                keep = in_vocab >= 0
                loss += float(F.cross_entropy(logits[keep], in_vocab[keep], reduction="sum"))
                scored += int(keep.sum())
            rows.append(DraftAgreement(depth, start, hits / max(total, 1), loss / max(scored, 1), total))
    return rows


@torch.no_grad()
def draft_predictions(draft: DraftModel, target: Decoder, ids: torch.Tensor, positions: torch.Tensor, depth: int):
    """(draft argmax, target argmax) as full-vocabulary ids for the positions of one
    sequence that see at least one target key at drafting depth `depth`."""
    features = target_features(target, ids, positions, draft.config.target_layers, self_distill=True)
    logits, labels = _scored_positions(draft, target, ids, positions, features, depth)
    return draft.to_full_vocab(logits.argmax(dim=-1)), labels


def _scored_positions(draft, target, ids, positions, features, depth):
    """Draft logits over its vocabulary and the target's labels at the scored positions."""
    visible, counted = shifted_mask(ids.numel(), depth)
    cross_mask = visible.clone()
    cross_mask[~counted, 0] = True  # nothing to see there: a dummy key, not scored
    hidden = training_hidden(draft.eval(), draft.config, target, {**features, "ids": ids, "positions": positions},
                             cross_mask, visible)
    head = draft.head_rows(target.head_weight).to(hidden.dtype)
    logits = softcap(hidden[counted] @ head.t(), target.config.final_logit_softcapping).float()
    return logits, features["labels"][counted]


def _draft_index(draft: DraftModel, full_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary index of each full-vocabulary id (-1 where the draft cannot score it)."""
    if not draft.reduced_vocab:
        return full_ids
    lookup = torch.full((int(draft.config.vocab_size),), -1, dtype=torch.long)
    lookup[draft.vocab_ids] = torch.arange(draft.vocab_ids.numel())
    return lookup[full_ids]
