"""PEFT LoRA adapters for a base checkpoint, made with transformers and peft: the test and benchmark
adapters of multi-LoRA (scripts/make_lora_adapters.py is the command line; ``orca-bench lora`` and
tests/test_lora_adapters.py call make_adapters).

Each adapter is a directory (``adapter_config.json`` and ``adapter_model.safetensors``, saved with
save_pretrained(safe_serialization=True)), what orca's read_adapter (orca/models/lora.py) and vLLM read.
Two initialisations:

- ``random``: PEFT's ``init_lora_weights=False`` (A and B both drawn as nn.Linear's weights are), then, in
  every adapted layer, B rescaled so that the delta s B A (s = lora_alpha / r) has ``scale`` times the
  Frobenius norm of the layer's base weight W. Unscaled, PEFT's random B makes deltas far larger than W (the
  model babbles). RANDOM_SCALE = 0.1 is the default: on q_proj and v_proj of SmolLM2-135M-Instruct
  (int4 engine, greedy, chat template) one adapter's answers differ from the base model's within their
  first tokens yet stay fluent ("The capital of France is Paris, France."; a different sea poem), where
  0.2 already repeats itself ("The sea, a river, a river, a river") and 0.4 is gibberish. Fast: no
  training, one base model for every adapter.
- ``fitted``: PEFT's default initialisation (B zero: the adapter starts as the base model), then a short
  fine-tune, ``steps`` AdamW steps (lr ``lr``) on CPU over batches of ``batch_size`` sequences of
  ``seq_len`` tokens of real English text: adapter i of n on Python's own documentation
  (``pydoc_data.topics``, its topics in sorted order) topics i, i + n, i + 2n, ..., so every adapter
  learns a different slice. The loss (mean next-token cross-entropy) on held-out sequences of its own
  slice (the ones after those it trained on) is measured before and after: it falls.

A checkpoint without a tokenizer (the tests' tiny models) gets the text's UTF-8 bytes modulo its vocabulary
as token ids, as orca-bench's prompts do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

INITS = ("random", "fitted")
RANDOM_SCALE = 0.1  # random init: ||s B A||_F = RANDOM_SCALE * ||W||_F in every adapted layer
GPT2_TARGETS = ("c_attn",)
LLAMA_TARGETS = ("q_proj", "v_proj")


def default_targets(model_type: str) -> tuple[str, ...]:
    """PEFT's target_modules for a family: GPT-2's fused c_attn, else (Llama-style) q_proj and v_proj."""
    return GPT2_TARGETS if model_type == "gpt2" else LLAMA_TARGETS


def topic_slice(index: int, count: int) -> list[str]:
    """Adapter `index` of `count`'s text: the topics index, index + count, ... of pydoc_data.topics (sorted
    by name), each topic's text whole."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)[index::count]]


class _Tokens:
    """Text as token ids: the checkpoint's tokenizer, or (none) the UTF-8 bytes modulo the vocabulary."""

    def __init__(self, model_dir: str, vocab: int) -> None:
        self.vocab = vocab
        self.hf: Any = None
        try:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(model_dir)
        except Exception:  # noqa: BLE001 - no tokenizer files (the tests' tiny checkpoints)
            self.hf = None

    def __call__(self, text: str) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=False))
        return [b % self.vocab for b in text.encode()]


def text_sequences(tokens: Callable[[str], list[int]], texts: Sequence[str], seq_len: int, n: int) -> list[list[int]]:
    """The first `n` consecutive `seq_len`-token sequences of the texts, read in order (tokenized topic by
    topic, only as far as needed); fewer if the texts run out."""
    stream: list[int] = []
    for text in texts:
        stream += tokens(text)
        if len(stream) >= n * seq_len:
            break
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(min(n, len(stream) // seq_len))]


def _loss(model: Any, batch: Any) -> Any:
    return model(input_ids=batch, labels=batch).loss


def _lora_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})]


def _init_random(model: Any, scale: float) -> None:
    """PEFT's init_lora_weights=False drawn again (A and B as nn.Linear's weights), B then scaled so that
    ||s B A||_F = scale ||W||_F in each layer."""
    import torch
    from torch import nn

    with torch.no_grad():
        for layer in _lora_layers(model):
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            nn.init.kaiming_uniform_(b, a=math.sqrt(5))
            delta = layer.scaling["default"] * (b @ a)
            b.mul_(scale * layer.get_base_layer().weight.float().norm() / delta.norm())


def _init_zero_b(model: Any) -> None:
    """PEFT's default (init_lora_weights=True): A as nn.Linear's weight, B zero."""
    import torch
    from torch import nn

    with torch.no_grad():
        for layer in _lora_layers(model):
            nn.init.kaiming_uniform_(layer.lora_A["default"].weight, a=math.sqrt(5))
            nn.init.zeros_(layer.lora_B["default"].weight)


