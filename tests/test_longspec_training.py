"""LongSpec draft training: pinned visibility rules and anchor offsets, training
and inference computing the same draft distribution, exact resume, 2-process DDP."""

from __future__ import annotations

import socket

import pytest
import torch

from longspec.speculation.drafters.base import DraftContext, TargetView
from longspec.speculation.drafters.longspec import DraftModel, LongSpecDrafter, load_draft
from longspec.speculation.drafters.longspec.model import chunked_cross_entropy
from longspec.speculation.drafters.longspec.strategies import Proposal
from longspec.training.data import Document, SequenceSampler, build_shards, is_held_out, load_split, most_frequent_ids
from longspec.training.longspec.features import target_features
from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions, training_hidden
from longspec.training.longspec.visibility import BlockVisibility, NoisyShift, ShiftVisibility, anchor_offset_positions, shifted_mask
from tiny_models import random_ids, tiny_decoder
from training_setup import _options, _tokens, small_draft_config


# ------------------------------------------------------------------ visibility
def test_anchor_offset_keeps_four_anchors_and_shifts_the_rest():
    offsets = set()
    for seed in range(1000):
        positions = anchor_offset_positions(10, 40, torch.Generator().manual_seed(seed))
        assert positions[:4].tolist() == [0, 1, 2, 3]
        offset = int(positions[4]) - 4
        assert positions[4:].tolist() == list(range(4 + offset, 10 + offset))
        assert 0 <= offset <= 30 and int(positions[-1]) <= 39
        offsets.add(offset)
    assert offsets == set(range(31))  # every offset in [0, max_positions - length] is drawn
    with pytest.raises(ValueError, match="exceeds"):
        anchor_offset_positions(50, 40, torch.Generator())


def test_noisy_shift_truncates_target_kv_by_j():
    rule = NoisyShift(4)
    shifts = set()
    for seed in range(100):
        j = rule.draw_shift(torch.Generator().manual_seed(seed))
        visible, counted = rule.mask(6, torch.Generator().manual_seed(seed))
        expected = torch.tensor([[k <= i - j for k in range(6)] for i in range(6)])
        assert torch.equal(visible, expected)
        assert counted.tolist() == [i >= j for i in range(6)]  # queries from j on
        shifts.add(j)
    assert shifts == {1, 2, 3}  # j in [1, gamma)
    visible, _ = ShiftVisibility(1).mask(4)
    assert visible.int().tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]


def test_weighted_noisy_shift_draws_shifts_by_their_weights():
    rule = NoisyShift(5, (6, 2, 0, 2))
    draws = [rule.draw_shift(torch.Generator().manual_seed(seed)) for seed in range(2000)]
    counts = {j: draws.count(j) for j in range(1, 5)}
    assert counts[3] == 0  # a zero weight is never drawn
    assert 0.55 < counts[1] / 2000 < 0.65 and 0.15 < counts[2] / 2000 < 0.25 and 0.15 < counts[4] / 2000 < 0.25
    visible, counted = rule.mask(6, torch.Generator().manual_seed(0))
    j = rule.draw_shift(torch.Generator().manual_seed(0))
    assert torch.equal(visible, shifted_mask(6, j)[0]) and counted.tolist() == [i >= j for i in range(6)]


def test_unweighted_noisy_shift_draws_what_earlier_runs_drew():
    # Resuming a run started before the weights existed must replay the same shifts.
    for seed in range(50):
        expected = int(torch.randint(1, 5, (), generator=torch.Generator().manual_seed(seed)))
        assert NoisyShift(5).draw_shift(torch.Generator().manual_seed(seed)) == expected


@pytest.mark.parametrize("weights, message", [((1, 2), "one weight per shift 1..4"), ((1, -1, 1, 1), ">= 0"),
                                              ((0, 0, 0, 0), "positive sum")])
def test_invalid_shift_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        NoisyShift(5, weights)


def test_cli_shift_weights_errors_before_loading_the_target(tmp_path, capsys):
    from longspec.cli.main import main

    base = ["train", "longspec", "--stdlib", "--out", str(tmp_path / "run"), "--gamma", "5"]
    assert main(base + ["--shift-weights", "4", "2", "1"]) == 2
    assert "one weight per shift 1..4" in capsys.readouterr().err
    assert main(base + ["--block-mask", "--shift-weights", "4", "2", "1", "1"]) == 2
    assert "drop it with --block-mask" in capsys.readouterr().err


