"""Weights copied onto transparent huge pages keep their values and stay usable; where
the machine offers none, nothing changes."""

from __future__ import annotations

import torch

from longspec.runtime import huge_pages
from longspec.runtime import model as decoder_module
from longspec.runtime.huge_pages import HUGE_PAGE_BYTES, move_to_huge_pages
from tiny_models import random_ids, tiny_decoder


def weights(count: int = 3) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(700, 1500, generator=generator).to(torch.bfloat16), requires_grad=False)
            for _ in range(count)]


def test_moved_weights_keep_their_values_on_aligned_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_page_policy", lambda: "madvise")
    params = weights()
    before = [p.detach().clone() for p in params]
    assert move_to_huge_pages(params)
    for p, old in zip(params, before):
        assert torch.equal(p, old) and p.data_ptr() % HUGE_PAGE_BYTES == 0
    params[0].data.mul_(2)  # a writable mapping: loading new weights into it works
    assert torch.equal(params[0], before[0] * 2)


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_page_policy", lambda: "never")
    params = weights(1)
    address = params[0].data_ptr()
    assert not move_to_huge_pages(params)
    assert params[0].data_ptr() == address


def test_a_bf16_decoder_on_huge_pages_gives_the_same_logits(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_page_policy", lambda: "madvise")
    monkeypatch.setattr(decoder_module, "HUGE_PAGE_BYTES", 4096)  # tiny weights count as large here
    model = tiny_decoder("gemma3", dtype=torch.bfloat16)
    ids = random_ids(9, seed=2)
    expected = model(ids, model.new_cache(16)).logits
    address = model.embed_weight.data_ptr()
    model.on_huge_pages = False
    model.prepare()
    # The large packed copies the products stream go onto huge pages; the plain weights (read a row at a
    # time, if at all) stay where they are, which saves copying them at every load.
    assert model.on_huge_pages and model.embed_weight.data_ptr() == address
    tiles = [p.tiles for p in model._packed_weights() if p.tiles is not None]
    assert all(t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 for t in tiles if t.numel() * t.element_size() >= 4096)
    torch.testing.assert_close(model(ids, model.new_cache(16)).logits, expected, rtol=0, atol=0)
