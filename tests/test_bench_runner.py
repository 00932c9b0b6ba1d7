"""The benchmark matrix end to end on a tiny model: JSON, markdown and PNG are
produced, greedy equality checks pass for lossless methods, a planted
mismatching method is flagged, and resume skips finished rows."""

from __future__ import annotations

import json

import pytest
import torch

from longspec.bench import report
from longspec.bench.methods import EngineMethod, RunOutput, build_methods, default_settings
from longspec.bench.runner import BenchRunner, RunnerOptions, first_divergence, load_rows, mismatches
from longspec.bench.tasks import Prompt
from longspec.speculation.engine import EngineOptions
from longspec.speculation.metrics import distinct_n
from tiny_models import random_ids, tiny_pair

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("gemma3", dtype=torch.float64)


def prompts():
    base = random_ids(6, seed=1)[0]
    looping = torch.cat([base.repeat(5), random_ids(4, seed=2)[0]])
    return [Prompt("loop", "a", looping, bucket=34), Prompt("random", "b", random_ids(30, seed=3)[0], bucket=30)]


class PlantedMismatch(EngineMethod):
    """Our AR with one output token changed: the checks must catch it."""

    def run(self, prompt, setting, max_new_tokens, eos_token_ids) -> RunOutput:
        out = super().run(prompt, setting, max_new_tokens, eos_token_ids)
        if len(out.tokens) > 5:
            out.tokens[5] = (out.tokens[5] + 1) % 128
        return out


def runner_for(pair, names, extra=()):
    hf, decoder = pair
    options = EngineOptions(progress=False, max_tree_nodes=16)
    methods, skipped = build_methods(names, decoder, peer=hf, engine_options=options)
    return BenchRunner(decoder, list(methods) + list(extra), skipped=skipped,
                       options=RunnerOptions(max_new_tokens=NEW_TOKENS, warmup_tokens=2, progress=False))


def test_matrix_end_to_end_writes_json_markdown_png_and_checks_pass(pair, tmp_path):
    runner = runner_for(pair, ["ar", "pld", "hf", "hf_pld"])
    settings = default_settings([0])
    out = tmp_path / "results.jsonl"
    rows = runner.run(prompts(), settings, out, header={"model": "tiny", "floor_tokens_per_s": [[30, 1e4]]})
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["model"] == "tiny"
    runs = [r for r in lines if r["kind"] == "run"]
    assert len(runs) == 2 * 2 * 4  # prompts × settings × methods
    for r in runs:
        assert r["new_tokens"] == NEW_TOKENS and r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0
        assert 0 < r["distinct_1"] <= 1 and r["timeline"][-1][0] == NEW_TOKENS
        if r["setting"] == "greedy":
            assert r["check_ar"]["equal"], r  # lossless: float64 greedy identity with our AR
            assert r["check_hf"]["equal"], r  # and with transformers
        else:
            assert "check_ar" not in r
    pld = [r for r in runs if r["method"] == "pld" and r["task"] == "loop" and r["setting"] == "greedy"][0]
    assert pld["tau"] > 1 and pld["cache_bytes"] > 0 and pld["acceptance_by_depth"]
    assert pld["draft_state_bytes"] > 0  # the drafter's own index, beside the target's cache
    assert all(r["draft_state_bytes"] is None for r in runs if r["method"] in ("ar", "hf", "hf_pld"))
    assert [r for r in runs if r["method"] == "hf"][0]["cache_bytes"] > 0
    assert not mismatches(rows)

    text = report.markdown(rows)
    assert "| method | loop | random |" in text and "AR floor" in text and "MISMATCH" not in text
    assert "| loop | 34 | greedy | pld |" in text
    files = report.plots(rows, tmp_path)
    assert [f.name for f in files] == list(report.PLOTS)
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
    assert "pld" in report.summary(rows)


def test_planted_mismatch_is_flagged_with_position_and_gap(pair, tmp_path):
    hf, decoder = pair
    planted = PlantedMismatch("planted", decoder, lambda: None, EngineOptions(progress=False))
    runner = runner_for(pair, ["ar", "hf"], extra=[planted])
    rows = runner.run(prompts()[:1], default_settings([]), tmp_path / "r.jsonl")
    assert rows[0]["kind"] == "header"  # the returned rows are the file's rows
    bad = mismatches(rows)
    assert [r["method"] for r in bad] == ["planted"]
    check = bad[0]["check_ar"]
    assert check["position"] == 5 and check["verdict"] == "MISMATCH" and check["top2_gap"] > 0
    assert bad[0]["check_hf"]["position"] == 5
    assert "**MISMATCH** planted vs our AR" in report.markdown(rows)


