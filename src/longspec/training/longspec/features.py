"""Target-side features for LongSpec draft training, from our runtime decoder.

For one sequence at given RoPE positions: the K/V of the target layers the draft
attends ([1, Hkv, n, D] each), and the labels — the next data token, or (self-
distillation) the target's own greedy prediction at each position, which is what
greedy verification accepts. One target forward per sequence is the whole cost;
`FeatureCache` keeps the results on disk so later epochs and resumed runs reuse them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longspec.runtime.device import HOST
from longspec.runtime.model import Decoder
from longspec.training.fingerprint import digest

IGNORE = -100
# Bumped when the stored tensors change (2: the target's hidden states added), so a
# cache of an older layout is refused rather than read.
FEATURES_VERSION = 2


def target_features(
    target: Decoder, ids: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...], self_distill: bool
) -> dict[str, torch.Tensor]:
    """ids [n] -> {"k{m}", "v{m}": [1, Hkv, n, D] per draft layer m, "labels": [n],
    "hidden": [n, H] the target's final hidden states (for EAGLE-style drafts)}."""
    n = ids.numel()
    ids, positions = ids.to(target.device), positions.to(target.device)
    cache = target.new_cache(n, max_forward_tokens=n)
    out = target(ids.unsqueeze(0), cache, positions=positions, with_logits=False)
    features = {}
    for m, layer in enumerate(layers):
        k, v = cache.prefix(layer, include_pending=True)
        # Outside inference mode, clones are ordinary tensors autograd may save.
        features[f"k{m}"], features[f"v{m}"] = k.clone(), v.clone()
    if self_distill:
        labels = target.greedy_tokens(out.hidden[0])
    else:
        labels = torch.cat([ids[1:], torch.tensor([IGNORE], device=ids.device)])
    features["labels"] = labels.clone().long()
    features["hidden"] = out.hidden[0].clone()
    return features


class FeatureCache:
    """One safetensors file per (sequence row, label kind); row ids are stable across
    epochs because a row's anchor offset is derived from the row, not the step.

    `key` names everything the features depend on (target weights and dtype, attended
    layers, the token stream, sequence length, seed, row prefix). It is written once
    beside the files, and a directory made under another key is refused: a row number
    alone would pair stale K/V with new ids."""

    KEY_FILE = "key.json"

    def __init__(self, directory: str | Path | None, key: dict | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        key_file = self.directory / self.KEY_FILE
        wanted = digest(key or {})
        if key_file.is_file():
            if json.loads(key_file.read_text()).get("digest") != wanted:
                raise ValueError(
                    f"the feature cache {self.directory} was computed for another target, layer, corpus, sequence "
                    "length, seed or row prefix than this run's: use another --feature-cache directory (or delete it)"
                )
        elif any(self.directory.glob("*.safetensors")):
            raise ValueError(f"the feature cache {self.directory} has features but no {self.KEY_FILE} (made by an older "
                             "longspec): use another --feature-cache directory (or delete it)")
        else:
            key_file.write_text(json.dumps({"digest": wanted, "key": key}, default=str, indent=1))

    def get_or_compute(self, key: str, compute) -> dict[str, torch.Tensor]:
        if self.directory is None:
            return compute()
        path = self.directory / f"{key}.safetensors"
        if path.is_file():
            return load_file(str(path))  # on the host: the trainer moves them to its device
        features = compute()
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: t.to(HOST).contiguous() for k, t in features.items()}, str(tmp))
        tmp.replace(path)
        return features
