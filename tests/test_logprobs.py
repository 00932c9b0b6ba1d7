"""Log-probabilities of generated tokens: every method reports the numbers plain
decoding's own forward gives (float64), one per token, through stop strings,
streams and batches; bad `logprobs` values are refused before work."""

from __future__ import annotations

import pytest
import torch

from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.logprobs import LogprobRecorder
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import NodeHistories, SamplingParams, processed_logits
from tiny_models import random_ids, tiny_decoder, tiny_hf_model

TOP = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-logprobs")
    tiny_hf_model("llama", dtype=torch.float32).save_pretrained(directory, safe_serialization=True)
    return LongSpecModel(load_target(directory, dtype=torch.float64))


def reference_logits(model: LongSpecModel, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """One plain forward over prompt + tokens: the logits of the rows that predicted each token."""
    ids = torch.cat([prompt.view(-1), torch.tensor(tokens)]).view(1, -1)
    cache = model.model.new_cache(ids.shape[1] + 1)
    return model.model(ids, cache).logits[0, prompt.numel() - 1 : -1]


def reference_logprobs(model: LongSpecModel, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(reference_logits(model, prompt, tokens).double(), dim=-1)


@pytest.mark.parametrize("method", ["ar", "pld", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_plain_decodings_own(model, method, temperature):
    prompt = random_ids(10, seed=4)[0].repeat(3)  # repeats, so prompt lookup drafts and accepts
    result = model.generate(prompt, max_new_tokens=24, method=method, temperature=temperature, seed=7, logprobs=TOP)
    assert len(result.logprobs) == len(result.token_ids) == 24
    expected = reference_logprobs(model, prompt, result.token_ids)
    for position, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(expected[position, token].item(), abs=1e-9)
        values, indices = torch.topk(expected[position], TOP)
        assert [t for t, _ in entry.top] == indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-9)


def test_logprobs_follow_the_stream_and_stop_at_eos(model):
    prompt = random_ids(12, seed=9)[0].repeat(2)
    stream = model.stream(prompt, max_new_tokens=16, method="pld", logprobs=0)
    chunks = list(stream)
    assert sum(len(c.token_ids) for c in chunks) == len(stream.token_ids) == len(stream.logprobs) == 16
    for chunk in chunks:
        assert [e.token for e in chunk.logprobs] == chunk.token_ids
    assert all(e.top == () for e in stream.logprobs)
    assert model.generate(prompt, max_new_tokens=4).logprobs is None  # not asked, not computed

    eos = stream.token_ids[5]  # a round that reaches EOS keeps its tokens up to it, and their logprobs alone
    recorder = LogprobRecorder(top=0)
    rounds = model.engine.generate(prompt, max_new_tokens=16, drafter=make_drafter("pld"), eos_token_ids=(eos,),
                                   logprobs=recorder)
    tokens = torch.cat(list(rounds)).tolist()
    assert tokens[-1] == eos and [e.token for e in recorder.entries] == tokens


def test_batched_rows_report_their_own_logprobs(model):
    prompts = [random_ids(8 + i, seed=20 + i)[0].repeat(2) for i in range(3)]
    batched = model.generate_batch(prompts, max_new_tokens=12, method="pld", logprobs=2, seed=3, temperature=1.0)
    for prompt, result, i in zip(prompts, batched, range(3)):
        alone = model.generate(prompt, max_new_tokens=12, method="pld", logprobs=2, seed=3 + i, temperature=1.0)
        assert result.token_ids == alone.token_ids
        assert [e.logprob for e in result.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-9)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_bad_logprobs_are_refused(model, bad):
    with pytest.raises(ValueError, match="top logprobs"):
        model.generate(random_ids(6, seed=1)[0], max_new_tokens=2, logprobs=bad)
    with pytest.raises(ValueError, match="top logprobs"):
        LogprobRecorder(top=bad)


def test_certified_head_rounds_report_the_full_heads_logprobs():
    """The certified head decides without the full head; logprobs then compute it for
    the committed tokens' rows alone, and give what a model without one gives."""
    prompt = random_ids(8, seed=2)[0].repeat(3)
    runs = []
    for certified in (True, False):
        decoder = tiny_decoder("llama", dtype=torch.bfloat16, head_dim=32)
        assert decoder.certified_head is not None
        if not certified:
            decoder._certified_head = None
        engine = SpeculativeEngine(decoder, EngineOptions(progress=False, max_tree_nodes=12, prefill_chunk=16))
        recorder = LogprobRecorder(top=2)
        tokens = torch.cat(list(engine.generate(prompt, max_new_tokens=30, drafter=make_drafter("pld"),
                                                logprobs=recorder)))
        runs.append((tokens.tolist(), recorder.entries))
    assert runs[0][0] == runs[1][0]
    assert [e.token for e in runs[0][1]] == runs[0][0]
    assert [e.logprob for e in runs[0][1]] == pytest.approx([e.logprob for e in runs[1][1]], abs=1e-6)
    assert [[t for t, _ in e.top] for e in runs[0][1]] == [[t for t, _ in e.top] for e in runs[1][1]]


PROCESSING = dict(temperature=0.7, top_k=20, presence_penalty=0.5, frequency_penalty=0.3, penalty=1.2,
                  penalty_window=16, logit_bias={5: 2.0, 7: -3.0})


def padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([[-1] * (width - len(r)) + r[-width:] if r else [-1] * width for r in rows])


@pytest.mark.parametrize("method", ["ar", "pld", "auto"])
def test_processed_logprobs_are_of_the_distribution_tokens_are_drawn_from(model, method):
    prompt = random_ids(10, seed=4)[0].repeat(3)
    result = model.generate(prompt, max_new_tokens=20, method=method, seed=5, logprobs=2, logprobs_mode="processed",
                            **PROCESSING)
    tokens = result.token_ids
    everything = prompt.tolist() + tokens
    histories = NodeHistories(
        padded([everything[: prompt.numel() + i] for i in range(len(tokens))], PROCESSING["penalty_window"]),
        padded([tokens[:i] for i in range(len(tokens))], len(tokens)),
    )
    params = SamplingParams(**{**PROCESSING, "logit_bias": tuple(PROCESSING["logit_bias"].items())})
    expected = torch.log_softmax(processed_logits(reference_logits(model, prompt, tokens), histories, params), dim=-1)
    for position, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(expected[position, tokens[position]].item(), abs=1e-9)
        assert entry.logprob > float("-inf")  # a drawn token survives truncation
        assert [v for _, v in entry.top] == pytest.approx(torch.topk(expected[position], 2).values.tolist(), abs=1e-9)
    with pytest.raises(ValueError, match="logprobs_mode"):
        model.generate(prompt, max_new_tokens=2, logprobs=1, logprobs_mode="logits")
