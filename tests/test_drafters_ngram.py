import random
from collections import Counter

import pytest
import torch

from longspec.speculation.copied_tree import copied_runs
from longspec.speculation.drafters import (
    DraftContext,
    Drafter,
    NgramDrafter,
    NgramTable,
    PromptLookupDrafter,
)
from longspec.speculation.tree import Tree


def ctx(tokens, max_nodes=64):
    return DraftContext(torch.as_tensor(tokens, dtype=torch.long), max_nodes=max_nodes)


def proposed(drafter, tokens, max_nodes=64, begin=True):
    context = ctx(tokens, max_nodes)
    if begin:
        drafter.begin(context)
    return drafter.propose(context)


def root_paths(tree: Tree) -> set[tuple[int, ...]]:
    """Token sequences (root excluded) from the root to every leaf."""
    leaves = set(range(tree.size)) - set(tree.parents.tolist())
    return {tuple(tree.tokens[tree.path_to(leaf)][1:].tolist()) for leaf in leaves if leaf != 0}


def assert_no_duplicate_siblings(tree: Tree) -> None:
    pairs = list(zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:]))
    assert len(pairs) == len(set(pairs))


# ------------------------------------------------------------------ prompt lookup
def test_pld_is_a_drafter():
    assert isinstance(PromptLookupDrafter(), Drafter)
    assert isinstance(NgramDrafter(), Drafter)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_tokens": 0}, "num_tokens"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
        ({"max_candidates": 0}, "max_candidates"),
        ({"num_tokens": 2.5}, "num_tokens"),
        ({"max_candidates": True}, "max_candidates"),
        ({"continue_copies": 1}, "continue_copies"),
    ],
)
def test_pld_validates_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PromptLookupDrafter(**kwargs)


def test_pld_takes_most_recent_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 6, 1, 2, 3]
    tree = proposed(PromptLookupDrafter(num_tokens=3), tokens)
    assert tree.is_chain()
    assert tree.tokens.tolist() == [3, 7, 7, 5]


def test_pld_prefers_longer_ngrams():
    # the unigram "3" last occurred at position 5, but the trigram "1 2 3" only at 0..2
    tokens = [1, 2, 3, 10, 11, 3, 20, 21, 1, 2, 3]
    tree = proposed(PromptLookupDrafter(num_tokens=2), tokens)
    assert tree.tokens.tolist() == [3, 10, 11]
    # with max_ngram=1 the most recent unigram wins
    tree = proposed(PromptLookupDrafter(num_tokens=2, max_ngram=1), tokens)
    assert tree.tokens.tolist() == [3, 20, 21]


def test_pld_min_ngram_ignores_short_matches():
    tokens = [5, 3, 8, 9, 4, 3]
    assert proposed(PromptLookupDrafter(min_ngram=1), tokens).tokens.tolist() == [3, 8, 9, 4, 3]
    assert proposed(PromptLookupDrafter(min_ngram=2), tokens).size == 1


def test_pld_respects_num_tokens_and_max_nodes():
    tokens = list(range(20)) + [0]
    assert proposed(PromptLookupDrafter(num_tokens=10), tokens).tokens.tolist() == [0] + list(range(1, 11))
    assert proposed(PromptLookupDrafter(num_tokens=4), tokens).tokens.tolist() == [0, 1, 2, 3, 4]
    assert proposed(PromptLookupDrafter(num_tokens=10), tokens, max_nodes=3).tokens.tolist() == [0, 1, 2, 3]
    assert proposed(PromptLookupDrafter(num_tokens=10), tokens, max_nodes=0).size == 1


def test_pld_match_may_overlap_the_suffix_but_not_be_it():
    # "7 7" ends at the root; its previous occurrence (positions 1..2) overlaps it
    tree = proposed(PromptLookupDrafter(num_tokens=5), [4, 7, 7, 7])
    assert tree.tokens.tolist() == [7, 7]
    # a single token never matches itself
    assert proposed(PromptLookupDrafter(), [7]).size == 1


def test_pld_no_match_gives_root_only_tree():
    tree = proposed(PromptLookupDrafter(), [1, 2, 3, 4, 5])
    assert tree.size == 1 and tree.tokens.tolist() == [5]


