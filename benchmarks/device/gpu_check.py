"""One command for anyone with a GPU: is longspec correct there, and how fast is it?

    python benchmarks/device/gpu_check.py                       # on a CUDA machine
    python benchmarks/device/gpu_check.py --device cpu --shapes tiny --skip-tests   # a smoke run anywhere

1. Correctness: the device-parametrised tests (every method on the GPU against AR on
   the CPU, seeded sampling, batched rows), the Triton tree kernel compiled against
   the reference attention, and the attention backends' equivalence tests.
2. Speed, on random weights of real shapes (no model hub, no checkpoint: the GPU
   machine may have neither): Gemma 3 270M's and a 1B-class Llama's. Per shape: AR
   decode tokens/s, speculation with an oracle drafter (a chain of the true next
   tokens, so every round accepts `--oracle-tokens`; what a perfect drafter buys),
   AR throughput of the continuous-batching engine at each of `--batch-sizes` rows
   (and rows of `auto` over garbage beside it: ≥ 0.97× AR, its rounds off run as plain
   decoding; the same asked every round, as before),
   and the cost of verifying k tree tokens relative to one decode forward. With
   `--compile` (the default on a GPU), AR, the oracle chain and the largest tree again
   through compiled static-shape steps (CUDA graphs there), beside the eager numbers.
3. `auto` on that machine's measured cost: over the oracle (it should verify the whole
   chain: ≥ 0.95× the fixed oracle chain) and over a drafter proposing garbage (it
   should switch speculation off: ≥ 0.97× AR), eager and compiled, beside AR and the
   fixed chain timed the same way: each method runs once untimed, then every one is
   timed `--alternations` times in turns (`auto` keeps what it learned, as a server's
   controller would). Plain decoding through the engine's drafter path (a drafter that
   proposes nothing) shows what of `auto`'s extra time is the engine's. Two A/B runs:
   `auto` over the oracle learning in the round (not during the forward, as the engine
   does on a GPU), and `auto` over garbage with Python's collector kept off the heap
   that exists before the run (`gc.freeze`); and for every timed run, the compiler's
   events and the collections during it.

With `--profile`, each shape's operator profile of a few decode steps (host and
device time per operator) is written beside them, and for AR and `auto` over garbage
in each mode also a profile of Python functions (where the host's time goes).

Writes a markdown table and the raw numbers (JSON) to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # common.py, also when loaded from elsewhere (tests)

from common import GarbageDrafter  # noqa: E402
from longspec.runtime.device import HOST, device_name, resolve_device, synchronize  # noqa: E402
from longspec.runtime.loading import decoder_from_state_dict  # noqa: E402
from longspec.runtime.static_step import CompileOptions  # noqa: E402
from longspec.speculation.batch_engine import BatchEngine, BatchOptions  # noqa: E402
from longspec.speculation.cost_model import measure_forward_cost  # noqa: E402
from longspec.speculation.drafters.adaptive.drafter import AdaptiveDrafter  # noqa: E402
from longspec.speculation.drafters.base import DraftContext, Drafter  # noqa: E402
from longspec.speculation.engine import EngineOptions, SpeculativeEngine  # noqa: E402
from longspec.speculation.metrics import GenerationStats  # noqa: E402
from longspec.speculation.tree import Tree  # noqa: E402

DEVICE_TESTS = ["tests/test_devices.py", "tests/test_triton_tree_attention.py", "tests/test_cache.py", "tests/test_static_step.py",
                "tests/test_runtime_equivalence.py"]


def shape_configs() -> dict:
    """Configs of real models' shapes (weights are random)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    gemma = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                 final_logit_softcapping=None, attn_logit_softcapping=None)
    llama = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return {"gemma3-270m": lambda: Gemma3TextConfig(**gemma), "llama-1b": lambda: LlamaConfig(**llama),
            "tiny": lambda: LlamaConfig(**tiny)}


