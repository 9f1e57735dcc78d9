"""Prometheus metrics of the server: request and token counters, latency histograms, engine gauges, startup.

Engine gauges and the startup timeline are read at scrape time by `collect`, so they are never stale. One registry
per server, so tests can run several in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Read from the engine's stats() at scrape time: (name, help, key).
_ENGINE_GAUGES = [
    ("day0jax_num_requests_waiting", "Sequences waiting to be scheduled (the queue depth).", "waiting"),
    ("day0jax_num_requests_running", "Sequences in the running batch.", "running"),
    ("day0jax_kv_blocks_used", "KV cache pages held by sequences.", "kv_blocks_used"),
    ("day0jax_kv_blocks_free", "KV cache pages free (cached prefixes included).", "kv_blocks_free"),
    ("day0jax_kv_blocks_total", "KV cache pages in the pool.", "kv_blocks_total"),
]
_ENGINE_COUNTERS = [
    ("day0jax_prefix_cache_hits", "KV pages reused from the prefix cache.", "prefix_hit_blocks"),
    ("day0jax_prefix_cache_queries", "KV pages looked up in the prefix cache.", "prefix_query_blocks"),
    ("day0jax_prefix_cache_hit_tokens", "Prompt tokens not recomputed thanks to the prefix cache.",
     "prefix_hit_tokens"),
    ("day0jax_num_preemptions", "Sequences preempted for lack of KV pages.", "preemptions"),
    ("day0jax_engine_steps", "Engine steps run.", "steps"),
]
# Speculative decoding (only with --speculative): counters, then the mean acceptance length as a gauge.
_SPEC_COUNTERS = [
    ("day0jax_spec_decode_num_drafts", "Verify steps of a sequence that carried drafts.", "spec_drafts"),
    ("day0jax_spec_decode_num_draft_tokens", "Tokens drafted.", "spec_draft_tokens"),
    ("day0jax_spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.", "spec_accepted_tokens"),
]


class Metrics:
    """The server's registry and instruments; also the registry's collector of the scrape-time figures."""

    def __init__(self, state):
        self.state = state
        self.registry = r = CollectorRegistry()
        self.requests = Counter("day0jax_requests", "HTTP requests to /v1 routes by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("day0jax_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("day0jax_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("day0jax_request_success", "Finished sequences by finish reason.",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("day0jax_time_to_first_token_seconds", "Time from request to its first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("day0jax_inter_token_latency_seconds", "Time between a sequence's tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("day0jax_e2e_request_latency_seconds", "Time from request to its last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        """The figures read at scrape time (the registry calls this)."""
        engine = self.state.engine
        stats = engine.engine.stats() if engine is not None else {}
        for name, doc, key in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        for name, doc, key in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        if "spec_drafts" in stats:
            yield from self._speculative(stats)
        if self.state.timeline is not None:
            yield from self._startup()

    @staticmethod
    def _speculative(stats: dict):
        for name, doc, key in _SPEC_COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])
        per = CounterMetricFamily("day0jax_spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts accepted at each draft position (0: a row's first draft).",
                                  labels=["position"])
        for i, n in enumerate(stats["spec_accepted_per_position"]):
            per.add_metric([str(i)], n)
        yield per
        yield GaugeMetricFamily("day0jax_spec_decode_mean_acceptance_length",
                                "Tokens per verify step of a sequence that drafted: 1 + accepted drafts per step.",
                                value=stats["spec_mean_acceptance_length"])

    def _startup(self):
        timeline = self.state.timeline
        phases = GaugeMetricFamily("day0jax_startup_phase_seconds",
                                   "Seconds of each startup phase; 'ready' is process start to ready.",
                                   labels=["phase"])
        for name, seconds in timeline.phase_seconds().items():
            phases.add_metric([name], seconds)
        yield phases
        restored = [p for p in timeline.phases if p.name == "restore parameters" and "bytes" in p.detail]
        if restored:
            yield GaugeMetricFamily("day0jax_startup_restore_bytes", "Parameter bytes restored at startup.",
                                    value=restored[-1].detail["bytes"])
        per_program = GaugeMetricFamily("day0jax_startup_compile_seconds",
                                        "Seconds to make each program ready (lowering plus compiling or loading).",
                                        labels=["program", "shape", "cache", "source"])
        for r in timeline.compiles:
            per_program.add_metric([r.program, r.shape, r.cache, r.source], r.seconds)
        yield per_program
        programs = CounterMetricFamily("day0jax_startup_programs", "Programs made ready at startup, by cache outcome.",
                                       labels=["cache", "source"])
        for source, n in timeline.compile_counts().items():
            programs.add_metric(["miss" if source == "compiled" else "hit", source], n)
        yield programs
        at_ready = self.state.compiles_at_ready
        if at_ready is not None:
            from day0jax.startup.warmup import compile_totals

            late = CounterMetricFamily("day0jax_compiles_after_ready",
                                       "JAX traces and XLA compilations since ready, by path: 'background' (the "
                                       "programs left out of the ready set) or 'request' (on a request's path: each "
                                       "one stalls it; 0 while requests fit the compiled programs).",
                                       labels=["kind", "path"])
            for path, before in at_ready.items():
                now = compile_totals(path)
                late.add_metric(["trace", path], now["traces"] - before["traces"])
                late.add_metric(["compile", path], now["compiles"] - before["compiles"])
            yield late
        compiler = self.state.background
        if compiler is not None:
            yield GaugeMetricFamily("day0jax_programs_pending",
                                    "Programs still compiling in the background (a request needing one runs on a "
                                    "larger compiled program, or waits for its own).", value=compiler.pending)
