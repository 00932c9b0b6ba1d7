"""TokenSwift heads trained from the LongSpec trainer's cached target features."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.training.data import prefixed_rows
from longspec.training.fingerprint import target_fingerprint, tokens_fingerprint
from longspec.training.longspec.features import FEATURES_VERSION, IGNORE, FeatureCache, target_features
from longspec.training.tokenswift.heads_cached import (
    CachedHeadsConfig, head_labels, heldout_accuracy, loss_over, map_labels, read_feature_caches,
    train_heads_from_features)
from tiny_models import tiny_decoder

BOS = 1


def _rows(count: int, length: int, seed: int = 0) -> torch.Tensor:
    """BOS-first rows of a periodic stream (the tokens 2..4 ahead are predictable)."""
    body = (torch.arange(count * (length - 1)) * 3 % 7 * 11 + seed) % 128
    rows = body.view(count, length - 1)
    return torch.cat([torch.full((count, 1), BOS), rows], dim=1)


def _cache(directory, target, rows: torch.Tensor, self_distill: bool, **key_overrides):
    """A feature cache as `longspec train longspec` writes it (plain positions)."""
    key = {"features": FEATURES_VERSION, "target": target_fingerprint(target), "layers": [0],
           "seq_len": rows.shape[1], "seed": 0, "row_prefix": [BOS], "tokens": "test", **key_overrides}
    cache = FeatureCache(directory, key=key)
    positions = torch.arange(rows.shape[1])
    for index, row in enumerate(rows):
        name = f"row{index}-{'self' if self_distill else 'data'}-plain"
        cache.get_or_compute(name, lambda row=row: target_features(target, row, positions, (0,), self_distill))
    return directory


def _shards(directory, stream: torch.Tensor):
    """Token shards as `longspec train longspec --shards` writes them: one train shard."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file({"tokens": stream.to(torch.int32)}, str(directory / "train-00000.safetensors"))
    (directory / "index.json").write_text(json.dumps({"shards": {"train": ["train-00000.safetensors"], "heldout": []}}))
    return directory


def test_head_i_is_scored_against_the_token_i_plus_1_ahead():
    labels = torch.arange(10).view(1, 10)  # labels[t] stands for the token at t + 1
    table = head_labels(labels, first=1, num_heads=3)
    assert table.shape == (1, 6, 3)  # positions 1 .. T - γ - 1
    assert table[0, 0].tolist() == [2, 3, 4]  # at t = 1: the tokens at 3, 4, 5 (t + 2, t + 3, t + 4)
    assert table[0, -1].tolist() == [7, 8, 9]  # at t = 6, head 3 reads the row's last label
    with pytest.raises(ValueError, match="leave no position"):
        head_labels(labels, first=8, num_heads=3)


def test_cached_loss_equals_the_heads_cross_entropy_from_a_fresh_forward(tmp_path):
    target = tiny_decoder("llama")  # float64
    rows = _rows(3, 12)
    cached = read_feature_caches([_cache(tmp_path / "c", target, rows, self_distill=False)], target, "data")
    assert cached.prefix_tokens == 1 and cached.label_kind == "data"
    heads = TokenSwiftHeads.for_target(target.config, 3).to(torch.float64).randomize(torch.Generator().manual_seed(1))
    V = target.config.vocab_size
    label_map = torch.arange(V)  # the whole vocabulary: the exact cross-entropy
    loss, per_head, counted = loss_over(target, heads, cached.hidden, cached.labels, 1, target.head_weight, label_map)
    # Reference: a fresh forward over the rows, each head's logits over the full
    # vocabulary, scored against the data token i + 1 ahead of its own head's target.
    with torch.no_grad():
        out = target(rows, target.new_cache(rows.shape[1], batch_size=rows.shape[0]))
    T = rows.shape[1]
    for i in range(3):
        logits = heads.logits(target, out.hidden[:, 1 : T - 3])[..., i, :]  # positions 1 .. T - 4
        wanted = torch.cat([rows, torch.full((rows.shape[0], 1), IGNORE)], dim=1)[:, 1 + i + 2 : T - 3 + i + 2]
        reference = F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), ignore_index=IGNORE)
        torch.testing.assert_close(torch.tensor(per_head[i], dtype=torch.float64), reference)
    assert counted == rows.shape[0] * (T - 1 - 3)


