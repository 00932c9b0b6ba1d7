"""Batched speculative decoding is lossless per row.

* A forward over ragged rows with one tree each gives every row the logits of its
  own single-row forward (float64, every family, rings wrapping).
* Every row of a continuously batched run equals its B = 1 run token for token:
  greedy with every drafter (several drafters in one batch), rows of different
  prompt lengths finishing at different times, rows joining as others leave.
* Sampled rows: exact seeded identity with B = 1 for every processor, and the
  chi-square test of the row distribution against the exact target distribution.
* Rows free their cache when they leave or are cancelled; requests that cannot
  fit are refused before any prefill.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longspec.runtime.batch_cache import BatchKVCache
from longspec.runtime.native import attention_ops
from longspec.speculation import batch_engine
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.drafters.mamba import MambaDrafter
from longspec.speculation.drafters.adaptive import AdaptiveDrafter
from longspec.speculation.batch_engine import BatchEngine, BatchOptions, EngineBusy
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.tokenswift.one_pass import OnePassTokenSwiftDrafter
from longspec.speculation.engine import EngineOptions
from longspec.speculation.tree import Tree
from exactness import OPTIONS, PROCESSORS, diverse_model, real_drafters, single_run
from oracles import OracleGarbageDrafter, tiny_mamba
from sampling_checks import (
    PENALIZED,
    PROMPT,
    SAMPLING,
    CartesianDrafter,
    SampledChainDrafter,
    SampledTreeDrafter,
    exact_distribution,
    goodness_of_fit,
)
from sampling_checks import N as SAMPLES
from sampling_checks import K as SAMPLE_TOKENS
from sampling_checks import model as sampling_model  # noqa: F401 - pytest fixture
from tiny_models import FAMILIES, random_ids, tiny_decoder


def random_tree(size: int, generator: torch.Generator, vocab: int) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, size)]
    return Tree.from_parents(torch.randint(0, vocab, (size,), generator=generator), torch.tensor(parents))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_tree_forward_matches_single_rows(family, packed):
    """Rows of different lengths and trees, padded to the widest; `packed` skips the
    padding's per-token work (`real_tokens`)."""
    model = tiny_decoder(family, dtype=torch.float64)
    vocab = model.config.vocab_size
    lengths = [5, 13, 9]
    batch = BatchKVCache(model.config, 96, 4, max_forward_tokens=16, dtype=torch.float64)
    singles = []
    for i, length in enumerate(lengths):
        prompt = random_ids(length, seed=i)[0]
        view = batch.acquire().view()
        model(prompt.unsqueeze(0), view, positions=view.next_positions(length))
        view.commit()
        single = model.new_cache(96, max_forward_tokens=16)
        model(prompt.unsqueeze(0), single)
        single.commit()
        singles.append(single)
    generator = torch.Generator().manual_seed(0)
    for step in range(8):  # rings (window 8) wrap; every row keeps a different path
        trees = [random_tree(1 + (b + step) % 5, generator, vocab) for b in range(len(lengths))]
        width = max(t.size for t in trees)
        view = batch.rows()
        ids = torch.zeros(len(trees), width, dtype=torch.long)
        positions = view.lengths.unsqueeze(1).repeat(1, width)
        masks = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
        real = torch.zeros(len(trees), width, dtype=torch.bool)
        for b, tree in enumerate(trees):
            ids[b, : tree.size] = tree.tokens
            positions[b, : tree.size] += tree.depths
            masks[b, : tree.size, : tree.size] = tree.ancestor_mask()
            real[b, : tree.size] = True
        out = model(ids, view, tree_mask=masks, positions=positions, real_tokens=real if packed else None)
        kept = []
        for b, (tree, single) in enumerate(zip(trees, singles)):
            expected = model(tree.tokens.unsqueeze(0), single, tree_mask=tree.ancestor_mask(),
                             positions=single.length + tree.depths)
            torch.testing.assert_close(out.logits[b, : tree.size], expected.logits[0], rtol=1e-12, atol=1e-12)
            path = tree.path_to(int(torch.randint(0, tree.size, (), generator=generator)))
            single.commit(path)
            kept.append(path)
        view.commit(kept)
        assert batch.lengths[: len(lengths)].tolist() == [s.length for s in singles]
        assert batch.host_lengths[: len(lengths)].tolist() == [s.length for s in singles]


