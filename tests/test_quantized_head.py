"""The quantized target read from a GGUF file directly (`runtime.gguf_reading`): every
float tensor has the bits `transformers`' dequantizing converter gives it, the embedding
looks up the file's rows exactly, the output layer is the `gguf_linear` product of the
file's rows (any subset of rows gives the full product's bits), bad files are refused
before any work naming the tensor, and every method returns plain decoding's tokens of
this target, in one sequence and in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import F32, read_model, write_model
from quantized_blocks import Q4_K, Q6_K, Q8_0

from longspec.runtime.native import attention_ops, native_ops

pytestmark = pytest.mark.skipif(native_ops() is None or attention_ops() is None,
                                reason="native kernels unavailable here (reason logged)")


def dequantized_reference(path, config, layers):
    """The model `transformers`' converter gives (every tensor dequantized to float32, then
    bf16), with the same quantized layer products."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from longspec.runtime.loading import decoder_from_state_dict

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    return decoder_from_state_dict(config, tensors, torch.bfloat16, layers)


@pytest.mark.parametrize("family", ("llama", "gemma3"))
def test_float_tensors_and_embedding_rows_are_the_dequantized_loads_bits(tmp_path, family):
    path = tmp_path / "m.gguf"
    # A float q weight: Llama's rows must be reordered as transformers reorders them.
    rng = np.random.default_rng(1)
    change = {"blk.1.attn_q.weight": (F32, (rng.standard_normal((256, 256)) * 0.05).astype(np.float32))}
    config = write_model(path, family, change=change)
    ours = read_model(path, family, config)
    reference = dequantized_reference(path, config, [dict(layer.quantized) for layer in ours.layers])
    dense = {name: p for name, p in reference.named_parameters()}
    for name, p in ours.named_parameters():
        if p.stride() and 0 not in p.stride():  # a real tensor, not a stand-in for the file's blocks
            assert torch.equal(p, dense[name]), name
    assert "qkv_weight" not in ours.layers[1].quantized and "qkv_weight" in ours.layers[0].quantized
    ids = torch.tensor([[0, 5, 299, 5, 17]])
    assert torch.equal(ours.embed(ids), reference.embed(ids))
    assert torch.equal(ours.head_weight, reference.head_weight)  # the copy a drafter may ask for


@pytest.mark.parametrize("kind", (Q8_0, Q6_K, Q4_K))
def test_the_head_is_the_kernels_product_of_the_files_rows_and_any_rows_give_its_bits(tmp_path, kind, monkeypatch):
    from longspec.runtime.quantized import QuantizedWeight, segment

    monkeypatch.delenv("LONGSPEC_FILE_SCREEN", raising=False)
    path = tmp_path / "m.gguf"
    config = write_model(path, "llama", head_kind=kind, vocab=333)
    model = read_model(path, "llama", config)
    head = model.file_head
    assert head.kind == kind and model.embed_weight.stride() == (0, 0)  # no dense embedding resident
    assert model.certified_head is None  # by default the full file head decides (the screen is opt-in)
    from longspec.speculation.cost_defaults import decode_bytes

    layers = sum(w.nbytes for layer in model.layers for w in layer.quantized.values())
    norms = sum(p.numel() * 2 for layer in model.layers for p in layer.parameters() if 0 not in p.stride())
    assert decode_bytes(model) == layers + norms + model.packed_head.quantized.nbytes  # the bytes a step reads
    assert head._dense is None  # no dense copy was made to count them
    hidden = (torch.randn(7, 256) * 3).to(torch.bfloat16)
    full = model.logits(hidden)
    expected = QuantizedWeight((segment("h", kind, head.raw, 333, 256),), 256).linear(hidden)
    assert torch.equal(full, expected)
    for rows in (torch.tensor([0]), torch.tensor([3, 17, 18, 200, 332]), torch.arange(5, 333, 3)):
        assert torch.equal(head.select(rows).linear(hidden), full[:, rows])
        for r in range(hidden.shape[0]):  # a row alone: the same bits as among the others
            assert torch.equal(head.select(rows).linear(hidden[r : r + 1])[0], full[r, rows])


