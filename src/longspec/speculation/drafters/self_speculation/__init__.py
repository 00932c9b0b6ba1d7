from longspec.speculation.drafters.self_speculation.drafter import MagicDecDrafter, TriForceDrafter

__all__ = ["MagicDecDrafter", "TriForceDrafter"]
