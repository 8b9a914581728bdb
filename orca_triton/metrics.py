"""orca_gpt's Triton custom metrics (served on Triton's metrics port beside its own): counters and
histograms the response thread updates from RequestOutputs, gauges the scheduler thread publishes from
EngineStats (only those that changed). Names and labels are part of the interface: docs in README.md,
"Metrics". Beside the orca_* series, the vllm:* series of triton-inference-server/vllm_backend (and of
vLLM's own server, for the gauges it adds) under the same names, labels and buckets, so that dashboards and
autoscaling rules written for vllm_backend read orca_gpt unchanged (VllmMetrics), when the model's
REPORT_CUSTOM_METRICS parameter is "true" (vllm_backend's switch; orca_gpt's config.pbtxt sets it)."""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

from orca.core.outputs import EngineStats

COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LORA_LOAD_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
# The gauges, each named (in Metrics' families) by the EngineStats field or property it shows.
# The order _set_changed sets them in within a direction: running last, so a scrape that sees a new count of
# running requests sees the K/V that goes with it.
_GAUGES = ("waiting", "kv_total_blocks", "kv_allocated_blocks", "kv_used_tokens", "kv_allocated_slots", "n_slots",
           "prefix_cache_blocks", "lora_resident", "lora_active", "running")
# The counters published from EngineStats' cumulative fields, each named by its field: incremented by
# what the field grew since the last publish.
_COUNTERS = ("preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_verifications", "spec_proposed_tokens",
             "spec_accepted_tokens")
# vllm_backend's buckets (src/utils/metrics.py), which are vLLM's.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]
# vLLM's finish reasons (vllm:request_success_total's finished_reason label) for orca's.
VLLM_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


def build_1_2_5_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of token counts, bounded by max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


def _set_changed(gauges: dict[str, Any], shown: dict[str, Any], values: dict[str, Any]) -> None:
    """Sets each gauge whose value changed since it was last set (shown: the values last set). A scrape is not
    atomic across gauges, so the ones that fall are set before the ones that rise: a scrape between two sets
    never sees more requests (running + waiting) or more K/V than before or after the change."""
    changed = [(key, value) for key, value in values.items() if shown.get(key) != value]
    for key, value in sorted(changed, key=lambda kv: kv[1] > shown.get(kv[0], 0)):  # stable: falls first
        gauges[key].set(value)
        shown[key] = value


class _PerLabel:
    """One metric of a family per value of one extra label, made when that value first comes."""

    def __init__(self, family: Any, labels: dict[str, str], label: str) -> None:
        self._family, self._labels, self._label = family, labels, label
        self._metrics: dict[str, Any] = {}

    def __getitem__(self, value: str) -> Any:
        if value not in self._metrics:
            self._metrics[value] = self._family.Metric(labels={**self._labels, self._label: value})
        return self._metrics[value]


