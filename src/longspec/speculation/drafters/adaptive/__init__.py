from longspec.speculation.drafters.adaptive.acceptance import AcceptanceTable, CrossFittedAcceptance
from longspec.speculation.drafters.adaptive.drafter import AdaptiveDrafter
from longspec.speculation.drafters.shared.policies import ThroughputPolicy, TreePolicy, UCBPolicy, mamba_reward

__all__ = ["AdaptiveDrafter", "AcceptanceTable", "CrossFittedAcceptance", "ThroughputPolicy", "TreePolicy", "UCBPolicy", "mamba_reward"]