def test_pld_multi_candidate_tree():
    tokens = [7, 1, 2, 3, 7, 1, 2, 4, 7, 1, 2, 3, 7, 9, 7]
    drafter = PromptLookupDrafter(num_tokens=3, max_ngram=1, max_candidates=3)
    tree = proposed(drafter, tokens)
    assert_no_duplicate_siblings(tree)
    assert tree.tokens[0] == 7
    # most recent match first: its chain occupies the first child of the root
    assert tree.tokens[tree.children(0)].tolist() == [9, 1]
    assert root_paths(tree) == {(9, 7), (1, 2, 3), (1, 2, 4)}
    assert tree.size == 1 + 2 + 3 + 1
    # budget: the first two chains fit (4 nodes), nothing of the third
    tree = proposed(drafter, tokens, max_nodes=4)
    assert root_paths(tree) == {(9, 7), (1, 2)}
    assert tree.size == 5


def test_pld_trees_carry_the_copied_run_of_each_node():
    """A node's copied run: the tokens up to its parent, root included, that equal the
    tokens before its source; the longest run among the chains through a shared node."""
    tokens = [5, 1, 2, 3, 4, 9, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    tree = proposed(PromptLookupDrafter(num_tokens=5, max_candidates=3), tokens)
    # "2 3" ends at 9 (then 7 8 0 2 3) and at 3 (then 4 9 9 1 2); both agree with the
    # sequence for 2 tokens back from the root (then 1 != 0).
    assert tree.tokens.tolist() == [3, 7, 8, 0, 2, 3, 4, 9, 9, 1, 2]
    assert tree.copied_runs.tolist() == [0, 2, 3, 4, 5, 6, 2, 3, 4, 5, 6]
    # Shared prefixes keep the longest run: "7" follows both "0 2 3" (run 2, most recent)
    # and "1 2 3" (run 3: the sequence ends in "1 2 3" too).
    tokens = [1, 2, 3, 7, 8, 0, 2, 3, 7, 9, 1, 2, 3]
    tree = proposed(PromptLookupDrafter(num_tokens=2, max_ngram=1, max_candidates=2), tokens)
    assert tree.tokens.tolist() == [3, 7, 9, 8] and tree.copied_runs.tolist() == [0, 3, 3, 4]
    assert copied_runs(proposed(PromptLookupDrafter(), [1, 2, 3])) is None  # no match: root only


def brute_force_run(seq: list[int], min_ngram: int, max_ngram: int) -> int | None:
    """The copied run of the most recent match of the longest matching suffix (None: no match)."""
    length = len(seq)
    for n in range(max_ngram, min_ngram - 1, -1):
        ends = [e for e in range(n - 1, length - 1) if seq[e - n + 1 : e + 1] == seq[length - n :]]
        if ends:
            end = ends[-1]
            run = 0
            while run <= end and seq[end - run] == seq[length - 1 - run]:
                run += 1
            return min(run, PromptLookupDrafter.max_run)
    return None


def test_pld_copied_runs_match_brute_force():
    rng = random.Random(3)
    for _ in range(300):
        seq = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(2, 120))]
        min_ngram = rng.randint(1, 2)
        max_ngram = min_ngram + rng.randint(0, 2)
        tree = proposed(PromptLookupDrafter(num_tokens=4, min_ngram=min_ngram, max_ngram=max_ngram), seq)
        run = brute_force_run(seq, min_ngram, max_ngram)
        if run is None:
            assert tree.size == 1
            continue
        assert tree.copied_runs.tolist() == [0] + [run + d for d in range(tree.size - 1)], seq


def test_pld_continued_copies_repeat_a_loop_past_its_period():
    tokens = [9, 1, 2, 3, 1, 2, 3]  # "1 2 3" last seen at 1..3: its copy reaches the end after 3 tokens
    assert proposed(PromptLookupDrafter(num_tokens=8), tokens).tokens.tolist() == [3, 1, 2, 3]
    continued = PromptLookupDrafter(num_tokens=8, continue_copies=True)
    tree = proposed(continued, tokens)
    assert tree.tokens.tolist() == [3, 1, 2, 3, 1, 2, 3, 1, 2]
    assert tree.copied_runs.tolist() == [0] + [3 + d for d in range(8)]
    assert proposed(continued, tokens, max_nodes=5).tokens.tolist() == [3, 1, 2, 3, 1, 2]
    # a copy that does not reach the end is the standard one
    assert proposed(continued, list(range(1, 11)) + [1]).tokens.tolist() == list(range(1, 10))


