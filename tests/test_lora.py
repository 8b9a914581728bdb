"""Multi-LoRA (orca/core/lora.py, orca/models/lora.py): adapters in PEFT's format, mixed in one iteration
with each other and with the base model, against PEFT's merged model (transformers + peft, float32) as the
reference; slots, eviction, waiting for a slot, chunked prefill, preemption, the prefix cache, tensor
parallelism on gloo, and the errors of bad adapters and bad requests."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import cpu_graphs, hf_greedy, tiny_checkpoint
from checkpoints import make_llama, make_lora_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.checkpoint import read_model_config
from orca.core.lora import LoRASlots
from orca.models import lora as lora_layers
from orca.models.lora import LoRAError, read_adapter

TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
# (rank, which targets) of the three adapters: all layers, the first two kinds only, the last two only
SHAPES = [(4, slice(None)), (8, slice(0, 2)), (2, slice(-2, None))]
MAX_TOKENS = 8


@functools.cache
def adapters(family: str, root: str) -> dict[str, Path]:
    checkpoint = tiny_checkpoint(family)
    return {f"{family}-{i}": make_lora_adapter(checkpoint, Path(root) / f"{family}-{i}", i, rank,
                                               TARGETS[family][which])
            for i, (rank, which) in enumerate(SHAPES)}


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("adapters"))


@functools.cache
def peft_greedy(family: str, adapter: str | None, prompt: tuple[int, ...], root: str) -> list[int]:
    """PEFT's merged model's greedy tokens (the reference), MAX_TOKENS of them, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapters(family, root)[adapter]).merge_and_unload()
    return hf_greedy(model.eval(), list(prompt), MAX_TOKENS)


def lora_engine(family: str, root: str, **options: Any) -> LLMEngine:
    modules = ",".join(f"{name}={path}" for name, path in adapters(family, root).items())
    options = {"dtype": "float32", "enable_lora": True, "lora_modules": modules, "max_bs": 8, **options}
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), **options))


def run(engine: LLMEngine, jobs: list[tuple[str, list[int], str | None]]) -> dict[str, list[int]]:
    for request_id, prompt, adapter in jobs:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                              lora_name=adapter))
    final: dict[str, list[int]] = {}
    for _ in range(1000):
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                final[out.request_id] = out.token_ids
        if not engine.has_unfinished():
            return final
    raise AssertionError("the engine did not finish")


def mixed_jobs(family: str, n: int = 8, long_prompt: int = 0) -> list[tuple[str, list[int], str | None]]:
    """n requests cycling over the three adapters and the base model; with `long_prompt` the first is that
    long (one slot's rows then far outnumber the others': the per-slot path)."""
    names = [f"{family}-0", None, f"{family}-1", f"{family}-2"]
    jobs = []
    for i in range(n):
        length = long_prompt if (long_prompt and i == 0) else 3 + (5 * i) % 11
        jobs.append((f"r{i}", [(7 * i + 3 * j) % 150 + 1 for j in range(length)], names[i % len(names)]))
    return jobs


def check(family: str, root: str, jobs: list, outputs: dict[str, list[int]]) -> None:
    for request_id, prompt, adapter in jobs:
        assert outputs[request_id] == peft_greedy(family, adapter, tuple(prompt), root), (request_id, adapter)


