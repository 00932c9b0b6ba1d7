"""LongSpec / GLIDE draft model: a small network that cross-attends the target's
own KV cache, with chain, CAPE and dynamic beam-tree drafting."""

from longspec.speculation.drafters.longspec.checkpoint import load_draft, save_draft
from longspec.speculation.drafters.longspec.config import DraftConfig
from longspec.speculation.drafters.shared.errors import DraftMismatchError
from longspec.speculation.drafters.longspec.drafter import LongSpecDrafter
from longspec.speculation.drafters.longspec.model import DraftModel
from longspec.speculation.drafters.longspec.strategies import BeamStrategy, CapeStrategy, ChainStrategy, SampledChainStrategy

__all__ = [
    "BeamStrategy", "CapeStrategy", "ChainStrategy", "DraftConfig", "DraftMismatchError", "DraftModel",
    "LongSpecDrafter", "SampledChainStrategy", "load_draft", "save_draft",
]
