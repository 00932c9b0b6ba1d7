"""`longspec bench` from the command line on a tiny checkpoint (token-id tasks)."""

from __future__ import annotations

import json

import torch

import longspec
from longspec.api import LongSpecModel
from longspec.cli.main import main
from longspec.runtime.loading import LoadedTarget
from tiny_models import decoder_from_hf, random_ids, tiny_hf_model


def test_cli_runs_reports_and_resumes(tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "tiny"
    hf = tiny_hf_model("llama", dtype=torch.float32)
    hf.save_pretrained(checkpoint)  # the transformers peer loads from here

    def load_tiny(model, dtype, device=None, compile=False):  # the checkpoint has no tokenizer, which the real loader requires
        assert device is None  # --device was not given
        return LongSpecModel(LoadedTarget(decoder_from_hf(hf), None, hf.config, str(model)))

    monkeypatch.setattr(longspec, "load", load_tiny)
    tasks = tmp_path / "ids.jsonl"
    looping = torch.cat([random_ids(5, seed=4)[0].repeat(6), random_ids(3, seed=5)[0]])
    tasks.write_text(json.dumps({"id": "loop", "prompt_ids": looping.tolist()}) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--model", str(checkpoint), "--dtype", "float32", "--tasks", f"jsonl={tasks}", "--methods", "ar",
            "pld", "hf", "--max-new-tokens", "12", "--seeds", "0", "--out", str(out), "--threads", "1"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "run" for r in rows) == 6  # 1 prompt × (greedy + 1 seed) × 3 methods
    assert all(r["check_ar"]["equal"] and r["check_hf"]["equal"] for r in rows if r.get("setting") == "greedy")
    assert "| method | ids |" in (out / "report.md").read_text()
    assert (out / "tau_by_method.png").is_file()
    assert "pld" in capsys.readouterr().out  # the summary table
    before = (out / "results.jsonl").read_text()
    assert main(argv + ["--resume"]) == 0
    assert (out / "results.jsonl").read_text() == before  # nothing left to run
    (out / "report.md").unlink()
    assert main(["bench", "--out", str(out), "--report-only", "--no-plots"]) == 0
    assert (out / "report.md").is_file()


def test_cli_fails_before_loading_on_bad_task_files(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x"}\n')
    assert main(["bench", "--model", str(tmp_path / "missing"), "--tasks", f"lcc={bad}"]) == 2
    assert f"{bad}:1: missing key 'input'" in capsys.readouterr().err
    assert main(["bench", "--tasks", "bogus"]) == 2
    assert "unknown task 'bogus'" in capsys.readouterr().err


def test_method_options_parse():
    from longspec.cli.bench import parse_method_options

    assert parse_method_options(["pld.num_tokens=5", "longspec.checkpoint=/x/y", "pld.max_candidates=2"]) == {
        "pld": {"num_tokens": 5, "max_candidates": 2}, "longspec": {"checkpoint": "/x/y"}}
    import pytest

    with pytest.raises(ValueError, match="METHOD.KEY=VALUE"):
        parse_method_options(["pld=5"])
