"""The compiled iteration: the model's forward pass as torch.compile graphs on a CPU.

Eager PyTorch pays a fixed cost per op (dispatch, an output allocation, Python around it): a decode step
of SmolLM2-135M runs about 2,000 of them, most on a few hundred numbers, and on this 2-core CPU they cost
a fifth of the step beside the matmuls that stream the weights. Inductor fuses the norms, rotary
embedding, SiLU and residual adds into a few C++ loops, and its wrapper calls them without Python in
between.

What a graph holds: the whole forward pass but two opaque ops (three with LoRA), which it calls as they are
(the int8/int4 kernels of quantized layers are aten ops it calls directly):
- attention, ``orca::selective_attention`` (orca/models/attention/base.py): the per-request split reads the
  iteration's layout, which the worker puts in scope (``iteration_scope``) around each call;
- the oneDNN-packed linears, ``orca::packed_linear`` (orca/models/layers.py): oneDNN's matmul on the weights
  packed at load, the fastest matmul measured here at decode sizes (inductor would otherwise pick MKL's,
  slower at 1 row); with linear_backend hybrid, F.linear on the checkpoint's weights from HYBRID_MIN_ROWS
  rows (the op chooses at run time: the graph's token count is dynamic), and the quantized layers' float
  copies, in a graph of their own: iterations of `float_rows` rows or more run it (FloatCopyRows, in
  orca/models/quantization.py: the choice made before the call, one graph per answer, both compiled at
  load);
- with enable_lora, in iterations with adapter rows, each adapted linear's deltas, ``orca::lora_add_``
  (orca/models/lora.py): a second graph, traced with adapter rows and compiled at load by a second pair
  of warm-up iterations; the first, without adapter rows, has no LoRA op at all.

A single stream's decode step, the iteration that pays most for the opaque attention op (its write, Python and
SDPA call ~85 us a layer at one row, SmolLM2, 300 cached keys), has a graph of its own with attention inside
it: LoneStep, below (1.17-1.24x faster steps here, 1.30x where the request's blocks are not consecutive,
docs/BENCHMARKS.md); where the engine speculates, so does such a stream's verification of its proposed tokens
(a second LoneStep, of up to VERIFYING_MAX_ROWS rows). A decode step of 2 to FEW_MAX_ROWS (5) requests has one
too, each request's row over its own block table (both thresholds orca/tuning.py's): FewStep (1.17-1.31x
faster steps at 2-5 requests, SmolLM2 as shipped; its compile about 80 s of a cold load, 7 s of a warm one).
With int8 layers its graphs hold the weights as constants, for inductor's int8 GEMM template (an int8
model's single-stream step 1.57x faster).

Shapes: the token count is an unbacked dynamic size (``torch._dynamo.decorators.mark_unbacked``), so one graph
serves every iteration, of one row or thousands (prompts, chunks, mixed and decode batches alike): a
backed dynamic size would have dynamo specialise one row and compile a one-row graph of its own, which
cost 9 s more at load here and decoded no faster (with attention still an opaque op). It is compiled at
load by the warm-up iterations (two rows, then one, which LoneStep runs, then with float copies one of
float_rows rows, then two prompts and their step, which FewStep runs), with a progress message;
afterwards an input the graph does not fit (none is known) would run eagerly rather than compile inside a
user's request
(``torch.compiler.set_stance("eager_on_recompile")``).

Guards: before each call dynamo checks that the inputs still fit the graph. It checked every tensor of
the model too, and that no two of its buffers alias: about 1 ms a call for SmolLM2's ~700 tensors, 7% of
a single-stream decode step here. The model's tensors are made at load and never replaced, and its layers
are built alike, so the later layers' tensor guards are not installed (``_guards_to_keep``; the first
layer's and the model's own tell another model of the same class apart), and after the warm-up only the
guards that tell the graphs apart run (``skip_guard_eval_unsafe``: the token inputs', the first layer's
tensors', which graph an iteration takes with LoRA or float copies, and any that ever failed): 0.1 ms.
The tests run every guard (``all_guards``) and fail on any recompilation, which shows the skipped ones
hold.

Compiled in the worker's own process
(``compile_threads=1``: inside Triton's stub ``sys.executable`` is not Python, and inductor's compile
workers are started from it). Inductor reads its own UTF-8 source templates with open()'s default
encoding, the locale's; the stub embeds Python with an isolated configuration (no UTF-8 mode, the C
locale kept), where that is ASCII, so compiling first switches such a process's LC_CTYPE to C.UTF-8.

The LM head: it runs after the graph, on the sampled rows alone. Where it is an int8 layer (the
default model's head is GGUF Q8_0: int8), its int8 kernel's matmul is compiled as a graph of its own
(CompiledHead) with inductor's weight-only GEMM template, chosen against torch's kernel by measurement at
load (max_autotune, the weight frozen into the graph as a constant the template packs for itself):
SmolLM2's 49152 x 576 int8 head at one row took 0.8 ms against torch._weight_int8pack_mm's 2.0 (1-3 rows
2.4-2.5x; a single-stream decode step 1.09-1.17x faster, docs/BENCHMARKS.md). The price: the packed copy
of the head's weight (28 MB for SmolLM2) and 2-10 s of load.

Used where measured to win: a CPU, attention_backend reference or batched, a dense model, one worker. On
CUDA decode iterations replay CUDA graphs instead (orca/worker/cuda_graphs.py) and compiling is not yet
measured there; a mixture-of-experts layer reads per-expert token counts on the host; the distributed
workers exchange activations between layers through gloo/NCCL calls that the graph does not hold.
`torch_compile: off`, or any of these, runs the eager forward pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import locale
import logging
import re
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from orca import tuning
from orca.models.attention import AttentionMetadata, get_backend, iteration_scope
from orca.models.attention.base import FewDecode, LoneDecode
from orca.models.attention.reference import ReferenceMetadata
from orca.models.lora import LoRABatch
from orca.models.moe import SparseMoE
from orca.models.quantization import FLOAT_COPY_ROWS, QuantizedLinear, float_rows

logger = logging.getLogger(__name__)


def why_not_compiled(choice: str, device: torch.device, attention_backend: str, world_size: int,
                     model: nn.Module) -> str | None:
    """Why the forward pass runs eagerly (EngineConfig.torch_compile, resolved, and the conditions above),
    or None when it is compiled."""
    if choice == "off":
        return "torch_compile is off"
    if device.type != "cpu":
        return f"the device is {device.type}, not a CPU (compiling is measured on a CPU only; CUDA has cuda_graphs)"
    if not get_backend(attention_backend).in_compiled_forward:
        return f"attention_backend is {attention_backend} (compiling runs reference or batched attention as one op)"
    if world_size > 1:
        return "several ranks (their activations cross processes between layers)"
    if any(isinstance(m, SparseMoE) for m in model.modules()):
        return "a mixture-of-experts layer counts its tokens per expert on the host"
    return None


RECOMPILE_LIMIT = 64

# Inductor's options for every graph compiled here. compile_threads=1: see above. No size, stride or
# alignment asserts in the graphs' wrappers: they checked each input and each output of an opaque op (the
# int4/int8 kernels, attention) at every call, 576 checks a SmolLM2 step at 0.44 us each, 0.25 ms of a
# ~10 ms single-stream step; the inputs are the guarded token tensors and the model's own tensors, made at
# load and never replaced, and the ops' outputs are those the fake kernels say (the tests compare every
# compiled graph with the eager model).
GRAPH_OPTIONS = {"compile_threads": 1, "size_asserts": False, "alignment_asserts": False}

# The graphs of LoneStep and CompiledHead, further: the model's weights frozen into them as constants
# (inductor's freezing), so that its weight-only GEMM templates may pack the int8 and int4 weights for
# themselves, and max_autotune choosing, by measuring both at load, a template or torch's kernel for each
# matmul shape; the casts rounded as eagerly (a float32 model's int8 head runs in bfloat16: without the
# rounding of its output to bfloat16, logits moved by up to half a bfloat16 step from the eager engine's);
# the choices' table (a warning inside inductor's autotuning) not for the server's log.
FROZEN_OPTIONS = {**GRAPH_OPTIONS, "emulate_precision_casts": True, "freezing": True, "max_autotune": True,
                  "max_autotune_gemm_backends": "CPP,ATEN", "autotune_num_choices_displayed": 0,
                  "max_autotune_report_choices_stats": False}


@contextlib.contextmanager
def frozen_compiling(fingerprint: str) -> Iterator[None]:
    """Compiling with FROZEN_OPTIONS. Inductor's graph cache keys a frozen weight by its shape, not its
    values (a second head of the same shape in one process got the first one's graph, weights included):
    the model's `fingerprint` (weights_fingerprint) joins every key, so that a graph comes from the cache
    only for the same weights (a server's restart), never for another model of the same shapes."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(**FROZEN_OPTIONS), torch.compiler.config.patch(cache_key_tag=fingerprint), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        yield


def weights_fingerprint(model: nn.Module) -> str:
    """A SHA-256 over the model's tensors: their names, dtypes, shapes and bytes (oneDNN's packed copies,
    opaque, left out: they are made from the others). ~0.1 s for SmolLM2's quantized tensors here."""
    digest = hashlib.sha256()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_mkldnn:
            continue
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class CompiledForward:
    """``model(input_ids, positions, meta)`` through torch.compile, one graph for every token count. Call
    ``compile(warm_up, device)`` once at load: ``warm_up`` executes the warm-up iterations through the
    worker, which calls this object for each; later calls never compile."""

    def __init__(self, model: nn.Module, lora_batch: LoRABatch | None = None, verifies: bool = False) -> None:
        _utf8_text_encoding()
        self.model = model
        self.lora_batch = lora_batch  # (enable_lora) the iteration's adapter rows: LoneStep runs none
        # linear_backend hybrid: from this many rows an iteration runs the graph of the quantized layers' float
        # copies (FloatCopyRows); None: no float copies, one graph.
        self.float_rows = float_rows(model)
        # dynamo keeps at most recompile_limit graphs of one function (8 by default), those of every model of a
        # class together: an engine compiles up to 4 (with and without float copies and adapter rows), and one
        # process may hold several engines (the tests, the benchmarks' side-by-side runs).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.compiled = torch.compile(model, dynamic=True, options={"guard_filter_fn": _guards_to_keep})
        self.head = CompiledHead.of(model, self)
        self.lone = LoneStep.of(model)
        self.lone_rows = LoneStep.of(model, rows=True) if verifies else None
        self.few = FewStep.of(model)
        self._fingerprint: str | None = None
        self.ready = False
        self.compile_seconds: float | None = None
        # After the warm-up: what torch.compile does with an input no graph fits (the tests make it fail).
        self.stance = "eager_on_recompile"
        # After the warm-up, only the guards that tell its graphs apart run (the tests run them all).
        self.all_guards = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        lone = self._lone_step(meta)
        if lone is not None:
            FLOAT_COPY_ROWS.on = False
            return lone(input_ids, positions, meta, self)
        FLOAT_COPY_ROWS.on = self.float_rows is not None and input_ids.shape[0] >= self.float_rows
        with iteration_scope(meta):
            if not self.ready:  # the warm-up: compiles, in this process
                import torch._inductor.config as inductor_config

                torch._dynamo.decorators.mark_unbacked(input_ids, 0)  # any token count, one included: one graph
                torch._dynamo.decorators.mark_unbacked(positions, 0)
                with inductor_config.patch(**GRAPH_OPTIONS):
                    return self.compiled(input_ids, positions, None)
            with torch.compiler.set_stance(self.stance, skip_guard_eval_unsafe=not self.all_guards):
                return self.compiled(input_ids, positions, None)

    @property
    def fingerprint(self) -> str:
        """weights_fingerprint(self.model), computed once (by the first frozen graph's compiling)."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model)
        return self._fingerprint

    def _lone_step(self, meta: AttentionMetadata) -> LoneStep | None:
        """The LoneStep that runs iteration `meta`, or None: one request's step of one token (self.lone) or
        of up to tuning.VERIFYING_MAX_ROWS (self.lone_rows) after its cached ones (meta.lone_table: an
        unquantized pool on a CPU), or a decode step of 2 to tuning.FEW_MAX_ROWS requests (self.few;
        meta.few_tables), with no adapter
        row, fewer rows than the float copies' graph takes, and no profiling timer (which times attention by
        itself)."""
        if (not isinstance(meta, ReferenceMetadata) or meta.timer is not None
                or (self.lora_batch is not None and self.lora_batch.active)):
            return None
        if meta.few_tables is not None:
            rows = len(meta.lengths)
            return self.few if self.float_rows is None or rows < self.float_rows else None
        if type(meta) is not ReferenceMetadata or meta.lone_table is None:
            return None
        rows = meta.lengths[0]
        if self.float_rows is not None and rows >= self.float_rows:
            return None
        return self.lone if rows == 1 else self.lone_rows if rows <= tuning.VERIFYING_MAX_ROWS else None

    def compile(self, warm_up: Callable[[], None], device: torch.device) -> None:
        """Runs `warm_up()` (iterations through this object: the first compiles the graph, the next check
        it serves them) and marks it ready, logging the time it took."""
        logger.info("compiling the model's forward pass for %s with torch.compile (once, at load: for a "
                    "135M model on 2 cores about 30 s with inductor's on-disk cache warm, 200 s cold) ...", device)
        t0 = time.perf_counter()
        try:
            warm_up()
            if self.head is not None and not self.head.ready:
                raise RuntimeError("the warm-up never reached the LM head")
            if self.lone is not None and not self.lone.ready:
                # (no warm-up iteration was one: a quantized K/V pool; then none ever is)
                logger.info("single-stream decode steps run the graph of every token count: the warm-up ran none")
                self.lone = None
            if self.lone_rows is not None and not self.lone_rows.ready:
                logger.info("a single stream's verifications run the graph of every token count: the warm-up ran none")
                self.lone_rows = None
            if self.few is not None and not self.few.ready:
                logger.info("decode steps of 2-%d requests run the graph of every token count: the warm-up ran none",
                            tuning.FEW_MAX_ROWS)
                self.few = None
        except BaseException:  # the model runs eagerly then (the worker says why): its head too
            if self.head is not None:
                self.head.layer.int_kernel = None
            raise
        self.compile_seconds = time.perf_counter() - t0
        self.ready = True
        logger.info("forward pass compiled in %.1f s", self.compile_seconds)


class LoneStep:
    """A single stream's step as a compiled graph of its own, attention inside it (LoneDecode,
    orca/models/attention/base.py): the graph of every token count calls attention as an opaque op, whose
    write, Python and SDPA call cost ~85 us a layer at one decode row (SmolLM2, 300 cached keys), against
    ~30-40 inside the graph. It runs a lone request's step after its cached tokens, wherever its blocks
    are (a prefix from the cache, blocks placed after a preemption: read through its block table), with no
    sliding window (the keys read would differ by layer) and an unquantized pool; the worker's other
    iterations run the graph of every token count. Its inputs are the pool, as blocks, and the request's
    block table, its length unbacked: one graph for any context, compiled at load by a warm-up iteration.
    `rows` False: one new token (a decode step; the graph specialised to one row); True: 2 to
    tuning.VERIFYING_MAX_ROWS (a speculating stream's verification: num_speculative_tokens proposals and the
    token before them; the row count unbacked too), a graph of its own,
    compiled only where the engine speculates."""

    def __init__(self, model: nn.Module, rows: bool = False) -> None:
        module = self._module(model, rows)
        self.compiled = torch.compile(module, dynamic=False, options={"guard_filter_fn": _guards_to_keep})
        self.rows = rows
        # Compiled with the weights frozen in (FROZEN_OPTIONS) where a decoder layer is int8: inductor's int8
        # template beats torch's kernel there; with int4 layers it gains too little for its longer load (not
        # taken); unquantized layers are oneDNN's (docs/BENCHMARKS.md, "Results: a single stream through its
        # block table; int8's frozen graphs").
        head = getattr(model, "lm_head", None)
        self.frozen = any(isinstance(m, QuantizedLinear) and m.kind == "int8" and m is not head
                          for m in model.modules())
        self.ready = False
        self.steps = 0  # iterations it ran (the tests read it)

    @classmethod
    def of(cls, model: nn.Module, rows: bool = False) -> LoneStep | None:
        """LoneStep of `model`, or None where a layer has a sliding window."""
        if any(getattr(m, "window", None) is not None for m in model.modules()):
            return None
        return cls(model, rows)

    @staticmethod
    def _module(model: nn.Module, rows: bool) -> nn.Module:
        """What it compiles. (dynamo keeps graphs by code object: each graph's module a class of its own)"""
        return _LoneRowsModel(model) if rows else _LoneModel(model)

    def _tables(self, meta: ReferenceMetadata) -> tuple[torch.Tensor, ...]:
        """The graph's inputs after the pool: the request's table (its length unbacked at the warm-up)."""
        return (meta.lone_table,)  # type: ignore[return-value]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ReferenceMetadata,
                 owner: CompiledForward) -> torch.Tensor:
        """(T, E): the model's hidden rows; writes the step's keys and values into meta's pool."""
        self.steps += 1
        pool = meta.kv_pool  # (layers, 2, KVH, slots, D)
        blocks = pool.unflatten(3, (-1, meta.block_size))  # (layers, 2, KVH, blocks, block size, D)
        tables = self._tables(meta)
        if not self.ready:  # the warm-up's iteration: compiles, in this process
            import torch._inductor.config as inductor_config

            for table in tables:  # any number of cached blocks (and of requests): one graph
                for dim in range(table.dim()):
                    torch._dynamo.decorators.mark_unbacked(table, dim)
            if self.rows:  # and of new tokens
                torch._dynamo.decorators.mark_unbacked(input_ids, 0)
                torch._dynamo.decorators.mark_unbacked(positions, 0)
            with frozen_compiling(owner.fingerprint) if self.frozen else inductor_config.patch(**GRAPH_OPTIONS):
                hidden, written = self.compiled(input_ids, positions, blocks, *tables)
            self.ready = True
        else:
            with torch.compiler.set_stance(owner.stance, skip_guard_eval_unsafe=not owner.all_guards):
                hidden, written = self.compiled(input_ids, positions, blocks, *tables)
        pool.index_copy_(3, meta.slot_mapping, written.permute(0, 2, 3, 1, 4))  # (layers, T, 2, KVH, D)
        return hidden


