"""One round of speculative decoding, written once for every engine.

    propose   each sequence's drafter proposes a tree (or, in a plain round, the root alone)
    forward   ONE target forward over every tree (the engine's: one cache, or a batch's rows)
    verify    the lossless rules per sequence, each with its own random stream
    commit    each cache keeps its accepted path; the bonus becomes the new root
    stop      EOS, the token limit
    observe   each drafter is told what was committed
    record    stats, the controller's account

`SpeculativeEngine` (one sequence) and `BatchEngine` (rows sharing forwards) both run
`decode_round`; they differ only in the `RoundTarget` they hand it: how trees become
one forward and how paths are committed to their cache. So a batch row's output is a
single run's, token for token, by construction. Prefill is shared the same way
(`prefill_piece`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from longspec.runtime.device import HOST
from longspec.runtime.model import Decoder
from longspec.runtime.setup_time import Stopwatch
from longspec.speculation import cost_measurement
from longspec.speculation.decoding_request import DecodingRequest
from longspec.speculation.drafters.base import DraftContext, Drafter, TargetView, check_drafter
from longspec.speculation.grammar import GrammarState
from longspec.speculation.logprobs import LogprobRecorder
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.plain_rounds import PlainRounds
from longspec.speculation.processors import NodeHistories, SamplingParams
from longspec.speculation.seeding import drafter_generator
from longspec.speculation.tree import MalformedTreeError, Tree
from longspec.speculation.verification import NodeScores, Verdict, verify


def check_request(model: Decoder, prompt_length: int, max_new_tokens: int) -> None:
    """Fail before any work on requests the model cannot serve."""
    if prompt_length < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = model.config.max_position_embeddings
    if prompt_length + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_length} tokens + max_new_tokens={max_new_tokens} = "
            f"{prompt_length + max_new_tokens} exceeds the model's context of {limit} tokens; "
            f"shorten the prompt or lower max_new_tokens (at most {max(limit - prompt_length, 0)} here)"
        )


@dataclass(frozen=True)
class SequenceRequest:
    """The request a sequence serves, checked: fixed for the sequence's life."""

    prompt: torch.Tensor
    params: SamplingParams
    max_new_tokens: int
    drafter: Drafter | None
    eos: torch.Tensor
    generator: torch.Generator | None  # the verifier's stream
    stats: GenerationStats  # filled in place as the sequence decodes
    tree_budget: int  # speculative nodes the drafter may propose per round
    logprobs: LogprobRecorder | None = None  # collects the tokens' log-probabilities, when asked


@dataclass(eq=False)
class DecodingState:
    """What the sequence has decoded so far; changes every round."""

    tokens: torch.Tensor  # committed tokens (prompt, then output), preallocated
    length: int  # committed tokens, the root included
    produced: int = 0
    grammar: GrammarState | None = None  # the grammar the output follows, matched to the committed tokens
    # Set by `DecodingSequence.start`, after prefill:
    view: TargetView | None = None
    draft_generator: torch.Generator | None = None
    plain: PlainRounds | None = None
    learns_while_verifying: bool = False  # its drafter's `learn` runs during the forward


@dataclass(eq=False)
class RoundScratch:
    """Made by this round's propose and verify, read by its advance; stale after it."""

    histories: NodeHistories | None = None  # the processors' histories of the tree's nodes
    constraint: tuple[Tree, torch.Tensor] | None = None  # the pruned tree and its nodes' allowed tokens


