"""Tensor (Megatron-style) and pipeline parallelism: where a rank sits, and how weights are split.

A layout of `tp` x `pp` ranks: rank = stage * tp + tp_rank. Each pipeline stage holds a contiguous run of
layers; within a stage the `tp` ranks split every layer's matrices:

- column-parallel (q/k/v, gate/up, c_attn, c_fc): output rows split, no communication;
- row-parallel (o_proj, down_proj, c_proj, the MoE output): input columns split, partial sums all-reduced,
  the bias added once after;
- vocab-parallel (embedding, LM head): vocabulary rows split, padded to ceil(V / tp) per rank; the
  embedding all-reduces (ids outside a rank's rows give zeros), the head all-gathers its logits.

Attention heads split with the columns: rank r holds query heads [r H/tp, (r+1) H/tp) and their K/V heads;
when tp exceeds the K/V heads, each K/V head is replicated on the tp / KVH ranks whose queries use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from orca.checkpoint import ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    """How many ranks split each layer (tensor) and the layers (pipeline). Pure numbers, picklable."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor_parallel_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of this layout")
        return divmod(rank, self.tensor_parallel_size)

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """The global layer indices stage `stage` holds: contiguous, as even as possible, the earlier
        stages taking one extra layer each when the division is not exact."""
        pp = self.pipeline_parallel_size
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size {pp} is more than the {num_layers} layers of this model: "
                             f"use at most {num_layers}")
        if not 0 <= stage < pp:
            raise ValueError(f"stage {stage} is outside the {pp} pipeline stages")
        base, extra = divmod(num_layers, pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def validate(self, cfg: ModelConfig) -> None:
        """ValueError naming what does not split and which sizes would."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        problem = _tp_problem(cfg, tp)
        if problem is not None:
            fits = [t for t in range(1, cfg.num_heads + 1) if _tp_problem(cfg, t) is None]
            raise ValueError(f"tensor_parallel_size {tp} {problem} of this model: use one of "
                             f"{', '.join(map(str, fits))}")
        if pp > cfg.num_layers:
            raise ValueError(f"pipeline_parallel_size {pp} is more than the {cfg.num_layers} layers of this model: "
                             f"use at most {cfg.num_layers}")


def _tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model's layers (the end of a sentence), or None."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % tp:
        return f"does not divide the {heads} attention heads"
    if kv % tp and tp % kv:
        return f"neither divides nor is a multiple of the {kv} key/value heads"
    dense = not cfg.moe_layers or not all(cfg.moe_layers)
    if dense and cfg.intermediate_size % tp:
        return f"does not divide the MLP intermediate size {cfg.intermediate_size}"
    if any(cfg.moe_layers) and cfg.moe_intermediate_size % tp:
        return f"does not divide the experts' intermediate size {cfg.moe_intermediate_size}"
    return None


def vocab_per_rank(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rows per rank: ceil(V / tp), the last rank's padded with zero rows."""
    return -(-vocab_size // tp_size)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """K/V heads one rank holds: its share, or one (replicated) when tp exceeds the K/V heads."""
    return max(1, num_kv_heads // tp_size)


class ParallelContext:
    """One rank's place: tp_rank, tp_size, stage, pp_size, layers (range of global layer indices this stage
    holds), tp_group (a torch.distributed ProcessGroup or None when tp_size == 1; with tp_size > 1, None
    means the default group, right when the whole world is one tensor-parallel group)."""

    def __init__(self, layout: ParallelLayout, rank: int, num_layers: int, tp_group: Any = None) -> None:
        self.layout, self.rank = layout, rank
        self.stage, self.tp_rank = layout.coords(rank)
        self.tp_size, self.pp_size = layout.tensor_parallel_size, layout.pipeline_parallel_size
        self.layers = layout.stage_layers(num_layers, self.stage)
        self.tp_group = tp_group

    @classmethod
    def single(cls, num_layers: int) -> ParallelContext:
        """One rank holding the whole model (tp 1, pp 1)."""
        return cls(ParallelLayout(), 0, num_layers)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the tensor-parallel group, in place; x untouched when tp_size == 1."""
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The group's x concatenated along dim in tp-rank order; x itself when tp_size == 1."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def __repr__(self) -> str:
        return (f"ParallelContext(stage={self.stage}/{self.pp_size}, tp_rank={self.tp_rank}/{self.tp_size}, "
                f"layers={self.layers.start}..{self.layers.stop - 1})")


# -- shard rules: how one Hugging Face tensor (in nn.Linear's [out, in] layout) splits over tp ranks ---------
@dataclass(frozen=True)
class Shard:
    kind: str  # one of SHARD_KINDS
    head_dim: int = 0  # heads, kv_heads, packed_qkv: dim 0 counts in units of head_dim


SHARD_KINDS = ("replicated", "column", "row", "heads", "kv_heads", "vocab", "packed_qkv")
REPLICATED = Shard("replicated")  # norms, row-parallel biases, the MoE router, GPT-2's wpe
COLUMN = Shard("column")  # dim 0 split evenly: gate/up/c_fc weights and biases
ROW = Shard("row")  # dim 1 split evenly: o_proj/down_proj/c_proj weights
VOCAB = Shard("vocab")  # dim 0 rows [r ceil(V/tp), ...), zero-padded to ceil(V/tp): embedding, LM head


def head_shard(head_dim: int) -> Shard:
    """q_proj (weight and bias): rank r gets query heads [r H/tp, (r+1) H/tp)."""
    return Shard("heads", head_dim)


def kv_head_shard(head_dim: int) -> Shard:
    """k_proj, v_proj: like heads; when tp > KVH rank r gets the single K/V head r // (tp // KVH)."""
    return Shard("kv_heads", head_dim)


def packed_qkv_shard(head_dim: int) -> Shard:
    """GPT-2's c_attn (q | k | v concatenated along dim 0, weight or bias): each third split by heads."""
    return Shard("packed_qkv", head_dim)


class Source(NamedTuple):
    """One Hugging Face tensor that (part of) one of our parameters is made of."""

    name: str
    shard: Shard = REPLICATED
    conv1d: bool = False  # a GPT-2 Conv1D weight, stored [in, out]: transposed before sharding


def shard_tensor(t: torch.Tensor, rule: Shard, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of the Hugging Face tensor t (a view where possible)."""
    if rule.kind not in SHARD_KINDS:
        raise ValueError(f"unknown shard kind {rule.kind!r}")
    if tp_size == 1 or rule.kind == "replicated":
        return t
    if rule.kind == "vocab":
        per = vocab_per_rank(t.shape[0], tp_size)
        piece = t[tp_rank * per : (tp_rank + 1) * per]
        if piece.shape[0] == per:
            return piece
        return torch.cat((piece, piece.new_zeros(per - piece.shape[0], *t.shape[1:])))
    if rule.kind == "packed_qkv":
        return torch.cat([shard_tensor(p, head_shard(rule.head_dim), tp_rank, tp_size) for p in t.chunk(3)])
    if rule.kind == "row":
        return _even(t, 1, 1, tp_rank, tp_size)
    if rule.kind == "column":
        return _even(t, 0, 1, tp_rank, tp_size)
    num_heads = t.shape[0] // rule.head_dim
    if rule.kind == "kv_heads" and tp_size > num_heads:  # K/V replication
        if tp_size % num_heads:
            raise ValueError(f"{tp_size} ranks cannot share {num_heads} K/V heads evenly")
        head = tp_rank // (tp_size // num_heads)
        return t[head * rule.head_dim : (head + 1) * rule.head_dim]
    return _even(t, 0, rule.head_dim, tp_rank, tp_size)


def _even(t: torch.Tensor, dim: int, unit: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank tp_rank's 1/tp_size of t along dim, in whole units of `unit` elements."""
    units = t.shape[dim] // unit
    if units * unit != t.shape[dim] or units % tp_size:
        raise ValueError(f"dim {dim} of a {tuple(t.shape)} tensor does not split into {tp_size} equal parts"
                         + (f" of whole heads of {unit}" if unit > 1 else ""))
    size = units // tp_size * unit
    return t.narrow(dim, tp_rank * size, size)
