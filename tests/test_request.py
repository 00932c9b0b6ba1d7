"""One request object from the edge to the engine: `GenerationRequest` validates once,
the API's keywords, the CLI's options and the server's fields all become it, and a
sampling option declared on `SamplingParams` reaches every edge without being spelled
again (typical_p is the proof)."""

from __future__ import annotations

import argparse

import pytest

from longspec.request import SAMPLING_FIELDS, GenerationRequest
from longspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from longspec.speculation.grammar import OutputConstraint
from longspec.speculation.processors import SamplingParams


def test_flat_keywords_are_sorted_into_sampling_and_request_fields():
    request = GenerationRequest.of(temperature=0.8, top_p=0.9, typical_p=0.5, max_new_tokens=7, seed=3, stop="x")
    assert request.sampling == SamplingParams(temperature=0.8, top_p=0.9, typical_p=0.5)
    assert (request.max_new_tokens, request.seed, request.stop) == (7, 3, ("x",))
    assert request.but(temperature=0.1, seed=4).sampling.temperature == 0.1
    assert GenerationRequest.of(constraint=OutputConstraint("json_object")).sampling.constrained


@pytest.mark.parametrize("keywords,message", [
    ({"temprature": 1.0}, "unknown generation option(s) temprature"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"seed": -1}, "seed must be in"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"logprobs": 21}, "top logprobs must be an int in [0, 20]"),
    ({"seed": 2**64}, "seed must be in [0, 18446744073709551615]"),
    ({"logprobs_mode": "cooked"}, "logprobs_mode must be one of"),
    ({"typical_p": 0.0}, "typical_p must be in (0, 1]"),
    ({"constraint": OutputConstraint("json_object"), "ignore_eos": True}, "ignore_eos cannot go with a constraint"),
    ({"method_options": [1]}, "method_options must be a dict"),
])
def test_bad_values_are_refused_on_construction(keywords, message):
    with pytest.raises((TypeError, ValueError)) as error:
        GenerationRequest.of(**keywords)
    assert message in str(error.value)


def test_every_cli_sampling_option_comes_from_sampling_params():
    from longspec.cli.main import _add_sampling_arguments

    parser = argparse.ArgumentParser()
    _add_sampling_arguments(parser)
    offered = {action.dest for action in parser._actions if action.dest != "help"}
    assert "typical_p" in offered and offered <= SAMPLING_FIELDS
    assert parser.parse_args(["--typical-p", "0.4"]).typical_p == 0.4


def test_server_fields_map_onto_sampling_params_by_name():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": 0.7, "top_p": 1.0,
                                             "typical_p": 0.6, "logit_bias": {"5": 2}, "presence_penalty": 1})
    fields = body.sampling_fields()
    assert fields["typical_p"] == 0.6 and fields["logit_bias"] == {5: 2.0} and "top_p" not in fields
    assert GenerationRequest.of(**fields).sampling.typical_p == 0.6
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "min_p": 0.1})
    assert chat.sampling_fields()["min_p"] == 0.1
