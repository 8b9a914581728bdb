"""The CPU graphs runner (orca/worker/cpu_graphs/): where it applies and why not, and that it is the
eager engine's numbers: logits within 1e-4 of the eager twin and transformers' greedy tokens on mixed
iterations (chunked prompts, increments at different positions and batched, preemptions, GQA), with no compilation
after load (torch.compile's fail_on_recompile stance: every iteration ran the graph compiled at
load)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import FAMILIES, cpu_graphs, drain, hf_greedy, record_logits, tiny_checkpoint, tiny_reference
from checkpoints import make_mixtral

from orca import LLM, EngineConfig, LLMEngine, SamplingParams
from orca.checkpoint import read_model_config
from orca.models.attention import AttentionMetadata, IterationLayout, get_backend
from orca.models.layers import onednn_packs
from orca.models.lora import LoRABatch
from orca.models.quantization import QuantizedLinear, quantize
from orca.tuning import COMPILED_HEAD_FLOAT_ROWS, FEW_MAX_ROWS, HYBRID_QUANTIZED_MIN_ROWS
from orca.worker import Worker
from orca.worker.cpu_graphs import CPUGraphs
from orca.worker.cpu_graphs.head import CompiledHead
from orca.worker.cpu_graphs.views import iteration_scope
from orca.worker.resolution import why_not_compiled

# Paged blocks of 4 tokens, a budget of 8 tokens per iteration (prompts in chunks, mixed with increments)
# and a pool of 10 blocks for 5 requests at a time (preemptions).
OPTIONS = dict(max_bs=5, n_slots=40, block_size=4, kv_admission="on_demand", max_num_batched_tokens=8)


def _jobs() -> list[tuple[list[int], int]]:
    rng = random.Random(5)
    return [([rng.randrange(0, 190) for _ in range(rng.randint(1, 20))], rng.randint(1, 14)) for _ in range(10)]


def _run(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    logits = record_logits(engine, monkeypatch)
    for i, (prompt, n) in enumerate(_jobs()):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return drain(engine), logits


def _shipped(model: str, **options: Any) -> LLMEngine:
    """An engine with torch_compile as shipped: the suite's $ORCA_TORCH_COMPILE=off lifted while it loads."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ORCA_TORCH_COMPILE")
        return LLMEngine(EngineConfig(model=model, **options))


@pytest.fixture(scope="module", params=FAMILIES)
def compiled_engine(request: pytest.FixtureRequest) -> LLMEngine:
    """An engine of the family with torch_compile auto as shipped (the suite's $ORCA_TORCH_COMPILE=off
    lifted while it loads); after load any compilation fails the test."""
    engine = _shipped(str(tiny_checkpoint(request.param)), **OPTIONS)
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled is not None and compiled.ready and compiled.compile_seconds > 0
    assert engine.executor.worker.attention_backend == "batched"  # auto on a CPU: max_bs 5 batches increments
    compiled.stance, compiled.all_guards = "fail_on_recompile", True
    engine.family = request.param
    return engine


def test_the_compiled_engine_is_the_eager_one(compiled_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    family = compiled_engine.family
    eager = LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), **OPTIONS))
    assert cpu_graphs(eager.executor.worker) is None
    final, logits = _run(compiled_engine, monkeypatch)
    want_final, want_logits = _run(eager, monkeypatch)
    assert compiled_engine.stats().preemptions > 0
    assert cpu_graphs(compiled_engine.executor.worker).few.steps > 0  # (decode steps of 2-5 requests: FewStep)
    reference = tiny_reference(family)
    for i, (prompt, n) in enumerate(_jobs()):
        assert final[f"r{i}"].token_ids == want_final[f"r{i}"].token_ids == hf_greedy(reference, prompt, n), f"r{i}"
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):
        assert sorted(got) == sorted(want)
        for rid in want:
            torch.testing.assert_close(got[rid], want[rid], atol=1e-4, rtol=0)