@pytest.mark.parametrize("path", ["grouped", "per-slot"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mixed_adapters_and_base_in_one_batch_match_peft(family: str, path: str, adapter_root: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 adapters in 2 slots: the slot of an idle adapter is reloaded with another as requests finish.
    # Both ways of computing a mixed iteration's deltas (orca/models/lora.py), each forced throughout.
    monkeypatch.setattr(lora_layers, "GROUPED_MAX_PADDING", 1e9 if path == "grouped" else -1e9)
    engine = lora_engine(family, adapter_root, max_loras=2)
    jobs = mixed_jobs(family)
    outputs = run(engine, jobs)
    check(family, adapter_root, jobs, outputs)
    assert engine.core.stats().lora_loads >= 3  # every adapter was loaded, one of them into a reused slot
    # The adapters change the output (the base model's tokens differ from each adapter's for one prompt).
    prompt = tuple(jobs[0][1])
    names = [None, *adapters(family, adapter_root)]
    assert len({tuple(peft_greedy(family, a, prompt, adapter_root)) for a in names}) == 4


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_chunked_prefill_preemption_and_a_skewed_iteration_match_peft(family: str, adapter_root: str) -> None:
    # A 40-token prompt beside one-token increments (the per-slot path), prompts in chunks of 16, and a
    # pool so small that requests are preempted and recompute (with their adapters) when readmitted.
    engine = lora_engine(family, adapter_root, max_loras=3, max_num_batched_tokens=16, n_slots=96,
                         kv_admission="on_demand", block_size=8)
    jobs = mixed_jobs(family, n=8, long_prompt=40)
    outputs = run(engine, jobs)
    check(family, adapter_root, jobs, outputs)
    assert engine.stats().preemptions > 0


def test_a_request_waits_for_a_slot_while_others_go_ahead(adapter_root: str) -> None:
    # One slot, two adapters: requests of the second wait until no admitted request uses the first, while
    # base requests (no slot needed) run beside them.
    engine = lora_engine("llama", adapter_root, max_loras=1)
    jobs = [("a", [5, 6, 7], "llama-0"), ("b", [8, 9], "llama-1"), ("base", [4, 4, 4], None), ("a2", [3, 1], "llama-0")]
    for request_id, prompt, adapter in jobs:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                              lora_name=adapter))
    first = {o.request_id for o in engine.step()}
    assert first == {"a", "base", "a2"}  # b waits for the slot; a2, later, shares a's adapter and goes ahead
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    check("llama", adapter_root, jobs, final)
    assert engine.core.stats().lora_loads == 2


def test_prefix_cache_never_shares_keys_across_adapters(adapter_root: str) -> None:
    # The same 40-token prompt, base then adapter then adapter again: only the same adapter's second
    # request reuses cached blocks, and every output is its own model's.
    engine = lora_engine("llama", adapter_root, block_size=8)
    prompt = [(11 * j) % 150 + 1 for j in range(40)]
    for i, adapter in enumerate([None, "llama-0", "llama-0", "llama-1"]):
        job = (f"p{i}", prompt, adapter)
        before = engine.stats().prefix_cache_hits
        check("llama", adapter_root, [job], run(engine, [job]))
        hits = engine.stats().prefix_cache_hits - before
        assert (hits > 0) == (i == 2), (i, adapter, hits)


@pytest.mark.parametrize("family,tp,pp", [("llama", 2, 1), ("gpt2", 2, 1), ("llama", 1, 2)])
def test_parallel_adapters_match_peft(family: str, tp: int, pp: int, adapter_root: str) -> None:
    # tp 2 on gloo: column-parallel layers split B by output rows, row-parallel ones A by input columns
    # (their x A^T all-reduced); pp 2: each stage adapts its own layers.
    engine = lora_engine(family, adapter_root, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_loras=3)
    try:
        jobs = mixed_jobs(family, n=6)
        check(family, adapter_root, jobs, run(engine, jobs))
    finally:
        engine.shutdown()


# -- bad input ---------------------------------------------------------------------------------------
def test_unknown_adapter_and_lora_off_are_refused_per_request(adapter_root: str) -> None:
    engine = lora_engine("llama", adapter_root)
    with pytest.raises(ValueError, match=r"lora_name 'nope' is not an adapter this model serves \(served: llama-0, "
                                         r"llama-1, llama-2\)"):
        engine.add_request("x", [1, 2], SamplingParams(lora_name="nope"))
    plain = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama"))))
    with pytest.raises(ValueError, match=r"lora_name 'llama-0': this model serves no LoRA adapters \(enable_lora is "
                                         r"off\)"):
        plain.add_request("x", [1, 2], SamplingParams(lora_name="llama-0"))
    with pytest.raises(ValueError, match="lora_name must be the name of a LoRA adapter"):
        SamplingParams(lora_name="")
    # the engine serves on: a good request after the bad ones
    check("llama", adapter_root, [("ok", [1, 2], "llama-1")], run(engine, [("ok", [1, 2], "llama-1")]))


def _broken(root: Path, source: Path, name: str) -> Path:
    path = root / name
    shutil.copytree(source, path)
    return path


def test_bad_adapters_are_refused_naming_the_adapter_and_the_reason(adapter_root: str, tmp_path: Path) -> None:
    good = adapters("llama", adapter_root)["llama-0"]  # rank 4
    cfg = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), enable_lora=True, max_lora_rank=4)).core
    other = make_llama(tmp_path / "wide", hidden_size=96)  # another base model: other shapes
    wrong_base = make_lora_adapter(other, tmp_path / "wide-adapter", 0, 4, ["q_proj"])
    corrupt = _broken(tmp_path, good, "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    no_config = _broken(tmp_path, good, "no-config")
    (no_config / "adapter_config.json").unlink()
    dora = _broken(tmp_path, good, "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    high = make_lora_adapter(tiny_checkpoint("llama"), tmp_path / "rank8", 0, 8, ["q_proj"])
    cases = [
        ("wide", wrong_base, r"has A \(4, 96\).*Is it an adapter for another base model\?"),
        ("corrupt", corrupt, "adapter_model.safetensors cannot be read"),
        ("no-config", no_config, "no adapter_config.json"),
        ("dora", dora, r"use_dora \(DoRA\) is not supported"),
        ("rank8", high, "has rank 8, above max_lora_rank 4"),
        ("missing", tmp_path / "missing", "no such directory"),
    ]
    for name, path, reason in cases:
        with pytest.raises(LoRAError, match=rf"LoRA adapter '{name}' \(.*\): .*{reason}"):
            cfg.add_lora(name, str(path))
    cfg.add_lora("good", str(good))
    with pytest.raises(ValueError, match="'good' is already served"):
        cfg.add_lora("good", str(good))
    assert [lora.name for lora in cfg.list_loras()] == ["good"]
    assert cfg.remove_lora("good") and not cfg.remove_lora("good")
    # An embedding adapter is no linear layer's
    emb = make_lora_adapter(tiny_checkpoint("llama"), tmp_path / "emb", 0, 4, ["embed_tokens"])
    with pytest.raises(LoRAError, match="is not a LoRA A or B matrix of a linear layer"):
        read_adapter("emb", emb, cfg.model_config, 16)


def test_options_are_checked() -> None:
    model = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="lora_modules needs enable_lora true"):
        EngineConfig(model=model, lora_modules="a=/x")
    with pytest.raises(ValueError, match="max_loras must be an integer in \\[1, 64\\]"):
        EngineConfig(model=model, enable_lora=True, max_loras=65)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        EngineConfig(model=model, enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="'b' is not one"):
        EngineConfig(model=model, enable_lora=True, lora_modules="a=/x, b")
    with pytest.raises(ValueError, match="names adapter 'a' twice"):
        EngineConfig(model=model, enable_lora=True, lora_modules="a=/x,a=/y")
    config = EngineConfig.from_parameters({"enable_lora": "true", "max_loras": "2", "lora_modules": "a=/x"})
    assert (config.enable_lora, config.max_loras, config.lora_modules) == (True, 2, "a=/x")


# -- the slots (plain numbers) -----------------------------------------------------------------------
def test_slots_evict_the_least_recently_used_idle_adapter() -> None:
    slots = LoRASlots(2)
    assert slots.acquire(1) == (0, True) and slots.acquire(2) == (1, True)
    assert not slots.can_acquire(3)  # both pinned
    slots.release(1)
    slots.release(2)
    assert slots.acquire(2) == (1, False)  # resident: no load; 1 is now the least recently used idle one
    assert slots.can_acquire(3) and slots.acquire(3) == (0, True)
    assert slots.resident == {2: 1, 3: 0} and slots.num_loads == 3 and slots.num_active == 2
    slots.release(3)
    slots.forget(3)  # removed while idle: its slot is free again
    assert slots.acquire(4) == (0, True)


def test_a_compiled_engine_compiles_adapter_iterations_too(adapter_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch_compile auto as shipped: two graphs compiled at load, one traced without adapter rows and one
    # with them (each adapted layer's deltas an opaque op); never compiled again (fail_on_recompile), for
    # base-only and mixed iterations alike, with PEFT's tokens.
    monkeypatch.delenv("ORCA_TORCH_COMPILE")
    engine = lora_engine("llama", adapter_root, max_loras=3)
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled is not None and compiled.ready
    compiled.stance, compiled.all_guards = "fail_on_recompile", True
    calls = {"compiled": 0}
    original = type(compiled).forward

    def counting(self: Any, *args: Any) -> Any:
        calls["compiled"] += 1
        return original(self, *args)

    monkeypatch.setattr(type(compiled), "forward", counting)
    base_only = [("b0", [1, 2, 3], None), ("b1", [4, 5], None)]
    check("llama", adapter_root, base_only, run(engine, base_only))
    assert calls["compiled"] == MAX_TOKENS  # every iteration of the base-only run
    calls["compiled"] = 0
    for path in (1e9, -1e9):  # grouped, then per slot
        monkeypatch.setattr(lora_layers, "GROUPED_MAX_PADDING", path)
        jobs = [(f"{path}-{r}", p, a) for r, p, a in mixed_jobs("llama", n=6)]
        check("llama", adapter_root, jobs, run(engine, jobs))
    assert calls["compiled"] == 2 * MAX_TOKENS  # every iteration, adapter rows and all
    # As shipped, only the guards telling the two graphs apart run: they still pick the right one.
    compiled.all_guards = False
    jobs = [(f"shipped-{r}", p, a) for r, p, a in mixed_jobs("llama", n=6)]
    check("llama", adapter_root, base_only + jobs, run(engine, base_only + jobs))


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_every_llama_style_family_matches_peft(family: str, tmp_path: Path) -> None:
    # One adapter on attention and (where the layer is dense) the MLP, beside the base model: a sliding
    # window (Mistral, Qwen2), q/k/v biases (Qwen2), q/k norms and a head_dim of its own (Qwen3), and
    # mixtures whose experts stay the base's (an adapter on experts is refused: tested above by name).
    import checkpoints

    checkpoint = getattr(checkpoints, f"make_{family}")(tmp_path / family)
    attention, mlp = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
    moe = family in ("mixtral", "qwen3_moe")
    adapter = make_lora_adapter(checkpoint, tmp_path / "adapter", 1, 4, attention if moe else attention + mlp)
    if family == "qwen3_moe":  # PEFT maps the MLP targets onto the experts' parameters: refused by name
        experts = make_lora_adapter(checkpoint, tmp_path / "experts", 1, 4, attention + mlp)
        with pytest.raises(LoRAError, match=r"'experts' .*target_parameters \(adapters on parameters, such as a "
                                            r"mixture's experts\) is not supported"):
            read_adapter("experts", experts, read_model_config(checkpoint)[0], 16)
    engine = LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", enable_lora=True,
                                    lora_modules=f"a={adapter}"))
    pi, e = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8]
    jobs = [("x", pi, "a"), ("w", pi, None), ("y", e, None), ("z", e, "a")]
    outputs = run(engine, jobs)
    for request_id, prompt, name in jobs:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        assert outputs[request_id] == hf_greedy(model.eval(), prompt, MAX_TOKENS), request_id
    assert outputs["y"] != outputs["z"] or outputs["x"] != outputs["w"]  # the adapter changes the model


