"""Prompt lookup decoding (PLD): draft the tokens that followed an earlier
occurrence of the sequence's last n tokens.

Matching is served by an incremental hash index, one per n-gram size: n-gram tuple
-> increasing list of the positions where that n-gram *ends*. Only n-grams followed
by at least one committed token are indexed, so the current suffix (which ends at
the root) never matches itself; a match may overlap the suffix, as in repetitive
text, exactly like the windowed search of transformers' prompt lookup.
"""

from __future__ import annotations

import torch

from longspec.speculation.drafters.base import DraftContext, Drafter, container_nbytes
from longspec.speculation.drafters.shared.chains import chains_tree
from longspec.speculation.drafters.shared.checks import check_positive_int
from longspec.speculation.tree import Tree


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding over the whole committed sequence (prompt + output).

    For n from ``max_ngram`` down to ``min_ngram``, the last n tokens (root
    included) are looked up among earlier n-grams; the largest n with a match wins
    and shorter n are not consulted. The draft is the (up to ``num_tokens``) tokens
    that followed the **most recent** earlier occurrence. (transformers'
    ``prompt_lookup`` takes the first, i.e. oldest, match; the most recent one is
    usually closer in topic and format to what is being generated, so we prefer it.)

    A continuation that reaches the end of the committed sequence stops there (the
    standard method; with a loop of period p, copies are at most p tokens long).
    With ``continue_copies`` it goes on with the tokens it has itself drafted, as the
    text would if it kept repeating: a loop of period 10 is then copied 32 tokens at a
    time when ``num_tokens`` is 32. Verification decides as for any draft.

    With ``longest_run`` the copy follows, of the ``scan_factor`` most recent
    occurrences, the one whose preceding tokens agree longest with the sequence's
    (`CopiedTree.copied_runs`; the most recent among equals): in a loop whose short n-grams
    recur at other phases, the most recent match can break off after a few tokens
    where an older one continues (`auto` copies this way;
    docs/lab-notes/prompt-lookup.md#a-lookup-that-locked-auto-into-the-wrong-points-of-a-loop).

    With ``max_candidates > 1`` the most recent occurrences whose continuations
    differ are merged into one tree (most recent first, shared prefixes merged by
    `Tree.with_chains`). At most ``scan_factor * max_candidates`` of the most
    recent occurrences are examined, so a long run of identical continuations
    cannot make ``propose`` scan the whole sequence.

    The tree never has more than ``context.max_nodes`` speculative nodes; with no
    match it is root-only.

    Complexity, with L the sequence length, G = max_ngram - min_ngram + 1 and
    c the tokens committed per round:
      * ``begin``: O(L·G) dict insertions (once per sequence);
      * ``observe``: O(c·G) (amortized O(1) per committed token);
      * ``propose``: O(G·max_ngram + scan_factor·max_candidates·num_tokens),
        independent of L;
      * memory: O(L·G) positions.

    The drafter keeps its own copy of the committed tokens, fed by ``begin`` and
    ``observe``. ``propose`` checks it against the context (length and the token
    at the last known position) and catches up from the context when they differ,
    so it is also correct when ``observe`` is not called.
    """

    scan_factor = 8
    # Copied runs are measured up to this length (`CopiedTree.copied_runs`): a controller's
    # acceptance no longer changes with the run length long before it.
    max_run = 64

    def __init__(
        self,
        num_tokens: int = 10,
        min_ngram: int = 1,
        max_ngram: int = 3,
        max_candidates: int = 1,
        continue_copies: bool = False,
        longest_run: bool = False,
    ) -> None:
        self.num_tokens = check_positive_int("num_tokens", num_tokens, 1)
        self.min_ngram = check_positive_int("min_ngram", min_ngram, 1)
        self.max_ngram = check_positive_int("max_ngram", max_ngram, 1)
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
        self.max_candidates = check_positive_int("max_candidates", max_candidates, 1)
        if not isinstance(continue_copies, bool):
            raise ValueError(f"continue_copies must be a bool, got {continue_copies!r}")
        self.continue_copies = continue_copies
        if not isinstance(longest_run, bool):
            raise ValueError(f"longest_run must be a bool, got {longest_run!r}")
        self.longest_run = longest_run
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._tokens: list[int] = []
        # n -> {n-gram tuple -> increasing end positions}
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(self.min_ngram, self.max_ngram + 1)
        }
        self._next_end = 0  # n-grams ending before this position are indexed

    def _extend(self, new: list[int]) -> None:
        if not new:
            return
        toks = self._tokens
        toks.extend(new)
        stop = len(toks) - 1  # index ends e < stop: each has a following token
        for n, index in self._index.items():
            start = max(self._next_end, n - 1)
            if start >= stop:
                continue
            columns = [toks[start - n + 1 + j : stop - n + 1 + j] for j in range(n)]
            get = index.get
            for end, key in zip(range(start, stop), zip(*columns)):
                ends = get(key)
                if ends is None:
                    index[key] = [end]
                else:
                    ends.append(end)
        self._next_end = max(self._next_end, stop)

    def _sync(self, tokens: torch.Tensor) -> None:
        seen = len(self._tokens)
        total = tokens.numel()
        if total < seen or (seen and int(tokens[seen - 1]) != self._tokens[-1]):
            self._reset()
            seen = 0
        if total > seen:
            self._extend(tokens[seen:].tolist())

    # --------------------------------------------------------------- protocol
    def begin(self, context: DraftContext) -> None:
        self._reset()
        self._extend(torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1).tolist())

    def observe(self, committed: torch.Tensor) -> None:
        self._extend(torch.as_tensor(committed, dtype=torch.long).reshape(-1).tolist())

    def state_nbytes(self) -> int:
        """The token list and the n-gram index: linear in the sequence length."""
        return container_nbytes((self._tokens, self._index))

    def propose(self, context: DraftContext) -> Tree:
        tokens = torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1)
        self._sync(tokens)
        root = int(tokens[-1])
        limit = min(self.num_tokens, int(context.max_nodes))
        if limit <= 0:
            return Tree.chain(root, [])
        matches = self._matches(limit)
        return chains_tree(root, [chain for _, chain in matches], context.max_nodes,
                           runs=[self._run_length(end) for end, _ in matches])

    # ----------------------------------------------------------------- lookup
    def lookup(self, limit: int | None = None) -> list[list[int]]:
        """Continuations (each at most ``limit`` tokens, default ``num_tokens``) of
        the most recent earlier occurrences of the longest matching suffix, most
        recent first, at most ``max_candidates`` distinct ones; ``[]`` if none."""
        return [chain for _, chain in self._matches(self.num_tokens if limit is None else limit)]

    def _matches(self, limit: int) -> list[tuple[int, list[int]]]:
        """(end, continuation) of each occurrence `lookup` returns, `end` being the
        position where the matched earlier n-gram ends."""
        toks = self._tokens
        length = len(toks)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n > length - 1:
                continue
            ends = self._index[n].get(tuple(toks[length - n :]))
            if not ends:
                continue
            if self.max_candidates == 1:
                end = self._longest_run_end(ends) if self.longest_run else ends[-1]
                return [(end, self._continuation(end, limit))]
            matches: list[tuple[int, list[int]]] = []
            seen: set[tuple[int, ...]] = set()
            scan = self.scan_factor * self.max_candidates
            for i in range(len(ends) - 1, max(len(ends) - 1 - scan, -1), -1):
                end = ends[i]
                cont = tuple(self._continuation(end, limit))
                if cont not in seen:
                    seen.add(cont)
                    matches.append((end, list(cont)))
                    if len(matches) == self.max_candidates:
                        break
            return matches
        return []

    def _continuation(self, end: int, limit: int) -> list[int]:
        """At most `limit` tokens that followed position `end`; with `continue_copies`,
        a copy that reaches the sequence's end continues with its own first tokens
        (the copy's source then lies in what it drafted: period = length - 1 - end)."""
        toks = self._tokens
        copied = toks[end + 1 : end + 1 + limit]
        if self.continue_copies and copied and len(copied) < limit:
            period = len(copied)
            copied = [copied[i % period] for i in range(limit)]
        return copied

    def _longest_run_end(self, ends: list[int]) -> int:
        """Of the `scan_factor` most recent occurrences, the one whose preceding tokens
        agree longest with the sequence's (the most recent among equals)."""
        best, best_run = ends[-1], self._run_length(ends[-1])
        for i in range(len(ends) - 2, max(len(ends) - 1 - self.scan_factor, -1), -1):
            if best_run >= self.max_run:
                break
            run = self._run_length(ends[i])
            if run > best_run:
                best, best_run = ends[i], run
        return best

    def _run_length(self, end: int) -> int:
        """How many tokens, back from the root, equal those back from `end` (the
        copied run the continuation after `end` extends), at most `max_run`."""
        toks = self._tokens
        last = len(toks) - 1
        run = 0
        while run < self.max_run and run <= end and toks[end - run] == toks[last - run]:
            run += 1
        return run
