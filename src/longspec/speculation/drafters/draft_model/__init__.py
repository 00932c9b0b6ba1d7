from longspec.speculation.drafters.draft_model.drafter import DraftModelDrafter

__all__ = ["DraftModelDrafter"]