def random_decoder(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Our decoder with random weights of `config`'s shapes, built on the device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, tensor in skeleton.state_dict().items():
        values = torch.randn(tensor.shape, generator=generator, device=device, dtype=torch.float32) * 0.02
        state[name] = values.to(dtype)
    return decoder_from_state_dict(config, state, dtype).place(device)


class OracleDrafter(Drafter):
    """Proposes the next `length` tokens of a known greedy output: every round accepts them all."""

    def __init__(self, reference: list[int], prompt_length: int, length: int) -> None:
        self.reference, self.prompt_length, self.length = reference, prompt_length, length

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        done = context.tokens.numel() - self.prompt_length
        return Tree.chain(context.root, self.reference[done : done + min(self.length, context.max_nodes)])


class RootOnlyDrafter(Drafter):
    """Proposes nothing, every round: plain decoding through the engine's drafter path
    (what a round costs the engine, beside AR's, without any controller work)."""

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        return Tree.chain(context.root, [])


def auto_rates(model, prompt: torch.Tensor, reference: list[int], args, label: str) -> dict:
    """`auto` over the oracle and over garbage, beside AR and the fixed oracle chain timed
    the same way: each drafter runs once untimed (first-use costs and, for `auto`, the
    cost measurement and acceptance learned), then every run is timed `--alternations`
    times, the runs taking turns so that a drift of the machine spreads over all of
    them. Reported per run: the median over the turns of tokens/s and of the median
    round, the mean split of a round (drafting, forward + verification, bookkeeping),
    the controller's telemetry, and whether the tokens equal AR's (reported, not
    required: bf16; past a token unlike AR's, the oracle is no oracle any more)."""
    def over_oracle():
        return AdaptiveDrafter([("oracle", OracleDrafter(reference, args.prompt_tokens, args.oracle_tokens))])

    def over_garbage():
        return AdaptiveDrafter([("garbage", GarbageDrafter(model.config.vocab_size, args.oracle_tokens))])

    default, in_the_round = EngineOptions(progress=False), EngineOptions(progress=False, learn_while_verifying=False)
    # name -> (drafter, engine options, whether the timed run freezes the garbage collector's heap)
    runs = {"ar": (lambda: None, default, False),
            "oracle chain": (lambda: OracleDrafter(reference, args.prompt_tokens, args.oracle_tokens), default, False),
            "auto over the oracle": (over_oracle, default, False),
            "auto over garbage": (over_garbage, default, False),
            # What the engine's drafter path costs without a controller: the share of
            # auto-over-garbage's extra time that is not auto's own.
            "root only through the drafter path": (RootOnlyDrafter, default, False),
            # A/B on the same machine: the learning overlap (on by default on a GPU) and
            # the collector walking the compiled heap (once a suspect for the extra cost of
            # rounds off on the H100; it made no difference there).
            "auto over the oracle, learning in the round": (over_oracle, in_the_round, False),
            "auto over garbage, collector frozen": (over_garbage, default, True)}
    drafters = {}
    for name, (make, options, _) in runs.items():
        drafters[name] = make()
        decode_rate(model, prompt, args.new_tokens, drafters[name], options)
    timed: dict[str, list] = {name: [] for name in runs}
    for turn in range(args.alternations):
        for name, (_, options, freeze) in runs.items():
            if freeze:
                gc.freeze()  # what exists now is left out of every collection
            try:
                timed[name].append(with_events(lambda: decode_rate(model, prompt, args.new_tokens, drafters[name],
                                                                   options)))
            finally:
                gc.unfreeze()
            (_, stats, round_ms), _ = timed[name][-1]
            # As it comes: a run cut short by a time limit keeps what it measured in its log.
            print(f"{label} | {name} | turn {turn + 1}: {stats.decode_tokens_per_s:.1f} tok/s, median round "
                  f"{statistics.median(round_ms) if round_ms else float('nan'):.2f} ms", flush=True)
    result = {}
    for name, turns in timed.items():
        (tokens, stats, round_ms), events = turns[-1]
        rates = [turn_stats.decode_tokens_per_s for (_, turn_stats, _), _ in turns]
        medians = [statistics.median(ms) for (_, _, ms), _ in turns if ms]
        splits = [round_split(turn_stats, ms) for (_, turn_stats, ms), _ in turns]
        result[name] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_turns": rates, "tau": stats.tau,
                        "equal": all(turn_tokens == reference for (turn_tokens, _, _), _ in turns),
                        "median_round_ms": statistics.median(medians) if medians else None,
                        "split_ms": {part: statistics.fmean(s[part] for s in splits)
                                     for part in ("draft_ms", "verify_ms", "bookkeeping_ms")},
                        "events": {key: sum(e.get(key, 0) for _, e in turns) for key in {k for _, e in turns for k in e}}}
        telemetry = stats.controller
        if telemetry:
            result[name].update(
                mean_nodes=telemetry["mean_nodes"],
                speculation_off_share=telemetry["speculation_off_rounds"] / max(telemetry["rounds"], 1),
                rounds_without_proposals=telemetry["rounds_without_proposals"],
                predicted_accepted_per_round=telemetry["predicted_accepted_per_round"],
                realised_accepted_per_round=telemetry["realised_accepted_per_round"])
    if args.profile:  # where a round off costs more than plain decoding's: operators, then Python functions
        for name in ("ar", "auto over garbage"):
            stem = f"{name.replace(' ', '-')}-{label}"
            write_profile(model, prompt, args.out / f"profile-{stem}.txt", 16, drafters[name])
            write_python_profile(lambda: decode_rate(model, prompt, args.new_tokens, drafters[name], runs[name][1]),
                                 args.out / f"python-profile-{stem}.txt")
    return result