def test_resume_skips_finished_rows(pair, tmp_path):
    out = tmp_path / "results.jsonl"
    runner_for(pair, ["ar"]).run(prompts()[:1], default_settings([]), out)
    first = out.read_text()
    with out.open("a") as f:
        f.write('{"kind": "run", "task": "lo')  # a row cut off by a killed run
    calls = []

    class Counting(EngineMethod):
        def run(self, *args, **kwargs):
            calls.append(self.name)
            return super().run(*args, **kwargs)

    hf, decoder = pair
    counting = [Counting(n, decoder, lambda: None, EngineOptions(progress=False)) for n in ("ar", "ar_again")]
    runner = BenchRunner(decoder, counting, options=RunnerOptions(max_new_tokens=NEW_TOKENS, warmup_tokens=2,
                                                                  progress=False))
    rows = runner.run(prompts(), default_settings([]), out, resume=True)
    timed = [c for c in calls[2:]]  # the first two calls are the warm-up
    assert sorted(timed) == ["ar", "ar_again", "ar_again"]  # the finished (loop, ar) row was not re-run
    assert out.read_text().startswith(first)
    runs = [r for r in load_rows(out) if r["kind"] == "run"]
    assert len(runs) == 4 and all(r["check_ar"]["equal"] for r in runs)


def test_repeats_run_interleaved_and_reports_keep_each_methods_median_run(pair, tmp_path):
    order = []

    class Recording(EngineMethod):
        def run(self, prompt, setting, max_new_tokens, eos_token_ids):
            order.append(self.name)
            return super().run(prompt, setting, max_new_tokens, eos_token_ids)

    hf, decoder = pair
    methods = [Recording(n, decoder, lambda: None, EngineOptions(progress=False)) for n in ("ar", "b", "c")]
    runner = BenchRunner(decoder, methods, options=RunnerOptions(max_new_tokens=6, warmup_tokens=2, progress=False,
                                                                 repeats=3))
    out = tmp_path / "r.jsonl"
    rows = runner.run(prompts()[:1], default_settings([]), out)
    assert order[3:] == ["ar", "b", "c", "b", "c", "ar", "c", "ar", "b"]  # after the warm-up: rotated repeats
    runs = [r for r in rows if r["kind"] == "run"]
    assert [(r["method"], r["repeat"]) for r in runs[:3]] == [("ar", 0), ("b", 0), ("c", 0)]
    assert all(r["check_ar"]["equal"] for r in runs)  # every repeat is checked, not only the first

    # The reports keep the median run of each method; a divergence in any repeat is still listed.
    rates = {("b", 0): 10.0, ("b", 1): 30.0, ("b", 2): 20.0, ("ar", 0): 10.0, ("ar", 1): 10.0, ("ar", 2): 10.0,
             ("c", 0): 5.0, ("c", 1): 50.0, ("c", 2): 40.0}
    edited = [r | {"decode_tokens_per_s": rates[(r["method"], r["repeat"])]} if r["kind"] == "run" else r
              for r in rows]
    edited[-1] = edited[-1] | {"check_ar": {"equal": False, "position": 1, "ours": 1, "reference": 2,
                                            "top2_gap": 1.0, "top2_tokens": [2, 1], "near_tie_threshold": 0.1,
                                            "verdict": "MISMATCH"}}
    medians = {r["method"]: r for r in report.median_runs([r for r in edited if r["kind"] == "run"])}
    assert {m: r["decode_tokens_per_s"] for m, r in medians.items()} == {"ar": 10.0, "b": 20.0, "c": 40.0}
    assert medians["b"]["decode_tokens_per_s_repeats"] == [10.0, 30.0, 20.0]
    cells = report.aggregate(edited)
    assert cells[("loop", 34, "greedy", "b")].speedup_ar == [2.0]
    assert len(cells[("loop", 34, "greedy", "c")].rows) == 1
    text = report.markdown(edited, {})
    assert "ran up to 3 times per prompt and setting" in text and "**MISMATCH** b vs our AR" in text

    # Resume with more repeats runs only the new ones.
    order.clear()
    BenchRunner(decoder, methods, options=RunnerOptions(max_new_tokens=6, warmup_tokens=2, progress=False,
                                                        repeats=4)).run(prompts()[:1], default_settings([]), out,
                                                                        resume=True)
    assert order[3:] == ["ar", "b", "c"]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        RunnerOptions(repeats=0)


def test_unavailable_methods_are_listed_not_dropped(pair, tmp_path):
    hf, decoder = pair
    methods, skipped = build_methods(["ar", "hf"], decoder, peer=None)
    assert [m.name for m in methods] == ["ar"]
    assert skipped[0].name == "hf" and "transformers" in skipped[0].reason
    runner = BenchRunner(decoder, methods, skipped=skipped,
                         options=RunnerOptions(max_new_tokens=4, warmup_tokens=2, progress=False))
    rows = runner.run(prompts()[:1], default_settings([]), tmp_path / "r.jsonl")
    assert "- hf: no transformers model" in report.markdown(rows)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        build_methods(["nope"], decoder)


def test_helpers():
    assert distinct_n([1, 2, 1, 2, 1, 2], 2) == 2 / 5
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
