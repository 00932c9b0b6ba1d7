"""A suffix cache across requests: an index of earlier sequences (a prompt's tail and
its output) whose n-grams point at what followed them, shared by every request of a
model (one per process or server replica). Repeated agentic and templated traffic
(the same JSON record shape, the same boilerplate) is then drafted from earlier
requests, in the spirit of ArcticInference's suffix decoding and llama.cpp's n-gram
cache. It only proposes: verification keeps every output plain decoding's.

Memory is bounded: inserting past `max_bytes` evicts the oldest sequences first. The
bytes are an upper-bound estimate from counts (tokens, keys, occurrences), checked
against the measured size of the structures in tests/test_suffix_cache.py.
Thread-safe: one lock around inserts and lookups (a lookup costs microseconds).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from longspec.speculation.drafters.shared.checks import check_positive_int

DEFAULT_MEGABYTES = 64  # `longspec.load` and `longspec serve --suffix-cache-mb`
_POSITION_BITS = 32  # an occurrence is one int: sequence id << 32 | end position
_POSITION_MASK = (1 << _POSITION_BITS) - 1

# Estimated bytes (CPython 3, 64-bit), rounded up: a sequence's array header and its
# entries in the order and duplicate maps; an index key (a hashed n-gram int, its dict
# slot, its list of occurrences); one occurrence (the packed int and its list slot);
# one stored token (array("l")).
_SEQUENCE_BYTES = 400
_KEY_BYTES = 200
_OCCURRENCE_BYTES = 48
_TOKEN_BYTES = 8


def check_cache_bytes(name: str, value: object) -> int:
    """`value` when it is an int >= 0 (bools refused), else a ValueError naming the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number of bytes >= 0 (0 turns the suffix cache off), "
                         f"got {value!r}")
    return value


