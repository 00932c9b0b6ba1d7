"""The GPU check script stays runnable: a smoke run on the CPU with a tiny shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "device" / "gpu_check.py"


def test_gpu_check_smoke_run_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check"
    assert gpu_check.main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--skip-tests", "--prompt-tokens", "32",
                           "--new-tokens", "12", "--batch-sizes", "1", "2", "--contexts", "64", "--ks", "1", "8", "--repeats", "1",
                           "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert rows[0]["oracle_tau"] > 1 and set(rows[0]["forward_seconds"]["64"]) == {"1", "8"}
    assert set(rows[0]["batch_tokens_per_s"]) == {"1", "2"} and min(rows[0]["batch_tokens_per_s"].values()) > 0
    batch_auto = rows[0]["batch_auto"]["2"]
    assert set(batch_auto) == {"ar", "auto over garbage", "auto over garbage, asked every round"}
    assert min(batch_auto.values()) > 0
    auto = rows[0]["auto"]
    assert all(run["equal"] for run in auto.values())  # float32 on the CPU: every method's tokens are AR's
    # Garbage is uniform over the tiny shape's 512 tokens: a node matches now and then by chance.
    assert auto["auto over the oracle"]["tau"] > 1 and auto["auto over garbage"]["realised_accepted_per_round"] < 0.5
    table = (out / "results.md").read_text()
    assert "oracle chain" in table and "auto over garbage" in table
