"""TokenSwift parts: residual heads, the dynamic partial KV cache (against brute
force), GQA importance without K replication, tree assembly, Distinct-n, trainer."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.cache import KVCache
from longspec.speculation.metrics import distinct_n
from longspec.speculation.drafters.tokenswift.heads import HeadsConfig, TokenSwiftHeads
from longspec.speculation.drafters.shared.partial_cache import (
    PartialKVCache,
    grouped_importance,
    recording_queries,
)
from longspec.speculation.drafters.tokenswift.tree import add_chains_within, cartesian_within
from longspec.speculation.tree import Tree
from tiny_models import random_ids, tiny_config, tiny_decoder
from longspec.runtime.config import DecoderConfig


# ----------------------------------------------------------------------- heads
def test_identity_heads_reproduce_the_target_head():
    model = tiny_decoder("gemma3", dtype=torch.float64)
    heads = TokenSwiftHeads.for_target(model.config).to(torch.float64)
    ids = random_ids(9, seed=1)
    out = model(ids, model.new_cache(16))
    head_logits = heads.logits(model, out.hidden[0])  # [T, γ, V]
    for i in range(3):
        # Equal up to the RMSNorm epsilon (rms of a unit-rms vector is sqrt(1 + eps)).
        torch.testing.assert_close(head_logits[:, i], out.logits[0], rtol=1e-5, atol=1e-5)


def test_heads_round_trip_and_misfit_error(tmp_path):
    model = tiny_decoder("llama", dtype=torch.float64)
    heads = TokenSwiftHeads.for_target(model.config, target="tiny").randomize(torch.Generator().manual_seed(0))
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    loaded = TokenSwiftHeads.load(path, model.config)
    for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b)
    other = tiny_decoder("llama", dtype=torch.float64, vocab_size=64)
    with pytest.raises(ValueError, match="do not fit this target.*vocabulary 128 != target's 64"):
        TokenSwiftHeads.load(path, other.config)
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(Exception):
        TokenSwiftHeads.load(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError):
        TokenSwiftHeads.load(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------- importance
def test_grouped_importance_equals_replicated_keys():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)  # 8 query heads
    k = torch.randn(2, 2, 30, 16, generator=g, dtype=torch.float64)  # 2 kv heads
    replicated = k.repeat_interleave(4, dim=1)  # [B, Hq, N, D]
    expected = torch.einsum("bhd,bhnd->n", q, replicated)
    torch.testing.assert_close(grouped_importance(q, k), expected)


# -------------------------------------------------------------- partial cache
def _config(**kw) -> DecoderConfig:
    return DecoderConfig.from_hf(tiny_config("llama", **kw))


def _source(length, seed=0):
    """Random full K/V per full layer, as the verifier's cache would hold."""
    g = torch.Generator().manual_seed(seed)
    config = _config()
    kv = {layer: (torch.randn(1, 2, length, 16, generator=g, dtype=torch.float64),
                  torch.randn(1, 2, length, 16, generator=g, dtype=torch.float64))
          for layer in range(config.num_layers)}
    return config, kv


