"""Every method on every available device (the CPU always, a CUDA GPU when present).

On a machine without a GPU the device tests still prove what the CPU can: each run
happens under `stray_allocations_on_meta`, so a tensor that longspec creates without
naming its device fails the run instead of silently landing on the CPU (where, on a
GPU machine, it would be on the wrong device). `benchmarks/device/gpu_check.py` runs this
file on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from device_guard import stray_allocations_on_meta
from longspec.runtime.device import HOST, available_devices
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.adaptive import AdaptiveDrafter
from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.drafters.longspec import ChainStrategy, LongSpecDrafter, SampledChainStrategy
from longspec.speculation.drafters.mamba import MambaDrafter
from longspec.speculation.drafters.self_speculation import MagicDecDrafter, TriForceDrafter
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.tokenswift.medusa import MedusaDrafter
from longspec.speculation.drafters.tokenswift.one_pass import OnePassTokenSwiftDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from exactness import PROCESSORS, diverse_model, real_drafters
from oracles import random_draft, tiny_mamba
from tiny_models import random_ids

OPTIONS = EngineOptions(prefill_chunk=8, max_tree_nodes=24, progress=False)
DEVICES = available_devices()


def every_drafter(model) -> dict:
    drafters = dict(real_drafters(model))
    drafters["tokenswift-onepass"] = lambda: OnePassTokenSwiftDrafter(
        TokenSwiftHeads.for_target(model.config).randomize(torch.Generator().manual_seed(1)), k=3)
    drafters["longspec-sampled"] = lambda: LongSpecDrafter(random_draft(model), SampledChainStrategy(3))
    drafters["draft-model"] = lambda: DraftModelDrafter(model, length=3)
    drafters["mamba"] = lambda: MambaDrafter(tiny_mamba(vocab_size=model.config.vocab_size), widths=(2, 2, 1))
    drafters["auto"] = lambda: AdaptiveDrafter([("pld", PromptLookupDrafter(num_tokens=5)), ("ngram", NgramDrafter(k=3))],
                                               forward_cost=ForwardCost({}, (1, 8, 64), (0.01, 0.012, 0.03)))
    drafters["medusa"] = lambda: MedusaDrafter(
        TokenSwiftHeads.for_target(model.config, chained=False).randomize(torch.Generator().manual_seed(2)), k=2)
    drafters["magicdec"] = lambda: MagicDecDrafter(length=3, budget=16, sinks=2, forward_chunk=8)
    drafters["triforce"] = lambda: TriForceDrafter(length=3, budget=16, sinks=2, forward_chunk=8)
    drafters["ar"] = lambda: None
    return drafters


def generate(model, prompt, drafter, *, params=SamplingParams(), seed=None, max_new_tokens=40):
    generator = None if seed is None else torch.Generator(device=model.device).manual_seed(seed)
    rounds = SpeculativeEngine(model, OPTIONS).generate(prompt, params=params, max_new_tokens=max_new_tokens,
                                                        drafter=drafter, generator=generator)
    return torch.cat(list(rounds))


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(scope="module")
def placed(device):
    """A float64 Gemma 3-shaped target (sliding and full layers) on the device, and its
    greedy AR output computed on the CPU, outside the guard."""
    model, _ = diverse_model("gemma3")
    prompt = random_ids(30, seed=5)[0] % 32
    reference = generate(model, prompt, None)
    return model.place(device), prompt, reference


@pytest.mark.parametrize("name", sorted(every_drafter(diverse_model("gemma3")[0])))
def test_greedy_identity_on_device(placed, name):
    model, prompt, reference = placed
    drafter = every_drafter(model)[name]()  # modules are built on the host; begin() places them
    with stray_allocations_on_meta() as strays:
        tokens = generate(model, prompt, drafter)
    assert not strays, f"{name}: tensors created without a device at {sorted(strays)}"
    assert tokens.device == HOST
    assert torch.equal(tokens, reference), f"{name} on {model.device} differs from AR on the CPU"


@pytest.mark.parametrize("processor", ["temperature", "top_p", "penalty"])
def test_seeded_sampling_on_device_equals_seeded_ar(placed, processor):
    """One draw per emitted token from the device's own generator: a seeded run is the
    same for AR and deterministic-candidate drafters on that device."""
    model, prompt, _ = placed
    params = PROCESSORS[processor]
    with stray_allocations_on_meta() as strays:
        ar = generate(model, prompt, None, params=params, seed=7, max_new_tokens=60)
        for drafter in (PromptLookupDrafter(num_tokens=4), NgramDrafter(k=3)):
            assert torch.equal(generate(model, prompt, drafter, params=params, seed=7, max_new_tokens=60), ar)
    assert not strays, f"tensors created without a device at {sorted(strays)}"


def test_batch_rows_on_device_equal_single_runs(placed):
    model, _, _ = placed
    makers = [lambda: None, lambda: PromptLookupDrafter(num_tokens=4), lambda: NgramDrafter(k=3),
              lambda: LongSpecDrafter(random_draft(model), ChainStrategy(3))]
    prompts = [random_ids(5 + 7 * i, seed=30 + i)[0] % 32 for i in range(len(makers) + 1)]
    references = [generate(model, p, None, max_new_tokens=25) for p in prompts]
    drafters = [makers[i % len(makers)]() for i in range(len(prompts))]  # modules are built on the host
    with stray_allocations_on_meta() as strays:
        engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=3, row_capacity=96, prefill_tokens_per_step=8))
        handles = [engine.submit(p, max_new_tokens=25, drafter=d) for p, d in zip(prompts, drafters)]
        engine.run()
    assert not strays, f"tensors created without a device at {sorted(strays)}"
    for handle, reference in zip(handles, references):
        assert torch.equal(handle.tokens, reference)


def test_draft_training_on_device_equals_the_cpu_run(device, tmp_path):
    """A few steps of LongSpec training (features computed, cached and read back) on
    the device: the same weights as on the CPU, within float32 rounding."""
    from longspec.speculation.drafters.longspec import load_draft
    from longspec.training.longspec.trainer import LongSpecTrainer
    from training_setup import _options, _tokens, small_draft_config
    from tiny_models import tiny_decoder

    cpu_target = tiny_decoder("gemma3", dtype=torch.float32)
    config = small_draft_config(cpu_target)
    options = _options(steps=3, bf16_autocast=False)

    def train(target, out):
        trainer = LongSpecTrainer(target, _tokens(), out, options, draft_config=config, draft_vocab=60,
                                  feature_cache=out / "features", progress=False)
        trainer.train(stop_after=2)  # features computed and stored
        LongSpecTrainer(target, _tokens(), out, options, draft_config=config, draft_vocab=60,
                        feature_cache=out / "features", progress=False).train()  # resumed: one more step
        return load_draft(out / "draft.safetensors", target.config)

    expected = train(cpu_target, tmp_path / "cpu")
    target = tiny_decoder("gemma3", dtype=torch.float32).place(device)
    with stray_allocations_on_meta() as strays:
        trained = train(target, tmp_path / "device")
    assert not strays, f"tensors created without a device at {sorted(strays)}"
    for (name, x), (_, y) in zip(expected.state_dict().items(), trained.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5, msg=name)


def test_load_places_the_model_and_refuses_devices_it_cannot_use(tmp_path):
    import longspec
    from tiny_models import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "tiny")
    model = longspec.load(checkpoint, dtype="float32", device="cpu")
    assert model.device == HOST and model.generate("ab", max_new_tokens=3, method="pld").token_ids
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        longspec.load(checkpoint, device="gpu0")
    with pytest.raises(ValueError, match="not supported"):
        longspec.load(checkpoint, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use --device cpu"):
            longspec.load(checkpoint, device="cuda")
    else:
        with pytest.raises(ValueError, match="does not exist"):
            longspec.load(checkpoint, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("drafter", ["ar", "chain-q", "deterministic-tree"])
def test_sampled_sequences_on_device_follow_the_target_distribution(device, drafter):
    """The engine's chi-square test with the model, processors and random streams on
    the device (on the CPU this is tests/test_engine_sampling.py itself)."""
    if device.type == "cpu":
        pytest.skip("on the CPU, tests/test_engine_sampling.py runs these checks")
    from sampling_checks import (
        N, PROMPT, SAMPLING, K, CartesianDrafter, SampledChainDrafter, exact_distribution, goodness_of_fit,
    )
    from tiny_models import tiny_decoder

    model = tiny_decoder("qwen3", dtype=torch.float64, vocab_size=4, seed=7, initializer_range=0.5)
    exact = exact_distribution(model, SAMPLING)
    model.place(device)
    factory = {"ar": None, "chain-q": SampledChainDrafter, "deterministic-tree": CartesianDrafter}[drafter]
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=32, progress=False))
    generator = torch.Generator(device=device).manual_seed(0)
    draft_generator = torch.Generator().manual_seed(1)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N):
        rounds = engine.generate(PROMPT, params=SAMPLING, max_new_tokens=K, generator=generator,
                                 drafter=factory(draft_generator) if factory else None)
        key = tuple(torch.cat(list(rounds)).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert goodness_of_fit(exact, counts) > 1e-3


def test_tokenswift_heads_training_on_device_equals_the_cpu_run(device, tmp_path):
    """Float64: at lr 5e-2, Adam turns float32 rounding (a 1e-7 relative change of the
    target's weights on one machine) into weight changes of up to 3e-3, so float32 runs
    on two devices need not agree; float64 ones must."""
    from longspec.training.tokenswift.heads import HeadsTrainingConfig, train_heads
    from tiny_models import tiny_decoder

    data = torch.arange(7).repeat(60)[: 16 * 24].view(24, 16) * 3 % 128
    config = HeadsTrainingConfig(steps=3, batch_size=4, seq_len=16, rows_per_window=8, lr=5e-2, warmup_steps=1,
                                 heldout_windows=4, eval_every=3, save_every=3)
    expected = train_heads(tiny_decoder("qwen3", dtype=torch.float64), data, tmp_path / "cpu", config, log=lambda _: None)
    target = tiny_decoder("qwen3", dtype=torch.float64).place(device)
    with stray_allocations_on_meta() as strays:
        trained = train_heads(target, data, tmp_path / "device", config, log=lambda _: None)
    assert not strays, f"tensors created without a device at {sorted(strays)}"
    for (name, x), (_, y) in zip(expected.state_dict().items(), trained.state_dict().items()):
        torch.testing.assert_close(y.cpu(), x, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_attention_leaves_out_cudnn_whose_plans_are_per_shape(monkeypatch):
    import longspec.runtime.attention as attention

    seen = []
    real = attention.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    q = torch.randn(1, 4, 1, 16, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 9, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attention.sdpa_attention(q, k, v, None, None, None, None, 0.25)
    assert seen == [False]


def test_bf16_autocast_for_training_follows_what_this_machine_computes_fast(monkeypatch):
    from longspec.runtime.device import bf16_matmuls_are_fast

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not bf16_matmuls_are_fast(torch.device("cpu"))  # AVX2 alone: float32 is faster
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert bf16_matmuls_are_fast(torch.device("cpu"))
