"""The README's first command on a fresh clone, as a new user meets it: empty model cache and
kernel builds, the clone's own code, timed from outside to the first byte of generated text; then
the same command again, to compare the decode rates the two runs report.

    git clone -q . /tmp/fresh_clone && python benchmarks/ab/fresh_start.py /tmp/fresh_clone \
        > benchmarks/results/$(date +%F)-instant-start/fresh_clone.jsonl

Run it after the install (the issue's clock starts when `pip install` ends), on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

COMMAND = ["generate", "def quicksort(items):", "--max-new-tokens", "128"]


def one_run(clone: str, env: dict[str, str], run: int) -> dict:
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "longspec.cli.main", *COMMAND], env=env, cwd=clone,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = None
    while process.stdout.read(1):
        if first is None:
            first = time.perf_counter() - start
    errors = process.stderr.read().decode()
    process.wait()
    stats = [line for line in errors.splitlines() if "decode" in line and "tok/s" in line]
    return {"run": run, "returncode": process.returncode, "first_token_s": first, "wall_s": time.perf_counter() - start,
            "stats": stats[-1] if stats else errors[-500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clone", help="a fresh clone of the repository")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="fresh-caches-")
    env = {**os.environ, "PYTHONPATH": os.path.join(args.clone, "src"), "LONGSPEC_CACHE": f"{scratch}/longspec",
           "TORCH_EXTENSIONS_DIR": f"{scratch}/torch_extensions"}
    try:
        for run in (1, 2):
            print(json.dumps(one_run(args.clone, env, run)), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