def _brute_force_selection(q, k, length, budget, sinks, keep):
    """Sinks + the (budget - keep - sinks) most important other positions,
    scoring with explicitly replicated K; victims in ascending importance."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("bhd,bhnd->n", q, k[:, :, :length].repeat_interleave(group, dim=1))
    rest = sorted(range(sinks, length), key=lambda p: -float(scores[p]))[: budget - keep - sinks]
    victims = sorted(rest, key=lambda p: float(scores[p]))
    return set(range(sinks)) | set(rest), victims


def _step(cache, kv_new, positions, source):
    """One fake drafting forward: store K/V for every layer, record queries, commit."""
    cache.begin_forward(positions)
    for layer in range(cache.config.num_layers):
        cache.store(layer, *kv_new[layer])
    cache.commit(source)


def test_rebuild_selects_sinks_and_most_important_like_brute_force():
    config, kv = _source(40)
    cache = PartialKVCache(config, budget=12, sinks=3, max_forward_tokens=2, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    cache.start_at(40)
    cache.last_queries = [torch.randn(1, 4, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    cache.rebuild(lambda layer: kv[layer], 40)
    for j, layer in enumerate(cache.full_layers):
        chosen, victims = _brute_force_selection(cache.last_queries[j], kv[layer][0], 40, 12, 3, keep=0)
        assert set(cache.selected_positions(layer).tolist()) == chosen
        assert cache.slot_positions[j, cache.victims[j]].tolist() == victims
        # The slots hold exactly the source's K/V of those positions.
        slots = cache.slot_positions[j, : cache.used]
        torch.testing.assert_close(cache.full_k[j][:, :, : cache.used], kv[layer][0][:, :, slots])


def test_new_tokens_replace_least_important_then_rebuild_at_the_sinks():
    total = 60
    config, kv = _source(total, seed=1)
    source = lambda layer: kv[layer]  # noqa: E731
    budget, sinks = 10, 2
    cache = PartialKVCache(config, budget=budget, sinks=sinks, max_forward_tokens=2, dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    start = 30
    cache.start_at(start)
    queries = [torch.randn(1, 4, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    cache.last_queries = list(queries)
    cache.rebuild(source, start)
    expected = {layer: set(cache.selected_positions(layer).tolist()) for layer in cache.full_layers}
    queue = {layer: cache.slot_positions[j, cache.victims[j]].tolist() for j, layer in enumerate(cache.full_layers)}
    n_victims = budget - sinks
    position = start
    for step in range(6):  # 2 tokens per step: 8 victims last 4 steps, the 5th step rebuilds
        positions = torch.arange(position, position + 2)
        new = {layer: (kv[layer][0][:, :, positions], kv[layer][1][:, :, positions]) for layer in kv}
        _step(cache, new, positions, source)
        position += 2
        for j, layer in enumerate(cache.full_layers):
            if step < n_victims // 2:
                out = set(queue[layer][2 * step : 2 * step + 2])
                expected[layer] = (expected[layer] - out) | set(positions.tolist())
                assert set(cache.selected_positions(layer).tolist()) == expected[layer]
            elif step == n_victims // 2:
                # Replacements reached the sinks: re-scored over every preceding
                # position; this forward's tokens are kept.
                chosen, _ = _brute_force_selection(queries[j], kv[layer][0], int(positions[0]), budget, sinks, keep=2)
                assert set(cache.selected_positions(layer).tolist()) == chosen | set(positions.tolist())
        assert cache.rebuilds == (1 if step < n_victims // 2 else 2)
        assert cache.used <= budget
        for j, layer in enumerate(cache.full_layers):  # slots always hold the true K/V of their positions
            slots = cache.slot_positions[j, : cache.used]
            torch.testing.assert_close(cache.full_k[j][:, :, : cache.used], kv[layer][0][:, :, slots])


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_partial_cache_holding_everything_is_exact(family):
    """With a budget covering the sequence, drafting forwards equal the target's."""
    model = tiny_decoder(family, dtype=torch.float64)
    ids = random_ids(30, seed=3)[0]
    full = KVCache(model.config, 64, dtype=torch.float64)
    reference = model(ids.unsqueeze(0), full).logits[0]
    cache = PartialKVCache(model.config, budget=64, sinks=4, max_forward_tokens=4, dtype=torch.float64)
    got = []
    for begin in range(0, ids.numel(), 4):
        piece = ids[begin : begin + 4]
        with recording_queries(model, cache):
            got.append(model(piece.unsqueeze(0), cache, positions=cache.length + torch.arange(piece.numel())).logits[0])
        cache.commit()
    torch.testing.assert_close(torch.cat(got), reference, rtol=1e-9, atol=1e-9)
    assert all(q is not None for q in cache.last_queries)
    assert model.attention.__name__ == "fused_attention"  # the wrapper is removed


def test_partial_cache_rejects_a_budget_too_small():
    with pytest.raises(ValueError, match="budget 5 is smaller than sinks"):
        PartialKVCache(_config(), budget=5, sinks=4, max_forward_tokens=2)


