"""The one resolution pass: what each of EngineConfig's choices (``auto`` or explicit) becomes on a worker,
and why.

``resolve`` turns an EngineConfig, the device, the checkpoint's config.json and the rank count into a
frozen ResolvedPlan (dtype, linear and attention backends, CUDA graphs, the compiled forward pass, the K/V
pool's dtype, the quantization), each with its reason (``Choice``), before any weight loads, so what the
device cannot run is refused first. The backends' traits (orca/models/attention/) say what each runs.
``RULES`` states each rule in words; scripts/options_doc.py renders them into docs/OPTIONS.md, "How
`auto` resolves". Environment overrides of ``auto`` are read in orca/config.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from orca import tuning
from orca.checkpoint import ModelConfig, read_model_config, resolve_checkpoint
from orca.config import DTYPES, EngineConfig, auto_dtype_and_reason
from orca.models import layers
from orca.models.attention import AttentionMetadata, get_backend
from orca.models.loader import checkpoint_bytes
from orca.worker.kv_cache import resolve_kv_cache_dtype

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them

# attention_backend auto's candidates: on CUDA where its graphs serve the configuration, and elsewhere.
AUTO_ATTENTION_ON_CUDA = "flex"
AUTO_ATTENTION = "batched"

RULES: dict[str, str] = {
    "dtype": (
        "`auto`: $ORCA_DTYPE when set; else bfloat16 on CUDA (float16 where the GPU lacks bfloat16) and on a "
        "CPU that multiplies bfloat16 natively (the avx512_bf16 or amx_bf16 flag of /proc/cpuinfo), float32 "
        "on other CPUs, where bfloat16 matmuls are emulated and slower."
    ),
    "linear_backend": (
        "`auto`: on a CPU whose oneDNN packs the dtype (float32 always, bfloat16 and float16 where the CPU "
        "has the instructions), `hybrid` when this rank's share of the weights (estimated from the "
        "checkpoint's headers) is at most tuning.HYBRID_MEMORY_SHARE of the available memory (hybrid keeps "
        "a second copy), `onednn` otherwise; `reference` elsewhere (cuBLAS on CUDA). An explicit `onednn` "
        "or `hybrid` where oneDNN cannot pack is refused. Measured: docs/BENCHMARKS.md, \"Results: the fast "
        "data plane, first step\" and \"Results: the fast data plane, fifth step: hybrid linears\"."
    ),
    "attention_backend": (
        "`auto`: `flex` on CUDA where its decode iterations run in CUDA graphs and it serves the "
        "configuration: `cuda_graphs` auto, one rank, no mixture-of-experts layer, `kv_cache_dtype` auto "
        "(flex over a quantized pool is not measured against batched on a GPU yet: `flex` chooses it), "
        "`enable_lora` false (iterations with an adapter run without graphs), and the model's head_dim (and "
        "the draft model's) at least flex's `cuda_min_head_dim` (16, inductor's kernels); `batched` "
        "everywhere else. Why: on CUDA flex with its graphs is ahead of batched at every batch size "
        "measured, without them behind it; on a CPU batched is the fastest measured, and flex's paged mask "
        "does not compile there (docs/BENCHMARKS.md, \"Results: the CUDA path on an H200\", its four "
        "sessions, and \"Results: the fast data plane, fourth step: batched increments\"). Refused at load, "
        "auto or not: a backend on CUDA below its `cuda_min_head_dim` (flex: 16), and one over an fp8_e4m3 "
        "pool below its `cuda_fp8_pool_min_capability` (flex: compute capability 8.9)."
    ),
    "cuda_graphs": (
        "`auto`: decode iterations are captured (one graph per batch size) where the device is CUDA, the "
        "attention backend has the `cuda_graphs` trait (flex: its shapes depend on the token count only), "
        "the worker is the only rank and the model has no mixture-of-experts layer (their routing reads "
        "token counts on the host). `off`: never."
    ),
    "torch_compile": (
        "`auto`: $ORCA_TORCH_COMPILE when set; else the forward pass runs through the CPU graphs where the "
        "device is a CPU, the attention backend has the `in_compiled_forward` trait (reference, batched), "
        "the worker is the only rank and the model has no mixture-of-experts layer; at the warm-up a pool "
        "too small for its iterations, or a compile that fails, serves eagerly and says why. `off`: eager. "
        "Measured: docs/BENCHMARKS.md, \"Results: the fast data plane, third step: the compiled forward "
        "pass\"."
    ),
    "kv_cache_dtype": (
        "`auto`: the model's dtype. `fp8_e4m3` and `int8`: their values with a float32 scale per token and "
        "K/V head, which every attention backend reads."
    ),
    "quantization": (
        "`auto`: the checkpoint's own format, decided as its tensors are read (plan_quantization, "
        "orca/models/loader.py): a GGUF file's Q8_0 as int8, Q4_0/Q4_1 as int4, an AWQ or GPTQ checkpoint as "
        "int4, a compressed-tensors FP8 one as fp8, a float checkpoint float; the load logs what each "
        "linear layer became."
    ),
}
"""Each resolved option's rule, in words: docs/OPTIONS.md's "How `auto` resolves" (scripts/options_doc.py)."""

RULES_HEADING = "How `auto` resolves"


@dataclass(frozen=True)
class Choice:
    """One option as resolved: its EngineConfig field, the value asked, what this worker runs, and why."""

    option: str
    asked: str
    value: str
    reason: str


@dataclass(frozen=True)
class ResolvedPlan:
    """What resolve chose for one worker, each with its reason in `choices` (table() renders them)."""

    device: torch.device
    dtype: torch.dtype  # the model's dtype
    linear: str  # the linear backend (orca/models/layers.py): hybrid, onednn or reference
    attention_backend: str  # the attention backend's name
    attention: type[AttentionMetadata]  # its metadata class: builder and traits (orca/models/attention/)
    kv_dtype: torch.dtype  # the K/V pool's values' dtype (orca/worker/kv_cache.py)
    quantization: str  # EngineConfig.quantization ("auto": the checkpoint's own, decided as it is read)
    no_flex_reason: str | None  # why auto is not flex here (why_not_flex_by_default), None where it is
    no_graphs_reason: str | None  # why decode iterations are not captured in CUDA graphs; None: they are
    no_compile_reason: str | None  # why the forward pass is not compiled (the CPU graphs); None: it is
    weight_bytes: int  # this rank's share of the weights in `dtype`, estimated from the checkpoint
    choices: tuple[Choice, ...]

    def choice(self, option: str) -> Choice:
        for c in self.choices:
            if c.option == option:
                return c
        raise KeyError(option)

    def reason(self, option: str) -> str:
        return self.choice(option).reason

    def table(self) -> str:
        """The choices as a text table, the load's one log entry of them."""
        rows = [("option", "asked", "resolved", "reason")] + [(c.option, c.asked, c.value, c.reason)
                                                              for c in self.choices]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"  {o:<{widths[0]}}  {a:<{widths[1]}}  {v:<{widths[2]}}  {r}" for o, a, v, r in rows]
        head = (f"resolved for {self.device} (weights about {self.weight_bytes / 1e6:.1f} MB per rank in "
                f"{_name(self.dtype)}; the rules: docs/OPTIONS.md, \"{RULES_HEADING}\"):")
        return "\n".join([head, *lines])


