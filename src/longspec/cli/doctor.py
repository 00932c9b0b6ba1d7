"""`longspec doctor`: what this machine uses and why, and the one-time work done ahead.

It prints the CPU's instruction sets and the kernel path they choose, whether the
native kernels are built, whether the certified head decides (and why not), the
forward-cost curve `auto` prices trees with (measured, or the default standing in),
and where the caches are with their sizes. Unless --no-build, it first builds what is
missing (the converted model, the kernels, the head's int8 copy: `load` does these)
and measures the forward cost (one sequence, and the batch row counts of --rows), so
that a later run starts without one-time work.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

from longspec.cli.options import add_device_argument

ROWS = (2, 4, 8)  # the batch shapes measured by default: a server's first requests with n > 1


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="what this machine uses and why; builds and measures what is missing")
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf file or cached HF id (default: embedded Gemma 3 270M)")
    p.add_argument("--no-build", action="store_true", help="only report: build nothing, measure nothing")
    p.add_argument("--rows", type=int, nargs="*", default=list(ROWS),
                   help="batch row counts whose forward cost is measured (default: 2 4 8; none: --rows)")
    p.add_argument("--context", type=int, default=512, help="committed tokens of the measured forward cost (default 512)")
    p.add_argument("--remeasure", action="store_true", help="measure the forward cost again even where it is cached "
                                                            "(after the machine was busy when it was measured)")
    add_device_argument(p)


def run(args) -> int:
    if any(rows < 1 for rows in args.rows):
        raise ValueError(f"--rows takes row counts >= 1, got {args.rows}")
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    import torch

    import longspec
    from longspec.api import choose_certified_head
    from longspec.runtime import progress
    from longspec.runtime.default_model import cache_root
    from longspec.runtime.linear import cpu_flags
    from longspec.runtime.machine import cpu_name
    from longspec.speculation import cost_measurement, cost_model
    from longspec.speculation.cost_defaults import cpu_kind

    progress.set_enabled(True)
    flags = cpu_flags()
    isa = [name for name in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if name in flags]
    print(f"longspec {longspec.__version__}; python {platform.python_version()}; torch {torch.__version__}")
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
          f"instruction sets: {' '.join(isa) or 'none of avx2/avx-512/amx'}")

    if args.no_build:
        _report_caches(cache_root())
        return 0
    start = time.perf_counter()
    model = longspec.load(args.model, device=args.device)
    print(f"load: {time.perf_counter() - start:.2f} s (one-time parts: "
          + (", ".join(f"{part} {s:.2f} s" for part, s in sorted(model.load_setup.items())) or "none") + ")")
    decoder = model.model
    kind = cpu_kind(decoder)
    print(f"kernels: {_kernels_line()}; products on this CPU: {kind}")

    cost_measurement.set_policy("now")
    if args.remeasure:
        _forget_costs(decoder, args.context, args.rows)
    decoder._certified_head = False  # as it applies, whatever an earlier measurement decided: measured again below
    if decoder.certified_head is not None:
        cost_model.forward_cost_at(decoder, 1)  # the two curves the load's choice reads, at the smallest context
        cost_model.measure_full_head(decoder)
        choose_certified_head(decoder)
    print(f"certified head: {_head_line(decoder)}")
    cost = cost_model.forward_cost_at(decoder, args.context)
    print(f"forward cost ({'default' if cost_model.is_default(cost) else 'measured'}, context {cost.key['context']}): "
          + _curve(cost))
    for rows in args.rows:
        batch = cost_model.batch_forward_cost_at(decoder, rows, args.context)
        print(f"  {rows} rows, tokens per row: " + _curve(batch))
    _report_caches(cache_root())
    return 0


def _kernels_line() -> str:
    from longspec.runtime.native import LIBRARY, kernels_identity, native_ops

    if native_ops() is None:
        return "not built (see the warning above: PyTorch and oneDNN run instead)"
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(LIBRARY, False))
    return f"built ({kernels_identity()}) in {directory} ({_size(directory)})"


def _head_line(decoder) -> str:
    """On, or off with the reason `CertifiedHead.for_model` had."""
    from longspec.runtime.certified_head import DISABLE_VARIABLE, FILE_SCREEN_VARIABLE
    from longspec.speculation.cost_model import certified_head_gain

    gain = certified_head_gain(decoder)
    measured = "" if gain is None else f"; measured here: a decode step {gain:.2f}x as fast with it as without"
    head = decoder.certified_head
    if head is not None:
        return f"on: decisions read {head.describe()}{measured}; {DISABLE_VARIABLE}=0 turns it off"
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return f"off ({DISABLE_VARIABLE}=0)"
    if decoder.file_head is not None:
        return (f"off: the quantized target's head is the file's own rows, read in full ({FILE_SCREEN_VARIABLE}=1 "
                "turns on their Q5_0 screen)")
    if gain is not None and decoder._packed_head is not None and decoder._packed_head.tiles is not None:
        return f"off: the full head is faster on this machine{measured}; {DISABLE_VARIABLE}=1 turns it on"
    if decoder._packed_head is None or decoder._packed_head.tiles is None:
        return "off: the head is not on the native packed bf16 kernel (another dtype or device, or no kernels)"
    if decoder.config.final_logit_softcapping:
        return "off: the model soft-caps its logits"
    return "off: the head weight is not finite"


def _curve(cost) -> str:
    shown = [k for k in cost.ks if k in (1, 2, 4, 8, 16, 32, 64)]
    return " ".join(f"{k}: {cost.seconds_for(k) * 1e3:.1f} ms" for k in shown)


def _forget_costs(decoder, context: int, rows_list) -> None:
    from longspec.runtime.machine import machine_identity
    from longspec.speculation import cost_model

    machine = machine_identity()
    bucket = cost_model._bucket(decoder, context, max(cost_model.DEFAULT_KS))
    keys = [cost_model.cost_key(decoder, bucket, machine)]
    batch_bucket = cost_model.batch_context_bucket(decoder, context)
    keys += [{**cost_model.cost_key(decoder, batch_bucket, machine), "rows": rows} for rows in rows_list]
    for key in keys:
        cost_model._path(key, cost_model.default_directory()).unlink(missing_ok=True)


def _report_caches(root: Path) -> None:
    from longspec.runtime.head_cache import cached_entries
    from longspec.speculation.cost_model import default_directory as cost_directory

    print(f"cache: {root} ({_size(root)}; LONGSPEC_CACHE moves it)")
    if root.is_dir():
        for entry in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            print(f"  {entry.name}: {_size(entry)}")
    for entry, size, problem in cached_entries():
        print(f"  prepared/{entry.name}: {size / 2**20:.0f} MiB" + (f" (unusable: {problem})" if problem else ""))
    costs = cost_directory()
    count = len(list(costs.glob("*.json"))) if costs.is_dir() else 0
    print(f"  forward costs measured: {count} in {costs}")
    sys.stdout.flush()


def _size(path: Path) -> str:
    if not path.exists():
        return "absent"
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{total / 2**20:,.0f} MiB"
