"""Prometheus metrics of the server: request and token counters, latency histograms, engine gauges, startup.

Counters and histograms are updated where things happen (the request handlers); the engine's gauges (queue,
batch, KV pages, prefix cache) and the startup timeline (phases, compiled programs and where each came from,
traces and compiles since ready) are read at scrape time by collectors, so they are never stale. One registry
per server, so tests can run several in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        stats = engine.engine.stats() if engine is not None else {}
        gauges = [
            ("day0jax_num_requests_waiting", "Sequences waiting to be scheduled (the queue depth).", "waiting"),
            ("day0jax_num_requests_running", "Sequences in the running batch.", "running"),
            ("day0jax_kv_blocks_used", "KV cache pages held by sequences.", "kv_blocks_used"),
            ("day0jax_kv_blocks_free", "KV cache pages free (cached prefixes included).", "kv_blocks_free"),
            ("day0jax_kv_blocks_total", "KV cache pages in the pool.", "kv_blocks_total"),
        ]
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], stats.get(key, 0))
            yield g
        counters = [
            ("day0jax_prefix_cache_hits", "KV pages reused from the prefix cache.", "prefix_hit_blocks"),
            ("day0jax_prefix_cache_queries", "KV pages looked up in the prefix cache.", "prefix_query_blocks"),
            ("day0jax_prefix_cache_hit_tokens", "Prompt tokens not recomputed thanks to the prefix cache.",
             "prefix_hit_tokens"),
            ("day0jax_num_preemptions", "Sequences preempted for lack of KV pages.", "preemptions"),
            ("day0jax_engine_steps", "Engine steps run.", "steps"),
        ]
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], stats.get(key, 0))
            yield c


class _StartupCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        timeline = self.state.timeline
        if timeline is None:
            return
        phases = GaugeMetricFamily("day0jax_startup_phase_seconds",
                                   "Seconds of each startup phase; 'ready' is process start to ready.",
                                   labels=["phase"])
        for name, seconds in timeline.phase_seconds().items():
            phases.add_metric([name], seconds)
        yield phases
        restored = [p for p in timeline.phases if p.name == "restore parameters" and "bytes" in p.detail]
        if restored:
            g = GaugeMetricFamily("day0jax_startup_restore_bytes", "Parameter bytes restored at startup.")
            g.add_metric([], restored[-1].detail["bytes"])
            yield g
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

            now = compile_totals()
            late = CounterMetricFamily("day0jax_compiles_after_ready",
                                       "JAX traces and XLA compilations since ready (each one stalls a request; "
                                       "0 when warm-up covered every program).", labels=["kind"])
            late.add_metric(["trace"], now["traces"] - at_ready["traces"])
            late.add_metric(["compile"], now["compiles"] - at_ready["compiles"])
            yield late


class Metrics:
    """The server's registry and instruments."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        r = self.registry
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
        r.register(_EngineCollector(state))
        r.register(_StartupCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)