def test_the_host_copy_of_row_lengths_follows_every_row_operation():
    """What the host reads of the rows' lengths (so that a GPU forward never waits to
    learn them) stays equal to the device's through commits, swaps, releases and copies."""
    model = tiny_decoder("gemma3", dtype=torch.float64)
    batch = BatchKVCache(model.config, 64, 4, max_forward_tokens=16, dtype=torch.float64)

    def agree():
        assert torch.equal(batch.lengths.cpu(), batch.host_lengths), (batch.lengths, batch.host_lengths)

    rows = []
    for i, length in enumerate([3, 11, 7]):
        rows.append(batch.acquire())
        view = rows[-1].view()
        model(random_ids(length, seed=i), view, positions=view.next_positions(length))
        view.commit()
        agree()
    view = batch.rows()
    model(torch.zeros(3, 2, dtype=torch.long), view, positions=view.next_positions(2))
    view.commit([torch.tensor([0]), torch.tensor([0, 1]), torch.empty(0, dtype=torch.long)])
    agree()
    assert [row.length for row in rows] == [4, 13, 7]
    batch.swap(rows[0], rows[2])
    agree()
    batch.release(rows[1])
    agree()
    batch.copy_row(rows[2], rows[0])
    agree()
    assert [row.length for row in (rows[0], rows[2])] == [7, 7]  # the source's


@pytest.mark.skipif(attention_ops() is None, reason="the native bf16 kernels need AVX-512 BF16 or AVX2")
def test_packed_rows_are_the_same_bits_as_padded_rows():
    """In bf16 through the native kernels a row's products do not depend on how many
    rows share them, so skipping the padding changes no bit of the real tokens."""
    model = tiny_decoder("gemma3", dtype=torch.bfloat16)
    batch = BatchKVCache(model.config, 96, 3, max_forward_tokens=16, dtype=torch.bfloat16)
    for i, length in enumerate([5, 13, 9]):
        view = batch.acquire().view()
        model(random_ids(length, seed=i), view, positions=view.next_positions(length))
        view.commit()
    generator = torch.Generator().manual_seed(1)
    trees = [random_tree(size, generator, model.config.vocab_size) for size in (2, 7, 4)]
    view = batch.rows()
    ids, positions, masks, real = batch_engine.pad_trees(trees, view.lengths)
    padded = model(ids, view, tree_mask=masks, positions=positions)
    view.drop_pending()
    packed = model(ids, view, tree_mask=masks, positions=positions, real_tokens=real)
    assert torch.equal(packed.logits[real], padded.logits[real])
    assert not packed.hidden[~real].any()  # the padding comes back as zeros


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_equals_its_single_run_greedy(family):
    """Five more requests than rows: rows of different lengths, each with a different
    drafter, finish at different times and new ones join in their place."""
    model, _ = diverse_model(family)
    drafters = dict(real_drafters(model))
    drafters["tokenswift-onepass"] = lambda: OnePassTokenSwiftDrafter(
        TokenSwiftHeads.for_target(model.config).randomize(torch.Generator().manual_seed(1)), k=3)
    drafters["ar"] = lambda: None
    drafters["draft-model"] = lambda: DraftModelDrafter(model, length=3)  # the target drafting for itself
    drafters["mamba"] = lambda: MambaDrafter(tiny_mamba(vocab_size=model.config.vocab_size), widths=(2, 2, 1))
    drafters["auto"] = lambda: AdaptiveDrafter([("pld", PromptLookupDrafter(num_tokens=5)), ("ngram", NgramDrafter(k=3))],
                                               forward_cost=ForwardCost({}, (1, 8, 64), (0.01, 0.012, 0.03)))
    names = sorted(drafters)
    prompts = [random_ids(3 + 11 * i % 50, seed=i)[0] % 24 for i in range(len(names) + 1)]
    max_new = [20 + 13 * i % 40 for i in range(len(prompts))]
    references = [single_run(model, p, max_new_tokens=n) for p, n in zip(prompts, max_new)]
    factories = [drafters[names[i % len(names)]] for i in range(len(names))]
    # The last request drafts adversarial trees from its own reference output.
    factories.append(lambda: OracleGarbageDrafter(references[-1], prompts[-1].numel(), seed=3))
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=4, row_capacity=160, prefill_tokens_per_step=10))
    handles = [engine.submit(p, max_new_tokens=n, drafter=f()) for p, n, f in zip(prompts, max_new, factories)]
    joined_mid_run = 0
    while engine.has_work:
        joined_mid_run += engine.active_rows > 0 and engine.waiting > 0
        engine.step()
    assert joined_mid_run
    for name, handle, reference in zip(names + ["oracle"], handles, references):
        assert handle.finished and handle.stats.stop_reason == "length"
        assert torch.equal(handle.tokens, reference), f"row drafted by {name} differs from its B=1 run"
    assert engine.cache.occupied == 0 and engine.bytes_in_use() == 0


