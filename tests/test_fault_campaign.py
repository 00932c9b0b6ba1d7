"""SIGKILL at random instants of every long job (`train longspec|mamba|tokenswift|
responses`, `bench --resume`), restarted until each finishes: each ends at the state of
an uninterrupted run (benchmarks/faults/fault_campaign.py; the recorded campaign kills
each job ten times)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

CAMPAIGN = Path(__file__).resolve().parents[1] / "benchmarks" / "faults" / "fault_campaign.py"


def load_campaign():
    spec = importlib.util.spec_from_file_location("fault_campaign", CAMPAIGN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JOBS = ["train-longspec", "train-mamba", "train-tokenswift", "train-responses", "bench"]


@pytest.mark.parametrize("job", JOBS)
def test_a_killed_job_ends_at_the_uninterrupted_state(tmp_path, job):
    (row,) = load_campaign().campaign([job], kills=2, root=tmp_path, seed=JOBS.index(job), steps=12)
    assert row["same_final_state"], row