class FewStep(LoneStep):
    """A decode step of 2 to tuning.FEW_MAX_ROWS requests (one new token each, after cached ones; an unquantized
    pool on a CPU; fewer rows than the float copies' graph takes) as a compiled graph of its own, attention
    inside it (FewDecode, orca/models/attention/base.py), as LoneStep runs one request's: each request's
    cached keys and values read through its block table (`meta.few_tables`, padded to the longest, and
    `meta.few_past`), the row count and the tables' width unbacked (one graph), compiled at load by a
    warm-up step of two requests (orca/worker/warmup.py: few_warm_up_plans). Where the graph of every token count
    calls attention as an opaque op, its per-request SDPA calls (2 rows) or the batched backend's gathers,
    two bmm and a softmax (3-5) cost 1.4x FewDecode's loops at 4 rows (docs/BENCHMARKS.md)."""

    def __init__(self, model: nn.Module, rows: bool = True) -> None:
        super().__init__(model, rows=True)  # (always several rows: `rows` is LoneStep.of's, whatever it says)
        # (not frozen for int8 layers, as LoneStep's graphs are: inductor's int8 template was measured at one
        # row only, and autotuning it for an unbacked row count at load is not)
        self.frozen = False

    @staticmethod
    def _module(model: nn.Module, rows: bool) -> nn.Module:
        return _FewModel(model)

    def _tables(self, meta: ReferenceMetadata) -> tuple[torch.Tensor, ...]:
        return meta.few_tables, meta.few_past  # type: ignore[return-value]


