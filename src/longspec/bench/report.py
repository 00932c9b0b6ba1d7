"""Reports from benchmark rows: aggregation (speedup as a ratio per row, then the
geometric mean), a markdown table grouped like LongSpec's Table 1 plus a
detailed one with the physical floor, and matplotlib plots."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from longspec.bench.runner import AR_REFERENCE, HF_REFERENCE

_GRID = 16  # output lengths per run at which speedup-vs-length is evaluated
PLOTS = ("tokens_per_s_vs_context.png", "tau_by_method.png", "acceptance_by_depth.png", "speedup_vs_output_length.png")


def _runs(rows: Sequence[dict]) -> list[dict]:
    return median_runs([r for r in rows if r.get("kind") == "run"])


def median_runs(runs: Sequence[dict]) -> list[dict]:
    """One run per (prompt, setting, method): of repeated runs, the one with the median
    decode rate (the slower of the middle two for an even count). Repeats produce the
    same tokens, so only their timings differ; the rates of all repeats are kept in
    `decode_tokens_per_s_repeats`."""
    repeats: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        repeats[(*_group(r), r["method"])].append(r)
    chosen = []
    for group in repeats.values():
        if len(group) == 1:
            chosen.append(group[0])
            continue
        ordered = sorted(group, key=lambda r: r["decode_tokens_per_s"] or 0.0)
        rates = [r["decode_tokens_per_s"] for r in group]
        chosen.append(ordered[(len(ordered) - 1) // 2] | {"decode_tokens_per_s_repeats": rates})
    return chosen


def _group(row: dict) -> tuple:
    return (row["task"], row["item"], row["bucket"], row["context_tokens"], row["setting"], row["seed"])


def geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


@dataclass
class Cell:
    """Aggregate of one (task, context bucket, setting, method)."""

    rows: list[dict] = field(default_factory=list)
    speedup_ar: list[float] = field(default_factory=list)
    speedup_hf: list[float] = field(default_factory=list)

    @property
    def tau(self):
        return _mean(r.get("tau") for r in self.rows)

    @property
    def tokens_per_s(self):
        return _mean(r["decode_tokens_per_s"] for r in self.rows)

    @property
    def context(self):
        return _mean(r["context_tokens"] for r in self.rows)

    def check(self, name: str) -> str:
        checks = [r.get(name) for r in self.rows if r.get(name) is not None]
        if not checks:
            return "–"
        equal = sum(c["equal"] for c in checks)
        ties = sum(1 for c in checks if not c["equal"] and c["verdict"] == "near-tie")
        bad = len(checks) - equal - ties
        text = f"{equal}/{len(checks)}"
        if ties:
            text += f" ({ties} near-tie)"
        if bad:
            text += f" **{bad} MISMATCH**"
        return text


def aggregate(rows: Sequence[dict]) -> dict[tuple, Cell]:
    """(task, context label, setting, method) -> Cell, with per-row speedups over
    our AR and transformers generate of the same prompt, setting and seed."""
    runs = _runs(rows)
    by_group: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by_group[_group(r)][r["method"]] = r
    cells: dict[tuple, Cell] = defaultdict(Cell)
    for r in runs:
        label = r["bucket"] or r["context_tokens"]
        cell = cells[(r["task"], label, r["setting"], r["method"])]
        cell.rows.append(r)
        peers = by_group[_group(r)]
        for ref, out in ((AR_REFERENCE, cell.speedup_ar), (HF_REFERENCE, cell.speedup_hf)):
            base = peers.get(ref, {}).get("decode_tokens_per_s")
            if base and r["decode_tokens_per_s"]:
                out.append(r["decode_tokens_per_s"] / base)
    return dict(cells)


def _mib(values) -> float | None:
    mean = _mean(values)
    return None if mean is None else mean / 2**20


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _floor(header: dict, context: float | None) -> float | None:
    table = {int(c): tps for c, tps in header.get("floor_tokens_per_s", [])}
    if not table or context is None:
        return None
    nearest = min(table, key=lambda c: abs(c - context))
    return table[nearest]


def markdown(rows: Sequence[dict], header: dict | None = None) -> str:
    header = header or next((r for r in rows if r.get("kind") == "header"), {})
    cells = aggregate(rows)
    methods = list(dict.fromkeys(k[3] for k in cells))
    settings = list(dict.fromkeys(k[2] for k in cells))
    tasks = list(dict.fromkeys((k[0], k[1]) for k in cells))
    out = []
    m = header.get("machine", {})
    if m:
        out.append(f"Machine: {m.get('cpu')}, {m.get('cores')} cores ({m.get('torch_threads')} torch threads); "
                   f"torch {m.get('torch')}, transformers {m.get('transformers')}, longspec {m.get('longspec')}.")
    if header.get("model"):
        out.append(f"Model: {header['model']} ({header.get('dtype')}); max new tokens {header.get('max_new_tokens')}, "
                   f"{'EOS ignored' if header.get('ignore_eos') else 'stops at EOS'}; read bandwidth "
                   f"{_fmt(header.get('bandwidth_gbs'), '.1f')} GB/s.")
    if header.get("command"):
        out.append(f"Command: `{header['command']}`")
    repeats = 1 + max((r.get("repeat", 0) for r in rows if r.get("kind") == "run"), default=0)  # resume may add some
    if repeats > 1:
        out.append(f"Each method ran up to {repeats} times per prompt and setting, interleaved; the tables "
                   "show each method's median run.")
    out.append("")
    for setting in settings:
        out.append(f"### {setting}: τ · decode tok/s · speedup over our AR (geometric mean of per-row ratios)")
        out.append("")
        columns = list(dict.fromkeys(t for t, _ in tasks))
        out.append("| method | " + " | ".join(columns) + " |")
        out.append("|---|" + "---|" * len(columns))
        for method in methods:
            parts = []
            for task in columns:
                group = [c for (t, _, s, mm), c in cells.items() if t == task and s == setting and mm == method]
                if not group:
                    parts.append("–")
                    continue
                pooled = Cell([r for c in group for r in c.rows], [x for c in group for x in c.speedup_ar])
                parts.append(f"{_fmt(pooled.tau)} · {_fmt(pooled.tokens_per_s, '.1f')} · "
                             f"{_fmt(geomean(pooled.speedup_ar), '.2f', '×')}")
            out.append(f"| {method} | " + " | ".join(parts) + " |")
        out.append("")
    out.append("### Detail (per task and context length)")
    out.append("")
    out.append("| task | context | setting | method | τ | decode tok/s | × our AR | × tf generate | prefill tok/s "
               "| latency s | % of AR floor | KV cache MiB | draft state MiB | Distinct-4 | = our AR | = tf |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for task, label in tasks:
        for setting in settings:
            floor = None
            for method in methods:
                cell = cells.get((task, label, setting, method))
                if cell is None:
                    continue
                floor = _floor(header, cell.context)
                share = cell.tokens_per_s / floor * 100 if floor and cell.tokens_per_s else None
                out.append(
                    f"| {task} | {label} | {setting} | {method} | {_fmt(cell.tau)} | {_fmt(cell.tokens_per_s, '.1f')} "
                    f"| {_fmt(geomean(cell.speedup_ar), '.2f', '×')} | {_fmt(geomean(cell.speedup_hf), '.2f', '×')} "
                    f"| {_fmt(_mean(r['prefill_tokens_per_s'] for r in cell.rows), '.0f')} "
                    f"| {_fmt(_mean(r['total_s'] for r in cell.rows), '.1f')} | {_fmt(share, '.0f', '%')} "
                    f"| {_fmt(_mib(r['cache_bytes'] for r in cell.rows), '.1f')} "
                    f"| {_fmt(_mib(r['draft_state_bytes'] for r in cell.rows), '.2f')} "
                    f"| {_fmt(_mean(r['distinct_4'] for r in cell.rows))} | {cell.check('check_ar')} "
                    f"| {cell.check('check_hf')} |"
                )
            if floor:
                out.append(f"| {task} | {label} | {setting} | *AR floor (bytes/forward ÷ bandwidth)* | – | "
                           f"{floor:.1f} | | | | | 100% | | | | | |")
    every_repeat = [r for r in rows if r.get("kind") == "run"]  # a divergence in any repeat is listed
    problems = [r for r in every_repeat if any(r.get(c) and not r[c]["equal"] for c in ("check_ar", "check_hf"))]
    if problems:
        out += ["", "### Greedy divergences", ""]
        for r in problems:
            for name in ("check_ar", "check_hf"):
                c = r.get(name)
                if c and not c["equal"]:
                    ref = "our AR" if name == "check_ar" else "transformers"
                    out.append(f"- **{c['verdict']}** {r['method']} vs {ref}: {r['task']} item {r['item']} "
                               f"@{r['context_tokens']} tokens, first divergence at output position {c['position']} "
                               f"(tokens {c['ours']} vs {c['reference']}; target top-2 {c['top2_tokens']}, logit gap "
                               f"{c['top2_gap']:.4g}, near-tie threshold {c['near_tie_threshold']:.3g})")
    skipped = [r for r in rows if r.get("kind") in ("skipped", "unavailable")]
    if skipped:
        out += ["", "### Methods not run", ""]
        seen = set()
        for r in skipped:
            if (r["method"], r["reason"]) not in seen:
                seen.add((r["method"], r["reason"]))
                out.append(f"- {r['method']}: {r['reason']}")
    return "\n".join(out) + "\n"


def summary(rows: Sequence[dict]) -> str:
    """A short plain-text table for the end of a CLI run."""
    cells = aggregate(rows)
    by: dict[tuple, list[Cell]] = defaultdict(list)
    for (_, _, setting, method), cell in cells.items():
        by[(setting, method)].append(cell)
    lines = [f"{'setting':<8} {'method':<10} {'tok/s':>7} {'tau':>6} {'x AR':>6} {'x tf':>6}  greedy checks"]
    for (setting, method), group in by.items():
        pooled = Cell([r for c in group for r in c.rows], [x for c in group for x in c.speedup_ar],
                      [x for c in group for x in c.speedup_hf])
        checks = pooled.check("check_ar") if setting == "greedy" else ""
        lines.append(f"{setting:<8} {method:<10} {_fmt(pooled.tokens_per_s, '.1f'):>7} {_fmt(pooled.tau, '.2f'):>6} "
                     f"{_fmt(geomean(pooled.speedup_ar), '.2f'):>6} {_fmt(geomean(pooled.speedup_hf), '.2f'):>6}  {checks}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots
def plots(rows: Sequence[dict], out_dir: Path, *, long_output_tasks: Sequence[str] = ()) -> list[Path]:
    """Write the PNG plots into out_dir; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _runs(rows)
    header = next((r for r in rows if r.get("kind") == "header"), {})
    greedy = [r for r in runs if r["setting"] == "greedy"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)

    # tokens/s vs context length, per method (greedy)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        points = defaultdict(list)
        for r in greedy:
            if r["method"] == method and r["decode_tokens_per_s"]:
                points[r["context_tokens"]].append(r["decode_tokens_per_s"])
        xs = sorted(points)
        ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], marker="o", label=method)
    floor = sorted((int(c), t) for c, t in header.get("floor_tokens_per_s", []))
    if floor:
        ax.plot([c for c, _ in floor], [t for _, t in floor], "k--", label="AR floor")
    ax.set(xlabel="context tokens", ylabel="decode tokens/s", title="greedy decode speed vs context")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    save(fig, PLOTS[0])

    # tau per method, greedy and sampled
    ours = [m for m in methods if any(r.get("tau") is not None for r in runs if r["method"] == m)]
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(settings), 1)
    for i, setting in enumerate(settings):
        taus = [_mean(r.get("tau") for r in runs if r["method"] == m and r["setting"] == setting) or 0 for m in ours]
        ax.bar([j + i * width for j in range(len(ours))], taus, width, label=setting)
    ax.set_xticks([j + width * (len(settings) - 1) / 2 for j in range(len(ours))], ours)
    ax.set(ylabel="τ (tokens per target forward)", title="τ per method")
    ax.legend(fontsize=8)
    save(fig, PLOTS[1])

    # acceptance by depth, pooled over rows (greedy)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        accepted, proposed = defaultdict(float), defaultdict(float)
        for r in greedy:
            if r["method"] != method or not r.get("proposed_by_depth"):
                continue
            for d, (a, p) in enumerate(zip(r["acceptance_by_depth"], r["proposed_by_depth"])):
                accepted[d] += a * p
                proposed[d] += p
        depths = sorted(d for d in proposed if proposed[d])
        if depths:
            ax.plot([d + 1 for d in depths], [accepted[d] / proposed[d] for d in depths], marker=".", label=method)
    ax.set(xlabel="draft depth", ylabel="P(accepted | proposed)", title="acceptance by depth (greedy)", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    save(fig, PLOTS[2])

    # speedup over our AR vs output length (long-output tasks; all tasks when none)
    chosen = [r for r in greedy if r["task"] in long_output_tasks] or greedy
    by_group = defaultdict(dict)
    for r in chosen:
        by_group[_group(r)][r["method"]] = r
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        curves = defaultdict(list)
        for peers in by_group.values():
            base, mine = peers.get(AR_REFERENCE), peers.get(method)
            if not base or not mine or not base["timeline"] or not mine["timeline"]:
                continue
            # A common grid: both runs interpolated at the same lengths (their rounds end at different ones).
            end = min(base["timeline"][-1][0], mine["timeline"][-1][0])
            for length in sorted({max(1, round(end * (i + 1) / _GRID)) for i in range(_GRID)}):
                ar_seconds, seconds = _interpolate(base["timeline"], length), _interpolate(mine["timeline"], length)
                if ar_seconds and seconds:
                    curves[length].append(ar_seconds / seconds)
        xs = sorted(curves)
        if xs:
            ax.plot(xs, [geomean(curves[x]) for x in xs], label=method)
    ax.set(xlabel="output tokens", ylabel="speedup over our AR (time to reach length)",
           title="speedup vs output length (greedy)")
    ax.legend(fontsize=8)
    save(fig, PLOTS[3])
    return written


def _interpolate(timeline: Sequence[Sequence[float]], length: float) -> float | None:
    """Seconds at which a run reached `length` tokens (linear between points)."""
    previous = (0, 0.0)
    for tokens, seconds in timeline:
        if tokens >= length:
            t0, s0 = previous
            return s0 + (seconds - s0) * (length - t0) / (tokens - t0) if tokens > t0 else seconds
        previous = (tokens, seconds)
    return None
