"""The CUDA path on a fake `cuda` device. CI has no GPU, so the worker's iterations run here under PyTorch's
FakeTensorMode, which gives every tensor a device, a dtype and a shape but no values, and raises as CUDA
would when an op mixes a `cuda` tensor with a CPU one (FakeTensorDeviceMismatchError; a 0-dim CPU tensor is
allowed, as on CUDA). So the commonest bug of code that never ran on a GPU, a tensor left on the CPU, fails
this test on every commit (checked: an input, a slot mapping, a mask or the rotary tables left on the CPU
each fail it).

What runs, in bfloat16, for each model family (GPT-2; Llama with GQA and an untied head; Mistral's sliding
window; Qwen2's q/k/v biases, tied head and per-layer windows; Qwen3's q/k norms and head_dim of its own;
Llama 3's rotary scaling) and attention backend (reference, batched, flex), on one rank, and for GPT-2 and
Llama also as rank 0 and rank 1 of two tensor-parallel ranks (Qwen2 also as stage 0 and stage 1 of a
pipeline of two):

- the Worker built for device cuda as the engine builds it (orca/worker/worker.py: backends, the K/V
  layout, CUDA graphs or why not), its weights from the real loader (see below), and init_kv_pool: the pool
  allocated on the device and, for flex on one rank, the CUDA graphs' static buffers (DecodeGraphs);
- iterations through Worker._execute, the function the engine calls: the prompts (the first chunk of one);
  a mixed iteration: three decode increments, the second chunk of a prompt continuing its cached K/V
  (chunked prefill) and a whole prompt with structured-output and log-probability options; then, for
  batched (increments only) and flex (padded to a CUDA-graph size, on the static buffers), a decode
  iteration. Each runs the worker's input preparation (_prepare: the pinned, non-blocking uploads of ids,
  positions, pool slots and sampling rows; the new blocks zeroed for batched and flex; the backend's
  metadata over consecutive and scattered block tables), the forward pass, the logits of the sampled rows,
  the allowed-token mask, the sampler and the log-probabilities up to their host read;
- the quantized K/V pools (int8, fp8_e4m3) with the reference and batched backends, and QuantizedLinear
  (int8, int4, fp8; plain and row-parallel) as the loader builds it for CUDA.

It asserts the device (cuda) of every weight and buffer (the dtype of every weight), of the pool, of every
tensor of the inputs and of the attention metadata, and the device, dtype and shape of the hidden states
(T, hidden; bfloat16), of this rank's attention output (T, local heads x head_dim), of the logits (sampled
rows, vocabulary; float32) and of the sampled ids (sampled rows; int64).

What it cannot reach, and why:

- values read on the host: the sampled ids' `.tolist()`, the log-probabilities' `.tolist()`, and what
  follows them (`logits.cpu()` for return_logits, the StepResult): fake tensors have no values. On the rank
  that samples an iteration stops at its first host read (asserted: a DataDependentOutputException at a
  `.tolist()` line, so a host read added before it, a sync on CUDA, fails the test), all before it having
  run; the other rank runs to the end.
- most of the mixture-of-experts families' forward pass (Mixtral, Qwen3-MoE): SparseMoE counts the tokens
  per expert on the host (`bincount(...).tolist()`; bincount's output length depends on the values), so
  their prompts' iteration runs only up to that count in the first layer (input preparation, embedding,
  attention, routing), asserted there.
- synchronisation and streams: torch.cuda.synchronize (PhaseTimer, profiled plans), whether a non_blocking
  copy is ordered before the kernels that read it, and the pinned allocator: a CPU build has none, so
  upload's pinned staging buffer is made unpinned here (the stand-in counts the requests for one: upload
  took its CUDA branch).
- CUDA graph capture and replay (torch.cuda.graph): the decode iteration runs its static buffers eagerly.
- torch.compile of flex_attention (Inductor's Triton kernels, and the load-time warm-up that compiles them):
  flex_attention runs uncompiled, its fake implementation giving the output's shape; the mask, the block-
  sparse layout and the call's inputs are the real ones. (Inductor's CUDA lowering of flex_attention, which
  runs this far on a CPU build, refuses head_dim < 16, and so does the worker for flex on CUDA: the families
  here are built with head_dim 16.)
- the paged decode kernel (Triton; flex's iterations of few rows per request on CUDA): a stand-in checks
  that every tensor it is given is on the device and gives the output's shape; the layout it reads (rows,
  tables; the CUDA graphs' static one) is the real one. tests/test_paged_decode.py runs the kernel itself.
- the warm-up iterations at load (init_kv_pool's _warm_up): they end in the same host read; the test's own
  iterations run the same path.
- the GPU's memory (the pool sized by a profiling pass: torch.cuda.mem_get_info, max_memory_allocated), its
  capabilities (torch.cuda.is_bf16_supported for dtype auto; get_device_capability for fp8 weights, set to
  8.9 here), kernel choice (SDPA's flash and efficient kernels, tinygemm, _scaled_mm) and every number.
- communication: ranks are built without a process group; ParallelContext's all_reduce and all_gather and
  the worker's sends and receives between pipeline stages run, but torch.distributed's all_reduce,
  all_gather, isend and recv are stand-ins that check their tensors are contiguous cuda tensors (as NCCL
  needs) and leave this rank's tensors as the collectives would shape them: no sum, no data moves.
- the loader on a CUDA device: FakeTensorMode cannot run Module.to twice on fake parameters in torch 2.13
  (torch.utils.swap_tensors refuses tensors the mode's memo holds weak references to), so the real loader
  loads on the meta device and each meta tensor becomes a fake cuda one; a tensor the loader leaves on the
  CPU stays there, and fails the test. Quantized weights are checked on QuantizedLinear alone.

The CUDA device guard: Python bindings that set the current device (indexing, copy_, contiguous, to("cuda"))
need a CUDA device guard, which a CPU build lacks. FakeTensorMode means to install a no-op one on a CPU-only
build (torch._C._ensureCUDADeviceGuardSet, called on entry), but torch 2.13's C++ installs it only where a
CUDA guard is already registered (a CUDA build without a GPU). The fake_cuda_guard fixture installs that same
object, c10's fake CUDA guard, in c10's registry while this module runs, and skips where it cannot find it.
It only sets a current device; every op runs as FakeTensorMode runs it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.attention.flex_attention
from _fixtures import decode_graphs
from checkpoints import (
    make_gpt2,
    make_llama,
    make_llama3,
    make_mistral,
    make_mixtral,
    make_qwen2,
    make_qwen3,
    make_qwen3_moe,
)
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.nn.attention.flex_attention import flex_attention

import orca.models.attention.flex
import orca.models.device
import orca.worker.warmup
import orca.worker.worker
from orca import EngineConfig
from orca.checkpoint import read_model_config, resolve_checkpoint
from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan
from orca.models.loader import load_model
from orca.models.quantization import QuantizedLinear, quantize
from orca.parallel import ParallelContext, ParallelLayout, local_kv_heads
from orca.worker import Worker
from orca.worker.cuda_graphs import DecodeGraphs

ORCA_SOURCES = str(Path(orca.__file__).parent) + os.sep
BLOCK_SIZE = 4
NUM_BLOCKS = 40
DTYPE = torch.bfloat16
GREEDY = SamplingSpec(0.0, 0, 1.0, 0)
# Temperature, top-k, top-p, a seed and two log-probabilities: the sampler's every filter.
SAMPLED = SamplingSpec(0.8, 5, 0.9, 3, logprobs=2)

# The families (tests/checkpoints.py: FAMILIES' two and the Llama-style variants) with one layer each (two
# for Qwen2: its first layer has no window, its second has one), so that each case takes a fraction of a
# second under FakeTensorMode; each checkpoint built once per module.
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "gpt2": lambda path: make_gpt2(path, n_layer=1),
    # head_dim 16: the tiny Llama's 8 is under what flex on CUDA takes (FLEX_MIN_HEAD_DIM; the worker refuses it)
    "llama": lambda path: make_llama(path, num_hidden_layers=1, head_dim=16),
    "mistral": lambda path: make_mistral(path, num_hidden_layers=1, head_dim=16),
    "qwen2": lambda path: make_qwen2(path, num_hidden_layers=2, hidden_size=128),  # head_dim 16 (Qwen2 derives it)
    "qwen3": lambda path: make_qwen3(path, num_hidden_layers=1),
    "llama3": lambda path: make_llama3(path, num_hidden_layers=1, head_dim=16),
}
MIXTURES: dict[str, Callable[[Path], Path]] = {
    "mixtral": lambda path: make_mixtral(path, num_hidden_layers=1),
    "qwen3_moe": lambda path: make_qwen3_moe(path, num_hidden_layers=1),
}
BACKENDS = ("reference", "batched", "flex")
# (tensor_parallel_size, tp rank): one rank; rank 0 of two (it samples); rank 1 of two (it does not). The code
# that tensor parallelism adds (vocabulary-parallel embedding and logits, row-parallel linears, the heads'
# split) is GPT-2's or Llama's whatever the variant: the variants run on one rank.
TP_SHAPES = {"tp1": (1, 0), "tp2-rank0": (2, 0), "tp2-rank1": (2, 1)}
CASES = [
    pytest.param(family, backend, tp_shape, id=f"{family}-{backend}-{tp_shape}")
    for family in FAMILIES for backend in BACKENDS for tp_shape in TP_SHAPES
    if tp_shape == "tp1" or family in ("gpt2", "llama")
]


# -- the fake CUDA device --------------------------------------------------------------------------------
CUDA_DEVICE_TYPE = 1  # c10::DeviceType::CUDA: its slot in c10's device_guard_impl_registry
REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry
# The no-op CUDA guard ensureCUDADeviceGuardSet() installs (a function-local static, constant-initialised).
FAKE_CUDA_GUARD = "_ZZN3c104impl24ensureCUDADeviceGuardSetEvE15fake_cuda_guard"


def _guarded_bindings_run() -> bool:
    """Whether a Python binding that sets the current device (indexing) runs on a fake cuda tensor."""
    with FakeTensorMode():
        try:
            torch.empty(2, device="cuda")[:1]
        except RuntimeError:  # "PyTorch is not linked with support for cuda devices"
            return False
    return True


def _elf_symbols(path: Path, names: set[str]) -> dict[str, int]:
    """The values (addresses relative to the load base) of `names` in an ELF64 little-endian shared
    library's symbol tables (.symtab and .dynsym)."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return {}
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize) per section header
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    wanted = {name.encode(): name for name in names}
    found: dict[str, int] = {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strings = sections[link][4]
        for entry in range(offset, offset + size, entsize):
            name_at, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, entry)
            name = data[strings + name_at : data.index(b"\0", strings + name_at)]
            if name in wanted and value:
                found[wanted[name]] = value
    return found


