"""longspec: lossless speculative decoding for long prompts and long outputs."""

__version__ = "0.1.0"

from longspec.api import GenerationResult, LongSpecModel, TokenStream, load  # noqa: E402
from longspec.request import GenerationRequest  # noqa: E402
from longspec.speculation.batch_engine import BatchOptions  # noqa: E402
from longspec.speculation.drafters.base import DraftContext, Drafter  # noqa: E402
from longspec.speculation.grammar import OutputConstraint  # noqa: E402
from longspec.speculation.tree import Tree  # noqa: E402

__all__ = ["load", "LongSpecModel", "GenerationRequest", "GenerationResult", "TokenStream", "BatchOptions", "Drafter", "DraftContext", "Tree",
           "OutputConstraint", "__version__"]
