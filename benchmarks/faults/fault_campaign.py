"""SIGKILL at random instants of the long-running jobs, restarted until they finish:
every run must end at the state of an uninterrupted run (the same weights, the same
result rows), and nothing committed may be lost along the way.

    python benchmarks/faults/fault_campaign.py --kills 10 --out benchmarks/results/$(date +%F)-fault-campaign
    python benchmarks/faults/fault_campaign.py --jobs bench --kills 3          # one job, a few kills

Jobs run the real command line (`longspec train longspec|mamba|tokenswift|responses`,
`longspec bench --resume`) on a tiny random checkpoint with float32 weights, so that
restarts compare bit for bit. A kill lands at a random instant of a run (loading,
tokenizing, training, writing a checkpoint); the job is then started again with the
same arguments (`--resume` where the command asks for it) until it exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

CORPUS = "the quick brown fox jumps over the lazy dog. " * 60 + "def add(a, b):\n    return a + b\n" * 40


def prepare(root: Path) -> dict:
    """A tiny checkpoint, a corpus and a task file shared by every job."""
    from tiny_models import save_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    checkpoint = root / "target"
    if not (checkpoint / "config.json").is_file():
        save_checkpoint(checkpoint, family="llama", max_position_embeddings=2048)
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS)
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": str(i), "prompt": f"the quick brown fox {i} jumps over",
                                         "response": ""}) + "\n" for i in range(6)))
    return {"checkpoint": checkpoint, "corpus": corpus, "tasks": tasks}


def jobs(files: dict, steps: int = 8) -> dict:
    """name -> (argv without --out, the artifacts compared, whether restarts pass --resume)."""
    model = ["--model", str(files["checkpoint"]), "--dtype", "float32", "--threads", "1"]
    training = model + ["--corpus", str(files["corpus"]), "--heldout", "0", "--seq-len", "32", "--batch-size", "2",
                        "--save-every", "2"]
    return {
        "train-longspec": (["train", "longspec", *training, "--steps", str(steps), "--layers", "1", "--no-warm-start"],
                           ["draft.safetensors", "draft.json", "trainer_state.pt"], False),
        "train-mamba": (["train", "mamba", *training, "--steps", str(steps), "--hidden-size", "32", "--layers", "2",
                         "--draft-vocab", "40"], ["model.safetensors", "trainer_state.pt"], False),
        "train-tokenswift": (["train", "tokenswift", *model[:4], "--data", str(files["corpus"]), "--steps", str(steps),
                              "--seq-len", "32", "--batch-size", "2", "--eval-every", "2"],
                             ["heads.safetensors", "trainer_state.pt"], True),
        "train-responses": (["train", "responses", *model, "--corpus", str(files["corpus"]), "--heldout", "0",
                             "--prompts", "8", "--excerpt-tokens", "64", "--max-new-tokens", "24"], ["responses.jsonl"], False),
        "bench": (["bench", *model, "--tasks", f"jsonl={files['tasks']}", "--methods", "ar", "pld",
                   "--max-new-tokens", "24", "--no-plots", "--no-chat"], ["results.jsonl"], True),
    }


def digest(run: Path, names: list[str]) -> dict:
    """What must equal an uninterrupted run: the artifacts' bytes, or for result logs
    their rows without timings."""
    out = {}
    for name in names:
        path = run / name
        if name.endswith(".jsonl"):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            keep = [{k: v for k, v in row.items() if k in ("kind", "id", "task", "method", "setting", "tokens",
                                                           "token_ids", "text", "item_id", "response")}
                    for row in rows if row.get("kind", "run") != "header"]
            out[name] = hashlib.sha256(json.dumps(sorted(keep, key=json.dumps), sort_keys=True).encode()).hexdigest()
        elif name.endswith(".pt"):  # torch.save's bytes vary from run to run; its values must not
            out[name] = _canonical_digest(torch.load(path, weights_only=True, map_location="cpu"))
        elif name.endswith(".safetensors"):  # the header's metadata order varies; tensors and metadata must not
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                out[name] = _canonical_digest({"tensors": {k: f.get_tensor(k) for k in f.keys()},
                                               "metadata": f.metadata()})
        else:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _canonical_digest(value) -> str:
    digest = hashlib.sha256()

    def visit(item) -> None:
        if isinstance(item, torch.Tensor):
            digest.update(str((item.dtype, tuple(item.shape))).encode())
            digest.update(item.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if item.numel() else b"")
        elif isinstance(item, dict):
            for key in sorted(item, key=repr):
                digest.update(repr(key).encode())
                visit(item[key])
        elif isinstance(item, (list, tuple)):
            for element in item:
                visit(element)
        else:
            digest.update(repr(item).encode())

    visit(value)
    return digest.hexdigest()


def command(argv: list[str], out: Path) -> list[str]:
    flag = "--out"
    return [sys.executable, "-m", "longspec.cli.main", *argv, flag, str(out)]


def run_to_end(argv: list[str], out: Path, resume: bool, kills: int, rng: random.Random, budget_s: float) -> dict:
    """Run, killing it `kills` times at random instants within the first `budget_s`, and
    restart until it exits 0. Returns what happened."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    restarts, killed = 0, 0
    first = True
    while True:
        args = command(argv + (["--resume"] if resume and not first else []), out)
        process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = False
        if killed < kills:
            try:  # past the imports (~3 s) most kills land in the work itself
                process.wait(timeout=rng.uniform(0.5, budget_s))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
                killed += 1
                restarts += 1
                continue
        _, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {process.returncode}: {err.strip()[-2000:]}")
        return {"kills": killed, "restarts": restarts}


def campaign(job_names: list[str], kills: int, root: Path, seed: int = 0, steps: int = 8) -> list[dict]:
    files = prepare(root / "inputs")
    table = jobs(files, steps)
    rows = []
    for name in job_names:
        argv, artifacts, resume = table[name]
        reference = root / f"{name}-reference"
        start = time.monotonic()
        run_to_end(argv, reference, resume, 0, random.Random(seed), 0)
        uninterrupted_s = time.monotonic() - start
        killed = root / f"{name}-killed"
        # Kills land within the first half of a full run: every restart still has work left to interrupt.
        result = run_to_end(argv, killed, resume, kills, random.Random(seed), max(uninterrupted_s / 2, 1.0))
        same = digest(reference, artifacts) == digest(killed, artifacts)
        rows.append({"job": name, **result, "uninterrupted_s": round(uninterrupted_s, 1), "same_final_state": same})
        print(f"{name:18s} kills {result['kills']:3d}  same final state: {same}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", default=["train-longspec", "train-mamba", "train-tokenswift",
                                                       "train-responses", "bench"])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each training job (longer runs take "
                                                              "more kills before they finish)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/longspec-fault-campaign"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = campaign(args.jobs, args.kills, args.work, args.seed, args.steps)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    sys.exit(0 if all(row["same_final_state"] for row in rows) else 1)


if __name__ == "__main__":
    main()
