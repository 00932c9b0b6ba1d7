"""Target-side features for LongSpec draft training, from our runtime decoder.

For one sequence at given RoPE positions: the K/V of the target layers the draft
attends ([1, Hkv, n, D] each), and the labels — the next data token, or (self-
distillation) the target's own greedy prediction at each position, which is what
greedy verification accepts. One target forward per sequence is the whole cost;
`FeatureCache` keeps the results on disk so later epochs and resumed runs reuse them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longspec.runtime.model import Decoder

IGNORE = -100


def target_features(
    target: Decoder, ids: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...], self_distill: bool
) -> dict[str, torch.Tensor]:
    """ids [n] -> {"k{m}", "v{m}": [1, Hkv, n, D] per draft layer m, "labels": [n]}."""
    n = ids.numel()
    cache = target.new_cache(n, max_forward_tokens=n)
    out = target(ids.unsqueeze(0), cache, positions=positions, logits_rows=None if self_distill else slice(0, 0), with_logits=False)
    features = {}
    for m, layer in enumerate(layers):
        k, v = cache.prefix(layer, include_pending=True)
        # Outside inference mode, clones are ordinary tensors autograd may save.
        features[f"k{m}"], features[f"v{m}"] = k.clone(), v.clone()
    if self_distill:
        labels = target.greedy_tokens(out.hidden[0])
    else:
        labels = torch.cat([ids[1:], torch.tensor([IGNORE])])
    features["labels"] = labels.clone().long()
    return features


class FeatureCache:
    """One safetensors file per (sequence row, label kind); row ids are stable across
    epochs because a row's anchor offset is derived from the row, not the step."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def get_or_compute(self, key: str, compute) -> dict[str, torch.Tensor]:
        if self.directory is None:
            return compute()
        path = self.directory / f"{key}.safetensors"
        if path.is_file():
            return load_file(str(path))
        features = compute()
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: t.contiguous() for k, t in features.items()}, str(tmp))
        tmp.replace(path)
        return features