# ----------------------------------------------------------------------- tree
def _siblings_unique(tree: Tree) -> bool:
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist()))[1:]
    return len(pairs) == len(set(pairs))


def test_ngram_chains_merge_into_the_cartesian_tree_without_duplicates():
    cands = [torch.tensor([5]), torch.tensor([1, 2, 3]), torch.tensor([4, 1, 7]), torch.tensor([0, 8, 9])]
    tree = cartesian_within(99, cands, 64)
    assert tree.size == 1 + 1 + 3 + 9 + 27
    chains = [[5, 1, 4, 0], [5, 1, 4, 11], [5, 12, 13, 14], [6, 1, 2, 3], [5, 1, 4, 0]]
    merged = add_chains_within(tree, chains, 64)
    assert _siblings_unique(merged)
    assert merged.size == tree.size + 1 + 3 + 4  # [5,1,4,0] and its repeat exist already
    paths = {tuple(merged.tokens[merged.path_to(i)][1:].tolist()) for i in range(merged.size)}
    assert all(tuple(c) in paths for c in chains)
    # Trimmed to the budget: the chain that does not fit is cut, later ones dropped.
    small = add_chains_within(tree, chains, tree.size - 1 + 2)
    assert small.size == tree.size + 2 and _siblings_unique(small)
    assert cartesian_within(99, cands, 20).size == 1 + 1 + 3 + 9
    assert cartesian_within(99, cands, 0).size == 1


def test_distinct_n():
    assert distinct_n([1, 2, 1, 2, 1], 1) == 2 / 5
    assert distinct_n([1, 2, 1, 2, 1], 2) == 2 / 4
    assert distinct_n([1, 2, 3], 4) == 0.0
    with pytest.raises(ValueError):
        distinct_n([1], 0)


# -------------------------------------------------------------------- trainer
def test_trainer_learns_and_resumes_exactly(tmp_path):
    from longspec.training.tokenswift.heads import HeadsTrainingConfig, train_heads

    model = tiny_decoder("qwen3", dtype=torch.float32)
    # A periodic stream: the token 2..4 ahead is predictable from the current one.
    data = torch.arange(7).repeat(60)[: 16 * 24].view(24, 16) * 3 % 128
    config = HeadsTrainingConfig(steps=6, batch_size=4, seq_len=16, rows_per_window=8, lr=5e-2, warmup_steps=1,
                                 heldout_windows=4, eval_every=3, save_every=3)
    straight = train_heads(model, data, tmp_path / "a", config, log=lambda line: None)
    curve = (tmp_path / "a" / "curve.csv").read_text().splitlines()
    assert float(curve[-1].split(",")[5]) < float(curve[1].split(",")[5])  # held-out loss went down
    with pytest.raises(ValueError, match="already holds a training run"):
        train_heads(model, data, tmp_path / "a", config, log=lambda line: None)
    # Interrupted after one step (wall-time limit), then resumed: equals the straight run.
    limited = HeadsTrainingConfig(**{**config.__dict__, "max_minutes": 0.0})
    train_heads(model, data, tmp_path / "b", limited, log=lambda line: None)
    assert torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=False)["step"] == 1
    resumed = train_heads(model, data, tmp_path / "b", config, resume=True, log=lambda line: None)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)
    other = HeadsTrainingConfig(**{**config.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="different configuration"):
        train_heads(model, data, tmp_path / "b", other, resume=True, log=lambda line: None)


def test_heads_windows_start_with_the_served_prefix_and_it_is_never_drafted_from():
    from longspec.training.tokenswift.data import windows
    from longspec.training.tokenswift.heads import sample_rows

    data = windows(torch.arange(100), 10, prefix=(7,))
    assert data.shape == (11, 10) and bool((data[:, 0] == 7).all()) and data[0, 1:].tolist() == list(range(9))
    rows = sample_rows(10, 20, 3, torch.Generator().manual_seed(0), first=1)
    assert rows.tolist() == list(range(1, 6))  # positions 1 .. T - γ - 2: never the prefix