@dataclass(eq=False)  # compared by identity
class DecodingSequence:
    """One sequence being decoded: the request it serves, its decoding state and the
    current round's scratch."""

    request: SequenceRequest
    state: DecodingState
    scratch: RoundScratch = field(default_factory=RoundScratch)

    @classmethod
    def create(cls, model: Decoder, prompt_ids, request: DecodingRequest, *, tree_budget: int) -> "DecodingSequence":
        """A checked request: everything that can be refused is refused here, before prefill."""
        params, drafter, grammar, eos_token_ids = (request.params, request.drafter, request.grammar,
                                                   request.eos_token_ids)
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=HOST).reshape(-1)
        if params.constrained != (grammar is not None):
            raise ValueError("a grammar comes with SamplingParams(constrained=True), and constrained params with a "
                             "grammar")
        if grammar is not None and not set(grammar.eos_token_ids) <= set(eos_token_ids):
            raise ValueError(f"a grammar's output ends at EOS {list(grammar.eos_token_ids)}: generation must stop "
                             "there (eos_token_ids must include them; ignore_eos cannot go with a grammar)")
        check_request(model, prompt.numel(), request.max_new_tokens)
        check_drafter(drafter)
        if drafter is not None:
            drafter.check_target(model.config)  # weights that do not fit fail before prefill
        stats = request.stats if request.stats is not None else GenerationStats()
        stats.prompt_tokens = prompt.numel()
        tokens = torch.empty(prompt.numel() + request.max_new_tokens, dtype=torch.long, device=HOST)
        tokens[: prompt.numel()] = prompt
        eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=HOST)
        served = SequenceRequest(prompt, params, request.max_new_tokens, drafter, eos, request.generator, stats,
                                 tree_budget if drafter is not None else 0, request.logprobs)
        return cls(served, DecodingState(tokens, prompt.numel(), grammar=grammar))

    @property
    def prefill_ids(self) -> torch.Tensor:
        """What prefill puts in the cache: every prompt token but the root."""
        return self.request.prompt[:-1]

    @property
    def prefill_hidden_rows(self) -> int:
        return self.request.drafter.prefill_hidden_rows if self.request.drafter is not None else 0

    def context(self, max_nodes: int | None = None, rows_in_forward: int = 1) -> DraftContext:
        request, state = self.request, self.state
        return DraftContext(state.tokens[: state.length], state.view,
                            request.tree_budget if max_nodes is None else max_nodes, state.draft_generator,
                            rows_in_forward=rows_in_forward, learns_while_verifying=state.learns_while_verifying,
                            sampled=not request.params.is_greedy)

    def start(self, view: TargetView, prefill_hidden: torch.Tensor | None, *, learns_while_verifying: bool,
              plain_rounds: bool = True) -> None:
        """After prefill: the drafter begins. `plain_rounds` False asks the drafter every
        round (a batch whose padding it may fill)."""
        request, state = self.request, self.state
        view.prefill_hidden = prefill_hidden
        state.view = view
        state.draft_generator = drafter_generator(request.generator) if request.generator is not None else None
        state.learns_while_verifying = learns_while_verifying and request.drafter is not None
        state.plain = PlainRounds(request.drafter, enabled=plain_rounds)
        if request.drafter is not None:
            # Buffers sized at begin hold the whole budget (a batch's cost cap loosens as rows leave).
            request.drafter.begin(self.context())

    def propose(self, context: DraftContext) -> Tree:
        state = self.state
        if state.plain.now():
            tree = Tree.chain(int(state.tokens[state.length - 1]), [])
        else:
            tree = checked_proposal(self.request.drafter, context, state.view.config.vocab_size)
        if state.grammar is not None:  # the drafts the grammar forbids go before the forward
            tree, allowed, pruned = state.grammar.constrain(tree)
            self.scratch.constraint = (tree, allowed)
            self.request.stats.pruned_tokens += pruned
        return tree

    def allowed_tokens(self, tree: Tree) -> torch.Tensor:
        """[n, V] bool: the tokens the grammar allows at each node of the verified tree."""
        constraint = self.scratch.constraint
        if constraint is not None and constraint[0] is tree:
            return constraint[1]
        return self.state.grammar.constrain(tree, prune=False)[1]  # a batch reshaped the proposal

    def verify(self, tree: Tree, scores: NodeScores, hidden: torch.Tensor) -> Verdict:
        request, state, params = self.request, self.state, self.request.params
        histories = None
        if params.uses_history or params.counts_outputs or params.constrained:
            recent = outputs = allowed = None
            if params.uses_history:
                recent = node_histories(state.tokens[: state.length], tree, params.penalty_window)
            if params.counts_outputs:  # every generated token so far, then the node's path
                outputs = node_histories(state.tokens[request.prompt.numel() : state.length], tree,
                                         max(state.produced, 1))
            if params.constrained:
                allowed = self.allowed_tokens(tree)
            histories = NodeHistories(recent, outputs, allowed)
        self.scratch.histories = histories
        verdict = verify(tree, scores, histories, params, request.generator)
        state.view.last_hidden = verdict.path_rows(hidden)
        return verdict

    def advance(self, tree: Tree, verdict: Verdict, scores: NodeScores | None = None) -> "Committed":
        """Append the round's tokens (up to a stop), tell the drafter, record the round
        (and, when asked, the tokens' log-probabilities from the rows that predicted them)."""
        request, state, stats = self.request, self.state, self.request.stats
        accepted = torch.cat([tree.tokens[verdict.path[1:]], torch.tensor([verdict.bonus], device=HOST)])
        new, stop_reason = truncate_at_stop(accepted, request.eos, request.max_new_tokens - state.produced)
        if request.logprobs is not None and scores is not None:
            rows = verdict.path[: new.numel()]
            histories = self.scratch.histories.select(rows) if self.scratch.histories is not None else None
            request.logprobs.record(scores.logits_of(rows), new, request.params, histories)
        if state.grammar is not None:
            state.grammar.advance(new)
        state.tokens[state.length : state.length + new.numel()] = new
        state.length += new.numel()
        state.produced += new.numel()
        observed = state.plain.told(new, stop_reason, state.view)  # never the last round's tokens
        if observed is not None:
            request.drafter.observe(observed)
        stats.new_tokens = state.produced
        stats.record_round(tree.max_depth, verdict.accepted_tokens, tree.size - 1)
        if observed is not None:
            telemetry = request.drafter.telemetry()
            if telemetry is not None:
                stats.controller = telemetry
        return Committed(new, stop_reason, accepted)


