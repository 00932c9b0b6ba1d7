"""The first run's numbers are decoding's own, and nothing is measured before a first
token: one-time work (the load's, a head built inside a round, a forward-cost
measurement) is reported as `setup` by part and never inside the decode times; a
machine without a forward-cost curve decides with the default one while the
measurement waits for a quiet moment, off the decoding thread (issue 64, defect 6).

The clocks are fake where a duration is asserted: no test depends on how fast this
machine is."""

from __future__ import annotations

import json
import threading
import types
from pathlib import Path

import pytest
import torch

import longspec
from longspec.runtime import setup_time
from longspec.runtime.native import bf16_linear_ops
from longspec.speculation import cost_measurement, cost_model
from longspec.speculation.cost_defaults import cpu_kind, slope
from tiny_models import save_checkpoint, tiny_decoder

ONE_TIME_S = 1000.0  # what the fake one-time work takes on the fake clock


class FakeClock:
    """`time` for setup_time: stands still unless a test's one-time work advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(setup_time, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("tiny-gemma3") / "model", family="gemma3", tokenizer_size=None)


@pytest.fixture
def background(monkeypatch):
    """The default policy, as a user's process has it (the suite measures first)."""
    monkeypatch.setattr(cost_measurement, "_policy", "background")
    monkeypatch.setattr(cost_measurement, "_pending", {})
    yield
    cost_measurement.stop()  # no thread outlives the test (it would measure into another test's directory)


def test_one_time_work_inside_a_round_is_setup_not_decoding(checkpoint, fake_clock, monkeypatch):
    """The certified head built at the first decision (as it was before this issue): the
    stats' decode and verify seconds exclude it, `setup` names it."""
    model = longspec.load(checkpoint, dtype="bfloat16")
    model.generate([1, 2, 3], max_new_tokens=2, method="ar")  # the load's setup reported and done with
    model.model._certified_head = False  # built again, this time inside the first round's decision
    original = model.model.__class__.certified_head.fget

    def slow_head(decoder):
        if decoder._certified_head is not False:  # built: a plain read
            return original(decoder)
        with setup_time.one_time("certified_head"):
            fake_clock.now += ONE_TIME_S
            return original(decoder)

    monkeypatch.setattr(type(model.model), "certified_head", property(slow_head))
    result = model.generate([1, 2, 3, 4], max_new_tokens=4, method="ar")
    stats = result.stats
    assert stats.setup["certified_head"] == pytest.approx(ONE_TIME_S)
    assert stats.decode_s == pytest.approx(0.0) and stats.verify_s == pytest.approx(0.0)
    assert stats.to_dict()["setup_s"] == pytest.approx(ONE_TIME_S)


def test_the_loads_one_time_work_is_reported_once_by_the_first_request(checkpoint):
    model = longspec.load(checkpoint, dtype="bfloat16")
    assert "packing" in model.load_setup  # the packed copies, made by every load
    first = model.generate([1, 2, 3], max_new_tokens=2, method="ar").stats
    second = model.generate([1, 2, 3], max_new_tokens=2, method="ar").stats
    assert set(model.load_setup) <= set(first.setup)
    assert not set(model.load_setup) & set(second.setup)


def test_nested_one_time_work_counts_once_under_the_inner_part(fake_clock):
    mark = setup_time.snapshot()
    with setup_time.one_time("outer"):
        fake_clock.now += 2.0
        with setup_time.one_time("inner"):
            fake_clock.now += 3.0
    assert setup_time.since(mark) == {"outer": 2.0, "inner": 3.0}


def test_a_missing_curve_gives_the_default_at_once_and_queues_the_measurement(background, monkeypatch):
    model = tiny_decoder("gemma3", dtype=torch.bfloat16)
    measured_on = []
    real = cost_model.measure_forward_cost

    def measure(*args, **kwargs):
        measured_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_model, "measure_forward_cost", measure)
    monkeypatch.setattr(cost_measurement, "_autostart", False)  # the queue is run below, on this thread
    cost = cost_model.forward_cost_at(model, 40, ks=(1, 2, 4))
    assert cost_model.is_default(cost) and cost.key["default"] == cpu_kind(model)
    assert measured_on == [] and cost_measurement.pending() == 1
    assert cost.relative(4) == pytest.approx(1 + 3 * slope(cpu_kind(model), cost.key["context"]))
    # A second lookup queues nothing more; `longspec doctor` runs the queue on its own thread.
    cost_model.forward_cost_at(model, 40, ks=(1, 2, 4))
    assert cost_measurement.pending() == 1
    assert cost_measurement.measure_pending() == 1 and len(measured_on) == 1
    assert not cost_model.is_default(cost_model.forward_cost_at(model, 40, ks=(1, 2, 4)))


def test_the_background_thread_measures_and_the_next_lookup_uses_it(background):
    model = tiny_decoder("qwen3", dtype=torch.bfloat16)
    assert cost_model.is_default(cost_model.forward_cost_at(model, 50, ks=(1, 3)))
    thread = cost_measurement._thread
    assert thread is not None and thread is not threading.current_thread()
    for _ in range(600):  # bounded: the measurement of a tiny model takes well under a second
        if cost_measurement.pending() == 0:
            break
        threading.Event().wait(0.1)
    assert cost_measurement.pending() == 0
    assert not cost_model.is_default(cost_model.forward_cost_at(model, 50, ks=(1, 3)))


