"""KV cache operations (append, rollback, tree commit, the sliding-window ring) and
the fused attention backend, checked in float64 against recomputation from scratch."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.attention import fused_attention, reference_attention, sdpa_attention
from longspec.runtime.batch_cache import BatchKVCache
from longspec.runtime.cache import EMPTY_SLOT, KVCache
from longspec.speculation.tree import Tree
from tiny_models import SLIDING_WINDOW, random_ids, tiny_decoder

EXACT = 1e-10
WINDOW = SLIDING_WINDOW
# gemma3: sliding, full, sliding layers; llama: full only; mistral: sliding only.
MODELS = ("gemma3", "llama", "mistral")
SLIDING_MODELS = ("gemma3", "mistral")


@pytest.fixture(scope="module", params=MODELS)
def decoder(request):
    return tiny_decoder(request.param, dtype=torch.float64)


def fresh_logits(decoder, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position, from one forward over a new cache."""
    n = ids.shape[1]
    cache = decoder.new_cache(n, max_forward_tokens=n)
    logits = decoder(ids, cache).logits
    cache.drop_pending()
    return logits


def feed(decoder, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Append ids in forwards of at most `chunk` tokens, committing each; all logits."""
    out = []
    for start in range(0, ids.shape[1], chunk):
        out.append(decoder(ids[:, start : start + chunk], cache).logits)
        cache.commit()
    return torch.cat(out, dim=1)


def assert_exact(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff <= EXACT, f"max abs difference {diff:.3g}"


# ----------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("k", [1, 3, 8, 13])
def test_append_then_continue(decoder, k):
    ids = random_ids(50, seed=10 + k)
    cache = decoder.new_cache(64, max_forward_tokens=16)
    prefix = 21
    logits = [feed(decoder, cache, ids[:, :prefix], 16)]
    logits.append(decoder(ids[:, prefix : prefix + k], cache).logits)
    cache.commit()
    assert cache.length == prefix + k
    logits.append(feed(decoder, cache, ids[:, prefix + k :], 5))
    assert_exact(torch.cat(logits, dim=1), fresh_logits(decoder, ids))


def test_forward_limits(decoder):
    cache = decoder.new_cache(10, max_forward_tokens=4)
    with pytest.raises(ValueError):
        decoder(random_ids(5), cache)
    feed(decoder, cache, random_ids(8), 4)
    with pytest.raises(ValueError):
        decoder(random_ids(3), cache)  # 8 + 3 > capacity 10
    decoder(random_ids(2), cache)
    with pytest.raises(RuntimeError):
        decoder(random_ids(1), cache)  # pending tokens neither committed nor dropped


# ----------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("distance", [1, 4, 6])
@pytest.mark.parametrize("steps", [1, 3])
def test_rollback_then_continue(decoder, distance, steps):
    """Commit `distance` extra tokens over `steps` forwards, roll them back, continue
    with other tokens: the same logits as a fresh cache fed only the survivors."""
    headroom = 6
    ids = random_ids(40, seed=distance * 10 + steps)
    other = random_ids(12, seed=99)
    cache = decoder.new_cache(64, max_forward_tokens=headroom)
    length = 23
    feed(decoder, cache, ids[:, :length], headroom)
    extra = ids[:, length : length + distance]
    for part in extra.tensor_split(steps, dim=1):
        if part.shape[1]:
            decoder(part, cache)
            cache.commit()
    assert cache.length == length + distance
    cache.rollback(length)
    assert cache.length == length
    ours = feed(decoder, cache, other, 5)
    expected = fresh_logits(decoder, torch.cat([ids[:, :length], other], dim=1))[:, length:]
    assert_exact(ours, expected)


@pytest.mark.parametrize("name", SLIDING_MODELS)
def test_rollback_beyond_ring_headroom_raises(name):
    decoder = tiny_decoder(name)
    headroom = 4
    cache = decoder.new_cache(64, max_forward_tokens=headroom)
    feed(decoder, cache, random_ids(30), headroom)
    assert cache.ring_size == WINDOW + headroom
    with pytest.raises(ValueError):
        cache.rollback(30 - headroom - 1)
    assert cache.length == 30  # a refused rollback changes nothing
    cache.rollback(30 - headroom)  # exactly the headroom is fine
    cache.rollback(0)  # back to empty is always fine
    assert cache.length == 0
    ids = random_ids(20, seed=7)
    assert_exact(feed(decoder, cache, ids, headroom), fresh_logits(decoder, ids))


def test_rollback_without_sliding_layers_has_no_limit():
    decoder = tiny_decoder("llama")
    ids, other = random_ids(40, seed=1), random_ids(10, seed=2)
    cache = decoder.new_cache(64, max_forward_tokens=4)
    feed(decoder, cache, ids, 4)
    cache.rollback(3)
    ours = feed(decoder, cache, other, 4)
    assert_exact(ours, fresh_logits(decoder, torch.cat([ids[:, :3], other], dim=1))[:, 3:])


@pytest.mark.parametrize("name", SLIDING_MODELS)
def test_ring_as_large_as_capacity_rolls_back_anywhere(name):
    decoder = tiny_decoder(name)
    cache = decoder.new_cache(12, max_forward_tokens=8)
    assert cache.ring_size == 12  # min(capacity, window + max_forward_tokens)
    ids, other = random_ids(12, seed=1), random_ids(6, seed=2)
    feed(decoder, cache, ids, 8)
    cache.rollback(cache.length)  # a no-op
    cache.rollback(2)
    ours = feed(decoder, cache, other, 8)
    assert_exact(ours, fresh_logits(decoder, torch.cat([ids[:, :2], other], dim=1))[:, 2:])


@pytest.mark.parametrize("name", SLIDING_MODELS)
def test_rollback_refused_when_a_partial_tree_commit_overwrote_the_window(name):
    """A tree forward writes ring slots for all its T nodes; keeping only a short
    path means the headroom rule is not enough: the cache must refuse, not read a
    window with holes."""
    decoder = tiny_decoder(name)
    M = 6
    ids = random_ids(40, seed=3)
    cache = decoder.new_cache(64, max_forward_tokens=M)
    feed(decoder, cache, ids[:, :30], M)
    decoder(ids[:, 30:36], cache, tree_mask=torch.eye(M, dtype=torch.bool), positions=torch.full((M,), 30))
    cache.commit(torch.tensor([0]))
    with pytest.raises(ValueError):
        cache.rollback(31 - M)
    cache.rollback(31 - M + 4)  # far enough from the overwritten slots
    other = random_ids(5, seed=4)
    ours = feed(decoder, cache, other, M)
    prefix = torch.cat([ids[:, :30], ids[:, 30:31]], dim=1)[:, : 31 - M + 4]
    assert_exact(ours, fresh_logits(decoder, torch.cat([prefix, other], dim=1))[:, prefix.shape[1] :])


def test_rollback_and_commit_argument_errors(decoder):
    cache = decoder.new_cache(32, max_forward_tokens=8)
    feed(decoder, cache, random_ids(10), 8)
    with pytest.raises(ValueError):
        cache.rollback(11)
    decoder(random_ids(3), cache)
    with pytest.raises(RuntimeError):
        cache.rollback(5)  # pending tokens first
    with pytest.raises(ValueError):
        cache.commit(torch.tensor([0, 3]))
    cache.drop_pending()
    assert cache.length == 10 and cache.pending == 0


# ----------------------------------------------------------------------------- (c)
def random_tree(T: int, generator: torch.Generator) -> torch.Tensor:
    """parents[i] < i (parents[0] = -1): often the previous node, so trees get deep."""
    parents = [-1]
    for i in range(1, T):
        if torch.rand((), generator=generator) < 0.5:
            parents.append(i - 1)
        else:
            parents.append(int(torch.randint(0, i, (), generator=generator)))
    return torch.tensor(parents)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    T = parents.numel()
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        mask[i] |= mask[parents[i]]
    return mask


def path_to(parents: torch.Tensor, node: int) -> torch.Tensor:
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return torch.tensor(path[::-1])


@pytest.mark.parametrize("prefix_len", [0, 5, 30])
@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_and_commit_path(decoder, prefix_len, seed):
    g = torch.Generator().manual_seed(seed)
    T = 14
    parents = random_tree(T, g)
    mask = ancestor_mask(parents)
    depth = mask.sum(dim=1) - 1
    ids = random_ids(prefix_len + T + 6, seed=100 + seed)
    prefix, tree_ids, tail = ids[:, :prefix_len], ids[:, prefix_len : prefix_len + T], ids[:, prefix_len + T :]
    cache = decoder.new_cache(64, max_forward_tokens=T)
    if prefix_len:
        feed(decoder, cache, prefix, 7)
    tree_logits = decoder(tree_ids, cache, tree_mask=mask, positions=prefix_len + depth).logits

    # Every node's logits are those of its root-to-node path appended to the prefix.
    for node in range(T):
        seq = torch.cat([prefix, tree_ids[:, path_to(parents, node)]], dim=1)
        assert_exact(tree_logits[:, node], fresh_logits(decoder, seq)[:, -1])

    node = int(torch.randint(0, T, (), generator=g))
    path = path_to(parents, node)
    cache.commit(path)
    assert cache.length == prefix_len + path.numel()
    ours = feed(decoder, cache, tail, 4)
    seq = torch.cat([prefix, tree_ids[:, path], tail], dim=1)
    assert_exact(ours, fresh_logits(decoder, seq)[:, -tail.shape[1] :])


def test_drop_pending_tree(decoder):
    g = torch.Generator().manual_seed(5)
    parents = random_tree(10, g)
    ids, tail = random_ids(20, seed=1), random_ids(6, seed=2)
    cache = decoder.new_cache(64, max_forward_tokens=10)
    feed(decoder, cache, ids, 10)
    decoder(random_ids(10, seed=3), cache, tree_mask=ancestor_mask(parents), positions=20 + ancestor_mask(parents).sum(1) - 1)
    cache.drop_pending()
    assert cache.length == 20
    assert_exact(feed(decoder, cache, tail, 3), fresh_logits(decoder, torch.cat([ids, tail], dim=1))[:, 20:])


def test_many_speculative_rounds(decoder):
    """Rounds of tree forward + partial commit, enough to wrap the ring many times:
    the logits of every kept node equal a single prefill over the final sequence."""
    g = torch.Generator().manual_seed(11)
    M = 9
    cache = decoder.new_cache(400, max_forward_tokens=M)
    sequence = random_ids(12, seed=12)
    kept_logits = [feed(decoder, cache, sequence, M)]
    for round_ in range(40):
        T = int(torch.randint(1, M + 1, (), generator=g))
        parents = random_tree(T, g)
        mask = ancestor_mask(parents)
        tree_ids = torch.randint(0, decoder.config.vocab_size, (1, T), generator=g)
        L = cache.length
        out = decoder(tree_ids, cache, tree_mask=mask, positions=L + mask.sum(1) - 1).logits
        path = path_to(parents, int(torch.randint(0, T, (), generator=g)))
        cache.commit(path)
        kept_logits.append(out[:, path])
        sequence = torch.cat([sequence, tree_ids[:, path]], dim=1)
        assert cache.length == sequence.shape[1]
    assert_exact(torch.cat(kept_logits, dim=1), fresh_logits(decoder, sequence))


# ----------------------------------------------------------------------------- (d)
@pytest.mark.parametrize("name", SLIDING_MODELS)
def test_ring_stays_bounded_over_long_decoding(name):
    decoder = tiny_decoder(name)
    steps = 2000
    cache = decoder.new_cache(steps + 16, max_forward_tokens=4)
    shapes = (cache.ring_k.shape, cache.ring_v.shape, cache.ring_positions.shape)
    assert cache.ring_k.shape[3] == WINDOW + 4
    ids = random_ids(steps, seed=21)
    bytes_before = cache.nbytes()
    ring_ptr = cache.ring_k.data_ptr()
    logits = [feed(decoder, cache, ids[:, :5], 4)]
    for i in range(5, steps):
        logits.append(decoder(ids[:, i : i + 1], cache).logits)
        cache.commit()
        assert (cache.ring_k.shape, cache.ring_v.shape, cache.ring_positions.shape) == shapes
        assert cache.nbytes() == bytes_before
    assert cache.ring_k.data_ptr() == ring_ptr  # written in place, never reallocated
    assert cache.length == steps
    assert_exact(torch.cat(logits, dim=1), fresh_logits(decoder, ids))


# ----------------------------------------------------------------------------- (e)
def _ring_mask(T: int, R: int, g: torch.Generator) -> torch.Tensor:
    """A sliding layer's [T, R] ring mask: slots hold scattered committed positions
    (or nothing) and each query sees those within its window."""
    length = int(torch.randint(0, 3 * R, (), generator=g))
    slot_pos = torch.randint(max(0, length - R), max(1, length), (R,), generator=g)
    slot_pos[torch.rand(R, generator=g) < 0.3] = -(2**62)
    query_pos = length + torch.randint(0, T + 1, (T,), generator=g)
    return (slot_pos < length).unsqueeze(0) & (slot_pos.unsqueeze(0) > query_pos.unsqueeze(1) - WINDOW)


def _attention_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 3, (), generator=g))
    Hkv = int(torch.randint(1, 4, (), generator=g))
    group = [1, 2, 4][seed % 3]
    T = int(torch.randint(1, 24, (), generator=g))
    P = [0, 1, 7, 37][seed % 4]
    D = [8, 16, 32][seed % 5 % 3]

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q = rand(B, Hkv * group, T, D)
    k_prefix, v_prefix = rand(B, Hkv, P, D), rand(B, Hkv, P, D)
    k_new, v_new = rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    kind = seed % 3
    if kind == 0 or P == 0:
        prefix_mask = None
    elif kind == 1:
        prefix_mask = torch.rand(T, P, generator=g) < 0.5
        prefix_mask[torch.rand(T, generator=g) < 0.3] = False  # rows with no visible prefix key
    else:
        prefix_mask = _ring_mask(T, P, g)
    new_mask = ancestor_mask(random_tree(T, g))
    if seed % 2:
        new_mask &= torch.rand(T, T, generator=g) < 0.7
        new_mask |= torch.eye(T, dtype=torch.bool)  # a token always sees itself
    scale = float(torch.rand((), generator=g)) + 0.1
    return q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale


# sdpa: the device-generic path a GPU takes where the Triton tree kernel does not.
BACKENDS = pytest.mark.parametrize("backend", [fused_attention, sdpa_attention], ids=["fused", "sdpa"])


@BACKENDS
@pytest.mark.parametrize("seed", range(36))
def test_fused_attention_equals_reference(seed, backend):
    args = _attention_case(seed)
    fused = backend(*args)
    assert torch.isfinite(fused).all()
    assert_exact(fused, reference_attention(*args))


@BACKENDS
@pytest.mark.parametrize("seed", range(6))
def test_fused_attention_prefix_only(seed, backend):
    """Single-token decode on a full layer: no new part, no mask."""
    q, k_prefix, v_prefix, *_ , scale = _attention_case(seed * 4 + 3)  # P = 37
    q = q[:, :, :1]
    args = (q, k_prefix, v_prefix, None, None, None, None, scale)
    assert_exact(backend(*args), reference_attention(*args))


@BACKENDS
def test_fused_attention_fully_masked_prefix_rows_fall_back_to_new_part(backend):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g, dtype=torch.float64)
    kp, vp = torch.randn(2, 1, 2, 9, 16, generator=g, dtype=torch.float64)
    kn, vn = torch.randn(2, 1, 2, 5, 16, generator=g, dtype=torch.float64)
    prefix_mask = torch.zeros(5, 9, dtype=torch.bool)  # e.g. an empty ring
    new_mask = torch.ones(5, 5, dtype=torch.bool).tril()
    args = (q, kp, vp, prefix_mask, kn, vn, new_mask, 0.25)
    expected = reference_attention(q, kn[:, :, :0], vn[:, :, :0], None, kn, vn, new_mask, 0.25)
    assert_exact(backend(*args), expected)
    assert_exact(reference_attention(*args), expected)


def test_tree_kernel_fallback_is_taken_and_logged(monkeypatch, caplog):
    """Off the CPU, a tree the Triton kernel cannot serve (Triton missing, or float64)
    goes to SDPA, with one warning naming the reason."""
    from longspec.runtime import attention

    q = torch.zeros((1, 2, 3, 8), dtype=torch.float64)
    attention._log_fallback_once.cache_clear()
    monkeypatch.setattr(attention, "_tree_kernel_unavailable", lambda: "triton is not installed")
    with caplog.at_level("WARNING", logger="longspec.runtime.attention"):
        assert not attention.tree_kernel_fits(q, None)
        assert not attention.tree_kernel_fits(q, None)
    assert [r.getMessage().count("triton is not installed") for r in caplog.records] == [1]
    monkeypatch.setattr(attention, "_tree_kernel_unavailable", lambda: None)
    monkeypatch.setattr(attention, "_tree_kernel_dtypes", lambda: (torch.float32,))
    caplog.clear()
    with caplog.at_level("WARNING", logger="longspec.runtime.attention"):
        assert not attention.tree_kernel_fits(q, None)
        assert attention.tree_kernel_fits(q.float(), None)
    assert "does not compute in torch.float64" in caplog.text


def test_the_tree_kernel_serves_only_a_forwards_own_tokens_over_an_unmasked_prefix(monkeypatch):
    """A draft's cross-attention passes a tail of the target's keys whose count differs
    from the queries': that goes to SDPA (the Triton kernel needs T tree keys for T
    queries; on an H200 the LongSpec draft failed there before this check)."""
    from longspec.runtime import attention

    monkeypatch.setattr(attention, "tree_kernel_fits", lambda q, mask: True)
    q = torch.zeros((1, 4, 5, 8))
    assert attention.tree_kernel_serves(q, None, torch.zeros((1, 2, 5, 8)))
    assert not attention.tree_kernel_serves(q, None, torch.zeros((1, 2, 7, 8)))  # a cross-attention tail
    assert not attention.tree_kernel_serves(q, torch.ones((5, 3), dtype=torch.bool), torch.zeros((1, 2, 5, 8)))
    assert not attention.tree_kernel_serves(q, None, None)


# ----------------------------------------------------------------------------- (e)
def relabelled(labels: list[int], slots: list[int], length: int, kept_count: int) -> None:
    """The ring's labels after a commit, the plain way: every pending slot freed, then
    kept token i labelled with position length + i in slot (length + i) % ring."""
    for slot in slots:
        labels[slot] = EMPTY_SLOT
    for i in range(kept_count):
        labels[(length + i) % len(labels)] = length + i


@pytest.mark.parametrize("name", SLIDING_MODELS)
def test_ring_labels_after_every_kind_of_commit_match_the_plain_relabelling(name):
    """Commits that keep every token in place (AR's, a chain accepted whole) skip the
    relabelling, the others write all labels in one operation: the labels stay those of
    the plain relabelling, in one sequence and in each row of a batch, rings wrapping."""
    config = tiny_decoder(name).config
    generator = torch.Generator().manual_seed(5)
    single = KVCache(config, 400, max_forward_tokens=6)
    batch = BatchKVCache(config, 400, 3, max_forward_tokens=6)
    rows = [batch.acquire() for _ in range(3)]
    expected = [[EMPTY_SLOT] * single.ring_size for _ in range(4)]  # the single cache's, then each row's
    for step in range(150):
        T = 1 + step % 6
        trees = [Tree.from_parents(torch.zeros(T, dtype=torch.long), random_tree(T, generator)) for _ in range(4)]
        paths = [tree.path_to(int(torch.randint(0, T, (), generator=generator))) if step % 3 else
                 torch.arange(T if tree.is_chain() else 1) for tree in trees]  # every third commit in place
        single.begin_forward(single.length + trees[0].depths)
        view = batch.rows()
        view.begin_forward(view.lengths.unsqueeze(1) + torch.stack([tree.depths for tree in trees[1:]]))
        lengths = [single.length, *view.host_lengths.tolist()]
        for labels, tree, length in zip(expected, trees, lengths):
            slots = [(length + i) % len(labels) for i in range(T)]
            for slot, depth in zip(slots, tree.depths.tolist()):
                labels[slot] = length + depth  # what the forward writes
        single.commit(paths[0])
        view.commit(paths[1:])
        for labels, path, length in zip(expected, paths, lengths):
            relabelled(labels, [(length + i) % len(labels) for i in range(T)], length, path.numel())
        assert single.ring_positions.tolist() == expected[0], f"step {step}"
        assert batch.ring_positions[: len(rows)].tolist() == expected[1:], f"step {step}"



def test_a_large_host_cache_starts_as_zeros_and_takes_writes():
    """Past 16 MiB a host cache tensor comes from zero pages mapped on demand
    (`cache.zeroed`): it reads as torch.zeros does and holds what is written."""
    from longspec.runtime.cache import zeroed

    shape = (2, 3, 1, 4096, 1024)  # 48 MiB of float32
    big = zeroed(shape, torch.float32, torch.device("cpu"))
    assert big.shape == shape and big.dtype == torch.float32 and big.is_contiguous()
    assert not big.any()
    big[1, 2, 0, 4095] = 7.0
    assert float(big.sum()) == 7.0 * 1024
    small = zeroed((4, 4), torch.bfloat16, torch.device("cpu"))
    assert small.dtype == torch.bfloat16 and not small.any()