class Metrics:
    """Triton custom metrics (served on the metrics port with Triton's own)."""

    def __init__(self, labels: dict[str, str], report_vllm: bool = True) -> None:
        """`report_vllm`: also the vllm:* series (else none of them exists: NoVllmMetrics)."""
        self.vllm: VllmMetrics | NoVllmMetrics = VllmMetrics(labels) if report_vllm else NoVllmMetrics()
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
            "spec_verifications": fam("orca_spec_decode_num_drafts_total", "Speculative decoding: request-iterations "
                                      "that verified proposed tokens", C),
            "spec_proposed_tokens": fam("orca_spec_decode_num_draft_tokens_total", "Speculative decoding: proposed "
                                        "tokens verified", C),
            "spec_accepted_tokens": fam("orca_spec_decode_num_accepted_tokens_total", "Speculative decoding: proposed "
                                        "tokens accepted (each the token the model drew there)", C),
            "constrained": fam("orca_structured_output_requests_total", "Requests with a structured output "
                               "(JSON schema, json_object, regex, choice or grammar) submitted", C),
            "grammar_compile": fam("orca_grammar_compile_seconds", "Time to compile a structured output's grammar "
                                   "(cache hits are not compiles)", H),
            "lora_requests": fam("orca_lora_requests_total", "Requests submitted per LoRA adapter (label adapter; the "
                                 "base model's are not counted)", C),
            "lora_resident": fam("orca_lora_adapters_resident", "LoRA adapters in the workers' slots (max_loras)", G),
            "lora_active": fam("orca_lora_adapters_active", "LoRA adapters in a slot that admitted requests use", G),
            "lora_loads": fam("orca_lora_loads_total", "LoRA adapters put into a slot (from the workers' host copy, "
                              "read when the adapter was registered)", C),
            "lora_load": fam("orca_lora_load_seconds", "Time to put a LoRA adapter into a slot, in the workers", H),
        }
        f = self._families
        self.prompt = f["prompt"].Metric(labels=labels)
        self.generated = f["generated"].Metric(labels=labels)
        self._finished = _PerLabel(f["finished"], labels, "reason")
        self.ttft = f["ttft"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.tpot = f["tpot"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.e2e = f["e2e"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.batch = f["batch"].Metric(labels=labels, buckets=BATCH_BUCKETS)
        self.iteration = f["iteration"].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        self.constrained = f["constrained"].Metric(labels=labels)
        self.grammar_compile = f["grammar_compile"].Metric(labels=labels, buckets=COMPILE_BUCKETS)
        self._lora_requests = _PerLabel(f["lora_requests"], labels, "adapter")
        self.lora_load = f["lora_load"].Metric(labels=labels, buckets=LORA_LOAD_BUCKETS)
        self._lora_loads = f["lora_loads"].Metric(labels=labels)
        self._lora_loads_counted = 0
        self._gauges = {key: f[key].Metric(labels=labels) for key in _GAUGES}
        self._counters = {key: f[key].Metric(labels=labels) for key in _COUNTERS}
        self._shown: dict[str, int] = {}
        self._counted = dict.fromkeys(_COUNTERS, 0)

    def publish(self, stats: EngineStats) -> None:
        """Sets the gauges that changed and counts what the cumulative fields (preemptions, prefix cache
        look-ups and hits) grew by (scheduler thread only)."""
        _set_changed(self._gauges, self._shown, {key: getattr(stats, key) for key in self._gauges})
        for key, counter in self._counters.items():
            value = getattr(stats, key)
            if value > self._counted[key]:
                grown = value - self._counted[key]
                counter.increment(grown)
                self.vllm.counters[key].increment(grown)
            self._counted[key] = value
        if stats.lora_loads > self._lora_loads_counted:
            self._lora_loads.increment(stats.lora_loads - self._lora_loads_counted)
        self._lora_loads_counted = stats.lora_loads
        self.vllm.publish(stats)

    def lora_request(self, adapter: str | None) -> None:
        """A request submitted with a LoRA adapter (None: the base model, not counted)."""
        if adapter is not None:
            self._lora_requests[adapter].increment(1)

    def finished(self, reason: str) -> Any:
        return self._finished[reason]


class VllmMetrics:
    """vllm_backend's vllm:* series, labelled {model, version} as it labels them, with the same meanings and
    buckets; plus vLLM's own server's gauges of the scheduler and the K/V cache and its counters of
    preemptions and prefix-cache look-ups (vllm_backend reports none of those). The request-size histograms
    (bucketed up to the model's context) exist from engine_loaded on."""

    def __init__(self, labels: dict[str, str]) -> None:
        C, G, H = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM
        fam = pb_utils.MetricFamily
        self._labels = labels
        self._families = {
            "prompt": fam("vllm:prompt_tokens_total", "Number of prefill tokens processed.", C),
            "generation": fam("vllm:generation_tokens_total", "Number of generation tokens processed.", C),
            "ttft": fam("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", H),
            "tpot": fam("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", H),
            "e2e": fam("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", H),
            "request_prompt": fam("vllm:request_prompt_tokens", "Number of prefill tokens processed.", H),
            "request_generation": fam("vllm:request_generation_tokens", "Number of generation tokens processed.", H),
            "n": fam("vllm:request_params_n", "Histogram of the n request parameter.", H),
            "max_tokens": fam("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", H),
            "success": fam("vllm:request_success_total", "Count of successfully processed requests.", C),
            "running": fam("vllm:num_requests_running", "Number of requests in model execution batches.", G),
            "waiting": fam("vllm:num_requests_waiting", "Number of requests waiting to be processed.", G),
            "kv_usage": fam("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", G),
            "gpu_usage": fam("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (the older "
                             "name of vllm:kv_cache_usage_perc).", G),
            "preemptions": fam("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", C),
            "prefix_cache_queries": fam("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of "
                                        "number of queried tokens.", C),
            "prefix_cache_hits": fam("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of "
                                     "cached tokens.", C),
            "spec_verifications": fam("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", C),
            "spec_proposed_tokens": fam("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", C),
            "spec_accepted_tokens": fam("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                                        C),
        }
        f = self._families
        self.prompt = f["prompt"].Metric(labels=labels)
        self.generation = f["generation"].Metric(labels=labels)
        self.ttft = f["ttft"].Metric(labels=labels, buckets=VLLM_TTFT_BUCKETS)
        self.tpot = f["tpot"].Metric(labels=labels, buckets=VLLM_TPOT_BUCKETS)
        self.e2e = f["e2e"].Metric(labels=labels, buckets=VLLM_E2E_BUCKETS)
        self.n = f["n"].Metric(labels=labels, buckets=VLLM_N_BUCKETS)
        self.request_prompt: Any = None
        self.request_generation: Any = None
        self.max_tokens: Any = None
        self._success = _PerLabel(f["success"], labels, "finished_reason")
        self._gauges = {key: f[key].Metric(labels=labels) for key in ("running", "waiting", "kv_usage", "gpu_usage")}
        self.counters = {key: f[key].Metric(labels=labels) for key in _COUNTERS}
        self._shown: dict[str, float] = {}

    def engine_loaded(self, max_model_len: int) -> None:
        """The histograms of request sizes, bucketed 1, 2, 5, 10, ... up to the context (vLLM's)."""
        buckets = build_1_2_5_buckets(max_model_len)
        f = self._families
        self.request_prompt = f["request_prompt"].Metric(labels=self._labels, buckets=buckets)
        self.request_generation = f["request_generation"].Metric(labels=self._labels, buckets=buckets)
        self.max_tokens = f["max_tokens"].Metric(labels=self._labels, buckets=buckets)

    def publish(self, stats: EngineStats) -> None:
        usage = stats.kv_allocated_blocks / stats.kv_total_blocks if stats.kv_total_blocks else 0.0
        values = {"waiting": stats.waiting, "kv_usage": usage, "gpu_usage": usage, "running": stats.running}
        _set_changed(self._gauges, self._shown, values)

    def finished(self, reason: str | None, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                 count_n: bool = True) -> None:
        """A request ended (any reason): its size histograms, n (1; an n > 1 request's children leave it to
        params_n) and success count."""
        if self.request_prompt is not None:
            self.request_prompt.observe(num_prompt_tokens)
            self.request_generation.observe(num_output_tokens)
            self.max_tokens.observe(max_tokens)
        if count_n:
            self.n.observe(1)
        label = VLLM_FINISH_REASONS.get(reason or "", reason or "unknown")
        self._success[label].increment(1)

    def params_n(self, n: int) -> None:
        """An n > 1 request answered: vllm:request_params_n observes its n once."""
        self.n.observe(n)


class _NoMetric:
    def increment(self, value: float) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def observe(self, value: float) -> None:
        return None


class NoVllmMetrics:
    """VllmMetrics' interface with no series behind it: REPORT_CUSTOM_METRICS off, as in vllm_backend,
    where the model then reports no vllm:* series at all."""

    def __init__(self) -> None:
        nothing = _NoMetric()
        self.prompt = self.generation = self.ttft = self.tpot = self.e2e = self.n = nothing
        self.counters: dict[str, _NoMetric] = {key: nothing for key in _COUNTERS}

    def engine_loaded(self, max_model_len: int) -> None:
        return None

    def publish(self, stats: EngineStats) -> None:
        return None

    def finished(self, reason: str | None, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                 count_n: bool = True) -> None:
        return None

    def params_n(self, n: int) -> None:
        return None
