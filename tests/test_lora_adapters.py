"""The PEFT adapters of client/orca_client/lora_adapters.py (scripts/make_lora_adapters.py): made for the
tiny Llama, random and fitted, then served by orca's engine with enable_lora; every adapter's greedy tokens
equal those of PEFT's merged model (PeftModel.from_pretrained(base, dir).merge_and_unload())."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _fixtures import (
    one_torch_thread,  # noqa: F401 - autouse: one torch thread
    tiny_checkpoint,
)
from orca_client.lora_adapters import default_targets, make_adapters, text_sequences, topic_slice

from orca import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [[1, 17, 42, 99, 5, 150, 23], [1, 88, 3, 61, 120, 7, 7, 190, 44, 12], [1, 64]]
NEW_TOKENS = 12


def merged_greedy(adapter: Path | None, prompt: list[int], family: str = "llama") -> list[int]:
    """PEFT's merged model (or the base model alone), greedy, EOS not stopping it: argmax token by token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_topic_slices_and_sequences() -> None:
    slices = [topic_slice(i, 3) for i in range(3)]
    assert all(slices) and not set(slices[0]) & set(slices[1])
    sequences = text_sequences(lambda text: list(text.encode()), slices[0], 16, 5)
    assert len(sequences) == 5 and all(len(s) == 16 for s in sequences)
    assert bytes(sequences[0]) == slices[0][0].encode()[:16]
    assert default_targets("gpt2") == ("c_attn",) and default_targets("llama") == ("q_proj", "v_proj")


def serve(family: str, modules: str, requests: list[tuple[str | None, int]], max_loras: int) -> list[list[int]]:
    """Every request (adapter name, prompt index) at once on an enable_lora engine: its greedy tokens."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), dtype="float32", torch_compile="off",
                                    enable_lora=True, max_loras=max_loras, max_lora_rank=8, lora_modules=modules))
    try:
        for k, (name, i) in enumerate(requests):
            engine.add_request(f"r{k}", PROMPTS[i], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                    ignore_eos=True, lora_name=name))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    assert not out.error, out.error
                    tokens[out.request_id] = list(out.token_ids)
    finally:
        engine.shutdown()
    return [tokens[f"r{k}"] for k in range(len(requests))]


def test_adapters_served_by_the_engine_equal_peft_merged(tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    random = make_adapters(tmp_path, ["r0", "r1"], model, rank=4, init="random", log=None)
    fitted = make_adapters(tmp_path, ["fit"], model, rank=8, init="fitted", steps=6, seq_len=16, batch_size=2,
                           eval_sequences=2, lr=1e-2, seed=3, log=None)
    for record in random + fitted:
        directory = Path(record["path"])
        config = json.loads((directory / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
        assert config["r"] == record["rank"] and config["lora_alpha"] == 2 * record["rank"]
        assert (directory / "adapter_model.safetensors").is_file()
        assert not (directory / "adapter_model.bin").exists()
    assert random[0]["scale"] == 0.1 and random[1]["seed"] == 1
    fit = fitted[0]
    assert fit["train_sequences"] >= 2 and fit["loss_after"] < fit["loss_before"]  # it learnt its text

    names = ["r0", "r1", "fit"]
    modules = ",".join(f"{n}={tmp_path / n}" for n in names)
    requests = [(name, i) for name in [None, *names] for i in range(len(PROMPTS))]
    served = dict(zip(requests, serve("llama", modules, requests, max_loras=3)))
    for name in [None, *names]:
        for i, prompt in enumerate(PROMPTS):
            expected = merged_greedy(None if name is None else tmp_path / name, prompt)
            assert served[(name, i)] == expected, (name, i)
    # The random adapters change the model's output (each differs from the base on some prompt).
    for name in ("r0", "r1"):
        assert any(served[(name, i)] != served[(None, i)] for i in range(len(PROMPTS))), name


def test_gpt2_c_attn_adapter_equals_peft_merged(tmp_path: Path) -> None:
    """GPT-2: PEFT adapts the fused c_attn (a Conv1D, fan_in_fan_out); orca's c_attn takes it whole."""
    (record,) = make_adapters(tmp_path, ["g"], tiny_checkpoint("gpt2"), rank=4, log=None)
    assert record["target_modules"] == ["c_attn"]
    requests = [(name, i) for name in (None, "g") for i in range(len(PROMPTS))]
    served = dict(zip(requests, serve("gpt2", f"g={tmp_path / 'g'}", requests, max_loras=1)))
    for i, prompt in enumerate(PROMPTS):
        assert served[("g", i)] == merged_greedy(tmp_path / "g", prompt, "gpt2"), i
        assert served[(None, i)] == merged_greedy(None, prompt, "gpt2"), i
    assert any(served[("g", i)] != served[(None, i)] for i in range(len(PROMPTS)))
