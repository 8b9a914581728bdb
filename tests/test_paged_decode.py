"""The paged decode attention kernel (orca/models/attention/paged_decode.py) run by Triton's interpreter on
the CPU (TRITON_INTERPRET=1), against attention computed directly from each row's gathered keys and values:
grouped-query heads, block sizes smaller and larger than a tile, scattered blocks, windows, padding rows,
one split and several (the combining kernel), float32 and bfloat16, a quantized pool (int8, float8).
tests/test_gpu.py runs it compiled.

Triton chooses its interpreter when it is imported (its language's own functions are kernels too), so the
kernel cases run in a pytest process of their own started with TRITON_INTERPRET=1
(test_the_kernel_cases_under_the_interpreter); in this process they are skipped."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orca.models.attention import paged_decode

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def interpreted() -> None:
    """Only where Triton runs interpreted (the process test_the_kernel_cases_under_the_interpreter starts)."""
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 (test_the_kernel_cases_under_the_interpreter)")


@pytest.mark.skipif(INTERPRETED, reason="the process this test starts")
def test_the_kernel_cases_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    # every case ran there: only this test skipped
    assert re.search(r"\b\d+ passed, 1 skipped in", run.stdout.splitlines()[-1]), run.stdout[-2000:]


def _case(seed: int, *, rows: int, heads: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
          dtype: torch.dtype, padding: int = 0, positions: list[int] | None = None):
    """A pool of scattered blocks, each row a request at a random position, and the expected output."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pool = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(rows + padding, heads, head_dim, generator=g).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    positions = positions or [rng.randrange(0, 5 * paged_decode.BLOCK_N // 2) for _ in range(rows)]
    tables = []
    for position in positions:
        used = position // block_size + 1
        tables.append([free.pop() for _ in range(used)])
    width = max(len(t) for t in tables)
    table = torch.full((rows + 1, width + 1), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    q_request = torch.tensor(list(range(rows)) + [0] * padding, dtype=torch.int32)
    q_position = torch.tensor(positions + [-1] * padding, dtype=torch.int32)
    return q, pool, q_request, q_position, table, tables, positions


def _expected(q, pool, tables, positions, block_size, scale, window, padding):  # noqa: ANN001, ANN202
    heads, kv_heads = q.shape[1], pool.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for row, (table, position) in enumerate(zip(tables, positions)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(position + 1)])
        if window:
            slots = slots[max(0, position + 1 - window):]
        k = pool[0][:, slots].float().repeat_interleave(heads // kv_heads, 0)  # (H, n, D)
        v = pool[1][:, slots].float().repeat_interleave(heads // kv_heads, 0)
        weights = torch.softmax((q[row].float()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale, -1)  # (H, n)
        out[row] = (weights[:, None, :] @ v)[:, 0]
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "window", "splits", "dtype"), [
    (4, 2, 16, 16, None, 1, torch.float32),
    (4, 2, 16, 16, None, 3, torch.float32),
    (8, 1, 32, 4, None, 2, torch.float32),  # blocks smaller than a tile, 8 query heads on one K/V head
    (3, 3, 24, 128, None, 1, torch.float32),  # no grouping, a head dim padded to 32, blocks larger than a tile
    (4, 2, 16, 8, 40, 4, torch.float32),  # a sliding window
    (4, 2, 16, 16, None, 2, torch.bfloat16),
])
def test_the_kernel_is_attention_over_each_rows_blocks(interpreted, heads: int, kv_heads: int, head_dim: int,  # noqa: ANN001
                                                       block_size: int, window: int | None, splits: int,
                                                       dtype: torch.dtype) -> None:
    rows, padding = 5, 2
    q, pool, q_request, q_position, table, tables, positions = _case(
        heads + block_size, rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        num_blocks=rows * (3 * paged_decode.BLOCK_N // block_size + 2), dtype=dtype, padding=padding)
    scale = head_dim ** -0.5
    out = paged_decode.paged_decode_attention(q, pool, q_request, q_position, table, block_size, scale, window,
                                              splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _expected(q, pool, tables, positions, block_size, scale, window, padding)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:rows].float(), expected[:rows], atol=tolerance, rtol=tolerance)
    assert torch.count_nonzero(out[rows:]) == 0  # padding rows read nothing


@pytest.mark.parametrize(("kv_dtype", "splits", "dtype"), [
    (torch.int8, 1, torch.float32),
    (torch.int8, 3, torch.bfloat16),
    (torch.float8_e4m3fn, 2, torch.float32),
])
def test_a_quantized_pool_is_read_with_its_scales(interpreted, kv_dtype: torch.dtype, splits: int,  # noqa: ANN001
                                                  dtype: torch.dtype) -> None:
    """int8 and float8 keys and values with a float32 scale per slot and K/V head (kv_cache.py's layout,
    quantize_kv's values): the kernel's attention is attention over dequantize_kv's keys and values; with
    the scales ignored it would not be (each slot's scale differs)."""
    from orca.models.attention.base import dequantize_kv, quantize_kv

    rows, padding, block_size = 5, 1, 8
    q, pool, q_request, q_position, table, tables, positions = _case(
        31 + splits, rows=rows, heads=4, kv_heads=2, head_dim=16, block_size=block_size,
        num_blocks=rows * (3 * paged_decode.BLOCK_N // block_size + 2), dtype=dtype, padding=padding)
    pool = pool * torch.rand(pool.shape[:3])[..., None].to(dtype) * 4  # scales that differ by slot
    values, scales = quantize_kv(pool, kv_dtype)  # (2, KVH, slots, D), (2, KVH, slots)
    scale = 0.25
    out = paged_decode.paged_decode_attention(q, values, q_request, q_position, table, block_size, scale, None,
                                              splits=splits, scales=scales)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _expected(q, dequantize_kv(values, scales, torch.float32), tables, positions, block_size, scale,
                         None, padding)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:rows].float(), expected[:rows], atol=tolerance, rtol=tolerance)
    assert torch.count_nonzero(out[rows:]) == 0
    unscaled = _expected(q, values.float(), tables, positions, block_size, scale, None, padding)
    assert not torch.allclose(out[:rows].float(), unscaled[:rows], atol=1e-2)


def test_a_quantized_pool_without_its_scales_or_with_others_is_refused() -> None:
    q, rows = torch.zeros(1, 2, 16), torch.zeros(1, dtype=torch.int32)
    pool, table = torch.zeros(2, 1, 32, 16, dtype=torch.int8), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="a pool of torch.int8 needs its scales"):
        paged_decode.paged_decode_attention(q, pool, rows, rows, table, 16, 1.0, None)
    with pytest.raises(ValueError, match=r"scales of shape \(2, 1, 16\)"):
        paged_decode.paged_decode_attention(q, pool, rows, rows, table, 16, 1.0, None, scales=torch.ones(2, 1, 16))


def test_more_splits_than_a_rows_tiles_leave_the_empty_shares_out(interpreted) -> None:  # noqa: ANN001
    """A share with no tile (a short row under many splits) weighs nothing in the combination."""
    q, pool, q_request, q_position, table, tables, positions = _case(
        7, rows=3, heads=2, kv_heads=1, head_dim=16, block_size=16, num_blocks=40, dtype=torch.float32,
        positions=[0, 17, 70])  # 1, 1 and 2 tiles; 16 shares
    scale = 0.25
    out = paged_decode.paged_decode_attention(q, pool, q_request, q_position, table, 16, scale, None, splits=16)
    torch.testing.assert_close(out, _expected(q, pool, tables, positions, 16, scale, None, 0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_n", [16, 128])
def test_other_tiles_give_the_same_attention(interpreted, block_n: int) -> None:  # noqa: ANN001
    """The tile size is a launch parameter (the tiles experiment sweeps it): smaller and larger tiles than
    the default, with splits, the same attention."""
    q, pool, q_request, q_position, table, tables, positions = _case(
        11, rows=4, heads=4, kv_heads=2, head_dim=16, block_size=8, num_blocks=200, dtype=torch.float32, padding=1)
    out = paged_decode.paged_decode_attention(q, pool, q_request, q_position, table, 8, 0.25, None, splits=3,
                                              block_n=block_n, num_warps=2)
    torch.testing.assert_close(out[:4], _expected(q, pool, tables, positions, 8, 0.25, None, 1)[:4],
                               atol=1e-5, rtol=1e-5)


def test_the_split_count_fills_the_gpu_and_is_one_for_a_full_batch() -> None:
    cpu = torch.device("cpu")
    assert paged_decode.num_splits(256, 4, cpu) == 1
    assert 1 < paged_decode.num_splits(1, 4, cpu) <= paged_decode.MAX_SPLITS


def test_a_tile_that_is_not_a_power_of_two_is_refused() -> None:
    q, pool = torch.zeros(1, 2, 16), torch.zeros(2, 1, 32, 16)
    rows = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_n 48"):
        paged_decode.paged_decode_attention(q, pool, rows, rows, torch.zeros(1, 2, dtype=torch.int32), 16, 1.0,
                                            None, block_n=48)


def test_mismatched_heads_are_refused() -> None:
    q = torch.zeros(2, 5, 16)
    pool = torch.zeros(2, 2, 32, 16)
    with pytest.raises(ValueError, match="5 query heads"):
        paged_decode.paged_decode_attention(q, pool, torch.zeros(2, dtype=torch.int32),
                                            torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                                            16, 1.0, None)


def test_the_tiles_experiment_runs(interpreted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """scripts/experiments/paged_decode_tiles.py, the sweep a GPU session runs, end to end in its smoke size."""
    import json
    import runpy

    out = tmp_path / "tiles.json"
    script = Path(__file__).parent.parent / "scripts" / "experiments" / "paged_decode_tiles.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke", "--json", str(out)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
    results = json.loads(out.read_text())["results"]
    assert {r["splits"] for r in results} >= {2} and all(r["us"] > 0 for r in results)
