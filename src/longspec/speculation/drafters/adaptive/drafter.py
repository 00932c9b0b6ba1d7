"""`auto`: a drafter that composes other drafters and sizes each round's tree from
measured acceptance and measured cost.

Each round:

1. It asks its components for trees — the cheap ones (prompt lookup, n-gram reuse:
   microseconds) every round; an expensive one (the LongSpec draft: a fair part of a
   target forward) only in rounds where the cheap ones found nothing, and there only
   while the tokens only it contributes are worth its measured time, re-checked by
   a probe call after `probe_every` rounds out; each probe that does not pay doubles
   the wait (up to `_MAX_BACKOFF` times), so a drafter that does not fit the text
   costs ever less.
2. It merges the trees (equal paths become one node) and estimates each node's
   probability of acceptance as a path product of per-(drafter, depth or copied
   run, sibling rank) acceptance rates learned online (a flat prior, but one that
   expects a started copy to go on for the continuing nodes of copies, less firmly
   when the request samples; siblings'
   conditional probabilities normalised to sum at most 1, since one child at most
   is accepted). The evidence is cross-fitted (`acceptance.py`): one half of each
   cell's verdicts chooses the tree, the other predicts it, so the telemetry's
   predicted acceptance is not flattered by the choice.
3. The policy picks k, the number of best-ranked nodes to verify: the expected
   tokens per second against the cost of a forward of k + 1 tokens, the cached
   measurement scaled to the realised rounds (`ThroughputPolicy`, the default;
   `cost_fit.py`) or UCB over node budgets (`UCBPolicy`).
   k = 0 — plain decoding — is always a candidate, so speculation switches itself
   off where it does not pay.
4. Every proposed node is measured, verified or not: the nodes left out of the
   verified tree (and all nodes of rounds with speculation off) get their verdict
   from the tokens the sequence commits next (`unverified.py`), so the rates of
   deep nodes stay measured while the controller verifies short trees, and
   speculation switches back on as soon as the proposals start to match.
5. While speculation is off (the last candidates did not pay, or every component sat
   out as too costly), rounds without proposals (plain decoding steps) space out the
   ones with, so that the controller's own work costs at most `_OFF_OVERHEAD_SHARE` of
   plain decoding, where a decode step is short beside it; a committed token that
   matches a held proposal ends the wait.
   An engine may run such rounds as plain decoding and report them at once
   (`plain_rounds`): the wait then ends when it reports them.
   A round whose components found nothing is not such a verdict: they are asked again
   next round.

Lossless by construction: the result is an ordinary tree of deterministic
candidates, verified by the engine's rules (docs/design.md#verification-precisely).
Components whose children are sampled from q cannot be merged and are refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from longspec.speculation.cost_model import ForwardCost, is_default
from longspec.speculation.drafters.adaptive.acceptance import CrossFittedAcceptance
from longspec.speculation.drafters.adaptive.cost_fit import RealisedCostScale
from longspec.speculation.drafters.adaptive.merge import MergedTree, merge_trees, subtree
from longspec.speculation.drafters.shared.policies import ThroughputPolicy, TreePolicy
from longspec.speculation.drafters.adaptive.unverified import UnverifiedNodes
from longspec.speculation.drafters.base import DraftContext, Drafter, check_drafter
from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation.tree import Tree

_EMA = 0.2  # weight of the newest round in moving averages
# A component costing more than this share of a plain decoding round is "expensive":
# it is called only in rounds where the cheap ones found nothing, and only while what
# it alone contributes pays for its time. Lookups cost a small fraction of a round
# (their timing noise must not flip them), a draft network's proposal a round or more
# (docs/lab-notes/auto-controller.md#auto-on-the-full-preset-issue-adaptive-speculation).
_CHEAP_SHARE = 0.2
# Probes of a costly drafter that do not pay double the wait before the next one, up
# to this many times `probe_every` rounds: such a probe is a loss whenever it shows
# nothing new.
_MAX_BACKOFF = 8
# While speculation is off, the controller's own work (the components' proposals,
# merging, estimating, recording) is spread over enough rounds that it costs at most
# this share of plain decoding: on a GPU a compiled decode step is short beside that
# work, so doing it every round made `auto` with every round off much slower than plain
# decoding (docs/lab-notes/gpu.md#on-an-h100-what-a-short-decode-step-asks-of-the-controller).
_OFF_OVERHEAD_SHARE = 0.01
# ... but it looks at the proposals at least every this many rounds, so speculation
# comes back within that many tokens of text that the drafters can predict.
_MAX_ROUNDS_WITHOUT_PROPOSALS = 32


@dataclass
class _Component:
    name: str
    drafter: Drafter
    seconds: float | None = None  # moving average of one propose() after a sequence's first
    provisional: bool = False  # `seconds` is a first call's: the next call replaces it
    exclusive_gain: float | None = None  # moving average of accepted tokens only it proposed, per call
    calls: int = 0
    rounds_out: int = 0  # consecutive rounds it sat out
    probe_wait: int = 0  # rounds out before the next probe call (set by the controller)
    credited: int = 0  # accepted tokens it proposed (shared credit counts for each proposer)


@dataclass
class ControllerTelemetry:
    rounds: int = 0
    speculation_off_rounds: int = 0  # root-only trees chosen (or rounds without proposals)
    rounds_without_proposals: int = 0  # off rounds that skipped the components (`_OFF_OVERHEAD_SHARE`)
    nodes_chosen: int = 0
    nodes_widened: int = 0  # nodes added to fill a batch forward's padding (`widen`)
    predicted_accepted: float = 0.0  # Σ over rounds of the chosen nodes' acceptance probabilities
    realised_accepted: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    credited_tokens: dict[str, int] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # components that do not fit the target, and why
    cost: dict = field(default_factory=dict)  # how the realised rounds correct the measured cost

    def as_dict(self) -> dict:
        rounds = max(self.rounds, 1)
        return {
            "rounds": self.rounds, "speculation_off_rounds": self.speculation_off_rounds,
            "rounds_without_proposals": self.rounds_without_proposals,
            "mean_nodes": self.nodes_chosen / rounds, "mean_nodes_widened": self.nodes_widened / rounds,
            "predicted_accepted_per_round": self.predicted_accepted / rounds,
            "realised_accepted_per_round": self.realised_accepted / rounds,
            "calls": dict(self.calls), "credited_tokens": dict(self.credited_tokens),
            "unavailable": dict(self.unavailable),
            **self.cost,
        }


class AdaptiveDrafter(Drafter):
    # Sizes its tree from the measured forward cost at the batch's width itself: a
    # batched engine's joint budget leaves its trees whole.
    sizes_tree_from_cost = True
    cost_fit_type = RealisedCostScale  # how realised rounds correct the measured cost (a replay swaps it)

    def __init__(
        self,
        components: Sequence[tuple[str, Drafter]],
        *,
        policy: TreePolicy | None = None,
        forward_cost: ForwardCost | None = None,
        probe_every: int = 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not components:
            raise ValueError("auto needs at least one component drafter")
        names = [name for name, _ in components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be distinct, got {names}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        for _, drafter in components:
            check_drafter(drafter)
        self.components = [_Component(name, drafter) for name, drafter in components]
        self.policy = policy if policy is not None else ThroughputPolicy()
        self.forward_cost = forward_cost
        self.probe_every = probe_every
        self.clock = clock  # times rounds and components (a replay passes a clock that runs its modeled forwards)
        self.telemetry_state = ControllerTelemetry()
        self.table = CrossFittedAcceptance(len(self.components))
        self._cost_fit = self.cost_fit_type()
        # Moving average of the controller's own seconds in a round with proposals
        # (the components' calls included): a machine's, carried over sequences.
        self._own_seconds: float | None = None
        # Rounds whose verdicts the acceptance table has yet to learn (`learn`), and
        # whether the engine calls `learn` during its forwards (else `observe` does).
        self._verdicts: list[tuple] = []
        self._deferred = False

    # --------------------------------------------------------------- protocol
    def check_target(self, config) -> None:
        """Components that do not fit the target (a draft trained for another model)
        are left out, with the reason in the telemetry; auto itself always fits."""
        fitting = []
        for component in self.components:
            try:
                component.drafter.check_target(config)
                fitting.append(component)
            except (ValueError, TypeError) as error:
                self.telemetry_state.unavailable[component.name] = str(error).splitlines()[0]
        if len(fitting) != len(self.components):
            self.components = fitting
            self.table = CrossFittedAcceptance(max(len(fitting), 1))

    @property
    def prefill_hidden_rows(self) -> int:
        return max((c.drafter.prefill_hidden_rows for c in self.components), default=0)

    def begin(self, context: DraftContext) -> None:
        self.learn()  # the last sequence's last round: what was learned carries over
        self._deferred = bool(context.learns_while_verifying)
        if context.target is not None:
            self.check_target(context.target.config)
        self.table.expect_sampling(context.sampled)
        for component in self.components:
            component.drafter.begin(context)
        if self.forward_cost is None or is_default(self.forward_cost):  # a default: the measurement may exist now
            if context.target is None:
                raise ValueError("auto needs the target view to measure its forward cost (or pass forward_cost)")
            self.forward_cost = self._measured_cost(context)
        self._cost_fit = self.cost_fit_type()  # the measured cost scaled to the realised rounds
        self._rows = 1  # sequences sharing the verification forward
        self._round: dict | None = None
        self._off = False  # the last round with proposals had candidates and chose plain decoding
        self._rounds_without_proposals = 0  # since the last round with proposals
        # Telemetry is per sequence; what was learned (acceptance, costs) carries over.
        self.telemetry_state = ControllerTelemetry(unavailable=self.telemetry_state.unavailable)
        for component in self.components:
            component.calls = component.credited = 0
            component.probe_wait = self.probe_every
        # Rounds' unverified nodes waiting for the committed tokens that decide them.
        self._unverified: list[tuple[UnverifiedNodes, list, list[bool]]] = []

    def plain_rounds(self) -> int:
        """How many coming rounds this controller proposes nothing in, whatever they
        commit: while speculation is off, those before it asks its components again.
        An engine may decode them as plain decoding without calling `propose` or
        `observe`, then hand over their tokens in one `observe`: where a decode step is
        short (a GPU's), what a round through a drafter costs the engine is then paid
        once for them all. 0: the next round goes through `propose`."""
        rounds = self._rounds_to_skip() - self._rounds_without_proposals if self._off else 0
        if rounds > 0:
            self._round = {"start": self.clock(), "skipped": True, "drafted_s": 0.0}
        return max(rounds, 0)

    def propose(self, context: DraftContext) -> Tree:
        start = self.clock()
        self._rows = max(int(context.rows_in_forward), 1)
        if self._off and self._rounds_without_proposals < self._rounds_to_skip():
            tree = Tree.chain(context.root, [])
            self._round = {"start": start, "skipped": True, "tree": tree, "drafted_s": self.clock() - start}
            return tree
        return self._propose_from_components(context, start)

    def _propose_from_components(self, context: DraftContext, start: float) -> Tree:
        self._rounds_without_proposals = 0
        budget = int(context.max_nodes)
        trees: list[tuple[int, Tree]] = []
        called = []
        cheap_nodes = 0  # speculative nodes the cheap components proposed this round
        # Cheap (and not yet measured) components first; an expensive one only in a round
        # where they found nothing: where lookups hit, what it adds rarely pays its time.
        expensive_flags = [self._expensive(c) for c in self.components]
        for index in sorted(range(len(self.components)), key=expensive_flags.__getitem__):
            component, expensive = self.components[index], expensive_flags[index]
            pays = not expensive or self._pays(component)
            if budget <= 0 or (expensive and cheap_nodes) or not (pays or component.rounds_out + 1 >= component.probe_wait):
                component.rounds_out += 1
                continue
            # A call that pays resets the wait; a probe that was due doubles it.
            component.probe_wait = self.probe_every if pays else self._backed_off(component.probe_wait)
            t0 = self.clock()
            tree = component.drafter.propose(context)
            self._time_call(component, self.clock() - t0)
            component.calls += 1
            component.rounds_out = 0
            called.append(index)
            trees.append((index, tree))
            if isinstance(tree, CopiedTree):
                self.table.note_copying(index)
            if not expensive:
                cheap_nodes += tree.size - 1
        merged = merge_trees(context.root, trees)
        agreement = _agreement(merged)
        expected, optimistic = self._acceptance(merged, agreement)
        # Path products never grow along a path, so any prefix of this ranking
        # (ties broken by index: parents precede children) is a tree.
        order = sorted(range(1, merged.tree.size), key=lambda n: (-optimistic[n], n))[:budget]
        drafted_s = self.clock() - start
        base = self._measured_forward(0)
        k = self.policy.choose([optimistic[n] for n in order],
                               lambda k: drafted_s + self._verify_seconds(k, base))
        tree, kept = subtree(merged, order[:k])
        self._round = {"start": start, "merged": merged, "agreement": agreement, "kept": kept, "called": called, "k": k,
                       "predicted": sum(expected[n] for n in order[:k]), "drafted_s": drafted_s, "order": order,
                       "expected": expected, "tree": tree}
        return tree

    def widen(self, context: DraftContext, nodes: int) -> Tree:
        """This round's tree with the next best nodes added, up to `nodes` speculative
        nodes (and the budget): the batched engine asks (with `fill_padding`) when
        another row's tree is wider. The policy keeps its choice (`k`); the added nodes
        are verified, recorded and predicted like the others."""
        round_ = self._round
        if round_ is None:
            raise RuntimeError("widen() follows propose() in the same round")
        if round_.get("skipped"):  # the padding is free: ask the components after all
            self._propose_from_components(context, round_["start"])
            round_ = self._round
        order = round_["order"]
        count = min(int(nodes), int(context.max_nodes), len(order))
        if count > len(round_["kept"]) - 1:
            round_["tree"], round_["kept"] = subtree(round_["merged"], order[:count])
            round_["predicted"] = sum(round_["expected"][n] for n in order[:count])
        return round_["tree"]

    def observe(self, committed: torch.Tensor) -> None:
        self.learn()  # the last round's verdicts first: held nodes are decided in order
        for component in self.components:
            component.drafter.observe(committed)
        round_ = self._round
        if round_ is None:  # a round this controller did not draft: its tokens still decide earlier nodes
            self._resolve_unverified(committed.tolist())
            return
        self._round = None
        seconds = self.clock() - round_["start"]
        base = self._measured_forward(0)
        t = self.telemetry_state
        if round_.get("skipped"):  # plain decoding, one token a round (`propose`'s or `plain_rounds`')
            rounds = int(committed.numel())
            self._rounds_without_proposals += rounds
            for component in self.components:
                component.rounds_out += rounds  # a costly one's probe wait counts the sequence's rounds
            if self._resolve_unverified(committed.tolist()):
                self._off = False  # the last proposals start to match: ask the components next round
            for _ in range(rounds):
                self._cost_fit.observe(base, 0.0, max(seconds - round_["drafted_s"], 1e-9) / rounds, 0)
            t.rounds += rounds
            t.speculation_off_rounds += rounds
            t.rounds_without_proposals += rounds
            return
        t.rounds += 1
        observe_start = self.clock()
        merged: MergedTree = round_["merged"]
        kept = round_["kept"]
        accepted_nodes = _accepted_path(merged, kept, committed)
        agreement = round_["agreement"]
        on_path = set(accepted_nodes) | {0}
        exclusive = {index: 0 for index in round_["called"]}
        for node in accepted_nodes:
            proposers = {s.drafter for s in merged.sources[node]}
            for index in proposers:
                self.components[index].credited += 1
            if len(proposers) == 1:
                exclusive[next(iter(proposers))] += 1
        # The acceptance table learns from the verdicts now or, where the engine calls
        # `learn` during the next verification forward, then.
        self._verdicts.append((merged, kept, on_path, agreement, committed.tolist()))
        if not self._deferred:
            self.learn()
        for index, gained in exclusive.items():
            component = self.components[index]
            previous = component.exclusive_gain
            component.exclusive_gain = gained if previous is None else (1 - _EMA) * previous + _EMA * gained
        # The machine now against the cost model's measurement (load, context growth);
        # in a batch the round's wall time spans the whole shared forward, priced at the
        # nodes this row verified.
        whole = self._measured_forward(len(kept) - 1)
        self._cost_fit.observe(base, whole - base, max(seconds - round_["drafted_s"], 1e-9),
                              len(accepted_nodes))
        self.policy.update(round_["k"], int(committed.numel()), seconds, self._verify_seconds(0))
        # Plain decoding chosen over candidates: they do not pay, so the next rounds skip
        # asking. A round whose components found nothing says nothing about the next one
        # (a lookup that missed may hit at the next token): they are asked again. A round
        # in which every component sat out (too costly for what it adds, or no node
        # budget) is off too: asking again next round only finds them sitting out, and
        # in a batch, where a row's share of the forward is short, that asking cost
        # 16 rows of `auto` over garbage most of their rounds
        # (docs/lab-notes/auto-controller.md#batched-rows-asked-a-controller-whose-components-all-sat-out).
        self._off = round_["k"] == 0 and (bool(round_["order"]) or not round_["called"])
        own = round_["drafted_s"] + self.clock() - observe_start
        self._own_seconds = own if self._own_seconds is None else (1 - _EMA) * self._own_seconds + _EMA * own
        t.speculation_off_rounds += round_["k"] == 0
        t.nodes_chosen += round_["k"]
        t.nodes_widened += len(kept) - 1 - round_["k"]
        t.predicted_accepted += round_["predicted"]
        t.realised_accepted += len(accepted_nodes)

    def learn(self) -> None:
        """Record the queued rounds' verdicts in the acceptance table: each verified node
        whose parent was accepted, accepted or not; the nodes left unverified held until
        the committed tokens decide them. Where the engine calls this while the next
        forward runs (`DraftContext.learns_while_verifying`), also the rates that round's
        successor will rank its nodes with, so that none of this waits for the host."""
        if not self._verdicts:
            return
        for merged, kept, on_path, agreement, committed in self._verdicts:
            parents = merged.parents
            for node in kept[1:]:
                if parents[node] not in on_path:
                    continue  # its parent was rejected: this node was never tested
                for source in merged.sources[node]:
                    self.table.record(source, node in on_path, agreement[node])
            self._hold_unverified(merged, kept, agreement)
            self._resolve_unverified(committed)
            self.table.end_round()
        self._verdicts.clear()
        if self._deferred:
            self.table.deciding_rates()

    def telemetry(self) -> dict:
        t = self.telemetry_state
        t.calls = {c.name: c.calls for c in self.components}
        t.credited_tokens = {c.name: c.credited for c in self.components}
        t.cost = {**self._cost_fit.telemetry(),
                  "cost_curve": "default" if self.forward_cost is not None and is_default(self.forward_cost)
                  else "measured"}
        return t.as_dict()

    def state_nbytes(self) -> int:
        return sum(c.drafter.state_nbytes() for c in self.components)

    # --------------------------------------------------------------- internals
    def _hold_unverified(self, merged: MergedTree, kept: list[int], agreement: list[bool]) -> None:
        """Keep this round's proposed nodes that were not verified until the committed
        tokens decide them (this round's tokens are the first of their continuation)."""
        kept_set = set(kept)
        left_out = [node for node in range(1, len(merged.tokens)) if node not in kept_set]
        if left_out:
            nodes = UnverifiedNodes(merged.tokens, merged.parents, merged.depths, left_out)
            self._unverified.append((nodes, merged.sources, agreement))

    def _resolve_unverified(self, committed: list[int]) -> int:
        """Record the verdicts the newly committed tokens give on held nodes; how many
        were accepted."""
        matched = 0
        for nodes, sources, agreed in self._unverified:
            for node, accepted in nodes.resolve(committed):
                matched += accepted
                for source in sources[node]:
                    self.table.record(source, accepted, agreed[node])
        self._unverified = [entry for entry in self._unverified if entry[0].pending]
        return matched

    def _measured_cost(self, context: DraftContext) -> ForwardCost:
        return context.target.forward_cost(int(context.tokens.numel()))

    def _measured_forward(self, k: int) -> float:
        """The measured seconds of a forward in which every row verifies k + 1 tokens."""
        return self.forward_cost.seconds_for(self._rows * (k + 1))

    def _verify_seconds(self, k: int, base: float | None = None) -> float:
        """This row's share of a forward in which every row verifies k + 1 tokens (in a
        batch, its nodes are priced at the batch's width, not alone), as the machine
        runs it now. `base`: `_measured_forward(0)`, where the caller has it."""
        base = self._measured_forward(0) if base is None else base
        return self._cost_fit.seconds(base, self._measured_forward(k) - base) / self._rows

    @staticmethod
    def _time_call(component: _Component, elapsed: float) -> None:
        """Fold one propose() into the component's cost. A sequence's first call also
        pays one-off work (a draft network catching up on the prompt's last window, several
        times a later round's cost: docs/lab-notes/auto-controller.md#auto-on-the-full-preset-issue-adaptive-speculation),
        a cost no later call repeats: it only stands in until a second call is timed."""
        if component.calls == 0:
            if component.seconds is None:
                component.seconds, component.provisional = elapsed, True
        elif component.provisional:
            component.seconds, component.provisional = elapsed, False
        else:
            component.seconds = (1 - _EMA) * component.seconds + _EMA * elapsed

    def _rounds_to_skip(self) -> int:
        """Rounds without proposals between two with, while speculation is off: enough
        that the controller's own work costs at most `_OFF_OVERHEAD_SHARE` of plain
        decoding, within `_MAX_ROUNDS_WITHOUT_PROPOSALS`."""
        if not self._own_seconds:
            return 0
        plain = _OFF_OVERHEAD_SHARE * self._verify_seconds(0)
        return min(math.ceil(self._own_seconds / plain) - 1, _MAX_ROUNDS_WITHOUT_PROPOSALS)

    def _backed_off(self, wait: int) -> int:
        """The wait after a probe that did not pay: twice as long, within the cap."""
        return min(2 * wait, _MAX_BACKOFF * self.probe_every)

    def _expensive(self, component: _Component) -> bool:
        """Measured to cost more than a small share of a plain decoding round; before
        it was measured, whether it runs a draft network (`runs_model`)."""
        if component.seconds is None:
            return component.drafter.runs_model
        return component.seconds > _CHEAP_SHARE * self._verify_seconds(0)

    def _pays(self, component: _Component) -> bool:
        """An expensive component pays while the tokens only it adds (per call) are
        worth its time at the current rate (and before its first call was observed)."""
        if component.exclusive_gain is None:
            return True
        ar_seconds = self._verify_seconds(0)
        seconds_per_token = ar_seconds / max(1.0, self._recent_tokens_per_round())
        return component.exclusive_gain * seconds_per_token > component.seconds

    def _recent_tokens_per_round(self) -> float:
        t = self.telemetry_state
        return 1.0 + t.realised_accepted / t.rounds if t.rounds else 1.0

    def _acceptance(self, merged: MergedTree, agreement: list[bool]) -> tuple[list[float], list[float]]:
        """P(node accepted) per merged node from the table's means and from its
        optimistic rates: path products of conditional rates; a node proposed by
        several drafters takes the best of their rates."""
        cell, parents, size = self.table.cell, merged.parents, len(merged.tokens)
        if size == 1:  # nothing proposed: no rates needed
            return [1.0], [1.0]
        # Siblings (normalised below); a chain (the common round) has none.
        siblings: list[list[int]] = []
        if parents != list(range(-1, size - 1)):
            by_parent: dict[int, list[int]] = {}
            for node in range(1, size):
                by_parent.setdefault(parents[node], []).append(node)
            siblings = [children for children in by_parent.values() if len(children) > 1]
        cells = [[cell(s, agreement[n]) for s in merged.sources[n]] for n in range(size)]
        estimates = []
        for rates in (self.table.predicting_rates(), self.table.deciding_rates()):
            rate = rates.item  # a Python float per cell
            conditional = [1.0] + [rate(*c[0]) if len(c) == 1 else max(rate(*index) for index in c) for c in cells[1:]]
            # One child at most is accepted: siblings' conditionals sum to at most 1.
            for children in siblings:
                total = sum(conditional[c] for c in children)
                if total > 1.0:
                    for c in children:
                        conditional[c] /= total
            probability = [1.0] * size
            for node, parent in enumerate(parents[1:], start=1):  # parents precede children
                probability[node] = probability[parent] * conditional[node]
            estimates.append(probability)
        return estimates[0], estimates[1]


def _agreement(merged: MergedTree) -> list[bool]:
    """Per node: proposed by several drafters, or continuing such a node with one of
    the drafters that proposed it (the tail of a chain two drafters began together)."""
    sources, parents = merged.sources, merged.parents
    agreed = [False] * len(parents)
    for node in range(1, len(parents)):
        drafters = {s.drafter for s in sources[node]}
        parent = parents[node]
        agreed[node] = len(drafters) > 1 or (agreed[parent] and bool(drafters & {s.drafter for s in sources[parent]}))
    return agreed


def _accepted_path(merged: MergedTree, kept: list[int], committed: torch.Tensor) -> list[int]:
    """Merged-tree nodes (among `kept`) on the accepted path: the committed tokens
    but the last (the bonus) walked down from the root."""
    kept_set = set(kept)
    parents, tokens = merged.parents, merged.tokens
    children: dict[int, dict[int, int]] = {}
    for node in kept[1:]:
        children.setdefault(parents[node], {}).setdefault(tokens[node], node)
    path, node = [], 0
    for token in committed.tolist()[:-1]:
        node = children.get(node, {}).get(int(token))
        if node is None or node not in kept_set:
            break
        path.append(node)
    return path