def test_a_round_during_a_background_measurement_times_that_size_again(monkeypatch):
    """A decoding round between two of the measurement's forwards: the forwards of that
    size are timed again once the process is quiet, so a curve timed beside decoding is
    never kept."""
    forwards, asked = [], []
    answers = iter([False, True, False, False, False])

    def pause() -> bool:
        asked.append(len(forwards))
        return next(answers)

    best = cost_model._best_time(lambda: forwards.append(1), lambda: None, torch.device("cpu"), repeats=2,
                                 clock=iter(range(100)).__next__, pause=pause)
    assert len(forwards) == 5  # 2 before the round (discarded), then a warm-up and 2 repeats
    assert best == 1


def test_pausing_waits_only_on_the_background_thread():
    cost_measurement.note_round()
    assert cost_measurement.pause_while_decoding() is False  # the caller's own measurement ("now", doctor)


@pytest.mark.skipif(bf16_linear_ops() is None, reason="the certified head needs the native bf16 kernels")
def test_a_batch_with_a_new_row_count_measures_nothing_on_the_decoding_thread(checkpoint, background, monkeypatch):
    """Issue 64, defect 6: the first request with n = 8 measured the batched forward cost
    on the generation thread (48 s on a fresh cache). Now the batch decides with the
    default and the measurement is left to the background thread."""
    model = longspec.load(checkpoint, dtype="bfloat16")
    calls = []
    monkeypatch.setattr(cost_model, "measure_batch_forward_cost",
                        lambda *a, **k: calls.append(threading.current_thread().name) or pytest.fail("measured"))
    monkeypatch.setattr(cost_model, "measure_forward_cost",
                        lambda *a, **k: calls.append(threading.current_thread().name) or pytest.fail("measured"))
    monkeypatch.setattr(cost_measurement, "_autostart", False)  # nothing measures: the queue is only looked at
    results = model.generate_batch([[1, 2, 3, 1, 2, 3]] * 4, max_rows=4, max_new_tokens=6, method="auto", seed=0)
    assert calls == []
    assert cost_measurement.pending() >= 1
    single = model.generate([1, 2, 3, 1, 2, 3], max_new_tokens=6, method="ar")
    assert all(r.token_ids == single.token_ids for r in results)  # greedy rows: exact whatever the curve


def test_the_servers_metrics_show_the_processes_one_time_work():
    pytest.importorskip("prometheus_client")
    from longspec.serve.metrics import ServerMetrics

    with setup_time.one_time("a_test_part"):
        pass
    text = ServerMetrics().exposition().decode()
    assert 'longspec:setup_seconds_total{part="a_test_part"}' in text


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("tiny-gemma3-text") / "model", family="gemma3")


