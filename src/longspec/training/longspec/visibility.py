"""What a training query may see: Anchor-Offset Indices and cross-attention
visibility rules for the LongSpec/GLIDE draft.

At inference the draft's root query at position p sees the target's K/V of
positions < p, and a tree node at depth d (position p = root + d) sees only
positions < p - d. Training reproduces these views:

* `ShiftVisibility(1)`: every query at sequence index i sees target K/V at
  indices <= i - 1 (the root's view);
* `NoisyShift(gamma)` (LongSpec's flash noisy training): per batch a random shift
  j in [1, gamma); queries from index j on see target indices <= i - j;
* `BlockVisibility(gamma)` (GLIDE's block-wise mask): the sequence is cut into
  blocks of gamma; a query sees target indices before its block's start, i.e.
  shifts 1..gamma within each block, as in one drafting round.

Rules return ([n, n] bool visible mask, [n] bool "query has something to see and
counts in the loss").
"""

from __future__ import annotations

import torch

from longspec.runtime.device import HOST

ANCHORS = 4  # positions that keep 0..3 under Anchor-Offset Indices (attention sinks)


def anchor_offset_positions(length: int, max_positions: int, generator: torch.Generator) -> torch.Tensor:
    """[length] RoPE positions: 0..3, then 4.. shifted by a random offset in
    [0, max_positions - length], so short training sequences exercise the large
    positions long prompts reach."""
    if length > max_positions:
        raise ValueError(f"sequence length {length} exceeds the model's {max_positions} positions")
    positions = torch.arange(length, device=HOST)
    offset = int(torch.randint(0, max_positions - length + 1, (), generator=generator, device=HOST))
    positions[ANCHORS:] += offset
    return positions


class ShiftVisibility:
    def __init__(self, shift: int = 1) -> None:
        if shift < 1:
            raise ValueError(f"shift must be >= 1, got {shift}")
        self.shift = shift

    def mask(self, length: int, generator: torch.Generator | None = None):
        return shifted_mask(length, self.shift)


class NoisyShift:
    """`shift_weights` (one per shift 1..gamma-1, any positive scale) tilts the draw toward
    the shifts that matter most: depth 1 gates every accepted token of a round, depth d is
    reached only when the d - 1 before it were accepted. None draws uniformly (as the
    paper), and draws exactly the shifts earlier runs drew, so they resume unchanged."""

    def __init__(self, gamma: int, shift_weights: tuple[float, ...] | None = None) -> None:
        if gamma < 2:
            raise ValueError(f"noisy training needs gamma >= 2 (shift drawn from [1, gamma)), got {gamma}")
        if shift_weights is not None:
            shift_weights = tuple(float(w) for w in shift_weights)
            if len(shift_weights) != gamma - 1:
                raise ValueError(f"shift weights need one weight per shift 1..{gamma - 1} (gamma {gamma}), "
                                 f"got {len(shift_weights)}")
            if min(shift_weights) < 0 or sum(shift_weights) <= 0:
                raise ValueError(f"shift weights must be >= 0 with a positive sum, got {list(shift_weights)}")
        self.gamma = gamma
        self.shift_weights = shift_weights

    def draw_shift(self, generator: torch.Generator) -> int:
        if self.shift_weights is None:
            return int(torch.randint(1, self.gamma, (), generator=generator, device=HOST))
        weights = torch.tensor(self.shift_weights, dtype=torch.float64, device=HOST)
        return 1 + int(torch.multinomial(weights, 1, generator=generator))

    def mask(self, length: int, generator: torch.Generator):
        return shifted_mask(length, self.draw_shift(generator))


class BlockVisibility:
    def __init__(self, gamma: int) -> None:
        if gamma < 1:
            raise ValueError(f"block size must be >= 1, got {gamma}")
        self.gamma = gamma

    def mask(self, length: int, generator: torch.Generator | None = None):
        index = torch.arange(length, device=HOST)
        block_start = index // self.gamma * self.gamma
        visible = index.unsqueeze(0) < block_start.unsqueeze(1)
        return visible, block_start > 0


def shifted_mask(length: int, shift: int):
    index = torch.arange(length, device=HOST)
    visible = index.unsqueeze(0) <= index.unsqueeze(1) - shift
    return visible, index >= shift
