from longspec.speculation.drafters.base import DraftContext, Drafter, TargetView
from longspec.speculation.drafters.ngram import NgramDrafter, NgramTable
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["DraftContext", "Drafter", "TargetView", "NgramDrafter", "NgramTable", "PromptLookupDrafter"]