def test_reduced_loss_vocabulary_leaves_out_the_labels_it_does_not_hold():
    label_map = torch.full((10,), IGNORE)
    label_map[torch.tensor([2, 5])] = torch.tensor([0, 1])
    assert map_labels(label_map, torch.tensor([5, 3, IGNORE, 2])).tolist() == [1, IGNORE, IGNORE, 0]


def test_heldout_accuracy_is_the_full_vocabulary_argmax_per_head():
    target = tiny_decoder("llama")
    rows = _rows(2, 10)
    heads = TokenSwiftHeads.for_target(target.config, 2).to(torch.float64).randomize(torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target(rows, target.new_cache(10, batch_size=2)).hidden
    predicted = heads.logits(target, hidden[:, 1:8]).argmax(-1)  # [2, 7, 2] at positions 1..7
    # Labels that head 1 names everywhere (labels[t + 1] for t = 1..7) and the last one
    # ignored, as a row's data labels end: head 2 has one position fewer.
    labels = torch.zeros((2, 10), dtype=torch.long)
    labels[:, 2:9] = predicted[..., 0]
    labels[:, 9] = IGNORE
    accuracy = heldout_accuracy(target, heads, hidden, labels, first=1)
    assert accuracy[0] == 1.0
    wanted = labels[:, 3:10]
    valid = wanted != IGNORE
    assert int(valid.sum()) == 12
    assert accuracy[1] == pytest.approx(float(((predicted[..., 1] == wanted) & valid).sum() / valid.sum()))


def test_trainer_learns_from_cached_features_and_resumes_exactly(tmp_path):
    target = tiny_decoder("qwen3", dtype=torch.float32)
    rows = read_feature_caches([_cache(tmp_path / "c", target, _rows(12, 16), self_distill=True)], target, "self")
    config = CachedHeadsConfig(steps=6, batch_size=2, lr=5e-2, warmup_steps=1, loss_vocab=64, heldout_rows=2,
                               eval_every=3, save_every=3)
    straight = train_heads_from_features(target, rows, tmp_path / "a", config, log=lambda line: None)
    curve = (tmp_path / "a" / "curve.csv").read_text().splitlines()
    assert len(curve) == 3 and float(curve[-1].split(",")[4]) < 10.0
    with pytest.raises(ValueError, match="already holds a training run"):
        train_heads_from_features(target, rows, tmp_path / "a", config, log=lambda line: None)
    # Interrupted after one step (wall-time limit), then resumed: equals the straight run.
    limited = CachedHeadsConfig(**{**config.__dict__, "max_minutes": 0.0})
    train_heads_from_features(target, rows, tmp_path / "b", limited, log=lambda line: None)
    assert torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=False)["step"] == 1
    resumed = train_heads_from_features(target, rows, tmp_path / "b", config, resume=True, log=lambda line: None)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)
    other = CachedHeadsConfig(**{**config.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="other settings or feature caches"):
        train_heads_from_features(target, rows, tmp_path / "b", other, resume=True, log=lambda line: None)


def test_caches_of_another_target_layout_or_shape_are_refused(tmp_path):
    target = tiny_decoder("llama")
    good = _cache(tmp_path / "good", target, _rows(2, 12), self_distill=True)
    other = tiny_decoder("llama", seed=1)
    with pytest.raises(ValueError, match="another target"):
        read_feature_caches([good], other, "self")
    with pytest.raises(ValueError, match="no rows with 'data' labels"):
        read_feature_caches([good], target, "data")
    longer = _cache(tmp_path / "longer", target, _rows(2, 14), self_distill=True)
    with pytest.raises(ValueError, match="different lengths or prefixes"):
        read_feature_caches([good, longer], target, "self")
    old = tmp_path / "old"
    old.mkdir()
    (old / FeatureCache.KEY_FILE).write_text(json.dumps({"digest": "x", "key": {
        "features": 1, "target": target_fingerprint(target)}}))
    with pytest.raises(ValueError, match="layout version 1"):
        read_feature_caches([old], target, "self")
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        read_feature_caches([tmp_path], target, "self")


def test_cache_shards_give_every_cached_row_its_tokens_and_data_labels(tmp_path):
    """A cache of self-distilled rows and the shards its run cut them from: each row's
    tokens are found by its row number (a sample of the stream's rows, as --max-rows
    caches them), data labels are the next tokens, the hidden states are the same rows'."""
    target = tiny_decoder("llama")
    stream = (torch.arange(60) * 5 % 13 * 7 + 3) % 128
    rows = prefixed_rows(stream, 12, [BOS])  # 5 rows: BOS + 11 tokens
    key = {"features": FEATURES_VERSION, "target": target_fingerprint(target), "layers": [0], "seq_len": 12,
           "seed": 0, "row_prefix": [BOS], "tokens": tokens_fingerprint(stream)}
    cache = FeatureCache(tmp_path / "c", key=key)
    positions = torch.arange(12)
    for number in (3, 1):
        cache.get_or_compute(f"row{number}-self-plain",
                             lambda row=rows[number]: target_features(target, row, positions, (0,), True))
    shards = _shards(tmp_path / "s", stream)
    data = read_feature_caches([tmp_path / "c"], target, "data", [shards])
    assert data.label_kind == "data" and torch.equal(data.ids, rows[[1, 3]])
    assert torch.equal(data.labels[:, :-1], rows[[1, 3], 1:]) and (data.labels[:, -1] == IGNORE).all()
    distilled = read_feature_caches([tmp_path / "c"], target, "self", [shards])
    assert torch.equal(distilled.hidden, data.hidden) and torch.equal(distilled.ids, data.ids)
    fresh = target_features(target, rows[3], positions, (), True)  # row 3's own forward
    assert torch.equal(distilled.labels[1], fresh["labels"]) and torch.equal(distilled.hidden[1], fresh["hidden"])
    assert data.sources != read_feature_caches([tmp_path / "c"], target, "self").sources  # a resume tells them apart
    with pytest.raises(ValueError, match="not the token stream"):
        read_feature_caches([tmp_path / "c"], target, "data", [_shards(tmp_path / "other", stream.flip(0))])
    with pytest.raises(ValueError, match="2 shard directories for 1 feature caches"):
        read_feature_caches([tmp_path / "c"], target, "data", [shards, shards])
    with pytest.raises(ValueError, match="--cache-shards"):  # without shards, the self rows have no data labels
        read_feature_caches([tmp_path / "c"], target, "data")


def test_cli_refuses_feature_caches_with_text_data(tmp_path, capsys):
    from longspec.cli.main import main

    assert main(["train", "tokenswift", "--feature-cache", str(tmp_path), "--data", str(tmp_path),
                 "--out", str(tmp_path / "out")]) == 2
    assert "drop --data" in capsys.readouterr().err
    assert main(["train", "tokenswift", "--feature-cache", str(tmp_path), "--seq-len", "512", "--no-bos",
                 "--out", str(tmp_path / "out")]) == 2
    assert "--seq-len, --no-bos shape text windows" in capsys.readouterr().err
    assert main(["train", "tokenswift", "--cache-shards", str(tmp_path), "--data", str(tmp_path),
                 "--out", str(tmp_path / "out")]) == 2
    assert "pass those too" in capsys.readouterr().err
    assert main(["train", "tokenswift", "--feature-cache", str(tmp_path), "--cache-shards", str(tmp_path),
                 "--cache-shards", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "2 --cache-shards for 1 --feature-cache" in capsys.readouterr().err
