"""One comparison row: the sides measured in turns (A, B, A, B ...), the load average
before the row, the median of each side's rates and their ratio."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable


def alternate(repeats: int, sides: dict[str, Callable[[], dict]]) -> dict[str, list[dict]]:
    """Each side called once per repeat, in the order given."""
    samples: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, call in sides.items():
            samples[name].append(call())
    return samples


def median_rate(samples: list[dict], key: str = "decode_tokens_per_s") -> float:
    return statistics.median(sample[key] for sample in samples)


def row(kind: str, *, ours: float, peer: float, peer_name: str, load: tuple[float, ...], goal: float | None,
        samples: dict, **fields) -> dict:
    return {"row": kind, **fields, "ours_tokens_per_s": ours, "peer": peer_name, "peer_tokens_per_s": peer,
            "ratio": ours / peer if peer else float("nan"), "goal": goal, "load_before": load,
            "samples": {name: [{k: v for k, v in s.items() if k != "tokens"} for s in group]
                        for name, group in samples.items()}}


def load_average() -> tuple[float, ...]:
    return tuple(round(x, 2) for x in os.getloadavg())


def markdown(rows: list[dict]) -> str:
    lines = ["| row | file | context | prompt | ours tok/s | peer | peer tok/s | ours / peer | goal | load before |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r.get('file', '')} | {r.get('context', '')} | | failed: "
                         f"{r['error'].splitlines()[-1][:120]} | | | | | |")
            continue
        goal = "" if r["goal"] is None else f"≥ {r['goal']}"
        lines.append(f"| {r['row']} | {r.get('file', '')} | {r.get('context', '')} | {r.get('prompt', '')} "
                     f"| {r['ours_tokens_per_s']:.1f} | {r['peer']} | {r['peer_tokens_per_s']:.1f} "
                     f"| {r['ratio']:.2f} | {goal} | {r['load_before'][0]:.2f} |")
    return "\n".join(lines)
