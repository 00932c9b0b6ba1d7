"""The paper-scale GPU script stays runnable (a CPU run at a tiny shape, the same code
path) and its controlled-acceptance drafter accepts what it promises."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "device" / "paper_scale.py"


@pytest.fixture(scope="module")
def paper_scale():
    spec = importlib.util.spec_from_file_location("paper_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_scale_runs_on_the_cpu_at_a_tiny_shape(paper_scale, tmp_path):
    out = tmp_path / "run"
    code = paper_scale.main(["--device", "cpu", "--dtype", "float32", "--main-shape", "tiny", "--shapes", "tiny",
                             "--contexts", "64", "128", "--long-context", "256", "--ks", "1", "4", "8",
                             "--new-tokens", "12", "--batch-sizes", "1", "2", "--partial-budget", "128",
                             "--draft-vocab", "256", "--repeats", "1", "--compile-backend", "none",
                             "--bandwidth-mb", "8", "--out", str(out)])
    sections = {line["section"]: line["value"] for line in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert code == 0, {name: value for name, value in sections.items() if "error" in value}
    assert set(sections) >= {"ceilings", "tree attention", "verification", "AR eager", "self-drafting", "longspec draft",
                             "oracle eager", "compiled", "transformers compiled", "transformers eager", "shape tiny"}
    attention = sections["tree attention"]["128"]
    assert attention["sdpa_prefix_tree_merged_max_abs_error"] < 1e-5  # float32: the merge is exact to rounding
    for kernel in ("triton_tree_kernel", "triton_split_kernel"):  # through Triton's interpreter here (conftest)
        assert attention[kernel + "_max_abs_error"] < 1e-5
    assert set(sections["verification"]["128"]) == {"chain", "tree"}
    for context in ("64", "128"):
        assert sections["AR eager"][context]["tokens_per_s"] > 0 and sections["AR eager"][context]["floor_tokens_per_s"] > 0
        # float32 on the CPU: the static steps decode exactly what the eager forward does
        assert sections["compiled"]["ar"][context]["tokens"] == sections["AR eager"][context]["tokens"]
    assert sections["compiled"]["static_calls"] > 0 and sections["compiled"]["failure"] is None
    assert set(sections["self-drafting"]) == {"128", "256"}
    assert sections["longspec draft"]["draft_forward_ms"] > 0
    oracle = sections["oracle eager"]
    assert set(oracle) == {"1", "2"}
    single = oracle["1"]
    for alpha in (0.6, 0.8):
        assert single[f"alpha {alpha} chain"]["tokens_equal_ar"] == 1.0  # lossless, whatever the drafter proposes
        assert single[f"alpha {alpha} tree"]["tau"] > 1 and single[f"alpha {alpha} chain"]["tau"] > 1
    assert sections["transformers compiled"]["64"]["tokens_per_s"] > 0
    table = (out / "results.md").read_text()
    assert "Triton" in table and "Controlled-acceptance oracle" in table and "tiny" in table


@pytest.mark.parametrize("alpha", [0.6, 0.8])
def test_the_controlled_drafter_proposes_the_true_token_at_rate_alpha(paper_scale, alpha):
    """Over 4,000 first candidates the share of true ones is alpha within 4 standard
    errors, and a chain's accepted length averages sum(alpha^i) within 4 errors."""
    from longspec.speculation.drafters.base import DraftContext

    length, rounds = 8, 500
    reference = list(range(100, 100 + length))
    drafter = paper_scale.ControlledAcceptanceDrafter(reference, 1, alpha, length, vocab_size=1000, seed=3)
    context = DraftContext(tokens=torch.tensor([7]))
    accepted = []
    for _ in range(rounds):
        tree = drafter.propose(context)
        tokens = tree.tokens[1:].tolist()
        accepted.append(next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens)))
    share = drafter.true_proposed / drafter.proposed
    assert abs(share - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / drafter.proposed)
    expected = sum(alpha ** i for i in range(1, length + 1))
    spread = torch.tensor(accepted, dtype=torch.float64).std().item()
    assert abs(sum(accepted) / rounds - expected) < 4 * spread / math.sqrt(rounds)


def test_the_controlled_tree_holds_the_true_token_at_rate_one_minus_miss_squared(paper_scale):
    alpha, length, rounds = 0.6, 1, 4000
    drafter = paper_scale.ControlledAcceptanceDrafter([42], 1, alpha, length, width=2, vocab_size=1000, seed=5)
    from longspec.speculation.drafters.base import DraftContext

    hits = 0
    for _ in range(rounds):
        tree = drafter.propose(DraftContext(tokens=torch.tensor([7])))
        assert tree.size == 3 and tree.parents.tolist() == [-1, 0, 0]
        hits += 42 in tree.tokens[1:].tolist()
    expected = 1 - (1 - alpha) ** 2
    assert abs(hits / rounds - expected) < 4 * math.sqrt(expected * (1 - expected) / rounds)