def write_python_profile(run, path: Path) -> None:
    """Where a run's host time goes by Python function (cProfile, sorted by own time):
    time a function spends waiting on the device shows in the call that waits."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    print(f"Python profile: {path}", flush=True)


def with_events(run):
    """run()'s value, and what happened under it that a timed run should not pay for:
    the compiler's event counts that changed (recompilations, CUDA graphs recorded or
    skipped) and Python's garbage collections per generation."""
    from torch._dynamo.utils import counters

    def snapshot() -> dict:
        events = {f"{group}/{name}": count for group, names in counters.items() for name, count in names.items()}
        events.update({f"gc/generation {g}": stats["collections"] for g, stats in enumerate(gc.get_stats())})
        return events

    before = snapshot()
    value = run()
    after = snapshot()
    return value, {key: count - before.get(key, 0) for key, count in after.items() if count != before.get(key, 0)}


def decode_rate(model, prompt: torch.Tensor, new_tokens: int, drafter=None,
                options: EngineOptions = EngineOptions(progress=False)) -> tuple[list[int], GenerationStats, list[float]]:
    """The tokens, the run's stats and each round's wall time in ms after the first (which
    also pays first-use costs: ~15 ms on an H100 in a fresh process)."""
    engine = SpeculativeEngine(model, options)
    stats = GenerationStats()
    tokens, round_ms, last = [], [], None
    for new in engine.generate(prompt, max_new_tokens=new_tokens, drafter=drafter, stats=stats):
        tokens += new.tolist()  # a host copy: the round has finished on the device
        now = time.perf_counter()
        if last is not None:
            round_ms.append(1e3 * (now - last))
        last = now
    synchronize(model.device)
    return tokens, stats, round_ms


