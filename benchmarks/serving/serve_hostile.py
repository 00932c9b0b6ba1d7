"""The hostile requests of tests/hostile.py against a `longspec serve` process: each
one's status and seconds, the server's resident memory after it, and a greedy stream
sent beside it that must get exactly the text it gets alone.

    python benchmarks/serving/serve_hostile.py --out benchmarks/results/$(date +%F)-serve-hostile   # starts a server (Gemma 3 270M)
    python benchmarks/serving/serve_hostile.py --url http://127.0.0.1:8000 --pid PID    # a server started with SERVER_FLAGS

Prints a markdown table and fails (exit 1) on a wrong status, a changed neighbour, a
response naming a server path, memory above --max-rss-mib, or a /health answer slower
than --max-health-ms while any case runs (the event loop must never stall). Then
schemathesis, driven by the served OpenAPI document, sends --schema-examples generated
requests per route and fails on any 5xx or any response outside the document.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import shutil
import threading

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from hostile import BODY_LIMIT, BODY_TIMEOUT_S, CASES, MODEL, PROMPT_LIMIT, reveals_server_paths, send  # noqa: E402

SERVER_FLAGS = ["--served-model-name", MODEL, "--max-prompt-tokens", str(PROMPT_LIMIT), "--max-body-bytes",
                str(BODY_LIMIT), "--body-timeout", str(BODY_TIMEOUT_S), "--max-new-tokens", "256", "--method", "pld"]
NEIGHBOUR = {"model": MODEL, "prompt": "def fibonacci(n):\n    ", "max_tokens": 48, "temperature": 0, "stream": True}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stream(url: str) -> tuple[str, bool]:
    text, done = [], False
    with httpx.stream("POST", url + "/v1/completions", json=NEIGHBOUR, timeout=120) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return f"ERROR {event}", False
                text.append(event["choices"][0]["text"])
    return "".join(text), done


class HealthWatch:
    """/health polled from a thread while a case runs: the slowest answer, in ms."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest_ms, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                client.get(self.url + "/health")
                self.slowest_ms = max(self.slowest_ms, (time.monotonic() - start) * 1000)
                self._stop.wait(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# Rules across fields that the document's JSON Schema does not spell (top_logprobs needs
# logprobs, exactly one structured output, max_tokens 0 only with echo, the served
# model's name) make some schema-valid bodies a 400: schemathesis's check that every
# schema-valid body is accepted is left out; every other check runs.
SCHEMA_CHECKS = ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]


def schema_run(url: str, examples: int, out: Path | None) -> bool:
    """schemathesis against the served document; True when it found nothing."""
    command = shutil.which("schemathesis")
    if command is None:
        print("schemathesis is not installed (pip install schemathesis): the document-driven run is skipped")
        return True
    report = [] if out is None else ["--report", "junit", "--report-dir", str(out)]
    result = subprocess.run([command, "run", url + "/openapi.json", *SCHEMA_CHECKS, "--max-examples", str(examples),
                             "--request-timeout", "300", *report], capture_output=True, text=True)
    print(result.stdout[-4000:])
    return result.returncode == 0


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "longspec.cli.main", "serve", "--port", str(port), *SERVER_FLAGS])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (started with SERVER_FLAGS)")
    parser.add_argument("--pid", type=int, default=None, help="its process id, for its memory")
    parser.add_argument("--max-rss-mib", type=float, default=4096)
    parser.add_argument("--max-health-ms", type=float, default=100.0)
    parser.add_argument("--schema-examples", type=int, default=10, help="generated requests per route (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    process = None
    if args.url is None:
        process, url = start_server()
        pid = process.pid
    else:
        url, pid = args.url, args.pid
    try:
        expected, done = stream(url)
        assert done, expected
        baseline = rss_mib(pid) if pid else float("nan")
        rows, failures = [], 0
        for case in CASES:
            with concurrent.futures.ThreadPoolExecutor(1) as pool, HealthWatch(url) as health:
                neighbour = pool.submit(stream, url)
                status, text, seconds = send(url, case, timeout_s=120)
                streamed, finished = neighbour.result(timeout=300)
            row = {"case": case.name, "expected": case.status, "status": status, "seconds": round(seconds, 3),
                   "health_ms": round(health.slowest_ms, 1),
                   "rss_mib": round(rss_mib(pid), 1) if pid else None, "neighbour_exact": finished and streamed == expected,
                   "reveals": reveals_server_paths(text), "message": text[:200]}
            ok = (status == case.status and row["neighbour_exact"] and not row["reveals"]
                  and row["health_ms"] <= args.max_health_ms
                  and (row["rss_mib"] is None or row["rss_mib"] <= args.max_rss_mib))
            failures += not ok
            rows.append({**row, "ok": ok})
        print(f"server {url}; resident memory at start {baseline:.0f} MiB, bound {args.max_rss_mib:.0f} MiB\n")
        print("| request | status (expected) | seconds | slowest /health ms | server RSS MiB | neighbour exact | ok |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['case']} | {row['status']} ({row['expected']}) | {row['seconds']:.2f} | {row['health_ms']} | "
                  f"{row['rss_mib']} | {row['neighbour_exact']} | {'yes' if row['ok'] else 'NO'} |")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            with (args.out / "results.jsonl").open("w") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")
        print(f"\n{len(rows) - failures} of {len(rows)} hostile requests answered as expected")
        schema_clean = args.schema_examples == 0 or schema_run(url, args.schema_examples, args.out)
        print(f"document-driven run: {'no 5xx, no response outside the document' if schema_clean else 'FAILED'}")
        sys.exit(1 if failures or not schema_clean else 0)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
