"""`longspec bench`: run the benchmark matrix and write results, report and plots.

    longspec bench --preset small                       # a few minutes on a 2-core CPU
    longspec bench --tasks multi_news lcc --context-buckets 1024 4096 --methods ar pld hf hf_pld \\
                   --max-new-tokens 256 --limit 2 --out bench-out/run1 [--resume]
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from longspec.cli.options import add_compile_argument, add_device_argument
from longspec.cli.paths import check_output_directory

DATA_ENV = "LONGSPEC_BENCH_DATA"


@dataclass(frozen=True)
class Preset:
    tasks: tuple[str, ...]
    context_buckets: tuple[int, ...]
    limit: int
    max_new_tokens: int
    seeds: tuple[int, ...]


PRESETS = {
    # Minutes on this project's 2-core CPU: one item per task, 1k-token documents.
    "small": Preset(("multi_news", "lcc", "spec_bench"), (1024,), 1, 64, (0,)),
    # The LongSpec tasks at every context bucket the data reach under Gemma 3 270M's 32k
    # context (Multi-News documents stop near 15k tokens, LCC files reach 16k and beyond),
    # one item per bucket and one sampling seed: about an hour on this 2-core CPU. Raise
    # --limit and --seeds where more machine time is available.
    "full": Preset(("multi_news", "lcc"), (1024, 2048, 4096, 8192, 16384), 1, 256, (0,)),
}


def add_parser(sub) -> None:
    from longspec.bench.tasks import TASK_KINDS

    p = sub.add_parser("bench", help="benchmark methods side by side on long-context tasks",
                       description="Run every task × context bucket × setting × method, check greedy outputs "
                                   "against our AR and transformers, and write results.jsonl, report.md and plots.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="defaults for tasks/buckets/limit/max-new-tokens/seeds (explicit flags override)")
    p.add_argument("--tasks", nargs="+", default=None, metavar="TASK[=PATH]",
                   help=f"task kinds: {', '.join(TASK_KINDS)}; KIND=PATH reads another file of that format")
    p.add_argument("--methods", nargs="+", default=None,
                   help="our methods (default: every registered one) plus hf (transformers generate) and "
                        "hf_pld (its prompt lookup)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="items per task (and per context bucket)")
    p.add_argument("--context-buckets", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="fit document prompts to these lengths (middle cut); items shorter than a bucket skip it")
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="sampling seeds (none: greedy only)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--lookup-tokens", type=int, default=10, help="hf_pld: prompt_lookup_num_tokens")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="a drafter option for one of our methods, e.g. longspec.checkpoint=DIR or pld.num_tokens=5 "
                        "(VALUE is read as JSON when it parses, else as a string; repeatable)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: fixed output length)")
    p.add_argument("--no-chat", action="store_true", help="never apply the chat template")
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf or cached HF id (default: Gemma 3 270M)")
    p.add_argument("--dtype", default="bfloat16")
    add_device_argument(p)
    add_compile_argument(p)
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="time each method N times per prompt and setting, interleaved, and report its median run "
                        "(a shared machine's speed drifts by 10-30%% between minutes; a median of 3 is steadier than one run)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every method (default: torch's choice); 1 is steadier on a busy machine")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"directory of the default task files (default: ${DATA_ENV}, else ../shared/data if present)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench"), help="output directory")
    p.add_argument("--resume", action="store_true", help="keep rows already in DIR/results.jsonl, run the rest")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="re-render report.md and plots from DIR/results.jsonl without running anything")


def data_dir_of(args) -> Path | None:
    """--data-dir, else $LONGSPEC_BENCH_DATA, else ../shared/data when it exists."""
    if args.data_dir is not None:
        return args.data_dir
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    guess = Path.cwd().parent / "shared" / "data"
    return guess if guess.is_dir() else None


def parse_method_options(specs) -> dict[str, dict]:
    """METHOD.KEY=VALUE strings -> {method: {key: value}}."""
    from longspec.cli.options import parse_option

    example = "METHOD.KEY=VALUE, e.g. pld.num_tokens=5"
    options: dict[str, dict] = {}
    for spec in specs:
        target, value = parse_option(spec, example)
        method, dot, key = target.partition(".")
        if not (dot and method and key):
            raise ValueError(f"--option {spec!r}: write {example}")
        options.setdefault(method, {})[key] = value
    return options


def _settings(args, preset: Preset | None):
    from longspec.bench.methods import default_settings

    seeds = args.seeds if args.seeds is not None else (preset.seeds if preset else (0,))
    return default_settings(seeds, temperature=args.temperature, top_p=args.top_p, min_p=args.min_p)


def _write_report(rows, header, out_dir: Path, plots: bool, long_output_tasks) -> None:
    from longspec.bench import report

    (out_dir / "report.md").write_text(report.markdown(rows, header))
    if plots:
        report.plots(rows, out_dir, long_output_tasks=long_output_tasks)


def _report_only(args) -> int:
    from longspec.bench.runner import load_rows
    from longspec.bench.tasks import TASK_KINDS

    results = args.out / "results.jsonl"
    if not results.is_file():
        raise FileNotFoundError(f"no results to report: {results} does not exist (run without --report-only first)")
    rows = load_rows(results)
    header = next((r for r in rows if r.get("kind") == "header"), {})
    long_output = [k for k, kind in TASK_KINDS.items() if kind.long_output]
    _write_report(rows, header, args.out, not args.no_plots, long_output)
    print(f"wrote {args.out / 'report.md'}" + ("" if args.no_plots else " and plots"), file=sys.stderr)
    return 0


def check_results_directory(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """An earlier run's results are never replaced silently."""
    check_output_directory(out_dir)
    if resume and overwrite:
        raise ValueError("--resume keeps the rows in --out and --overwrite replaces them: choose one")
    earlier = [name for name in ("results.jsonl", "report.md") if (out_dir / name).exists()]
    if earlier and not (resume or overwrite):
        raise FileExistsError(f"{out_dir} already holds an earlier run ({', '.join(earlier)}): pass --resume to "
                              "continue it, --overwrite to replace it, or another --out")


