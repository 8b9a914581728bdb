"""The tensor-parallel pieces the model families share (orca/parallel.py says how weights split).

With tp_size == 1 each factory returns the plain torch module, so a single-rank model runs exactly the
code it always ran."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from orca import tuning
from orca.checkpoint import ModelConfig
from orca.parallel import ParallelContext, vocab_per_rank


class RowParallelLinear(nn.Linear):
    """y = sum over the group of x W_r^T, + b once. W_r: (out, in / tp), this rank's input columns; x: the
    matching (T, in / tp) slice of the activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool, par: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.par = par

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.par.all_reduce(F.linear(x, self.weight))  # (T, out)
        return y if self.bias is None else y + self.bias


def row_linear(in_features: int, out_features: int, bias: bool, par: ParallelContext) -> nn.Linear:
    """A row-parallel linear; in_features is this rank's share."""
    if par.tp_size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, par)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + V/tp) of the embedding; an id outside them gives zeros, and the group's sum
    is every id's row."""

    def __init__(self, vocab_size: int, hidden: int, par: ParallelContext) -> None:
        rows = vocab_per_rank(vocab_size, par.tp_size)
        super().__init__(rows, hidden, _weight=torch.empty(rows, hidden))
        self.par, self.start = par, par.tp_rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (T,)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.masked_fill(~inside, 0), self.weight).masked_fill_(~inside.unsqueeze(-1), 0)
        return self.par.all_reduce(x)  # (T, E)


def embedding(vocab_size: int, hidden: int, par: ParallelContext) -> nn.Embedding:
    if par.tp_size == 1:
        return plain_embedding(vocab_size, hidden)
    return VocabParallelEmbedding(vocab_size, hidden, par)


def plain_embedding(num: int, hidden: int) -> nn.Embedding:
    """nn.Embedding without its random init: the loader copies every weight in, and the meta-device init
    costs each worker process seconds of one-time set-up."""
    return nn.Embedding(num, hidden, _weight=torch.empty(num, hidden))


def vocab_logits(
    hidden: torch.Tensor, head: torch.Tensor | nn.Module, vocab_size: int, par: ParallelContext
) -> torch.Tensor:
    """(B, V) float32 logits of normed hidden states (B, E) under this rank's head rows (V/tp, E): a weight,
    or the head as a (packed) linear module."""
    logits = head(hidden) if isinstance(head, nn.Module) else F.linear(hidden, head)  # (B, V / tp)
    if par.tp_size > 1:
        logits = par.all_gather(logits, dim=-1)[:, :vocab_size]  # (B, V): padding rows dropped
    return logits.float()


# -- what every family's pipeline stage does alike ------------------------------------------------------
def untied_lm_head(cfg: ModelConfig, par: ParallelContext) -> nn.Linear | None:
    """The last stage's own LM head (this rank's vocabulary rows), or None where the model ties it to the
    input embedding or this stage is not the last."""
    if not par.is_last_stage or cfg.tie_word_embeddings:
        return None
    return nn.Linear(cfg.hidden_size, vocab_per_rank(cfg.vocab_size, par.tp_size), bias=False)


def stage_input(par: ParallelContext, hidden: torch.Tensor | None, embed: Callable[[], torch.Tensor]) -> torch.Tensor:
    """(T, E): the first stage embeds (`embed()`); a later stage starts from `hidden`, the previous stage's
    output."""
    if par.is_first_stage:
        return embed()
    if hidden is None:
        raise ValueError(f"pipeline stage {par.stage} needs the previous stage's hidden states")
    return hidden


def stage_logits(
    hidden: torch.Tensor, norm: nn.Module | None, embedding: nn.Embedding | None, lm_head: nn.Linear | None,
    cfg: ModelConfig, par: ParallelContext,
) -> torch.Tensor:
    """(B, V) float32 logits of (B, E) hidden rows through the final norm and the LM head (the embedding's
    weight when tied); last stage only (the one holding `norm`)."""
    if norm is None:
        raise RuntimeError(f"pipeline stage {par.stage} is not the last: it has no LM head")
    head = embedding.weight if lm_head is None else lm_head  # (V/tp, E), or the (packed) head module
    return vocab_logits(norm(hidden), head, cfg.vocab_size, par)


# -- oneDNN-packed linears (EngineConfig.linear_backend) --------------------------------------------------
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack (and so multiply) weights of this dtype on this CPU: always float32 where
    torch has oneDNN; bfloat16 and float16 only where the CPU has the instructions oneDNN needs for them."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


# The hybrid backend's switch (orca/tuning.py, HYBRID_MIN_ROWS): from that many rows F.linear on the float32
# weights beats oneDNN's packed matmul. Float32 only: in bfloat16 F.linear never won, so no second copy.
HYBRID_KEEPS_WEIGHTS = (torch.float32,)


def available_memory_bytes() -> int | None:
    """The host's available memory (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, weight: torch.Tensor | None,
                  bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """PackedLinear's matmul: F.linear on the kept weight from tuning.HYBRID_MIN_ROWS rows, else oneDNN's
    on the packed one."""
    if weight is not None and x.shape[0] >= tuning.HYBRID_MIN_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed once at load into oneDNN's blocked layout and multiplied by
    oneDNN's matmul, faster at decode's few rows (docs/BENCHMARKS.md, "Where a decode iteration's time
    went"). With `keep_weight` (hybrid) inputs of tuning.HYBRID_MIN_ROWS rows or more use F.linear on the
    kept weight. With `par` (row-parallel) partial products are all-reduced before the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, par: ParallelContext | None = None,
                 keep_weight: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Buffers, not parameters: the packed layout is opaque (no views, no state_dict round trip).
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        # The same tensor, not a copy: a tied head shares its embedding's.
        self.register_buffer("weight", weight.detach() if keep_weight else None, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.par = par

    kernel = staticmethod(packed_linear)  # the matmul (an instance may be given another of its signature)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        bias_in_matmul = self.bias if self.par is None else None
        y = self.kernel(x, self.packed_weight, self.weight, bias_in_matmul, self.out_features)
        if self.par is not None:
            y = self.par.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"keep_weight={self.weight is not None}")


def prepack_linears(model: nn.Module, keep_weights: bool = False) -> None:
    """Replaces every linear layer of `model` (plain and row-parallel; not a mixture's stacked experts) by
    a PackedLinear, and gives a tied head a packed copy of the embedding unless it has a quantized one.
    `keep_weights` (hybrid): each keeps its checkpoint weight too."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, child.bias, keep_weight=keep_weights))
            elif type(child) is RowParallelLinear:
                setattr(parent, name, PackedLinear(child.weight, child.bias, child.par, keep_weight=keep_weights))
    if model.par.is_last_stage and model.config.tie_word_embeddings and model.lm_head is None:
        model.lm_head = PackedLinear(model.input_embedding.weight, None, keep_weight=keep_weights)