def test_rows_stop_at_their_own_eos():
    model = tiny_decoder("llama", dtype=torch.float64, initializer_range=0.3)
    prompts = [random_ids(4 + 7 * i, seed=10 + i)[0] for i in range(4)]
    references = [single_run(model, p, max_new_tokens=30) for p in prompts]
    eos = [(int(r[5 + 4 * i]),) for i, r in enumerate(references)]
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=4, row_capacity=96))
    handles = [engine.submit(p, max_new_tokens=30, drafter=PromptLookupDrafter(num_tokens=4), eos_token_ids=e)
               for p, e in zip(prompts, eos)]
    engine.run()
    for handle, prompt, e in zip(handles, prompts, eos):
        assert torch.equal(handle.tokens, single_run(model, prompt, max_new_tokens=30, eos=e))
        assert handle.stats.stop_reason == "eos" and int(handle.tokens[-1]) == e[0]


@pytest.mark.parametrize("processor", sorted(PROCESSORS))
def test_seeded_rows_equal_seeded_single_runs(processor):
    """Deterministic candidates: one draw per emitted token, so each seeded row must
    equal the seeded B = 1 run exactly (and AR rows too), whatever shares its forwards."""
    model, extra = diverse_model("qwen2")
    params = PROCESSORS[processor]
    makers = [lambda: None, lambda: PromptLookupDrafter(num_tokens=5), lambda: NgramDrafter(k=4), lambda: None]
    prompts = [random_ids(6 + 9 * i, seed=20 + i)[0] % 32 for i in range(len(makers))]
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=3, row_capacity=256))
    handles = []
    for i, (prompt, make) in enumerate(zip(prompts, makers)):
        generator = torch.Generator().manual_seed(100 + i)
        handles.append(engine.submit(prompt, params=params, max_new_tokens=120, drafter=make(), generator=generator))
    engine.run()
    for i, (prompt, make, handle) in enumerate(zip(prompts, makers, handles)):
        reference = single_run(model, prompt, params=params, max_new_tokens=120, seed=100 + i)
        assert torch.equal(handle.tokens, reference), f"row {i} differs from its seeded B=1 run"


@pytest.mark.parametrize(
    "params,drafters",
    [(SAMPLING, (SampledChainDrafter, SampledTreeDrafter, CartesianDrafter, None)),
     (PENALIZED, (CartesianDrafter, SampledChainDrafter))],
    ids=["mixed", "penalty"],
)
def test_sampled_rows_follow_the_target_distribution(sampling_model, params, drafters):  # noqa: F811
    """Many short requests through 8 rows (every drafter kind in one batch, each row
    with its own random stream): their sequences follow the exact AR distribution."""
    exact = exact_distribution(sampling_model, params)
    # The test drafters' trees have fixed shapes: rows keep their whole budget.
    engine = BatchEngine(sampling_model, EngineOptions(max_tree_nodes=32, progress=False),
                         BatchOptions(max_rows=8, row_capacity=64, forward_cost_limit=None))
    handles = []
    for i in range(SAMPLES):
        generator = torch.Generator().manual_seed(7000 + i)
        make = drafters[i % len(drafters)]
        drafter = make(torch.Generator().manual_seed(90000 + i)) if make else None
        handles.append(engine.submit(PROMPT, params=params, max_new_tokens=SAMPLE_TOKENS, drafter=drafter,
                                     generator=generator))
        if len(handles) % 8 == 0:
            engine.run()
    engine.run()
    counts: dict[tuple[int, ...], int] = {}
    for handle in handles:
        key = tuple(handle.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
    assert goodness_of_fit(exact, counts) > 1e-3


def test_a_forward_node_budget_is_shared_by_the_rows():
    model = tiny_decoder("llama", dtype=torch.float64)
    prompts = [random_ids(30, seed=40 + i)[0] % 6 for i in range(4)]  # repetitive: lookups always hit
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=4, row_capacity=128, max_forward_nodes=8))
    for rows in range(1, 5):  # measured (and cached) before forwards are counted: run alone, the test measured them
        engine.forward_cost(rows, 60)
    shapes: list[tuple[int, int]] = []
    original = model.forward
    model.forward = lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or original(ids, *a, **k)
    try:
        handles = [engine.submit(p, max_new_tokens=30, drafter=PromptLookupDrafter()) for p in prompts]
        engine.run()
    finally:
        model.forward = original
    rounds = [(rows, width) for rows, width in shapes if rows > 1]  # prefills run one row at a time
    assert rounds and all(width <= 8 // rows + 1 for rows, width in rounds), rounds  # the root, plus a share of 8
    assert (4, 3) in rounds
    for prompt, handle in zip(prompts, handles):
        assert torch.equal(handle.tokens, single_run(model, prompt, max_new_tokens=30))


def test_cancel_frees_the_row_and_a_waiting_request_takes_it():
    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=128, prefill_tokens_per_step=8))
    first = engine.submit(random_ids(10, seed=1)[0], max_new_tokens=50, drafter=PromptLookupDrafter())
    engine.step()
    in_use = engine.bytes_in_use()
    second = engine.submit(random_ids(40, seed=2)[0], max_new_tokens=50)
    third = engine.submit(random_ids(12, seed=3)[0], max_new_tokens=50)
    engine.step()  # the second row is prefilling (8 of 39 tokens), the third waits
    assert engine.active_rows == 2 and engine.bytes_in_use() == 2 * in_use
    engine.cancel(second)  # mid-prefill
    assert second.finished and second.stats.stop_reason == "cancelled"
    assert engine.bytes_in_use() == in_use
    engine.step()  # the third joins the freed row
    assert engine.active_rows == 2
    engine.cancel(first)  # decoding
    assert engine.bytes_in_use() == in_use and first.stats.stop_reason == "cancelled"
    engine.run()
    assert torch.equal(third.tokens, single_run(model, random_ids(12, seed=3)[0], max_new_tokens=50))
    assert engine.bytes_in_use() == 0