@dataclass(frozen=True)
class Committed:
    """What one round committed to a sequence."""

    tokens: torch.Tensor  # appended this round (up to EOS or the token limit)
    stop_reason: str  # "eos", "length" or "" (go on)
    accepted: torch.Tensor  # the verdict's tokens before the stop cut them


class RoundTarget(Protocol):
    """What an engine gives a round: the drafting context of each sequence, the forward
    over all trees, and the commit of the accepted paths to the cache."""

    def context(self, sequence: DecodingSequence) -> DraftContext: ...

    def shape(self, sequences: list[DecodingSequence], trees: list[Tree]) -> list[Tree]:
        """The trees to verify (a batch may cut or widen them); a single sequence keeps its own."""

    def forward(self, sequences: list[DecodingSequence], trees: list[Tree]
                ) -> tuple[list[NodeScores], list[torch.Tensor]]:
        """The target's scores (`NodeScores`: logits, or the argmax alone where a
        sequence's verification needs nothing else) and final hidden states [n_i, H] of
        every tree's nodes."""

    def commit(self, paths: list[torch.Tensor]) -> None: ...


@dataclass
class RoundResult:
    """One sequence's round: the tree proposed, the tree verified, what was committed;
    or, with `contain_errors`, the error that ended this sequence alone."""

    proposed: Tree | None = None
    verified: Tree | None = None
    committed: Committed | None = None
    error: Exception | None = None


def decode_round(sequences: list[DecodingSequence], target: RoundTarget, *,
                 contain_errors: bool = False) -> list[RoundResult]:
    """One round of every sequence.

    contain_errors: an exception in one sequence's drafter (propose, observe) or
    verification fails that sequence alone (its `RoundResult.error`): it goes through
    the shared forward as a root alone and commits nothing but its root, so the other
    sequences' shapes, and bits, are those of a round without the error. An exception
    in the shared forward or commit fails them all (it propagates). Without it, every
    exception propagates at once (a single sequence has no neighbours to protect)."""
    cost_measurement.note_round()  # a background cost measurement waits while this process decodes
    results = [RoundResult() for _ in sequences]
    proposed = []
    # One-time work inside a phase (a head or a cost built on first use) is reported as the
    # setup of every sequence that waited for it, never as their decoding (runtime/setup_time.py).
    for sequence, result in zip(sequences, results):
        watch = Stopwatch()
        try:
            proposed.append(sequence.propose(target.context(sequence)))
        except Exception as error:
            if not contain_errors:
                raise
            result.error = error
            proposed.append(Tree.chain(int(sequence.state.tokens[sequence.state.length - 1]), []))
        sequence.request.stats.draft_s += watch.stop()
        sequence.request.stats.add_setup(watch.setup)
    trees = target.shape(sequences, proposed)

    watch = Stopwatch()
    scores, hidden = target.forward(sequences, trees)
    for sequence in sequences:  # queued on a GPU, the forward runs meanwhile; its result is read below
        if sequence.state.learns_while_verifying:
            sequence.request.drafter.learn()
    forward_s = watch.stop() / len(sequences)  # the shared forward, split evenly
    for sequence in sequences:
        sequence.request.stats.add_setup(watch.setup)

    verdicts: list[Verdict | None] = []
    for sequence, result, tree, tree_scores, tree_hidden in zip(sequences, results, trees, scores, hidden):
        watch = Stopwatch()
        verdict = None
        if result.error is None:
            try:
                verdict = sequence.verify(tree, tree_scores, tree_hidden)
            except Exception as error:
                if not contain_errors:
                    raise
                result.error = error
        verdicts.append(verdict)
        sequence.request.stats.verify_s += forward_s + watch.stop()
        sequence.request.stats.add_setup(watch.setup)
    watch = Stopwatch()
    root_only = torch.zeros(1, dtype=torch.long, device=HOST)
    target.commit([root_only if verdict is None else verdict.path for verdict in verdicts])
    commit_s = watch.stop() / len(sequences)

    for sequence, result, whole, tree, verdict, tree_scores in zip(sequences, results, proposed, trees, verdicts,
                                                                   scores):
        if verdict is None:
            continue
        watch = Stopwatch()
        try:
            result.committed = sequence.advance(tree, verdict, tree_scores)
        except Exception as error:
            if not contain_errors:
                raise
            result.error = error
        result.proposed, result.verified = whole, tree
        sequence.request.stats.bookkeeping_s += commit_s + watch.stop()
        sequence.request.stats.add_setup(watch.setup)
    cost_measurement.note_round()
    return results


