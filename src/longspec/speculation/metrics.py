"""What every generation reports: speed, τ, acceptance by depth, time split, and
the output's Distinct-n (the repetition measure long-generation methods report)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

DISTINCT_ORDERS = (1, 2, 3, 4)


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """|distinct n-grams| / |n-grams| of ``tokens`` (0.0 when shorter than n); loops score low."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    tokens = [int(t) for t in tokens]
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total


@dataclass
class GenerationStats:
    method: str = "ar"
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + verification
    bookkeeping_s: float = 0.0  # cache commit, drafter updates, history
    target_forwards: int = 0  # decode forwards (prefill excluded)
    proposed_by_depth: list[int] = field(default_factory=list)  # rounds whose tree reached depth d+1
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds that accepted a node at depth d+1
    draft_rounds: int = 0  # rounds whose tree had at least one speculative node
    draft_tokens: int = 0  # speculative nodes proposed, over all rounds
    accepted_tokens: int = 0  # speculative nodes accepted (bonus tokens excluded)
    pruned_tokens: int = 0  # speculative nodes a grammar forbade, removed before verification
    stop_reason: str = ""
    kv_cache_bytes: int = 0  # the target KV cache allocated for this sequence
    distinct: list[float] = field(default_factory=list)  # Distinct-1..4 of the output, set when generation ends
    # A controlling drafter's own account (`auto`: rounds with speculation off, nodes
    # chosen, predicted vs realised acceptance, calls and credit per component).
    controller: dict = field(default_factory=dict)
    # One-time work this generation waited for, by part ("kernels", "packing", "certified_head",
    # "forward_cost", "conversion", "compile"; runtime/setup_time.py): never in the times above,
    # so the first run's tokens per second are the decoding's. A model's first generation also
    # reports what its load paid.
    setup: dict = field(default_factory=dict)

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s + self.bookkeeping_s

    @property
    def setup_s(self) -> float:
        return sum(self.setup.values())

    def add_setup(self, parts: dict[str, float]) -> None:
        for part, seconds in parts.items():
            self.setup[part] = self.setup.get(part, 0.0) + seconds

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward, the bonus token included."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(node at depth d accepted | the tree reached depth d)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_depth, self.proposed_by_depth)]

    def record_round(self, tree_depth: int, accepted: int, nodes: int = 0) -> None:
        """One verification: the tree's depth and speculative node count, and how many
        of its nodes were accepted."""
        self.target_forwards += 1
        self.draft_rounds += nodes > 0
        self.draft_tokens += nodes
        self.accepted_tokens += accepted
        for counts, upto in ((self.proposed_by_depth, tree_depth), (self.accepted_by_depth, accepted)):
            if len(counts) < upto:
                counts.extend([0] * (upto - len(counts)))
            for d in range(upto):
                counts[d] += 1

    def record_output(self, tokens: Sequence[int]) -> None:
        self.distinct = [distinct_n(tokens, n) for n in DISTINCT_ORDERS]

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            decode_s=self.decode_s,
            setup_s=self.setup_s,
            tau=self.tau,
            decode_tokens_per_s=self.decode_tokens_per_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            acceptance_by_depth=self.acceptance_by_depth,
        )
        return data
