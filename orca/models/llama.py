"""Llama-style decoders: RMSNorm, rotary positions, SwiGLU, grouped-query attention, tied or untied head.
The families that are Llama with options are served here too (ModelConfig._llama_style reads them):
Llama 3.x (llama3 / linear / yarn rotary scaling), Mistral (a sliding attention window), Qwen2 (bias on
q, k, v; per-layer sliding windows), Qwen3 (RMSNorm on each query and key head; its own head_dim), and
the mixtures of experts Mixtral and Qwen3-MoE (sparse MLPs, orca/models/moe.py).
Q, K and V are fused into one linear and gate/up into another at load time: fewer, larger matmuls over
the flattened [num_tokens, hidden] batch."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from orca.config import ModelConfig
from orca.models.attention import AttentionMetadata, selective_attention
from orca.models.moe import SparseMoE


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
    """cos/sin tables for every position, computed once; a step gathers its tokens' rows. Scaled variants
    (linear, llama3, yarn) take their frequencies and attention factor from transformers' own rope
    functions, so they are the reference's numbers by construction."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.head_dim
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
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.window = cfg.sliding_windows[layer] if cfg.sliding_windows else None  # Mistral, Qwen2
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        if cfg.qk_norm:  # Qwen3: over head_dim, on each query and key head, before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias and not cfg.qkv_bias_only)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if is_moe_layer(cfg, layer):  # Mixtral, Qwen3-MoE
            self.moe = SparseMoE(
                cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
            )
        else:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

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
        x = x + self.o_proj(selective_attention(q, kv, meta, self.layer, self.scale, self.window))
        if hasattr(self, "moe"):
            return x + self.moe(self.post_attention_layernorm(x))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)  # (T, I) each
        return x + self.down_proj(F.silu(gate) * up)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return bool(cfg.moe_layers) and cfg.moe_layers[layer]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg)
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
            }
            if is_moe_layer(cfg, i):
                # Mixtral names its experts' matrices w1 (gate), w3 (up), w2 (down); Qwen3-MoE like Llama.
                moe, (g, u, d) = (
                    (f"{p}.block_sparse_moe", ("w1", "w3", "w2"))
                    if cfg.model_type == "mixtral"
                    else (f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"))
                )
                experts = [f"{moe}.experts.{e}" for e in range(cfg.num_experts)]
                m[f"layers.{i}.moe.gate.weight"] = [(f"{moe}.gate.weight", False)]
                m[f"layers.{i}.moe.gate_up_proj"] = [(f"{x}.{w}.weight", False) for x in experts for w in (g, u)]
                m[f"layers.{i}.moe.down_proj"] = [(f"{x}.{d}.weight", False) for x in experts]
            else:
                fused["gate_up_proj"] = [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
                fused["down_proj"] = [f"{p}.mlp.down_proj"]
            for ours, parts in fused.items():
                m[f"layers.{i}.{ours}.weight"] = [(f"{hf}.weight", False) for hf in parts]
                bias = {
                    "gate_up_proj": cfg.mlp_bias,
                    "down_proj": cfg.mlp_bias,
                    "qkv_proj": cfg.attention_bias,
                    "o_proj": cfg.attention_bias and not cfg.qkv_bias_only,
                }[ours]
                if bias:
                    m[f"layers.{i}.{ours}.bias"] = [(f"{hf}.bias", False) for hf in parts]
            if cfg.qk_norm:
                m[f"layers.{i}.q_norm.weight"] = [(f"{p}.self_attn.q_norm.weight", False)]
                m[f"layers.{i}.k_norm.weight"] = [(f"{p}.self_attn.k_norm.weight", False)]
            m[f"layers.{i}.input_layernorm.weight"] = [(f"{p}.input_layernorm.weight", False)]
            m[f"layers.{i}.post_attention_layernorm.weight"] = [(f"{p}.post_attention_layernorm.weight", False)]
        return m
