"""Llama family: RMSNorm, rotary positions, SwiGLU, grouped-query attention, tied or untied head.
Q, K and V are fused into one linear and gate/up into another at load time: fewer, larger matmuls over
the flattened [num_tokens, hidden] batch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from orca.config import ModelConfig
from orca.models.attention import AttentionMetadata, selective_attention


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the model dtype, as the reference does: fp16 squares overflow.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once; a step gathers its tokens' rows."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D): the rotate-half layout of the HF checkpoint
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (T, 1, D) cos and sin rows of this iteration's tokens: gathered once, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (T, heads, D); cos, sin: (T, 1, D)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(x))  # (T, (H + 2 KVH) D)
        qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)  # (T, H+KVH, D)
        qk = RotaryEmbedding.apply(qk, *rope)  # queries and keys share each token's rotation
        q = qk[:, :heads]  # (T, H, D)
        kv = torch.cat((qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)), 1)
        kv = kv.view(num_tokens, 2, kv_heads, dim)  # (T, 2, KVH, D)
        x = x + self.o_proj(selective_attention(q, kv, meta, self.layer, self.scale))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)  # (T, I) each
        return x + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, E)
        rope = self.rotary.tables(positions, x.dtype)
        for block in self.layers:
            x = block(x, rope, meta)
        return x  # (T, E), before the final norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(hidden), head).float()  # (B, V)

    @staticmethod
    def hf_weight_map(cfg: ModelConfig) -> dict[str, list[tuple[str, bool]]]:
        """Our parameter name -> the Hugging Face tensors concatenated (along the output dim) to make it."""
        m: dict[str, list[tuple[str, bool]]] = {
            "embed_tokens.weight": [("model.embed_tokens.weight", False)],
            "norm.weight": [("model.norm.weight", False)],
        }
        if not cfg.tie_word_embeddings:
            m["lm_head.weight"] = [("lm_head.weight", False)]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            fused = {
                "qkv_proj": [f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj"],
                "o_proj": [f"{p}.self_attn.o_proj"],
                "gate_up_proj": [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
                "down_proj": [f"{p}.mlp.down_proj"],
            }
            for ours, parts in fused.items():
                m[f"layers.{i}.{ours}.weight"] = [(f"{hf}.weight", False) for hf in parts]
                bias = cfg.mlp_bias if ours in ("gate_up_proj", "down_proj") else cfg.attention_bias
                if bias:
                    m[f"layers.{i}.{ours}.bias"] = [(f"{hf}.bias", False) for hf in parts]
            m[f"layers.{i}.input_layernorm.weight"] = [(f"{p}.input_layernorm.weight", False)]
            m[f"layers.{i}.post_attention_layernorm.weight"] = [(f"{p}.post_attention_layernorm.weight", False)]
        return m
