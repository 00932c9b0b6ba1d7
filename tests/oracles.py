"""Drafters whose proposals owe nothing to the target, for losslessness tests (the
output may not depend on what a drafter proposes): the adversarial oracle that hides
the true continuation among garbage in random trees, LongSpec drafts with random
weights and the tree strategies they run, and a tiny random Mamba drafter model."""

from __future__ import annotations

import torch
from transformers import MambaConfig, MambaForCausalLM

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.longspec import (
    BeamStrategy,
    CapeStrategy,
    ChainStrategy,
    DraftConfig,
    DraftModel,
    SampledChainStrategy,
)
from longspec.speculation.tree import Tree
from tiny_models import VOCAB_SIZE


class OracleGarbageDrafter(Drafter):
    """Adversarial drafter: random tree shapes whose nodes are sometimes the
    true continuation (so deep paths get accepted and compacted) and otherwise
    random or repeated garbage, with duplicate siblings allowed."""

    def __init__(self, reference: torch.Tensor, prompt_length: int, seed: int, max_nodes: int = 24) -> None:
        self.reference = reference
        self.prompt_length = prompt_length
        self.rng = torch.Generator().manual_seed(seed)
        self.max_nodes = max_nodes

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def _rand(self, high: int) -> int:
        return int(torch.randint(0, high, (), generator=self.rng))

    def propose(self, context: DraftContext) -> Tree:
        n = self._rand(min(context.max_nodes, self.max_nodes) + 1)
        done = context.tokens.numel() - self.prompt_length  # generated tokens, minus the root's offset
        tokens, parents, depths = [context.root], [-1], [0]
        for i in range(1, n + 1):
            parent = self._rand(i)
            depth = depths[parent] + 1
            truth_index = done + depth - 1
            style = self._rand(4)
            if style <= 1 and truth_index < self.reference.numel() and self._on_truth(tokens, parents, parent, done):
                token = int(self.reference[truth_index])
            elif style == 2:
                token = tokens[parent]  # repeated garbage
            else:
                token = self._rand(VOCAB_SIZE)
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
        return Tree.from_parents(torch.tensor(tokens), torch.tensor(parents))

    def _on_truth(self, tokens, parents, node, done) -> bool:
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        path.reverse()
        return path == self.reference[done : done + len(path)].tolist()


def random_draft(target, *, seed=0, std=0.3, **options):
    config = DraftConfig.for_target(
        target.config, self_num_heads=2, self_head_dim=8, intermediate_size=32, **{"window": 6, **options}
    )
    return DraftModel(config).reset_parameters(seed=seed, std=std).to(target.dtype)


STRATEGIES = {
    "chain": lambda: ChainStrategy(4),
    "cape": lambda: CapeStrategy(4, bins=((0.9, 1), (0.3, 2), (0.0, 3))),
    "beam": lambda: BeamStrategy((3, 5, 5, 4)),
    "sampled-chain": lambda: SampledChainStrategy(4, temperature=1.0),
}


def tiny_mamba(vocab_size=VOCAB_SIZE, eos=None, seed=0):
    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=vocab_size, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                         conv_kernel=4, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    return MambaForCausalLM(config).to(torch.float64).eval()