def brute_force_continued_copy(seq: list[int], num_tokens: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The most recent match of the longest matching suffix, copied one token at a time
    from the sequence extended by the copy itself."""
    length = len(seq)
    for n in range(max_ngram, min_ngram - 1, -1):
        ends = [e for e in range(n - 1, length - 1) if seq[e - n + 1 : e + 1] == seq[length - n :]]
        if ends:
            extended = list(seq)
            for i in range(num_tokens):
                extended.append(extended[ends[-1] + 1 + i])
            return extended[length:]
    return []


@pytest.mark.parametrize("max_candidates", [1, 3])
def test_pld_continued_copies_match_brute_force(max_candidates):
    rng = random.Random(7 + max_candidates)
    for _ in range(300):
        seq = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(2, 60))]
        num_tokens, min_ngram = rng.randint(1, 12), rng.randint(1, 2)
        max_ngram = min_ngram + rng.randint(0, 2)
        drafter = PromptLookupDrafter(num_tokens=num_tokens, min_ngram=min_ngram, max_ngram=max_ngram,
                                      max_candidates=max_candidates, continue_copies=True)
        tree = proposed(drafter, seq)
        want = brute_force_continued_copy(seq, num_tokens, min_ngram, max_ngram)
        if max_candidates == 1:  # the chain is the most recent match's copy
            assert root_paths(tree) == ({tuple(want)} if want else set()), seq
        else:  # one of the tree's chains
            assert (tuple(want) in root_paths(tree)) if want else tree.size == 1, seq


def test_pld_longest_run_copies_the_occurrence_whose_context_agrees_longest():
    # "7 8" ends at 2 (after 6 5) and at 8 (after 4 4): the suffix "6 5 7 8" agrees
    # with the older occurrence 4 tokens back, with the most recent one 2.
    tokens = [6, 5, 7, 8, 1, 2, 4, 4, 7, 8, 3, 3, 6, 5, 7, 8]
    assert proposed(PromptLookupDrafter(num_tokens=3, max_ngram=2), tokens).tokens.tolist() == [8, 3, 3, 6]
    tree = proposed(PromptLookupDrafter(num_tokens=3, max_ngram=2, longest_run=True), tokens)
    assert tree.tokens.tolist() == [8, 1, 2, 4]
    assert tree.copied_runs.tolist() == [0, 4, 5, 6]
    with pytest.raises(ValueError, match="longest_run must be a bool"):
        PromptLookupDrafter(longest_run=1)


def brute_force_longest_run_copy(seq: list[int], num_tokens: int, max_ngram: int, scan: int) -> list[int]:
    """Of the `scan` most recent matches of the longest matching suffix, the copy after
    the one whose preceding tokens agree longest with the sequence's end (the most
    recent among equals)."""
    length = len(seq)
    for n in range(max_ngram, 0, -1):
        ends = [e for e in range(n - 1, length - 1) if seq[e - n + 1 : e + 1] == seq[length - n :]]
        if ends:
            def agreement(end: int) -> int:
                run = 0
                while run <= end and seq[end - run] == seq[length - 1 - run]:
                    run += 1
                return run
            best = max(reversed(ends[-scan:]), key=agreement)  # max keeps the first (most recent) of equals
            return seq[best + 1 : best + 1 + num_tokens]
    return []


def test_pld_longest_run_matches_brute_force():
    rng = random.Random(11)
    for _ in range(300):
        seq = [rng.randrange(rng.choice([2, 3, 4])) for _ in range(rng.randint(2, 60))]
        num_tokens, max_ngram = rng.randint(1, 8), rng.randint(1, 3)
        drafter = PromptLookupDrafter(num_tokens=num_tokens, max_ngram=max_ngram, longest_run=True)
        want = brute_force_longest_run_copy(seq, num_tokens, max_ngram, drafter.scan_factor)
        assert root_paths(proposed(drafter, seq)) == ({tuple(want)} if want else set()), seq


def test_pld_multi_candidate_skips_identical_continuations():
    tokens = [5, 1, 5, 1, 5, 2, 5]
    tree = proposed(PromptLookupDrafter(num_tokens=1, max_ngram=1, max_candidates=3), tokens)
    assert_no_duplicate_siblings(tree)
    assert tree.tokens.tolist() == [5, 2, 1]


def test_pld_observe_matches_fresh_begin_and_resyncs():
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(400)]
    incremental = PromptLookupDrafter(num_tokens=4, max_candidates=2)
    incremental.begin(ctx(seq[:50]))
    lazy = PromptLookupDrafter(num_tokens=4, max_candidates=2)  # never told begin/observe
    pos = 50
    while pos < len(seq):
        step = rng.randint(1, 5)
        incremental.observe(torch.tensor(seq[pos : pos + step]))
        pos = min(pos + step, len(seq))
        fresh = proposed(PromptLookupDrafter(num_tokens=4, max_candidates=2), seq[:pos])
        for drafter in (incremental, lazy):
            tree = drafter.propose(ctx(seq[:pos]))
            assert torch.equal(tree.tokens, fresh.tokens) and torch.equal(tree.parents, fresh.parents)
    # a shorter / rewritten context makes the drafter start over
    other = [9, 8, 9, 8, 9]
    assert incremental.propose(ctx(other)).tokens.tolist() == [9, 8, 9]
    assert lazy.propose(ctx(seq[:100])).tokens.tolist() == proposed(
        PromptLookupDrafter(num_tokens=4, max_candidates=2), seq[:100]
    ).tokens.tolist()


def python_pld(seq, num_tokens, min_ngram, max_ngram, max_candidates, max_nodes, scan):
    """Brute force: scan every earlier position, most recent first."""
    length = len(seq)
    limit = min(num_tokens, max_nodes)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = seq[length - n :] if n <= length else None
        chains, scanned = [], 0
        for end in range(length - 2, n - 2, -1):
            if seq[end - n + 1 : end + 1] != suffix:
                continue
            if scanned == scan:
                break
            scanned += 1
            cont = seq[end + 1 : end + 1 + limit]
            if cont not in chains:
                chains.append(cont)
            if len(chains) == max_candidates:
                break
        if chains:
            return chains
    return []


def torch_pld(seq: torch.Tensor, num_tokens, min_ngram, max_ngram, max_candidates, max_nodes, scan):
    """Brute force with every window compared at once: window s (tokens s..s+n-1,
    ending at or before length-2) matches when each of its n shifted columns does."""
    length = seq.numel()
    limit = min(num_tokens, max_nodes)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length - 1:
            continue
        windows = length - n  # starts 0 .. length-n-1
        match = torch.ones(windows, dtype=torch.bool)
        for j in range(n):
            match &= seq[j : j + windows] == seq[length - n + j]
        starts = torch.nonzero(match).flatten().tolist()
        if not starts:
            continue
        chains = []
        for start in reversed(starts[-scan:]):
            end = start + n - 1
            cont = seq[end + 1 : end + 1 + limit].tolist()
            if cont not in chains:
                chains.append(cont)
            if len(chains) == max_candidates:
                break
        return chains
    return []


def expected_tree(root, chains, max_nodes):
    tree = Tree.chain(root, [])
    merged, budget = [], max_nodes
    seen = {}
    for chain in chains:  # reference trimming: add nodes until the budget is spent
        node, kept = 0, []
        for token in chain:
            if (node, token) not in seen:
                if budget == 0:
                    break
                budget -= 1
                seen[(node, token)] = len(seen) + 1
            kept.append(token)
            node = seen[(node, token)]
        if kept:
            merged.append(torch.tensor(kept))
    return tree.with_chains(merged) if merged else tree


@pytest.mark.parametrize("max_candidates", [1, 3])
def test_pld_matches_brute_force_on_small_random_sequences(max_candidates):
    rng = random.Random(max_candidates)
    for _ in range(300):
        seq = [rng.randrange(rng.choice([2, 3, 5, 12])) for _ in range(rng.randint(1, 40))]
        kw = dict(
            num_tokens=rng.randint(1, 6),
            min_ngram=rng.randint(1, 2),
            max_candidates=max_candidates,
        )
        kw["max_ngram"] = kw["min_ngram"] + rng.randint(0, 3)
        max_nodes = rng.randint(0, 12)
        drafter = PromptLookupDrafter(**kw)
        tree = proposed(drafter, seq, max_nodes=max_nodes)
        chains = python_pld(seq, max_nodes=max_nodes, scan=drafter.scan_factor * max_candidates, **kw)
        want = expected_tree(seq[-1], chains if max_nodes > 0 else [], max_nodes)
        assert tree.tokens.tolist() == want.tokens.tolist()
        assert tree.parents.tolist() == want.parents.tolist()


@pytest.mark.parametrize("vocab, max_candidates", [(4, 1), (4, 4), (40, 1), (40, 3)])
def test_pld_matches_brute_force_on_32k_tokens(vocab, max_candidates):
    gen = torch.Generator().manual_seed(vocab * 10 + max_candidates)
    seq = torch.randint(0, vocab, (32768,), generator=gen)
    kw = dict(num_tokens=8, min_ngram=1, max_ngram=4, max_candidates=max_candidates)
    drafter = PromptLookupDrafter(**kw)
    scan = drafter.scan_factor * max_candidates
    start = 32768 - 300
    drafter.begin(ctx(seq[:start]))
    rng = random.Random(vocab)
    pos = start
    rounds = 0
    while pos < seq.numel():
        max_nodes = rng.choice([0, 3, 64])
        tree = drafter.propose(DraftContext(seq[:pos], max_nodes=max_nodes))
        chains = torch_pld(seq[:pos], max_nodes=max_nodes, scan=scan, **kw)
        want = expected_tree(int(seq[pos - 1]), chains, max_nodes)
        assert tree.tokens.tolist() == want.tokens.tolist()
        assert tree.parents.tolist() == want.parents.tolist()
        assert tree.size - 1 <= max_nodes
        step = rng.randint(1, 6)
        drafter.observe(seq[pos : pos + step])
        pos += step
        rounds += 1
    assert rounds > 50


# --------------------------------------------------------------------- n-gram table
def brute_force(stream, n):
    counts, last = Counter(), {}
    for i in range(len(stream) - n + 1):
        gram = tuple(stream[i : i + n])
        counts[gram] += 1
        last[gram] = i
    return counts, last


def test_table_validates_n():
    with pytest.raises(ValueError, match="n"):
        NgramTable(n=1)
    with pytest.raises(ValueError, match="k"):
        NgramDrafter(k=0)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_table_agrees_with_counter_after_random_updates(n):
    rng = random.Random(n)
    table = NgramTable(n=n)
    stream: list[int] = []
    for step in range(150):
        size = rng.choice([0, 1, 1, 2, 3, 5, 8, 20])
        new = [rng.randrange(4) for _ in range(size)]
        table.update(torch.tensor(new, dtype=torch.long) if step % 2 else new)
        stream += new
        counts, last = brute_force(stream, n)
        got = {gram: (count, seen) for gram, count, seen in table.items()}
        assert got == {gram: (counts[gram], last[gram]) for gram in counts}
        assert len(table) == len(counts)
        assert table.length == len(stream)
        for gram in list(counts)[:5]:
            assert table.count(gram) == counts[gram]
        # ordering: sorted by (count, last occurrence), descending; no stale entries
        for first in range(4):
            ranked = sorted(
                (g for g in counts if g[0] == first), key=lambda g: (counts[g], last[g]), reverse=True
            )
            ranked = [g[1:] for g in ranked]
            everything = [tuple(c.tolist()) for c in table.top_continuations(first, 10**6)]
            assert everything == ranked
            assert len(set(everything)) == len(everything)
            for k in (1, 3):
                top = table.top_continuations(first, k)
                assert [tuple(c.tolist()) for c in top] == ranked[:k]
                assert all(c.dtype == torch.long and c.shape == (n - 1,) for c in top)


def test_table_repeated_updates_leave_one_entry_per_ngram():
    table = NgramTable(n=3)
    # the same trigram gains counts while others overtake and fall behind it
    for chunk in ([1, 2, 3], [1], [2], [3, 1, 2, 4], [1, 2, 4], [1, 2, 4, 1, 2, 3], [1, 2, 3]):
        table.update(chunk)
    stream = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 4, 1, 2, 4, 1, 2, 3, 1, 2, 3]
    counts, last = brute_force(stream, 3)
    top = [tuple(c.tolist()) for c in table.top_continuations(1, 10)]
    assert top == [(2, 3), (2, 4)]  # 4 vs 3 occurrences
    assert table.count((1, 2, 3)) == counts[(1, 2, 3)] == 4
    assert table.count((1, 2, 4)) == counts[(1, 2, 4)] == 3
    assert table.top_continuations(1, 0) == [] and table.top_continuations(99, 5) == []


def test_table_ties_broken_by_most_recent():
    table = NgramTable(n=2)
    table.update([0, 5, 0, 6, 0, 7, 0, 6, 0, 5])
    # counts: (0,5)=2 last 8, (0,6)=2 last 6, (0,7)=1
    assert [c.tolist() for c in table.top_continuations(0, 3)] == [[5], [6], [7]]


# ------------------------------------------------------------------- n-gram drafter
def test_ngram_drafter_tree():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1]
    drafter = NgramDrafter(n=3, k=20)
    tree = proposed(drafter, tokens)
    assert tree.tokens.tolist() == [1, 2, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert not tree.children_sampled
    assert_no_duplicate_siblings(tree)

    # observe: (1,2,4) ties (1,2,3) at 2 occurrences and is now more recent
    drafter.observe(torch.tensor([2, 4, 1]))
    tree = drafter.propose(ctx(tokens + [2, 4, 1]))
    assert tree.tokens.tolist() == [1, 2, 4, 3]

    # budget trimming and k
    assert proposed(drafter, tokens, max_nodes=2).tokens.tolist() == [1, 2, 3]
    assert proposed(drafter, tokens, max_nodes=0).size == 1
    assert proposed(NgramDrafter(n=3, k=1), tokens).tokens.tolist() == [1, 2, 3]
    # a root never seen as an n-gram start proposes nothing
    assert proposed(NgramDrafter(n=3), [1, 2, 3, 8]).size == 1


def test_ngram_drafter_random_contents():
    rng = random.Random(7)
    seq = [rng.randrange(5) for _ in range(1200)]
    drafter = NgramDrafter(n=4, k=6)
    drafter.begin(ctx(seq[:900]))
    pos = 900
    while pos < len(seq):
        max_nodes = rng.choice([1, 5, 64])
        tree = drafter.propose(ctx(seq[:pos], max_nodes))
        counts, last = brute_force(seq[:pos], 4)
        root = seq[pos - 1]
        ranked = sorted((g for g in counts if g[0] == root), key=lambda g: (counts[g], last[g]), reverse=True)
        want = expected_tree(root, [list(g[1:]) for g in ranked[:6]], max_nodes)
        assert tree.tokens.tolist() == want.tokens.tolist()
        assert tree.parents.tolist() == want.parents.tolist()
        assert tree.size - 1 <= max_nodes
        assert_no_duplicate_siblings(tree)
        step = rng.randint(1, 4)
        drafter.observe(torch.tensor(seq[pos : pos + step]))
        pos += step
    # a drafter that is only ever handed contexts catches up by itself
    lazy = NgramDrafter(n=4, k=6)
    assert lazy.propose(ctx(seq)).tokens.tolist() == drafter.propose(ctx(seq)).tokens.tolist()


# ------------------------------------------------------------------ state size
def test_container_nbytes_counts_each_object_once():
    import sys

    from longspec.speculation.drafters.base import container_nbytes

    shared = (1000001, 1000002)
    structure = {shared: [shared, shared]}
    expected = sys.getsizeof(structure) + sys.getsizeof(shared) + sys.getsizeof(1000001) + sys.getsizeof(1000002)
    expected += sys.getsizeof(structure[shared])
    assert container_nbytes(structure) == expected


@pytest.mark.parametrize("make", [lambda: PromptLookupDrafter(num_tokens=4), lambda: NgramDrafter(n=4, k=3)])
def test_retrieval_state_grows_with_the_text_it_indexes(make):
    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(2000)]
    short, long = make(), make()
    short.begin(ctx(seq[:200]))
    long.begin(ctx(seq))
    assert 0 < short.state_nbytes() < long.state_nbytes()
