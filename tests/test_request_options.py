"""The allowlist of drafter options a request may set over HTTP (the server's tests
send them through a live server)."""

from __future__ import annotations

import pytest

from longspec.serve.request_options import (
    REQUEST_OPTIONS, OptionError, ServerLimits, check_request_options, server_only_options,
)
from longspec.speculation.methods import METHODS, accepted_options, make_drafter

LIMITS = ServerLimits(prompt_tokens=4096)
PATH_VALUED = {"checkpoint", "heads", "model", "vocab", "generator"}


def test_every_method_has_an_allowlist_of_options_it_really_takes():
    assert set(REQUEST_OPTIONS) == set(METHODS)
    for method, rules in REQUEST_OPTIONS.items():
        assert set(rules) <= set(accepted_options(method)), method


def test_no_option_that_names_a_file_or_a_model_is_a_request_option():
    for method, rules in REQUEST_OPTIONS.items():
        assert not set(rules) & PATH_VALUED, method
        assert set(accepted_options(method)) & PATH_VALUED <= set(server_only_options(method))


@pytest.mark.parametrize("method,options", [
    ("pld", {"num_tokens": 64, "min_ngram": 1, "max_ngram": 8, "longest_run": True}),
    ("ngram", {"n": 8, "k": 64}),
    ("tokenswift", {"budget": 4096, "widths": [1, 3, 3, 3], "sinks": 0, "dynamic_cache": False}),
    ("magicdec", {"length": 32, "budget": None, "budget_fraction": 1.0}),
    ("longspec-chain", {"length": 16, "retrieval": "pld", "retrieval_streak": None, "temperature": 0.5}),
    ("mamba", {"widths": [2, 2, 2], "exploration": 0.0}),
    ("auto", {"components": "pld,ngram", "policy": "ucb", "probe_every": 4096}),
])
def test_options_at_their_bounds_are_accepted_and_normalised(method, options):
    checked = check_request_options(method, options, LIMITS)
    assert set(checked) == set(options)
    assert all(not isinstance(v, list) for v in checked.values())  # widths and names become tuples


@pytest.mark.parametrize("method,options,fragment", [
    ("pld", {"num_tokens": 65}, "in [1, 64]"),
    ("pld", {"num_tokens": True}, "must be an integer"),
    ("pld", {"longest_run": 1}, "true or false"),
    ("tokenswift", {"budget": 4097}, "in [1, 4096]"),
    ("tokenswift", {"widths": []}, "list of 1 to 8"),
    ("tokenswift", {"widths": [1, 2.5]}, "every width"),
    ("mamba", {"exploration": float("nan")}, "must be a number"),
    ("draft-model", {"temperature": 0}, "(0.0, 10.0]"),
    ("longspec", {"retrieval": "web"}, "must be one of"),
    ("longspec", {"strategy": "chain"}, "set by the server's configuration"),
    ("auto", {"components": ["pld", "oracle"]}, "unknown ['oracle']"),
    ("auto", {"components": []}, "list of names"),
    ("ar", {"num_tokens": 3}, "a request may set: none"),
])
def test_options_out_of_bounds_are_refused_naming_the_option(method, options, fragment):
    with pytest.raises(OptionError) as refused:
        check_request_options(method, options, LIMITS)
    assert fragment in str(refused.value)
    assert next(iter(options)) in str(refused.value)


def test_allowed_options_build_their_drafter():
    """Accepted values are values the drafter takes (where it needs no weights)."""
    for method, options in [("pld", {"num_tokens": 3, "max_candidates": 2}), ("ngram", {"n": 3, "k": 5}),
                            ("magicdec", {"budget": 64, "sinks": 4}), ("auto", {"components": ["pld", "ngram"]})]:
        make_drafter(method, **check_request_options(method, options, LIMITS))