def _fit(model: Any, train: Any, evaluation: Any, steps: int, batch_size: int, lr: float) -> tuple[float, float]:
    """`steps` AdamW steps on the LoRA matrices over `train` (N, seq_len), batches in turn; the mean loss
    on `evaluation` before and after."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.eval()  # no dropout (lora_dropout is 0 anyway): the steps are deterministic given the seed
    with torch.no_grad():
        before = float(_loss(model, evaluation))
    for step in range(steps):
        start = (step * batch_size) % len(train)
        batch = train[start:start + batch_size]
        optimizer.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        after = float(_loss(model, evaluation))
    return before, after


def make_adapters(
    out: str | Path,
    names: Sequence[str],
    model: str | Path | None = None,
    *,
    rank: int = 8,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
    seed: int = 0,
    init: str = "random",
    scale: float = RANDOM_SCALE,
    steps: int = 32,
    seq_len: int = 16,
    batch_size: int = 2,
    eval_sequences: int = 8,
    lr: float = 1e-3,
    threads: int | None = None,
    log: Callable[[str], None] | None = print,
) -> list[dict[str, Any]]:
    """Makes one PEFT LoRA adapter per name under ``out/<name>`` for the base checkpoint `model` (a
    Hugging Face directory or anything orca.checkpoint.resolve_checkpoint takes; None: the shipped
    SmolLM2-135M-Instruct) and returns a record per adapter (name, path, init, seed, seconds, and for
    fitted the losses before and after). Adapter i is seeded with seed + i. alpha None: 2 x rank; targets
    None: default_targets of the model's family. The module docstring describes the two inits."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from orca.checkpoint import resolve_checkpoint

    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if not names or len(set(names)) != len(names) or any(not n or "/" in n or "," in n or "=" in n for n in names):
        raise ValueError(f"names must be distinct non-empty adapter names without '/', ',' or '=', got {list(names)}")
    for what, value in (("rank", rank), ("steps", steps), ("seq_len", seq_len), ("batch_size", batch_size),
                        ("eval_sequences", eval_sequences)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    say = log or (lambda _text: None)
    checkpoint = str(resolve_checkpoint(None if model is None else str(model)))
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        model_type = base.config.model_type
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank if alpha is None else alpha,
            target_modules=list(targets or default_targets(model_type)), lora_dropout=0.0, bias="none",
            init_lora_weights=init == "fitted", task_type="CAUSAL_LM",
            fan_in_fan_out=model_type == "gpt2",  # GPT-2's Conv1D stores its weight as (in, out)
        )
        peft_model = get_peft_model(base, config)
        tokens = _Tokens(checkpoint, base.config.vocab_size) if init == "fitted" else None
        records = []
        for i, name in enumerate(names):
            start = time.perf_counter()
            torch.manual_seed(seed + i)
            record: dict[str, Any] = {"name": name, "path": str(Path(out) / name), "init": init, "seed": seed + i,
                                      "rank": rank, "lora_alpha": config.lora_alpha,
                                      "target_modules": sorted(config.target_modules)}
            if init == "random":
                _init_random(peft_model, scale)
                record["scale"] = scale
            else:
                _init_zero_b(peft_model)
                need = steps * batch_size
                sequences = text_sequences(tokens, topic_slice(i, len(names)), seq_len,  # type: ignore[arg-type]
                                           min(need, 64 * batch_size) + eval_sequences)
                if len(sequences) <= eval_sequences:
                    raise ValueError(f"adapter {name!r}: its text gives {len(sequences)} sequences of {seq_len} "
                                     f"tokens, more than {eval_sequences} needed")
                data = torch.tensor(sequences, dtype=torch.long)
                train, evaluation = data[:-eval_sequences], data[-eval_sequences:]
                before, after = _fit(peft_model, train, evaluation, steps, batch_size, lr)
                record.update({"text": f"pydoc_data.topics, sorted, topics {i}::{len(names)}", "steps": steps,
                               "seq_len": seq_len, "batch_size": batch_size, "lr": lr,
                               "train_sequences": int(train.shape[0]), "eval_sequences": eval_sequences,
                               "loss_before": before, "loss_after": after})
            peft_model.save_pretrained(record["path"], safe_serialization=True)
            record["seconds"] = time.perf_counter() - start
            records.append(record)
            losses = (f"; loss on its held-out text {record['loss_before']:.3f} -> {record['loss_after']:.3f}"
                      if init == "fitted" else f"; |delta| = {scale:g} |W|")
            say(f"adapter {name}: {init}, rank {rank}, {', '.join(record['target_modules'])}{losses}; "
                f"{record['seconds']:.1f} s -> {record['path']}")
        return records
    finally:
        torch.set_num_threads(old_threads)
