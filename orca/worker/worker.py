"""The worker: owns the device, the weights, the K/V pool and the attention path; carries out StepPlans.

Per plan it frees finished requests, extends block tables, flattens every token of every request into
(T,) rows with an explicit AttentionMetadata, runs the model once, computes logits only at sampling rows
and samples (keeping speculative draws up to the first mismatch). It decides nothing: the scheduler did.
Under parallelism each rank holds its stage's layers and its tensor-parallel share (pipeline.py). The
load's choices are resolution.py's; pool sizing memory.py's; the warm-up warmup.py's; the draft draft.py's.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from orca import tuning
from orca.checkpoint import ModelConfig, resolve_checkpoint
from orca.config import EngineConfig
from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan, StepResult
from orca.models.attention import AttentionMetadata, IterationLayout, PhaseTimer
from orca.models.device import upload
from orca.models.loader import load_model
from orca.models.lora import LoRAModel
from orca.models.quantization import QuantizedLinear
from orca.parallel import ParallelContext, local_kv_heads
from orca.worker import memory
from orca.worker.draft import DraftModel
from orca.worker.kv_cache import KVLayout
from orca.worker.pipeline import StageLink
from orca.worker.resolution import ResolvedPlan, resolve
from orca.worker.runners import EagerRunner, Runner
from orca.worker.sampler import SamplingTensors, apply_allowed_tokens, sample, token_logprobs
from orca.worker.warmup import warm_up

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them


@dataclass
class _RequestState:
    """What the worker remembers of a request between plans."""

    sampling: SamplingSpec
    block_table: list[int] = field(default_factory=list)


class Worker:
    """One device's share of the engine. In-process today (orca/executor/__init__.py); the same class serves as the
    body of a worker process."""

    def __init__(
        self, config: EngineConfig, par: ParallelContext | None = None, device: torch.device | None = None
    ) -> None:
        self.config = config
        self.device = device or config.torch_device
        self.dtype = config.torch_dtype
        self.checkpoint = resolve_checkpoint(config.model)
        # Every choice of the load and its reason (resolution.py), before the weights.
        self.resolved: ResolvedPlan = resolve(config, self.device, self.checkpoint,
                                              1 if par is None else par.tp_size * par.pp_size)
        logger.info("%s", self.resolved.table())
        self.linear_backend = self.resolved.linear
        self.no_flex_reason = self.resolved.no_flex_reason
        self.attention_backend = self.resolved.attention_backend
        self.attention: type[AttentionMetadata] = self.resolved.attention
        if self.device.type == "cuda":
            memory.release_cached_memory()  # before the weights: none of them in an earlier engine's cached pool
        self.model, self.model_config = load_model(self.checkpoint, self.dtype, self.device, par, self.linear_backend,
                                                   config.quantization, config.quantization_group_size)
        mc: ModelConfig = self.model_config
        self.par = par or ParallelContext.single(mc.num_layers)
        # Multi-LoRA (enable_lora): every adaptable linear gets max_loras slots (orca/models/lora.py).
        self.lora: LoRAModel | None = None
        if config.enable_lora:
            self.lora = LoRAModel(self.model, mc, self.par, config.max_loras, config.max_lora_rank, self.dtype,
                                  self.device)
            logger.info("LoRA: %d adapted linear layers, %d slots of rank %d (%.1f MB each)", len(self.lora.layers),
                        config.max_loras, config.max_lora_rank, self.lora.bytes_per_slot / 1e6)
        kinds = Counter(m.kind for m in self.model.modules() if isinstance(m, QuantizedLinear))
        logger.info("quantization %s -> %s", config.quantization,
                    ", ".join(f"{k} ({n} linear layers)" for k, n in sorted(kinds.items())) or "none (float weights)")
        kv_heads = local_kv_heads(mc.num_kv_heads, self.par.tp_size)
        self.kv_layout = KVLayout(len(self.par.layers), kv_heads, mc.head_dim, self.resolved.kv_dtype,
                                  config.block_size)
        self.kv_pool: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # a quantized pool's scales (kv_cache.py)
        # speculative_method draft: the draft model and its K/V pool (draft.py).
        self.draft: DraftModel | None = None
        if config.speculative_method == "draft":
            self.draft = DraftModel.load(config, self.resolved, self.dtype, self.device, mc, self.kv_layout,
                                         self.max_len(), load_model)
        # The runner (runners.py), chosen by the warm-up: CUDA graphs, else CPU graphs, else eager.
        self.no_graphs_reason = self.resolved.no_graphs_reason
        self.no_compile_reason = self.resolved.no_compile_reason
        self._requests: dict[str, _RequestState] = {}
        self.stages = StageLink(self.par, mc.hidden_size, self.dtype, self.device)  # pipeline.py
        self.runner: Runner = EagerRunner(self.model, self.par, self.stages)
        self._fault: str | None = None  # inject_fault: the next plan raises this message mid-iteration
        # Iterations must run on the thread that loaded the model (see _foreign_thread).
        self.load_thread = threading.get_ident()
        self.foreign_thread_iterations = 0

    @property
    def bytes_per_block(self) -> int:
        """What one block of the pool costs: the model's K/V, and the draft's beside it."""
        draft = 0 if self.draft is None else self.draft.layout.bytes_per_block
        return self.kv_layout.bytes_per_block + draft

    @property
    def draft_layout(self) -> KVLayout | None:
        """The draft model's K/V layout; None without one."""
        return None if self.draft is None else self.draft.layout

    def max_len(self) -> int:
        """The longest sequence the model takes: max_model_len within its positions."""
        positions = self.model_config.max_position_embeddings
        return min(self.config.max_model_len or positions, positions)

    # -- the K/V pool (memory.py) and the warm-up (warmup.py) -----------------------------------
    def determine_num_blocks(self) -> int:
        """How many K/V blocks this worker can hold (memory.determine_num_blocks)."""
        return memory.determine_num_blocks(self)

    def init_kv_pool(self, num_blocks: int) -> None:
        """Allocates the pool of `num_blocks` blocks (one more for CUDA graphs' padding rows), then warms up."""
        if num_blocks < 1:
            raise ValueError("the K/V pool needs at least one block")
        layout = self.kv_layout
        logger.info("K/V pool: %d blocks of %d tokens, %s%s (%d bytes per token%s)", num_blocks, layout.block_size,
                    str(layout.dtype).removeprefix("torch."), " with float32 scales" if layout.quantized else "",
                    layout.bytes_per_slot,
                    "" if self.draft is None else f", and {self.draft.layout.bytes_per_slot} for the draft's")
        memory.allocate_pool(self, num_blocks + 1 if self.no_graphs_reason is None else num_blocks)
        warm_up(self, num_blocks)

    def forget_requests(self) -> None:
        """Drops every request's state (after load-time iterations: the warm-up's, the profile's)."""
        self._requests.clear()

    @property
    def num_requests(self) -> int:
        """Requests this worker holds state for."""
        return len(self._requests)

    # -- iterations ------------------------------------------------------------------------------
    def inject_fault(self, message: str) -> None:
        """Fault injection for the reliability tests ($ORCA_ENGINE_FAULT kind raise): the next plan raises
        RuntimeError(message) after the model ran and before sampling, failing that plan only."""
        self._fault = message

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one iteration. An exception fails this plan only: it comes back as StepResult.error."""
        if threading.get_ident() != self.load_thread:
            self._foreign_thread()
        try:
            return self._execute(plan)
        except Exception as exc:  # noqa: BLE001 - the driver fails this iteration's requests, not the engine
            logger.exception("iteration %d failed", plan.batch_id)
            for pr in plan.requests:  # their state is now unreliable; the driver frees them anyway
                self._requests.pop(pr.request_id, None)
            return StepResult(plan.batch_id, error=f"{type(exc).__name__}: {exc}")

    def _foreign_thread(self) -> None:
        """An iteration on another thread than the one that loaded the model. On a CPU each such thread
        gets its own OpenMP team, and with more teams than cores libgomp stops spin-waiting, slowing every
        op (docs/BENCHMARKS.md, "The cause found first: two OpenMP teams in the stub"). Counted, said once."""
        self.foreign_thread_iterations += 1
        if self.foreign_thread_iterations == 1 and self.device.type == "cpu":
            logger.warning("an iteration runs on thread %d, but this worker loaded its model on thread %d: each "
                           "thread that runs torch's CPU ops gets an OpenMP team of its own, and with more of them "
                           "than cores every op pays a thread wake-up (slower steps); build and step an engine on "
                           "one thread", threading.get_ident(), self.load_thread)

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        if self.kv_pool is None:
            raise RuntimeError("the K/V pool is not initialised")
        timer = PhaseTimer(self.device) if plan.profile else None
        t0 = time.perf_counter()
        for request_id in plan.free_request_ids:
            self._requests.pop(request_id, None)
        lora_seconds = self._load_loras(plan) if plan.lora_loads or plan.lora_removed or plan.lora_added else {}
        ordered = execution_order(plan.requests)
        graph_size = self.runner.padded_size(ordered) if timer is None else None
        ids, pos, layout, sample_rows = self._prepare(ordered, timer, graph_size)
        t1 = time.perf_counter()
        par = self.par
        hidden = self.runner.forward(ids, pos, layout)  # (T, E); padded: (graph_size, E), padding rows last
        if self._fault is not None:
            message, self._fault = self._fault, None
            raise RuntimeError(message)
        result = StepResult(plan.batch_id, lora_load_seconds=lora_seconds)
        if not par.is_last_stage:
            self.stages.send(hidden)
            return result
        if sample_rows is not None:
            rows, specs, steps, sampled_ids, masks, proposals = sample_rows
            logits = self.model.compute_logits(hidden[rows])  # (B, V): no logits for other prompt rows
            if masks and par.tp_rank == 0:  # structured outputs: their disallowed tokens are never drawn
                apply_allowed_tokens(logits, masks)
            if timer is not None:
                timer.sync()
            t2 = time.perf_counter()
            if par.tp_rank == 0:  # the full logits are on every rank of the stage; one of them samples
                self._sample(logits, specs, steps, sampled_ids, proposals, plan.return_logits, result)
        else:
            if timer is not None:
                timer.sync()
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        if self.draft is not None:
            # The draft runs over this iteration's tokens too (padding rows left out), then drafts.
            num_tokens = sum(len(pr.token_ids) for pr in ordered)
            states = [self._requests[pr.request_id] for pr in ordered]
            tables = [state.block_table for state in states]
            self.draft.follow(ids[:num_tokens], pos[:num_tokens], ordered, tables, layout, timer)
            self.draft.propose(ordered, tables, [state.sampling for state in states], result)
        if timer is not None:
            timer.sync()
            t4 = time.perf_counter()
            attention = timer.seconds.get("attention", 0.0)
            result.timings = {"prepare": t1 - t0, "model": t2 - t1, "attention": attention, "sample": t3 - t2}
            if self.draft is not None:
                result.timings["draft"] = t4 - t3  # (its attention is in "attention" too)
        return result

    def _sample(self, logits: torch.Tensor, specs: list[SamplingSpec], steps: list[int], sampled_ids: list[str],
                proposals: list[tuple[int, ...]], return_logits: bool, result: StepResult) -> None:
        """Draws a token at each sampling row of `logits` (B, V) and puts each request's kept draws into
        result.sampled (with their logprobs where it asks for them, and its logits where the plan does)."""
        token_ids = sample(logits, SamplingTensors.from_specs(specs, steps, self.device))
        asking = [i for i, spec in enumerate(specs) if spec.logprobs is not None]
        # only the rows of the requests that ask pay for it; by sampling row
        row_logprobs = token_logprobs(logits, token_ids, asking, specs, range(len(specs))) if asking else {}
        tokens = token_ids.tolist()  # host sync
        first = 0
        for request_id, proposed in zip(sampled_ids, proposals):
            # Keep draws up to and including the first that differs from its proposal (orca/core/speculative.py).
            kept = 1
            while kept <= len(proposed) and tokens[first + kept - 1] == proposed[kept - 1]:
                kept += 1
            result.sampled[request_id] = tokens[first:first + kept]
            if row_logprobs:
                entries = [row_logprobs[r] for r in range(first, first + kept) if r in row_logprobs]
                if entries:
                    result.logprobs[request_id] = entries
            if return_logits:  # (no proposals while logits are captured: one row each)
                result.logits[request_id] = logits[first].detach().cpu()
            first += len(proposed) + 1

    def _load_loras(self, plan: StepPlan) -> dict[int, float]:
        """Applies the plan's LoRA changes: drops removed adapters' host copies, keeps added ones, loads
        slots from them; returns each load's seconds by lora_id. Reads no file."""
        if self.lora is None:
            raise RuntimeError("the plan loads LoRA adapters, but this worker was started without enable_lora")
        self.lora.forget(set(plan.lora_removed))
        for lora_id, adapter in plan.lora_added:
            self.lora.add(lora_id, adapter)
        seconds = {}
        for load in plan.lora_loads:
            t0 = time.perf_counter()
            self.lora.load(load.slot, load.lora_id, load.name)
            seconds[load.lora_id] = time.perf_counter() - t0
            logger.info("LoRA adapter %s into slot %d in %.1f ms", load.name, load.slot, 1e3 * seconds[load.lora_id])
        return seconds

    def _prepare(
        self, ordered: list[PlannedRequest], timer: PhaseTimer | None, padded_to: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, IterationLayout, tuple | None]:
        """Flat input ids and positions (T,), the iteration's layout, and the sampling rows: (row indices
        (B,), specs, steps, request ids, (sampling row, bitmask) of constrained ones, proposed tokens), or
        None when no request draws (one with k proposals draws at its last k + 1 rows). With `padded_to`,
        padding rows follow up to that many rows; no sampling row is one of them."""
        input_ids: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        specs: list[SamplingSpec] = []
        steps: list[int] = []
        sampled_ids: list[str] = []
        proposals: list[tuple[int, ...]] = []  # per sampling request, its proposed tokens (none mostly)
        masks: list[tuple[int, bytes]] = []  # (sampling row, allowed-token bitmask) of constrained requests
        new_blocks: list[int] = []
        lora_rows: dict[int, list[int]] = {}  # slot -> this iteration's rows of its adapter
        for pr, end in zip(ordered, itertools.accumulate(len(p.token_ids) for p in ordered)):
            if pr.lora_slot >= 0:
                lora_rows.setdefault(pr.lora_slot, []).extend(range(end - len(pr.token_ids), end))
            state = self._requests.get(pr.request_id)
            if pr.sampling is not None:
                state = self._requests[pr.request_id] = _RequestState(pr.sampling)
            elif state is None:
                raise RuntimeError(f"plan names request {pr.request_id!r}, which this worker does not hold")
            # New blocks below the request's start are the prefix cache's; only later ones are fresh.
            fresh = max(0, pr.start // self.kv_layout.block_size - len(state.block_table))
            state.block_table.extend(pr.new_block_ids)
            new_blocks.extend(pr.new_block_ids[fresh:])
            n = len(pr.token_ids)
            input_ids.extend(pr.token_ids)
            positions.extend(range(pr.start, pr.start + n))
            lengths.append(n)
            context_lens.append(pr.start)
            tables.append(state.block_table)
            if pr.sample_step is not None:
                # Draws at its last row and at each proposed token's (steps sample_step, sample_step + 1, ...).
                k = pr.num_proposed
                if pr.allowed_tokens is not None:  # one bitmask per drawn row
                    masks.extend((len(rows) + i, mask) for i, mask in enumerate(pr.allowed_tokens))
                rows.extend(range(end - 1 - k, end))
                specs.extend([state.sampling] * (k + 1))
                steps.extend(range(pr.sample_step, pr.sample_step + k + 1))
                sampled_ids.append(pr.request_id)
                proposals.append(pr.token_ids[n - k:] if k else ())
        if new_blocks and self.attention.reads_whole_blocks:  # batched and flex
            fresh_ids = upload(new_blocks, torch.int64, self.device)
            self.kv_layout.zero_blocks(self.kv_pool, fresh_ids, self.kv_scales)
            if self.draft is not None:
                self.draft.zero_blocks(fresh_ids)
        padding = 0 if padded_to is None else padded_to - len(input_ids)
        input_ids.extend([0] * padding)
        positions.extend([0] * padding)
        layout = IterationLayout(self.attention, lengths, context_lens, tables, self.kv_layout.block_size,
                                 self.kv_pool, self.kv_scales, timer, padded_to)
        if self.lora is not None:
            self.lora.batch.set_rows(lora_rows, self.device, self.dtype)
        elif lora_rows:
            raise RuntimeError("the plan runs requests with LoRA adapters, but this worker was started without "
                               "enable_lora")
        ids = upload(input_ids, torch.int64, self.device)  # (T,)
        pos = upload(positions, torch.int64, self.device)  # (T,)
        sample_rows = None
        if rows:
            sample_rows = (upload(rows, torch.int64, self.device), specs, steps, sampled_ids, masks, proposals)
        return ids, pos, layout, sample_rows


def execution_order(requests: tuple[PlannedRequest, ...]) -> list[PlannedRequest]:
    """Increments first, then short requests (up to tuning.VERIFYING_MAX_ROWS tokens after a cached prefix:
    speculation being verified), each by shortest cached prefix; then the rest in plan order. The layout
    AttentionMetadata expects (orca/models/attention/batched.py groups by these)."""
    inc: list[PlannedRequest] = []
    short: list[PlannedRequest] = []
    rest: list[PlannedRequest] = []
    most = tuning.VERIFYING_MAX_ROWS
    for r in requests:  # (one pass: a decode iteration of 256 requests sorts them at every step)
        n = len(r.token_ids)
        (rest if r.start == 0 or n > most else inc if n == 1 else short).append(r)
    inc.sort(key=_start)
    short.sort(key=_start)
    return inc + short + rest


def _start(r: PlannedRequest) -> int:
    return r.start
