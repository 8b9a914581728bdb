"""Llama-style decoders: RMSNorm, rotary positions, SwiGLU, grouped-query attention, tied or untied head.
Also the families that are Llama with options (ModelConfig._llama_style): Llama 3.x rotary scaling,
Mistral and Qwen2 sliding windows, Qwen2's q/k/v bias, Qwen3's q/k norms, and the mixtures Mixtral and
Qwen3-MoE (orca/models/moe.py). Q|K|V and gate|up are fused at load: fewer, larger matmuls over (T, E).

Under tensor parallelism a rank holds H/tp query heads with their K/V heads (one replicated when tp > KVH),
I/tp rows of gate/up, and the matching columns of the row-parallel o_proj/down_proj. The first pipeline
stage embeds, the last normalises and computes logits."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from orca.checkpoint import ModelConfig
from orca.models.attention import AttentionMetadata, selective_attention
from orca.models.layers import embedding, row_linear, stage_input, stage_logits, untied_lm_head
from orca.models.moe import SparseMoE
from orca.parallel import (
    COLUMN,
    REPLICATED,
    ROW,
    VOCAB,
    ParallelContext,
    Source,
    head_shard,
    kv_head_shard,
    local_kv_heads,
)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op with the weight: the same numbers, a third less time
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 whatever the model dtype, as the reference does (fp16 squares overflow), and
        # scale in the model dtype after rounding to it, in the reference's order.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once; a step gathers its tokens' rows. Scaled variants
    (linear, llama3, yarn) take their frequencies and attention factor from transformers' own rope
    functions, so they are the reference's numbers by construction."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.head_dim
        with torch.device("cpu"):  # also under the loader's meta-device context: the tables are data
            if cfg.rope_type == "default":
                inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
                scaling = 1.0
            else:
                from transformers import AutoConfig
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                raw = json.loads(cfg.rope_config)
                hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_config)
                inv_freq = inv_freq.float()
            freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D): the rotate-half layout of the HF checkpoint
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (T, 1, D) cos and sin rows of this iteration's tokens: gathered once, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (T, heads, D); cos, sin: (T, 1, D)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ParallelContext) -> None:
        super().__init__()
        tp = par.tp_size
        self.layer, self.kv_layer = layer, layer - par.layers.start  # global; index in this stage's K/V pool
        # This rank's heads: H/tp queries and their K/V heads.
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp, local_kv_heads(cfg.num_kv_heads, tp)
        self.head_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.window = cfg.sliding_windows[layer] if cfg.sliding_windows else None  # Mistral, Qwen2
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        if cfg.qk_norm:  # Qwen3: over head_dim, on each query and key head, before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.o_proj = row_linear(q_size, cfg.hidden_size, cfg.attention_bias and not cfg.qkv_bias_only, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if is_moe_layer(cfg, layer):  # Mixtral, Qwen3-MoE
            self.moe = SparseMoE(
                cfg.hidden_size, cfg.moe_intermediate_size // tp, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, par,
            )
        else:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * (cfg.intermediate_size // tp), bias=cfg.mlp_bias)
            self.down_proj = row_linear(cfg.intermediate_size // tp, cfg.hidden_size, cfg.mlp_bias, par)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(x))  # (T, (H + 2 KVH) D)
        qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)  # (T, H+KVH, D)
        if hasattr(self, "q_norm"):
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = RotaryEmbedding.apply(qk, *rope)  # queries and keys share each token's rotation
        q = qk[:, :heads]  # (T, H, D)
        kv = torch.cat((qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)), 1)
        kv = kv.view(num_tokens, 2, kv_heads, dim)  # (T, 2, KVH, D)
        x = x + self.o_proj(selective_attention(q, kv, meta, self.kv_layer, self.scale, self.window))
        if hasattr(self, "moe"):
            return x + self.moe(self.post_attention_layernorm(x))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)  # (T, I) each
        return x + self.down_proj(F.silu(gate) * up)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return bool(cfg.moe_layers) and cfg.moe_layers[layer]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext.single(cfg.num_layers)
        par.layout.validate(cfg)
        self.config, self.par = cfg, par
        first, last, tied = par.is_first_stage, par.is_last_stage, cfg.tie_word_embeddings
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, par) if first or (last and tied) else None
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(LlamaBlock(cfg, i, par) for i in par.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if last else None
        self.lm_head = untied_lm_head(cfg, par)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(T, E) before the final norm. The first stage embeds input_ids; a later stage starts from
        `hidden`, the previous stage's output."""
        x = stage_input(self.par, hidden, lambda: self.embed_tokens(input_ids))  # (T, E)
        rope = self.rotary.tables(positions, x.dtype)
        for block in self.layers:
            x = block(x, rope, meta)
        return x

    @property
    def input_embedding(self) -> nn.Embedding | None:
        """The token embedding (None on a middle pipeline stage, which neither embeds nor ties a head)."""
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 logits of (B, E) hidden rows; last stage only."""
        return stage_logits(hidden, self.norm, self.embed_tokens, self.lm_head, self.config, self.par)

    @staticmethod
    def hf_weight_map(cfg: ModelConfig, par: ParallelContext | None = None) -> dict[str, list[Source]]:
        """Our parameter name -> the Hugging Face tensors concatenated (along the output dim, each sharded
        by its rule first) to make it."""
        par = par or ParallelContext.single(cfg.num_layers)
        first, last, tied = par.is_first_stage, par.is_last_stage, cfg.tie_word_embeddings
        m: dict[str, list[Source]] = {}
        if first or (last and tied):
            m["embed_tokens.weight"] = [Source("model.embed_tokens.weight", VOCAB)]
        if last:
            m["norm.weight"] = [Source("model.norm.weight")]
            if not tied:
                m["lm_head.weight"] = [Source("lm_head.weight", VOCAB)]
        q, kv = head_shard(cfg.head_dim), kv_head_shard(cfg.head_dim)
        for local, i in enumerate(par.layers):
            p, ours = f"model.layers.{i}", f"layers.{local}"
            # ours: ([(HF linear, rule of its weight and of a column-parallel bias)], bias present)
            linears = {
                "qkv_proj": ([(f"{p}.self_attn.q_proj", q), (f"{p}.self_attn.k_proj", kv),
                              (f"{p}.self_attn.v_proj", kv)], cfg.attention_bias),
                "o_proj": ([(f"{p}.self_attn.o_proj", ROW)], cfg.attention_bias and not cfg.qkv_bias_only),
            }
            if is_moe_layer(cfg, i):
                # Mixtral names its experts' matrices w1 (gate), w3 (up), w2 (down); Qwen3-MoE like Llama.
                moe, (g, u, d) = (
                    (f"{p}.block_sparse_moe", ("w1", "w3", "w2"))
                    if cfg.model_type == "mixtral"
                    else (f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"))
                )
                experts = [f"{moe}.experts.{e}" for e in range(cfg.num_experts)]
                m[f"{ours}.moe.gate.weight"] = [Source(f"{moe}.gate.weight")]  # the router: replicated
                m[f"{ours}.moe.gate_up_proj"] = [Source(f"{x}.{w}.weight", COLUMN) for x in experts for w in (g, u)]
                m[f"{ours}.moe.down_proj"] = [Source(f"{x}.{d}.weight", ROW) for x in experts]
            else:
                linears["gate_up_proj"] = ([(f"{p}.mlp.gate_proj", COLUMN), (f"{p}.mlp.up_proj", COLUMN)], cfg.mlp_bias)
                linears["down_proj"] = ([(f"{p}.mlp.down_proj", ROW)], cfg.mlp_bias)
            for name, (parts, bias) in linears.items():
                m[f"{ours}.{name}.weight"] = [Source(f"{hf}.weight", rule) for hf, rule in parts]
                if bias:  # a row-parallel layer's bias is added once, after the all-reduce: replicated
                    m[f"{ours}.{name}.bias"] = [Source(f"{hf}.bias", REPLICATED if rule == ROW else rule)
                                                for hf, rule in parts]
            if cfg.qk_norm:
                m[f"{ours}.q_norm.weight"] = [Source(f"{p}.self_attn.q_norm.weight")]
                m[f"{ours}.k_norm.weight"] = [Source(f"{p}.self_attn.k_norm.weight")]
            m[f"{ours}.input_layernorm.weight"] = [Source(f"{p}.input_layernorm.weight")]
            m[f"{ours}.post_attention_layernorm.weight"] = [Source(f"{p}.post_attention_layernorm.weight")]
        return m
