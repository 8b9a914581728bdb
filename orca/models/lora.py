"""LoRA adapters in PEFT's format, and the layers that add their deltas to a batch of mixed adapters.

An adapter (``adapter_config.json`` + ``adapter_model.safetensors``) holds A (r, in) and B (out, r) per
adapted linear; the output becomes x W^T + s (x A^T) B^T, s = lora_alpha / r (/ sqrt(r) with use_rslora).
Targets: attention q/k/v/o and the dense MLP (Llama-style), c_attn/c_proj/c_fc (GPT-2); fused linears are
adapted part by part. Every adapted linear holds max_loras slots (orca/core/lora.py assigns them) of P parts
x r_max rows, B pre-scaled by s; under tensor parallelism a slot holds this rank's share, and a
row-parallel layer all-reduces the small products x A^T. Per iteration the adapter rows are grouped by slot
(LoRABatch): grouped batched matmuls, or per-slot segments where padding would waste more.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from orca.checkpoint import ModelConfig
from orca.parallel import ROW, ParallelContext, Shard, Source, shard_tensor

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# Above this many padded rows per real row, a grouped iteration runs per slot instead.
GROUPED_MAX_PADDING = 2.0


class LoRAError(ValueError):
    """An adapter orca cannot serve: the message names the adapter and the reason."""


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The linear layers an adapter may adapt, by their name inside a layer (PEFT's module path after the
    layer prefix), with their full (out, in) shapes in nn.Linear's layout."""
    e, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.architecture == "gpt2":
        return {"attn.c_attn": (3 * e, e), "attn.c_proj": (e, e), "mlp.c_fc": (i, e), "mlp.c_proj": (e, i)}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.q_proj": (q, e), "self_attn.k_proj": (kv, e), "self_attn.v_proj": (kv, e),
        "self_attn.o_proj": (e, q), "mlp.gate_proj": (i, e), "mlp.up_proj": (i, e), "mlp.down_proj": (e, i),
    }


def layer_prefix(cfg: ModelConfig) -> str:
    return "transformer.h." if cfg.architecture == "gpt2" else "model.layers."


def _short_names(cfg: ModelConfig) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in target_shapes(cfg)})


