from longspec.speculation.drafters.base import DraftContext, Drafter, TargetView
from longspec.speculation.drafters.ngram import NgramDrafter
from longspec.speculation.drafters.shared.ngram_table import NgramTable
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["DraftContext", "Drafter", "TargetView", "NgramDrafter", "NgramTable", "PromptLookupDrafter"]