def resolve(config: EngineConfig, device: torch.device, checkpoint: Path, ranks: int,
            model_config: ModelConfig | None = None) -> ResolvedPlan:
    """Every choice of a worker that is one of `ranks` (tensor x pipeline parallel) on `device`, before its
    weights load (`model_config`: the checkpoint's, read when None). ValueError for what the device cannot
    run; logs the chosen backend's device warning."""
    mc = model_config if model_config is not None else read_model_config(checkpoint)[0]
    moe = any(mc.moe_layers)
    dtype, dtype_reason = resolve_dtype(config)
    # auto keeps a second copy of the weights (hybrid) only where it fits: this rank's share, estimated.
    weight_bytes = checkpoint_bytes(checkpoint, dtype) // ranks
    linear, linear_reason = resolve_linear_backend(config.linear_backend, device, dtype, weight_bytes)
    no_flex_reason = why_not_flex_by_default(config, device, checkpoint, ranks, mc)
    attention_backend, attention_reason = resolve_attention_backend(config.attention_backend, device,
                                                                    no_flex_reason)
    attention = get_backend(attention_backend)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    check_attention_support(attention, device, mc.head_dim, kv_dtype)
    warning = attention.device_warning(device)
    if warning is not None:
        logger.warning("%s", warning)
    no_graphs_reason = why_no_graphs(config.cuda_graphs, device, attention_backend, ranks, moe)
    compile_choice = config.effective_torch_compile
    no_compile_reason = why_not_compiled(compile_choice, device, attention_backend, ranks, moe)
    compile_reason = no_compile_reason or "the CPU graphs, compiled at the warm-up"
    if compile_choice != config.torch_compile:
        compile_reason = f"auto is $ORCA_TORCH_COMPILE's {compile_choice}: {compile_reason}"
    kv_reason = ("auto: the model's dtype" if config.kv_cache_dtype == "auto"
                 else "as asked: its values with a float32 scale per token and K/V head")
    quantization_reason = ("auto: the checkpoint's own format (the load logs each linear layer's)"
                           if config.quantization == "auto" else "as asked")
    choices = (
        Choice("dtype", config.dtype, _name(dtype), dtype_reason),
        Choice("linear_backend", config.linear_backend, linear, linear_reason),
        Choice("attention_backend", config.attention_backend, attention_backend, attention_reason),
        Choice("cuda_graphs", config.cuda_graphs, "off" if no_graphs_reason else "on",
               no_graphs_reason or "decode iterations captured, one graph per batch size"),
        Choice("torch_compile", config.torch_compile, "off" if no_compile_reason else "on",
               compile_reason),
        Choice("kv_cache_dtype", config.kv_cache_dtype, _name(kv_dtype), kv_reason),
        Choice("quantization", config.quantization,
               "checkpoint's" if config.quantization == "auto" else config.quantization, quantization_reason),
    )
    return ResolvedPlan(device, dtype, linear, attention_backend, attention, kv_dtype, config.quantization,
                        no_flex_reason, no_graphs_reason, no_compile_reason, weight_bytes, choices)