@dataclass
class LoRAAdapter:
    """One adapter as read from its files: for each adapted module (the base checkpoint's name, e.g.
    model.layers.3.self_attn.q_proj), A (r, in) and B (out, r) float32 on the host, and its scaling."""

    name: str
    path: str
    rank: int
    scaling: dict[str, float]  # module -> s
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks an adapter for a base model of config `cfg`; LoRAError names the adapter and what
    is wrong (missing or corrupt files, another base model's shapes, a rank above max_rank, a target orca
    cannot adapt, a PEFT variant it does not run).

    The only place adapter files are read: once per registration, on the registering thread, never in an
    iteration; the host copy goes to the workers with the next plan (StepPlan.lora_added)."""
    where = f"LoRA adapter {name!r} ({path})"
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAError(f"{where}: no such directory (an adapter is a directory with {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS})")
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise LoRAError(f"{where}: no {ADAPTER_CONFIG}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where}: {ADAPTER_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type is {config.get('peft_type')!r}; orca serves LORA adapters only")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    unsupported = [
        (config.get("target_parameters"), "target_parameters (adapters on parameters, such as a mixture's experts)"),
        (config.get("use_dora"), "use_dora (DoRA)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only \"none\")"),
        (config.get("modules_to_save"), "modules_to_save (fully trained layers)"),
        (config.get("alpha_pattern"), "alpha_pattern (per-module alphas)"),
        (config.get("layer_replication"), "layer_replication"),
    ]
    for present, what in unsupported:
        if present:
            raise LoRAError(f"{where}: {what} is not supported")
    weights_file = directory / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        other = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" \
            if (directory / "adapter_model.bin").exists() else ""
        raise LoRAError(f"{where}: no {ADAPTER_WEIGHTS}{other}")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds for a corrupt file
        raise LoRAError(f"{where}: {ADAPTER_WEIGHTS} cannot be read ({type(exc).__name__}: {exc})") from None

    shapes, prefix = target_shapes(cfg), layer_prefix(cfg)
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.(.+)$")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = re.match(r"^(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if m is None or not m.group(1).startswith(_PEFT_PREFIX):
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A or B matrix of a linear layer "
                            f"(embedding and other adapters are not supported)")
        pairs.setdefault(m.group(1)[len(_PEFT_PREFIX):], {})[m.group(2)] = tensor
    if not pairs:
        raise LoRAError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA matrices")
    adapter = LoRAAdapter(name, str(directory), rank, {})
    use_rslora = bool(config.get("use_rslora"))
    for module, ab in sorted(pairs.items()):
        m = pattern.match(module)
        inner = m.group(2) if m else None
        if m is None or inner not in shapes or int(m.group(1)) >= cfg.num_layers or (
                inner.startswith("mlp.") and cfg.moe_layers and cfg.moe_layers[int(m.group(1))]):
            raise LoRAError(f"{where}: it adapts {module}, which orca cannot adapt (the linear layers "
                            f"{', '.join(_short_names(cfg))} of the {cfg.num_layers} layers; not embeddings, the "
                            "LM head or a mixture's experts)")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: {module} has lora_{''.join(set('AB') - set(ab))} missing")
        a, b = ab["A"], ab["B"]
        out, cols = shapes[inner]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape != (r, cols) or b.shape != (out, r):
            raise LoRAError(f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this base model's "
                            f"layer is ({out}, {cols}): A must be (r, {cols}) and B ({out}, r). Is it an adapter for "
                            "another base model?")
        if r > max_rank:
            raise LoRAError(f"{where}: {module} has rank {r}, above max_lora_rank {max_rank} (raise max_lora_rank "
                            "to serve it)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{where}: {module} holds NaN or infinite values")
        adapter.scaling[module] = alpha / (math.sqrt(r) if use_rslora else r)
        adapter.weights[module] = (a.float().contiguous(), b.float().contiguous())
    return adapter


# -- the layers ------------------------------------------------------------------------------------------
class LoRABatch:
    """One iteration's rows by slot, shared by every LoRALinear of a model (set_rows, by the worker before
    the forward pass; `active` False: no adapter row).

    Grouped: `gather` (slots x max_rows,) row indices over slots [lo, hi), each slot padded with row 0;
    `valid` (slots, max_rows, 1) 1 for a real row. Per slot: `segments` (slot, row indices, start, stop),
    indices None where the rows are the contiguous range [start, stop) (read and written in place)."""

    def __init__(self) -> None:
        self.active = False
        self.grouped = True
        self.lo = self.hi = 0
        self.max_rows = 0
        self.gather: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.segments: list[tuple[int, torch.Tensor | None, int, int]] = []

    def clear(self) -> None:
        self.active = False
        self.segments = []
        self.gather = self.valid = None

    def set_rows(self, rows_by_slot: dict[int, list[int]], device: torch.device, dtype: torch.dtype) -> None:
        """The iteration's adapter rows: {slot: row indices into the (T, ...) activations, ascending}."""
        self.clear()
        rows_by_slot = {s: r for s, r in rows_by_slot.items() if r}
        if not rows_by_slot:
            return
        self.active = True
        self.lo, self.hi = min(rows_by_slot), max(rows_by_slot) + 1
        total = sum(len(r) for r in rows_by_slot.values())
        self.max_rows = max(len(r) for r in rows_by_slot.values())
        padded = (self.hi - self.lo) * self.max_rows
        self.grouped = len(rows_by_slot) > 1 and padded <= GROUPED_MAX_PADDING * total + 64
        if self.grouped:
            gather, valid = [], []
            for slot in range(self.lo, self.hi):
                rows = rows_by_slot.get(slot, [])
                gather += rows + [0] * (self.max_rows - len(rows))
                valid += [1.0] * len(rows) + [0.0] * (self.max_rows - len(rows))
            self.gather = torch.tensor(gather, dtype=torch.int64).to(device)
            self.valid = torch.tensor(valid, dtype=dtype).view(self.hi - self.lo, self.max_rows, 1).to(device)
        else:
            for slot, rows in sorted(rows_by_slot.items()):
                start, stop = rows[0], rows[-1] + 1
                contiguous = stop - start == len(rows)
                index = None if contiguous else torch.tensor(rows, dtype=torch.int64).to(device)
                self.segments.append((slot, index, start, stop))


