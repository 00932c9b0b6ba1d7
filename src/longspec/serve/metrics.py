"""The server's Prometheus metrics, in a registry of its own (one per app, so two
servers in one process, or tests, never share counters). Names follow vLLM's where
vLLM has the quantity (`spec_decode_num_drafts`, `time_to_first_token_seconds`, ...),
under the `longspec:` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from longspec.runtime import setup_time
from longspec.speculation.metrics import GenerationStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("longspec:request_success", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("longspec:request_errors", "Refused or failed requests by HTTP status", ["status"],
                              registry=r)
        self.cancelled = Counter("longspec:request_cancelled", "Requests whose client went away", registry=r)
        self.prompt_tokens = Counter("longspec:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("longspec:generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("longspec:num_requests_running", "Requests being generated (rows in flight)", registry=r)
        self.waiting = Gauge("longspec:num_requests_waiting", "Requests queued behind the running ones", registry=r)
        self.kv_cache_bytes = Gauge("longspec:kv_cache_bytes", "Target KV cache bytes held by running requests",
                                    registry=r)
        self.ttft = Histogram("longspec:time_to_first_token_seconds", "From arrival to the first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tau = Histogram("longspec:request_tau", "Tokens per target forward of a request (bonus included)",
                             buckets=_TAU_BUCKETS, registry=r)
        self.drafts = Counter("longspec:spec_decode_num_drafts", "Verification rounds with a speculative tree",
                              registry=r)
        self.draft_tokens = Counter("longspec:spec_decode_num_draft_tokens", "Speculative tokens proposed", registry=r)
        self.accepted_tokens = Counter("longspec:spec_decode_num_accepted_tokens", "Speculative tokens accepted",
                                       registry=r)
        self.pruned_tokens = Counter("longspec:structured_output_pruned_draft_tokens",
                                     "Speculative tokens a request's grammar forbade, pruned before verification",
                                     registry=r)
        self.accepted_per_position = Counter("longspec:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted speculative tokens by depth in the tree", ["position"],
                                             registry=r)
        r.register(_SetupSeconds())

    def record_finished(self, stats: GenerationStats, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.record_tokens(stats)

    def record_tokens(self, stats: GenerationStats) -> None:
        """What a request generated and how speculation went (finished or cancelled)."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        if stats.target_forwards:
            self.tau.observe(stats.tau)
        self.drafts.inc(stats.draft_rounds)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.pruned_tokens.inc(stats.pruned_tokens)
        for position, accepted in enumerate(stats.accepted_by_depth):
            self.accepted_per_position.labels(position=str(position)).inc(accepted)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SetupSeconds:
    """`longspec:setup_seconds_total{part}`: the process's one-time work so far (the load's
    conversion, kernels, packing and certified head; forward-cost measurements, the
    background's included), read at each scrape (runtime/setup_time.py). No request's
    decoding time holds any of it."""

    def collect(self):
        family = CounterMetricFamily("longspec:setup_seconds", "One-time work of this process by part, in seconds",
                                     labels=["part"])
        for part, seconds in sorted(setup_time.process_totals().items()):
            family.add_metric([part], seconds)
        yield family