def resolve_dtype(config: EngineConfig) -> tuple[torch.dtype, str]:
    """EngineConfig.dtype to the model's dtype, and why (auto: orca.config.auto_dtype_and_reason on the
    config's device, as EngineConfig.torch_dtype)."""
    if config.dtype != "auto":
        return DTYPES[config.dtype], "as asked"
    dtype, reason = auto_dtype_and_reason(config.torch_device)
    return dtype, f"auto: {reason}"


def resolve_linear_backend(choice: str, device: torch.device, dtype: torch.dtype,
                           weight_bytes: int | None = None) -> tuple[str, str]:
    """EngineConfig.linear_backend to what runs ("hybrid", "onednn" or "reference"), and why (RULES); an
    explicit onednn or hybrid where oneDNN cannot run is refused with the reason."""
    packs = device.type == "cpu" and layers.onednn_packs(dtype)
    if choice in ("onednn", "hybrid") and not packs:
        where = f"device {device}" if device.type != "cpu" else f"{dtype} on this CPU"
        raise ValueError(f"linear_backend {choice} cannot run {where} (oneDNN packs CPU weights only, float32 "
                         f"always, bfloat16/float16 where the CPU has the instructions): use auto or reference")
    if choice != "auto":
        return choice, "as asked"
    if not packs:
        where = "on CUDA (cuBLAS)" if device.type == "cuda" else (
            f"on {device.type}" if device.type != "cpu" else f"({_name(dtype)} is not packed by oneDNN here)")
        return "reference", f"auto: reference {where}"
    available = layers.available_memory_bytes()
    if weight_bytes is None or available is None:
        return "onednn", "auto: onednn (the weights' size or the available memory unknown: no second copy)"
    share = tuning.HYBRID_MEMORY_SHARE
    if weight_bytes <= share * available:
        return "hybrid", (f"auto: hybrid (a second copy of {weight_bytes / 1e6:.0f} MB fits in {share:.0%} of "
                          f"the {available / 1e9:.1f} GB available)")
    return "onednn", (f"auto: onednn (a second copy of {weight_bytes / 1e6:.0f} MB exceeds {share:.0%} of the "
                      f"{available / 1e9:.1f} GB available)")


def resolve_attention_backend(choice: str, device: torch.device, no_flex_reason: str | None) -> tuple[str, str]:
    """EngineConfig.attention_backend to what runs, and why: auto is flex on CUDA where why_not_flex_by_default
    finds nothing against it (`no_flex_reason` None), batched elsewhere (RULES)."""
    if choice != "auto":
        get_backend(choice)  # (an unknown name is refused, naming the backends)
        return choice, "as asked"
    if device.type == "cuda" and no_flex_reason is None:
        return AUTO_ATTENTION_ON_CUDA, (f"auto: {AUTO_ATTENTION_ON_CUDA} on CUDA with its CUDA graphs (ahead of "
                                        f"{AUTO_ATTENTION} at every batch size measured)")
    if device.type == "cpu":
        return AUTO_ATTENTION, (f"auto: {AUTO_ATTENTION} on a CPU ({AUTO_ATTENTION_ON_CUDA}'s paged mask does not "
                                "compile there)")
    return AUTO_ATTENTION, f"auto: {AUTO_ATTENTION}, not {AUTO_ATTENTION_ON_CUDA}: {no_flex_reason}"


