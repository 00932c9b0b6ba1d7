from longspec.speculation.drafters.mamba.drafter import PAPER_TREES, MambaDrafter, tree_nodes

__all__ = ["PAPER_TREES", "MambaDrafter", "tree_nodes"]
