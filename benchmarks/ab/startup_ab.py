"""Warm starts of two source trees in turns (issue 65's goals): `import longspec` +
`load()` + the first token in Python, the CLI's one-token `generate` wall time, and a
`longspec serve` process's first token after it was started. Each tree runs with its own
caches (`LONGSPEC_CACHE`, `TORCH_EXTENSIONS_DIR` under --cache), warmed once first, so
both read everything cached. Runs alternate A, B, B, A, ... to spread the machine's load.

    python benchmarks/ab/startup_ab.py --a /tmp/ls_A --b /tmp/ls_B --pairs 3 \
        --out benchmarks/results/2026-11-29-instant-start/startup_ab.jsonl

--a / --b: repository roots (a `git worktree` each); their `src` is put first on PYTHONPATH.
Prints each run, each measure's median per tree and the ratio A / B (above 1: B is faster),
with the 1-minute load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = "def fib(n):"
PYTHON_RUN = """
import json, sys, time
t0 = time.perf_counter()
import longspec
t1 = time.perf_counter()
model = longspec.load()
t2 = time.perf_counter()
model.generate({prompt!r}, max_new_tokens=1)
t3 = time.perf_counter()
print("RESULT" + json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2,
                            "python_total_s": t3 - t0, "transformers_imported": "transformers" in sys.modules,
                            "module": longspec.__file__}}))
"""


def environment(tree: Path, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(tree / "src"), LONGSPEC_CACHE=str(cache / "longspec"),
               TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def python_run(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PYTHON_RUN.format(prompt=PROMPT)], env=env, capture_output=True,
                          text=True, timeout=1800, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def cli_run(env: dict[str, str]) -> dict:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longspec.cli.main", "generate", PROMPT, "--max-new-tokens", "1"], env=env,
                   capture_output=True, text=True, timeout=1800, check=True)
    return {"cli_wall_s": time.perf_counter() - start}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_run(env: dict[str, str]) -> dict:
    """Seconds from starting `longspec serve` to its first completion token (polling)."""
    port = free_port()
    start = time.perf_counter()
    command = [sys.executable, "-m", "longspec.cli.main", "serve", "--port", str(port), "--served-model-name", "default"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = json.dumps({"model": "default", "prompt": PROMPT, "max_tokens": 1}).encode()
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"longspec serve exited with {server.returncode}")
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    if response.status == 200:
                        json.loads(response.read())
                        return {"server_first_token_s": time.perf_counter() - start}
            except (OSError, ValueError):
                time.sleep(0.05)
            if time.perf_counter() - start > 1800:
                raise RuntimeError("no first token in 30 minutes")
    finally:
        server.terminate()
        server.wait(timeout=60)


def one_run(env: dict[str, str]) -> dict:
    load = os.getloadavg()[0]
    return {"load_1min": load, **python_run(env), **cli_run(env), **server_run(env)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="repository root of the before tree")
    parser.add_argument("--b", type=Path, required=True, help="repository root of the after tree")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/longspec-startup-ab"), help="per-tree caches")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON lines of every run")
    args = parser.parse_args()
    envs = {"A": environment(args.a, args.cache / "A"), "B": environment(args.b, args.cache / "B")}
    for name, env in envs.items():  # conversion, kernels, the head's copy: paid here, outside the runs
        print(f"warming {name}: {python_run(env)}", flush=True)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    order = [name for i in range(args.pairs) for name in (("A", "B") if i % 2 == 0 else ("B", "A"))]
    for name in order:
        run = one_run(envs[name])
        runs[name].append(run)
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as out:
                out.write(json.dumps({"tree": name, **run}) + "\n")
    for key in ("import_s", "load_s", "first_token_s", "python_total_s", "cli_wall_s", "server_first_token_s"):
        a, b = (statistics.median(r[key] for r in runs[n]) for n in ("A", "B"))
        print(f"{key:22s} A {a:7.2f}  B {b:7.2f}  A/B {a / b:5.2f}")
    loads = [r["load_1min"] for rs in runs.values() for r in rs]
    print(f"1-minute load average during the runs: {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