def why_not_flex_by_default(config: EngineConfig, device: torch.device, checkpoint: Path, ranks: int,
                            model_config: ModelConfig | None = None) -> str | None:
    """Why attention_backend auto is not flex on this configuration, or None when it is (RULES).
    `model_config`: the checkpoint's, when already read."""
    if device.type != "cuda":  # (why_no_graphs says so too; here before any checkpoint is read)
        return f"the device is {device.type}"
    if config.kv_cache_dtype != "auto":
        # Not measured against batched on a quantized pool: attention_backend flex chooses it.
        return (f"kv_cache_dtype {config.kv_cache_dtype} (flex over a quantized pool is not measured on a GPU "
                "yet; attention_backend flex chooses it)")
    if config.enable_lora:
        return "enable_lora (iterations with an adapter run without CUDA graphs)"
    flex = get_backend(AUTO_ATTENTION_ON_CUDA)
    min_head_dim = flex.cuda_min_head_dim
    configs = [model_config or read_model_config(checkpoint)[0]]
    if config.speculative_method == "draft" and config.speculative_model:
        configs.append(read_model_config(resolve_checkpoint(config.speculative_model))[0])
    for mc in configs:
        reason = why_no_graphs(config.cuda_graphs, device, AUTO_ATTENTION_ON_CUDA, ranks, any(mc.moe_layers))
        if reason is not None:
            return reason
        if mc.head_dim < min_head_dim:
            return f"head_dim {mc.head_dim} < {min_head_dim} (torch's flex kernels)"
    return None


def check_attention_support(attention: type[AttentionMetadata], device: torch.device, head_dim: int,
                            kv_dtype: torch.dtype, whose: str = "this model's") -> None:
    """Refuses what the attention backend cannot run on this device for a model of `head_dim` (`whose`
    names the model), by its traits: its CUDA kernels' head size, a float8 e4m3 pool's compute capability."""
    if device.type != "cuda":
        return
    min_head_dim = attention.cuda_min_head_dim
    if head_dim < min_head_dim:
        raise ValueError(f"attention_backend {attention.name} on CUDA needs head_dim >= {min_head_dim} (torch's "
                         f"{attention.name} kernels); {whose} is {head_dim}: choose batched or reference")
    fp8_capability = attention.cuda_fp8_pool_min_capability
    if fp8_capability is not None and kv_dtype == torch.float8_e4m3fn:
        capability = torch.cuda.get_device_capability(device)
        if capability < fp8_capability:  # (Triton converts float8 e4m3 from compute capability 8.9 on)
            raise ValueError(
                f"kv_cache_dtype fp8_e4m3 with attention_backend {attention.name} needs a GPU of compute "
                f"capability {fp8_capability[0]}.{fp8_capability[1]} or later (its paged decode kernel reads "
                f"float8 e4m3); {device} is {capability[0]}.{capability[1]}: choose kv_cache_dtype int8, or "
                f"attention_backend batched")


def why_no_graphs(choice: str, device: torch.device, attention_backend: str, world_size: int,
                  moe: bool) -> str | None:
    """Why decode iterations are not captured in CUDA graphs (EngineConfig.cuda_graphs, RULES), or None
    when they are. `moe`: the model has mixture-of-experts layers (its config's moe_layers)."""
    if choice == "off":
        return "cuda_graphs is off"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if not get_backend(attention_backend).cuda_graphs:
        return f"attention_backend is {attention_backend} (graphs need flex's fixed shapes)"
    if world_size > 1:
        return "the worker is one of several ranks (tensor or pipeline parallelism)"
    if moe:
        return "the model has mixture-of-experts layers (their routing reads token counts on the host)"
    return None


def why_not_compiled(choice: str, device: torch.device, attention_backend: str, world_size: int,
                     moe: bool) -> str | None:
    """Why the forward pass runs eagerly rather than through the CPU graphs (RULES), or None when it is
    compiled (the warm-up may still find a reason: warmup.py)."""
    if choice == "off":
        return "torch_compile is off"
    if device.type != "cpu":
        return f"the device is {device.type}, not a CPU (compiling is measured on a CPU only; CUDA has cuda_graphs)"
    if not get_backend(attention_backend).in_compiled_forward:
        return f"attention_backend is {attention_backend} (compiling runs reference or batched attention as one op)"
    if world_size > 1:
        return "several ranks (their activations cross processes between layers)"
    if moe:
        return "a mixture-of-experts layer counts its tokens per expert on the host"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