def batch_throughput(model, prompt: torch.Tensor, new_tokens: int, rows: int, drafters: list | None = None) -> float:
    """Generated tokens/s across `rows` requests decoded together (prefill excluded):
    AR, or one of `drafters` per row."""
    options = EngineOptions(progress=False)
    budget = options.max_tree_nodes  # room for a drafter's tree; AR rows get it too: every run, the same cache
    engine = BatchEngine(model, options,
                         BatchOptions(max_rows=rows, row_capacity=prompt.numel() + new_tokens + budget + 1,
                                      prefill_tokens_per_step=prompt.numel()))
    handles = [engine.submit(prompt, max_new_tokens=new_tokens, drafter=drafters[row] if drafters else None)
               for row in range(rows)]
    while any(h.stats.new_tokens == 0 for h in handles):  # every row prefilled and past its first token
        engine.step()
    synchronize(model.device)
    done, start = sum(h.stats.new_tokens for h in handles), time.perf_counter()
    engine.run()
    synchronize(model.device)
    return (sum(h.stats.new_tokens for h in handles) - done) / (time.perf_counter() - start)


class AskedEveryRound(AdaptiveDrafter):
    """`auto` without `plain_rounds`: the engines ask it every round, speculation off or
    not, as they did before plain rounds (the batched A/B)."""

    plain_rounds = None


def batch_rates(model, prompt: torch.Tensor, args) -> dict[int, dict[str, float]]:
    """Per batch size, tokens/s of AR rows and of rows of `auto` over garbage, with its
    rounds off run as plain decoding and asked every round: each run once untimed (the
    cost measurement, what `auto` learns), then timed `--alternations` times in turns;
    medians."""
    def garbage() -> list:
        return [("garbage", GarbageDrafter(model.config.vocab_size, args.oracle_tokens))]

    makers = {"ar": lambda: None, "auto over garbage": lambda: AdaptiveDrafter(garbage()),
              "auto over garbage, asked every round": lambda: AskedEveryRound(garbage())}
    rates = {}
    for rows in args.batch_sizes:
        drafters = {name: [make() for _ in range(rows)] for name, make in makers.items()}
        timed: dict[str, list[float]] = {name: [] for name in makers}
        for turn in range(args.alternations + 1):  # the first turn untimed
            for name in makers:
                rate = batch_throughput(model, prompt, args.new_tokens, rows, drafters[name])
                if turn:
                    timed[name].append(rate)
                    print(f"batch of {rows} | {name} | turn {turn}: {rate:.1f} tok/s", flush=True)
        rates[rows] = {name: statistics.median(values) for name, values in timed.items()}
    return rates


def measure_shape(name: str, config, args, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    model = random_decoder(config, dtype, device)
    built_s = time.perf_counter() - started
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1),
                           device=HOST)
    decode_rate(model, prompt[:64], 8)  # warm-up: kernels, allocator, Triton compilation
    reference, ar, ar_rounds = decode_rate(model, prompt, args.new_tokens)
    oracle = OracleDrafter(reference, args.prompt_tokens, args.oracle_tokens)
    tokens, spec, spec_rounds = decode_rate(model, prompt, args.new_tokens, oracle)
    print(f"{name} eager: AR {ar.decode_tokens_per_s:.1f} tok/s, oracle chain {spec.decode_tokens_per_s:.1f}",
          flush=True)
    # Reported, not required: in bf16 a many-token and a one-token forward may round a
    # near-tie of random weights apart (the device tests prove identity in float64); past
    # such a token the oracle's chain stops matching, which τ shows.
    first_difference = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if args.profile:
        write_profile(model, prompt[:256], args.out / f"profile-{name}.txt")
    auto = auto_rates(model, prompt, reference, args, f"{name}-eager") if args.auto else None
    compiled = compiled_rates(name, model, prompt, reference, args) if args.compile else None
    batch_throughput(model, prompt[:64], 4, max(args.batch_sizes))  # warm-up: batched shapes and masks
    batches = batch_rates(model, prompt, args)
    costs = {}
    for context in args.contexts:
        if context + max(args.ks) <= config.max_position_embeddings:
            cost = measure_forward_cost(model, context=context, ks=args.ks, repeats=args.repeats)
            costs[context] = {k: cost.seconds_for(k) for k in cost.ks}
    return {
        "shape": name, "device": device_name(device), "dtype": args.dtype, "build_s": built_s,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "ar_tokens_per_s": ar.decode_tokens_per_s, "oracle_tokens_per_s": spec.decode_tokens_per_s,
        "oracle_tau": spec.tau, "oracle_first_difference": first_difference,
        "batch_tokens_per_s": {rows: rates["ar"] for rows, rates in batches.items()}, "batch_auto": batches,
        "forward_seconds": costs, "compiled": compiled, "ar_split": round_split(ar, ar_rounds),
        "oracle_split": round_split(spec, spec_rounds), "auto": auto,
    }


