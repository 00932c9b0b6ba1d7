"""Structured output under speculation (speculation/grammar.py): constraints compile or
are refused with the reason; each round's tree is pruned to the drafts the grammar
allows (a sampled tree keeps its forbidden nodes as leaves) and every node's mask
reaches verification; greedy and seeded outputs equal constrained plain decoding's for
every drafter kind, sampled children and batch rows included; finished JSON parses."""

from __future__ import annotations

import json

import pytest
import torch

from exactness import OPTIONS, diverse_model, real_drafters
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.drafters.longspec import LongSpecDrafter, SampledChainStrategy
from longspec.speculation.engine import SpeculativeEngine
from longspec.speculation.grammar import GrammarVocabulary, OutputConstraint
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree
from oracles import OracleGarbageDrafter, random_draft
from tiny_models import VOCAB_SIZE, char_tokenizer, random_ids

EOS = 95  # the character tokenizer's "~", the tiny models' end of sequence here
TOKENIZER = char_tokenizer(96)


def token(text: str) -> int:
    return TOKENIZER.convert_tokens_to_ids(text)


@pytest.fixture(scope="module")
def vocabulary() -> GrammarVocabulary:
    return GrammarVocabulary(TOKENIZER, VOCAB_SIZE, (EOS,))


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": OutputConstraint("json_schema", SCHEMA),
    "json_object": OutputConstraint("json_object"),
    "regex": OutputConstraint("regex", r"(ab|cd)+[0-9]{2,5}( [a-z]+)*"),
    "lark": OutputConstraint("grammar", 'start: "x" ("y" | "zz")* "!"'),
    "gbnf": OutputConstraint("grammar", 'root ::= "(" [a-c]+ ")" | "no"'),
    "choice": OutputConstraint("choice", ["yes", "no", "maybe so"]),
}


# ------------------------------------------------------------------ the constraints
@pytest.mark.parametrize("constraint,message", [
    (lambda: OutputConstraint("yaml", "x"), "unknown constraint kind"),
    (lambda: OutputConstraint("choice", []), "non-empty list"),
    (lambda: OutputConstraint("regex", ""), "non-empty text"),
    (lambda: OutputConstraint("json_schema", 3), "a JSON schema is an object"),
    (lambda: OutputConstraint("regex", "(ab").grammar(), "the regex does not compile"),
    (lambda: OutputConstraint("grammar", "start: (").grammar(), "the grammar does not compile"),
    (lambda: OutputConstraint("json_schema", {"type": "strin"}).grammar(), "the json schema does not compile"),
])
def test_bad_constraints_are_refused_with_the_reason(constraint, message):
    with pytest.raises(ValueError, match=message):
        constraint()


