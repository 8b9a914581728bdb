"""Where and when LoRA adapter files are read (orca/models/lora.py read_adapter): once, when the adapter is
registered, on the registering thread: the adapters of lora_modules at the engine's construction (model
load), a run-time load (EngineLoop.add_lora, which the Triton model's lora_control goes through) on the
caller's thread while the engine's iterations go on. Never on the engine's thread while it serves, never
inside an iteration, never by a worker: the workers get the host copy read at registration with the next
plan (StepPlan.lora_added), worker processes included, so an adapter's directory may vanish once it is
registered and its requests still get PEFT's tokens."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from _fixtures import tiny_checkpoint
from test_lora import MAX_TOKENS, adapters, peft_greedy, run

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.core.engine import EngineCore
from orca.core.engine_loop import EngineLoop


class Reads:
    """Records the thread of every read of an adapter's weights (safetensors' load_file, which read_adapter
    calls). With `hold_but` set (a thread's id), a read on any other thread waits for `release` (a slow
    disk); `reading` is set once a read has begun."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[int] = []
        self.reading, self.release = threading.Event(), threading.Event()
        self.hold_but: int | None = None
        real = safetensors.torch.load_file

        def load_file(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_ident()
            self.threads.append(me)
            self.reading.set()
            if self.hold_but is not None and me != self.hold_but:
                assert self.release.wait(60), "the test never released the read"
            return real(*args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "load_file", load_file)


class Generator:
    """Requests on an EngineLoop, each waited for on the test's thread."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = {}
        self.errors: dict[str, str | None] = {}
        self.finished: dict[str, threading.Event] = {}
        self.loop: EngineLoop | None = None

    def on_output(self, out: Any) -> None:
        self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            self.errors[out.request_id] = out.error
            self.finished.setdefault(out.request_id, threading.Event()).set()

    def __call__(self, request_id: str, prompt: list[int], lora: str | None) -> list[int]:
        self.finished.setdefault(request_id, threading.Event())
        self.loop.submit(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                            lora_name=lora))
        assert self.finished[request_id].wait(60), request_id
        assert self.errors[request_id] is None, self.errors[request_id]
        return self.outputs[request_id]


def copies(root: str, names: list[str], where: Path) -> dict[str, Path]:
    """Copies of test_lora's llama adapters (the originals stay for PEFT's references)."""
    made = adapters("llama", root)
    return {name: Path(shutil.copytree(made[name], where / name)) for name in names}


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("adapters"))


def test_configured_adapters_are_read_at_load_and_never_in_an_iteration(
        adapter_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [5, 6, 7]
    want = {name: peft_greedy("llama", name, tuple(prompt), adapter_root) for name in ("llama-0", "llama-2")}
    configured = copies(adapter_root, ["llama-0", "llama-2"], tmp_path)
    reads = Reads(monkeypatch)
    generate = Generator()
    config = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", enable_lora=True, max_loras=1,
                          lora_modules=",".join(f"{name}={path}" for name, path in configured.items()))
    loop = generate.loop = EngineLoop(lambda: EngineCore(config), on_output=generate.on_output)
    try:
        # read and checked while the loop's thread built the engine (model load), before it served anything
        assert reads.threads == [loop._thread.ident] * 2
        for path in configured.values():  # from now on a read of their files would fail
            shutil.rmtree(path)
        loop.start()
        # one slot for two adapters: each is put into it twice, from the worker's host copy
        for i in range(2):
            for name in want:
                assert generate(f"{name}-{i}", prompt, name) == want[name]
        assert generate("base", prompt, None) == peft_greedy("llama", None, tuple(prompt), adapter_root)
        assert loop.core.stats().lora_loads == 4
        assert reads.threads == [loop._thread.ident] * 2  # no read since
    finally:
        loop.shutdown()


def test_a_loop_load_reads_on_the_callers_thread_while_iterations_go_on(
        adapter_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # EngineLoop.add_lora itself (any front end's run-time load, not only the Triton model's): the files are
    # read on the caller's thread, held there while requests run, and registered after.
    prompt = [5, 6, 7]
    want = peft_greedy("llama", "llama-1", tuple(prompt), adapter_root)
    late = copies(adapter_root, ["llama-1"], tmp_path)["llama-1"]
    reads = Reads(monkeypatch)
    generate = Generator()
    config = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", enable_lora=True)
    loop = generate.loop = EngineLoop(lambda: EngineCore(config), on_output=generate.on_output)
    result: dict[str, Any] = {}

    def load() -> None:
        try:
            result["lora"] = loop.add_lora("late", str(late))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            result["error"] = exc

    try:
        loop.start()
        reads.hold_but = loop._thread.ident  # (a read on the loop's thread would not wait: the checks below fail)
        loader = threading.Thread(target=load)
        loader.start()
        assert reads.reading.wait(60)
        assert generate("meanwhile", [4, 4, 4, 4], None)  # the engine iterates while the read is held
        assert "late" not in {lora.name for lora in loop.list_loras()} and "lora" not in result
        reads.release.set()
        loader.join(60)
        assert "error" not in result, result.get("error")
        assert reads.threads == [loader.ident]
        shutil.rmtree(late)
        assert generate("with-late", prompt, "late") == want
        assert reads.threads == [loader.ident]
        # refused before any read: a name already served; a bad adapter is refused by its read, on this thread
        with pytest.raises(ValueError, match="'late' is already served"):
            loop.add_lora("late", str(late))
        with pytest.raises(ValueError, match=r"LoRA adapter 'gone' \(.*\): no such directory"):
            loop.add_lora("gone", str(late))
        assert reads.threads == [loader.ident] and [lora.name for lora in loop.list_loras()] == ["late"]
    finally:
        reads.release.set()
        loop.shutdown()


def test_worker_processes_read_no_adapter_file(adapter_root: str, tmp_path: Path) -> None:
    # Tensor parallelism 2 on gloo: the driver reads each adapter once (a configured one at load, one added
    # later) and the worker processes get its host copy with the next plan; both directories are gone
    # before any request runs, one slot makes each adapter go into it again, and every output is PEFT's.
    jobs = [("a0", [5, 6, 7], "configured"), ("b0", [8, 9], "late"), ("base", [4, 4, 4], None),
            ("a1", [3, 1], "configured"), ("b1", [2, 7, 1], "late")]
    source = {"configured": "llama-0", "late": "llama-1", None: None}
    want = {rid: peft_greedy("llama", source[name], tuple(prompt), adapter_root) for rid, prompt, name in jobs}
    made = copies(adapter_root, ["llama-0", "llama-1"], tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", enable_lora=True,
                                    max_loras=1, max_bs=2, tensor_parallel_size=2,
                                    lora_modules=f"configured={made['llama-0']}"))
    try:
        engine.core.add_lora("late", str(made["llama-1"]))
        for path in made.values():
            shutil.rmtree(path)
        assert run(engine, jobs) == want
        assert engine.core.stats().lora_loads >= 3  # the one slot took each adapter, and one of them again
        assert engine.core._lora_added == []  # handed over: the driver keeps no host copy
    finally:
        engine.shutdown()
