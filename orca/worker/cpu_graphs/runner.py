"""The CPU graphs runner: the model's forward pass as torch.compile graphs on a CPU, one dispatcher that
picks the graph of each iteration and declares the warm-up iterations that compile them all at load.

Eager PyTorch pays a fixed cost per op: a decode step of SmolLM2-135M runs about 2,000, most on a few
hundred numbers; inductor fuses the norms, rotary embedding, SiLU and residual adds into a few C++ loops.
The graphs (docs/BENCHMARKS.md, "Results: the compiled forward pass on a CPU" and the headings cited in
steps.py, head.py):
- the graph of every token count (views.py: attention, packed linears and LoRA deltas as opaque ops),
  the token count unbacked: one graph serves prompts, chunks, mixed and decode batches alike; with float
  copies (linear_backend hybrid) a second, of the float view, for iterations of `float_rows` rows or more;
- a lone request's decode step and verification, and a decode step of 2 to tuning.FEW_MAX_ROWS requests,
  each with attention inside its graph (steps.py), on an unquantized pool with no sliding window;
- an int8 LM head's matmul (head.py).

Guards: the later layers' tensor guards are not installed (inductor.guards_to_keep), and after the warm-up
only the guards that tell the graphs apart run (`skip_guard_eval_unsafe`); an input no graph fits would run
eagerly rather than compile inside a request (stance "eager_on_recompile"). The tests run every guard and
fail on any recompilation (`all_guards`, `stance`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from orca import tuning
from orca.core.plan import PlannedRequest, StepPlan
from orca.models.attention import IterationLayout
from orca.models.lora import LoRABatch
from orca.models.quantization import QuantizedLinear, float_rows
from orca.worker import warmup_plans
from orca.worker.cpu_graphs.decode_attention import StepInputs, few_inputs, lone_inputs
from orca.worker.cpu_graphs.head import CompiledHead
from orca.worker.cpu_graphs.inductor import (
    GRAPH_OPTIONS,
    RECOMPILE_LIMIT,
    guards_to_keep,
    utf8_text_encoding,
    weights_fingerprint,
)
from orca.worker.cpu_graphs.steps import GraphStep, few_step, lone_rows_step, lone_step
from orca.worker.cpu_graphs.views import OPAQUE_ATTENTION, graph_view, iteration_scope

logger = logging.getLogger(__name__)


class CPUGraphs:
    """Runs each iteration through one of the model's compiled graphs. Call `compile(warm_up)` once at load
    with the iterations of `warm_up_plans`; later calls never compile."""

    def __init__(self, model: nn.Module, lora_batch: LoRABatch | None = None, verifies: bool = False) -> None:
        utf8_text_encoding()
        self.model = model
        self.lora_batch = lora_batch  # (enable_lora) the iteration's adapter rows: the steps run none
        self.float_rows = float_rows(model)  # from this many rows the float view's graph; None: no float copies
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        options = {"guard_filter_fn": guards_to_keep}
        view = graph_view(model)
        self.compiled = torch.compile(view, dynamic=True, options=options)
        self.compiled_float = (None if self.float_rows is None
                               else torch.compile(graph_view(model, float_copies=True), dynamic=True, options=options))
        self.head = CompiledHead.install(model, self)
        # The steps' graphs hold the weights frozen in where a decoder layer is int8 (inductor's int8 template
        # wins there): docs/BENCHMARKS.md, "Results: a single stream through its block table; int8's frozen graphs".
        head = getattr(model, "lm_head", None)
        frozen = any(isinstance(m, QuantizedLinear) and m.kind == "int8" and m is not head for m in model.modules())
        windowed = any(getattr(m, "window", None) is not None for m in model.modules())
        self.lone: GraphStep | None = None if windowed else lone_step(view, frozen)
        self.lone_rows: GraphStep | None = lone_rows_step(view, frozen) if verifies and not windowed else None
        self.few: GraphStep | None = None if windowed else few_step(view)
        self._fingerprint: str | None = None
        self.ready = False
        self.compile_seconds: float | None = None
        self.stance = "eager_on_recompile"  # after the warm-up (the tests make it fail on any compilation)
        self.all_guards = False  # after the warm-up, only the guards that tell graphs apart (the tests: all)

    @property
    def fingerprint(self) -> str:
        """weights_fingerprint(self.model), computed once (by the first frozen graph's compiling)."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model)
        return self._fingerprint

    # -- an iteration ---------------------------------------------------------------------------------
    def padded_size(self, ordered: list[PlannedRequest]) -> int | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout) -> torch.Tensor:
        picked = self._step(layout, input_ids.shape[0])
        if picked is not None:
            step, inputs = picked
            return step(input_ids, positions, layout.kv_pool, layout.block_size, inputs(layout), self.stance,
                        self.all_guards, self.fingerprint)
        floats = self.float_rows is not None and input_ids.shape[0] >= self.float_rows
        compiled = self.compiled_float if floats else self.compiled
        with iteration_scope(layout.metadata()):
            if not self.ready:  # the warm-up: compiles, in this process
                import torch._inductor.config as inductor_config

                torch._dynamo.decorators.mark_unbacked(input_ids, 0)  # any token count, one included: one graph
                torch._dynamo.decorators.mark_unbacked(positions, 0)
                with inductor_config.patch(**GRAPH_OPTIONS):
                    return compiled(input_ids, positions, OPAQUE_ATTENTION)
            with torch.compiler.set_stance(self.stance, skip_guard_eval_unsafe=not self.all_guards):
                return compiled(input_ids, positions, OPAQUE_ATTENTION)

    def _step(self, layout: IterationLayout, rows: int
              ) -> tuple[GraphStep, Callable[[IterationLayout], StepInputs]] | None:
        """The step graph that runs the iteration, with its inputs' builder; None: the graph of every token
        count. A step runs none of: a quantized pool, adapter rows, the float view's rows, a profiling timer
        (which times attention by itself)."""
        if (layout.timer is not None or layout.kv_scales is not None
                or (self.lora_batch is not None and self.lora_batch.active)
                or (self.float_rows is not None and rows >= self.float_rows)):
            return None
        lengths, context_lens = layout.lengths, layout.context_lens
        if len(lengths) == 1 and context_lens[0] > 0:
            step = (self.lone if lengths[0] == 1 else
                    self.lone_rows if lengths[0] <= tuning.VERIFYING_MAX_ROWS else None)
            return None if step is None else (step, lone_inputs)
        if (self.few is not None and 2 <= len(lengths) <= tuning.FEW_MAX_ROWS and all(n == 1 for n in lengths)
                and all(context_lens)):
            return self.few, few_inputs
        return None

    # -- the load -------------------------------------------------------------------------------------
    def warm_up_plans(self, block_size: int, max_len: int, pool_slots: int, lora: bool) -> tuple[StepPlan, ...]:
        """The iterations that compile every graph, in a pool of `pool_slots` slots: a prompt (the graph of
        every token count) and its increment (the lone step); with float copies an iteration of float_rows
        rows; the verification of 2 tokens (the lone verification); with `lora` each again with adapter
        rows; a decode step of two requests (the few step). A graph whose iterations the pool cannot hold
        is left uncompiled (`compile` says so)."""
        def fits(plans: tuple[StepPlan, ...]) -> bool:
            return warmup_plans.blocks_after(plans) * block_size <= pool_slots

        plans = warmup_plans.prompt_and_increment_plans(block_size)
        if self.float_rows is not None:
            with_float = warmup_plans.warm_up_plans(block_size, max_len, (self.float_rows,))
            if fits(with_float):
                plans = with_float
        if self.lone_rows is not None:  # (the prompt's request again: its blocks stay consecutive)
            plans += (warmup_plans.verification_plan(block_size),)
        if lora:  # (slot 0, empty: no delta)
            plans += tuple(dataclasses.replace(plan, requests=tuple(
                dataclasses.replace(pr, request_id=f"{pr.request_id}-lora", lora_slot=0)
                for pr in plan.requests)) for plan in plans)
        if self.few is not None:
            with_few = plans + warmup_plans.few_warm_up_plans(block_size, warmup_plans.blocks_after(plans))
            if fits(with_few):
                plans = with_few
        return plans

    def compile(self, warm_up: Callable[[], None], device: torch.device) -> None:
        """Runs `warm_up()` (iterations through this runner: each compiles the graph it takes) and marks it
        ready; a step graph no warm-up iteration took is dropped (its iterations take the graph of every
        token count)."""
        logger.info("compiling the model's forward pass for %s with torch.compile (once, at load: for a "
                    "135M model on 2 cores about 30 s with inductor's on-disk cache warm, 200 s cold) ...", device)
        t0 = time.perf_counter()
        try:
            warm_up()
            if self.head is not None and not self.head.ready:
                raise RuntimeError("the warm-up never reached the LM head")
            for name, what in (("lone", "single-stream decode steps"), ("lone_rows", "a single stream's verifications"),
                               ("few", f"decode steps of 2-{tuning.FEW_MAX_ROWS} requests")):
                step = getattr(self, name)
                if step is not None and not step.ready:
                    logger.info("%s run the graph of every token count: the warm-up ran none", what)
                    setattr(self, name, None)
        except BaseException:  # the model runs eagerly then (the worker says why): its head too
            if self.head is not None:
                self.head.uninstall()
            raise
        self.compile_seconds = time.perf_counter() - t0
        self.ready = True
        logger.info("forward pass compiled in %.1f s", self.compile_seconds)
