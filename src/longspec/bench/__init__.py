"""The long-context benchmark suite: tasks from local files, the method matrix
(our engine's methods and `transformers` peers in one process), equality checks,
JSON-lines results, markdown tables and plots. `longspec bench` is its CLI."""

from longspec.bench.floor import ar_floor_tokens_per_s, decode_bytes_per_forward, machine, read_bandwidth_gbs
from longspec.bench.methods import (
    BenchMethod,
    EngineMethod,
    RunOutput,
    Setting,
    SkippedMethod,
    TransformersMethod,
    Unavailable,
    build_methods,
    default_settings,
)
from longspec.bench.report import markdown, plots, summary
from longspec.bench.runner import BenchRunner, RunnerOptions, load_rows, mismatches
from longspec.bench.tasks import TASK_KINDS, Prompt, PromptFilter, TaskFileError, TaskItem, TaskSpec, build_prompts

__all__ = [
    "BenchMethod", "BenchRunner", "EngineMethod", "Prompt", "PromptFilter", "RunOutput", "RunnerOptions", "Setting",
    "SkippedMethod", "TASK_KINDS", "TaskFileError", "TaskItem", "TaskSpec", "TransformersMethod", "Unavailable",
    "ar_floor_tokens_per_s", "build_methods", "build_prompts", "decode_bytes_per_forward", "default_settings",
    "load_rows", "machine", "markdown", "mismatches", "plots", "read_bandwidth_gbs", "summary",
]
