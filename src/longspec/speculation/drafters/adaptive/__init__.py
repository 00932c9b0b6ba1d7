from longspec.speculation.drafters.adaptive.drafter import AcceptanceTable, AdaptiveDrafter
from longspec.speculation.drafters.adaptive.policies import ThroughputPolicy, TreePolicy, UCBPolicy, mamba_reward

__all__ = ["AdaptiveDrafter", "AcceptanceTable", "ThroughputPolicy", "TreePolicy", "UCBPolicy", "mamba_reward"]
