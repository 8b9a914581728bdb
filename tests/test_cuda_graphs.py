"""CUDA graphs for decode iterations (orca/worker/cuda_graphs.py), checked on the CPU: which size a batch
runs in, when graphs apply and why not, and the padded static-buffer path itself. On a CPU the worker runs
that path without capture when a test lifts why_no_graphs' reasons: padding rows, the reserved slot, the
copies into the static buffers and the per-size masks all run as on CUDA; only capture and replay need a
GPU (tests/test_gpu.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _fixtures import FAMILIES, decode_graphs, drain, hf_greedy, tiny_checkpoint, tiny_reference
from checkpoints import make_mixtral

import orca.worker.resolution
from orca import EngineConfig, LLMEngine, SamplingParams
from orca.checkpoint import read_model_config
from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan
from orca.worker import Worker
from orca.worker.cuda_graphs import graph_size_for, graph_sizes
from orca.worker.resolution import why_no_graphs

GREEDY = SamplingSpec(0.0, 0, 1.0, 0)


@pytest.fixture
def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers built from here on take the decode-graph path on the CPU (uncaptured)."""
    monkeypatch.setattr(orca.worker.resolution, "why_no_graphs", lambda *args: None)


def test_sizes_and_the_size_a_batch_runs_in() -> None:
    assert graph_sizes(1) == (1,)
    assert graph_sizes(5) == (1, 2, 4, 5)
    assert graph_sizes(8) == (1, 2, 4, 8)
    assert graph_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert graph_sizes(33) == (1, 2, 4, 8, 16, 24, 32, 33)
    sizes = graph_sizes(32)
    assert [graph_size_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24, 25, 32)] == [
        1, 2, 4, 4, 8, 8, 16, 24, 24, 32, 32]
    assert graph_size_for(33, sizes) is None
    assert graph_size_for(0, sizes) is None


def test_graphs_apply_only_where_they_can(tmp_path: Path) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # moe: the model config's mixture-of-experts layers (what the worker passes), as a mixture's checkpoint
    # declares them and a dense one does not
    dense = any(read_model_config(tiny_checkpoint("llama"))[0].moe_layers)
    moe = any(read_model_config(make_mixtral(tmp_path / "mixtral"))[0].moe_layers)
    assert not dense and moe
    assert why_no_graphs("auto", cuda, "flex", 1, dense) is None
    assert why_no_graphs("off", cuda, "flex", 1, dense) == "cuda_graphs is off"
    assert "not CUDA" in why_no_graphs("auto", cpu, "flex", 1, dense)
    assert "attention_backend is reference" in why_no_graphs("auto", cuda, "reference", 1, dense)
    assert "several ranks" in why_no_graphs("auto", cuda, "flex", 2, dense)
    assert "mixture-of-experts" in why_no_graphs("auto", cuda, "flex", 1, moe)
    with pytest.raises(ValueError, match="cuda_graphs must be one of auto, off, got 'on'"):
        EngineConfig(cuda_graphs="on")
    assert EngineConfig.from_parameters({"cuda_graphs": "off"}).cuda_graphs == "off"
    # On this CPU the worker says why and reserves nothing.
    worker = Worker(EngineConfig(model=str(tiny_checkpoint("llama")), attention_backend="flex", block_size=4,
                                 n_slots=64))
    worker.init_kv_pool(16)
    assert worker.no_graphs_reason is not None and decode_graphs(worker) is None
    assert worker.kv_pool.shape[3] == 16 * 4


def _prompts_then_decode(worker: Worker, prompts: list[list[int]]) -> list:
    """Admits `prompts` (one iteration), then runs two decode iterations of all of them; returns the
    results of the decode iterations. Blocks are handed out interleaved, so no table is consecutive."""
    tables = [[2 * j + i for j in range(4)][::-1] for i in range(len(prompts))]
    worker.execute(StepPlan(0, tuple(
        PlannedRequest(f"r{i}", tuple(p), 0, tuple(tables[i]), GREEDY, sample_step=0) for i, p in enumerate(prompts)
    )))
    results = []
    for step in (1, 2):
        results.append(worker.execute(StepPlan(step, tuple(
            PlannedRequest(f"r{i}", (7 + i + step,), len(p) + step - 1, sample_step=step) for i, p in enumerate(prompts)
        ), return_logits=True)))
    return results