@pytest.mark.parametrize("change,message", [
    ({"token_embd.weight": (Q8_0, np.zeros((300, 224), np.float32))}, "'token_embd.weight' has shape"),
    ({"output.weight": (Q6_K, np.zeros((256, 256), np.float32))}, "'output.weight' has shape"),
    ({"blk.0.ffn_norm.weight": (F32, np.zeros(128, np.float32))}, "'blk.0.ffn_norm.weight' has shape"),
    ({"blk.1.attn_k.weight": (2, np.zeros((64, 256), np.float32))}, "'blk.1.attn_k.weight' is Q4_0.*dtype='bfloat16'"),
    ({"blk.1.ffn_down.weight": (Q8_0, np.zeros((200, 512), np.float32))}, "'blk.1.ffn_down.weight' has shape"),
])
def test_a_file_that_disagrees_with_its_metadata_is_refused_naming_the_tensor(tmp_path, change, message):
    path = tmp_path / "m.gguf"
    config = write_model(path, "llama", change=change)
    with pytest.raises(ValueError, match=message):
        read_model(path, "llama", config)


def test_a_missing_tensor_is_named(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    config = write_model(path, "llama")
    config.num_hidden_layers = 3
    from longspec.runtime.gguf_reading import quantized_decoder

    with pytest.raises(ValueError, match="lacks tensor 'blk.2.attn_norm.weight'"):
        quantized_decoder(gguf.GGUFReader(str(path)), config, "llama")


def test_a_truncated_file_is_refused(tmp_path):
    from longspec.runtime.loading import _quantized_from_gguf

    path = tmp_path / "m.gguf"
    config = write_model(path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match="truncated"):
        _quantized_from_gguf(path, config)


SETTINGS = {"greedy": {}, "seeded": {"temperature": 1.0, "top_p": 0.9}}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("family", ("gemma3", "llama"))
def test_every_method_returns_plain_decodings_tokens_of_the_file_target(tmp_path, family, setting):
    from exactness import DIVERSE, Run, assert_same_caches
    from oracles import OracleGarbageDrafter
    from tiny_models import random_ids

    from longspec.speculation.drafters import PromptLookupDrafter
    from longspec.speculation.engine import EngineOptions, SpeculativeEngine
    from longspec.speculation.methods import make_drafter
    from longspec.speculation.processors import SamplingParams

    path = tmp_path / "m.gguf"
    model = read_model(path, family, write_model(path, family, vocab=300))
    params = SamplingParams(**DIVERSE[family][1], **SETTINGS[setting])
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False))
    prompt = random_ids(30, seed=len(family))[0] % 40
    reference = Run(engine, prompt, params=params, max_new_tokens=200, seed=3)
    assert len(set(reference.tokens.tolist())) > 10  # not a short loop
    drafters = {"oracle": OracleGarbageDrafter(reference.tokens, prompt.numel(), seed=5),
                "pld": PromptLookupDrafter(num_tokens=6), "auto": make_drafter("auto")}
    for name, drafter in drafters.items():
        run = Run(engine, prompt, params=params, max_new_tokens=200, seed=3, drafter=drafter)
        assert torch.equal(run.tokens, reference.tokens), name
        assert_same_caches(reference.cache, run.cache)
        assert run.stats.tau > 1.2 or name != "oracle"