def test_drafters_begun_under_a_tight_cap_grow_their_trees_as_rows_leave(monkeypatch):
    """A row starts drafting while four rows share the forward (the cost cap allows one
    node per row), then rows finish and the cap lifts: every drafter must take the
    larger trees of the later rounds (buffers sized at begin for the row's whole
    budget) and each row still equals its single run."""
    model, _ = diverse_model("llama")
    drafters = dict(real_drafters(model))
    drafters["mamba"] = lambda: MambaDrafter(tiny_mamba(vocab_size=model.config.vocab_size), widths=(2, 2, 1))
    drafters["draft-model"] = lambda: DraftModelDrafter(model, length=3)
    steep = ForwardCost({}, (1, 2, 4, 8), (1.0, 2.4, 5.0, 10.0))  # 2 tokens per row: 2.4 steps
    flat = ForwardCost({}, (1, 2, 4, 8, 32), (1.0, 1.0, 1.0, 1.1, 1.2))
    names = sorted(drafters)
    for group in range(0, len(names), 4):
        engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=4, row_capacity=160, forward_cost_limit=2.5))
        monkeypatch.setattr(engine, "forward_cost", lambda rows, length: steep if rows > 2 else flat)
        chosen = [names[(group + i) % len(names)] for i in range(4)]  # always four rows: the cap starts tight
        prompts = [torch.cat([random_ids(5, seed=10 + i)[0] % 24] * 4) for i in range(len(chosen))]
        max_new = [8 + 20 * i for i in range(len(chosen))]  # rows leave one by one
        handles = [engine.submit(p, max_new_tokens=n, drafter=drafters[name]())
                   for p, n, name in zip(prompts, max_new, chosen)]
        engine.run()
        for name, prompt, n, handle in zip(chosen, prompts, max_new, handles):
            assert torch.equal(handle.tokens, single_run(model, prompt, max_new_tokens=n)), name


