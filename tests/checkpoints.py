"""Tiny random-weight checkpoints built with transformers: the engine's numerical reference.

Keyword overrides go to the transformers config, so a test can build a variant of a family (another
attention scaling, biases, a tied or untied head) with the same sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def make_gpt2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """initializer_range 0.3 (GPT-2's default is 0.02): with the default, random logits are so flat that
    greedy decoding repeats one token forever, and a greedy test would pass for almost any model."""
    torch.manual_seed(seed)
    options: dict[str, Any] = {
        "vocab_size": 211,
        "n_positions": 128,
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "eos_token_id": 210,
        "bos_token_id": 210,
        "initializer_range": 0.3,
    }
    model = GPT2LMHeadModel(GPT2Config(**{**options, **overrides})).eval()
    model.save_pretrained(path)
    return path


def make_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Grouped-query attention (8 query heads over 2 K/V heads) and an untied head, as the issue asks."""
    torch.manual_seed(seed)
    options: dict[str, Any] = {
        "vocab_size": 197,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "eos_token_id": 196,
        "bos_token_id": 1,
    }
    model = LlamaForCausalLM(LlamaConfig(**{**options, **overrides})).eval()
    # Random init gives near-uniform logits; scale them so greedy choices are well separated from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # with a tied head this scales the embeddings too: still fine
    model.save_pretrained(path)
    return path