class SuffixCache:
    """Earlier sequences, indexed by their n-grams (n from `min_ngram` to `max_ngram`).

    `insert(prompt, output)` stores the prompt's last `prompt_tail` tokens and the
    output (so a prompt's ending predicts the output's start); `lookup(suffix, ...)`
    returns the continuations that followed the longest n-gram of `suffix` that was
    seen before, as far as most of its occurrences agree. Each n-gram keeps its `max_occurrences` most recent occurrences, so
    a lookup and an eviction cost a bounded amount of work whatever the traffic."""

    def __init__(self, max_bytes: int, *, min_ngram: int = 1, max_ngram: int = 4, prompt_tail: int = 32,
                 max_occurrences: int = 32, max_run: int = 64, min_probability: float = 0.5) -> None:
        self.max_bytes = check_cache_bytes("max_bytes", max_bytes)
        self.min_ngram = check_positive_int("min_ngram", min_ngram, 1)
        self.max_ngram = check_positive_int("max_ngram", max_ngram, 1)
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
        self.prompt_tail = check_positive_int("prompt_tail", prompt_tail, 0)
        self.max_occurrences = check_positive_int("max_occurrences", max_occurrences, 1)
        self.max_run = check_positive_int("max_run", max_run, 1)
        if isinstance(min_probability, bool) or not isinstance(min_probability, (int, float)) \
                or not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"min_probability is a share in [0, 1], got {min_probability!r}")
        self.min_probability = float(min_probability)
        self._lock = threading.Lock()
        self._sequences: OrderedDict[int, array] = OrderedDict()  # id -> tokens, oldest first
        self._digests: dict[int, int] = {}  # hash of a sequence's tokens -> id: the same output is kept once
        self._index: dict[int, list[int]] = {}  # hash of an n-gram -> packed occurrences, oldest first
        self._next_id = 0
        self._tokens = self._occurrences = 0
        self.inserted = self.evicted = self.duplicates = 0

    @classmethod
    def of_megabytes(cls, megabytes: float, **options) -> "SuffixCache | None":
        """A cache of at most `megabytes` MiB; None for 0 (the cache off)."""
        if isinstance(megabytes, bool) or not isinstance(megabytes, (int, float)) or not megabytes >= 0:
            raise ValueError(f"the suffix cache size must be a number of MiB >= 0 (0 turns it off), got {megabytes!r}")
        return cls(int(megabytes * 2**20), **options) if megabytes > 0 else None

    # ------------------------------------------------------------------ size
    def _estimate(self, sequences: int, keys: int, occurrences: int, tokens: int) -> int:
        return (sequences * _SEQUENCE_BYTES + keys * _KEY_BYTES + occurrences * _OCCURRENCE_BYTES
                + tokens * _TOKEN_BYTES)

    def nbytes(self) -> int:
        """Estimated bytes held (an upper bound of the structures' measured size)."""
        with self._lock:
            return self._estimate(len(self._sequences), len(self._index), self._occurrences, self._tokens)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sequences)

    def stats(self) -> dict:
        with self._lock:
            return {"sequences": len(self._sequences), "tokens": self._tokens, "max_bytes": self.max_bytes,
                    "bytes": self._estimate(len(self._sequences), len(self._index), self._occurrences, self._tokens),
                    "inserted": self.inserted, "evicted": self.evicted, "duplicates": self.duplicates}

    # ---------------------------------------------------------------- insert
    def insert(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Remember a finished request: its prompt's tail and its output. A sequence
        larger than the whole cache keeps only the tail that fits."""
        tokens = [int(t) for t in prompt[len(prompt) - min(self.prompt_tail, len(prompt)):]] + [int(t) for t in output]
        if not output or len(tokens) <= self.min_ngram:
            return  # nothing generated, or nothing that follows an n-gram
        # Worst case every n-gram is a new key: the tail that fits the whole budget.
        per_token = _TOKEN_BYTES + (self.max_ngram - self.min_ngram + 1) * (_KEY_BYTES + _OCCURRENCE_BYTES)
        fits = (self.max_bytes - _SEQUENCE_BYTES) // per_token
        if fits <= self.min_ngram:
            return
        tokens = tokens[-fits:]
        digest = hash(tuple(tokens))
        with self._lock:
            if digest in self._digests:  # the same sequence again: templated traffic, kept once
                self.duplicates += 1
                return
            sequence_id = self._next_id
            self._next_id += 1
            self._sequences[sequence_id] = array("l", tokens)
            self._digests[digest] = sequence_id
            self._tokens += len(tokens)
            self.inserted += 1
            for key, end in self._ngrams(tokens):
                occurrences = self._index.get(key)
                if occurrences is None:
                    self._index[key] = [sequence_id << _POSITION_BITS | end]
                else:
                    occurrences.append(sequence_id << _POSITION_BITS | end)
                    if len(occurrences) > self.max_occurrences:
                        del occurrences[0]  # the oldest occurrence: lookups read the most recent ones
                        self._occurrences -= 1
                self._occurrences += 1
            while self._estimate(len(self._sequences), len(self._index), self._occurrences,
                                 self._tokens) > self.max_bytes and len(self._sequences) > 1:
                self._evict_oldest()

    def _ngrams(self, tokens: Sequence[int]):
        """(hashed n-gram, end position) of every n-gram followed by a token."""
        for n in range(self.min_ngram, self.max_ngram + 1):
            for end in range(n - 1, len(tokens) - 1):
                yield hash(tuple(tokens[end - n + 1 : end + 1])), end

    def _evict_oldest(self) -> None:
        """Drop the oldest sequence and its occurrences: lists hold occurrences oldest
        first and ids grow, so its entries are at the front of each list (or were
        already dropped there by `max_occurrences`)."""
        sequence_id, tokens = self._sequences.popitem(last=False)
        self._digests.pop(hash(tuple(tokens)), None)
        self._tokens -= len(tokens)
        self.evicted += 1
        for key, _ in self._ngrams(tokens):
            occurrences = self._index.get(key)
            if occurrences is None:
                continue
            while occurrences and occurrences[0] >> _POSITION_BITS == sequence_id:
                del occurrences[0]
                self._occurrences -= 1
            if not occurrences:
                del self._index[key]

    # ---------------------------------------------------------------- lookup
    def lookup(self, suffix: Sequence[int], limit: int, max_candidates: int = 1) -> list[tuple[list[int], int]]:
        """Up to `max_candidates` continuations (each at most `limit` tokens) of the
        longest n-gram ending `suffix` that the cache has seen, with the copied run of
        each (how many tokens back from the end `suffix` agrees with the tokens before
        the continuation, at most `max_run`; the longest among the occurrences the
        continuation follows). [] when none matches.

        The occurrences of that n-gram vote, token by token (a suffix tree's walk by
        frequency, as ArcticInference's suffix decoding does): the candidates start
        with the most frequent next tokens (the most recent occurrence first among
        equals), and each goes on with the token most of the occurrences that agree
        with it so far continue with, while the product of those majorities (the
        share of the occurrences that agree) stays at least `min_probability`. A
        template's fixed text is copied whole and the copy stops where earlier
        requests went different ways (a name, an id); a copy of the one occurrence
        that agreed longest ran on into that record's own values, and was rejected
        there (docs/lab-notes/serving-load.md#the-suffix-cache-counted-round-by-round-issue-68)."""
        suffix = [int(t) for t in suffix[len(suffix) - min(self.max_run, len(suffix)):]]
        if limit <= 0 or max_candidates <= 0:
            return []
        with self._lock:
            matches: list[tuple[int, array, int]] = []  # (run, tokens, end), newest first
            for n in range(min(self.max_ngram, len(suffix)), self.min_ngram - 1, -1):
                occurrences = self._index.get(hash(tuple(suffix[-n:])))
                if occurrences:
                    matches = self._matches(suffix, n, occurrences)
                    if matches:
                        break
            return self._vote(matches, limit, max_candidates)

    def _matches(self, suffix: list[int], n: int, occurrences: list[int]) -> list[tuple[int, array, int]]:
        """(run, sequence, end) of the occurrences (newest first) that are followed by a
        token; one whose n-gram only shares a hash is skipped."""
        last, found = len(suffix) - 1, []
        for packed in reversed(occurrences):
            tokens = self._sequences[packed >> _POSITION_BITS]
            end = packed & _POSITION_MASK
            run = 0
            while run <= end and run <= last and run < self.max_run and tokens[end - run] == suffix[last - run]:
                run += 1
            if run >= n and end + 1 < len(tokens):
                found.append((run, tokens, end))
        return found

    def _vote(self, matches: list[tuple[int, array, int]], limit: int, max_candidates: int) -> list[tuple[list[int], int]]:
        """The continuations `lookup` describes, built from `matches`' votes."""
        firsts: dict[int, int] = {}  # first token -> votes, in the order first seen (newest first)
        for _, tokens, end in matches:
            firsts[tokens[end + 1]] = firsts.get(tokens[end + 1], 0) + 1
        ranked = sorted(firsts, key=lambda token: -firsts[token])[:max_candidates]  # stable: newest among equals
        out = []
        for first in ranked:
            alive = [(tokens, end + 1) for _, tokens, end in matches if tokens[end + 1] == first]
            run = max(r for r, tokens, end in matches if tokens[end + 1] == first)
            chain, probability = [first], firsts[first] / len(matches)
            while len(chain) < limit:
                votes: dict[int, int] = {}
                for tokens, at in alive:
                    if at + 1 < len(tokens):
                        votes[tokens[at + 1]] = votes.get(tokens[at + 1], 0) + 1
                if not votes:
                    break
                token = max(votes, key=votes.__getitem__)  # the first seen among equals: the newest
                probability *= votes[token] / sum(votes.values())
                if probability < self.min_probability:
                    break
                chain.append(token)
                alive = [(tokens, at + 1) for tokens, at in alive if at + 1 < len(tokens) and tokens[at + 1] == token]
            out.append((chain, run))
        return out
