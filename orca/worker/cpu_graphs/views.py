"""What the CPU graphs compile: views of the model whose layers call opaque ops where a graph cannot hold
their work, and one fixed matmul where the eager layer chooses by row count.

A view shares every tensor with the model and leaves the model itself eager. In it:
- attention is ``orca::selective_attention``: the per-request split reads the iteration's layout (Python
  lists), which the runner puts in scope (``iteration_scope``) around each call; the layers receive
  OPAQUE_ATTENTION in place of the metadata;
- oneDNN-packed linears call ``orca::packed_linear``: inductor cannot lower oneDNN's op on a weight it did
  not pack itself, and the op picks F.linear from HYBRID_MIN_ROWS rows at run time;
- a LoRA layer's deltas are ``orca::lora_add_`` (the grouping of rows changes with each mix of adapters);
- a quantized layer runs its format's kernel (int view) or its float copy as ``orca::packed_linear``
  (float view): a graph's row count is dynamic, so the runner picks the view by the iteration's rows.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from orca.models.attention import AttentionMetadata
from orca.models.layers import PackedLinear, packed_linear
from orca.models.lora import LoRALinear
from orca.models.quantization import QuantizedLinear


def graph_view(model: nn.Module, float_copies: bool = False) -> nn.Module:
    """`model`'s module tree copied (every tensor shared) with the opaque ops and fixed matmuls above;
    `float_copies`: quantized layers with a float copy multiply it."""
    copies: dict[int, nn.Module] = {}

    def view(module: nn.Module) -> nn.Module:
        if id(module) in copies:  # (a module reached twice stays one)
            return copies[id(module)]
        c = copy.copy(module)  # a new __dict__; its _parameters and _buffers dicts shared
        copies[id(module)] = c
        c._modules = {name: None if child is None else view(child) for name, child in module._modules.items()}
        if isinstance(c, PackedLinear):
            c.__dict__["kernel"] = torch.ops.orca.packed_linear
        elif isinstance(c, QuantizedLinear):
            float_copy = float_copies and c.float_packed is not None
            c.__dict__["matmul"] = functools.partial(_float_copy, c) if float_copy else c.quantized_matmul
        elif isinstance(c, LoRALinear):
            c.__dict__["lora_key"] = _register(module)
            c.__dict__["add_deltas"] = functools.partial(_lora_op, c)
        return c

    return view(model)


def _float_copy(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.orca.packed_linear(x, layer.float_packed, None, None, layer.out_features)


# -- attention --------------------------------------------------------------------------------------------
_scope = threading.local()


@contextlib.contextmanager
def iteration_scope(meta: AttentionMetadata) -> Iterator[None]:
    """The iteration whose layout orca::selective_attention reads, for the duration of a call (this thread)."""
    _scope.meta = meta
    try:
        yield
    finally:
        _scope.meta = None


class OpaqueAttention:
    """What a view's layers get as their attention metadata: every layer's attention as one opaque op."""

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        return torch.ops.orca.selective_attention(q, kv, layer, scale, window)


OPAQUE_ATTENTION = OpaqueAttention()


def _attention_op(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
    meta = getattr(_scope, "meta", None)
    if meta is None:
        raise RuntimeError("orca::selective_attention ran outside iteration_scope: it has no iteration layout")
    return meta.write_and_attend(q, kv, layer, scale, window).contiguous()


def _attention_shape(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # (T, H * D)


def _packed_linear_shape(x: torch.Tensor, packed_weight: torch.Tensor, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)  # (the packed weight's layout is oneDNN's)


_OPS = torch.library.Library("orca", "FRAGMENT")
_OPS.define("selective_attention(Tensor q, Tensor kv, int layer, float scale, int? window) -> Tensor")
_OPS.impl("selective_attention", _attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("orca::selective_attention", _attention_shape, lib=_OPS)
_OPS.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? weight, Tensor? bias, int out_features) -> Tensor")
_OPS.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("orca::packed_linear", _packed_linear_shape, lib=_OPS)


# -- LoRA -------------------------------------------------------------------------------------------------
# The op finds its layer by key; the layer's LoRABatch holds the iteration's rows.
_LAYERS: weakref.WeakValueDictionary[int, LoRALinear] = weakref.WeakValueDictionary()


def _register(layer: LoRALinear) -> int:
    key = id(layer)
    _LAYERS[key] = layer
    return key


def _lora_op(layer: LoRALinear, y: torch.Tensor, x: torch.Tensor) -> None:
    torch.ops.orca.lora_add_(y, x, layer.lora_a, layer.lora_bt, layer.lora_key)


@torch.library.custom_op("orca::lora_add_", mutates_args=("y",))
def _lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor, key: int) -> None:
    _LAYERS[key].add_deltas(y, x)


@_lora_add.register_fake
def _lora_add_fake(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor, key: int) -> None:
    return None
