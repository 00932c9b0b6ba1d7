"""`plain_rounds`: a drafter that leaves rounds to plain decoding is neither asked nor
told during them, then told of them all at once: their tokens, and the target's
states of their roots, exactly as a drafter told round by round would have seen them.
Outputs stay AR's (greedy, float64) and the seeded ones the same under sampling; in
the batched engine too, row by row, beside rows that do not leave rounds plain."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree
from tiny_models import random_ids, tiny_decoder

OPTIONS = EngineOptions(max_tree_nodes=8, progress=False)


class Recorder(Drafter):
    """Proposes a prompt lookup's chain on `ask` rounds, nothing on the others, and keeps
    what it is told: with `plain`, it leaves the others to plain decoding; without, it
    goes through every one of them (the reference)."""

    def __init__(self, pattern: list[int], plain: bool) -> None:
        self.pattern, self.plain = pattern, plain  # rounds proposed, then rounds left plain, repeated
        self.lookup = PromptLookupDrafter(num_tokens=4)
        self.proposals, self.observed, self.hidden = 0, [], []

    def begin(self, context: DraftContext) -> None:
        self.view, self.cycle = context.target, 0
        self.lookup.begin(context)

    def _plain_now(self) -> int:
        ask, plain = self.pattern
        position = self.cycle % (ask + plain)
        return ask + plain - position if position >= ask else 0

    def plain_rounds(self) -> int:
        if not self.plain:
            return 0
        rounds = self._plain_now()
        self.cycle += rounds
        return rounds

    def propose(self, context: DraftContext) -> Tree:
        self.proposals += 1
        plain_now = self._plain_now()
        self.cycle += 1
        return Tree.chain(context.root, []) if plain_now else self.lookup.propose(context)

    def observe(self, committed: torch.Tensor) -> None:
        self.lookup.observe(committed)
        self.observed.append(committed.tolist())
        self.hidden.append(self.view.last_hidden.clone())


def generate(model, prompt, drafter, params=SamplingParams(), seed=None, max_new_tokens=60):
    engine = SpeculativeEngine(model, OPTIONS)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter,
                                          generator=generator)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_plain_rounds_are_told_at_once_with_every_root_state(family):
    model = tiny_decoder(family, dtype=torch.float64)
    prompt = torch.cat([random_ids(12, seed=3)[0]] * 3)  # repeats: the lookup's chains are accepted
    reference = generate(model, prompt, None)
    plain, each = Recorder([2, 5], plain=True), Recorder([2, 5], plain=False)
    assert torch.equal(generate(model, prompt, plain), reference)
    assert torch.equal(generate(model, prompt, each), reference)
    assert plain.proposals < each.proposals  # the plain rounds were not asked
    # Told the same tokens, the plain rounds in one piece ...
    assert sum(plain.observed, []) == sum(each.observed, [])
    assert any(len(tokens) == 5 for tokens in plain.observed)
    # ... with one state a root, equal to those of the rounds told one by one.
    assert torch.allclose(torch.cat(plain.hidden), torch.cat(each.hidden), rtol=0, atol=1e-12)
    for tokens, hidden in zip(plain.observed, plain.hidden):
        assert hidden.shape[0] == len(tokens)  # a plain round, or a round whose accepted path has as many nodes


def test_a_sequence_that_ends_among_plain_rounds_tells_all_but_the_last_round():
    model = tiny_decoder("qwen2", dtype=torch.float64)
    prompt = random_ids(16, seed=4)[0]
    drafter = Recorder([1, 30], plain=True)
    out = generate(model, prompt, drafter, max_new_tokens=20)
    assert torch.equal(out, generate(model, prompt, None, max_new_tokens=20))
    assert sum(drafter.observed, []) == out.tolist()[:-1]  # the last round is never told, as without plain rounds


def test_plain_rounds_keep_seeded_sampling_identical():
    model = tiny_decoder("llama", dtype=torch.float64)
    prompt = torch.cat([random_ids(10, seed=5)[0]] * 3)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    with_plain = generate(model, prompt, Recorder([2, 4], plain=True), params, seed=11)
    told_each = generate(model, prompt, Recorder([2, 4], plain=False), params, seed=11)
    assert torch.equal(with_plain, told_each)


@pytest.mark.parametrize("answer", [-1, 2.0, None, True])
def test_a_plain_rounds_answer_that_is_not_a_count_fails_naming_the_drafter(answer):
    class Broken(Recorder):
        def plain_rounds(self):
            return answer

    model = tiny_decoder("llama", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"drafter Broken\.plain_rounds\(\) returned"):
        generate(model, random_ids(8, seed=1)[0], Broken([1, 1], plain=True))


def generate_batch(model, prompts, drafters, params=SamplingParams(), seeds=None, max_new_tokens=60, **batch):
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=len(prompts), row_capacity=160, **batch))
    seeds = seeds or [None] * len(prompts)
    handles = [engine.submit(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter,
                             generator=torch.Generator().manual_seed(seed) if seed is not None else None)
               for prompt, drafter, seed in zip(prompts, drafters, seeds)]
    engine.run()
    return [handle.tokens for handle in handles]


def batch_prompts():
    return [torch.cat([random_ids(12, seed=3)[0]] * 3), random_ids(20, seed=6)[0],
            torch.cat([random_ids(9, seed=7)[0]] * 4)]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_rows_tell_their_plain_rounds_at_once_with_every_root_state(family):
    """Rows leaving different rounds plain beside a row that drafts every round and
    an AR row: every row is AR's, and each plain row is told what the same drafter
    told round by round is told."""
    model = tiny_decoder(family, dtype=torch.float64)
    prompts = batch_prompts()
    references = [generate(model, prompt, None) for prompt in prompts]
    plain = [Recorder([2, 5], plain=True), Recorder([1, 3], plain=True)]
    each = [Recorder([2, 5], plain=False), Recorder([1, 3], plain=False)]
    for drafters in (plain, each):
        outputs = generate_batch(model, prompts, [*drafters, None])
        for output, reference in zip(outputs, references):
            assert torch.equal(output, reference)
    for with_plain, told_each in zip(plain, each):
        assert with_plain.proposals < told_each.proposals
        assert sum(with_plain.observed, []) == sum(told_each.observed, [])
        torch.testing.assert_close(torch.cat(with_plain.hidden), torch.cat(told_each.hidden), rtol=1e-12, atol=1e-12)
        for tokens, hidden in zip(with_plain.observed, with_plain.hidden):
            assert hidden.shape[0] == len(tokens)


def test_a_batched_row_that_ends_among_plain_rounds_tells_all_but_the_last_round():
    model = tiny_decoder("qwen2", dtype=torch.float64)
    prompts = batch_prompts()[:2]
    drafter = Recorder([1, 30], plain=True)
    outputs = generate_batch(model, prompts, [drafter, PromptLookupDrafter(num_tokens=4)], max_new_tokens=20)
    assert torch.equal(outputs[0], generate(model, prompts[0], None, max_new_tokens=20))
    assert sum(drafter.observed, []) == outputs[0].tolist()[:-1]


def test_batched_plain_rounds_keep_seeded_sampling_identical():
    model = tiny_decoder("llama", dtype=torch.float64)
    prompts = batch_prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    outputs = generate_batch(model, prompts, [Recorder([2, 4], plain=True), Recorder([1, 2], plain=True), None],
                             params, seeds=[11, 12, 13])
    for output, prompt, seed in zip(outputs, prompts, [11, 12, 13]):
        assert torch.equal(output, generate(model, prompt, None, params, seed=seed))


def test_with_fill_padding_every_batched_round_asks_the_drafter():
    """Another row's wider tree leaves padding the drafter's proposals may fill: no
    round is left plain."""
    model = tiny_decoder("llama", dtype=torch.float64)
    prompts = batch_prompts()[:2]
    drafter = Recorder([1, 3], plain=True)
    outputs = generate_batch(model, prompts, [drafter, PromptLookupDrafter(num_tokens=4)], max_new_tokens=30,
                             fill_padding=True)
    assert torch.equal(outputs[0], generate(model, prompts[0], None, max_new_tokens=30))
    assert drafter.proposals == len(drafter.observed) + 1  # every round but the last was told one by one


def test_a_batched_plain_rounds_answer_that_is_not_a_count_fails_naming_the_drafter():
    class Broken(Recorder):
        def plain_rounds(self):
            return -2

    model = tiny_decoder("llama", dtype=torch.float64)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=160))
    prompts = batch_prompts()[:2]
    broken = engine.submit(prompts[0], max_new_tokens=60, drafter=Broken([1, 1], plain=True))
    other = engine.submit(prompts[1], max_new_tokens=60)
    engine.run()
    # The row fails alone, with its cause; its neighbour decodes on.
    assert broken.stats.stop_reason == "error" and isinstance(broken.error, ValueError)
    assert "drafter Broken.plain_rounds() returned -2" in str(broken.error)
    assert other.stats.stop_reason == "length" and other.tokens.numel() == 60