def test_json_whitespace_is_bounded_unless_the_schema_sets_its_own(vocabulary):
    """Between JSON tokens: one space, or a newline and at most 20 spaces or tabs (a
    greedy small model otherwise fills its token limit with whitespace)."""
    def allows_after(constraint, text: str, next_text: str) -> bool:
        state = vocabulary.matcher(constraint)
        state.advance(torch.tensor([token(c) for c in text]))
        _, allowed, _ = state.constrain(Tree.chain(token(text[-1]), []))
        return bool(allowed[0, token(next_text)])

    bounded = OutputConstraint("json_object")  # (the character tokenizer has no newline)
    assert allows_after(bounded, "{", " ") and not allows_after(bounded, "{ ", " ")
    free = OutputConstraint("json_schema", {"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert allows_after(free, "{ " * 1 + " " * 30, " ")
    assert "not JSON" in pytest.raises(ValueError, OutputConstraint("json_schema", "{bad").grammar).value.args[0]


def test_a_vocabulary_needs_an_eos_token():
    with pytest.raises(ValueError, match="EOS token"):
        GrammarVocabulary(TOKENIZER, VOCAB_SIZE, ())


# ------------------------------------------------------------------ tree masks
def tree_of(pairs: list[tuple[str, int]]) -> Tree:
    """Nodes (character, parent) after a root (an arbitrary committed token)."""
    return Tree.from_parents(torch.tensor([token(" ")] + [token(c) for c, _ in pairs]),
                             torch.tensor([-1] + [p for _, p in pairs]))


def test_the_tree_is_pruned_to_the_paths_the_grammar_allows(vocabulary):
    grammar = vocabulary.matcher(OutputConstraint("regex", r"ab[0-9]+"))
    # root -> a -> b -> 1 -> x(forbidden) -> 2 (below a forbidden node)
    #      -> b (forbidden at the start)  -> a (below it)
    #            a -> c (forbidden after a)
    tree = tree_of([("a", 0), ("b", 1), ("1", 2), ("x", 3), ("2", 4), ("b", 0), ("a", 6), ("c", 1)])
    pruned, allowed, count = grammar.constrain(tree)
    assert count == 5
    assert [TOKENIZER.decode([t]) for t in pruned.tokens.tolist()[1:]] == ["a", "b", "1"]
    assert pruned.parents.tolist() == [-1, 0, 1, 2]
    assert allowed.shape == (4, VOCAB_SIZE)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [token("a")]
    assert torch.nonzero(allowed[1]).flatten().tolist() == [token("b")]
    digits = sorted(token(str(d)) for d in range(10))
    assert torch.nonzero(allowed[2]).flatten().tolist() == digits
    assert torch.nonzero(allowed[3]).flatten().tolist() == sorted(digits + [EOS])  # complete: EOS may end it
    whole, masks, _ = grammar.constrain(tree, prune=False)
    assert whole is tree and masks.shape == (tree.size, VOCAB_SIZE)
    grammar.advance(torch.tensor([token("a"), token("b")]))  # the committed state moves on; the walk left it
    assert torch.nonzero(grammar.constrain(tree_of([]))[1][0]).flatten().tolist() == digits


def test_a_tree_of_sampled_children_keeps_forbidden_drafts_as_leaves(vocabulary):
    grammar = vocabulary.matcher(OutputConstraint("regex", r"ab"))
    tokens = tree_of([("b", 0), ("a", 0), ("a", 1), ("b", 2)]).tokens
    sampled = Tree.from_parents(tokens, torch.tensor([-1, 0, 0, 1, 2]),
                                draft_probs=torch.full((5, VOCAB_SIZE), 1.0 / VOCAB_SIZE, dtype=torch.float64),
                                children_sampled=True)
    kept, _, count = grammar.constrain(sampled)
    # "b" is rejected at the root (its residual update stays); the "a" below it can never be reached.
    assert count == 1 and kept.size == 4 and kept.children_sampled
    assert kept.parents.tolist() == [-1, 0, 0, 2]


# ------------------------------------------------------------------ exactness
def constrained_run(model, prompt, vocabulary, constraint, params, drafter=None, seed=None, tokens=60, stats=None):
    engine = SpeculativeEngine(model, OPTIONS)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    params = SamplingParams(**{**vars(params), "constrained": True})
    rounds = engine.generate(prompt, params=params, max_new_tokens=tokens, drafter=drafter, generator=generator,
                             eos_token_ids=(EOS,), grammar=vocabulary.matcher(constraint), stats=stats)
    return torch.cat(list(rounds))


def text_of(tokens: torch.Tensor) -> str:
    return TOKENIZER.decode([t for t in tokens.tolist() if t != EOS])


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(vocabulary, family, name):
    model, extra = diverse_model(family)
    params = SamplingParams(**extra)
    prompt = random_ids(20, seed=3)[0]
    reference = constrained_run(model, prompt, vocabulary, CONSTRAINTS[name], params)
    stats = GenerationStats()
    oracle = OracleGarbageDrafter(reference, prompt.numel(), seed=7)
    assert torch.equal(constrained_run(model, prompt, vocabulary, CONSTRAINTS[name], params, oracle, stats=stats),
                       reference)
    assert stats.pruned_tokens > 0  # the garbage drafts went before the forward
    for drafter_name, make in sorted(real_drafters(model).items()):
        got = constrained_run(model, prompt, vocabulary, CONSTRAINTS[name], params, make())
        assert torch.equal(got, reference), drafter_name


@pytest.mark.parametrize("name", ["json_schema", "regex", "choice"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_seeded_constrained_speculation_equals_constrained_plain_decoding(vocabulary, family, name):
    model, extra = diverse_model(family)
    params = SamplingParams(temperature=1.0, top_k=40, **extra)
    prompt = random_ids(20, seed=5)[0]
    reference = constrained_run(model, prompt, vocabulary, CONSTRAINTS[name], params, seed=11)
    for drafter_name, make in sorted(real_drafters(model).items()):
        got = constrained_run(model, prompt, vocabulary, CONSTRAINTS[name], params, make(), seed=11)
        assert torch.equal(got, reference), drafter_name


def test_sampled_children_under_a_grammar_follow_the_constrained_distribution(vocabulary):
    """Multi-draft rejection with forbidden drafts kept as leaves: the first token's
    distribution over many seeds matches constrained plain decoding's."""
    model, _ = diverse_model("llama")
    constraint = OutputConstraint("regex", r"[a-e]{3}")
    params = SamplingParams(temperature=1.0)
    prompt = random_ids(12, seed=2)[0]
    counts = {"plain": torch.zeros(VOCAB_SIZE), "sampled": torch.zeros(VOCAB_SIZE)}
    runs = 300
    for seed in range(runs):
        for label in counts:
            drafter = (LongSpecDrafter(random_draft(model, seed=1), SampledChainStrategy(3, temperature=1.5))
                       if label == "sampled" else None)
            out = constrained_run(model, prompt, vocabulary, constraint, params, drafter, seed=seed, tokens=3)
            assert text_of(out)[:3].strip("abcde") == ""
            counts[label][out[0]] += 1
    engine = SpeculativeEngine(model, OPTIONS)
    logits = model(prompt.view(1, -1), model.new_cache(64)).logits[0, -1]
    allowed = torch.tensor([token(c) for c in "abcde"])
    expected = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
    expected[allowed] = torch.softmax(logits[allowed].double(), dim=-1)
    del engine
    for label, observed in counts.items():
        frequencies = observed.double() / runs
        assert set(torch.nonzero(observed).flatten().tolist()) <= set(allowed.tolist()), label
        # 300 draws: each frequency within 4.5 standard deviations of its probability
        bound = 4.5 * torch.sqrt(expected * (1 - expected) / runs) + 1e-9
        assert ((frequencies - expected).abs() <= bound).all(), (label, frequencies[allowed], expected[allowed])


def test_batch_rows_with_different_constraints_equal_their_single_runs(vocabulary):
    model, _ = diverse_model("llama")
    names = ["json_schema", "regex", "choice", "lark"]
    prompts = [random_ids(10 + i, seed=30 + i)[0] for i in range(len(names))]
    settings = [SamplingParams(constrained=True), SamplingParams(temperature=0.9, constrained=True),
                SamplingParams(constrained=True), SamplingParams(temperature=1.0, top_p=0.9, constrained=True)]
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=4, row_capacity=256))
    handles = [engine.submit(p, params=s, max_new_tokens=40, drafter=real_drafters(model)["pld"](),
                             eos_token_ids=(EOS,), generator=torch.Generator().manual_seed(i),
                             grammar=vocabulary.matcher(CONSTRAINTS[name]))
               for i, (p, s, name) in enumerate(zip(prompts, settings, names))]
    engine.run()
    for i, (handle, prompt, params, name) in enumerate(zip(handles, prompts, settings, names)):
        alone = constrained_run(model, prompt, vocabulary, CONSTRAINTS[name],
                                SamplingParams(**{**vars(params), "constrained": False}), seed=i, tokens=40)
        assert torch.equal(handle.tokens, alone), name


def test_finished_outputs_follow_their_constraint(vocabulary):
    model, extra = diverse_model("llama")
    prompt = random_ids(20, seed=8)[0]
    for seed in range(6):
        params = SamplingParams(temperature=1.0, **extra)
        out = constrained_run(model, prompt, vocabulary, CONSTRAINTS["json_schema"], params,
                              real_drafters(model)["pld"](), seed=seed, tokens=120)
        if out[-1] != EOS:
            continue  # cut by max_new_tokens: a prefix of valid JSON
        value = json.loads(text_of(out))
        assert set(value) == {"name", "n", "tags"} and isinstance(value["n"], int)
        assert len(value["name"]) <= 6 and all(tag in ("a", "bc") for tag in value["tags"])
    out = constrained_run(model, prompt, vocabulary, CONSTRAINTS["choice"], SamplingParams(), tokens=20)
    assert out[-1] == EOS and text_of(out) in ("yes", "no", "maybe so")


def test_constrained_params_and_a_grammar_come_together(vocabulary):
    model, _ = diverse_model("llama")
    engine = SpeculativeEngine(model, OPTIONS)
    with pytest.raises(ValueError, match="a grammar comes with SamplingParams"):
        list(engine.generate(random_ids(5)[0], params=SamplingParams(constrained=True), max_new_tokens=3))
    with pytest.raises(ValueError, match="a grammar comes with SamplingParams"):
        list(engine.generate(random_ids(5)[0], params=SamplingParams(), max_new_tokens=3,
                             grammar=vocabulary.matcher(CONSTRAINTS["regex"])))
    with pytest.raises(ValueError, match="must stop there"):
        list(engine.generate(random_ids(5)[0], params=SamplingParams(constrained=True), max_new_tokens=3,
                             grammar=vocabulary.matcher(CONSTRAINTS["regex"])))


@pytest.mark.parametrize("name", ["json_schema", "regex"])
def test_the_certified_head_decides_constrained_greedy_rounds(vocabulary, name):
    """Where the grammar allows the certified argmax it is the constrained one; the
    other nodes take the full head's masked argmax: the full head's tokens either way."""
    from tiny_models import tiny_decoder

    prompt = random_ids(8, seed=2)[0].repeat(3)
    outputs = []
    for certified in (True, False):
        model = tiny_decoder("llama", dtype=torch.bfloat16, head_dim=32)
        assert model.certified_head is not None
        if not certified:
            model._certified_head = None
        for drafter in (None, real_drafters(model)["pld"]()):
            outputs.append(constrained_run(model, prompt, vocabulary, CONSTRAINTS[name], SamplingParams(), drafter))
        if certified:
            assert model.certified_head.stats.rows > 0
    assert all(torch.equal(out, outputs[0]) for out in outputs)
