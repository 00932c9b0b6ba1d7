"""`longspec` command line: parses, calls the API, prints."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import sys
import threading
from pathlib import Path

from longspec.cli import bench, doctor, serve, train
from longspec.cli.faults import run_reporting_faults
from longspec.cli.options import add_compile_argument, add_device_argument
from longspec.cli.paths import read_prompt_file
from longspec.speculation.methods import DEFAULT_METHOD, METHODS


def _add_sampling_arguments(parser) -> None:
    """An option for every `SamplingParams` field that declares its CLI `type` and `help`."""
    from dataclasses import fields

    from longspec.speculation.processors import SamplingParams

    for spec in fields(SamplingParams):
        if "help" in spec.metadata:
            parser.add_argument("--" + spec.name.replace("_", "-"), type=spec.metadata["type"], default=spec.default,
                                help=spec.metadata["help"])


def _sampling_arguments(args) -> dict:
    from dataclasses import fields

    from longspec.speculation.processors import SamplingParams

    return {spec.name: getattr(args, spec.name) for spec in fields(SamplingParams) if "help" in spec.metadata}


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of a prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("prompt", nargs="?", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file (- reads standard input)")
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf file or cached HF id (default: embedded Gemma 3 270M)")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=sorted(METHODS),
                   help=f"decoding method (default: {DEFAULT_METHOD})")
    p.add_argument("--max-new-tokens", type=int, default=256)
    _add_sampling_arguments(p)
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS in [-100, 100] to token id TOKEN's logit (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", type=Path, metavar="FILE", help="the output is JSON valid against this "
                                                                            "JSON schema file")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    structured.add_argument("--grammar", type=Path, metavar="FILE", help="the output follows this Lark or GBNF grammar")
    structured.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these strings "
                                                                              "(repeatable)")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 | float32 | float64 (default: bfloat16, a .gguf file's quantization kept for its layers)")
    add_device_argument(p)
    add_compile_argument(p)
    p.add_argument("--max-tree-nodes", type=int, default=None, help="speculative nodes per verification forward")
    p.add_argument("--draft-tokens", type=int, default=None, help="pld: tokens per lookup candidate")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a drafter option of the method, e.g. tokenswift: budget=1024 sinks=64 k=10; longspec: "
                        "checkpoint=PATH widths=[2,4,4]; pld: num_tokens=5 (VALUE read as JSON when it parses; repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, ids, stats) instead of streaming")
    p.add_argument("--quiet", action="store_true", help="nothing on stderr but errors: no progress lines, notices or "
                                                        "statistics")


def _cmd_generate(args) -> int:
    import longspec
    from longspec.api import parse_dtype
    from longspec.speculation.engine import EngineOptions

    prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt
    if not prompt:
        raise ValueError("the prompt is empty")
    from longspec.cli.options import parse_option

    options = dict(parse_option(spec, "KEY=VALUE, e.g. --option budget=1024") for spec in args.option)
    if args.draft_tokens is not None:
        if args.method != "pld":
            raise ValueError("--draft-tokens applies to --method pld only")
        options["num_tokens"] = args.draft_tokens
    engine = EngineOptions() if args.max_tree_nodes is None else EngineOptions(max_tree_nodes=args.max_tree_nodes)
    # Validate everything cheap before loading weights.
    from longspec.request import GenerationRequest
    from longspec.speculation.methods import make_drafter

    logit_bias = {}
    for spec in args.logit_bias:
        token, eq, bias = spec.partition("=")
        try:
            logit_bias[int(token)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias {spec!r}: write TOKEN=BIAS, e.g. --logit-bias 42=-100") from None
    constraint = _output_constraint(args)
    if constraint is not None and args.ignore_eos:
        raise ValueError("--ignore-eos cannot go with a structured output option: a finished grammar allows only EOS")
    try:
        request = GenerationRequest.of(
            max_new_tokens=args.max_new_tokens, method=args.method, method_options=options, seed=args.seed,
            stop=args.stop, chat=args.chat, ignore_eos=args.ignore_eos, constraint=constraint, logit_bias=logit_bias,
            **_sampling_arguments(args))
    except (TypeError, ValueError) as error:  # the request's message names its field: name the flag instead
        raise ValueError(re.sub(r"^(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(error))) from None
    make_drafter(args.method, **options)
    if constraint is not None:
        constraint.grammar()  # compiles, or names why not
    if args.dtype is not None:
        parse_dtype(args.dtype)

    from longspec.runtime import progress

    progress.set_enabled(not (args.quiet or args.json) and sys.stderr.isatty())
    from longspec.speculation import cost_measurement

    cost_measurement.prefer("later")  # a missing forward-cost curve waits for `longspec doctor`
    model = longspec.load(args.model, dtype=args.dtype, engine=engine, device=args.device, compile=args.compile)
    stream = model.stream(prompt, request)
    for chunk in stream:
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    stats = stream.stats
    if args.json:
        print(json.dumps({"text": stream.text, "token_ids": stream.token_ids, "stats": stats.to_dict()}))
    elif not args.quiet:
        print("\n\n" + stats_line(stats), file=sys.stderr)
        if stats.controller.get("cost_curve") == "default":
            print(f"note: {stats.method} priced its trees with a default forward-cost curve for this kind of CPU: this "
                  "machine's is not measured yet. `longspec doctor` measures it (about a minute, once); later runs "
                  "use it.", file=sys.stderr)
    return 0


def stats_line(stats) -> str:
    """The statistics `generate` prints: decoding apart from the one-time work (setup) it waited for."""
    depth = " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth[:8])
    setup = ", ".join(f"{part} {seconds:.2f}" for part, seconds in sorted(stats.setup.items(), key=lambda x: -x[1]))
    return (
        f"[{stats.method}] prompt {stats.prompt_tokens} tok, prefill {stats.prefill_s:.2f} s "
        f"({stats.prefill_tokens_per_s:.0f} tok/s) | {stats.new_tokens} new tok, decode "
        f"{stats.decode_tokens_per_s:.1f} tok/s | tau {stats.tau:.2f} over {stats.target_forwards} forwards"
        + (f" | acceptance by depth {depth}" if depth else "")
        + f" | draft {stats.draft_s:.2f} s, verify {stats.verify_s:.2f} s, bookkeeping {stats.bookkeeping_s:.2f} s"
        + (f" | setup {stats.setup_s:.2f} s ({setup}), not in the times above" if stats.setup else "")
        + " | Distinct-1..4 " + " ".join(f"{d:.3f}" for d in stats.distinct)
    )


def _output_constraint(args):
    """The structured-output option given, as an `OutputConstraint` (None: none given)."""
    from longspec.speculation.grammar import OutputConstraint

    if args.json_schema is not None:
        text = read_prompt_file(args.json_schema, "--json-schema", "JSON schema")
        try:
            return OutputConstraint("json_schema", json.loads(text))
        except json.JSONDecodeError as error:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({error})") from None
    if args.json_object:
        return OutputConstraint("json_object")
    if args.regex is not None:
        return OutputConstraint("regex", args.regex)
    if args.grammar is not None:
        return OutputConstraint("grammar", read_prompt_file(args.grammar, "--grammar", "grammar"))
    if args.choice:
        return OutputConstraint("choice", args.choice)
    return None


def _info_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, device, and a model summary")
    p.add_argument("--model", default=None, help="model to summarize (default: embedded Gemma 3 270M)")
    p.add_argument("--no-model", action="store_true", help="skip loading a model")


def _cmd_info(args) -> int:
    import torch
    import transformers

    import longspec

    print(f"longspec {longspec.__version__}; python {platform.python_version()}; torch {torch.__version__}; "
          f"transformers {transformers.__version__}")
    print(f"device: cpu ({torch.get_num_threads()} threads); cuda available: {torch.cuda.is_available()}")
    print(f"methods: {', '.join(METHODS)}")
    if args.no_model:
        return 0
    model = longspec.load(args.model)
    c = model.config
    params = sum(p.numel() for p in model.model.parameters())
    sliding = sum(c.layer_is_sliding)
    print(f"model: {model.target.source}")
    print(f"  {c.model_type}: {params / 1e6:.0f}M parameters, {c.num_layers} layers ({sliding} sliding, window "
          f"{c.sliding_window}), hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads} kv, head dim "
          f"{c.head_dim}, vocab {c.vocab_size}, context {c.max_position_embeddings}, dtype {model.model.dtype}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longspec", description="Lossless speculative decoding for long contexts.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also: LONGSPEC_DEBUG=1), for bug reports")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _info_parser(sub)
    doctor.add_parser(sub)
    bench.add_parser(sub)
    train.add_parser(sub)
    serve.add_parser(sub)
    return parser


COMMANDS = {"generate": _cmd_generate, "info": _cmd_info, "train": train.run}
COMMANDS["bench"] = bench.run
COMMANDS["doctor"] = doctor.run
COMMANDS["serve"] = serve.run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_faults(lambda: COMMANDS[args.command](args), debug=args.debug)


def console_main() -> None:
    """The `longspec` command: `main`, then an exit without the interpreter's teardown.
    Freeing every module, the weights' mappings and torch's state took about a second
    after a one-token `generate`; the shutdown steps that matter still run: streams
    flushed, non-daemon threads and executors joined, atexit handlers (logging, the
    background measurement's stop) run."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream is closed: nothing to keep
            pass
    threading._shutdown()  # what the interpreter's exit runs first: joins threads, shuts executors down
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    console_main()