def test_the_shipped_guards_run_the_same_graph(compiled_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """As shipped, after load only the guards that tell graphs apart run (compiled.py, Guards): the
    same iterations give transformers' tokens, and afterwards every guard passes on them."""
    compiled = cpu_graphs(compiled_engine.executor.worker)
    compiled.all_guards = False
    try:
        final = _run(compiled_engine, monkeypatch)[0]
    finally:
        compiled.all_guards = True
    reference = tiny_reference(compiled_engine.family)
    for i, (prompt, n) in enumerate(_jobs()):
        assert final[f"r{i}"].token_ids == hf_greedy(reference, prompt, n), f"r{i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_single_stream_decode_runs_the_lone_step_graph(family: str) -> None:
    """One request alone in a fresh pool: its increments run LoneStep's graph, compiled at load (the stance
    fails any compilation), at every context length, with transformers' tokens; its keys and values reach
    the pool (each step reads the previous steps'). The same prompt again (two whole blocks): its first
    block from the prefix cache, its others elsewhere in the pool (the cached blocks after the first are
    kept), it runs LoneStep at every increment too, through its block table."""
    engine = _shipped(str(tiny_checkpoint(family)), **{**OPTIONS, "n_slots": 64})
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled.lone is not None and compiled.lone.ready
    compiled.stance, compiled.all_guards = "fail_on_recompile", True
    prompt = [5, 17, 33, 2, 9, 4, 71, 8]
    want = hf_greedy(tiny_reference(family), prompt, 12)
    for again in ("alone", "again"):
        before = compiled.lone.steps
        engine.add_request(again, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        engine.step()  # its prompt
        table = engine.core.blocks.table(again)
        # the first time its own blocks, consecutive; again its cached first block, then blocks elsewhere
        assert (table == list(range(table[0], table[0] + len(table)))) == (again == "alone"), table
        final = drain(engine)
        assert final[again].token_ids == want, again
        assert compiled.lone.steps - before == 11, again  # every increment (the prompt's drew the first token)
    assert final["again"].num_cached_tokens == 4
    assert compiled.lone_rows is None  # (an engine that does not speculate compiles no graph of several rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_of_a_few_requests_run_the_few_step_graph(family: str) -> None:
    """Two to four requests decoding together (each joining at another moment, so their contexts differ;
    the later ones' prompts from the prefix cache, their other blocks elsewhere): their decode steps run
    FewStep's graph, compiled at load (the stance fails any compilation), at every row count and context,
    with transformers' greedy tokens each; a lone request's steps still run LoneStep's."""
    engine = _shipped(str(tiny_checkpoint(family)), **{**OPTIONS, "n_slots": 96})
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled.few is not None and compiled.few.ready
    compiled.stance, compiled.all_guards = "fail_on_recompile", True
    reference = tiny_reference(family)
    prompts = [[5, 17, 33, 2, 9, 4, 71, 8], [5, 17, 33, 2, 60, 61], [7, 3], [5, 17, 33, 2, 9, 4, 71, 8, 99]]
    budgets = [14, 9, 11, 5]
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        engine.step()
        engine.step()
    final = drain(engine)
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        assert final[f"r{i}"].token_ids == hf_greedy(reference, prompt, n), f"r{i}"
    assert final["r3"].num_cached_tokens == 8
    assert compiled.few.steps >= 10 and compiled.lone.steps > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_speculating_single_stream_verifies_in_the_lone_graph_of_several_rows(family: str) -> None:
    """A lone request speculating (n-gram proposals from its repetitive prompt): its verifications (the
    last drawn token and its proposals, after its cached tokens) run LoneStep's graph of several rows,
    compiled at load, at every row count and context; its tokens are transformers' greedy ones."""
    engine = _shipped(str(tiny_checkpoint(family)), speculative_method="ngram", num_speculative_tokens=3,
                      **{**OPTIONS, "n_slots": 64})
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled.lone_rows is not None and compiled.lone_rows.ready and compiled.lone.ready
    compiled.stance, compiled.all_guards = "fail_on_recompile", True
    prompt = [5, 17, 33, 2, 9] * 3
    engine.add_request("alone", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    final = drain(engine)
    assert final["alone"].token_ids == hf_greedy(tiny_reference(family), prompt, 20)
    assert compiled.lone_rows.steps > 0 and compiled.lone.steps > 0


def test_int8_models_of_the_same_shapes_each_run_their_own_weights_in_their_frozen_lone_graphs(
        tmp_path: Path) -> None:
    """An int8 model's LoneStep graphs hold its weights as constants (frozen in, for inductor's int8
    template): two such models of the same shapes, different weights, alive together in one process and
    stepped in turn, each decode with their own weights: the eager engine's tokens for each. Neither
    dynamo's graphs of the shared code nor inductor's graph cache (keyed by a frozen weight's shape, and the
    model's fingerprint) may hand one model's graph to the other."""
    from checkpoints import make_llama

    paths = [make_llama(tmp_path / f"seed{seed}", seed=seed) for seed in (0, 1)]
    engines = [_shipped(str(p), quantization="int8", **{**OPTIONS, "n_slots": 64}) for p in paths]
    lone = [cpu_graphs(e.executor.worker).lone for e in engines]
    assert all(step is not None and step.ready and step.frozen for step in lone)
    prompt = [5, 17, 33, 2, 9]
    for i, engine in enumerate(engines):
        engine.add_request(f"m{i}", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while any(e.has_unfinished() for e in engines):
        for engine in engines:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert all(step.steps >= 9 for step in lone)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCA_TORCH_COMPILE", "off")
        eager = [[o.token_ids for o in LLM(str(p), quantization="int8", max_bs=2).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))][0] for p in paths]
    assert [tokens["m0"], tokens["m1"]] == eager and eager[0] != eager[1]


def test_a_speculating_engine_with_float_copies_compiles_both_lone_graphs() -> None:
    """A quantized model under linear_backend hybrid compiles the float copies' graph at load too (its
    own warm-up iterations): the verification's warm-up still runs after them, so LoneStep's graph of
    several rows is compiled as well (once, it was left out, and verifications ran the opaque op)."""
    engine = _shipped(str(tiny_checkpoint("llama")), quantization="int8", linear_backend="hybrid",
                      speculative_method="ngram", **OPTIONS)
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled.float_rows is not None
    assert compiled.lone.ready and compiled.lone_rows is not None and compiled.lone_rows.ready


def test_lone_and_few_steps_are_left_to_the_graph_of_every_count_where_they_do_not_apply(tmp_path: Path) -> None:
    """A sliding-window model compiles no LoneStep or FewStep (its layers would read different keys); a lone
    request's step of more rows than VERIFYING_MAX_ROWS, a prompt, several requests (but a decode step of 2 to
    FEW_MAX_ROWS: FewStep), more than FEW_MAX_ROWS or as many as the float copies' graph takes, a request
    of several rows among them, a quantized pool, an adapter row or a profiling timer run the graph of every
    token count. (Blocks that are not consecutive do not stop them: they read them through block tables.)"""
    from checkpoints import make_mistral

    windowed = _shipped(str(make_mistral(tmp_path / "mistral")), **OPTIONS)
    assert cpu_graphs(windowed.executor.worker) is not None and cpu_graphs(windowed.executor.worker).lone is None
    assert cpu_graphs(windowed.executor.worker).few is None
    worker = Worker(EngineConfig(model=str(tiny_checkpoint("llama")), n_slots=64, block_size=4))
    forward = CPUGraphs(worker.model, verifies=True)
    pool = torch.zeros(worker.kv_layout.num_layers, 2, 2, 64, 16)
    batched = get_backend("batched")

    def picked(layout: IterationLayout) -> Any:
        chosen = forward._step(layout, sum(layout.lengths))
        return None if chosen is None else chosen[0]

    def step(new: int, table: list[int], past: int = 5) -> IterationLayout:
        return IterationLayout(batched, [new], [past], [table], 4, pool)

    assert picked(step(1, [3, 4])) is forward.lone
    assert picked(step(3, [3, 4])) is forward.lone_rows
    assert picked(step(1, [7, 3])) is forward.lone  # not consecutive: through the table
    scales = torch.ones(worker.kv_layout.num_layers, 2, 2, 64)
    quantized = IterationLayout(batched, [1], [5], [[3, 4]], 4, pool, kv_scales=scales)
    assert picked(quantized) is None
    assert picked(step(9, [3, 4, 5, 6])) is None  # more rows than VERIFYING_MAX_ROWS
    assert picked(step(2, [3], past=0)) is None  # a prompt

    def steps(lengths: list[int], backend: str = "batched", **kw: Any) -> IterationLayout:
        n = len(lengths)
        return IterationLayout(get_backend(backend), lengths, [5] * n, [[2 * i, 2 * i + 1] for i in range(n)], 4,
                               pool, **kw)

    assert picked(steps([1, 1], "reference")) is forward.few
    assert all(picked(steps([1] * n)) is forward.few for n in range(2, FEW_MAX_ROWS + 1))
    assert picked(steps([1] * (FEW_MAX_ROWS + 1))) is None
    assert picked(steps([1, 2])) is None  # a request of two rows among them
    assert picked(steps([1, 1], kv_scales=scales)) is None  # a quantized pool
    forward.float_rows = 3  # (a model with float copies: 3 rows take their graph)
    assert picked(steps([1, 1])) is forward.few and picked(steps([1, 1, 1])) is None
    forward.float_rows = None
    forward.lora_batch = LoRABatch()
    forward.lora_batch.active = True  # an adapter row
    assert picked(step(1, [3, 4])) is None and picked(steps([1, 1])) is None
    forward.lora_batch.active = False
    for layout in (step(1, [3, 4]), steps([1, 1])):
        layout.timer = object()
        assert picked(layout) is None


def test_compiling_applies_only_where_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    # moe: the model config's mixture-of-experts layers, as a mixture's checkpoint declares them
    dense = any(read_model_config(tiny_checkpoint("llama"))[0].moe_layers)
    moe = any(read_model_config(make_mixtral(tmp_path / "mixtral"))[0].moe_layers)
    assert not dense and moe
    assert why_not_compiled("auto", cpu, "reference", 1, dense) is None
    assert why_not_compiled("auto", cpu, "batched", 1, dense) is None
    assert why_not_compiled("off", cpu, "reference", 1, dense) == "torch_compile is off"
    assert "not a CPU" in why_not_compiled("auto", torch.device("cuda"), "reference", 1, dense)
    assert "attention_backend is flex" in why_not_compiled("auto", cpu, "flex", 1, dense)
    assert "several ranks" in why_not_compiled("auto", cpu, "reference", 2, dense)
    assert "mixture-of-experts" in why_not_compiled("auto", cpu, "reference", 1, moe)
    with pytest.raises(ValueError, match="torch_compile must be one of auto, off, got 'on'"):
        EngineConfig(torch_compile="on")
    assert EngineConfig.from_parameters({"torch_compile": "off"}).torch_compile == "off"
    # $ORCA_TORCH_COMPILE is what auto means (the suite sets off); an explicit value wins.
    assert EngineConfig().effective_torch_compile == "off"
    monkeypatch.delenv("ORCA_TORCH_COMPILE")
    assert EngineConfig().effective_torch_compile == "auto"
    monkeypatch.setenv("ORCA_TORCH_COMPILE", "off")
    assert EngineConfig(torch_compile="off").effective_torch_compile == "off"
    monkeypatch.setenv("ORCA_TORCH_COMPILE", "always")
    with pytest.raises(ValueError, match=r"\$ORCA_TORCH_COMPILE must be one of auto, off, got 'always'"):
        EngineConfig().effective_torch_compile  # noqa: B018 - the property raises
    # A pool too small for the warm-up's three slots runs eagerly and says why (before compiling anything).
    monkeypatch.delenv("ORCA_TORCH_COMPILE")
    worker = Worker(EngineConfig(model=str(tiny_checkpoint("gpt2")), block_size=2, n_slots=2))
    assert worker.no_compile_reason is None
    worker.init_kv_pool(1)
    assert cpu_graphs(worker) is None and "fewer than the 3 slots" in worker.no_compile_reason


def test_the_attention_op_needs_an_iteration_in_scope() -> None:
    q, kv = torch.zeros(1, 2, 4), torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="outside iteration_scope"):
        torch.ops.orca.selective_attention(q, kv, 0, 0.5, None)
    pool = torch.zeros(1, 2, 1, 4, 4)
    meta = AttentionMetadata.build([1], [0], [[0]], 4, pool)
    with iteration_scope(meta):
        out = torch.ops.orca.selective_attention(q, kv, 0, 0.5, None)
    assert out.shape == (1, 8)


def _generate_in_a_subprocess(tmp_path: Path, quantization: str = "none", **env: str) -> tuple[str, str]:
    """A tiny GPT-2 engine with torch_compile auto in a fresh interpreter with `env` added, which must
    generate transformers' greedy tokens (quantization none; int8: tokens, its head's int kernel eager
    when the forward pass is): (why the forward pass is eager or None, stderr). A fresh process reuses
    nothing this one compiled."""
    script = tmp_path / "generate.py"
    script.write_text(
        "from orca import SamplingParams\n"
        "from orca.frontend.llm import LLM\n"
        f"llm = LLM({str(tiny_checkpoint('gpt2'))!r}, block_size=4, n_slots=64, quantization={quantization!r})\n"
        "from orca.worker.cpu_graphs import CPUGraphs\n"
        "worker = llm.engine.executor.worker\n"
        "print('REASON', worker.no_compile_reason)\n"
        "head = worker.model.lm_head\n"
        "compiled_head = isinstance(worker.runner, CPUGraphs) and worker.runner.head is not None\n"
        "assert ('matmul' in vars(head)) == compiled_head\n"
        "out = llm.generate([[5, 17, 33, 2]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))\n"
        "print('TOKENS', out[0].token_ids)\n"
    )
    full_env = {k: v for k, v in os.environ.items() if k != "ORCA_TORCH_COMPILE"}
    done = subprocess.run([sys.executable, str(script)], env={**full_env, **env}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    if quantization == "none":
        assert lines["TOKENS"] == str(hf_greedy(tiny_reference("gpt2"), [5, 17, 33, 2], 6))
    else:
        assert len(json.loads(lines["TOKENS"])) == 6
    return lines["REASON"], done.stderr


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_without_a_cxx_compiler_the_engine_serves_eagerly_and_says_why(tmp_path: Path, quantization: str) -> None:
    """Inductor's C++ compiler missing (CXX pointing nowhere, its caches off): the worker logs why and
    runs the eager forward pass; the engine still generates transformers' tokens. With an int8 head, its
    compiled graph is dropped too: the head runs torch's kernel."""
    reason, stderr = _generate_in_a_subprocess(
        tmp_path, quantization, CXX=str(tmp_path / "no-such-g++"), TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    assert reason.startswith("compiling failed"), reason
    assert "the forward pass runs eagerly: compiling failed" in stderr


def test_compiling_works_in_the_c_locale(tmp_path: Path) -> None:
    """Triton's stub embeds Python in the C locale without UTF-8 mode: open()'s default encoding is ASCII,
    and inductor reads its own UTF-8 templates with it. The same here (no C-locale coercion, no UTF-8
    mode): the worker switches the text encoding to UTF-8 and compiles."""
    reason, _ = _generate_in_a_subprocess(tmp_path, LC_ALL="C", LANG="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    assert reason == "None"


def test_models_of_one_class_in_one_process_keep_their_own_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo keeps the graphs of a class's forward together, for every model of it in the process. With
    the guards as shipped (the later layers' tensor guards dropped, only telling guards run after load),
    engines of one checkpoint in float32, int8 and (where oneDNN packs it) bfloat16 int8, alive together and
    stepped in turn, each still runs its own graph: each gives its eager twin's tokens."""
    monkeypatch.delenv("ORCA_TORCH_COMPILE")
    variants = [dict(dtype="float32"), dict(dtype="float32", quantization="int8")]
    if onednn_packs(torch.bfloat16):
        variants.append(dict(dtype="bfloat16", quantization="int8"))
    path = str(tiny_checkpoint("llama"))
    engines = [LLMEngine(EngineConfig(model=path, max_bs=2, **v)) for v in variants]
    runners = [cpu_graphs(e.executor.worker) for e in engines]
    assert all(r is not None and not r.all_guards for r in runners)
    prompts = [[5, 17, 33, 2, 9], [40, 41]]
    for i, engine in enumerate(engines):
        for j, prompt in enumerate(prompts):
            engine.add_request(f"{i}-{j}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while any(e.has_unfinished() for e in engines):
        for engine in engines:  # in turn: each call may meet the others' graphs first
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    monkeypatch.setenv("ORCA_TORCH_COMPILE", "off")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, v in enumerate(variants):
        want = [o.token_ids for o in LLM(path, max_bs=2, **v).generate(prompts, greedy)]
        assert [tokens[f"{i}-{j}"] for j in range(len(prompts))] == want, v


# -- the LM head's compiled graph (CompiledHead) -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_head_is_compiled_in_a_graph_of_its_own_with_the_eager_numbers(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized model's int8 LM head runs a graph of its own, compiled at load, installed as the layer's
    matmul; its logits are the eager kernel's up to the bfloat16 rounding of the kernel's output (a
    float32 model's head computes in bfloat16, its output rounded so as eagerly), at any row count below the
    float copy's, with no compilation after load."""
    monkeypatch.delenv("ORCA_TORCH_COMPILE")
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), max_bs=4, quantization="int8",
                                    dtype=str(dtype).removeprefix("torch.")))
    worker = engine.executor.worker
    head = worker.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.kind == "int8"
    assert isinstance(cpu_graphs(worker).head, CompiledHead) and cpu_graphs(worker).head.ready
    assert head.matmul is cpu_graphs(worker).head
    float_rows = cpu_graphs(worker).head.float_rows
    if head.float_packed is not None:  # hybrid: its rows up to the template's pass of 4, or its dtype's more
        assert float_rows == max(HYBRID_QUANTIZED_MIN_ROWS[dtype]["int8"], COMPILED_HEAD_FLOAT_ROWS)
    cpu_graphs(worker).stance, cpu_graphs(worker).all_guards = "fail_on_recompile", True
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in range(1, (float_rows if head.float_packed is not None else 8)):
            x = torch.randn(rows, head.in_features, dtype=dtype)
            got, want = head(x).float(), head.quantized_matmul(x).float()
            step = want.abs().amax().bfloat16().float() * 2.0**-7  # bfloat16's step at the largest logit
            torch.testing.assert_close(got, want, atol=step.item(), rtol=0)
            assert torch.equal(got, got.bfloat16().float())  # rounded to bfloat16 as eagerly, then float32
    # a float32 model without the quantized head has none (nothing to compile)
    plain = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), max_bs=4))
    assert cpu_graphs(plain.executor.worker).head is None


def test_int8_heads_of_the_same_shapes_each_run_their_own_weights() -> None:
    """Two compiled heads of one shape, different weights, alive together and called in turn with the
    guards as shipped: each gives its own logits. Their weights are constants inside their graphs, so
    inductor's graph cache (keyed by a frozen weight's shape, not its values) may not hand one head's
    graph to the other."""
    torch.manual_seed(0)
    heads = [QuantizedLinear(quantize(torch.randn(512, 64), "int8"), None, torch.device("cpu"), torch.bfloat16)
             for _ in range(2)]
    compiled = []
    with torch.inference_mode():
        for head in heads:
            model = torch.nn.Module()
            model.lm_head = head
            forward = CPUGraphs(model)
            forward.head(torch.randn(1, 64, dtype=torch.bfloat16))  # its warm-up: compiles
            forward.ready = True
            compiled.append(forward)
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        for _ in range(2):
            for head in heads:
                torch.testing.assert_close(head(x).float(), head.quantized_matmul(x).float(), atol=0.07, rtol=0)


def test_a_warm_up_that_never_reaches_the_head_leaves_it_eager() -> None:
    """compile() fails when the warm-up never ran the head (its graph would compile inside a request), and
    a failed compile uninstalls the head's graph: the worker then serves eagerly, head included."""
    head = QuantizedLinear(quantize(torch.randn(64, 32), "int8"), None, torch.device("cpu"), torch.bfloat16)
    model = torch.nn.Module()
    model.lm_head = head
    forward = CPUGraphs(model)
    assert head.matmul is forward.head
    with pytest.raises(RuntimeError, match="never reached the LM head"):
        forward.compile(lambda: None, torch.device("cpu"))
    assert "matmul" not in vars(head) and not forward.ready
