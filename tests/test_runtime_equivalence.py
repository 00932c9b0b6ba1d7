"""Our decoder reproduces `transformers` logits and greedy generations for every
supported family, however the sequence is split into forwards."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.attention import fused_attention, reference_attention, sdpa_attention
from tiny_models import FAMILIES, SLIDING_WINDOW, random_ids, tiny_decoder, tiny_pair

TOLERANCE = 1e-4
SEQ_LEN = 40  # five times the sliding window
# sdpa: what a GPU runs where the Triton tree kernel does not (device-generic, checked here on the CPU)
BACKENDS = {"fused": fused_attention, "sdpa": sdpa_attention, "reference": reference_attention}

assert SEQ_LEN > 2 * SLIDING_WINDOW


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=list(BACKENDS))
def pair(request, family):
    hf_model, decoder = tiny_pair(family, dtype=torch.float32, seed=FAMILIES.index(family))
    decoder.attention = BACKENDS[request.param]
    return hf_model, decoder


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits


def run_chunks(decoder, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Feed ids in forwards of the given sizes, committing after each; all logits."""
    assert sum(sizes) == ids.shape[1]
    cache = decoder.new_cache(ids.shape[1] + 8, max_forward_tokens=max(sizes))
    outputs, start = [], 0
    for size in sizes:
        outputs.append(decoder(ids[:, start : start + size], cache).logits)
        cache.commit()
        start += size
    assert cache.length == ids.shape[1]
    return torch.cat(outputs, dim=1)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff <= TOLERANCE, f"max abs logit difference {diff:.3g} > {TOLERANCE}"


def test_prefill_in_one_forward(pair):
    hf_model, decoder = pair
    ids = random_ids(SEQ_LEN, seed=1)
    assert_close(run_chunks(decoder, ids, [SEQ_LEN]), hf_logits(hf_model, ids))


@pytest.mark.parametrize("sizes", [[5, 1, 11, 3, 13, 7], [9, 9, 9, 13], [1, 2, 17, 20]])
def test_prefill_in_uneven_chunks(pair, sizes):
    hf_model, decoder = pair
    ids = random_ids(SEQ_LEN, seed=2)
    assert_close(run_chunks(decoder, ids, sizes), hf_logits(hf_model, ids))


def test_token_by_token(pair):
    hf_model, decoder = pair
    ids = random_ids(SEQ_LEN, seed=3)
    assert_close(run_chunks(decoder, ids, [1] * SEQ_LEN), hf_logits(hf_model, ids))


def test_logits_rows_selects_rows(pair):
    hf_model, decoder = pair
    ids = random_ids(SEQ_LEN, seed=4)
    cache = decoder.new_cache(SEQ_LEN)
    out = decoder(ids, cache, logits_rows=torch.tensor([0, 17, SEQ_LEN - 1]))
    assert_close(out.logits, hf_logits(hf_model, ids)[:, [0, 17, SEQ_LEN - 1]])
    assert out.hidden.shape == (1, 3, decoder.config.hidden_size)


def test_greedy_tokens_without_logits_equal_argmax_of_logits(pair):
    _, decoder = pair
    ids = random_ids(SEQ_LEN, seed=5)
    full = decoder(ids, decoder.new_cache(SEQ_LEN))
    hidden_only = decoder(ids, decoder.new_cache(SEQ_LEN), with_logits=False)
    assert hidden_only.logits is None and torch.equal(hidden_only.hidden, full.hidden)
    assert torch.equal(decoder.greedy_tokens(full.hidden), full.logits.argmax(dim=-1))


def test_greedy_tokens_in_vocabulary_slices_equal_argmax_of_logits(pair, monkeypatch):
    _, decoder = pair
    monkeypatch.setattr(decoder, "_packed_head", None)  # the slices a GPU scores
    ids = random_ids(SEQ_LEN, seed=5)
    full = decoder(ids, decoder.new_cache(SEQ_LEN))
    expected = full.logits.argmax(dim=-1)
    vocab = decoder.config.vocab_size
    for chunk in (vocab, 7, 1):  # one slice, uneven slices, one token at a time
        assert torch.equal(decoder.greedy_tokens(full.hidden, vocab_chunk=chunk), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_through_the_packed_head_equal_argmax_of_logits(family, dtype, monkeypatch):
    from longspec.runtime import model

    decoder = tiny_decoder(family, dtype=dtype, seed=3)
    ids = random_ids(SEQ_LEN, seed=6)
    full = decoder(ids, decoder.new_cache(SEQ_LEN))
    expected = full.logits.float().argmax(dim=-1)
    vocab = decoder.config.vocab_size
    for rows in (SEQ_LEN, 5, 1):  # all rows at once, uneven row chunks, one row at a time
        monkeypatch.setattr(model, "GREEDY_LOGITS_ELEMENTS", rows * vocab)
        assert torch.equal(decoder.greedy_tokens(full.hidden), expected)


def greedy(decoder, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = decoder.new_cache(prompt.shape[1] + new_tokens)
    logits = decoder(prompt, cache, logits_rows=slice(-1, None)).logits
    cache.commit()
    generated = []
    for _ in range(new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        generated.append(token)
        if len(generated) == new_tokens:
            break
        logits = decoder(token, cache).logits
        cache.commit()
    return torch.cat([prompt, *generated], dim=1)


@pytest.mark.parametrize("prompt_len", [3, 12])
def test_greedy_generation_matches_hf(pair, prompt_len):
    hf_model, decoder = pair
    assert hf_model.generation_config.eos_token_id is None  # never stops early
    prompt = random_ids(prompt_len, seed=5 + prompt_len)
    with torch.no_grad():
        expected = hf_model.generate(prompt, do_sample=False, max_new_tokens=30)
    assert expected.shape[1] == prompt_len + 30
    ours = greedy(decoder, prompt, 30)
    assert ours.tolist() == expected.tolist()
