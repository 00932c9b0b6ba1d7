"""The vLLM proposer plugin (longspec.vllm): its token-id logic runs everywhere, the
check against vLLM's own loader only where vLLM is installed. The end-to-end check
against vLLM's greedy decoding is benchmarks/serving/vllm_plugin.py."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter
from longspec.vllm import AutoLookupProposer, PromptLookupProposer, SuffixCacheProposer
from longspec.vllm.lookup import CopyLength

MAX_LEN = 256


def config(k: int = 4, max_len: int = MAX_LEN):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k, model="x.Y"),
                           model_config=SimpleNamespace(max_model_len=max_len))


def batch(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's layout: a [rows, max_model_len] int32 array and each row's length."""
    ids = np.zeros((len(seqs), MAX_LEN), dtype=np.int32)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = seq
    return np.array([len(s) for s in seqs], dtype=np.int32), ids


def decode(proposer, model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], int]:
    """vLLM's greedy verification of a batch, in miniature: each step the target
    (`model`: sequence -> next token) keeps the drafted tokens it would have produced
    and adds its own next one. Returns the sequences and the forwards taken."""
    seqs = [list(p) for p in prompts]
    new = [[model(s)] for s in seqs]  # the prefill's token
    for s, t in zip(seqs, new):
        s.extend(t)
    forwards = 1
    while min(len(s) for s in seqs) < min(len(p) for p in prompts) + steps:
        drafts = proposer.propose(new, *batch(seqs))
        forwards += 1
        for i, (s, draft) in enumerate(zip(seqs, drafts)):
            committed = []
            for token in draft:
                if token != model(s + committed):
                    break
                committed.append(token)
            committed.append(model(s + committed))
            s.extend(committed)
            new[i] = committed
    return seqs, forwards


def periodic(seq: list[int]) -> int:
    return (seq[-1] + 1) % 7  # 0 1 2 ... 6 0 1 ...: every copy is right


def plain(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    while len(seq) < len(prompt) + n:
        seq.append(model(seq))
    return seq


@pytest.mark.parametrize("cls", [PromptLookupProposer, AutoLookupProposer, SuffixCacheProposer])
def test_greedy_outputs_equal_plain_decoding_and_copies_pay(cls):
    prompts = [[3, 4, 5, 6, 0, 1, 2, 3], [5, 6, 0, 1]]
    seqs, forwards = decode(cls(config(k=4)), periodic, prompts, steps=60)
    for prompt, seq in zip(prompts, seqs):
        assert seq[: len(prompt) + 60] == plain(periodic, prompt, 60)
    assert forwards < 30  # copies of a loop are accepted: several tokens per forward


def test_drafts_are_prompt_lookups_of_each_row():
    seqs = [[1, 2, 3, 9, 8, 1, 2], [7, 7, 7, 7]]
    drafts = PromptLookupProposer(config(k=3)).propose([[2], [7]], *batch(seqs))
    for seq, draft in zip(seqs, drafts):
        lookup = PromptLookupDrafter(num_tokens=3)
        lookup.observe(seq)
        assert draft == (lookup.lookup() or [[]])[0]
    assert drafts[0] == [3, 9, 8]


def test_rows_without_new_tokens_or_room_get_no_draft():
    seqs = [[1, 2, 1, 2, 1], [1, 2, 1, 2, 1]]
    lengths, ids = batch(seqs)
    proposer = PromptLookupProposer(config(k=4, max_len=7))
    assert proposer.propose([[], [1]], lengths, ids) == [[], [2, 1]]  # a prefill chunk; 2 tokens of room
    lengths[1] = 7
    assert proposer.propose([[1], [1]], lengths, ids)[1] == []


def test_a_row_that_changes_request_starts_afresh_and_a_moved_one_keeps_its_state():
    proposer = PromptLookupProposer(config(k=2))
    a, b = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5]
    proposer.propose([[2], [5]], *batch([a, b]))
    state_a = proposer.rows.rows.rows[0].state
    # b leaves; c takes row 1; a moves to row 1 as vLLM condenses the batch
    c = [8, 8, 9, 8]
    drafts = proposer.propose([[9], [3]], *batch([c + [9], a + [3]]))
    assert drafts == [[8, 9], [1, 2]]  # each from its own tokens only
    assert proposer.rows.rows.rows[1].state is state_a


def test_copy_length_follows_acceptance():
    length = CopyLength(token_cost=0.05)
    chain, runs = [1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8]
    for _ in range(40):
        length.record(chain, runs, [1, 2, 3, 4, 5, 6, 7])
        length.end_round()
    assert length.choose(runs) == 6
    rejecting = CopyLength(token_cost=0.05)
    for _ in range(40):
        rejecting.record(chain, runs, [9, 9])
        rejecting.end_round()
    assert rejecting.choose(runs) == 0  # speculation off where copies miss
    # verdicts stop at the first miss: the nodes after it were never in question
    assert rejecting.table.proposed.sum() == 40


def test_auto_turns_copies_off_on_text_they_do_not_predict():
    def noisy(seq: list[int]) -> int:  # the prompt's loop once, then never again
        return (seq[-1] * 31 + len(seq) * 17) % 101
    proposer = AutoLookupProposer(config(k=4))
    prompt = [n % 101 for n in range(0, 80, 3)]
    seqs, _ = decode(proposer, noisy, [prompt], steps=80)
    assert seqs[0][: len(prompt) + 80] == plain(noisy, prompt, 80)
    assert proposer.calls > 0 and proposer.seconds > 0


def template(seq: list[int]) -> int:
    return seq[-1] + 1 if 100 <= seq[-1] < 140 else 100  # every answer is the record 100, 101, ... 140


def test_a_finished_requests_output_drafts_the_next_requests():
    """The suffix cache learns a request's output once it leaves the batch; a later
    request whose own text holds no copy of the template drafts it from there."""
    first, later = [[1, 2, 3, 100]], [[7, 8, 9, 100]]
    forwards = {}
    for cls in (AutoLookupProposer, SuffixCacheProposer):
        proposer = cls(config(k=8))
        decode(proposer, template, first, steps=30)
        seqs, forwards[cls] = decode(proposer, template, later, steps=30)
        assert seqs[0][:34] == plain(template, later[0], 30)
    assert forwards[AutoLookupProposer] >= 30  # the later request's own text never repeats
    assert forwards[SuffixCacheProposer] <= 12  # from its second step on, copies of the first request's record
    cache = proposer.rows.cache
    assert cache.stats()["inserted"] == 1  # the first request, once it left; the later one is still running


def test_rows_past_a_shrunk_batch_are_remembered():
    proposer = SuffixCacheProposer(config(k=4))
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    proposer.propose([[5], [10]], *batch([a, b]))
    proposer.propose([[11]], *batch([a + [11]]))  # b finished: the batch has one row
    assert proposer.rows.cache.stats()["inserted"] == 1
    assert proposer.rows.cache.lookup([7, 8], 4) == [([9, 10], 2)]


def test_importing_the_plugin_imports_no_vllm():
    code = "import sys, longspec.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vllms_loader_builds_the_proposers():
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer

    for name in ("longspec.vllm.PromptLookupProposer", "longspec.vllm.AutoLookupProposer",
                 "longspec.vllm.SuffixCacheProposer"):
        cfg = config(k=4)
        cfg.speculative_config.model = name
        proposer = create_custom_proposer(cfg)
        proposer.load_model(None)
        assert proposer.propose([[2]], *batch([[1, 2, 3, 1, 2]]))[0][:1] == [3]
