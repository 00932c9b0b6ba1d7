"""The ecosystem's clients end to end against a live `longspec serve` (issue 64):
langchain's `OpenAI` LLM (invoke, batch in sub-batches, stream) and lm-eval's
`local-completions` model (multiple-choice log-likelihoods and rolling perplexity from
local JSONL tasks, offline). A tiny float32 checkpoint keeps it to seconds; each test
skips when its client is not installed."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions
from longspec.speculation.engine import EngineOptions
from live_server import DEADLINE_S, Server
from test_serve_clients import plain_forward_logprobs
from tiny_models import save_checkpoint

NAME = "tiny"
PROMPTS = ["the cat sat on the mat. the cat", "a b c a b c a b", "hello hello hello"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ecosystem-model"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def model(checkpoint) -> LongSpecModel:
    return LongSpecModel(load_target(checkpoint, dtype=torch.float32), EngineOptions(progress=False))


@pytest.fixture(scope="module")
def server(model):
    running = Server(model, ServeOptions(model_name=NAME, method="pld", max_new_tokens=64, max_prompt_tokens=1000))
    yield running
    running.stop()


def served_alone(server, prompt: str) -> str:
    """The server's answer to the prompt sent alone, greedy, as a plain request."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=DEADLINE_S).json()["choices"][0]["text"]


# ------------------------------------------------------------------ langchain
def test_langchain_invoke_batch_and_stream_equal_single_requests_and_offline(server, model):
    pytest.importorskip("langchain_openai")
    from langchain_openai import OpenAI

    sent: list[dict] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http_client = httpx.Client(event_hooks={"request": [record]}, timeout=DEADLINE_S)
    llm = OpenAI(model=NAME, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                 batch_size=2, max_retries=0, timeout=DEADLINE_S, http_client=http_client)
    expected = [served_alone(server, p) for p in PROMPTS]
    for prompt, text in zip(PROMPTS, expected):
        assert text == model.generate(prompt, method="pld", ignore_eos=False, max_new_tokens=MAX_TOKENS,
                                      temperature=0.0).text

    assert [llm.invoke(p) for p in PROMPTS] == expected
    sent.clear()
    assert llm.batch(PROMPTS) == expected
    # batch_size=2: langchain sends the three prompts as OpenAI's list form, in sub-batches
    assert [body["prompt"] for body in sent] == [PROMPTS[:2], PROMPTS[2:]]
    chunks = list(llm.stream(PROMPTS[0]))
    assert len(chunks) > 1 and "".join(chunks) == expected[0]
    http_client.close()


# -------------------------------------------------------------------- lm-eval
MAX_LENGTH = 32  # lm-eval's context window: small, so the long document is scored in several windows
PREFIX = 1  # the tiny tokenizer has no BOS/EOS: the token lm-eval puts before a rolling document


def forward_logprobs(model: LongSpecModel, ids: list[int]) -> tuple[list[float], list[bool]]:
    """log p(token i | tokens < i) for i >= 1 from one plain forward, and whether each
    token is the forward's argmax (what lm-eval calls greedy)."""
    ids_t = torch.tensor(ids)
    decoder = model.model
    logits = decoder(ids_t[None, :-1], decoder.new_cache(ids_t.numel()), prefill=True).logits[0]
    return plain_forward_logprobs(model, ids_t).tolist(), (logits.argmax(-1) == ids_t[1:]).tolist()


def offline(monkeypatch) -> None:
    """No network for the hub or datasets. The variables are read when those packages are
    imported (perhaps earlier in this process), so their copies are set too."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets_config = pytest.importorskip("datasets.config")
    hub_constants = pytest.importorskip("huggingface_hub.constants")

    monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # what is_offline_mode() reads


def lm_eval_expected(model: LongSpecModel, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The (log-likelihood, is_greedy) of a continuation as lm-eval asks it: the tokens left-truncated
    to its window of MAX_LENGTH - 1 (one is kept for the generated token), its context shortened to
    match, the continuation's log-probabilities summed in order."""
    window = MAX_LENGTH - 1
    ids = (context + continuation)[-window:]
    ctxlen = len(context) - max(0, len(context) + len(continuation) - window)
    logprobs, argmax = forward_logprobs(model, ids)
    return sum(logprobs[ctxlen - 1 :]), all(argmax[ctxlen - 1 :])


def write_tasks(directory, mc_docs: list[dict], ppl_docs: list[dict]) -> None:
    """A multiple-choice task and a rolling-perplexity task over local JSONL files."""
    for name, docs in (("mc", mc_docs), ("ppl", ppl_docs)):
        (directory / f"{name}.jsonl").write_text("\n".join(json.dumps(doc) for doc in docs) + "\n")
    source = (
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        "    test: {data}\n"
        f"  cache_dir: {directory / 'datasets-cache'}\n"  # not the user's datasets cache
        "test_split: test\n"
    )
    (directory / "mc.yaml").write_text(
        "task: tiny_mc\n" + source.format(data=directory / "mc.jsonl") +
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )
    (directory / "ppl.yaml").write_text(
        "task: tiny_ppl\n" + source.format(data=directory / "ppl.jsonl") +
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )


