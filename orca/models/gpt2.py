"""GPT-2 family (the GPT-3 shape Orca served): learned positions, LayerNorm, tanh-GELU, fused QKV,
tied LM head. Works on tokens flattened to [num_tokens, hidden].

Under tensor parallelism (orca/parallel.py) a rank holds H/tp heads of c_attn (a third of each of q, k, v)
and I/tp rows of c_fc; c_proj and the MLP's projection are row-parallel. A pipeline stage holds its own
layers; the first stage embeds, the last normalises and computes logits."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from orca.checkpoint import ModelConfig
from orca.models.attention import AttentionMetadata, selective_attention
from orca.models.layers import embedding, plain_embedding, row_linear, stage_input, stage_logits, untied_lm_head
from orca.parallel import COLUMN, REPLICATED, ROW, VOCAB, ParallelContext, Source, packed_qkv_shard


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ParallelContext) -> None:
        super().__init__()
        hidden, tp = cfg.hidden_size, par.tp_size
        self.layer, self.kv_layer = layer, layer - par.layers.start  # global; index in this stage's K/V pool
        self.num_heads, self.head_dim = cfg.num_heads // tp, cfg.head_dim  # this rank's heads
        q_size = self.num_heads * self.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim) if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= layer + 1
        self.ln_1 = nn.LayerNorm(hidden, eps=cfg.norm_eps)
        self.c_attn = nn.Linear(hidden, 3 * q_size)
        self.c_proj = row_linear(q_size, hidden, True, par)
        self.ln_2 = nn.LayerNorm(hidden, eps=cfg.norm_eps)
        self.c_fc = nn.Linear(hidden, cfg.intermediate_size // tp)
        self.mlp_proj = row_linear(cfg.intermediate_size // tp, hidden, True, par)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]  # x: (T, E)
        q_size = self.num_heads * self.head_dim
        qkv = self.c_attn(self.ln_1(x))  # (T, 3 H D): one matmul for every token of every request
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        kv = qkv[:, q_size:].view(num_tokens, 2, self.num_heads, self.head_dim)  # (T, 2, H, D)
        x = x + self.c_proj(selective_attention(q, kv, meta, self.kv_layer, self.scale))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext.single(cfg.num_layers)
        par.layout.validate(cfg)
        self.config, self.par = cfg, par
        first, last, tied = par.is_first_stage, par.is_last_stage, cfg.tie_word_embeddings
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size, par) if first or (last and tied) else None
        self.wpe = plain_embedding(cfg.max_position_embeddings, cfg.hidden_size) if first else None
        self.h = nn.ModuleList(GPT2Block(cfg, i, par) for i in par.layers)
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if last else None
        self.lm_head = untied_lm_head(cfg, par)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(T, E) before the final norm (compute_logits applies it to the rows it needs). The first stage
        embeds input_ids; a later stage starts from `hidden`, the previous stage's output."""
        x = stage_input(self.par, hidden, lambda: self.wte(input_ids) + self.wpe(positions))  # (T, E)
        for block in self.h:
            x = block(x, meta)
        return x

    @property
    def input_embedding(self) -> nn.Embedding | None:
        """The token embedding (None on a middle pipeline stage, which neither embeds nor ties a head)."""
        return self.wte

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 logits of (B, E) hidden rows; last stage only."""
        return stage_logits(hidden, self.ln_f, self.wte, self.lm_head, self.config, self.par)

    @staticmethod
    def hf_weight_map(cfg: ModelConfig, par: ParallelContext | None = None) -> dict[str, list[Source]]:
        """Our parameter name -> the Hugging Face tensors that make it, with each one's shard rule and
        whether it is a GPT-2 Conv1D weight stored [in, out] (transposed relative to nn.Linear)."""
        par = par or ParallelContext.single(cfg.num_layers)
        first, last, tied = par.is_first_stage, par.is_last_stage, cfg.tie_word_embeddings
        m: dict[str, list[Source]] = {}
        if first or (last and tied):
            m["wte.weight"] = [Source("transformer.wte.weight", VOCAB)]
        if first:
            m["wpe.weight"] = [Source("transformer.wpe.weight")]
        if last:
            m["ln_f.weight"] = [Source("transformer.ln_f.weight")]
            m["ln_f.bias"] = [Source("transformer.ln_f.bias")]
            if not tied:
                m["lm_head.weight"] = [Source("lm_head.weight", VOCAB)]
        qkv = packed_qkv_shard(cfg.head_dim)
        # ours: (HF name, weight rule, bias rule)
        rules = {
            "ln_1": ("ln_1", REPLICATED, REPLICATED), "ln_2": ("ln_2", REPLICATED, REPLICATED),
            "c_attn": ("attn.c_attn", qkv, qkv), "c_proj": ("attn.c_proj", ROW, REPLICATED),
            "c_fc": ("mlp.c_fc", COLUMN, COLUMN), "mlp_proj": ("mlp.c_proj", ROW, REPLICATED),
        }
        for local, i in enumerate(par.layers):
            for ours, (hf, weight_rule, bias_rule) in rules.items():
                conv1d = not ours.startswith("ln")
                m[f"h.{local}.{ours}.weight"] = [Source(f"transformer.h.{i}.{hf}.weight", weight_rule, conv1d)]
                m[f"h.{local}.{ours}.bias"] = [Source(f"transformer.h.{i}.{hf}.bias", bias_rule)]
        return m