def test_a_padded_decode_iteration_equals_the_unpadded_one(
    graphs_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests decode in the 4-row size: the same logits as without padding, only the three are
    sampled, and the pool's blocks other than the reserved one hold the same keys and values."""
    options = dict(model=str(tiny_checkpoint("llama")), attention_backend="flex", block_size=4, n_slots=64, max_bs=6)
    padded = Worker(EngineConfig(**options))
    padded.init_kv_pool(16)
    assert decode_graphs(padded) is not None and decode_graphs(padded).sizes == (1, 2, 4, 6)
    assert padded.kv_pool.shape[3] == 17 * 4  # one block more, for the padding rows
    monkeypatch.setattr(orca.worker.resolution, "why_no_graphs", lambda *args: "off for the comparison")
    plain = Worker(EngineConfig(**options))
    plain.init_kv_pool(16)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4], [11]]
    got = _prompts_then_decode(padded, prompts)
    want = _prompts_then_decode(plain, prompts)
    assert decode_graphs(padded).replays == 2
    for g, w in zip(got, want):
        assert g.error is None and w.error is None
        assert sorted(g.sampled) == ["r0", "r1", "r2"]
        assert g.sampled == w.sampled
        for rid in w.logits:
            torch.testing.assert_close(g.logits[rid], w.logits[rid], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.kv_pool[:, :, :, : 16 * 4], plain.kv_pool, atol=1e-6, rtol=0)


def test_only_decode_iterations_that_fit_take_the_graph_path(graphs_on_cpu: None) -> None:
    worker = Worker(EngineConfig(model=str(tiny_checkpoint("gpt2")), attention_backend="flex", block_size=4,
                                 n_slots=64, max_bs=2))
    worker.init_kv_pool(16)
    graphs = decode_graphs(worker)
    worker.execute(StepPlan(0, (PlannedRequest("a", (1, 2), 0, (0,), GREEDY, sample_step=0),)))
    assert graphs.replays == 0  # a prompt
    worker.execute(StepPlan(1, (PlannedRequest("a", (3,), 2, sample_step=1),
                                PlannedRequest("b", (1, 2, 3), 0, (1,), GREEDY, sample_step=0))))
    assert graphs.replays == 0  # an increment with a prompt
    result = worker.execute(StepPlan(2, (PlannedRequest("a", (4,), 3, (2,), sample_step=2),
                                         PlannedRequest("b", (5,), 3, sample_step=1))))
    assert graphs.replays == 1 and sorted(result.sampled) == ["a", "b"]
    result = worker.execute(StepPlan(3, (PlannedRequest("a", (4,), 4, sample_step=3),), profile=True))
    assert graphs.replays == 1 and result.timings  # profiled iterations run eagerly, to be timed


KV_CONFIGS = {
    "paged-chunked-preempting": dict(n_slots=40, block_size=4, kv_admission="on_demand", max_num_batched_tokens=8),
    "block-16": dict(n_slots=160, block_size=16, kv_admission="on_demand"),
}


@pytest.mark.parametrize("kv", list(KV_CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_through_the_graph_path_is_transformers_greedy(graphs_on_cpu: None, family: str, kv: str) -> None:
    """Decode batches of every size from 1 to max_bs (requests of different lengths finishing at different
    times), padded, among prompt iterations and preemptions: transformers' greedy tokens."""
    rng = random.Random(3)
    jobs = [([rng.randrange(0, 190) for _ in range(rng.randint(1, 20))], rng.randint(1, 14)) for _ in range(10)]
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), max_bs=5, attention_backend="flex",
                                    **KV_CONFIGS[kv]))
    graphs = decode_graphs(engine.executor.worker)
    assert graphs is not None and graphs.sizes == (1, 2, 4, 5)
    for i, (prompt, n) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    final = drain(engine)
    assert graphs.replays > 0
    if kv == "paged-chunked-preempting":
        assert engine.stats().preemptions > 0
    reference = tiny_reference(family)
    for i, (prompt, n) in enumerate(jobs):
        assert final[f"r{i}"].token_ids == hf_greedy(reference, prompt, n), f"r{i}"