class _LoneModel(nn.Module):
    """What LoneStep compiles: the model over one row, attention reading the cached keys and values of the
    pool's `blocks` in `table` (LoneDecode); returns the hidden row and the step's keys and values,
    (layers, 1, 2, KVH, D)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lone = LoneDecode(blocks, table, positions[0])
        hidden = self.model(input_ids, positions, lone)
        return hidden, torch.stack(lone.written)


class _LoneRowsModel(_LoneModel):
    """What LoneStep(rows=True) compiles: the same over several rows, its forward a code object of its own
    (dynamo keeps graphs by code object: the one-row graph and the graph of an unbacked row count stay
    apart, each the only graph of its code, which skip_guard_eval_unsafe then calls unchecked)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lone = LoneDecode(blocks, table, positions[0])
        hidden = self.model(input_ids, positions, lone)
        return hidden, torch.stack(lone.written)


class _FewModel(nn.Module):
    """What FewStep compiles: the model over one row per request, attention reading each request's cached
    keys and values of the pool's `blocks` through its row of `tables` (FewDecode); returns the hidden rows
    and the step's keys and values, (layers, n, 2, KVH, D)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                tables: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        few = FewDecode(blocks, tables, past)
        hidden = self.model(input_ids, positions, few)
        return hidden, torch.stack(few.written)


class CompiledHead:
    """An int8 LM head's int kernel matmul (QuantizedLinear.int_linear) as a compiled graph of its own,
    installed as the layer's int_kernel: the weight and scales frozen into it as constants (inductor's
    freezing), so that inductor's weight-only GEMM template may pack the weight for itself, and
    max_autotune choosing, by measuring both at load, the template or torch's kernel. The row count is
    unbacked: one graph for any number of sampled rows (the warm-up's one compiles it). After the warm-up,
    the forward pass's stance and guards (`forward_pass`'s) hold for it too."""

    def __init__(self, head: QuantizedLinear, forward_pass: CompiledForward) -> None:
        self.layer = head
        self.compiled = torch.compile(_HeadMatmul(head), dynamic=True, fullgraph=True)
        self.forward_pass = forward_pass
        self.ready = False

    @classmethod
    def of(cls, model: nn.Module, forward_pass: CompiledForward) -> CompiledHead | None:
        """The compiled head of `model`, installed, where its LM head is an int8 layer; else None. (An int4
        head, rarer, has no measurement yet: inductor has a template for it too.)"""
        head = getattr(model, "lm_head", None)
        if not isinstance(head, QuantizedLinear) or head.kind != "int8":
            return None
        compiled = cls(head, forward_pass)
        head.int_kernel = compiled
        if head.float_packed is not None:  # (linear_backend hybrid) its int8 kernel's rows, compiled
            # The float copy from tuning.COMPILED_HEAD_FLOAT_ROWS rows, if the dtype's HYBRID_QUANTIZED_MIN_ROWS
            # is lower: inductor's template multiplies up to 4 rows in one pass over the int8 weight, half of a
            # bfloat16 copy's bytes. SmolLM2's head, the caches flushed between calls (as the other layers flush
            # them in a step), bfloat16: compiled int8 1.2-1.6 ms at 1-4 rows against the bfloat16 copy's
            # 2.5-3.0, then 3.7 at 5 rows against 2.6 (scripts/experiments/head_rows.py).
            head.float_min_rows = max(head.float_min_rows, tuning.COMPILED_HEAD_FLOAT_ROWS)
        return compiled

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ready:  # the warm-up's first sampled row: compiles, in this process
            # Any row count; the autotuning measures one row (the single stream: where the head's time shows).
            torch._dynamo.decorators.mark_unbacked(x, 0, hint_override=1)
            with frozen_compiling(self.forward_pass.fingerprint):
                y = self.compiled(x)
            self.ready = True
            return y
        owner = self.forward_pass
        with torch.compiler.set_stance(owner.stance, skip_guard_eval_unsafe=not owner.all_guards):
            return self.compiled(x)


class _HeadMatmul(nn.Module):
    """What CompiledHead compiles: the head's int_linear, the head a submodule (its buffers the graph's
    constants)."""

    def __init__(self, head: QuantizedLinear) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.int_linear(x)


def _utf8_text_encoding() -> None:
    """Makes UTF-8 open()'s default text encoding when the locale's is not (the C locale of Triton's stub)."""
    encoding = locale.getpreferredencoding(False)
    if encoding.lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        logger.info("text encoding %s -> UTF-8 (LC_CTYPE C.UTF-8), for inductor's UTF-8 sources", encoding)


def _guards_to_keep(entries: list) -> list[bool]:
    """torch.compile's guard_filter_fn: every guard but those on the tensors of the model's second and later
    layers (their weights, packed weights and scales: made at load, never replaced or reshaped). Each had
    a guard of its dtype, shape and strides, and a buffer also its part in one check that no two of them
    alias: 1 ms a call for SmolLM2's ~700 tensors, 7% of a single-stream decode step here. The first
    layer's tensors and the model's own (embedding, head, rotary tables) keep theirs: every layer is
    built alike, so they tell a graph apart from another model's of the same class (another dtype, other
    shapes, quantized layers) in the same process, which shares the graphs of that class's forward."""
    return [not (e.guard_type == "TENSOR_MATCH" and _LATER_LAYER.search(e.name) is not None) for e in entries]


_LATER_LAYER = re.compile(r"\._modules\['\w+'\]\._modules\['([1-9]\d*)'\]\.")
