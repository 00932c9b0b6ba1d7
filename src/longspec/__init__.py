"""longspec: lossless speculative decoding for long prompts and long outputs."""

__version__ = "0.1.0"

from longspec.api import GenerationResult, LongSpecModel, TokenStream, load  # noqa: E402

__all__ = ["load", "LongSpecModel", "GenerationResult", "TokenStream", "__version__"]
