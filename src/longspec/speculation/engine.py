"""The single-sequence engine: prefill, then `decode_round` (decode_round.py) until a
stop, with autoregressive decoding as the drafter-less case. Its cache is its own;
its forward is one tree (through the compiled static steps where they exist)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from longspec.runtime.cache import KVCache
from longspec.runtime.device import synchronize
from longspec.runtime.model import Decoder
from longspec.runtime.setup_time import Stopwatch
from longspec.speculation.decode_round import DecodingSequence
from longspec.speculation.decode_round import check_request, decode_round, prefill_piece
from longspec.speculation.decoding_request import DecodingRequest
from longspec.speculation.drafters.base import DraftContext, TargetView
from longspec.speculation.tree import Tree
from longspec.speculation.verification import NodeScores, certified_head_serves

# Prompts longer than this show a prefill progress bar (when attached to a terminal).
_PROGRESS_MIN_TOKENS = 4096


@dataclass(frozen=True)
class EngineOptions:
    # Tokens per prefill forward: bounds activation memory. 256 prefilled a little faster than 512
    # on a 2-core CPU and equals the batch engine's per-step budget, so a batched row's prompt is cut
    # where a single run cuts it, the same bits in bf16
    # (docs/lab-notes/attention.md#bf16-speculation-returns-plain-decodings-tokens-issues-adaptive-speculation-batching-runtime-speed).
    prefill_chunk: int = 256
    max_tree_nodes: int = 64  # speculative nodes per verification forward (root excluded)
    progress: bool = True
    # Call a drafter's `learn()` while each verification forward runs (its statistics
    # then lag a round): None does where the device computes asynchronously (not the
    # CPU, whose forward returns when it is done, so nothing would overlap).
    learn_while_verifying: bool | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_tree_nodes < 0:
            raise ValueError(f"max_tree_nodes must be >= 0, got {self.max_tree_nodes}")
        if self.learn_while_verifying not in (None, True, False):
            raise ValueError(f"learn_while_verifying must be True, False or None, got {self.learn_while_verifying!r}")


class SpeculativeEngine:
    """Decodes one sequence at a time over a cache of its own."""

    def __init__(self, model: Decoder, options: EngineOptions = EngineOptions()) -> None:
        self.model = model
        self.options = options

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """Fail before any work on requests the model cannot serve."""
        check_request(self.model, prompt_length, max_new_tokens)

    def generate(self, prompt_ids: torch.Tensor | Sequence[int], request: DecodingRequest | None = None,
                 **keywords) -> Iterator[torch.Tensor]:
        """Yield the tokens committed each round (1-D int64), until EOS (included),
        ``max_new_tokens`` or the caller stops iterating. Fills ``request.stats`` in place.
        ``request`` (or its fields as keywords) says how: see `DecodingRequest`."""
        request = DecodingRequest.given(request, keywords)
        sequence = DecodingSequence.create(self.model, prompt_ids, request, tree_budget=self.options.max_tree_nodes)
        max_new_tokens = request.max_new_tokens
        stats = sequence.request.stats
        capacity = sequence.request.prompt.numel() + max_new_tokens + sequence.request.tree_budget + 1
        cache = self.model.new_cache(capacity, max_forward_tokens=max(self.options.prefill_chunk,
                                                                      sequence.request.tree_budget + 1))
        stats.kv_cache_bytes = cache.nbytes()

        watch = Stopwatch()
        prefill_hidden = self._prefill(sequence.prefill_ids, cache, sequence.prefill_hidden_rows)
        synchronize(self.model.device)  # a GPU queues the prefill: wait, so prefill_s measures it
        stats.prefill_s = watch.stop()
        stats.add_setup(watch.setup)

        watch = Stopwatch()  # a drafter's begin is no round's; its one-time work is still reported
        sequence.start(TargetView(self.model, cache), prefill_hidden,
                       learns_while_verifying=learns_while_verifying(self.options, self.model.device))
        watch.stop()
        stats.add_setup(watch.setup)
        target = _OneSequence(self.model, cache)
        while True:
            (result,) = decode_round([sequence], target)
            committed = result.committed
            yield committed.tokens
            if committed.stop_reason:
                stats.stop_reason = committed.stop_reason
                return

    def _prefill(self, ids: torch.Tensor, cache: KVCache, keep_hidden: int = 0) -> torch.Tensor | None:
        """Fill the cache. Returns the final hidden states of the last `keep_hidden`
        prompt tokens (for drafters that read the target's features), else None."""
        chunk = self.options.prefill_chunk
        show = self.options.progress and ids.numel() >= _PROGRESS_MIN_TOKENS
        keep_from = ids.numel() - keep_hidden if keep_hidden else ids.numel()
        kept = []
        with tqdm(total=ids.numel(), desc="prefill", unit="tok", disable=None if show else True, leave=False) as bar:
            for begin in range(0, ids.numel(), chunk):
                end = min(begin + chunk, ids.numel())
                hidden = prefill_piece(self.model, cache, ids, begin, end, keep_from)
                if hidden is not None:
                    kept.append(hidden)
                bar.update(end - begin)
        return torch.cat(kept) if kept else None


class _OneSequence:
    """The round's target for one sequence: its tree in one forward over its own cache
    (through the compiled static steps where the model has them)."""

    def __init__(self, model: Decoder, cache: KVCache) -> None:
        self.model = model
        self.cache = cache

    def context(self, sequence: DecodingSequence) -> DraftContext:
        return sequence.context()

    def shape(self, sequences, trees: list[Tree]) -> list[Tree]:
        return trees

    def forward(self, sequences: list[DecodingSequence], trees: list[Tree]):
        (sequence,), (tree,) = sequences, trees
        mask = None if tree.is_chain() else tree.ancestor_mask()
        positions = self.cache.length + tree.depths
        if certified_head_serves(sequence.request.params, tree) and self.model.certified_head is not None:
            # Decisions and draws from the certified head, without the full head.
            out = self.model(tree.tokens.unsqueeze(0), self.cache, tree_mask=mask, positions=positions, with_logits=False)
            hidden = out.hidden[0]
            return [NodeScores(model=self.model, hidden=hidden)], [hidden]
        out = self.model(tree.tokens.unsqueeze(0), self.cache, tree_mask=mask, positions=positions)
        return [NodeScores(out.logits[0])], [out.hidden[0]]

    def commit(self, paths: list[torch.Tensor]) -> None:
        (path,) = paths
        self.cache.commit(path)


def learns_while_verifying(options: EngineOptions, device: torch.device) -> bool:
    """Whether the engines call drafters' `learn()` during verification forwards
    (`EngineOptions.learn_while_verifying`; by default where the device computes
    asynchronously)."""
    wanted = options.learn_while_verifying
    return device.type != "cpu" if wanted is None else wanted