@pytest.fixture(scope="module")
def fake_cuda_guard() -> Iterator[None]:
    """c10's fake CUDA device guard in c10's registry while this module's tests run (the module docstring
    says why), unless this torch build has one there already; skips where it cannot be found."""
    if _guarded_bindings_run():
        yield
        return
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    symbols = _elf_symbols(library, {REGISTRY, FAKE_CUDA_GUARD}) if library.is_file() else {}
    if len(symbols) != 2:
        pytest.skip(f"no fake CUDA device guard in {library} to install (torch {torch.__version__}): fake cuda "
                    "tensors cannot be indexed on this CPU build")
    registry = ctypes.addressof(ctypes.c_void_p.in_dll(ctypes.CDLL(str(library)), REGISTRY))
    slot = ctypes.c_void_p.from_address(registry + CUDA_DEVICE_TYPE * ctypes.sizeof(ctypes.c_void_p))
    before = slot.value
    slot.value = registry - symbols[REGISTRY] + symbols[FAKE_CUDA_GUARD]
    try:
        assert _guarded_bindings_run(), "the fake CUDA device guard was installed but indexing still fails"
        yield
    finally:
        slot.value = before


class _TorchWithoutPinnedMemory:
    """orca/models/device.py's `torch`, but with a `tensor` that makes the pinned staging buffer upload asks
    for on CUDA unpinned (a CPU build has no pinned allocator), counting the requests."""

    def __init__(self) -> None:
        self.pinned = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def tensor(self, data: Any, *, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        self.pinned += pin_memory
        return torch.tensor(data, **kwargs)

    def zeros(self, *size: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        """upload_arrays' staging buffer: a real CPU tensor (its values are written through numpy), then
        copied to the fake device."""
        self.pinned += pin_memory
        with unset_fake_temporarily():
            host = torch.zeros(*size, **kwargs)
        return _FakeStaged(host)


class _FakeStaged:
    """A host staging tensor whose `to(cuda)` makes a fake CUDA tensor of its values (FakeTensorMode cannot
    copy a real host tensor that numpy wrote into)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host

    def numpy(self) -> Any:
        with unset_fake_temporarily():
            return self.host.numpy()

    def to(self, device: Any, non_blocking: bool = False) -> torch.Tensor:
        with unset_fake_temporarily():
            values = self.host.tolist()
        return torch.tensor(values, dtype=self.host.dtype, device=device)


@dataclasses.dataclass
class FakeCuda:
    mode: FakeTensorMode
    staging: _TorchWithoutPinnedMemory


@pytest.fixture
def fake_cuda(fake_cuda_guard: None, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """A FakeTensorMode, and what the worker's CUDA path needs of a CPU build under it:

    - weights: the worker's load_model loads on the meta device and hands back fake cuda tensors (the module
      docstring says why);
    - upload's pinned staging buffer: made unpinned (_TorchWithoutPinnedMemory);
    - one-element tensors are not kept as constants: FakeTensorMode would otherwise run `to("cuda")` on their
      real value under inference_mode (torch 2.13 skips that only for _to_copy) and fail for want of CUDA;
    - flex_attention runs uncompiled (compiled, it needs Inductor's Triton kernels and a GPU), and its
      layout's host arrays go to the device unpinned (upload_arrays' staging buffer, which numpy writes
      into: FakeTensorMode cannot copy that to a fake device, so it is made from its values);
    - the paged decode kernel is a stand-in (_paged_decode_on_the_device) for Triton's, which needs a GPU;
    - CUDA graphs are not captured: DecodeGraphs keeps its static buffers and runs them eagerly;
    - the load-time warm-up iterations are not run (they end in a host read; the test's iterations run the
      same path)."""
    mode = FakeTensorMode()
    staging = _TorchWithoutPinnedMemory()
    monkeypatch.setattr(orca.models.device, "torch", staging)
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)
    monkeypatch.setattr(orca.models.attention.flex, "_flex_function", lambda device_type: flex_attention)
    monkeypatch.setattr(orca.models.attention.flex, "paged_decode_attention", _paged_decode_on_the_device)
    monkeypatch.setattr(torch.nn.attention.flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    monkeypatch.setattr(orca.worker.worker, "load_model", _fake_device_loader(mode))
    monkeypatch.setattr(orca.worker.warmup, "DecodeGraphs",
                        lambda *args, capture, **kwargs: DecodeGraphs(*args, capture=False, **kwargs))
    monkeypatch.setattr(orca.worker.warmup, "run_warm_up", lambda worker, plans, what: None)
    return FakeCuda(mode, staging)


def _paged_decode_on_the_device(q: torch.Tensor, pool: torch.Tensor, *tensors_and_options: Any,
                                scales: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_attention's stand-in: its tensors on q's device (cuda), a quantized pool's scales with
    it (one float32 per slot and K/V head), its output's shape and dtype."""
    tensors = [q, pool, *(t for t in tensors_and_options if isinstance(t, torch.Tensor))]
    assert len(tensors) == 5 and {t.device.type for t in tensors} == {"cuda"}, [t.device for t in tensors]
    assert (scales is None) == (pool.dtype == q.dtype), (pool.dtype, q.dtype)  # int8 / float8 values: scales
    if scales is not None:
        assert scales.device.type == "cuda" and scales.dtype == torch.float32 and scales.shape == pool.shape[:3]
        _paged_decode_on_the_device.scaled_calls += 1
    _paged_decode_on_the_device.calls += 1
    return torch.empty_like(q)


_paged_decode_on_the_device.calls = _paged_decode_on_the_device.scaled_calls = 0


def _fake_device_loader(mode: FakeTensorMode) -> Callable[..., tuple[nn.Module, Any]]:
    """load_model as the worker calls it, loading on the meta device; then each meta tensor of the model
    becomes a fake tensor on the asked device, each other tensor a fake one where it is (a CPU tensor stays on
    the CPU). A tensor two modules share (a tied head) stays shared."""

    def load(checkpoint: Path, dtype: torch.dtype, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            model, config = load_model(checkpoint, dtype, torch.device("meta"), *args, **kwargs)
        fakes: dict[int, torch.Tensor] = {}

        def fake(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in fakes:
                f = (mode.fake_tensor_converter.from_meta_and_device(mode, t, device) if t.device.type == "meta"
                     else mode.from_tensor(t))
                fakes[id(t)] = nn.Parameter(f, requires_grad=False) if isinstance(t, nn.Parameter) else f
            return fakes[id(t)]

        for module in model.modules():
            for tensors in (module._parameters, module._buffers):
                for name, t in tensors.items():
                    if t is not None:
                        tensors[name] = fake(t)
        return model, config

    return load


# -- checkpoints, ranks, plans ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def checkpoint(family: str) -> Path:
        if family not in built:
            built[family] = {**FAMILIES, **MIXTURES}[family](tmp_path_factory.mktemp(family))
        return built[family]

    return checkpoint


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.distributed's all_reduce and all_gather, which ParallelContext calls, and isend and recv, which
    the worker's pipeline stages call (the test's ranks have no process group), as stand-ins: they check
    each tensor is a contiguous cuda tensor, as NCCL needs, and leave what the collective would leave this
    rank (a sum in place or a received tensor: the tensor as it is; each rank's piece: a copy of this one).
    Returns the calls made."""
    calls: list[str] = []

    def check(what: str, t: torch.Tensor) -> None:
        assert t.device.type == "cuda" and t.is_contiguous(), (
            f"{what} of a {'' if t.is_contiguous() else 'non-contiguous '}tensor on {t.device}")

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        check("all_reduce", tensor)
        calls.append("all_reduce")

    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> None:
        for t in (tensor, *tensor_list):
            check("all_gather", t)
        for piece in tensor_list:
            piece.copy_(tensor)
        calls.append("all_gather")

    def point_to_point(what: str) -> Callable[..., Any]:
        def send_or_receive(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            check(what, tensor)
            calls.append(what)
            return type("Work", (), {"wait": lambda self: True})()

        return send_or_receive

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(torch.distributed, "isend", point_to_point("isend"))
    monkeypatch.setattr(torch.distributed, "recv", point_to_point("recv"))
    return calls


def _rank(num_layers: int, tp: int, rank: int, pp: int = 1) -> ParallelContext | None:
    """Rank `rank` of `tp` x `pp`, built without a process group (the collectives fixture stands in for it)."""
    return None if tp * pp == 1 else ParallelContext(ParallelLayout(tp, pp), rank, num_layers)


class _Requests:
    """The driver's bookkeeping for the test's plans: each request's tokens so far, its blocks (taken in
    order from the pool's first, so a request's blocks are consecutive until another request took the next
    one), its sampled tokens."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))[::-1]
        self.length: dict[str, int] = {}
        self.drawn: dict[str, int] = {}

    def feed(self, request_id: str, n: int, spec: SamplingSpec | None = None, samples: bool = True,
             allowed: bytes | None = None) -> PlannedRequest:
        """`n` more tokens of `request_id` (spec: its first); `samples`: the chunk reaches the prompt's end."""
        start = self.length.get(request_id, 0)
        self.length[request_id] = start + n
        blocks = tuple(self.free.pop() for _ in range(-(-(start + n) // BLOCK_SIZE) - -(-start // BLOCK_SIZE)))
        step = None
        if samples:
            step = self.drawn[request_id] = self.drawn.get(request_id, -1) + 1
        return PlannedRequest(request_id, tuple(range(3, 3 + n)), start, blocks, spec, sample_step=step,
                              allowed_tokens=None if allowed is None else (allowed,))


def _plans(vocab_size: int, decode: bool) -> list[StepPlan]:
    """The prompts; the mixed iteration; with `decode`, a decode iteration. Prompts and chunks of 8 tokens (one
    of 12: on CUDA flex attends to rows of up to 8 per request with its paged decode kernel), so
    that the attention calls of different requests share their shapes (FakeTensorMode computes each new
    shape's output once)."""
    r = _Requests(NUM_BLOCKS)
    allowed = bytes([0b10110111]) * -(-vocab_size // 8)  # a structured output's bitmask (some tokens off)
    prompts = StepPlan(0, (r.feed("a", 8, GREEDY), r.feed("b", 8, GREEDY), r.feed("c", 8, GREEDY),
                           r.feed("e", 8, GREEDY, samples=False)))  # and the first chunk of e's prompt
    increments = [r.feed(request_id, 1) for request_id in "abc"]  # each in a new block: tables scattered
    f = r.feed("f", 12, SAMPLED, allowed=allowed)  # a whole prompt, longer than VERIFYING_MAX_ROWS (flex's paged bound)
    e = r.feed("e", 3)  # the second chunk of e's prompt, after its 8 cached tokens, in a block apart
    plans = [prompts, StepPlan(1, (*increments, e, f))]
    if decode:
        plans.append(StepPlan(2, tuple(r.feed(request_id, 1) for request_id in "abcef")))
    return plans


# -- running an iteration --------------------------------------------------------------------------------
def _tensors(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor an attention metadata holds: its fields, and theirs (FlexLayout, IncrementBatch)."""
    if isinstance(obj, torch.Tensor):
        yield "", obj
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            for name, t in _tensors(item):
                yield f"[{i}]{name}", t
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name not in ("kv_pool", "kv_scales"):  # the pool's own, checked once
                for name, t in _tensors(getattr(obj, f.name)):
                    yield f".{f.name}{name}", t


def _spy(obj: Any, name: str, seen: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Records what obj.name(...) returns (and its arguments) under seen[name] on each call."""
    original = getattr(obj, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        seen[name] = out
        seen[f"{name} args"] = args
        return out

    monkeypatch.setattr(obj, name, spy)


def _innermost_orca_frame(stopped: pytest.ExceptionInfo) -> traceback.FrameSummary:
    return [f for f in traceback.extract_tb(stopped.tb) if f.filename.startswith(ORCA_SOURCES)][-1]


def _execute(worker: Worker, plan: StepPlan, fake: FakeCuda) -> None:
    """worker._execute(plan) on the fake device. On the rank that samples it stops at its first host read,
    which a fake tensor has no value for: the .tolist() of the sampled ids, or of the log-probabilities
    before them; everything before it has run. A host read earlier in the iteration (a sync on CUDA) fails."""
    samples = worker.par.is_last_stage and worker.par.tp_rank == 0
    with fake.mode:
        if not samples:
            worker._execute(plan)
            return
        with pytest.raises(DataDependentOutputException) as stopped:
            worker._execute(plan)
    frame = _innermost_orca_frame(stopped)
    assert ".tolist()" in (frame.line or ""), "".join(traceback.format_exception(stopped.value))


def _attention_output(model: nn.Module) -> nn.Module:
    """The first layer's attention output projection, whose input is this rank's attention output."""
    return model.layers[0].o_proj if hasattr(model, "layers") else model.h[0].c_proj


def _check_iteration(worker: Worker, plan: StepPlan, fake: FakeCuda, seen: dict[str, Any]) -> None:
    seen.clear()
    _execute(worker, plan, fake)
    cfg, par = worker.model_config, worker.par
    num_tokens = sum(len(pr.token_ids) for pr in plan.requests)
    num_sampled = sum(pr.sample_step is not None for pr in plan.requests)
    ids, positions, layout, sample_rows = seen["_prepare"]
    meta = layout.metadata()  # (what the runner built: the same object)
    graph_size = seen["_prepare args"][2]
    rows = num_tokens if graph_size is None else graph_size  # a decode iteration on CUDA graphs: padded
    for what, t in (("input ids", ids), ("positions", positions), *((f"meta{n}", t) for n, t in _tensors(meta))):
        assert t.device.type == "cuda", f"{what} on {t.device}"
    assert ids.shape == positions.shape == (rows,) and ids.dtype == positions.dtype == torch.int64
    assert meta.slot_mapping.shape == (rows,)
    assert sample_rows[0].device.type == "cuda" and sample_rows[0].shape == (num_sampled,)

    hidden = seen["forward"]
    assert (hidden.device.type, hidden.dtype, tuple(hidden.shape)) == ("cuda", DTYPE, (rows, cfg.hidden_size))
    local = seen["attention output"]  # this rank's heads, before the row-parallel projection sums them
    local_heads = cfg.num_heads // par.tp_size
    assert (local.device.type, local.dtype, tuple(local.shape)) == ("cuda", DTYPE, (rows, local_heads * cfg.head_dim))
    if not par.is_last_stage:  # it sends its hidden states on to the next stage
        assert "compute_logits" not in seen and "sample" not in seen
        return
    logits = seen["compute_logits"]
    assert (logits.device.type, logits.dtype, tuple(logits.shape)) == (
        "cuda", torch.float32, (num_sampled, cfg.vocab_size))
    if par.tp_rank == 0:
        token_ids = seen["sample"]
        assert (token_ids.device.type, token_ids.dtype, tuple(token_ids.shape)) == ("cuda", torch.int64, (num_sampled,))
    else:
        assert "sample" not in seen  # only tp rank 0 draws


def _worker(path: Path, backend: str, tp: int = 1, rank: int = 0, pp: int = 1, **options: Any) -> Worker:
    """The Worker of rank `rank` of tp x pp for device cuda, as the engine builds it (its executor, or a
    distributed rank's process, which uses cuda:<its local rank>)."""
    config = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", attention_backend=backend,
                          block_size=BLOCK_SIZE, n_slots=NUM_BLOCKS * BLOCK_SIZE, max_bs=8,
                          tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)
    if tp * pp == 1:
        return Worker(config)
    par = _rank(read_model_config(resolve_checkpoint(config.model))[0].num_layers, tp, rank, pp)
    return Worker(config, par=par, device=torch.device("cuda", rank))


def _run_on_fake_cuda(worker: Worker, fake: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """init_kv_pool and the iterations, each checked; returns what the spies saw of each. The decode
    iteration runs where it takes a path of its own: batched's increments alone, flex's CUDA-graph buffers
    (the reference backend runs increments as the mixed iteration does)."""
    cfg, par = worker.model_config, worker.par
    for name, t in [*worker.model.named_parameters(), *worker.model.named_buffers()]:
        assert t.device.type == "cuda", f"{name} on {t.device}"
        if isinstance(t, nn.Parameter):
            assert t.dtype == DTYPE, f"{name} is {t.dtype}"
    with fake.mode:
        worker.init_kv_pool(worker.determine_num_blocks())
    graphs = decode_graphs(worker) is not None
    pool, layout = worker.kv_pool, worker.kv_layout
    slots = (NUM_BLOCKS + graphs) * BLOCK_SIZE  # with CUDA graphs, one more block for padding rows
    assert pool.device.type == "cuda" and pool.dtype == layout.dtype
    assert tuple(pool.shape) == (len(par.layers), 2, local_kv_heads(cfg.num_kv_heads, par.tp_size), slots,
                                 cfg.head_dim)
    if layout.quantized:
        scales = worker.kv_scales
        assert (scales.device.type, scales.dtype, tuple(scales.shape)) == ("cuda", torch.float32, tuple(pool.shape[:4]))

    seen: dict[str, Any] = {}
    for obj, name in ((worker, "_prepare"), (worker.model, "forward"), (worker.model, "compute_logits"),
                      (orca.worker.worker, "sample")):
        _spy(obj, name, seen, monkeypatch)
    _attention_output(worker.model).register_forward_pre_hook(
        lambda module, args: seen.__setitem__("attention output", args[0]))
    history = []
    for plan in _plans(cfg.vocab_size, decode=worker.attention_backend != "reference"):
        _check_iteration(worker, plan, fake, seen)
        history.append(dict(seen))
    assert fake.staging.pinned > 0  # upload took its CUDA branch: pinned staging, non-blocking copy
    if graphs:
        assert history[2]["_prepare args"][2] == 8 and decode_graphs(worker).replays == 1  # 5 rows padded to 8
    return history


# -- the tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "backend", "tp_shape"), CASES)
def test_a_mixed_iteration_runs_on_fake_cuda(
    family: str, backend: str, tp_shape: str, fake_cuda: FakeCuda, checkpoints: Callable[[str], Path],
    collectives: list[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    tp, tp_rank = TP_SHAPES[tp_shape]
    worker = _worker(checkpoints(family), backend, tp, tp_rank)
    assert worker.device.type == "cuda" and worker.attention_backend == backend
    history = _run_on_fake_cuda(worker, fake_cuda, monkeypatch)
    # The mixed iteration took each backend's own path over the scattered and consecutive block tables.
    meta = history[1]["_prepare"][2].metadata()
    assert type(meta).name == backend
    if backend == "batched":  # the three increments, batched; then e's 3-token chunk as a short request
        assert [(g.rows, g.queries) for g in meta.increments] == [(3, 1), (1, 3)]
        assert meta.increments[1].q_index.device.type == "cuda"
    if backend == "reference":
        assert meta.gather_index is not None and any(view is not None for view in meta.views)
    # CUDA graphs for flex on one rank (their static buffers; nothing captured); none otherwise.
    assert (decode_graphs(worker) is not None) == (backend == "flex" and tp == 1)
    if backend == "flex":  # the decode iteration through the paged decode kernel (the stand-in), the
        assert history[-1]["_prepare"][2].metadata().flex.paged  # mixed one (a 12-token prompt) through flex_attention
        # Every captured size's static layout is paged: no CUDA graph calls flex_attention (whose compiled
        # guards made a new graph per size when graphs did), so capturing compiles no flex graph.
        graphs = decode_graphs(worker)
        assert tp > 1 or (graphs.sizes and all(graphs._metas[n].flex.paged for n in graphs.sizes))
        assert not meta.flex.paged and _paged_decode_on_the_device.calls > 0
    if tp > 1:
        assert {"all_reduce", "all_gather"} <= set(collectives)


def test_flex_on_cuda_is_refused_below_its_kernels_head_dim(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    """Inductor's flex kernels need head_dim >= 16 (the first GPU run's failure with the tiny Llama's 8): the
    worker refuses flex on CUDA at load with the alternatives, and takes batched on the same model."""
    path = make_llama(tmp_path / "llama-head8", num_hidden_layers=1)
    with pytest.raises(ValueError, match="attention_backend flex on CUDA needs head_dim >= 16 .* this model's is 8: "
                                         "choose batched or reference"):
        _worker(path, "flex")
    assert _worker(path, "batched").attention_backend == "batched"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["reference", "batched", "flex"])
def test_a_quantized_kv_pool_runs_on_fake_cuda(
    backend: str, kv_cache_dtype: str, fake_cuda: FakeCuda, checkpoints: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """flex: the mixed iteration's flex_attention over the iteration's blocks gathered and dequantized on the
    device; the decode iteration (a CUDA graph's static buffers) through the paged decode kernel with the
    pool's scales."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # (fp8 with flex)
    worker = _worker(checkpoints("llama"), backend, kv_cache_dtype=kv_cache_dtype)
    assert worker.kv_layout.quantized
    scaled_calls = _paged_decode_on_the_device.scaled_calls
    history = _run_on_fake_cuda(worker, fake_cuda, monkeypatch)
    if backend == "flex":
        mixed = history[1]["_prepare"][2].metadata()
        assert not mixed.flex.paged and mixed.gather_blocks.device.type == "cuda"
        graphs = decode_graphs(worker)
        assert all(graphs._metas[n].kv_scales is worker.kv_scales and graphs._metas[n].flex.paged
                   for n in graphs.sizes)
        assert history[-1]["_prepare"][2].metadata().flex.paged
        assert _paged_decode_on_the_device.scaled_calls > scaled_calls


def test_flex_over_an_fp8_pool_is_refused_below_compute_capability_8_9(
    fake_cuda: FakeCuda, checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The paged decode kernel reads float8 e4m3, which Triton converts from compute capability 8.9 on: an A100
    (8.0) is refused at load, naming what works there; int8 is not; 8.9 is not."""
    path = checkpoints("llama")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8_e4m3 with attention_backend flex needs a GPU of "
                                         r"compute capability 8.9 or later .* is 8.0: choose kv_cache_dtype int8"):
        _worker(path, "flex", kv_cache_dtype="fp8_e4m3")
    assert _worker(path, "flex", kv_cache_dtype="int8").kv_layout.quantized
    assert _worker(path, "batched", kv_cache_dtype="fp8_e4m3").kv_layout.quantized
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert _worker(path, "flex", kv_cache_dtype="fp8_e4m3").kv_layout.quantized


@pytest.mark.parametrize("row_parallel", [False, True], ids=["plain", "row-parallel"])
@pytest.mark.parametrize("kind", ["int8", "int8-dequantizing", "int4", "fp8"])
def test_quantized_linears_run_on_fake_cuda(
    kind: str, row_parallel: bool, fake_cuda: FakeCuda, collectives: list[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QuantizedLinear as the loader builds it for a CUDA device (a quantized weight read on the CPU, the
    bias already on the device): its CUDA packing (int4's nibbles, tinygemm's layout) and kernels. int8 runs
    torch's int8 kernel where the CUDA build has one, and dequantizes inside the matmul where it has not
    (a CPU build has not: both paths are set here). fp8 asks the GPU's compute capability: 8.9 stands for
    one that has fp8."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    par = _rank(1, 2, 0) if row_parallel else None
    with fake_cuda.mode:
        weight = quantize(torch.empty(48, 64), kind.split("-")[0], 32)
        bias = torch.empty(48, dtype=DTYPE, device="cuda")
        linear = QuantizedLinear(weight, bias, torch.device("cuda"), DTYPE, par)
        if kind.startswith("int8"):
            linear._int8_kernel = kind == "int8"
        out = linear(torch.empty(5, 64, dtype=DTYPE, device="cuda"))
    for name, t in linear.named_buffers():
        assert t.device.type == "cuda", f"{name} on {t.device}"
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("cuda", DTYPE, (5, 48))
    assert collectives == (["all_reduce"] if row_parallel else [])


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_stages_run_on_fake_cuda(
    stage: int, fake_cuda: FakeCuda, checkpoints: Callable[[str], Path], collectives: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage 0 and stage 1 of two (Qwen2's two layers; its tied head on the last stage): the first sends its
    hidden states on, the second receives them into a buffer on the device, and samples."""
    worker = _worker(checkpoints("qwen2"), "reference", rank=stage, pp=2)
    assert list(worker.par.layers) == [stage]
    _run_on_fake_cuda(worker, fake_cuda, monkeypatch)
    assert set(collectives) == ({"isend"} if stage == 0 else {"recv"})


@pytest.mark.parametrize("family", MIXTURES)
def test_a_mixture_of_experts_runs_on_fake_cuda_up_to_its_host_read(
    family: str, fake_cuda: FakeCuda, checkpoints: Callable[[str], Path],
) -> None:
    """SparseMoE counts the tokens per expert inside the forward pass (bincount, whose output's length depends
    on the values) and reads the counts on the host: a fake tensor has no values, so the prompts run up to
    the count in the first layer's mixture (attention and routing done)."""
    worker = _worker(checkpoints(family), "reference")
    seen: dict[str, Any] = {}
    _attention_output(worker.model).register_forward_pre_hook(
        lambda module, args: seen.__setitem__("attention output", args[0]))
    with fake_cuda.mode:
        worker.init_kv_pool(worker.determine_num_blocks())
        with pytest.raises(DynamicOutputShapeException) as stopped:
            worker._execute(_plans(worker.model_config.vocab_size, decode=False)[0])
    frame = _innermost_orca_frame(stopped)
    assert frame.filename.endswith("moe.py") and "bincount" in (frame.line or ""), "".join(
        traceback.format_exception(stopped.value))
    assert seen["attention output"].device.type == "cuda"
