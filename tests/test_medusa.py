"""Medusa-style independent heads (TokenSwift's "Medusa*" ablation): the head
arithmetic, files and training that keep the flag, lossless drafting through the
engine, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.tokenswift.medusa import MedusaDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import SamplingParams
from exactness import PROCESSORS, diverse_model
from tiny_models import random_ids, tiny_decoder

OPTIONS = EngineOptions(prefill_chunk=8, max_tree_nodes=16, progress=False)


def independent_heads(config, seed=1):
    return TokenSwiftHeads.for_target(config, chained=False).randomize(torch.Generator().manual_seed(seed))


def test_independent_heads_each_read_the_target_state_alone():
    heads = independent_heads(tiny_decoder("llama").config).double()
    h0 = torch.randn(2, heads.config.hidden_size, dtype=torch.float64)
    out = heads(h0)
    for i, layer in enumerate(heads.layers):
        torch.testing.assert_close(out[:, i], h0 + layer(h0))
    chained = TokenSwiftHeads.for_target(tiny_decoder("llama").config).double()
    chained.load_state_dict(heads.state_dict())
    assert not torch.allclose(chained(h0)[:, 1], out[:, 1])  # the chain feeds head 2 with head 1's state


def test_the_flag_survives_files_and_older_files_read_as_chained(tmp_path):
    config = tiny_decoder("llama").config
    independent_heads(config).save(tmp_path / "medusa.safetensors")
    assert TokenSwiftHeads.load(tmp_path / "medusa.safetensors", config).config.chained is False
    old = TokenSwiftHeads.for_target(config)
    meta = {"format": "longspec-tokenswift-heads/1",
            "config": json.dumps({"hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "num_heads": 3})}
    save_file({k: v.contiguous() for k, v in old.state_dict().items()}, str(tmp_path / "old.safetensors"), metadata=meta)
    assert TokenSwiftHeads.load(tmp_path / "old.safetensors", config).config.chained is True


def test_training_independent_heads(tmp_path):
    from longspec.training.tokenswift.heads import HeadsTrainingConfig, train_heads

    model = tiny_decoder("qwen3", dtype=torch.float32)
    data = torch.arange(7).repeat(60)[: 16 * 24].view(24, 16) * 3 % 128
    config = HeadsTrainingConfig(steps=2, batch_size=4, seq_len=16, rows_per_window=8, warmup_steps=1,
                                 heldout_windows=4, eval_every=2, save_every=2, chained=False)
    heads = train_heads(model, data, tmp_path, config, log=lambda _: None)
    assert heads.config.chained is False
    assert TokenSwiftHeads.load(tmp_path / "heads.safetensors", model.config).config.chained is False


@pytest.mark.parametrize("processor", [None, "temperature", "penalty"])
def test_medusa_is_lossless(processor):
    model, _ = diverse_model("gemma3")
    prompt = random_ids(40, seed=2)[0] % 40
    params = PROCESSORS[processor] if processor else SamplingParams()
    engine = SpeculativeEngine(model, OPTIONS)

    def run(drafter):
        generator = torch.Generator().manual_seed(5)
        return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=60, drafter=drafter,
                                              generator=generator)))

    assert torch.equal(run(MedusaDrafter(independent_heads(model.config), widths=(3, 2, 1), k=2)), run(None))


def test_medusa_refuses_missing_or_chained_heads():
    with pytest.raises(ValueError, match="independent-heads"):
        make_drafter("medusa")
    model = tiny_decoder("llama")
    chained = TokenSwiftHeads.for_target(model.config)
    with pytest.raises(ValueError, match="chained heads"):
        MedusaDrafter(chained).check_target(model.config)