def test_lm_eval_loglikelihoods_equal_the_plain_forward(server, model, checkpoint, tmp_path, monkeypatch):
    offline(monkeypatch)
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # lm-eval then sends an empty bearer; this server has no key

    # One choice is the model's own greedy continuation, so lm-eval's is_greedy is True at least once
    # (a context whose greedy token is a character: the tiny model's vocabulary is wider than its tokenizer's).
    context, greedy = next((c, g) for c in ("the cat sat on the", *PROMPTS, "hello")
                           for g in [model.generate(c, method="ar", max_new_tokens=1, temperature=0.0)]
                           if model.encode(c + g.text).tolist() == model.encode(c).tolist() + g.token_ids)
    mc_docs = [{"question": context, "choices": [" mat", greedy.text, " cat"], "answer": 0},
               {"question": "a b c a b", "choices": [" c", " d"], "answer": 0}]
    ppl_docs = [{"text": "hello hello hello"},
                {"text": "the quick brown fox jumps over the lazy dog. the quick brown fox jumps"}]
    write_tasks(tmp_path, mc_docs, ppl_docs)

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": NAME, "base_url": server.url + "/v1/completions", "tokenizer": str(checkpoint),
                    "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
                    "tokenizer_backend": "huggingface", "max_length": MAX_LENGTH, "custom_prefix_token_id": PREFIX},
        tasks=["tiny_mc", "tiny_ppl"], log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),  # not lm-eval's own thousands
    )

    # Multiple choice: lm-eval sums the echoed token_logprobs over the continuation. The server
    # scores with the same float32 forward and JSON round-trips a float exactly, so the sums
    # (same floats, same order) are equal exactly.
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(mc_docs)
    greedy_seen, correct = False, 0
    for sample in samples:
        for (ctx, continuation), (loglikelihood, is_greedy) in zip(sample["arguments"], sample["filtered_resps"],
                                                                    strict=True):
            ids = model.encode(ctx + continuation).tolist()
            ctxlen = len(model.encode(ctx))  # the character tokenizer splits at any boundary, as lm-eval does
            assert (loglikelihood, is_greedy) == lm_eval_expected(model, ids[:ctxlen], ids[ctxlen:])
            greedy_seen |= is_greedy
        lls = [ll for ll, _ in sample["filtered_resps"]]
        correct += lls.index(max(lls)) == sample["doc"]["answer"]
    assert greedy_seen and results["results"]["tiny_mc"]["acc,none"] == correct / len(samples)

    # Rolling: the document after lm-eval's prefix token, in disjoint windows of MAX_LENGTH - 2
    # tokens, each window's predicted tokens scored; the document's log-likelihood is their sum.
    samples = sorted(results["samples"]["tiny_ppl"], key=lambda s: s["doc_id"])
    totals = []
    for sample, doc in zip(samples, ppl_docs, strict=True):
        tokens = model.encode(doc["text"]).tolist()
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=tokens, prefix_token=PREFIX, max_seq_len=MAX_LENGTH - 2, context_len=1)]
        expected = sum(lm_eval_expected(model, ctx, pred)[0] for ctx, pred in windows)
        assert sample["filtered_resps"] == [expected]
        totals.append((expected, len(doc["text"].encode())))
    assert len(windows) >= 3  # the long document really spans windows
    # The short one fits one window: one plain forward over the prefix and the document, no lm-eval code.
    short = [PREFIX] + model.encode(ppl_docs[0]["text"]).tolist()
    assert len(short) < MAX_LENGTH and samples[0]["filtered_resps"] == [sum(forward_logprobs(model, short)[0])]
    ppl = results["results"]["tiny_ppl"]
    # lm-eval's weighted_perplexity: exp(-sum of log-likelihoods / sum of bytes), same order
    assert ppl["byte_perplexity,none"] == math.exp(-sum(t[0] for t in totals) / sum(t[1] for t in totals))
    assert math.isfinite(ppl["word_perplexity,none"]) and ppl["bits_per_byte,none"] > 0


def test_lm_eval_remote_tokenizer_probe_falls_back_to_the_local_tokenizer(server, checkpoint, monkeypatch):
    offline(monkeypatch)
    pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # tokenizer_backend "auto" asks the server for /tokenizer_info and /tokenize; this
    # server has neither (404), so lm-eval must settle on the checkpoint's own tokenizer.
    assert httpx.get(server.url + "/tokenizer_info", timeout=DEADLINE_S).status_code == 404
    lm = LocalCompletionsAPI(model=NAME, base_url=server.url + "/v1/completions", tokenizer=str(checkpoint),
                             tokenizer_backend="auto")
    assert lm.tokenizer_backend == "huggingface" and lm.tok_encode("abc") == [66, 67, 68]