def test_the_engine_loop_changes_adapters_on_its_thread(adapter_root: str, tmp_path: Path) -> None:
    # EngineLoop.add_lora / remove_lora run on the loop's thread between iterations (the Triton model's
    # lora_control) and hand the caller the result or the error; a request then runs with the new adapter.
    import threading

    from orca.core.engine import EngineCore
    from orca.core.engine_loop import EngineLoop

    threads: list[int] = []
    outputs: dict[str, list[int]] = {}
    done = threading.Event()

    def on_output(out: Any) -> None:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            done.set()

    loop = EngineLoop(lambda: EngineCore(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32",
                                                      enable_lora=True)), on_output=on_output)
    try:
        loop.start()
        original = type(loop.core).add_lora

        def recording(core: Any, *args: Any) -> Any:
            threads.append(threading.get_ident())
            return original(core, *args)

        type(loop.core).add_lora = recording  # type: ignore[method-assign]
        try:
            lora = loop.add_lora("late", str(adapters("llama", adapter_root)["llama-1"]))
        finally:
            type(loop.core).add_lora = original  # type: ignore[method-assign]
        assert lora.name == "late" and threads == [loop._thread.ident]
        with pytest.raises(LoRAError, match="LoRA adapter 'bad' .*no such directory"):
            loop.add_lora("bad", str(tmp_path / "nowhere"))
        assert [x.name for x in loop.list_loras()] == ["late"]
        prompt = [5, 6, 7]
        loop.submit("r", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                lora_name="late"))
        assert done.wait(60)
        assert outputs["r"] == peft_greedy("llama", "llama-1", tuple(prompt), adapter_root)
        assert loop.remove_lora("late") is True and loop.remove_lora("late") is False
        assert loop.list_loras() == []
    finally:
        loop.shutdown()
