"""Draft checkpoints: weights in safetensors, the config as a small JSON beside them.

    name.safetensors   draft parameters and the draft-vocabulary ids
    name.json          {"format": ..., "config": DraftConfig fields, "meta": {...}}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longspec.runtime.atomic_files import write_atomically
from longspec.runtime.device import HOST
from longspec.speculation.drafters.longspec.config import DraftConfig
from longspec.speculation.drafters.longspec.model import DraftModel

FORMAT = "longspec-draft/1"


def config_path(weights: Path) -> Path:
    return Path(weights).with_suffix(".json")


def draft_tensors(model: DraftModel, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The weights as saved (float32 for training checkpoints; bfloat16 halves a shipped draft)."""
    return {name: t.detach().to(device=HOST, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
            for name, t in model.state_dict().items()}


def draft_config_json(model: DraftModel, meta: dict | None = None) -> str:
    return json.dumps({"format": FORMAT, "config": model.config.to_dict(), "meta": meta or {}}, indent=2)


def save_draft(model: DraftModel, path: str | Path, meta: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Save weights and config, each file atomically (a training run commits them together
    through its checkpoint instead)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"draft weights must be saved as a .safetensors file, got {path}")
    tensors = draft_tensors(model, dtype)
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp)))
    write_atomically(config_path(path), draft_config_json(model, meta))
    return path


def load_draft(path: str | Path, target_config=None, dtype: torch.dtype = torch.float32) -> DraftModel:
    """Load a draft (on the host); with `target_config` (a DecoderConfig) check it fits first."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"draft weights not found: {path}")
    cfg_file = config_path(path)
    if not cfg_file.is_file():
        raise FileNotFoundError(f"draft config not found next to its weights: {cfg_file}")
    data = json.loads(cfg_file.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} is not a longspec draft config (format {data.get('format')!r}, expected {FORMAT!r})")
    config = DraftConfig.from_dict(data["config"])
    if target_config is not None:
        config.check_fits(target_config)
    with torch.device(HOST):  # a drafter moves it to the target's device when a sequence begins
        model = DraftModel(config)
    state = load_file(str(path))
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"draft checkpoint {path} lacks tensors {sorted(missing)}")
    model.load_state_dict(state)
    try:
        model.check_vocab_ids()
    except ValueError as error:
        raise ValueError(f"draft checkpoint {path}: {error}") from None
    return model.to(dtype).eval().requires_grad_(False)


def load_meta(path: str | Path) -> dict:
    return json.loads(config_path(Path(path)).read_text()).get("meta", {})
