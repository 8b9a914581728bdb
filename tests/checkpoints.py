"""Tiny random-weight checkpoints built with transformers: the engine's numerical reference.

Keyword overrides go to the transformers config, so a test can build a variant of a family (another
attention scaling, biases, a tied or untied head) with the same sizes."""

from __future__ import annotations

import json
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


_LLAMA_STYLE_SIZES: dict[str, Any] = {
    "vocab_size": 197,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "eos_token_id": 196,
    "bos_token_id": 1,
}


def make_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Grouped-query attention (8 query heads over 2 K/V heads) and an untied head, as the issue asks."""
    torch.manual_seed(seed)
    options: dict[str, Any] = {**_LLAMA_STYLE_SIZES, "tie_word_embeddings": False, "rope_theta": 10000.0}
    model = LlamaForCausalLM(LlamaConfig(**{**options, **overrides})).eval()
    # Random init gives near-uniform logits; scale them so greedy choices are well separated from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # with a tied head this scales the embeddings too: still fine
    model.save_pretrained(path)
    return path


def _save_scaled(model: Any, path: Path) -> Path:
    """Sharpens the random head (as make_llama does) and saves the checkpoint in two safetensors shards,
    so the sharded-index path of the loader is exercised too."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, max_shard_size="300KB")
    return path




def make_mistral(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Mistral with a sliding window (8) shorter than most test prompts, GQA, head_dim 16 of its own."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    options = {**_LLAMA_STYLE_SIZES, "sliding_window": 8, "head_dim": 16, "tie_word_embeddings": False}
    return _save_scaled(MistralForCausalLM(MistralConfig(**{**options, **overrides})).eval(), path)


def make_qwen2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen2: bias on q, k, v (not o); a tied head; the sliding window (6) on the layers from
    max_window_layers (1) on, as transformers lays them out."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    options = {
        **_LLAMA_STYLE_SIZES,
        "tie_word_embeddings": True,
        "use_sliding_window": True,
        "sliding_window": 6,
        "max_window_layers": 1,
    }
    model = Qwen2ForCausalLM(Qwen2Config(**{**options, **overrides})).eval()
    with torch.no_grad():  # random biases, so a model that drops them is caught
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return _save_scaled(model, path)


def make_qwen3(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen3: RMSNorm on each query and key head (random weights), head_dim 24 != hidden / heads (8)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    options = {**_LLAMA_STYLE_SIZES, "head_dim": 24, "tie_word_embeddings": False}
    model = Qwen3ForCausalLM(Qwen3Config(**{**options, **overrides})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return _save_scaled(model, path)


def make_llama3(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Llama 3.x rotary scaling ("llama3": factor 8, low/high frequency factors 1 and 4, original context
    32), a tied head as in Llama 3.2 1B/3B; positions past 32 take the scaled frequencies."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    }
    return make_llama(path, seed, **{"rope_parameters": rope, "tie_word_embeddings": True, **overrides})


def make_mixtral(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Mixtral: 4 experts, top-2 routing (renormalised), a sliding window (8) as Mistral's."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    options = {
        **_LLAMA_STYLE_SIZES,
        "intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "tie_word_embeddings": False,
    }
    model = MixtralForCausalLM(MixtralConfig(**{**options, **overrides})).eval()
    with torch.no_grad():  # a sharper router, so the top-2 choice differs between tokens
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    return _save_scaled(model, path)


def make_qwen3_moe(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen3-MoE: 4 experts, top-2 routing without renormalisation (norm_topk_prob False), layer 1 dense
    (mlp_only_layers), q/k norms."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    options = {
        **_LLAMA_STYLE_SIZES,
        "moe_intermediate_size": 40,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "head_dim": 16,
        "tie_word_embeddings": False,
    }
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**options, **overrides})).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if i != 1:
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    return _save_scaled(model, path)


def gguf_writer(cfg: dict[str, Any], out: Path, arch: str, file_type: Any) -> Any:
    """A gguf.GGUFWriter for `out` holding what every test GGUF file says of itself: the sizes of the Hugging
    Face config `cfg`, its file type, and a small byte-pair tokenizer (letters and their pairs) that
    transformers' GGUF reader can convert. The caller adds its own keys and the tensors."""
    import gguf

    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_file_type(file_type)
    vocab = cfg["vocab_size"]
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = alphabet + [a + b for a in alphabet for b in alphabet][: vocab - len(alphabet)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges([f"{t[0]} {t[1]}" for t in tokens[len(alphabet):]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    return w


def write_gguf(hf_dir: Path, out: Path, arch: str) -> Path:
    """Writes a Hugging Face checkpoint of `arch` (qwen2 or qwen3) as an F32 GGUF file the way llama.cpp
    names things (gguf's own tensor-name map), with a small byte-pair tokenizer (letters and their pairs),
    so that transformers' GGUF reader, which the engine's loader uses, can read it back."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    w = gguf_writer(cfg, out, arch, gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_pre("qwen2")
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(f))
    for name, t in state.items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, f"no GGUF name for {name}"
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def with_generation_config(source: Path, path: Path, **values: Any) -> Path:
    """A copy of the checkpoint `source` whose generation_config.json also holds `values` (a model's
    recommended sampling: temperature, top_p, top_k, ...), as published checkpoints ship it."""
    import shutil

    shutil.copytree(source, path)
    gen_path = path / "generation_config.json"
    config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen_path.write_text(json.dumps({**config, **values}, indent=2))
    return path


def make_lora_adapter(base: Path, path: Path, seed: int = 0, rank: int = 4,
                      targets: list[str] | None = None) -> Path:
    """A PEFT LoRA adapter of the checkpoint `base` with random (nonzero) A and B, saved as safetensors in
    `path`, on `targets` (default: every layer's GPT-2 Conv1D layers c_attn, c_proj and c_fc, with
    fan_in_fan_out, or Llama-style projections)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gpt2 = model.config.model_type == "gpt2"
    if targets is None:
        targets = (["c_attn", "c_proj", "c_fc"] if gpt2 else
                   ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, fan_in_fan_out=gpt2,
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(path, safe_serialization=True)
    return path