def test_rows_trees_stop_where_the_measured_batched_forward_passes_the_cost_limit(monkeypatch):
    """Each row's tree is capped at the widest forward (tokens per row) that costs at
    most forward_cost_limit decode steps of the same rows; one row alone is not capped."""
    model = tiny_decoder("llama", dtype=torch.float64, initializer_range=0.3)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=4, row_capacity=128, forward_cost_limit=2.5))
    cost = ForwardCost({}, (1, 2, 4, 8), (1.0, 1.3, 2.0, 3.5))  # 5 tokens per row: 2.375; 6: 2.75
    monkeypatch.setattr(engine, "forward_cost", lambda rows, length: cost)
    assert engine._affordable_nodes(4, 100) == 4
    prompts = [torch.cat([random_ids(6, seed=i)[0]] * 4) for i in range(4)]  # repeats: prompt lookup finds long matches
    widths: list[tuple[int, int]] = []
    original = model.forward

    def recording(ids, cache, *args, tree_mask=None, **kwargs):
        if tree_mask is not None or ids.shape[0] > 1:
            widths.append((ids.shape[0], ids.shape[1]))
        return original(ids, cache, *args, tree_mask=tree_mask, **kwargs)

    model.forward = recording
    try:
        handles = [engine.submit(p, max_new_tokens=30, drafter=PromptLookupDrafter(num_tokens=10)) for p in prompts]
        engine.run()
    finally:
        model.forward = original
    batched = [width for rows, width in widths if rows > 1]
    assert batched and max(batched) <= 5  # the root and 4 nodes
    for prompt, handle in zip(prompts, handles):
        assert torch.equal(handle.tokens, single_run(model, prompt, drafter=PromptLookupDrafter(num_tokens=10),
                                                     max_new_tokens=30))
    with pytest.raises(ValueError, match="forward_cost_limit"):
        BatchOptions(forward_cost_limit=0.5)


def test_prefill_pieces_are_the_single_runs_chunks():
    """A row's prompt is cut where a single run cuts it (at multiples of the prefill
    chunk), also when two rows join in one step and the first leaves only part of the
    budget: a bf16 chunk's attention depends on where it starts (test_bf16_identity)."""
    model = tiny_decoder("llama", dtype=torch.float64)
    options = EngineOptions(progress=False, max_tree_nodes=8, prefill_chunk=16)
    engine = BatchEngine(model, options, BatchOptions(max_rows=3, row_capacity=256, prefill_tokens_per_step=16))
    engine.submit(random_ids(5, seed=1)[0], max_new_tokens=60)
    engine.step()
    pieces: list[tuple[int, int]] = []  # (first position, tokens) of every prefill forward
    original = model.forward

    def recording(ids, cache, *args, positions=None, **kwargs):
        if kwargs.get("tree_mask") is None and positions is not None and ids.shape[0] == 1 and ids.shape[1] > 1:
            pieces.append((int(positions[0, 0]), ids.shape[1]))
        return original(ids, cache, *args, positions=positions, **kwargs)

    model.forward = recording
    try:
        short = engine.submit(random_ids(10, seed=2)[0], max_new_tokens=5)  # 9 prompt tokens: 7 of the budget left
        long = engine.submit(random_ids(60, seed=3)[0], max_new_tokens=5)
        engine.run()
    finally:
        model.forward = original
    assert (0, 9) in pieces  # the short prompt in one piece
    long_pieces = sorted(p for p in pieces if p != (0, 9))
    assert long_pieces == [(0, 16), (16, 16), (32, 16), (48, 11)]  # whole chunks, never the 7 left over
    for prompt, handle in ((random_ids(10, seed=2)[0], short), (random_ids(60, seed=3)[0], long)):
        assert torch.equal(handle.tokens, single_run(model, prompt, max_new_tokens=5))


def test_joining_prompt_prefills_within_the_step_budget():
    model = tiny_decoder("qwen3", dtype=torch.float64)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=256, prefill_tokens_per_step=12))
    decoding = engine.submit(random_ids(5, seed=1)[0], max_new_tokens=40)
    engine.step()
    joining = engine.submit(random_ids(100, seed=2)[0], max_new_tokens=5)
    widths: list[int] = []
    original = model.forward
    model.forward = lambda ids, *a, **k: widths.append(ids.shape[1]) or original(ids, *a, **k)
    try:
        before = decoding.stats.new_tokens
        engine.step()
    finally:
        model.forward = original
    assert decoding.stats.new_tokens == before + 1  # the decoding row still got its round
    assert sum(widths[:-1]) == 12 and widths[-1] == 1  # 12 prompt tokens, then the decode round
    engine.run()
    assert torch.equal(joining.tokens, single_run(model, random_ids(100, seed=2)[0], max_new_tokens=5))


