"""EngineConfig.linear_backend: oneDNN-packed linears (orca/models/layers.py PackedLinear) give the numbers
torch's F.linear gives (fp32, 1e-4) in a mixed iteration, for both families with tied and untied heads and
biases; auto picks onednn on this CPU for float32 and falls back where oneDNN cannot pack; greedy
generation is identical either way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from checkpoints import make_gpt2, make_llama
from torch import nn

from orca import LLM, EngineConfig, SamplingParams
from orca.models.attention import AttentionMetadata
from orca.models.layers import PackedLinear, onednn_packs, resolve_linear_backend
from orca.worker import Worker

pytestmark = pytest.mark.skipif(not onednn_packs(torch.float32), reason="this torch has no oneDNN")

VARIANTS = [
    ("gpt2", {}),
    ("gpt2", {"tie_word_embeddings": False}),
    ("llama", {}),  # untied head, grouped-query attention
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
]
BUILDERS = {"gpt2": make_gpt2, "llama": make_llama}


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_packed_linears_match_reference_in_a_mixed_iteration(family: str, overrides: dict, tmp_path: Path) -> None:
    path = BUILDERS[family](tmp_path / "ckpt", seed=5, **overrides)
    workers = {b: Worker(EngineConfig(model=str(path), block_size=4, n_slots=64, linear_backend=b))
               for b in ("reference", "onednn")}
    packed = workers["onednn"].model
    assert workers["onednn"].linear_backend == "onednn" and workers["reference"].linear_backend == "reference"
    # Every linear is packed, the head too (a packed copy of the embedding when tied); none in reference.
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in workers["reference"].model.modules())
    rng = random.Random(7)
    prompt, prefix, increment = ([rng.randrange(0, 190) for _ in range(n)] for n in (9, 5, 1))
    out = {}
    for backend, worker in workers.items():
        worker.init_kv_pool(16)
        with torch.inference_mode():
            # A cached prefix of 5 tokens, then one iteration: its increment + a whole 9-token prompt.
            worker.model(torch.tensor(prefix), torch.arange(5), AttentionMetadata.build([5], [0], [[0, 1]], 4,
                                                                                        worker.kv_pool))
            meta = AttentionMetadata.build([1, 9], [5, 0], [[0, 1], [4, 5, 6]], 4, worker.kv_pool)
            hidden = worker.model(torch.tensor(increment + prompt), torch.tensor([5, *range(9)]), meta)
            out[backend] = (hidden, worker.model.compute_logits(hidden))
    torch.testing.assert_close(out["onednn"][0], out["reference"][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out["onednn"][1], out["reference"][1], atol=1e-4, rtol=0)
    assert out["reference"][1].abs().max() > 0.1  # the comparison is not of zeros


def test_greedy_generation_is_the_same_with_either_backend(tmp_path: Path) -> None:
    path = make_llama(tmp_path / "ckpt", seed=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 190) for _ in range(n)] for n in (3, 12, 7, 1)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {b: [o.token_ids for o in LLM(str(path), max_bs=4, linear_backend=b).generate(prompts, greedy)]
              for b in ("reference", "onednn")}
    assert tokens["onednn"] == tokens["reference"]


def test_auto_and_explicit_choices() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_linear_backend("auto", cpu, torch.float32) == "onednn"
    assert resolve_linear_backend("reference", cpu, torch.float32) == "reference"
    assert resolve_linear_backend("auto", cuda, torch.float32) == "reference"  # cuBLAS on a GPU
    with pytest.raises(ValueError, match="linear_backend onednn cannot run device cuda"):
        resolve_linear_backend("onednn", cuda, torch.float32)
    # bfloat16 packs only where the CPU has the instructions; auto then falls back to torch's matmul.
    bf16 = onednn_packs(torch.bfloat16)
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == ("onednn" if bf16 else "reference")
    if not bf16:
        with pytest.raises(ValueError, match="cannot run torch.bfloat16 on this CPU.*use auto or reference"):
            resolve_linear_backend("onednn", cpu, torch.bfloat16)


def test_unknown_backend_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of auto, onednn, reference, got 'mkl'"):
        EngineConfig(linear_backend="mkl")
