"""GPT-2 family (the GPT-3 shape Orca served): learned positions, LayerNorm, tanh-GELU, fused QKV,
tied LM head. Works on tokens flattened to [num_tokens, hidden]."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from orca.config import ModelConfig
from orca.models.attention import AttentionMetadata, selective_attention


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.layer = layer
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim) if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= layer + 1
        self.ln_1 = nn.LayerNorm(hidden, eps=cfg.norm_eps)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=cfg.norm_eps)
        self.c_fc = nn.Linear(hidden, cfg.intermediate_size)
        self.mlp_proj = nn.Linear(cfg.intermediate_size, hidden)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, hidden = x.shape  # (T, E)
        qkv = self.c_attn(self.ln_1(x))  # (T, 3E): one matmul for every token of every request
        q = qkv[:, :hidden].view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        kv = qkv[:, hidden:].view(num_tokens, 2, self.num_heads, self.head_dim)  # (T, 2, H, D)
        x = x + self.c_proj(selective_attention(q, kv, meta, self.layer, self.scale))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # (T, E)
        for block in self.h:
            x = block(x, meta)
        return x  # (T, E), before the final norm: compute_logits applies it to the rows it needs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight  # weight tying
        return F.linear(self.ln_f(hidden), head).float()  # (B, V)

    @staticmethod
    def hf_weight_map(cfg: ModelConfig) -> dict[str, list[tuple[str, bool]]]:
        """Our parameter name -> the Hugging Face tensors that make it, and whether each is a GPT-2
        Conv1D weight stored [in, out] (transposed relative to nn.Linear)."""
        m: dict[str, list[tuple[str, bool]]] = {
            "wte.weight": [("transformer.wte.weight", False)],
            "wpe.weight": [("transformer.wpe.weight", False)],
            "ln_f.weight": [("transformer.ln_f.weight", False)],
            "ln_f.bias": [("transformer.ln_f.bias", False)],
        }
        if not cfg.tie_word_embeddings:
            m["lm_head.weight"] = [("lm_head.weight", False)]
        ours_to_hf = {
            "ln_1": "ln_1", "ln_2": "ln_2", "c_attn": "attn.c_attn", "c_proj": "attn.c_proj",
            "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj",
        }
        for i in range(cfg.num_layers):
            for ours, hf in ours_to_hf.items():
                conv1d = not ours.startswith("ln")
                m[f"h.{i}.{ours}.weight"] = [(f"transformer.h.{i}.{hf}.weight", conv1d)]
                m[f"h.{i}.{ours}.bias"] = [(f"transformer.h.{i}.{hf}.bias", False)]
        return m