def prefill_piece(model: Decoder, cache, ids: torch.Tensor, begin: int, end: int, keep_from: int) -> torch.Tensor | None:
    """Prefill ids[begin:end] into `cache` (a sequence's cache or a batch row's view) and
    commit it; the final hidden states of the tokens at `keep_from` and after, if any."""
    cost_measurement.note_round()  # a prefill, too, keeps a background cost measurement waiting
    piece = ids[begin:end]
    kept = slice(max(0, keep_from - begin), None) if end > keep_from else slice(0, 0)
    out = model(piece.unsqueeze(0), cache, positions=cache.next_positions(piece.numel()), logits_rows=kept,
                with_logits=False, prefill=True)
    cache.commit()
    return out.hidden[0] if out.hidden.shape[1] else None


def checked_proposal(drafter: Drafter, context: DraftContext, vocab_size: int, propose=None) -> Tree:
    """The drafter's tree (`propose(context)`, by default its `propose`), every
    invariant checked once before the target sees it."""
    name = type(drafter).__name__
    try:
        tree = (propose or drafter.propose)(context)
    except MalformedTreeError as error:  # raised while the drafter built its tree
        raise MalformedTreeError(f"drafter {name} proposed a malformed tree: {error}") from None
    if not isinstance(tree, Tree):
        raise TypeError(f"drafter {name} returned {type(tree).__name__} from propose(), expected a Tree")
    problem = tree.problem(vocab_size)
    if problem is None and int(tree.tokens[0]) != context.root:
        problem = f"node 0 carries token {int(tree.tokens[0])}, but the root (last committed token) is {context.root}"
    if problem is None and tree.size - 1 > context.max_nodes:
        problem = f"{tree.size - 1} speculative nodes, more than max_tree_nodes={context.max_nodes}"
    if problem:
        raise MalformedTreeError(f"drafter {name} proposed a malformed tree: {problem}")
    return tree


def node_histories(committed: torch.Tensor, tree: Tree, window: int) -> torch.Tensor:
    """[n, window + max_depth] token histories, one per tree node: the last `window`
    committed tokens followed by the node's own path below the root (-1 padded)."""
    n, depth = tree.size, tree.max_depth
    recent = committed[-window:]
    shared = torch.full((window,), -1, dtype=torch.long, device=HOST)
    shared[window - recent.numel() :] = recent
    path_tokens = torch.full((n, depth), -1, dtype=torch.long, device=HOST)
    if depth:
        node, ancestor = torch.nonzero(tree.ancestor_mask() & (tree.depths > 0).unsqueeze(0), as_tuple=True)
        path_tokens[node, tree.depths[ancestor] - 1] = tree.tokens[ancestor]
    return torch.cat([shared.expand(n, window), path_tokens], dim=1)


def truncate_at_stop(new: torch.Tensor, eos: torch.Tensor, room: int) -> tuple[torch.Tensor, str]:
    """This round's tokens up to the first EOS (kept) or the room left; the reason, if any."""
    if eos.numel():
        hits = torch.nonzero(torch.isin(new, eos)).flatten()
        if hits.numel() and int(hits[0]) < room:
            return new[: int(hits[0]) + 1], "eos"
    if new.numel() >= room:
        return new[:room], "length"
    return new, ""