def test_generate_reports_setup_apart_in_json_and_in_its_line(checkpoint_with_tokenizer, capsys):
    from longspec.cli.main import main

    args = ["generate", "abcabc", "--model", str(checkpoint_with_tokenizer), "--max-new-tokens", "4", "--method", "ar"]
    assert main(args + ["--json"]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.out)["stats"]
    assert stats["setup_s"] == pytest.approx(sum(stats["setup"].values())) and "packing" in stats["setup"]
    assert out.err == ""  # nothing but the JSON under --json
    assert main(args) == 0
    assert "| setup " in capsys.readouterr().err
    assert main(args + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_doctor_reports_what_this_machine_uses_and_measures_what_is_missing(checkpoint, capsys, tmp_path,
                                                                             monkeypatch):
    from longspec.cli.main import main

    # Its own curves: the head's measured choice must not reach other tests' loads of this model.
    monkeypatch.setattr(cost_model, "default_directory", lambda: tmp_path)
    assert main(["doctor", "--model", str(checkpoint), "--rows", "2", "--context", "32"]) == 0
    out = capsys.readouterr().out
    for line in ("instruction sets:", "kernels:", "certified head:", "forward cost (measured", "2 rows", "cache:"):
        assert line in out, out
    if bf16_linear_ops() is not None:
        assert "measured here: a decode step" in out  # the head's choice, from both curves
    assert main(["doctor", "--no-build"]) == 0
    assert "cache:" in capsys.readouterr().out


@pytest.mark.skipif(bf16_linear_ops() is None, reason="the certified head needs the native bf16 kernels")
@pytest.mark.parametrize("full_over_certified,forced,on", [(0.5, None, False), (1.2, None, True), (0.5, "1", True)])
def test_the_certified_head_is_on_where_it_measured_faster(checkpoint, tmp_path, monkeypatch, full_over_certified,
                                                            forced, on):
    """Both heads give the same tokens; the load keeps the one this machine measured faster
    (the curves `longspec doctor` caches), unless LONGSPEC_CERTIFIED_HEAD says otherwise."""
    from longspec.runtime.certified_head import DISABLE_VARIABLE, GROUP
    from longspec.runtime.machine import machine_identity

    monkeypatch.setattr(cost_model, "default_directory", lambda: tmp_path)
    if forced is None:
        monkeypatch.delenv(DISABLE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(DISABLE_VARIABLE, forced)
    decoder = longspec.load(checkpoint, dtype="bfloat16").model
    assert decoder.certified_head is not None
    bucket = cost_model._bucket(decoder, 1, max(cost_model.DEFAULT_KS))
    key = cost_model.cost_key(decoder, bucket, machine_identity())
    for head, seconds in ((f"certified/{GROUP}", 1.0), ("full", full_over_certified)):
        cost = cost_model.ForwardCost({**key, "head": head}, (1, 2), (seconds, 2 * seconds))
        cost_model._path(cost.key, tmp_path).write_text(cost.to_json())
    assert cost_model.certified_head_gain(decoder) == pytest.approx(full_over_certified)
    assert (longspec.load(checkpoint, dtype="bfloat16").model.certified_head is not None) == on


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# Curves recorded on AVX-512 BF16 with the kernels in use since the tiled product; AVX2's at 2k
# context (docs/lab-notes/forward-cost.md, "The forward-cost steps with the products' row tiles"), ms by tokens.
AVX512_RESULTS = ("2026-11-25-forward_cost-tiled/forward_cost-tiled.jsonl",
                  "2026-11-25-forward_cost-fewquery/forward_cost-fewquery.jsonl",
                  "2026-11-25-forward_cost-ordered/forward_cost-ordered.jsonl",
                  "2026-11-26-forward_cost-dense/forward_cost-dense.jsonl")
AVX2_AT_2K = [dict(zip((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 24), ms)) for ms in (
    (33, 37, 45, 51, 59, 66, 94, 86, 93, 92, 99, 100, 139, 122, 117, 122, 159, 177),
    (25, 33, 38, 42, 54, 57, 87, 76, 99, 81, 93, 102, 126, 123, 134, 124, 155, 170))]


def recorded_curves():
    """(kind, context, {k: relative cost}) of every recorded curve."""
    for name in AVX512_RESULTS:
        curves = {}
        for line in (RESULTS / name).read_text().splitlines()[1:]:
            row = json.loads(line)
            if "relative" in row:
                curves.setdefault((row["context"], row.get("shape")), {})[row["k"]] = row["relative"]
        for (context, _), curve in curves.items():
            yield "avx512-bf16", context, curve
    for ms in AVX2_AT_2K:
        yield "avx2", 2048, {k: t / ms[1] for k, t in ms.items()}


def test_the_default_curve_prices_trees_at_or_above_every_recorded_curve():
    """Dear, never cheap: `auto` on the default speculates less than on the measured curve, so
    the default cannot make it verify nodes that do not pay (the realised-cost correction
    scales the level only)."""
    checked = 0
    for kind, context, curve in recorded_curves():
        for k, relative in curve.items():
            assert 1 + slope(kind, context) * (k - 1) >= relative, (kind, context, k, relative)
            checked += 1
    assert checked > 50


def test_a_cli_run_uses_the_default_curve_and_measures_nothing_in_its_process(monkeypatch, tmp_path):
    """Under "later" (`longspec generate`) a missing curve gives the default and starts no
    thread: a CLI run's only quiet moment is its exit, which would wait for the forward."""
    monkeypatch.setattr(cost_measurement, "_policy", "later")
    monkeypatch.setattr(cost_measurement, "_pending", {})
    monkeypatch.setattr(cost_measurement, "_thread", None)
    monkeypatch.setattr(cost_model, "default_directory", lambda: tmp_path)  # no curve measured yet
    model = tiny_decoder("gemma3", dtype=torch.bfloat16)
    monkeypatch.setattr(cost_model, "measure_forward_cost", lambda *a, **k: pytest.fail("measured"))
    cost = cost_model.forward_cost_at(model, 40, ks=(1, 2, 4))
    assert cost_model.is_default(cost)
    assert cost_measurement.pending() == 0 and cost_measurement._thread is None


def test_the_cli_defers_a_missing_curve_unless_a_policy_was_chosen(checkpoint_with_tokenizer, monkeypatch):
    from longspec.cli.main import main

    args = ["generate", "abc", "--model", str(checkpoint_with_tokenizer), "--max-new-tokens", "2", "--method", "ar",
            "--quiet"]
    monkeypatch.delenv(cost_measurement.VARIABLE, raising=False)
    monkeypatch.setattr(cost_measurement, "_policy", None)  # nothing chosen, as in a user's `longspec generate`
    assert main(args) == 0 and cost_measurement.policy() == "later"
    monkeypatch.setattr(cost_measurement, "_policy", "now")  # chosen by the caller (here, the suite)
    assert main(args) == 0 and cost_measurement.policy() == "now"
    monkeypatch.setattr(cost_measurement, "_policy", None)
    monkeypatch.setenv(cost_measurement.VARIABLE, "background")  # chosen in the environment
    assert main(args) == 0 and cost_measurement.policy() == "background"
