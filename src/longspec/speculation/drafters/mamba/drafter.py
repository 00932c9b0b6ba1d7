"""Mamba (state-space) drafter: an external drafter whose per-sequence state is
constant in the context (a convolution window and an SSM state per layer), with tree
drafting by batching copied states (no tree attention), after "Mamba Drafters for
Speculative Decoding".

A tree configuration (N1, ..., Nγ) is drafted breadth-first: depth i holds
N1·…·Ni nodes, each branch a copy of its parent's state (into buffers kept per depth),
fed its own token in one batched step; children are the parent's top-N(i+1) tokens
(deterministic candidates, verified by the one-draw rule, so greedy and sampled
decoding both stay lossless). The model is `transformers`' Mamba; its states and step
are `state.py`'s (the native CPU scan and state update where they apply).

The prompt goes in one forward from the empty state; after each round the drafter
resumes from the state it already computed for the deepest accepted node, feeding only
the tokens after it (the bonus; several in one pass when it was not asked for a while).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from longspec.speculation.drafters.shared.policies import UCBPolicy, mamba_reward
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.shared.errors import DraftMismatchError
from longspec.speculation.drafters.mamba.state import MambaState, MambaStepper
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.speculation.tree import Tree

# The paper's arms for its test-time search (its default shape is the first, for a GPU).
PAPER_TREES = ((3, 3, 2, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1))
# Default shape: a chain. On a 2-core CPU the paper's 48-node tree ran far slower than
# this chain with the shipped drafter
# (docs/lab-notes/mamba-and-draft-models.md#end-to-end-the-shipped-drafters-do-not-pay-on-this-cpu): verifying 49
# tokens costs several decode steps there, and its wide depths multiply the drafter's work.
DEFAULT_WIDTHS = (1, 1, 1, 1)
SHIPPED_DRAFTER = "mamba-gemma-3-270m"  # in longspec/weights, for the embedded target


def shipped_drafter_path() -> Path:
    return Path(str(resources.files("longspec") / "weights" / SHIPPED_DRAFTER))


def check_tree_config(widths: Sequence[int]) -> tuple[int, ...]:
    widths = tuple(widths)
    if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"a tree configuration is a non-empty sequence of widths >= 1, got {widths!r}")
    return widths


def tree_nodes(widths: Sequence[int]) -> int:
    """Speculative nodes of a configuration: N1 + N1·N2 + ... ."""
    total, level = 0, 1
    for width in widths:
        level *= width
        total += level
    return total


class MambaDrafter(Drafter):
    runs_model = True  # each proposal runs the drafter network (see drafters.base)

    def __init__(self, model=None, *, widths: Sequence[int] = DEFAULT_WIDTHS, search: Sequence[Sequence[int]] | None = None,
                 exploration: float = 1.0, vocab: VocabMap | None = None) -> None:
        """model: a `transformers` Mamba causal LM, or a checkpoint directory / local
        model id of one (with its reduced vocabulary, `longspec-vocab.json`, when it
        was trained with one); default: the drafter shipped for the embedded Gemma 3
        270M (checked against the actual target when generation begins). vocab: the
        reduced vocabulary of a model passed as an object (None: it speaks the target's
        ids). widths: the tree configuration (N1, ..., Nγ). search: tree
        configurations to choose among per round (the paper's test-time tree search,
        e.g. `PAPER_TREES`): UCB1 with the paper's reward -(1/N + λγ/N), N the tokens a
        round commits (the bonus counted), γ the configuration's depth, λ the measured
        cost of a draft step over a verification round; `widths` is then ignored."""
        if model is None:
            model = shipped_drafter_path()
            if not model.is_dir():
                raise FileNotFoundError(f"no Mamba drafter at {model}: this installation lacks the shipped one; pass "
                                        "model=PATH (train one with `longspec train mamba --model ... --out DIR`)")
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            if vocab is None:
                vocab = VocabMap.load(model)
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, local_files_only=True)
        self.vocab = vocab
        self.model = model.eval().requires_grad_(False)
        self.stepper = MambaStepper(self.model)
        self.widths = check_tree_config(widths)
        self.configs = tuple(check_tree_config(w) for w in search) if search is not None else (self.widths,)
        if not self.configs:
            raise ValueError("search needs at least one tree configuration")
        self.bandit = UCBPolicy(arms=range(len(self.configs)), exploration=exploration) if search is not None else None
        self._arm = 0
        self._step_seconds = 0.0  # last round: draft seconds per depth drafted
        self._cost_ratio: float | None = None  # λ: a draft step over a verification round, smoothed
        self._proposed_at: float | None = None
        self._drafted_depth = 0
        self.state: MambaState | None = None  # the state after every committed token but those in `_unfed`
        self._buffers: dict[int, MambaState] = {}  # per depth: the branches' states, reused round after round
        self._unfed: list[int] = []  # committed tokens not yet in `state` (the root last)
        self._root_logits: torch.Tensor | None = None
        self._levels: list = []  # per depth: (tokens [n_d], parent index [n_d] into depth d-1, state after them)
        self._vocab_size: int | None = None

    # --------------------------------------------------------------- protocol
    def check_target(self, config) -> None:
        draft = self.model.config
        if self.vocab is not None:
            self.vocab.check_fits("Mamba drafter", draft.vocab_size, config)
            return
        problems = []
        if draft.vocab_size > config.vocab_size:
            problems.append(f"vocabulary: draft {draft.vocab_size} ids vs target {config.vocab_size}")
        eos = draft.eos_token_id if isinstance(draft.eos_token_id, (list, tuple)) else [draft.eos_token_id]
        if draft.eos_token_id is not None and not set(eos) <= set(config.eos_token_ids):
            problems.append(f"end-of-sequence ids: draft {sorted(eos)} vs target {sorted(config.eos_token_ids)}")
        if problems:
            raise DraftMismatchError("the Mamba drafter does not share the target's tokenizer (" + "; ".join(problems)
                                     + "); use a drafter trained with the target's tokenizer")

    def begin(self, context: DraftContext) -> None:
        view = context.target
        self._vocab_size = self.model.config.vocab_size
        if view is not None:
            self.check_target(view.config)
            self._vocab_size = view.config.vocab_size
            self.model.to(device=view.device, dtype=view.dtype)
            if self.vocab is not None:
                self.vocab = self.vocab.to(view.device)
        if not self.stepper.prepared_for(self.model):  # moved (here or by another user of the model)
            self.stepper = MambaStepper(self.model)
            self._buffers = {}
        self.state = None
        self._unfed = context.tokens.tolist()
        self._levels = []

    def observe(self, committed: torch.Tensor) -> None:
        """Resume from the drafted state of the deepest accepted node; the tokens
        after it wait for the next round. With a search, reward the round's arm."""
        tokens = committed.tolist()
        if self.bandit is not None and self._drafted_depth and self._proposed_at is not None:
            verify_seconds = time.perf_counter() - self._proposed_at
            ratio = self._step_seconds / max(verify_seconds, 1e-9)
            self._cost_ratio = ratio if self._cost_ratio is None else 0.9 * self._cost_ratio + 0.1 * ratio
            self.bandit.record(self._arm, mamba_reward(len(tokens), self._drafted_depth, self._cost_ratio))
        path: list[int] = []  # batch row of the accepted node at each depth
        while len(path) < min(len(tokens), len(self._levels)):
            depth = len(path)
            level_tokens, parents, _ = self._levels[depth]
            match = [i for i, token in enumerate(level_tokens)
                     if token == tokens[depth] and (depth == 0 or parents[i] == path[-1])]
            if not match:
                break
            path.append(match[0])
        # The deepest accepted node whose state was computed (the last depth's was not).
        while path and self._levels[len(path) - 1][2] is None:
            path.pop()
        if path:
            level_state = self._levels[len(path) - 1][2]
            self.state = level_state.select(torch.tensor([path[-1]], device=self._device))
            self._unfed = tokens[len(path):]
        else:
            self._unfed.extend(tokens)
        self._levels = []

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_nbytes(self) -> int:
        return self.state.nbytes() if self.state is not None else 0

    @property
    def arm_counts(self) -> dict[tuple[int, ...], int]:
        """Rounds drafted with each tree configuration (the search's choices)."""
        counts = self.bandit.counts if self.bandit is not None else [0]
        return dict(zip(self.configs, counts))

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Tree:
        started = time.perf_counter()
        self._drafted_depth = 0
        if self.bandit is not None:
            self._arm = self.bandit.best_arm()
        widths = self._fitting_widths(self.configs[self._arm], int(context.max_nodes))
        if not widths:
            return Tree.chain(context.root, [])
        if self._unfed:
            self._root_logits = self._catch_up()
        tokens, parents = [context.root], [-1]
        logits = self._root_logits.unsqueeze(0)  # [1, V] at the root
        level_state, level_nodes = self.state, [0]  # tree indices of the previous depth's nodes
        self._levels = []
        for depth, width in enumerate(widths):
            top = torch.topk(self._candidates(logits).float(), width, dim=-1).indices  # [n_prev, width]
            new_tokens = top.reshape(-1)  # the drafter's ids
            target_tokens = self._target_ids(new_tokens).tolist()
            parent_rows = torch.arange(top.shape[0], device=top.device).repeat_interleave(width)
            first = len(tokens)
            tokens.extend(target_tokens)
            parents.extend(level_nodes[p] for p in parent_rows.tolist())
            level_nodes = list(range(first, len(tokens)))
            state = None
            if depth + 1 < len(widths):  # the last depth's tokens need no forward
                state = level_state.select(parent_rows, out=self._buffers.get(depth))
                self._buffers[depth] = state
                logits = self.stepper.step(state, new_tokens)
            self._levels.append((target_tokens, parent_rows.tolist(), state))
            level_state = state
        self._proposed_at = time.perf_counter()
        self._drafted_depth = len(widths)
        self._step_seconds = (self._proposed_at - started) / len(widths)
        return Tree.from_parents(tokens, parents)

    # ---------------------------------------------------------------- internals
    def _candidates(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of the ids the drafter may propose (its reduced vocabulary's "other" id never)."""
        return self.vocab.hide_other(logits) if self.vocab is not None else logits

    def _target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.to_target(draft_ids) if self.vocab is not None else draft_ids

    @staticmethod
    def _fitting_widths(widths: tuple[int, ...], budget: int) -> tuple[int, ...]:
        """The configuration cut to the node budget (deepest levels dropped first)."""
        while widths and tree_nodes(widths) > budget:
            widths = widths[:-1]
        return widths

    def _catch_up(self) -> torch.Tensor:
        """Feed the committed tokens the state has not seen; the logits after the root."""
        ids = torch.tensor(self._unfed, device=self._device)
        ids = self.vocab.to_draft(ids) if self.vocab is not None else ids
        self._unfed = []
        if self.state is not None and ids.numel() == 1:
            return self.stepper.step(self.state, ids)[0]
        logits, self.state = self.stepper.run(ids, self.state)  # one pass (from the empty state for a prompt)
        return logits
