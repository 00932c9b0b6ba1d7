"""A checkpoint's config.json read without `transformers`, where the file already holds
what `transformers`' config class would compute: a file that `transformers` 5 wrote lists
every attribute (`layer_types`, `rope_parameters` per layer type, the resolved
`sliding_window`), so `DecoderConfig.from_hf` and `rope_tables` read the same values from
it. Any other file (an older writer, a multimodal wrapper, a RoPE scaling computed by
`transformers`' initialisers) is read by `transformers`' AutoConfig."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from longspec.runtime.config import SUPPORTED_MODEL_TYPES


class CheckpointConfig(SimpleNamespace):
    """config.json's attributes (an absent one stays absent: `DecoderConfig.from_hf` reads
    optional ones with getattr defaults, as from `transformers`' config)."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def plain_config_problem(values: dict) -> str | None:
    """Why these values need `transformers`' config class, or None."""
    version = str(values.get("transformers_version", "0"))
    if not version.split(".")[0].isdigit() or int(version.split(".")[0]) < 5:
        return f"written by transformers {version}, whose config class fills in attributes"
    if values.get("model_type") not in SUPPORTED_MODEL_TYPES or "text_config" in values:
        return f"model_type {values.get('model_type')!r} is read by transformers"
    params = values.get("rope_parameters")
    if not isinstance(params, dict):
        return "no rope_parameters"
    tables = list(params.values()) if all(isinstance(v, dict) for v in params.values()) else [params]
    if any(table.get("rope_type", "default") != "default" for table in tables):
        return "a RoPE scaling type computed by transformers' initialisers"
    return None


def read_config(directory: Path):
    """The checkpoint's config: ours where the file is complete (`plain_config_problem`),
    else `transformers`' AutoConfig. A file that is not JSON raises ValueError."""
    values = json.loads((directory / "config.json").read_text())
    if isinstance(values, dict) and plain_config_problem(values) is None:
        return CheckpointConfig(**values)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory, local_files_only=True)