def run(args) -> int:
    if args.report_only:
        return _report_only(args)
    import longspec
    from longspec.bench import report
    from longspec.speculation import cost_measurement

    cost_measurement.set_policy("now")  # measured in the warm-up, before any clock (never the default curve)
    from longspec.bench.floor import ar_floor_tokens_per_s, machine, read_bandwidth_gbs
    from longspec.bench.methods import build_methods, our_method_names
    from longspec.bench.runner import BenchRunner, RunnerOptions, mismatches, now
    from longspec.bench.tasks import TASK_KINDS, PromptFilter, TaskSpec, build_prompts, check_prompt_ids
    from longspec.speculation.engine import EngineOptions

    check_results_directory(args.out, resume=args.resume, overwrite=args.overwrite)
    preset = PRESETS[args.preset] if args.preset else None
    pick = lambda value, fallback: value if value is not None else fallback  # noqa: E731
    tasks = pick(args.tasks, preset.tasks if preset else None)
    if not tasks:
        raise ValueError("give --tasks or --preset")
    max_new = pick(args.max_new_tokens, preset.max_new_tokens if preset else 256)
    limit = pick(args.limit, preset.limit if preset else None)
    buckets = tuple(pick(args.context_buckets, preset.context_buckets if preset else ()))
    method_names = args.methods or our_method_names() + ["hf", "hf_pld"]
    # Everything cheap is checked before loading weights.
    data_dir = data_dir_of(args)
    specs = [TaskSpec.parse(t, data_dir) for t in tasks]
    items = {spec: spec.load() for spec in specs}
    settings = _settings(args, preset)
    method_options = parse_method_options(args.option)
    unknown = set(method_options) - set(method_names)
    if unknown:
        raise ValueError(f"--option names method(s) not in the run: {', '.join(sorted(unknown))}")
    options = RunnerOptions(max_new_tokens=max_new, ignore_eos=not args.stop_at_eos, repeats=args.repeats)
    out_dir = args.out
    results = out_dir / "results.jsonl"
    if args.resume and not results.is_file():
        print(f"longspec bench: nothing to resume in {results}; starting a new run", file=sys.stderr)

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    model = longspec.load(args.model, dtype=args.dtype, device=args.device, compile=args.compile)
    for spec in specs:
        check_prompt_ids(items[spec], model.config.vocab_size)
    prompts = []
    for spec in specs:
        bucketed = TASK_KINDS[spec.kind].bucketed
        selection = PromptFilter(buckets=buckets if bucketed else (), limit=limit, use_chat=not args.no_chat)
        found = build_prompts(items[spec], model.tokenizer, selection)
        if not found:
            print(f"longspec bench: {spec.kind} ({spec.path}) has no item long enough for buckets {buckets}",
                  file=sys.stderr)
        prompts += found
    peer, peer_error = None, None
    if any(m in ("hf", "hf_pld") for m in method_names):
        try:
            from transformers import AutoModelForCausalLM

            peer = AutoModelForCausalLM.from_pretrained(model.target.source, dtype=model.model.dtype).to(model.device).eval()
        except (OSError, ValueError) as error:
            peer_error = f"transformers could not load {model.target.source}: {error}"
    methods, skipped = build_methods(method_names, model.model, peer=peer, engine_options=EngineOptions(progress=False),
                                     method_options=method_options, prompt_lookup_num_tokens=args.lookup_tokens)
    if peer_error:
        skipped = [type(s)(s.name, peer_error) if s.name in ("hf", "hf_pld") else s for s in skipped]
    for s in skipped:
        print(f"longspec bench: skipping {s.name}: {s.reason}", file=sys.stderr)

    bandwidth = read_bandwidth_gbs()
    contexts = sorted({p.context_tokens for p in prompts})
    header = {
        "benchmark": "longspec bench", "time": now(), "machine": machine(), "model": model.target.source,
        "dtype": str(model.model.dtype).removeprefix("torch."), "max_new_tokens": max_new,
        "ignore_eos": options.ignore_eos, "repeats": options.repeats, "command": "longspec bench " + shlex.join(sys.argv[2:]),
        "bandwidth_gbs": bandwidth,
        # The floor at the mean K/V length a decode step attends: the prompt plus half the output.
        "floor_tokens_per_s": [[c, ar_floor_tokens_per_s(model.model, c + max_new // 2, bandwidth)] for c in contexts],
        "tasks": [f"{s.kind}={s.path}" for s in specs], "methods": [m.name for m in methods],
        "settings": [{"name": s.name, "seed": s.seed, "temperature": s.params.temperature} for s in settings],
    }
    runner = BenchRunner(model.model, methods, options=options, eos_token_ids=model.config.eos_token_ids,
                         skipped=skipped)
    start = time.perf_counter()
    rows = runner.run(prompts, settings, results, header=header, resume=args.resume)
    file_header = next((r for r in rows if r.get("kind") == "header"), header)
    _write_report(rows, file_header, out_dir, not args.no_plots,
                  [s.kind for s in specs if TASK_KINDS[s.kind].long_output])
    print(f"\n{report.summary(rows)}\n")
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s; wrote {results}, {out_dir / 'report.md'}"
          + ("" if args.no_plots else ", plots"), file=sys.stderr)
    measured = [r for r in rows if r.get("kind") == "run"]
    if not measured:
        print("longspec bench: no run produced a result (every method was skipped or every prompt was "
              f"filtered out): see {out_dir / 'report.md'}", file=sys.stderr)
        return 1
    bad = mismatches(rows)
    if bad:
        print(f"longspec bench: {len(bad)} greedy output(s) differ from a reference beyond a near-tie: see "
              f"'Greedy divergences' in {out_dir / 'report.md'}", file=sys.stderr)
        return 1
    return 0