def test_block_mask_sees_only_previous_blocks():
    visible, counted = BlockVisibility(3).mask(7)
    assert visible.int().tolist() == [
        [0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
    ]
    assert counted.tolist() == [False] * 3 + [True] * 4


# ------------------------------------------------- training == inference
class RecordingChain:
    """Greedy chain of 2 that records the distributions it saw."""

    def __init__(self):
        self.seen = []

    def build(self, expand, root_logprobs, budget, generator=None):
        proposal = Proposal()
        self.seen = [root_logprobs]
        node = proposal.add(int(root_logprobs.argmax()), 0)
        self.seen.append(expand(proposal, [node])[0])
        node = proposal.add(int(self.seen[-1].argmax()), node)
        self.seen.append(expand(proposal, [node])[0])
        proposal.add(int(self.seen[-1].argmax()), node)
        return proposal


VARIANTS = {
    "plain": {},
    "recency-bias": {"recency_bias": True},
    "hidden-input": {"hidden_input": True},
    # A window that binds: the 20-token prompt's queries read 2 sinks and their 5 newest keys.
    "cross-window": {"recency_bias": True, "cross_window": 5, "cross_sinks": 2},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_training_forward_equals_inference_drafting(family, variant):
    """The root and tree nodes at depth d see the target's K/V of positions before the
    root; training with a per-row shift of d + 1 computes exactly the same logits
    (with the recency bias too, and with the EAGLE-style input: both read the target's
    hidden state of the newest position a query may see; and with a cross-attention window
    and sinks)."""
    target = tiny_decoder(family, dtype=torch.float64)
    config = small_draft_config(target, window=64, **VARIANTS[variant])
    draft = DraftModel(config).reset_parameters(seed=3, std=0.3).to(torch.float64)
    prompt = random_ids(20, seed=8)[0]
    L = prompt.numel() - 1  # root position
    cache = target.new_cache(64)
    prefill = target(prompt[:-1].unsqueeze(0), cache)
    cache.commit()
    strategy = RecordingChain()
    drafter = LongSpecDrafter(draft, strategy)
    view = TargetView(target, cache)
    view.prefill_hidden = prefill.hidden[0]  # as the engine hands it over
    drafter.begin(DraftContext(prompt, view, 8))
    tree = drafter.propose(DraftContext(prompt, view, 8))
    ids = torch.cat([prompt, tree.tokens[1:3]])  # root, then the two expanded nodes
    positions = torch.arange(ids.numel())
    features = target_features(target, ids, positions, draft.config.target_layers, self_distill=False)
    features.update(ids=ids, positions=positions)
    index = torch.arange(ids.numel())
    visible = index.unsqueeze(0) < torch.clamp(index, max=L).unsqueeze(1)  # k < min(i, L)
    cross_mask = visible.clone()
    cross_mask[0, 0] = True  # row 0 sees nothing; a dummy key, unused
    hidden = training_hidden(draft, draft.config, target, features, cross_mask, visible)
    logprobs = torch.log_softmax(hidden @ target.head_weight.t(), dim=-1)
    for depth, seen in enumerate(strategy.seen):
        torch.testing.assert_close(seen, logprobs[L + depth], rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------ data
def test_heldout_split_is_by_file_and_shards_round_trip(tmp_path):
    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [ord(c) % 50 + 1 for c in text]})()

    docs = [Document(f"file{i}.py", "x" * (i + 1)) for i in range(40)]
    index = build_shards(docs, Tok(), tmp_path, heldout_fraction=0.25, shard_tokens=30)
    assert set(index["files"]["heldout"]) == {d.name for d in docs if is_held_out(d.name, 0.25)}
    assert index["files"]["heldout"] and not set(index["files"]["heldout"]) & set(index["files"]["train"])
    train = load_split(tmp_path, "train")
    assert train.numel() == sum(len(d.text) + 1 for d in docs if d.name in index["files"]["train"])
    ids = most_frequent_ids(torch.tensor([5, 5, 5, 7, 7, 9]), 12, 2, always=[0])
    assert ids.tolist() == [0, 5]
    sampler = SequenceSampler(torch.arange(100), 10, seed=1)
    first_epoch = torch.cat([sampler.batch(p, 1) for p in range(10)])
    assert sorted(first_epoch[:, 0].tolist()) == list(range(0, 100, 10))


def test_chunked_loss_equals_full_loss_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 8, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    labels[3] = -100
    full = torch.nn.functional.cross_entropy(hidden @ head.t(), labels, ignore_index=-100, reduction="sum")
    (g_full,) = torch.autograd.grad(full, hidden)
    chunked = chunked_cross_entropy(hidden, head, labels, chunk=8)
    (g_chunk,) = torch.autograd.grad(chunked, hidden)
    torch.testing.assert_close(chunked.double(), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_chunk, g_full, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ training runs
def test_killed_and_resumed_run_ends_at_the_same_weights(tmp_path):
    target = tiny_decoder("gemma3", dtype=torch.float32)
    config = small_draft_config(target)
    whole = LongSpecTrainer(target, _tokens(), tmp_path / "whole", _options(), draft_config=config, draft_vocab=60, progress=False)
    whole.train()
    first = LongSpecTrainer(target, _tokens(), tmp_path / "split", _options(), draft_config=config, draft_vocab=60, progress=False)
    first.train(stop_after=3)  # "killed" after step 3 (its checkpoint is on disk)
    del first
    resumed = LongSpecTrainer(target, _tokens(), tmp_path / "split", _options(), draft_config=config, draft_vocab=60, progress=False)
    assert (resumed.step, resumed.position) == (3, 6)
    resumed.train()
    a = load_draft(tmp_path / "whole" / "draft.safetensors", target.config)
    b = load_draft(tmp_path / "split" / "draft.safetensors", target.config)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.layers[0].cross_q.weight, DraftModel(config).reset_parameters(0).layers[0].cross_q.weight)
    curve = (tmp_path / "split" / "loss.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in curve[1:]] == ["1", "2", "3", "4", "5", "6"]


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    target = tiny_decoder("gemma3", dtype=torch.float32)
    config = small_draft_config(target)
    killed = LongSpecTrainer(target, _tokens(), tmp_path / "run", _options(save_every=10), draft_config=config,
                             progress=False)
    killed.train(stop_after=3)  # stopping saves a checkpoint; a kill before step 10 leaves none:
    for name in ("draft.safetensors", "draft.json", "trainer_state.pt", "checkpoint.json"):
        (tmp_path / "run" / name).unlink()
    restarted = LongSpecTrainer(target, _tokens(), tmp_path / "run", _options(save_every=10), draft_config=config,
                                progress=False)
    assert restarted.step == 0
    restarted.train()
    curve = (tmp_path / "run" / "loss.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in curve[1:]] == ["1", "2", "3", "4", "5", "6"]


def test_init_from_continues_an_existing_draft_with_a_fresh_schedule(tmp_path):
    target = tiny_decoder("gemma3", dtype=torch.float32)
    config = small_draft_config(target)
    LongSpecTrainer(target, _tokens(), tmp_path / "first", _options(steps=2), draft_config=config, draft_vocab=60, progress=False).train()
    start = load_draft(tmp_path / "first" / "draft.safetensors", target.config)
    second = LongSpecTrainer(target, _tokens(), tmp_path / "second", _options(steps=2, seed=1),
                             init_from=tmp_path / "first" / "draft.safetensors", progress=False)
    assert second.step == 0 and second.draft.config == start.config
    for (name, x), (_, y) in zip(second.draft.state_dict().items(), start.state_dict().items()):
        assert torch.equal(x, y), name  # vocabulary included
    second.train()
    assert not torch.equal(second.draft.layers[0].cross_q.weight, start.layers[0].cross_q.weight)
    with pytest.raises(ValueError, match="init_from"):
        LongSpecTrainer(target, _tokens(), tmp_path / "third", _options(), draft_vocab=60,
                        init_from=tmp_path / "first" / "draft.safetensors", progress=False)


def test_two_process_gloo_training_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    from longspec_ddp_worker import train_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = tiny_decoder("llama", dtype=torch.float32)
    config = small_draft_config(target)
    files = [str(tmp_path / name) for name in ("target.pt", "tokens.pt", "config.pt")]
    for obj, name in zip((target, _tokens(), config.to_dict()), files):
        torch.save(obj, name)
    mp.spawn(train_rank, args=(2, port, *files, str(tmp_path / "ddp"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    single = LongSpecTrainer(target, _tokens(), tmp_path / "single", _options(batch_size=2, steps=3), draft_config=config, progress=False)
    single.train()
    for name, value in single.draft.state_dict().items():
        assert torch.equal(rank0[name], rank1[name]), name  # replicas stay in sync
        torch.testing.assert_close(rank0[name], value, rtol=1e-4, atol=1e-5)  # same rows, same step


def test_cli_init_from_errors_before_loading_the_target(tmp_path, capsys):
    from longspec.cli.main import main

    missing = tmp_path / "nowhere.safetensors"
    assert main(["train", "longspec", "--stdlib", "--out", str(tmp_path / "run"), "--init-from", str(missing)]) == 2
    assert "--init-from" in capsys.readouterr().err
    existing = tmp_path / "draft.safetensors"
    existing.write_bytes(b"")
    args = ["train", "longspec", "--stdlib", "--out", str(tmp_path / "run"), "--init-from", str(existing), "--draft-vocab", "100"]
    assert main(args) == 2
    assert "drop --draft-vocab" in capsys.readouterr().err


# ------------------------------------------------------------------ held-out evaluation
def test_depth1_predictions_equal_the_inference_drafters_first_token():
    from longspec.speculation.drafters.longspec import ChainStrategy
    from longspec.training.longspec.agreement import draft_agreement, draft_predictions

    target = tiny_decoder("gemma3", dtype=torch.float64)
    draft = DraftModel(small_draft_config(target, window=64)).reset_parameters(seed=1, std=0.3).to(torch.float64)
    sequences = torch.stack([random_ids(12, seed=20 + s)[0] for s in range(2)])
    hits = total = 0
    for ids in sequences:
        predicted, labels = draft_predictions(draft, target, ids, torch.arange(ids.numel()), depth=1)
        for i in range(1, ids.numel()):  # root = ids[i]; the target cache holds ids[:i]
            cache = target.new_cache(32)
            target(ids[:i].unsqueeze(0), cache)
            cache.commit()
            view = TargetView(target, cache)
            drafter = LongSpecDrafter(draft, ChainStrategy(1))
            drafter.begin(DraftContext(ids[: i + 1], view, 4))
            assert int(predicted[i - 1]) == int(drafter.propose(DraftContext(ids[: i + 1], view, 4)).tokens[1])
            assert int(labels[i - 1]) == int(target(ids[: i + 1].unsqueeze(0), target.new_cache(32)).logits[0, -1].argmax())
            hits += int(predicted[i - 1] == labels[i - 1])
            total += 1
    (row,) = draft_agreement(draft, target, sequences, depths=(1,))
    assert (row.depth, row.positions, row.top1) == (1, total, hits / total) and row.cross_entropy > 0
    with pytest.raises(ValueError, match="exceeds the target's"):
        draft_agreement(draft, target, sequences, start_positions=(target.config.max_position_embeddings,))


# ------------------------------------------------------ rows as served, cache keys
def test_rows_start_with_the_served_prefix_and_its_label_never_counts():
    from longspec.training.data import SequenceSampler, prefixed_rows, served_prefix

    class BosTokenizer:
        def __call__(self, text, add_special_tokens=True):
            ids = [ord(c) % 50 + 3 for c in text]
            return type("E", (), {"input_ids": ([2] if add_special_tokens else []) + ids})()

    class PlainTokenizer(BosTokenizer):
        def __call__(self, text, add_special_tokens=True):
            return super().__call__(text, add_special_tokens=False)

    assert served_prefix(BosTokenizer()) == (2,) and served_prefix(PlainTokenizer()) == ()
    stream = torch.arange(10, 40)
    rows = prefixed_rows(stream, 8, (2,))
    assert rows.shape == (4, 8) and bool((rows[:, 0] == 2).all())
    assert torch.equal(rows[:, 1:].reshape(-1), stream[:28])  # the stream continues across rows, nothing skipped
    sampler = SequenceSampler(stream, 8, seed=0, prefix=(2,))
    assert bool((sampler.sequences[:, 0] == 2).all())
    for rule in (ShiftVisibility(1), NoisyShift(5), BlockVisibility(3)):
        _, counted = rule.mask(8, torch.Generator().manual_seed(0))
        assert not bool(counted[0])  # the prefix's own prediction is never in the loss


def test_feature_cache_refuses_features_of_another_key(tmp_path):
    from longspec.training.longspec.features import FeatureCache

    target = tiny_decoder("llama", dtype=torch.float32)
    tokens = random_ids(400, seed=1)[0]
    options = TrainOptions(steps=1, seq_len=32, batch_size=1, save_every=1)
    config = small_draft_config(target)
    LongSpecTrainer(target, tokens, tmp_path / "a", options, draft_config=config, feature_cache=tmp_path / "f",
                    progress=False).train()
    assert list((tmp_path / "f").glob("row*.safetensors"))
    # Same everything: reused.
    LongSpecTrainer(target, tokens, tmp_path / "b", options, draft_config=config, feature_cache=tmp_path / "f", progress=False)
    changes = {
        "corpus": dict(tokens=random_ids(400, seed=2)[0]),
        "target": dict(target=tiny_decoder("llama", dtype=torch.float32, seed=5)),
        "layer": dict(config=small_draft_config(target, target_layers=(0,))),
        "row prefix": dict(options=TrainOptions(steps=1, seq_len=32, batch_size=1, row_prefix=(1,))),
        "seed": dict(options=TrainOptions(steps=1, seq_len=32, batch_size=1, seed=3)),
    }
    for name, change in changes.items():
        arguments = dict(target=target, tokens=tokens, options=options, config=small_draft_config(target))
        arguments.update(change)
        with pytest.raises(ValueError, match="feature cache .* was computed for another"):
            LongSpecTrainer(arguments["target"], arguments["tokens"], tmp_path / name, arguments["options"],
                            draft_config=arguments["config"], feature_cache=tmp_path / "f", progress=False)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "row0-self-aoi.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no key.json"):
        FeatureCache(legacy, key={"a": 1})


def test_long_position_agreement_keeps_the_anchors():
    from longspec.training.longspec import agreement

    target = tiny_decoder("llama", dtype=torch.float64, max_position_embeddings=4096)
    draft = DraftModel(small_draft_config(target, recency_bias=True)).reset_parameters(seed=1, std=0.3).to(torch.float64)
    seen = []
    original = agreement.target_features
    agreement.target_features = lambda t, ids, positions, *a, **k: seen.append(positions.clone()) or original(t, ids, positions, *a, **k)
    try:
        scores = agreement.draft_agreement(draft, target, random_ids(24, seed=2), depths=(1,), start_positions=(0, 2000))
    finally:
        agreement.target_features = original
    assert seen[0].tolist() == list(range(24))
    assert seen[1][:4].tolist() == [0, 1, 2, 3] and seen[1][4:].tolist() == list(range(2004, 2024))
    assert scores[0].top1 != scores[1].top1 or scores[0].cross_entropy != scores[1].cross_entropy  # positions matter


def test_a_feature_store_scores_several_drafts_with_one_target_forward_per_row():
    from longspec.training.longspec import agreement

    target = tiny_decoder("llama", dtype=torch.float64, max_position_embeddings=4096)
    drafts = [DraftModel(small_draft_config(target)).reset_parameters(seed=s, std=0.3).to(torch.float64) for s in (1, 2)]
    sequences = torch.stack([random_ids(24, seed=2 + r)[0] for r in range(3)])
    calls = []
    original = agreement.target_features
    agreement.target_features = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        store = {}
        shared = [agreement.draft_agreement(d, target, sequences, start_positions=(0, 2000), feature_store=store)
                  for d in drafts]
        assert len(calls) == 3 * 2  # rows x start positions, once for both drafts
        alone = [agreement.draft_agreement(d, target, sequences, start_positions=(0, 2000)) for d in drafts]
    finally:
        agreement.target_features = original
    assert shared == alone


@pytest.mark.parametrize("with_retrieval", [False, True], ids=["draft-every-round", "retrieval-first"])
def test_hidden_input_drafter_reads_the_right_states_round_after_round(with_retrieval):
    """Through the engine, every round's root distribution of an EAGLE-style draft equals
    the training forward over the final sequence (shift 1): the states the drafter kept
    from prefill and from each verification are the target's states at those positions."""
    from longspec.speculation.drafters import PromptLookupDrafter
    from longspec.speculation.drafters.longspec import ChainStrategy
    from longspec.speculation.engine import EngineOptions, SpeculativeEngine
    from longspec.training.longspec.visibility import shifted_mask

    target = tiny_decoder("gemma3", dtype=torch.float64)
    draft = DraftModel(small_draft_config(target, window=64, hidden_input=True)).reset_parameters(seed=4, std=0.3)
    draft = draft.to(torch.float64)
    seen = []

    class Recording(LongSpecDrafter):
        def propose(self, context):
            skipped = self.skipped_rounds
            tree = super().propose(context)
            if self.skipped_rounds == skipped:  # the draft ran this round (retrieval may skip it)
                seen.append((context.tokens.numel(), self._root_logprobs.clone()))
            return tree

    engine = SpeculativeEngine(target, EngineOptions(prefill_chunk=8, max_tree_nodes=8, progress=False))
    prompt = torch.cat([random_ids(6, seed=3)[0].repeat(3), random_ids(4, seed=7)[0]])
    retrieval = PromptLookupDrafter(num_tokens=3) if with_retrieval else None
    drafter = Recording(draft, ChainStrategy(3), retrieval=retrieval)
    out = torch.cat(list(engine.generate(prompt, max_new_tokens=30, drafter=drafter)))
    assert not with_retrieval or drafter.skipped_rounds > 0
    ids = torch.cat([prompt, out])
    positions = torch.arange(ids.numel())
    features = target_features(target, ids, positions, draft.config.target_layers, self_distill=False)
    features.update(ids=ids, positions=positions)
    visible, counted = shifted_mask(ids.numel(), 1)
    cross_mask = visible.clone()
    cross_mask[~counted, 0] = True
    hidden = training_hidden(draft, draft.config, target, features, cross_mask, visible)
    logprobs = torch.log_softmax(hidden @ target.head_weight.t(), dim=-1)
    assert len(seen) > 3
    for length, root_logprobs in seen:
        torch.testing.assert_close(root_logprobs, logprobs[length - 1], rtol=1e-8, atol=1e-8)


def test_sampler_max_rows_visits_one_seeded_subset_every_epoch():
    stream = torch.arange(1000)
    whole = SequenceSampler(stream, 10, seed=3)
    sampler = SequenceSampler(stream, 10, seed=3, max_rows=7)
    assert len(sampler) == 7 and len(whole) == 100
    epochs = [sorted(sampler.row_at(e * 7 + i) for i in range(7)) for e in range(3)]
    assert epochs[0] == epochs[1] == epochs[2] == sampler.rows.tolist()  # each epoch visits the subset once
    assert [sampler.row_at(i) for i in range(7)] != [sampler.row_at(7 + i) for i in range(7)]  # in a new order
    assert torch.equal(sampler.sequences, whole.sequences)  # row ids are the stream's: cached features keep names
    assert len(SequenceSampler(stream, 10, seed=3, max_rows=500)) == 100
    with pytest.raises(ValueError, match="max_rows"):
        SequenceSampler(stream, 10, seed=3, max_rows=0)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_warm_start_copies_the_attended_target_layer(family, tmp_path):
    from longspec.training.longspec.warm_start import norm_scale

    target = tiny_decoder(family, dtype=torch.float32)
    config = small_draft_config(target, intermediate_size=target.config.intermediate_size)
    options = TrainOptions(steps=1, seq_len=32, batch_size=1, save_every=1)
    tokens = random_ids(200, seed=2)[0]
    trainer = LongSpecTrainer(target, tokens, tmp_path / "run", options, draft_config=config, warm_start=True, progress=False)
    layer, source = trainer.draft.layers[0], target.layers[config.target_layers[0]]
    q_dim = target.config.num_heads * target.config.head_dim
    assert torch.equal(layer.cross_q.weight, source.qkv_weight[:q_dim])
    assert torch.equal(layer.cross_out.weight, source.o_weight)
    assert torch.equal(layer.gate_up.weight, source.gate_up_weight) and torch.equal(layer.down.weight, source.down_weight)
    assert torch.equal(layer.cross_norm.weight, norm_scale(source.input_norm))
    assert torch.equal(layer.mlp_norm.weight, norm_scale(source.pre_mlp_norm))
    if source.qk_norm is not None:
        assert torch.equal(layer.cross_q_norm.weight, norm_scale(source.qk_norm)[0])
    cold = LongSpecTrainer(target, tokens, tmp_path / "cold", options, draft_config=config, progress=False).draft
    assert torch.equal(cold.layers[0].self_qkv.weight, layer.self_qkv.weight)  # the rest is drawn as without warm start
    assert not torch.equal(cold.layers[0].cross_q.weight, layer.cross_q.weight)
    with pytest.raises(ValueError, match="intermediate_size"):
        LongSpecTrainer(target, tokens, tmp_path / "bad", options, draft_config=small_draft_config(target), warm_start=True,
                        progress=False)
