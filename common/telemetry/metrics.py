"""Prometheus metrics: one registry per process, served on its own HTTP port (`--metrics-port`).

Names follow Prometheus conventions: `disagg_` prefix, base units (seconds, bytes), `_total`
for counters; every series carries `model` and `role`. The router measures what clients see
(TTFT and its breakdown by part, inter-token and end-to-end latency, tokens, per-status requests, prefix-cache
hits); workers publish their engine's state (running / waiting, KV usage, free blocks) and the KV handoff
(sessions exported / pulled / expired, pull bytes and seconds); encode workers their latency.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_PART_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0)
_PULL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Engine steps: fine from a GPU decode step (~1 ms) to a CPU one (tens of ms), so a bench can read its quantiles.
_STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.0125,
                 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)

# name → (kind, help, extra label names); the one table of every metric disagg exports.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "disagg_time_to_first_token_seconds": ("histogram", "Time from request arrival to its first token.", ()),
    "disagg_ttft_breakdown_seconds": ("histogram", "A request's time to first token part by part (router_queue, "
                                      "prefill_queue, prefill_compute; then kv_handoff and first_decode_step, which a "
                                      "prefill→decode request's second token waits for), by where its prompt ran "
                                      "(mode prefill_decode or aggregated).", ("part", "mode")),
    "disagg_inter_token_latency_seconds": ("histogram", "Time between consecutive tokens of a request.", ()),
    "disagg_e2e_request_latency_seconds": ("histogram", "Time from request arrival to its last message.", ()),
    "disagg_requests_total": ("counter", "Requests finished, by gRPC status code name.", ("status",)),
    "disagg_prompt_tokens_total": ("counter", "Prompt tokens of finished requests.", ()),
    "disagg_generation_tokens_total": ("counter", "Tokens generated and delivered.", ()),
    "disagg_prefix_cache_hit_tokens_total": ("counter", "Prompt tokens served from a prefix cache.", ()),
    "disagg_requests_running": ("gauge", "Requests in the engine's running batch.", ()),
    "disagg_requests_waiting": ("gauge", "Requests queued in the engine.", ()),
    "disagg_kv_cache_usage_ratio": ("gauge", "Used KV blocks / all KV blocks, in [0, 1].", ()),
    "disagg_kv_cache_free_blocks": ("gauge", "Free KV blocks.", ()),
    "disagg_kv_sessions_active": ("gauge", "Exported KV sessions not yet released.", ()),
    "disagg_kv_sessions_exported_total": ("counter", "KV sessions exported by prefill.", ()),
    "disagg_kv_sessions_pulled_total": ("counter", "KV sessions whose blocks were pulled from this worker.", ()),
    "disagg_kv_sessions_expired_total": ("counter", "KV sessions that reached their TTL unpulled.", ()),
    "disagg_preemptions_total": ("counter", "Running requests preempted (KV freed, recomputed later) when the KV pool "
                                 "ran short.", ()),
    "disagg_kv_pull_bytes_total": ("counter", "KV bytes pulled by decode from prefill workers, by transfer backend.",
                                   ("backend",)),
    "disagg_kv_pull_seconds": ("histogram", "Duration of one KV pull, by transfer backend.", ("backend",)),
    "disagg_kv_pull_fallbacks_total": ("counter", "KV pulls that could not use a backend and fell back to the next, "
                                       "by the backend that failed.", ("backend",)),
    "disagg_kv_probe_gbps": ("gauge", "GB/s of the self-check pull from each exporter through each backend it offers "
                             "(0: that backend failed, and pulls fall back).", ("peer", "backend")),
    "disagg_kv_load_failures_total": ("counter", "KV pulls that failed, by what decode did next.", ("action",)),
    "disagg_encode_latency_seconds": ("histogram", "Duration of one Encode call (all its images).", ()),
    "disagg_routing_decisions_total": ("counter", "Prefill workers picked by the router, by policy.", ("policy",)),
    "disagg_routing_cached_tokens_total": ("counter", "Prompt tokens found in the picked prefill worker's cache: "
                                           "as the kv_aware policy predicted, and as the worker reported.",
                                           ("source",)),
    "disagg_routing_prefill_decisions_total": ("counter", "Where the router ran a request's prefill (a prefill "
                                               "worker, or locally on the decode worker) and why.",
                                               ("where", "reason")),
    "disagg_event_loop_lag_seconds": ("histogram", "How much later than asked the router's event loop ran a 50 ms "
                                      "timer while requests were in flight: what its busy loop adds to every token it "
                                      "relays and to a new request's start.", ()),
    "disagg_engine_output_wait_seconds": ("histogram", "How long a step's outputs waited for this worker's event loop "
                                          "(the engine thread handed them over → the loop took them): the loop busy, "
                                          "or the engine thread holding the GIL.", ()),
    "disagg_engine_step_seconds": ("histogram", "Wall time of one engine step on the engine thread (launch to its "
                                   "tokens booked), by kind: decode (every row one token), prefill (prompt chunks "
                                   "alone) or mixed (chunks beside decode rows).", ("kind",)),
    "disagg_engine_step_period_seconds": ("histogram", "Start of one engine step to the start of the next while the "
                                          "engine stayed busy: what a token's inter-token latency is made of. By the "
                                          "first step's kind and whether it had been launched ahead (no: async "
                                          "scheduling's pipeline was broken, a request joined or the batch changed).",
                                          ("kind", "launched_ahead")),
    "disagg_engine_step_cpu_seconds_total": ("counter", "CPU seconds the engine thread spent in its steps, by kind "
                                             "(against disagg_engine_step_seconds_sum: the rest of a step's wall time "
                                             "it waited, for the GPU, a core or the GIL).", ("kind",)),
    "disagg_engine_step_sequences_total": ("counter", "Sequences (rows) the engine steps ran, by kind (over "
                                           "disagg_engine_step_seconds_count: the mean batch).", ("kind",)),
    "disagg_grammar_compile_seconds": ("histogram", "Duration of one structured-output grammar compile that succeeded "
                                       "(a cache hit included), by grammar backend.", ("backend",)),
    "disagg_grammar_compiles_total": ("counter", "Structured-output grammar compiles by grammar backend and outcome "
                                      "(compiled; refused: tried on the other backend, or a 400 where both refuse; "
                                      "timeout: past the limit, a 400).", ("backend", "outcome")),
    "disagg_kv_tier_hit_blocks_total": ("counter", "KV blocks of prompts brought up from a tier below the device "
                                        "pool (host, disk) instead of recomputed, by tier.", ("tier",)),
    "disagg_kv_tier_hit_tokens_total": ("counter", "Prompt tokens whose KV came from a tier below the device pool: "
                                        "prefill tokens saved, by tier.", ("tier",)),
    "disagg_kv_tier_onboard_bytes_total": ("counter", "KV bytes brought up from a tier into the device pool, by tier "
                                           "(over disagg_kv_tier_onboard_seconds_sum: the bandwidth up).", ("tier",)),
    "disagg_kv_tier_onboard_seconds": ("histogram", "Reading, verifying and copying one request's blocks up from a "
                                       "tier, by tier.", ("tier",)),
    "disagg_kv_tier_offload_blocks_total": ("counter", "KV blocks stored into a tier (device evictions into host or "
                                            "disk, host evictions into disk, finished requests written through to "
                                            "a shared disk tier), by tier.", ("tier",)),
    "disagg_kv_tier_offload_bytes_total": ("counter", "KV bytes stored into a tier, by tier (over "
                                           "disagg_kv_tier_offload_seconds_sum: the bandwidth down).", ("tier",)),
    "disagg_kv_tier_offload_seconds": ("histogram", "Storing one batch of evicted blocks into a tier, by tier.",
                                       ("tier",)),
    "disagg_kv_tier_offload_failures_total": ("counter", "KV blocks a tier did not store, by tier and reason "
                                              "(queue_full: the store queue's byte bound; full: the disk or its "
                                              "budget; error: another I/O error).", ("tier", "reason")),
    "disagg_kv_tier_evictions_total": ("counter", "Cached KV blocks evicted from a tier by its LRU, by tier (device: "
                                       "sent down to the tiers).", ("tier",)),
    "disagg_kv_tier_recomputes_total": ("counter", "Stored KV blocks that failed a check on their way up and were "
                                        "recomputed instead, by tier and reason (checksum, truncated, layout, key, "
                                        "format).", ("tier", "reason")),
    "disagg_kv_tier_used_bytes": ("gauge", "Bytes a KV tier holds, by tier (disk: the whole directory's, as this "
                                  "worker last counted).", ("tier",)),
    "disagg_spec_decode_drafts_total": ("counter", "Drafts verified (a speculating row of a step with at least one "
                                        "draft token), by method.", ("method",)),
    "disagg_spec_decode_draft_tokens_total": ("counter", "Draft tokens proposed and verified, by method.",
                                              ("method",)),
    "disagg_spec_decode_accepted_tokens_total": ("counter", "Draft tokens the target accepted, by method (over "
                                                 "draft_tokens: the acceptance rate; 1 + this over drafts: the mean "
                                                 "accepted length).", ("method",)),
    "disagg_spec_decode_accepted_tokens_per_pos_total": ("counter", "Drafts whose token at this position (0: the "
                                                         "first) the target accepted, by method (over drafts: "
                                                         "acceptance by position).", ("method", "position")),
    "disagg_spec_decode_plain_steps_total": ("counter", "Steps a request of a speculating engine ran without drafts, "
                                             "by method and reason (off: its acceptance did not pay for the verify; "
                                             "no_draft: the proposer found none).", ("method", "reason")),
    "disagg_gc_pause_seconds": ("histogram", "Duration of one cyclic garbage collection in this process, by "
                                "generation: every thread waits for it (start-up objects are frozen out of it).",
                                ("generation",)),
}
_BUCKETS = {"disagg_time_to_first_token_seconds": _LATENCY_BUCKETS, "disagg_ttft_breakdown_seconds": _PART_BUCKETS,
            "disagg_inter_token_latency_seconds": _ITL_BUCKETS,
            "disagg_e2e_request_latency_seconds": _E2E_BUCKETS, "disagg_kv_pull_seconds": _PULL_BUCKETS,
            "disagg_encode_latency_seconds": _LATENCY_BUCKETS, "disagg_gc_pause_seconds": _PULL_BUCKETS,
            "disagg_engine_output_wait_seconds": _PULL_BUCKETS, "disagg_event_loop_lag_seconds": _PULL_BUCKETS,
            "disagg_grammar_compile_seconds": _PULL_BUCKETS, "disagg_engine_step_seconds": _STEP_BUCKETS,
            "disagg_engine_step_period_seconds": _STEP_BUCKETS, "disagg_kv_tier_onboard_seconds": _PULL_BUCKETS,
            "disagg_kv_tier_offload_seconds": _PULL_BUCKETS}
_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


@dataclass
class Metrics:
    """The metrics of one process; `m.get(name)` is the labelled child for this process's model and role."""

    role: str
    model: str
    registry: CollectorRegistry
    _families: dict = field(default_factory=dict)
    _children: dict = field(default_factory=dict)  # (name, *label items) → its labelled child
    _expired_seen: int = 0  # the engine's cumulative expired-session count at the last observation
    _preemptions_seen: int = 0  # and its cumulative preemptions

    @classmethod
    def create(cls, role: str, model: str) -> "Metrics":
        registry = CollectorRegistry()
        metrics = cls(role, model, registry)
        for name, (kind, help_text, extra) in METRICS.items():
            kwargs = {"buckets": _BUCKETS[name]} if kind == "histogram" else {}
            # prometheus_client appends _total to counters itself
            family_name = name.removesuffix("_total") if kind == "counter" else name
            metrics._families[name] = _KINDS[kind](family_name, help_text, ("model", "role", *extra),
                                                   registry=registry, **kwargs)
        return metrics

    def get(self, name: str, **labels: str):
        # The labelled child, looked up once: prometheus_client's labels() checks and joins the label values on
        # every call, and the router asks for some per token.
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._families[name].labels(model=self.model, role=self.role, **labels)
        return child

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP on host:port (0 picks a free port); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound


def observe_engine_load(metrics: Metrics, load) -> None:
    """Copy a worker's Load (disagg.v1.Load) into its gauges; expired sessions and preemptions count up
    monotonically."""
    metrics.get("disagg_requests_running").set(load.running_requests)
    metrics.get("disagg_requests_waiting").set(load.waiting_requests)
    metrics.get("disagg_kv_cache_usage_ratio").set(load.kv_usage_ratio)
    metrics.get("disagg_kv_cache_free_blocks").set(load.kv_blocks_free)
    metrics.get("disagg_kv_sessions_active").set(load.active_kv_sessions)
    if load.expired_kv_sessions > metrics._expired_seen:
        metrics.get("disagg_kv_sessions_expired_total").inc(load.expired_kv_sessions - metrics._expired_seen)
        metrics._expired_seen = load.expired_kv_sessions
    if load.preemptions > metrics._preemptions_seen:
        metrics.get("disagg_preemptions_total").inc(load.preemptions - metrics._preemptions_seen)
        metrics._preemptions_seen = load.preemptions


def observe_grammar_compile(metrics: Metrics, backend: str, outcome: str, seconds: float) -> None:
    """One grammar compile (common.engine.grammar.Grammars.observe)."""
    metrics.get("disagg_grammar_compiles_total", backend=backend, outcome=outcome).inc()
    if outcome == "compiled":
        metrics.get("disagg_grammar_compile_seconds", backend=backend).observe(seconds)


def observe_engine_step(metrics: Metrics, step, wall_s: float, cpu_s: float, period) -> None:
    """One engine step (AsyncLLMEngine.step_done, on the engine thread): `step` is its StepFacts, `period` the
    (StepFacts, seconds) of the step period it closed, or None."""
    metrics.get("disagg_engine_step_seconds", kind=step.kind).observe(wall_s)
    metrics.get("disagg_engine_step_cpu_seconds_total", kind=step.kind).inc(cpu_s)
    metrics.get("disagg_engine_step_sequences_total", kind=step.kind).inc(step.sequences)
    if period is not None:
        began, seconds = period
        ahead = "yes" if began.launched_ahead else "no"
        metrics.get("disagg_engine_step_period_seconds", kind=began.kind, launched_ahead=ahead).observe(seconds)