def write_profile(model, prompt: torch.Tensor, path: Path, steps: int = 6, drafter=None) -> None:
    """Where a few decode steps (or speculation rounds, with `drafter`) spend host and
    device time, by operator (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        decode_rate(model, prompt, steps, drafter)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
    print(f"profile of {steps} new tokens{' (speculation)' if drafter else ''}: {path}", flush=True)


def round_split(stats: GenerationStats, round_ms: list[float]) -> dict:
    """Milliseconds per round (per token for AR) drafting, in the forward + verification,
    and in bookkeeping (means), and the median round's wall time: where a round's time
    goes when the forward is cheap, and its steady cost without first-use outliers."""
    rounds = max(stats.target_forwards, 1)
    return {"rounds": stats.target_forwards, "draft_ms": 1e3 * stats.draft_s / rounds,
            "verify_ms": 1e3 * stats.verify_s / rounds, "bookkeeping_ms": 1e3 * stats.bookkeeping_s / rounds,
            "median_round_ms": statistics.median(round_ms) if round_ms else None}


def compiled_rates(name: str, model, prompt: torch.Tensor, reference: list[int], args) -> dict:
    """AR, the oracle chain and a forward of the largest tree through compiled static
    steps, then the model back to eager. Equality with the eager tokens is reported,
    not required: in bf16 two kernels may round a near-tie apart (the float32 tests
    prove the compiled steps exact)."""
    largest = max(args.ks)
    buckets = tuple(sorted({1, args.oracle_tokens + 1, largest}))
    model.compile_steps(CompileOptions.for_device(model.device, buckets=buckets))
    started = time.perf_counter()
    engine = EngineOptions()
    model.static_steps.warm_up(max(engine.prefill_chunk, engine.max_tree_nodes + 1))  # before anything is timed
    compile_s = time.perf_counter() - started
    print(f"{name}: compiled steps {buckets} in {compile_s:.0f} s", flush=True)
    context = min(args.contexts)
    cost = measure_forward_cost(model, context=context, ks=(1, largest), repeats=args.repeats)
    ar_tokens, ar, ar_rounds = decode_rate(model, prompt, args.new_tokens)
    oracle_tokens, spec, spec_rounds = decode_rate(model, prompt, args.new_tokens,
                                      OracleDrafter(reference, args.prompt_tokens, args.oracle_tokens))
    if args.profile:
        oracle = OracleDrafter(reference, args.prompt_tokens, args.oracle_tokens)
        write_profile(model, prompt, args.out / f"profile-oracle-compiled-{name}.txt", args.new_tokens, oracle)
    auto = auto_rates(model, prompt, reference, args, f"{name}-compiled") if args.auto else None
    result = {
        "buckets": buckets, "compile_s": compile_s, "failure": model.static_steps.failure,
        "ar_tokens_per_s": ar.decode_tokens_per_s, "oracle_tokens_per_s": spec.decode_tokens_per_s,
        "equal_to_eager": ar_tokens == reference and oracle_tokens == reference,
        "forward_seconds": {context: {k: cost.seconds_for(k) for k in cost.ks}},
        "ar_split": round_split(ar, ar_rounds), "oracle_split": round_split(spec, spec_rounds), "auto": auto,
    }
    model.compile_steps(False)
    return result


def markdown(rows: list[dict], ks: list[int]) -> str:
    lines = ["| shape | device | AR tok/s | oracle chain tok/s (τ) | × AR | first token unlike AR's |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        difference = r["oracle_first_difference"]
        lines.append(f"| {r['shape']} | {r['device']} | {r['ar_tokens_per_s']:.1f} | "
                     f"{r['oracle_tokens_per_s']:.1f} ({r['oracle_tau']:.2f}) | "
                     f"{r['oracle_tokens_per_s'] / r['ar_tokens_per_s']:.2f} | "
                     f"{'none' if difference is None else difference} |")
    sizes = sorted({b for r in rows for b in r["batch_tokens_per_s"]})
    lines += ["", "| shape | " + " | ".join(f"AR, {b} rows: tok/s (× 1 row)" for b in sizes) + " |",
              "|---|" + "---|" * len(sizes)]
    for r in rows:
        rates = r["batch_tokens_per_s"]
        lines.append(f"| {r['shape']} | " + " | ".join(
            f"{rates[b]:.1f} ({rates[b] / rates[sizes[0]]:.2f})" if b in rates else "–" for b in sizes) + " |")
    lines += ["", "Rows of `auto` over garbage × AR rows, batch by batch: its rounds off as plain decoding / asked "
                  "every round (medians of the turns).", "",
              "| shape | " + " | ".join(f"{b} rows" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for r in rows:
        autos = r.get("batch_auto", {})
        lines.append(f"| {r['shape']} | " + " | ".join(
            f"{autos[b]['auto over garbage'] / autos[b]['ar']:.2f} / "
            f"{autos[b]['auto over garbage, asked every round'] / autos[b]['ar']:.2f}" if b in autos else "–"
            for b in sizes) + " |")
    lines += ["", "| shape | context | " + " | ".join(f"k={k}" for k in ks) + " |",
              "|---|---|" + "---|" * len(ks)]
    for r in rows:
        for context, seconds in r["forward_seconds"].items():
            one = seconds[1]
            cells = " | ".join(f"{seconds[k] * 1e3:.2f} ms ({seconds[k] / one:.2f}×)" for k in ks)
            lines.append(f"| {r['shape']} | {context} | {cells} |")
    compiled = [r for r in rows if r.get("compiled")]
    if compiled:
        lines += ["", "| shape | compiled steps | compile s | AR tok/s (× eager) | oracle tok/s (× eager) | "
                      "largest tree / decode forward | tokens = eager |", "|---|---|---|---|---|---|---|"]
    for r in compiled:
        c = r["compiled"]
        seconds = next(iter(c["forward_seconds"].values()))
        largest = max(seconds)
        lines.append(f"| {r['shape']} | {c['buckets']} | {c['compile_s']:.0f} | "
                     f"{c['ar_tokens_per_s']:.1f} ({c['ar_tokens_per_s'] / r['ar_tokens_per_s']:.2f}) | "
                     f"{c['oracle_tokens_per_s']:.1f} ({c['oracle_tokens_per_s'] / r['oracle_tokens_per_s']:.2f}) | "
                     f"k={largest}: {seconds[largest] / seconds[1]:.2f}× | {c['equal_to_eager']} |")
    steps = [(r["shape"], "eager", r["auto"]) for r in rows if r.get("auto")]
    steps += [(r["shape"], "compiled", r["compiled"]["auto"]) for r in compiled if r["compiled"].get("auto")]
    if steps:
        lines += ["", "Each run once untimed, then timed in turns with the others (`--alternations`): medians. auto over "
                      "the oracle: × the fixed oracle chain, nodes a round, "
                      "predicted / realised accepted a round; auto over garbage: × AR, rounds off (of them without "
                      "proposals); = AR: tokens equal AR's (bf16: reported, not required).", "",
                  "| shape | steps | AR tok/s | oracle chain tok/s | auto over the oracle | auto over garbage | = AR |",
                  "|---|---|---|---|---|---|---|"]
    for shape, mode, auto in steps:
        ar, chain, oracle, garbage = (auto[n] for n in ("ar", "oracle chain", "auto over the oracle", "auto over garbage"))
        equal = "/".join("yes" if auto[n]["equal"] else "no" for n in auto)
        lines.append(f"| {shape} | {mode} | {ar['tokens_per_s']:.1f} | {chain['tokens_per_s']:.1f} | "
                     f"{oracle['tokens_per_s']:.1f} ({oracle['tokens_per_s'] / chain['tokens_per_s']:.2f}×), "
                     f"{oracle['mean_nodes']:.1f}, {oracle['predicted_accepted_per_round']:.2f} / "
                     f"{oracle['realised_accepted_per_round']:.2f} | {garbage['tokens_per_s']:.1f} "
                     f"({garbage['tokens_per_s'] / ar['tokens_per_s']:.2f}×), "
                     f"{100 * garbage['speculation_off_share']:.0f}% ({garbage['rounds_without_proposals']}) | {equal} |")
    if steps:
        lines += ["", "Every timed run of those, with what happened during it (`with_events`): compiler counters that "
                      "changed, and garbage collections per generation.", "",
                  "| shape | steps | run | tok/s (each turn) | median round ms | draft / forward + verify / "
                  "bookkeeping ms (means) | events |", "|---|---|---|---|---|---|---|"]
    for shape, mode, auto in steps:
        for name, run in auto.items():
            events = ", ".join(f"{key} {count:+d}" for key, count in sorted(run.get("events", {}).items())) or "none"
            median = run["median_round_ms"]
            turns = ", ".join(f"{rate:.0f}" for rate in run["tokens_per_s_turns"])
            split = " / ".join(f"{run['split_ms'][part]:.2f}" for part in ("draft_ms", "verify_ms", "bookkeeping_ms"))
            lines.append(f"| {shape} | {mode} | {name} | {run['tokens_per_s']:.1f} ({turns}) | "
                         f"{'–' if median is None else f'{median:.2f}'} | {split} | {events} |")
    return "\n".join(lines) + "\n"


def run_tests(device: torch.device) -> int:
    """The device-parametrised tests; on a GPU they run on it (and the Triton kernel compiled)."""
    command = [sys.executable, "-m", "pytest", "-q", *DEVICE_TESTS]
    print("$", " ".join(command), flush=True)
    return subprocess.call(command, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", nargs="+", default=["gemma3-270m", "llama-1b"], choices=sorted(shape_configs()))
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--oracle-tokens", type=int, default=8, help="tokens the oracle drafter proposes per round")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                        help="also run auto over the oracle and over a garbage drafter")
    parser.add_argument("--profile", action="store_true",
                        help="also write each shape's operator profile of decode steps")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure compiled static steps (default: on a GPU only)")
    parser.add_argument("--alternations", type=int, default=1,
                        help="timed turns of each run in the auto table, the runs taking turns")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu_check"))
    args = parser.parse_args(argv)
    if args.alternations < 1:
        parser.error(f"--alternations must be at least 1, got {args.alternations}")
    device = resolve_device(args.device)
    if args.compile is None:
        args.compile = device.type == "cuda"
    if 1 not in args.ks:
        args.ks = [1, *args.ks]
    failed = 0 if args.skip_tests else run_tests(device)
    configs = shape_configs()
    rows = []
    for name in args.shapes:
        rows.append(measure_shape(name, configs[name](), args, device))
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows, sorted(args.ks))
    (args.out / "results.md").write_text(table)
    print(table)
    if failed:
        print(f"gpu_check: the device tests failed (pytest exit {failed})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
