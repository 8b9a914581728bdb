"""The one resolution pass (orca/worker/resolution.py): each choice and its reason for CPU- and CUDA-shaped
inputs, from the config and the checkpoint's config.json only (no weight loads; a "cuda" device is only a
name here: no CUDA call is made), the frozen plan, its table, and docs/OPTIONS.md's section of the rules."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama, make_mixtral

from orca import EngineConfig
from orca.models import layers
from orca.worker import resolution
from orca.worker.resolution import RULES, RULES_HEADING, ResolvedPlan, resolve

ROOT = Path(__file__).resolve().parent.parent
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("dense") / "llama", head_dim=16)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("narrow") / "llama")  # head_dim 8: below flex's CUDA kernels'


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mixtral(tmp_path_factory.mktemp("moe") / "mixtral", head_dim=16)


def _plan(path: Path, device: torch.device = CPU, ranks: int = 1, **options: object) -> ResolvedPlan:
    options.setdefault("dtype", "bfloat16" if device.type == "cuda" else "float32")
    return resolve(EngineConfig(model=str(path), **options), device, path, ranks)


def test_a_cpu_plan_and_its_reasons(dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 8 << 30)
    monkeypatch.delenv("ORCA_TORCH_COMPILE", raising=False)
    plan = _plan(dense)
    packs = layers.onednn_packs(torch.float32)
    assert (plan.dtype, plan.reason("dtype")) == (torch.float32, "as asked")
    assert plan.linear == ("hybrid" if packs else "reference")
    assert plan.reason("linear_backend").startswith("auto: hybrid (a second copy of" if packs else "auto: reference")
    assert plan.attention_backend == "batched" and plan.attention.name == "batched"
    assert plan.reason("attention_backend") == "auto: batched on a CPU (flex's paged mask does not compile there)"
    assert plan.no_flex_reason == "the device is cpu"
    assert plan.no_graphs_reason == "the device is cpu, not CUDA" == plan.reason("cuda_graphs")
    assert plan.no_compile_reason is None and plan.choice("torch_compile").value == "on"
    assert (plan.kv_dtype, plan.reason("kv_cache_dtype")) == (torch.float32, "auto: the model's dtype")
    assert plan.quantization == "auto" and plan.reason("quantization").startswith("auto: the checkpoint's own")


def test_a_cuda_plan_is_flex_with_graphs(dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_TORCH_COMPILE", raising=False)
    plan = _plan(dense, CUDA)
    assert plan.linear == "reference" and plan.reason("linear_backend") == "auto: reference on CUDA (cuBLAS)"
    assert plan.attention_backend == "flex" and plan.no_flex_reason is None
    assert plan.reason("attention_backend").startswith("auto: flex on CUDA with its CUDA graphs")
    assert plan.no_graphs_reason is None and plan.choice("cuda_graphs").value == "on"
    assert "not a CPU" in plan.no_compile_reason
    assert plan.kv_dtype == torch.bfloat16


@pytest.mark.parametrize(("options", "words"), [
    ({"cuda_graphs": "off"}, "cuda_graphs is off"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype int8"),
    ({"enable_lora": True}, "enable_lora"),
])
def test_auto_is_batched_on_cuda_where_flex_would_not_serve(dense: Path, options: dict, words: str) -> None:
    plan = _plan(dense, CUDA, **options)
    assert plan.attention_backend == "batched" and words in plan.no_flex_reason
    assert plan.reason("attention_backend") == f"auto: batched, not flex: {plan.no_flex_reason}"


def test_ranks_moe_and_head_dim_on_cuda(dense: Path, narrow: Path, moe: Path) -> None:
    two = _plan(dense, CUDA, ranks=2)
    assert two.attention_backend == "batched" and "parallelism" in two.no_flex_reason
    assert two.weight_bytes == _plan(dense, CUDA).weight_bytes // 2
    assert "mixture-of-experts" in _plan(moe, CUDA).no_flex_reason
    assert "mixture-of-experts" in _plan(moe, CUDA, attention_backend="flex").no_graphs_reason
    assert _plan(narrow, CUDA).no_flex_reason == "head_dim 8 < 16 (torch's flex kernels)"
    with pytest.raises(ValueError, match="attention_backend flex on CUDA needs head_dim >= 16 .* this model's is 8: "
                                         "choose batched or reference"):
        _plan(narrow, CUDA, attention_backend="flex")
    assert _plan(narrow, CUDA, attention_backend="batched").reason("attention_backend") == "as asked"


def test_flex_over_an_fp8_pool_needs_compute_capability_8_9(dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8_e4m3 with attention_backend flex needs a GPU of "
                                         r"compute capability 8.9 or later .* is 8.0: choose kv_cache_dtype int8"):
        _plan(dense, CUDA, attention_backend="flex", kv_cache_dtype="fp8_e4m3")
    assert _plan(dense, CUDA, attention_backend="flex", kv_cache_dtype="int8").kv_dtype == torch.int8
    assert _plan(dense, CUDA, attention_backend="batched", kv_cache_dtype="fp8_e4m3").kv_dtype == torch.float8_e4m3fn
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    plan = _plan(dense, CUDA, attention_backend="flex", kv_cache_dtype="fp8_e4m3")
    assert plan.reason("kv_cache_dtype").startswith("as asked")


def test_the_backends_traits_decide_not_their_names() -> None:
    flex = resolution.get_backend("flex")
    assert flex.cuda_min_head_dim == 16 and flex.cuda_fp8_pool_min_capability == (8, 9) and flex.cuda_graphs
    for name in ("reference", "batched"):
        backend = resolution.get_backend(name)
        resolution.check_attention_support(backend, CUDA, 1, torch.float8_e4m3fn)  # nothing it cannot run
        assert backend.in_compiled_forward and not backend.cuda_graphs


def test_cpu_graphs_reasons(dense: Path, moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_TORCH_COMPILE", raising=False)
    assert "attention_backend is flex" in _plan(dense, attention_backend="flex").no_compile_reason
    assert "several ranks" in _plan(dense, ranks=2).no_compile_reason
    assert "mixture-of-experts" in _plan(moe).no_compile_reason
    assert _plan(dense, torch_compile="off").no_compile_reason == "torch_compile is off"
    monkeypatch.setenv("ORCA_TORCH_COMPILE", "off")  # (the suite's setting: conftest.py)
    plan = _plan(dense)
    assert plan.no_compile_reason == "torch_compile is off"
    assert plan.reason("torch_compile") == "auto is $ORCA_TORCH_COMPILE's off: torch_compile is off"


def test_dtype_and_linear_reasons(dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCA_DTYPE", "float32")
    assert _plan(dense, dtype="auto").reason("dtype") == "auto: $ORCA_DTYPE is float32"
    monkeypatch.delenv("ORCA_DTYPE")
    monkeypatch.setattr("orca.config.cpu_has_native_bf16", lambda: False)
    assert _plan(dense, dtype="auto").choice("dtype").value == "float32"
    monkeypatch.setattr("orca.config.cpu_has_native_bf16", lambda: True)
    assert _plan(dense, dtype="auto").reason("dtype").startswith("auto: bfloat16 on a CPU that multiplies it")
    with pytest.raises(ValueError, match="linear_backend onednn cannot run device cuda"):
        _plan(dense, CUDA, linear_backend="onednn")
    if layers.onednn_packs(torch.float32):
        monkeypatch.setattr(layers, "available_memory_bytes", lambda: None)
        assert _plan(dense).linear == "onednn"
        monkeypatch.setattr(layers, "available_memory_bytes", lambda: 1)
        assert _plan(dense).reason("linear_backend").startswith("auto: onednn (a second copy of")
        assert _plan(dense, linear_backend="hybrid").reason("linear_backend") == "as asked"


def test_the_plan_is_frozen_and_its_table_has_every_choice(dense: Path) -> None:
    plan = _plan(dense, CUDA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.linear = "onednn"  # type: ignore[misc]
    options = [c.option for c in plan.choices]
    assert options == ["dtype", "linear_backend", "attention_backend", "cuda_graphs", "torch_compile",
                       "kv_cache_dtype", "quantization"] == list(RULES)
    lines = plan.table().splitlines()
    assert lines[0].startswith("resolved for cuda") and RULES_HEADING in lines[0]
    assert lines[1].split() == ["option", "asked", "resolved", "reason"]
    for line, choice in zip(lines[2:], plan.choices, strict=True):
        assert line.split()[:3] == [choice.option, choice.asked, choice.value] and line.endswith(choice.reason)
    with pytest.raises(KeyError):
        plan.choice("max_bs")


def test_options_md_holds_the_rules_section() -> None:
    spec = importlib.util.spec_from_file_location("options_doc", ROOT / "scripts" / "options_doc.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (ROOT / "docs" / "OPTIONS.md").read_text(encoding="utf-8")
    section = script.rules_markdown(script.option_docs(EngineConfig))
    assert section in page and f"## {RULES_HEADING}" in section
    assert all(f"| [`{option}`](#{option}) |" in section for option in RULES)
    # The sections the rules cite exist (as test_options_doc checks the docstring's).
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    titles = re.findall(r"^#+ (.+)$", text, re.M) + re.findall(r"\*\*([^*]+?)\.?\*\*", text)
    for option, rule in RULES.items():
        for cited in (q for q in rule.split('"')[1::2] if " " in q):
            assert any(title.startswith(cited) for title in titles), f"{option}: no section {cited!r}"