@dataclass(frozen=True)
class LoRAPart:
    """One Hugging Face linear inside one of our (possibly fused) linears: its name inside a layer
    (target_shapes' key), its shard rule, and its rows of the fused layer's (this rank's) output."""

    inner: str
    rule: Shard
    offset: int
    size: int


class LoRALinear(nn.Module):
    """A linear layer (any of ours: nn.Linear, row-parallel, oneDNN-packed, quantized) plus the LoRA deltas
    of the adapters in the model's slots (the module docstring). `row_parallel`: the base is row-parallel
    (its input is this rank's columns); `par` all-reduces the products x A^T then."""

    def __init__(self, base: nn.Module, layer: int, parts: list[LoRAPart], in_features: int, out_features: int,
                 num_slots: int, max_rank: int, batch: LoRABatch, par: ParallelContext | None,
                 row_parallel: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.layer, self.parts, self.batch = base, layer, parts, batch
        self.in_features, self.out_features = in_features, out_features
        self.num_slots, self.max_rank = num_slots, max_rank
        self.pr = len(parts) * max_rank  # rows of a slot: every part's r_max
        self.par, self.row_parallel = par, row_parallel
        self.register_buffer("lora_a", torch.zeros(num_slots * self.pr, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_bt", torch.zeros(num_slots * self.pr, out_features, dtype=dtype, device=device),
                             persistent=False)
        # Rows of each slot its adapter fills (0: the adapter leaves this layer alone).
        self.used = [0] * num_slots

    def load_slot(self, slot: int, adapter: LoRAAdapter | None, prefix: str, tp_rank: int, tp_size: int) -> None:
        """Puts the adapter's matrices for this layer into the slot, the parts it adapts one after the other
        (A's rows, and B^T's rows over the part's output columns); None empties it."""
        rows = slice(slot * self.pr, (slot + 1) * self.pr)
        self.lora_a[rows].zero_()
        self.lora_bt[rows].zero_()
        self.used[slot] = 0
        if adapter is None:
            return
        start = slot * self.pr
        for part in self.parts:
            module = f"{prefix}{self.layer}.{part.inner}"
            if module not in adapter.weights:
                continue
            a, b = adapter.weights[module]
            r = a.shape[0]
            if self.row_parallel:
                a = shard_tensor(a, ROW, tp_rank, tp_size)  # this rank's input columns
            else:
                b = shard_tensor(b, part.rule, tp_rank, tp_size)  # this rank's output rows
            self.lora_a[start:start + r].copy_(a)
            self.lora_bt[start:start + r, part.offset:part.offset + part.size].copy_(b.t() * adapter.scaling[module])
            start += r
        self.used[slot] = start - slot * self.pr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.active:
            self.add_deltas(y, x)
        return y

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y (T, out) += the deltas of the iteration's adapter rows of x (T, in), in place."""
        batch = self.batch
        used = max(self.used[batch.lo:batch.hi])  # rows the widest adapter in the range fills
        if used == 0:  # none of them adapts this layer
            return
        pr = self.pr
        if batch.grouped:
            n = batch.hi - batch.lo
            a = self.lora_a[batch.lo * pr:batch.hi * pr].view(n, pr, self.in_features)[:, :used]
            bt = self.lora_bt[batch.lo * pr:batch.hi * pr].view(n, pr, self.out_features)[:, :used]
            xs = x.index_select(0, batch.gather).view(n, batch.max_rows, self.in_features)
            xa = torch.bmm(xs, a.transpose(1, 2))  # (n, rows, used)
            if self.row_parallel:
                self.par.all_reduce(xa)  # type: ignore[union-attr]
            xa.mul_(batch.valid)  # padding rows add nothing
            y.index_add_(0, batch.gather, torch.bmm(xa, bt).view(-1, self.out_features))
            return
        for slot, index, start, stop in batch.segments:
            used = self.used[slot]  # (the same on every rank: all or none join a row-parallel all-reduce)
            if used == 0:
                continue
            a, bt = self.lora_a[slot * pr:slot * pr + used], self.lora_bt[slot * pr:slot * pr + used]
            xs = x[start:stop] if index is None else x.index_select(0, index)
            xa = xs @ a.t()  # (rows, used)
            if self.row_parallel:
                self.par.all_reduce(xa)  # type: ignore[union-attr]
            if index is None:
                y[start:stop].addmm_(xa, bt)
            else:
                y.index_add_(0, index, xa @ bt)

    def extra_repr(self) -> str:
        return (f"parts={[p.inner for p in self.parts]}, slots={self.num_slots}, max_rank={self.max_rank}, "
                f"row_parallel={self.row_parallel}")


class LoRAModel:
    """The LoRA side of one worker's model: wraps its adaptable linears (add_lora_layers) and fills their
    slots from the host copy of every registered adapter (kept until removed), so a slot load never reads
    a file."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, par: ParallelContext, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.par, self.num_slots, self.max_rank = cfg, par, num_slots, max_rank
        self.device, self.dtype = device, dtype
        self.batch = LoRABatch()
        self.layers = add_lora_layers(model, cfg, par, num_slots, max_rank, self.batch, dtype, device)
        self.prefix = layer_prefix(cfg)
        self.host: dict[int, LoRAAdapter] = {}  # lora_id -> adapter, as read at registration
        self.bytes_per_slot = sum((m.lora_a[:m.pr].numel() + m.lora_bt[:m.pr].numel()) * m.lora_a.element_size()
                                  for m in self.layers)

    def add(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Keeps the host copy of a newly registered adapter (read and checked by the driver)."""
        self.host[lora_id] = adapter

    def load(self, slot: int, lora_id: int, name: str) -> None:
        """Puts the adapter into the slot (the core decides which: orca/core/lora.py), from its host copy."""
        adapter = self.host.get(lora_id)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {name!r} (id {lora_id}) has no host copy on this worker: a plan must "
                               "hand it over (StepPlan.lora_added) before one puts it into a slot")
        for layer in self.layers:
            layer.load_slot(slot, adapter, self.prefix, self.par.tp_rank, self.par.tp_size)

    def forget(self, lora_ids: set[int]) -> None:
        """Drops the host copies of adapters no longer registered (not their slots: the core reuses them)."""
        for lora_id in lora_ids:
            self.host.pop(lora_id, None)


def add_lora_layers(model: nn.Module, cfg: ModelConfig, par: ParallelContext, num_slots: int, max_rank: int,
                    batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> list[LoRALinear]:
    """Wraps every adaptable linear of `model` (this rank's part) in a LoRALinear, its slots empty."""
    shapes, prefix = target_shapes(cfg), layer_prefix(cfg)
    weight_map: dict[str, list[Source]] = type(model).hf_weight_map(cfg, par)  # type: ignore[attr-defined]
    wrapped: list[LoRALinear] = []
    modules = dict(model.named_modules())
    for ours, sources in weight_map.items():
        if not ours.endswith(".weight"):
            continue
        inners = []
        for s in sources:
            m = re.match(rf"^{re.escape(prefix)}(\d+)\.(.+)\.weight$", s.name)
            inners.append((int(m.group(1)), m.group(2)) if m and m.group(2) in shapes else None)
        if not inners or None in inners:
            continue  # embeddings, the head, norms, a mixture's experts
        module_name = ours[: -len(".weight")]
        parent_name, _, attr = module_name.rpartition(".")
        base = modules[module_name]
        parts, offset = [], 0
        row_parallel = any(s.shard.kind == "row" for s in sources)
        for s, (_, inner) in zip(sources, inners):
            out, cols = shapes[inner]
            size = out if row_parallel else shard_tensor(torch.empty(out, 1, device="meta"), s.shard,
                                                         par.tp_rank, par.tp_size).shape[0]
            parts.append(LoRAPart(inner, s.shard, offset, size))
            offset += size
        cols = shapes[inners[0][1]][1]
        in_features = cols // par.tp_size if row_parallel else cols
        layer_index = inners[0][0]
        lora = LoRALinear(base, layer_index, parts, in_features, offset, num_slots, max_rank, batch,
                          par if par.tp_size > 1 else None, row_parallel and par.tp_size > 1, dtype, device)
        setattr(modules[parent_name], attr, lora)
        wrapped.append(lora)
    return wrapped