@pytest.mark.parametrize("screen", ("0", "1"))
def test_batch_rows_of_the_file_target_equal_their_single_runs(tmp_path, screen, monkeypatch):
    from exactness import DIVERSE, single_run
    from tiny_models import random_ids

    from longspec.speculation.batch_engine import BatchEngine, BatchOptions
    from longspec.speculation.drafters import PromptLookupDrafter
    from longspec.speculation.engine import EngineOptions
    from longspec.speculation.methods import make_drafter
    from longspec.speculation.processors import SamplingParams

    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LONGSPEC_FILE_SCREEN", screen)  # with the screen, greedy rows decide through it
    path = tmp_path / "m.gguf"
    model = read_model(path, "gemma3", write_model(path, "gemma3", vocab=300))
    assert (model.certified_head is not None) == (screen == "1")
    extra = {} if screen == "1" else DIVERSE["gemma3"][1]  # a penalty would keep every row off the screen
    for setting in SETTINGS.values():
        params = SamplingParams(**extra, **setting)
        drafters = [lambda: None, lambda: PromptLookupDrafter(num_tokens=5), lambda: make_drafter("auto")]
        prompts = [random_ids(5 + 9 * i, seed=i)[0] % 24 for i in range(4)]
        max_new = [50 + 23 * i for i in range(len(prompts))]
        engine = BatchEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False),
                             BatchOptions(max_rows=3, row_capacity=320, prefill_tokens_per_step=16))
        handles = [engine.submit(p, params=params, max_new_tokens=n, generator=torch.Generator().manual_seed(7),
                                 drafter=drafters[i % len(drafters)]()) for i, (p, n) in enumerate(zip(prompts, max_new))]
        engine.run()
        for prompt, n, handle in zip(prompts, max_new, handles):
            assert torch.equal(handle.tokens, single_run(model, prompt, params=params, max_new_tokens=n, seed=7))
    assert screen == "0" or model.certified_head.stats.rows > 0


def adversarial_head(kind: int, vocab: int = 400, cols: int = 256, seed: int = 0):
    """File rows built to sit at the screen's bound: near-copies of one top row (one code
    apart), exact duplicates (ties, the later index must lose), and rows far below."""
    from quantized_blocks import quantize

    from longspec.runtime.file_rows import FileRows

    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((vocab, cols)) * 0.02).astype(np.float32)
    top = weights[7].copy()
    for i in range(20, 120):  # near copies: the top row plus a perturbation a code's size or less
        weights[i] = top + (rng.standard_normal(cols) * 0.0005 * (i % 5)).astype(np.float32)
    raw = quantize(kind, weights)
    raw[300] = raw[7]  # an exact duplicate of the top row
    raw[301] = raw[45]
    return FileRows("output.weight", kind, raw, cols), weights


