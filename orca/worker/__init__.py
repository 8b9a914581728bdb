"""The worker: owns the device, the weights, the K/V pool and the attention path; carries out StepPlans.

For each plan it drops the state of the requests the plan frees, extends block tables, turns the plan into
flat tensors (every token of every request in one [T] row vector, positions, pool slots) plus an explicit
AttentionMetadata, runs the model once, computes logits only for the rows that sample, and samples one
token for each. It never sees a Request and never decides anything: the driver's scheduler did.

With parallelism (orca/executor/distributed.py runs one Worker per rank) a worker holds its pipeline stage's layers
and its tensor-parallel share of their heads, and of their K/V: every rank of every stage prepares the
same metadata from the same plan; a stage after the first receives the previous stage's [T, hidden]
activations and the last stage's first tensor-parallel rank samples.

With speculative_method draft the worker also holds the draft model and its K/V pool (``draft_pool``),
which mirrors the model's: the same blocks and block tables, shaped for the draft's layers and heads. The
draft runs over every iteration's tokens (so its keys and values follow the model's), and after the
iteration's draws it drafts each asking request's next tokens (``_draft``).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orca.checkpoint import ModelConfig, read_model_config, resolve_checkpoint
from orca.config import EngineConfig
from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan, StepResult
from orca.core.speculative import check_draft_model
from orca.models.attention import AttentionMetadata, PhaseTimer, get_backend, resolve_attention_backend
from orca.models.attention.batched import BATCHED_MAX_QUERIES
from orca.models.attention.flex import FLEX_MIN_HEAD_DIM
from orca.models.device import upload
from orca.models.layers import resolve_linear_backend
from orca.models.loader import checkpoint_bytes, load_model
from orca.models.lora import LoRAModel
from orca.models.quantization import FP8_MIN_CAPABILITY, QuantizedLinear
from orca.parallel import ParallelContext, local_kv_heads
from orca.worker.compiled import CompiledForward, why_not_compiled
from orca.worker.cuda_graphs import DecodeGraphs, graph_size_for, graph_sizes, why_no_graphs
from orca.worker.kv_cache import KVLayout, blocks_from_gpu_memory, resolve_kv_cache_dtype
from orca.worker.sampler import SamplingTensors, apply_allowed_tokens, sample, token_logprobs

logger = logging.getLogger(__name__)

PROFILE_TOKENS_WITHOUT_BUDGET = 8192
PROMPT_AND_INCREMENT_SLOTS = 3  # what prompt_and_increment_plans' iterations write


@dataclass
class _RequestState:
    """What the worker remembers of a request between plans."""

    sampling: SamplingSpec
    block_table: list[int] = field(default_factory=list)


@dataclass
class _Drafting:
    """A request the draft model drafts for in this iteration (Worker._draft): its latest token, at
    `position`, is fed next; the token drawn there is its output token number `step`; `k` steps in all,
    over `table` (its block table, and scratch blocks past it)."""

    request_id: str
    sampling: SamplingSpec
    token: int
    position: int
    step: int
    k: int
    table: list[int]


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
        # auto keeps a second copy of the weights (hybrid) only where it fits: this rank's share, estimated.
        ranks = 1 if par is None else par.tp_size * par.pp_size
        weight_bytes = checkpoint_bytes(self.checkpoint, self.dtype) // ranks
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype, weight_bytes)
        self.no_flex_reason = why_not_flex_by_default(config, self.device, self.checkpoint, ranks)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device,
                                                           self.no_flex_reason)
        if config.attention_backend == "auto" and self.device.type == "cuda" and self.no_flex_reason is not None:
            logger.info("attention_backend auto is batched, not flex, here: %s", self.no_flex_reason)
        # The backend: its metadata class, whose builder runs once per iteration and whose traits say what it
        # needs of the pool and of the load (orca/models/attention/base.py).
        self.attention: type[AttentionMetadata] = get_backend(self.attention_backend)
        # The K/V pool's dtype (kv_cache_dtype: the model's, or quantized values with scales), checked before the
        # weights load.
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        logger.info("linear_backend %s -> %s, attention_backend %s -> %s (%s on %s; weights about %.0f MB)%s",
                    config.linear_backend, self.linear_backend, config.attention_backend, self.attention_backend,
                    str(self.dtype).removeprefix("torch."), self.device, weight_bytes / 1e6,
                    "; hybrid keeps them twice" if self.linear_backend == "hybrid" else "")
        if self.device.type == "cuda":
            release_cached_memory()  # before the weights: none of them in an earlier engine's cached pool
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
        if (self.attention_backend == "flex" and self.device.type == "cuda"
                and self.model_config.head_dim < FLEX_MIN_HEAD_DIM):
            raise ValueError(f"attention_backend flex on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM} (torch's flex "
                             f"kernels); this model's is {self.model_config.head_dim}: choose batched or reference")
        if self.attention_backend == "flex" and self.device.type == "cuda" and kv_dtype == torch.float8_e4m3fn:
            capability = torch.cuda.get_device_capability(self.device)
            if capability < FP8_MIN_CAPABILITY:  # (Triton converts float8 e4m3 from compute capability 8.9 on)
                raise ValueError(
                    "kv_cache_dtype fp8_e4m3 with attention_backend flex needs a GPU of compute capability 8.9 or "
                    f"later (its paged decode kernel reads float8 e4m3); {self.device} is "
                    f"{capability[0]}.{capability[1]}: choose kv_cache_dtype int8, or attention_backend batched")
        warning = self.attention.device_warning(self.device)
        if warning is not None:
            logger.warning("%s", warning)
        kv_heads = local_kv_heads(mc.num_kv_heads, self.par.tp_size)
        self.kv_layout = KVLayout(len(self.par.layers), kv_heads, mc.head_dim, kv_dtype, config.block_size)
        self.kv_pool: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # a quantized pool's scales (kv_cache.py)
        # speculative_method draft: the draft model and its K/V pool (same blocks, its own layers and heads),
        # plus scratch blocks past the mirrored ones, where draft steps write beyond a request's blocks.
        self.draft_model: torch.nn.Module | None = None
        self.draft_layout: KVLayout | None = None
        self.draft_pool: torch.Tensor | None = None
        self.draft_scales: torch.Tensor | None = None
        self.draft_scratch_blocks = 0
        self._draft_scratch_first = 0  # the first scratch block's id in draft_pool
        if config.speculative_method == "draft":
            self._load_draft(kv_dtype)
        # CUDA graphs for decode iterations (orca/worker/cuda_graphs.py): captured in init_kv_pool when
        # why_no_graphs finds no reason against; the pool then has one block more, for padding rows.
        self.no_graphs_reason = why_no_graphs(config.cuda_graphs, self.device, self.attention_backend,
                                              self.par.layout.world_size, any(mc.moe_layers))
        self.decode_graphs: DecodeGraphs | None = None
        # The compiled forward pass (orca/worker/compiled.py): compiled in init_kv_pool when why_not_compiled
        # finds no reason against.
        self.no_compile_reason = why_not_compiled(config.effective_torch_compile, self.device,
                                                  self.attention_backend, self.par.layout.world_size, self.model)
        self.compiled: CompiledForward | None = None
        self._requests: dict[str, _RequestState] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []  # activations on their way to the next stage
        self._fault: str | None = None  # inject_fault: the next plan raises this message mid-iteration
        # The thread that loaded the model, and so ran its first OpenMP parallel regions (on a CPU), is the
        # one that must run its iterations (_foreign_thread's docstring); iterations on any other are counted.
        self.load_thread = threading.get_ident()
        self.foreign_thread_iterations = 0

    def _load_draft(self, kv_dtype: torch.dtype) -> None:
        """The draft model (EngineConfig.speculative_model), with the model's dtype, linear backend and
        quantization, and the layout of its K/V pool. One worker only (EngineConfig refuses parallelism)."""
        cfg = self.config
        checkpoint = resolve_checkpoint(cfg.speculative_model)
        self.draft_model, dc = load_model(checkpoint, self.dtype, self.device, None, self.linear_backend,
                                          cfg.quantization, cfg.quantization_group_size)
        check_draft_model(dc, self.model_config, self._max_len(), checkpoint)
        if self.attention_backend == "flex" and self.device.type == "cuda" and dc.head_dim < FLEX_MIN_HEAD_DIM:
            raise ValueError(f"attention_backend flex on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM}; the draft "
                             f"model's (speculative_model) is {dc.head_dim}: choose batched or reference")
        self.draft_layout = KVLayout(dc.num_layers, dc.num_kv_heads, dc.head_dim, kv_dtype, cfg.block_size)
        # Draft steps write up to num_speculative_tokens positions past what a request's blocks hold:
        # at most that many blocks more, for each of max_bs requests.
        self.draft_scratch_blocks = cfg.max_bs * -(-cfg.num_speculative_tokens // cfg.block_size)
        logger.info("speculative_method draft: %s (%d layers, %d bytes per token of K/V beside the model's %d)",
                    checkpoint, dc.num_layers, self.draft_layout.bytes_per_slot, self.kv_layout.bytes_per_slot)

    @property
    def bytes_per_block(self) -> int:
        """What one block of the pool costs: the model's K/V, and the draft's beside it."""
        draft = 0 if self.draft_layout is None else self.draft_layout.bytes_per_block
        return self.kv_layout.bytes_per_block + draft

    @property
    def _draft_scratch_bytes(self) -> int:
        return 0 if self.draft_layout is None else self.draft_scratch_blocks * self.draft_layout.bytes_per_block

    # -- the K/V pool ----------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """How many K/V blocks this worker can hold: n_slots or kv_cache_bytes when given; on CUDA
        otherwise what gpu_memory_utilization leaves after a profiling forward pass at the largest
        iteration; on CPU otherwise the default kv_cache_bytes. With a draft model a block holds the
        draft's keys and values too (bytes_per_block), and its scratch blocks come off the budget."""
        cfg = self.config
        if cfg.n_slots is not None:
            return cfg.n_slots // cfg.block_size
        if cfg.kv_cache_bytes is not None or self.device.type != "cuda":
            return max(0, cfg.effective_kv_cache_bytes - self._draft_scratch_bytes) // self.bytes_per_block
        return self._profile_gpu_blocks()

    def _max_len(self) -> int:
        """The longest sequence the model takes: max_model_len within its positions."""
        positions = self.model_config.max_position_embeddings
        return min(self.config.max_model_len or positions, positions)

    def _profile_gpu_blocks(self) -> int:
        cfg = self.config
        max_len = self._max_len()
        # The largest iteration: the token budget; without one, max_bs whole prompts could in principle run
        # at once, which is no useful bound (32 x 8192 tokens for SmolLM2), so the profile stops at
        # PROFILE_TOKENS_WITHOUT_BUDGET (or one full-length prompt). Set max_num_batched_tokens on a GPU to
        # bound every iteration by what was profiled.
        unbounded = min(cfg.max_bs * max_len, max(max_len, PROFILE_TOKENS_WITHOUT_BUDGET))
        num_tokens = min(cfg.max_num_batched_tokens or unbounded, cfg.max_bs * max_len)
        torch.cuda.empty_cache()  # (what an earlier engine left was collected before the weights loaded)
        torch.cuda.reset_peak_memory_stats(self.device)
        # A profiling iteration: `num_tokens` prompt tokens in sequences of max_len, on a scratch pool.
        blocks = -(-num_tokens // cfg.block_size) + cfg.max_bs
        self._allocate_pool(blocks)
        lengths = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        plan_requests, next_block = [], 0
        for i, n in enumerate(lengths):
            used = -(-n // cfg.block_size)
            plan_requests.append(PlannedRequest(
                f"profile-{i}", tuple([0] * n), 0, tuple(range(next_block, next_block + used)),
                SamplingSpec(1.0, 0, 1.0, 0), sample_step=0,
            ))
            next_block += used
        result = self.execute(StepPlan(-1, tuple(plan_requests)))
        self._requests.clear()
        if result.error:
            raise RuntimeError(f"the profiling iteration ({num_tokens} tokens) failed: {result.error}")
        torch.cuda.synchronize(self.device)
        peak = (torch.cuda.max_memory_allocated(self.device) - blocks * self.bytes_per_block
                - self._draft_scratch_bytes)
        self.kv_pool = self.kv_scales = self.draft_pool = self.draft_scales = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory in use beyond this process's live tensors (whose peak is `peak`) counts against the budget
        # too: other processes, the CUDA context, and cached segments the allocator could not release (a
        # segment part of which holds a live tensor: the pool, one allocation, cannot use its free part).
        used_elsewhere = total - free - torch.cuda.memory_allocated(self.device)
        n = blocks_from_gpu_memory(total, max(0, used_elsewhere) + peak + self._draft_scratch_bytes,
                                   cfg.gpu_memory_utilization, self.bytes_per_block)
        logger.info("K/V pool from GPU memory: %d blocks (profiled %d tokens, peak %.2f GiB)", n, num_tokens,
                    peak / 2**30)
        return n

    def init_kv_pool(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the K/V pool needs at least one block")
        layout = self.kv_layout
        logger.info("K/V pool: %d blocks of %d tokens, %s%s (%d bytes per token%s)", num_blocks, layout.block_size,
                    str(layout.dtype).removeprefix("torch."), " with float32 scales" if layout.quantized else "",
                    layout.bytes_per_slot,
                    "" if self.draft_layout is None else f", and {self.draft_layout.bytes_per_slot} for the draft's")
        if self.no_graphs_reason is None:
            self._allocate_pool(num_blocks + 1)  # the last block: padding rows' slots
        else:
            self._allocate_pool(num_blocks)
        if self.attention.compiles_at_load(self.device):
            self._warm_up_flex()
        if self.no_graphs_reason is None:
            # Captured on CUDA; elsewhere (only when a test lifts why_no_graphs' reasons) the same padded
            # iterations run eagerly on the static buffers.
            self.decode_graphs = DecodeGraphs(
                self.model, self.attention, self.kv_pool, self.kv_layout.block_size,
                pad_slot=num_blocks * self.kv_layout.block_size,
                sizes=graph_sizes(self.config.max_bs), capture=self.device.type == "cuda",
                max_blocks=-(-self._max_len() // self.kv_layout.block_size) + 1, kv_scales=self.kv_scales,
            )
        elif self.device.type == "cuda":
            logger.info("decode iterations run without CUDA graphs: %s", self.no_graphs_reason)
        if self.no_compile_reason is None and self.kv_pool.shape[3] < PROMPT_AND_INCREMENT_SLOTS:
            self.no_compile_reason = (f"the K/V pool holds fewer than the {PROMPT_AND_INCREMENT_SLOTS} slots the "
                                      "warm-up uses")
        if self.no_compile_reason is None:
            try:
                verifies = (self.config.speculative_method != "off"
                            and self.kv_pool.shape[3] >= PROMPT_AND_INCREMENT_SLOTS + VERIFICATION_ROWS)
                self.compiled = CompiledForward(self.model, None if self.lora is None else self.lora.batch, verifies)
                # The prompt compiles the graph (the token count unbacked: any count); the increment compiles
                # LoneStep's; a speculating engine's verification of 2 tokens LoneStep's of several rows.
                plans = prompt_and_increment_plans(self.kv_layout.block_size)
                if self.compiled.float_rows is not None:  # and the float copies' graph (FloatCopyRows)
                    with_float = warm_up_plans(self.kv_layout.block_size, self._max_len(), (self.compiled.float_rows,))
                    if self._pool_holds(with_float):  # (else those iterations run eagerly)
                        plans = with_float
                if verifies:  # (the prompt's request again: its blocks, and the next, stay consecutive)
                    plans += (verification_plan(self.kv_layout.block_size),)
                if self.lora is not None:  # the graph of adapter iterations too (slot 0, empty: no delta)
                    plans += tuple(dataclasses.replace(plan, requests=tuple(
                        dataclasses.replace(pr, request_id=f"{pr.request_id}-lora", lora_slot=0)
                        for pr in plan.requests)) for plan in plans)
                if self.compiled.few is not None:  # FewStep's graph: a decode step of two requests
                    with_few = plans + few_warm_up_plans(self.kv_layout.block_size, _next_block(plans))
                    if self._pool_holds(with_few):  # (else such steps run the op)
                        plans = with_few
                self.compiled.compile(lambda: self._warm_up(plans, "compiling the forward pass"), self.device)
            except Exception as exc:  # noqa: BLE001 - e.g. no C++ compiler: serve eagerly, say why
                self.compiled = None
                self.no_compile_reason = f"compiling failed ({str(exc).splitlines()[0][:300]})"
                logger.warning("the forward pass runs eagerly: %s", self.no_compile_reason)
        else:
            logger.info("the forward pass runs eagerly: %s", self.no_compile_reason)
        if self.compiled is None and self.par.layout.world_size == 1 and not self.attention.zeroed_pool \
                and self.kv_pool.shape[3] >= PROMPT_AND_INCREMENT_SLOTS:
            # A prompt and an increment now, not in the first request: oneDNN's primitives, the allocator's
            # blocks and this thread's OpenMP team are made here (the compiled path's warm-up does the same;
            # flex has its own on CUDA, and its pool, zeroed_pool, stays as allocated: zeroed).
            self._warm_up(prompt_and_increment_plans(self.kv_layout.block_size), "warming up the model")

    def _allocate_pool(self, num_blocks: int) -> None:
        """kv_pool (and a quantized pool's kv_scales) of num_blocks blocks; zeroed for a backend that weighs
        masked slots by 0 (flex; kv_cache.py)."""
        zeroed = self.attention.zeroed_pool
        self.kv_pool = self.kv_layout.allocate(num_blocks, self.device, zeroed=zeroed)
        self.kv_scales = self.kv_layout.allocate_scales(num_blocks, self.device, zeroed=zeroed)
        if self.draft_layout is not None:
            # The same blocks, then the scratch blocks (zeroed: a backend reading whole blocks needs finite
            # numbers in the slots it masks).
            layout, total = self.draft_layout, num_blocks + self.draft_scratch_blocks
            self.draft_pool = layout.allocate(total, self.device, zeroed=zeroed)
            self.draft_scales = layout.allocate_scales(total, self.device, zeroed=zeroed)
            self._draft_scratch_first = num_blocks
            if not zeroed:
                scratch = torch.arange(num_blocks, total, dtype=torch.int64, device=self.device)
                layout.zero_blocks(self.draft_pool, scratch, self.draft_scales)

    def _warm_up_flex(self) -> None:
        """Compiles the attention backend's kernels now rather than in a user's request (warm_up_plans with
        its warm_up_rows; flex's on CUDA, the one backend that compiles at load, hence the name). Writes only
        to blocks no request owns yet; skipped when the pool is too small to hold them."""
        plans = warm_up_plans(self.kv_layout.block_size, self._max_len(), self.attention.warm_up_rows)
        if not self._pool_holds(plans):
            return
        logger.info("compiling flex attention kernels for %s (once, at load) ...", self.device)
        t0 = time.perf_counter()
        self._warm_up(plans, "warming up flex attention")
        logger.info("flex attention compiled in %.1f s", time.perf_counter() - t0)

    def _pool_holds(self, plans: tuple[StepPlan, ...]) -> bool:
        """Whether the K/V pool has every block warm-up `plans` write (the highest included)."""
        return self.kv_pool is not None and _next_block(plans) * self.kv_layout.block_size <= self.kv_pool.shape[3]

    def _warm_up(self, plans: tuple[StepPlan, ...], what: str) -> None:
        """Executes load-time iterations (blocks no request owns yet) and forgets their requests."""
        for plan in plans:
            result = self.execute(plan)
            if result.error:
                raise RuntimeError(f"{what} failed: {result.error}")
        self._requests.clear()

    # -- iterations ------------------------------------------------------------------------------
    def inject_fault(self, message: str) -> None:
        """Fault injection for the reliability tests ($ORCA_ENGINE_FAULT kind raise, orca/core/engine_loop.py):
        the next plan this worker executes raises RuntimeError(message) inside the iteration, after the
        model has run (its keys and values are written) and before sampling: that plan fails, as any
        exception in an iteration would."""
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
        """An iteration on another thread than the one that loaded the model. On a CPU, every thread that
        runs torch's parallel ops gets an OpenMP team of its own (libgomp), and once a process has more
        such threads than cores libgomp stops spin-waiting, so every op pays a futex wake-up: slower decode
        steps, the more so the shorter the step (docs/BENCHMARKS.md, "The serving path"). Build and step
        an engine on one thread: LLM does, EngineLoop builds its engine on its own thread. Counted, and
        said once."""
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
        ordered = _execution_order(plan.requests)
        graph_size = self._graph_size(ordered) if timer is None else None
        ids, pos, meta, sample_rows = self._prepare(ordered, timer, graph_size)
        t1 = time.perf_counter()
        par = self.par
        if graph_size is not None:
            hidden = self.decode_graphs.run(ids, pos, meta)  # (graph_size, E), padding rows last
        elif self.compiled is not None:
            hidden = self.compiled(ids, pos, meta)  # (T, E); with LoRA, a graph with and one without adapter rows
        else:
            received = None if par.is_first_stage else self._receive_activations(ids.shape[0])
            hidden = self.model(ids, pos, meta, hidden=received)  # (T, E)
        if self._fault is not None:
            message, self._fault = self._fault, None
            raise RuntimeError(message)
        result = StepResult(plan.batch_id, lora_load_seconds=lora_seconds)
        if not par.is_last_stage:
            self._send_activations(hidden)
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
                token_ids = sample(logits, SamplingTensors.from_specs(specs, steps, self.device))
                asking = [i for i, spec in enumerate(specs) if spec.logprobs is not None]
                # only the rows of the requests that ask pay for it; by sampling row
                row_logprobs = token_logprobs(logits, token_ids, asking, specs, range(len(specs))) if asking else {}
                tokens = token_ids.tolist()  # host sync
                first = 0
                for request_id, proposed in zip(sampled_ids, proposals):
                    # A request with proposals keeps its draws up to the first that differs from the proposal
                    # at its position, that one included (orca/core/speculative.py).
                    kept = 1
                    while kept <= len(proposed) and tokens[first + kept - 1] == proposed[kept - 1]:
                        kept += 1
                    result.sampled[request_id] = tokens[first:first + kept]
                    if row_logprobs:
                        entries = [row_logprobs[r] for r in range(first, first + kept) if r in row_logprobs]
                        if entries:
                            result.logprobs[request_id] = entries
                    if plan.return_logits:  # (no proposals while logits are captured: one row each)
                        result.logits[request_id] = logits[first].detach().cpu()
                    first += len(proposed) + 1
        else:
            if timer is not None:
                timer.sync()
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        if self.draft_model is not None:
            # The draft reads its keys and values of every token the model has: it runs over this iteration's
            # tokens too (the model's padding rows, if any, left out), then drafts.
            num_tokens = sum(len(pr.token_ids) for pr in ordered)
            draft_meta = self._draft_metadata(ordered, meta, graph_size is not None, timer)
            self.draft_model(ids[:num_tokens], pos[:num_tokens], draft_meta)
            self._draft(ordered, result)
        if timer is not None:
            timer.sync()
            t4 = time.perf_counter()
            attention = timer.seconds.get("attention", 0.0)
            result.timings = {"prepare": t1 - t0, "model": t2 - t1, "attention": attention, "sample": t3 - t2}
            if self.draft_model is not None:
                result.timings["draft"] = t4 - t3  # (its attention is in "attention" too)
        return result

    def _load_loras(self, plan: StepPlan) -> dict[int, float]:
        """Drops the host copies of the plan's removed adapters, keeps those of its added ones (read by the
        driver: orca/models/lora.py read_adapter) and puts the plan's adapters into their slots
        (orca/core/lora.py) from them; returns each load's seconds by lora_id. Reads no file."""
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

    # -- the draft model (speculative_method draft) ----------------------------------------------
    def _draft_metadata(self, ordered: list[PlannedRequest], meta: AttentionMetadata, padded: bool,
                        timer: PhaseTimer | None) -> AttentionMetadata:
        """The iteration's attention metadata over the draft's pool: the model's with the pool swapped
        where nothing else in it depends on the pool (reference and batched: the same slots and blocks),
        else (flex's layout spans the pool; padding rows of a CUDA graph) built again."""
        if not padded and meta.flex is None:
            return dataclasses.replace(meta, kv_pool=self.draft_pool, kv_scales=self.draft_scales)
        return self.attention.for_iteration(
            [len(pr.token_ids) for pr in ordered], [pr.start for pr in ordered],
            [self._requests[pr.request_id].block_table for pr in ordered], self.kv_layout.block_size,
            self.draft_pool, timer, kv_scales=self.draft_scales,
        )

    def _draft(self, ordered: list[PlannedRequest], result: StepResult) -> None:
        """Drafts the next tokens of each request the plan asks to (PlannedRequest.num_to_propose, capped
        by its max_tokens) into result.proposals, after this iteration's draws. Step j runs the draft
        over one row per request still drafting: its latest token (its last drawn one, then its previous
        draft) at the next position, and draws the next token from the draft's logits with the request's
        sampling options at the output step where the model will draw when verifying it: the sampler's
        noise at a step is the same for both (orca/worker/sampler.py), so a draft close to the model
        draws what the model will, sampling too. The steps' keys and values go to the draft's pool at
        the request's next positions, in its blocks or past them in scratch blocks (never read after this
        iteration: the next one writes every position it feeds, in both pools)."""
        block_size = self.kv_layout.block_size
        scratch, scratch_end = self._draft_scratch_first, self._draft_scratch_first + self.draft_scratch_blocks
        drafting: list[_Drafting] = []
        for pr in ordered:
            kept = result.sampled.get(pr.request_id)
            if not pr.num_to_propose or not kept:
                continue
            step = pr.sample_step + len(kept)  # the output index of the first drafted token
            k = min(pr.num_to_propose, pr.max_tokens - step - 1)
            if k <= 0:
                continue
            position = pr.start + len(pr.token_ids) - pr.num_proposed + len(kept) - 1  # of the last drawn token
            table = self._requests[pr.request_id].block_table
            need = -(-(position + k) // block_size) - len(table)  # blocks the steps write past the table
            if need > 0:
                if scratch + need > scratch_end:
                    raise RuntimeError(f"draft steps need more than the {self.draft_scratch_blocks} scratch blocks")
                table = table + list(range(scratch, scratch + need))
                scratch += need
            drafting.append(_Drafting(pr.request_id, self._requests[pr.request_id].sampling, kept[-1], position,
                                      step, k, table))
            result.proposals[pr.request_id] = []
        for j in range(max((d.k for d in drafting), default=0)):
            live = [d for d in drafting if d.k > j]
            meta = self.attention.for_iteration([1] * len(live), [d.position + j for d in live],
                                                [d.table for d in live], block_size, self.draft_pool,
                                                kv_scales=self.draft_scales)
            ids = upload([d.token for d in live], torch.int64, self.device)
            pos = upload([d.position + j for d in live], torch.int64, self.device)
            logits = self.draft_model.compute_logits(self.draft_model(ids, pos, meta))  # (B, V)
            specs, steps = [d.sampling for d in live], [d.step + j for d in live]
            drawn = sample(logits, SamplingTensors.from_specs(specs, steps, self.device)).tolist()  # host sync
            for d, token in zip(live, drawn):
                d.token = token
                result.proposals[d.request_id].append(token)

    # -- pipeline stages -------------------------------------------------------------------------
    def _receive_activations(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's (T, E) output for this plan, from the same tensor-parallel rank there."""
        import torch.distributed as dist

        hidden = torch.empty(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.par.layout.rank(self.par.stage - 1, self.par.tp_rank))
        return hidden

    def _send_activations(self, hidden: torch.Tensor) -> None:
        """Sends (T, E) to the next stage without waiting for it to receive: this stage goes on with the
        next plan in flight. The previous send is completed first (its buffer must outlive it)."""
        import torch.distributed as dist

        for handle, _ in self._sends:
            handle.wait()
        hidden = hidden.contiguous()
        handle = dist.isend(hidden, dst=self.par.layout.rank(self.par.stage + 1, self.par.tp_rank))
        self._sends = [(handle, hidden)]

    def _graph_size(self, ordered: list[PlannedRequest]) -> int | None:
        """The CUDA graph size a decode iteration of these requests pads to; None when graphs are off or
        some request feeds more than one token (or none after a cached prefix)."""
        if self.decode_graphs is None or not all(len(pr.token_ids) == 1 and pr.start > 0 for pr in ordered):
            return None
        if any(pr.lora_slot >= 0 for pr in ordered):  # captured without adapter rows: those run eagerly
            return None
        return graph_size_for(len(ordered), self.decode_graphs.sizes)

    def _prepare(
        self, ordered: list[PlannedRequest], timer: PhaseTimer | None, padded_to: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, tuple | None]:
        """Flat input ids and positions (T,), the attention metadata, and the sampling rows: (row indices
        (B,), specs, steps, request ids, the (sampling row, bitmask) of the constrained ones, each request's
        proposed tokens) of the requests that draw a token (a request with k proposed tokens draws at its
        last k + 1 rows), or None when none does. With
        `padded_to`, padding rows follow the requests' up to that many rows (a CUDA graph's size); no
        sampling row is ever one of them."""
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
            # New blocks below the request's start hold keys and values computed before (the prefix
            # cache's, taken at admission): only those from its start on are fresh.
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
                # A draw at its last token's row, and with proposed tokens at each of theirs (output steps
                # sample_step, sample_step + 1, ...: the draws speculation off would make there).
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
            if self.draft_pool is not None:
                self.draft_layout.zero_blocks(self.draft_pool, fresh_ids, self.draft_scales)
        padding = 0 if padded_to is None else padded_to - len(input_ids)
        input_ids.extend([0] * padding)
        positions.extend([0] * padding)
        pad_slot = self.decode_graphs.pad_slot if padding else 0
        meta = self.attention.for_iteration(lengths, context_lens, tables, self.kv_layout.block_size, self.kv_pool,
                                            timer, padding=padding, pad_slot=pad_slot, kv_scales=self.kv_scales)
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
        return ids, pos, meta, sample_rows

    @property
    def num_requests(self) -> int:
        """Requests this worker holds state for."""
        return len(self._requests)


def why_not_flex_by_default(config: EngineConfig, device: torch.device, checkpoint: Path, ranks: int) -> str | None:
    """Why attention_backend auto is not flex on this configuration (resolve_attention_backend), or None when
    it is: flex is CUDA's default where its decode iterations run in CUDA graphs (why_no_graphs, on the
    checkpoint's config, read before the weights load) and it serves everything asked of it."""
    if device.type != "cuda":  # (why_no_graphs says so too; here before any checkpoint is read)
        return f"the device is {device.type}"
    if config.kv_cache_dtype != "auto":
        # flex reads a quantized pool (its paged decode kernel with the scales), but has not been measured
        # against batched on one: attention_backend flex chooses it.
        return (f"kv_cache_dtype {config.kv_cache_dtype} (flex over a quantized pool is not measured on a GPU "
                "yet; attention_backend flex chooses it)")
    if config.enable_lora:
        return "enable_lora (iterations with an adapter run without CUDA graphs)"
    checkpoints = [checkpoint] + ([resolve_checkpoint(config.speculative_model)]
                                  if config.speculative_method == "draft" and config.speculative_model else [])
    for path in checkpoints:
        mc, _ = read_model_config(path)
        reason = why_no_graphs(config.cuda_graphs, device, "flex", ranks, any(mc.moe_layers))
        if reason is not None:
            return reason
        if mc.head_dim < FLEX_MIN_HEAD_DIM:
            return f"head_dim {mc.head_dim} < {FLEX_MIN_HEAD_DIM} (torch's flex kernels)"
    return None


def flex_warm_up_plans(block_size: int, max_len: int) -> tuple[StepPlan, ...]:
    """The iterations that compile every graph compiled flex attention needs (its warm_up_rows, and why:
    orca/models/attention/flex.py)."""
    return warm_up_plans(block_size, max_len, get_backend("flex").warm_up_rows)


def warm_up_plans(block_size: int, max_len: int, rows: Sequence[int]) -> tuple[StepPlan, ...]:
    """The iterations that compile an attention backend's kernels at load: a two-token prompt, its
    one-token increment, then an iteration of each of `rows` token rows (the backend's warm_up_rows), each
    as prompts of at most `max_len` tokens (the model's positions), in blocks taken in order from the
    first. Every layer runs (sliding-window layers compile their own mask)."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    plans = list(prompt_and_increment_plans(block_size))
    next_block = -(-PROMPT_AND_INCREMENT_SLOTS // block_size)

    def blocks(before: int, after: int) -> tuple[int, ...]:
        nonlocal next_block
        n = -(-after // block_size) - -(-before // block_size)
        next_block += n
        return tuple(range(next_block - n, next_block))

    for k, num_rows in enumerate(rows):
        name = f"warm-up-{chr(ord('b') + k)}"  # (warm-up-a: the prompt and its increment)
        lengths = [max_len] * (num_rows // max_len) + ([num_rows % max_len] if num_rows % max_len else [])
        plans.append(StepPlan(-1, tuple(
            PlannedRequest(f"{name}-{i}", (0,) * n, 0, blocks(0, n), spec, sample_step=0) for i, n in enumerate(lengths)
        )))
    return tuple(plans)


def prompt_and_increment_plans(block_size: int) -> tuple[StepPlan, StepPlan]:
    """A two-token prompt and its one-token increment, in the pool's first blocks (PROMPT_AND_INCREMENT_SLOTS
    slots): the compiled forward pass's warm-up (orca/worker/compiled.py), and the first two iterations of
    an attention backend's (warm_up_plans)."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    prompt_blocks, all_blocks = -(-2 // block_size), -(-PROMPT_AND_INCREMENT_SLOTS // block_size)
    return (
        StepPlan(-1, (PlannedRequest("warm-up-a", (0, 0), 0, tuple(range(prompt_blocks)), spec, sample_step=0),)),
        StepPlan(-1, (PlannedRequest("warm-up-a", (0,), 2, tuple(range(prompt_blocks, all_blocks)), sample_step=1),)),
    )


VERIFICATION_ROWS = 2  # what verification_plan's iteration writes, after prompt_and_increment_plans'


def verification_plan(block_size: int) -> StepPlan:
    """After prompt_and_increment_plans' two, their request's next VERIFICATION_ROWS tokens (as a speculating
    stream verifies its proposals), its blocks still consecutive: what compiles LoneStep's graph of
    several rows (orca/worker/compiled.py)."""
    before = PROMPT_AND_INCREMENT_SLOTS
    blocks = tuple(range(-(-before // block_size), -(-(before + VERIFICATION_ROWS) // block_size)))
    return StepPlan(-1, (PlannedRequest("warm-up-a", (0,) * VERIFICATION_ROWS, before, blocks),))


def few_warm_up_plans(block_size: int, first_block: int) -> tuple[StepPlan, StepPlan]:
    """Two two-token prompts, then a step of one token each, in blocks from `first_block` on: what compiles
    FewStep's graph (orca/worker/compiled.py)."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    prompt_blocks, all_blocks = -(-2 // block_size), -(-3 // block_size)
    firsts = (first_block, first_block + all_blocks)
    names = ("warm-up-few-0", "warm-up-few-1")
    return (
        StepPlan(-1, tuple(PlannedRequest(name, (0, 0), 0, tuple(range(b, b + prompt_blocks)), spec, sample_step=0)
                           for name, b in zip(names, firsts))),
        StepPlan(-1, tuple(PlannedRequest(name, (0,), 2, tuple(range(b + prompt_blocks, b + all_blocks)),
                                          sample_step=1) for name, b in zip(names, firsts))),
    )


def _next_block(plans: tuple[StepPlan, ...]) -> int:
    """The first block after every block warm-up `plans` write."""
    return 1 + max((b for plan in plans for pr in plan.requests for b in pr.new_block_ids), default=-1)


def _execution_order(requests: tuple[PlannedRequest, ...]) -> list[PlannedRequest]:
    """Increments (one token after a cached prefix) first, shortest cached prefix first; then short requests
    (up to BATCHED_MAX_QUERIES tokens after a cached prefix: speculating requests verifying their proposed
    tokens), likewise; then the rest in plan order. The layout AttentionMetadata expects: one-token requests
    share their merge, and the batched backend groups increments, then short requests, of similar lengths
    (orca/models/attention/batched.py)."""
    inc: list[PlannedRequest] = []
    short: list[PlannedRequest] = []
    rest: list[PlannedRequest] = []
    for r in requests:  # (one pass: a decode iteration of 256 requests sorts them at every step)
        n = len(r.token_ids)
        (rest if r.start == 0 or n > BATCHED_MAX_QUERIES else inc if n == 1 else short).append(r)
    inc.sort(key=_start)
    short.sort(key=_start)
    return inc + short + rest


def _start(r: PlannedRequest) -> int:
    return r.start


def release_cached_memory() -> None:
    """Frees what an earlier engine of this process left on the GPU: a dropped engine caught in a reference
    cycle (collected now, not at some later collection), then the allocator's cached segments. Measured on
    an H200: a benchmark's second engine, created while the first awaited collection, put its weights into
    the first's cached 122 GiB pool segment, which then could not be released, and its own pool, sized as
    if it could, did not fit (CUDA out of memory)."""
    gc.collect()
    torch.cuda.empty_cache()
