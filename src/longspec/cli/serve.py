"""`longspec serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

from longspec.cli import serve_ray
from longspec.cli.options import add_device_argument, parse_option
from longspec.serve.limits import RequestLimits
from longspec.speculation.methods import DEFAULT_METHOD, METHODS

DEFAULT_HOST = "127.0.0.1"
SWITCH_INTERVAL_S = 0.001


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf file or cached HF id (default: embedded Gemma 3 270M)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                                                   "(visible in `ps`: prefer --api-key-file or LONGSPEC_API_KEY)")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    p.add_argument("--max-concurrent", type=int, default=64,
                   help="choices admitted at once, running and queued (a batch prompt counts each prompt times n); "
                        "more get 429 (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together in one forward (rows); the "
                                                             "others wait for a free row (default: 8; each row holds "
                                                             "--max-prompt-tokens + --max-new-tokens of KV cache)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt accepted (default: the context); "
                                                                       "with --max-new-tokens it sizes each row's cache")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="largest max_tokens accepted, and the default of chat")
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices per request, each a row) accepted")
    p.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="the distribution logprobs report: the model's (raw), or the one tokens are drawn from "
                        "(processed: after bias, penalties, temperature, truncation)")
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="read control-token strings in prompts and chat messages (<eos>, <end_of_turn>) as control "
                        "tokens; only for trusted clients: by default they are plain text, so that a message cannot "
                        "end its turn and write the assistant's")
    p.add_argument("--max-body-bytes", type=int, default=RequestLimits.max_body_bytes,
                   help=f"largest request body accepted (default: {RequestLimits.max_body_bytes >> 20} MiB); larger "
                        "bodies get 413 before they are read")
    p.add_argument("--body-timeout", type=float, default=RequestLimits.body_timeout_s,
                   help="seconds a client has to send its whole body (default: %(default)s); slower ones get 408")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="open connections at most; past it, connections still waiting for their headers are closed "
                        "to make room, and only when every one is serving a request does a new one get 503 "
                        "(default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers, from its opening and after each "
                        "response (idle and trickling sockets are closed; default: %(default)s)")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=sorted(METHODS),
                   help=f"speculation method when a request names none (default: {DEFAULT_METHOD}, lossless)")
    p.add_argument("--method-option", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="a drafter option of the server's, e.g. longspec:checkpoint=DIR/draft.safetensors or "
                        "mamba:model=DIR (repeatable): options naming files or models are set here, never by requests, "
                        "which may set only bounded numeric options (docs: serving)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (for a base model without one, e.g. the "
                        "embedded Gemma 3 270M)")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 | float32 | float64; default: bfloat16, keeping a GGUF file's own quantization "
                        "(a dtype given dequantizes it)")
    p.add_argument("--suffix-cache-mb", type=float, default=None, metavar="MIB",
                   help="memory of the cache of earlier requests' outputs that auto drafts from (default 64; 0 turns "
                        "it off; one cache per server process)")
    add_device_argument(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (with --ray: per replica)")
    serve_ray.add_arguments(p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warnings(host: str, api_key: str | None) -> list[str]:
    """What to tell a user who binds beyond loopback."""
    if is_loopback(host):
        return []
    lines = [f"binding {host}: the server is reachable from other machines"]
    if api_key is None:
        lines.append(f"WARNING: no --api-key: anyone who can reach {host} can use the model")
    return lines


def server_method_options(specs: list[str]) -> dict[str, dict]:
    """'METHOD:KEY=VALUE' flags -> {METHOD: {KEY: VALUE}}."""
    options: dict[str, dict] = {}
    for spec in specs:
        method, colon, option = spec.partition(":")
        if not colon or method not in METHODS:
            raise ValueError(f"--method-option {spec!r}: write METHOD:KEY=VALUE with METHOD one of {', '.join(METHODS)}")
        key, value = parse_option(option, "METHOD:KEY=VALUE")
        options.setdefault(method, {})[key] = value
    return options


API_KEY_VARIABLE = "LONGSPEC_API_KEY"


def resolve_api_key(given: str | None, key_file: str | None) -> str | None:
    """The API key from --api-key, --api-key-file or LONGSPEC_API_KEY (one of them at
    most); an empty key is refused rather than taken for "no key"."""
    import os

    sources = {name: value for name, value in (("--api-key", given), ("--api-key-file", key_file),
                                                (API_KEY_VARIABLE, os.environ.get(API_KEY_VARIABLE))) if value is not None}
    if len(sources) > 1:
        raise ValueError(f"the API key is given {len(sources)} ways ({', '.join(sources)}): give one")
    if not sources:
        return None
    (source, value), = sources.items()
    if source == "--api-key-file":
        try:
            value = Path(value).read_text().splitlines()[0] if Path(value).read_text().strip() else ""
        except OSError as error:
            raise ValueError(f"--api-key-file {value}: {error.strerror}") from None
    if not value.strip():
        raise ValueError(f"the API key from {source} is empty: give a real key, or none (loopback only)")
    return value.strip()


def served_name(model_arg: str | None) -> str:
    from longspec.runtime.default_model import DEFAULT_MODEL_NAME

    if model_arg is None:
        return DEFAULT_MODEL_NAME
    path = Path(model_arg)
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else model_arg)


def run(args) -> int:
    try:
        import uvicorn

        from longspec.serve import ServeOptions, create_app
    except ImportError as error:
        raise ValueError(f"`longspec serve` needs the serve extra ({error.name} is missing): "
                         "pip install 'longspec[serve]'") from None
    import longspec
    from longspec.api import parse_dtype

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.dtype is not None:
        parse_dtype(args.dtype)
    serve_ray.check_arguments(args)
    api_key = resolve_api_key(args.api_key, args.api_key_file)
    options = ServeOptions(
        model_name=args.served_model_name or served_name(args.model), method=args.method, api_key=api_key,
        max_concurrent=args.max_concurrent, max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
        max_batch=args.max_batch, method_options=server_method_options(args.method_option),
        limits=RequestLimits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout), max_n=args.max_n,
        logprobs_mode=args.logprobs_mode, allow_special_tokens=args.allow_special_tokens,
    )
    for line in exposure_warnings(args.host, api_key):
        print(f"longspec serve: {line}", file=sys.stderr)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from longspec.speculation.engine import EngineOptions

    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as error:
            raise ValueError(f"--chat-template {args.chat_template}: {error.strerror}") from None
    from longspec.speculation.drafters.suffix_cache.index import DEFAULT_MEGABYTES, SuffixCache

    suffix_cache_mb = DEFAULT_MEGABYTES if args.suffix_cache_mb is None else args.suffix_cache_mb
    SuffixCache.of_megabytes(suffix_cache_mb)  # a bad size fails before the model loads
    if args.ray:
        return serve_ray.run(args, options, template, suffix_cache_mb)
    model = longspec.load(args.model, dtype=args.dtype, engine=EngineOptions(progress=False), device=args.device,
                          suffix_cache_mb=suffix_cache_mb)
    if template is not None:
        model.set_chat_template(template)
    app = create_app(model, options)
    batch = app.state.batch
    cache_bytes = model.batch_cache_bytes(batch)
    print(f"longspec serve: {options.model_name} on http://{args.host}:{args.port}/v1 (method {options.method}; "
          f"{batch.max_rows} rows of {batch.row_capacity} tokens, KV cache {cache_bytes / 2**20:.0f} MiB)",
          file=sys.stderr, flush=True)
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    from longspec.serve.connections import raise_open_file_limit, uvicorn_config

    raise_open_file_limit()  # idle sockets are open files: the default 1,024 would stall the accept loop first
    # The event loop and the generation thread share the GIL; at the default 5 ms hand-over a burst of
    # connections waited that long for each of its callbacks while a stream decoded (/health 276 ms).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, max_connections=args.max_connections,
                                  header_timeout_s=args.header_timeout)).run()
    return 0