def adversarial_activations(rows, weights, count: int = 24, seed: int = 1) -> torch.Tensor:
    """Rows aligned with the top row, with the screen's residual direction (Cauchy-Schwarz
    tight), large and tiny scales, and a few random rows."""
    import gguf

    rng = np.random.default_rng(seed)
    exact = np.asarray(gguf.quants.dequantize(rows.raw, gguf.GGMLQuantizationType(rows.kind)),
                       dtype=np.float64).reshape(rows.rows, rows.cols)
    screen = gguf.quants.quantize(exact.astype(np.float32), gguf.GGMLQuantizationType.Q5_0)
    v = np.asarray(gguf.quants.dequantize(screen, gguf.GGMLQuantizationType.Q5_0), dtype=np.float64)
    v = v.reshape(rows.rows, rows.cols)
    out = []
    for n in range(count):
        i = [7, 45, 300, 21, 22][n % 5]
        direction = exact[i] if n % 3 == 0 else (exact[i] - v[i]) if n % 3 == 1 else rng.standard_normal(rows.cols)
        scale = [1.0, 300.0, 1e-3, 40.0][n % 4] / (np.abs(direction).max() + 1e-30)
        out.append(direction * scale)
    return torch.tensor(np.array(out), dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("kind", (Q8_0, Q6_K, Q4_K))
def test_the_screens_bound_holds_on_adversarial_rows_and_is_not_vacuous(kind):
    from longspec.runtime.file_screen import FileCertifiedHead, derive_screen

    rows, weights = adversarial_head(kind)
    head = FileCertifiedHead(rows, derive_screen(rows))
    hidden = adversarial_activations(rows, weights)
    exact = rows.quantized().linear(hidden).double()
    scores, bounds = head.bounds(hidden)
    error = (exact - scores.double()).abs()
    assert bool((error <= bounds).all())
    assert float((error / bounds).max()) > 0.5  # the adversarial rows come near the bound: it is not vacuous


@pytest.mark.parametrize("kind", (Q8_0, Q6_K, Q4_K))
def test_the_certified_argmax_is_the_full_heads_ties_included(kind):
    from longspec.runtime.argmax import row_argmax
    from longspec.runtime.file_screen import FileCertifiedHead, derive_screen

    rows, weights = adversarial_head(kind)
    head = FileCertifiedHead(rows, derive_screen(rows))
    hidden = adversarial_activations(rows, weights, count=40)
    full = lambda h: rows.quantized().linear(h)
    logits = full(hidden)
    expected = row_argmax(logits)
    assert torch.equal(head.argmax(hidden, full), expected)
    assert head.stats.fallbacks == 0 and max(head.stats.candidates) > 1  # certified, with real contests
    tied = [r for r in range(40) if int((logits[r] == logits[r].max()).sum()) > 1]
    assert tied and all(int(expected[r]) == int(torch.nonzero(logits[r] == logits[r].max())[0]) for r in tied)
    allowed = torch.rand(40, rows.rows, generator=torch.Generator().manual_seed(0)) < 0.5
    allowed[:, 0] = True
    masked = row_argmax(logits.masked_fill(~allowed, float("-inf")))
    assert torch.equal(head.argmax(hidden, full, allowed=allowed), masked)


def test_the_screen_reads_the_codes_the_product_quantizes_from_bf16():
    from longspec.runtime.native import native_ops

    hidden = (torch.randn(9, 256) * 7).to(torch.bfloat16)
    ours, theirs = native_ops().gguf_quantize_rows(hidden), native_ops().gguf_quantize_rows(hidden.float())
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("family", ("gemma3", "llama"))
def test_the_file_targets_certified_head_serves_greedy_and_sampled_decoding_exactly(tmp_path, family, monkeypatch):
    from exactness import single_run
    from tiny_models import random_ids

    from longspec.runtime.certified_head import DISABLE_VARIABLE
    from longspec.runtime.file_screen import FileCertifiedHead
    from longspec.speculation.drafters import PromptLookupDrafter
    from longspec.speculation.methods import make_drafter
    from longspec.speculation.processors import SamplingParams

    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LONGSPEC_FILE_SCREEN", "1")  # opt-in: the default reads the full file head
    path = tmp_path / "m.gguf"
    config = write_model(path, family, vocab=300)
    certified, full = read_model(path, family, config), read_model(path, family, config)
    assert isinstance(certified.certified_head, FileCertifiedHead)
    monkeypatch.setenv(DISABLE_VARIABLE, "0")
    assert full.certified_head is None  # plain decoding over the full quantized head
    monkeypatch.delenv(DISABLE_VARIABLE)
    prompt = random_ids(30, seed=2)[0] % 40
    for setting in SETTINGS.values():
        params = SamplingParams(**setting)  # no history-dependent processor: greedy decisions go through the head
        reference = single_run(full, prompt, params=params, max_new_tokens=120, seed=4)
        for drafter in (None, PromptLookupDrafter(num_tokens=6), make_drafter("auto")):
            assert torch.equal(single_run(certified, prompt, params=params, max_new_tokens=120, seed=4,
                                          drafter=drafter), reference)
    assert certified.certified_head.stats.rows > 0


def test_static_steps_of_the_file_target_compute_its_logits(tmp_path):
    """Static steps serve a quantized target eagerly or through its file head, never a dense copy."""
    from tiny_models import random_ids

    from longspec.runtime.static_step import CompileOptions

    path = tmp_path / "m.gguf"
    model = read_model(path, "llama", write_model(path, "llama", vocab=300))
    ids = random_ids(9, seed=3)
    eager = model(ids, model.new_cache(64)).logits
    model.compile_steps(CompileOptions(backend=None, buckets=(1, 4, 16)))
    cache = model.new_cache(64)
    static = model(ids, cache).logits
    assert torch.equal(static, eager)  # a static step (where one serves) computes the file head's logits
    assert model.file_head._dense is None


def test_doctor_names_what_the_file_targets_decisions_read(tmp_path, monkeypatch):
    from longspec.cli.doctor import _head_line

    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    config = write_model(path, "llama", vocab=300)
    monkeypatch.delenv("LONGSPEC_FILE_SCREEN", raising=False)
    assert "the file's own rows, read in full" in _head_line(read_model(path, "llama", config))
    monkeypatch.setenv("LONGSPEC_FILE_SCREEN", "1")
    assert _head_line(read_model(path, "llama", config)).startswith("on: decisions read a Q5_0 screen of the file's")
