"""orca_gpt's Triton custom metrics (served on Triton's metrics port beside its own): counters and
histograms the response thread updates from RequestOutputs, gauges the scheduler thread publishes from
EngineStats (only those that changed). Names and labels are part of the interface: docs in README.md,
"Metrics"."""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

from orca.core.engine import EngineStats

COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# The gauges, each named (in Metrics' families) by the EngineStats field or property it shows.
_GAUGES = ("running", "waiting", "kv_total_blocks", "kv_allocated_blocks", "kv_used_tokens", "kv_allocated_slots",
           "n_slots", "prefix_cache_blocks")
# The counters published from EngineStats' cumulative fields, each named by its field: incremented by
# what the field grew since the last publish.
_COUNTERS = ("preemptions", "prefix_cache_queries", "prefix_cache_hits")


class Metrics:
    """Triton custom metrics (served on the metrics port with Triton's own)."""

    def __init__(self, labels: dict[str, str]) -> None:
        C, G, H = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM
        fam = pb_utils.MetricFamily
        self._families = {
            "prompt": fam("orca_prompt_tokens_total", "Prompt tokens of admitted requests", C),
            "generated": fam("orca_generated_tokens_total", "Generated tokens", C),
            "finished": fam("orca_requests_finished_total", "Finished requests by finish reason", C),
            "ttft": fam("orca_time_to_first_token_seconds", "Arrival to first token", H),
            "tpot": fam("orca_time_per_output_token_seconds", "Per-token time after the first", H),
            "e2e": fam("orca_request_latency_seconds", "Arrival to final response", H),
            "batch": fam("orca_iteration_batch_size", "Requests per iteration", H),
            "iteration": fam("orca_iteration_seconds", "Duration of an iteration in the workers (the model's time: "
                             "plan submitted to result collected)", H),
            "preemptions": fam("orca_preemptions_total", "Requests preempted (K/V blocks freed, recomputed later)", C),
            "running": fam("orca_running_requests", "Admitted requests (holding K/V blocks)", G),
            "waiting": fam("orca_waiting_requests", "Requests waiting for admission (new or preempted)", G),
            "kv_total_blocks": fam("orca_kv_total_blocks", "K/V blocks in the pool", G),
            "kv_allocated_blocks": fam("orca_kv_allocated_blocks", "K/V blocks held by requests", G),
            "kv_used_tokens": fam("orca_kv_used_tokens", "Tokens whose keys and values the pool holds", G),
            "kv_allocated_slots": fam("orca_kv_reserved_slots", "K/V slots in allocated blocks", G),
            "n_slots": fam("orca_kv_slots", "K/V slots in the pool (n_slots)", G),
            "prefix_cache_queries": fam("orca_prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                                        "cache at admission", C),
            "prefix_cache_hits": fam("orca_prefix_cache_hits_total", "Prompt tokens found in the prefix cache at "
                                     "admission (their keys and values not computed again)", C),
            "prefix_cache_blocks": fam("orca_prefix_cache_blocks", "K/V blocks holding cached, reusable keys and "
                                       "values", G),
            "constrained": fam("orca_structured_output_requests_total", "Requests with a structured output "
                               "(JSON schema, json_object, regex, choice or grammar) submitted", C),
            "grammar_compile": fam("orca_grammar_compile_seconds", "Time to compile a structured output's grammar "
                                   "(cache hits are not compiles)", H),
        }
        f = self._families
        self.prompt = f["prompt"].Metric(labels=labels)
        self.generated = f["generated"].Metric(labels=labels)
        self._finished_labels = labels
        self._finished: dict[str, Any] = {}
        self.ttft = f["ttft"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.tpot = f["tpot"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.e2e = f["e2e"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.batch = f["batch"].Metric(labels=labels, buckets=BATCH_BUCKETS)
        self.iteration = f["iteration"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.constrained = f["constrained"].Metric(labels=labels)
        self.grammar_compile = f["grammar_compile"].Metric(labels=labels, buckets=COMPILE_BUCKETS)
        self._gauges = {key: f[key].Metric(labels=labels) for key in _GAUGES}
        self._counters = {key: f[key].Metric(labels=labels) for key in _COUNTERS}
        self._shown: dict[str, int] = {}
        self._counted = dict.fromkeys(_COUNTERS, 0)

    def publish(self, stats: EngineStats) -> None:
        """Sets the gauges that changed and counts what the cumulative fields (preemptions, prefix cache
        look-ups and hits) grew by (scheduler thread only)."""
        for key, gauge in self._gauges.items():
            value = getattr(stats, key)
            if self._shown.get(key) != value:
                gauge.set(value)
                self._shown[key] = value
        for key, counter in self._counters.items():
            value = getattr(stats, key)
            if value > self._counted[key]:
                counter.increment(value - self._counted[key])
            self._counted[key] = value

    def finished(self, reason: str) -> Any:
        if reason not in self._finished:
            labels = {**self._finished_labels, "reason": reason}
            self._finished[reason] = self._families["finished"].Metric(labels=labels)
        return self._finished[reason]