def test_requests_that_cannot_fit_are_refused_before_prefill():
    model = tiny_decoder("llama", dtype=torch.float64)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=1, row_capacity=64, max_waiting=1))
    calls = []
    original = model.forward
    model.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with pytest.raises(ValueError, match=r"needs 75 token slots .* a cache row holds 64 .*row_capacity >= 75"):
            engine.submit(random_ids(30, seed=0)[0], max_new_tokens=20, drafter=PromptLookupDrafter())
        with pytest.raises(ValueError, match="exceeds the model's context"):
            engine.submit(random_ids(30, seed=0)[0], max_new_tokens=500)
        assert not calls
        engine.submit(random_ids(10, seed=0)[0], max_new_tokens=5)
        engine.step()  # takes the only row
        engine.submit(random_ids(10, seed=1)[0], max_new_tokens=5)  # waits for it
        with pytest.raises(EngineBusy, match="all 1 rows are busy and 1 requests wait"):
            engine.submit(random_ids(10, seed=2)[0], max_new_tokens=5)
    finally:
        model.forward = original
    with pytest.raises(ValueError, match="row_capacity must be >= 1"):
        BatchOptions(row_capacity=0)


def test_generate_batch_equals_generate(tmp_path):
    from longspec.api import load
    from tiny_models import save_checkpoint

    save_checkpoint(tmp_path, family="qwen3")
    model = load(tmp_path, dtype="float64", engine=EngineOptions(progress=False, max_tree_nodes=16))
    prompts = ["abc abc abc", "hello there, hello there", "x", "the cat sat on the mat; the cat"]
    options = dict(max_new_tokens=24, method="pld", temperature=0.9, top_k=20, ignore_eos=True)
    results = model.generate_batch(prompts, max_rows=3, seed=5, **options)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        single = model.generate(prompt, seed=5 + i, **options)
        assert result.token_ids == single.token_ids and result.text == single.text
    stop = results[0].text[3:5]
    stopped = model.generate_batch(prompts[:1], seed=5, stop=stop, **options)[0]
    assert stopped.text == model.generate(prompts[0], seed=5, stop=stop, **options).text
    assert stopped.stats.stop_reason == "stop" and stop not in stopped.text
    with pytest.raises(TypeError, match="list of prompts"):
        model.generate_batch("one prompt")


def test_auto_rows_learning_while_the_batch_verifies_stay_exact():
    """With each row's `learn` called during the shared forward (a GPU's setting, forced
    on the CPU here), `auto` rows beside other rows still equal their B = 1 runs."""
    model, _ = diverse_model("qwen2")
    prompts = [random_ids(5 + 7 * i, seed=30 + i)[0] % 20 for i in range(3)]
    references = [single_run(model, p, max_new_tokens=40) for p in prompts]
    autos = [AdaptiveDrafter([("pld", PromptLookupDrafter(num_tokens=5)), ("ngram", NgramDrafter(k=3))],
                             forward_cost=ForwardCost({}, (1, 8, 64), (0.01, 0.012, 0.03))) for _ in range(2)]
    options = dataclasses.replace(OPTIONS, learn_while_verifying=True)
    engine = BatchEngine(model, options, BatchOptions(max_rows=3, row_capacity=120))
    handles = [engine.submit(p, max_new_tokens=40, drafter=d) for p, d in zip(prompts, [*autos, None])]
    engine.run()
    for handle, reference in zip(handles, references):
        assert torch.equal(handle.tokens, reference)
    assert all(auto._deferred and auto.telemetry_state.rounds > 0 for auto in autos)


def test_auto_fills_the_padding_of_a_batch_forward_and_stays_exact():
    """With `fill_padding`, beside a row whose trees are wide, `auto` grows its own tree
    into its padding slots; every row still equals its B = 1 run."""
    model, _ = diverse_model("llama")
    prompts = [torch.cat([random_ids(6, seed=4)[0].repeat(4), random_ids(3, seed=5)[0]]) % 24,
               random_ids(17, seed=6)[0] % 24]
    references = [single_run(model, p, max_new_tokens=30) for p in prompts]
    auto = AdaptiveDrafter([("pld", PromptLookupDrafter(num_tokens=5)), ("ngram", NgramDrafter(k=3))],
                           forward_cost=ForwardCost({}, (1, 8, 64), (0.01, 0.03, 0.2)))  # wide trees cost
    wide = MambaDrafter(tiny_mamba(vocab_size=model.config.vocab_size), widths=(3, 2, 2))
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=120, fill_padding=True))
    handles = [engine.submit(p, max_new_tokens=30, drafter=d) for p, d in zip(prompts, (auto, wide))]
    while engine.has_work:
        engine.step()
    for handle, reference in zip(handles, references):
        assert torch.equal(handle.tokens, reference)
    assert auto.telemetry_state.nodes_widened > 0
