"""Constraints the matcher cannot follow are refused before any work
(speculation/grammar_limits.py): a schema past the size bounds, a grammar whose
language is empty; one that still hits the matcher's limits mid-generation fails the
request and never ends the output where the constraint does not (issue 64, defects 4
and 5). Over HTTP each is a 400 naming the limit or the reason."""

from __future__ import annotations

import pytest
import torch

from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions
from longspec.speculation.engine import EngineOptions
from longspec.speculation.grammar import GrammarGaveUp, GrammarVocabulary, OutputConstraint
from longspec.speculation.grammar_limits import MAX_OBJECT_PROPERTIES, MAX_SPEC_BYTES, ConstraintTooLarge, EmptyLanguage
from live_server import Server
from tiny_models import VOCAB_SIZE, char_tokenizer, save_checkpoint

EOS = 95


def wide(n: int, required: bool = False) -> dict:
    properties = {f"p{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": properties, **({"required": list(properties)} if required else {})}


SELF_REFERENCE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize("constraint,error,message", [
    (OutputConstraint("json_schema", wide(1000)), ConstraintTooLarge, "1,000 properties, more than the limit of 256"),
    (OutputConstraint("json_schema", wide(10_000, required=True)), ConstraintTooLarge, "bytes, more than the limit"),
    (OutputConstraint("json_schema", {"type": "array", "items": wide(MAX_OBJECT_PROPERTIES + 1)}), ConstraintTooLarge,
     "group them into nested objects"),
    (OutputConstraint("regex", "a" * (MAX_SPEC_BYTES + 1)), ConstraintTooLarge, "65,536"),
    (OutputConstraint("choice", ["x" * 1000] * 70), ConstraintTooLarge, "more than the limit"),
    (OutputConstraint("regex", r"[^\s\S]"), EmptyLanguage, "matches no text at all"),
    (OutputConstraint("json_schema", SELF_REFERENCE), EmptyLanguage, "matches no text at all"),
    (OutputConstraint("grammar", "start: a\na: a"), EmptyLanguage, "matches no text at all"),
])
def test_constraints_past_the_bounds_or_with_no_text_are_refused(constraint, error, message):
    with pytest.raises(error, match=message):
        constraint.grammar()


@pytest.mark.parametrize("constraint", [
    OutputConstraint("json_schema", wide(MAX_OBJECT_PROPERTIES)),
    OutputConstraint("json_schema", wide(MAX_OBJECT_PROPERTIES, required=True)),
    OutputConstraint("regex", "a{0}"),  # only the empty text: not empty
    OutputConstraint("json_schema", True),
])
def test_constraints_within_the_bounds_compile(constraint):
    assert constraint.grammar()


def test_a_matcher_that_gives_up_mid_generation_fails_instead_of_ending_the_output():
    """An object of 600 optional properties passes llguidance's own checks but overflows
    its parser row after '{'; with the bound lifted (as a grammar the bounds do not
    foresee would), the state refuses to go on rather than allow only EOS."""
    import longspec.speculation.grammar_limits as limits

    vocabulary = GrammarVocabulary(char_tokenizer(96), VOCAB_SIZE, (EOS,))
    tokens = vocabulary.tokenizer.tokenize_str
    original = limits.MAX_OBJECT_PROPERTIES
    limits.MAX_OBJECT_PROPERTIES = 10_000
    try:
        state = vocabulary.matcher(OutputConstraint("json_schema", wide(600)))
    finally:
        limits.MAX_OBJECT_PROPERTIES = original
    with pytest.raises(GrammarGaveUp, match="nothing that breaks it is returned"):
        state.advance(torch.tensor(tokens('{"p1')))


# ------------------------------------------------------------------ over HTTP
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = save_checkpoint(tmp_path_factory.mktemp("grammar-limits"), chat_template=TEMPLATE, eos_token_id=EOS)
    model = LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))
    running = Server(model, ServeOptions(model_name="tiny", method="pld", max_new_tokens=64))
    yield running
    running.stop()


@pytest.mark.parametrize("extra,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": wide(1000)}}},
     "response_format: the json schema has an object with 1,000 properties"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": wide(10_000)}}},
     "more than the limit of 65,536"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs: the regex matches no text at all"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REFERENCE}}},
     "the json schema matches no text at all"),
])
def test_the_server_refuses_them_with_400_before_any_work(server, extra, message):
    import httpx

    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                **extra})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_the_grammar_library_imports_without_torch_dynamo():
    """The matcher's bitmask helpers come from llguidance.numpy: llguidance.torch's import
    pulls in torch._dynamo, seconds that a server's start or first request paid."""
    import subprocess
    import sys

    pytest.importorskip("llguidance")
    code = ("import sys; from longspec.speculation.grammar import warm_grammar_library; warm_grammar_library(); "
            "assert 'llguidance' in sys.modules; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
