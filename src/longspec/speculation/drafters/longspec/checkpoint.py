"""Draft checkpoints: weights in safetensors, the config as a small JSON beside them.

    name.safetensors   draft parameters and the draft-vocabulary ids
    name.json          {"format": ..., "config": DraftConfig fields, "meta": {...}}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longspec.runtime.device import HOST
from longspec.speculation.drafters.longspec.config import DraftConfig
from longspec.speculation.drafters.longspec.model import DraftModel

FORMAT = "longspec-draft/1"


def config_path(weights: Path) -> Path:
    return Path(weights).with_suffix(".json")


def save_draft(model: DraftModel, path: str | Path, meta: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Save weights (float32 for training checkpoints; bfloat16 halves a shipped draft)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"draft weights must be saved as a .safetensors file, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(device=HOST, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
               for name, t in model.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    config_path(path).write_text(json.dumps({"format": FORMAT, "config": model.config.to_dict(), "meta": meta or {}}, indent=2))
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
