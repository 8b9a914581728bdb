"""orca-bench perplexity (orca_client/bench/perplexity.py): the engine's path through the paged K/V pool,
chunk after chunk, gives transformers' negative log-likelihood for float weights, and a quantized variant
moves it (by little)."""

from __future__ import annotations

import math
import random

from _fixtures import tiny_checkpoint
from orca_client.bench.perplexity import engine_nll, english_text, transformers_nll


def test_the_engine_path_is_transformers_for_float_weights_and_quantization_moves_it() -> None:
    path = tiny_checkpoint("llama")
    rng = random.Random(0)
    windows = [[rng.randrange(0, 190) for _ in range(n)] for n in (70, 45)]
    ref_total, ref_count = transformers_nll(path, windows)
    total, count, _ = engine_nll(str(path), "float32", "none", "auto", windows, chunk=16)
    assert count == ref_count == 113
    assert math.isclose(total, ref_total, rel_tol=1e-5)
    for quantization, kv in (("int8", "auto"), ("none", "int8")):  # weights, then K/V read back from the pool
        other, _, _ = engine_nll(str(path), "float32", quantization, kv, windows, chunk=16)
        assert other != total and math.isclose(other, total, rel_tol=0.05), (quantization, kv)


def test_the_text_is_real_english() -> None:
    text = english_text()
    assert len(text) > 100_000 and " the " in text
