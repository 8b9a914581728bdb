"""dtype "auto" (orca.config.auto_dtype): bfloat16 on CPUs that multiply it natively, float32 elsewhere,
$ORCA_DTYPE as the override (the suite sets float32 in conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orca.config import EngineConfig, auto_dtype, cpu_has_native_bf16

# /proc/cpuinfo "flags" lines, abridged, of CPUs of each kind.
SAPPHIRE_RAPIDS = "fpu vme sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
COOPER_LAKE = "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16"
ZEN2 = "fpu sse2 avx avx2 fma sha_ni"
SKYLAKE_X = "fpu sse2 avx2 avx512f avx512bw avx512vl avx512_vnni"


def _cpuinfo(flags: str) -> str:
    return f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n"


@pytest.mark.parametrize(("flags", "native"), [
    (SAPPHIRE_RAPIDS, True), (COOPER_LAKE, True), (ZEN2, False), (SKYLAKE_X, False),
    ("avx512_bf16x avx2", False),  # a flag is a whole word
])
def test_native_bf16_from_cpu_flags(flags: str, native: bool) -> None:
    assert cpu_has_native_bf16(_cpuinfo(flags)) is native


def test_no_flags_line_means_no_native_bf16() -> None:
    assert cpu_has_native_bf16("processor\t: 0\n") is False


def test_this_host_agrees_with_torch() -> None:
    """The flags read from this host's /proc/cpuinfo say what torch's own CPU probe says."""
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_native_bf16() == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def test_auto_on_cpu_follows_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_DTYPE", raising=False)
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert auto_dtype(torch.device("cpu")) == expected
    assert EngineConfig(device="cpu").torch_dtype == expected


def test_orca_dtype_overrides_auto_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCA_DTYPE", "bfloat16")
    assert EngineConfig(device="cpu").torch_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", dtype="float32").torch_dtype == torch.float32  # an explicit dtype wins
    monkeypatch.setenv("ORCA_DTYPE", "fp8")
    with pytest.raises(ValueError, match=r"\$ORCA_DTYPE must be one of float32, float16, bfloat16, got 'fp8'"):
        auto_dtype(torch.device("cpu"))


def test_the_suite_pins_float32() -> None:
    """conftest.py: engines compared with float32 references run in float32 whatever the host."""
    assert EngineConfig(device="cpu").torch_dtype == torch.float32
