"""Run-time LoRA loads (orca_triton/lora.py: the lora_control input's load, orca-openai's /v1/load_lora_adapter)
read only from inside the model's lora_root, refuse everything else with one and the same answer (no oracle of
which directories exist: the reason is in the log), and read the adapter's files on the caller's thread, so a
slow disk holds up the load and never the engine's iterations. Adapters of lora_modules are not confined."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from _fixtures import tiny_checkpoint
from checkpoints import make_lora_adapter
from test_lora import MAX_TOKENS, adapters, peft_greedy

from orca import EngineConfig, SamplingParams
from orca.core.engine import EngineCore
from orca.core.engine_loop import EngineLoop
from orca.models.lora import LoRAError
from orca_triton.lora import ControlRequest, check_control, confine_lora_path, load_at_run_time


def refusal(name: str, path: str) -> str:
    return f"LoRA adapter {name!r}: lora_path {path!r} is not an adapter directory under lora_root"


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """lora_root with test_lora's llama adapters in it (llama-0, llama-1, llama-2) and things that are not
    adapters; beside it, outside, an adapter of its own."""
    base = tmp_path_factory.mktemp("lora-root")
    root = base / "root"
    root.mkdir()
    adapters("llama", str(root))  # root/llama-0 ... root/llama-2
    outside = make_lora_adapter(tiny_checkpoint("llama"), base / "outside", 7, 4, ["q_proj"])
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not a directory")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "alias").symlink_to(root / "llama-0", target_is_directory=True)  # a symlink inside the root
    half = root / "half"  # its config here, its weights a symlink to the adapter outside
    half.mkdir()
    (half / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    (half / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    fifo = root / "fifo"  # a FIFO as its config: a read would wait forever
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")
    (fifo / "adapter_model.safetensors").write_bytes((outside / "adapter_model.safetensors").read_bytes())
    return {"base": base, "root": root, "outside": outside}


def test_every_path_but_an_adapter_inside_the_root_gets_the_same_answer(layout: dict[str, Path],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    root, outside = layout["root"], layout["outside"]
    refused = {
        "outside": str(outside),  # an adapter, but outside
        "dot-dot": f"{root}/../outside",  # `..` out of the root
        "relative dot-dot": "../outside",
        "symlink": str(root / "escape"),  # a symlink inside the root to a directory outside
        "file symlink": str(root / "half"),  # its weights a symlink out of the root
        "missing inside": str(root / "nowhere"),
        "missing outside": "/nonexistent/adapters/x",
        "not an adapter": str(root / "empty"),
        "a file": str(root / "file.txt"),
        "a FIFO config": str(root / "fifo"),
        "the root itself": str(root),  # a directory, but no adapter
        "a NUL byte": "llama-0\x00",
    }
    caplog.set_level(logging.WARNING, logger="orca_gpt")
    for case, path in refused.items():
        with pytest.raises(ValueError) as info:
            confine_lora_path("x", path, str(root))
        assert str(info.value) == refusal("x", path), case
    # the reasons are in the server's log, one per refusal, and tell the cases apart
    reasons = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(reasons) == len(refused)
    assert sum("outside lora_root" in r for r in reasons) == 6  # the nonexistent /nonexistent too
    assert any("has no adapter_config.json (a regular file)" in r and "fifo" in r for r in reasons)
    # inside the root: absolute, relative, through `..` that stays inside, through a symlink inside
    want = str((root / "llama-0").resolve())
    for path in (str(root / "llama-0"), "llama-0", "empty/../llama-0", str(root / "alias")):
        assert confine_lora_path("x", path, str(root)) == want, path
    # a lora_root that does not exist refuses everything the same way
    with pytest.raises(ValueError, match="is not an adapter directory under lora_root"):
        confine_lora_path("x", "llama-0", str(layout["base"] / "no-root"))


def test_run_time_loads_need_lora_root(tmp_path: Path) -> None:
    updating = {"enable_lora": True, "allow_runtime_lora_updating": True}
    with pytest.raises(ValueError, match="m loads no LoRA adapters at run time without lora_root: set its parameter "
                                         "lora_root to the directory they may be loaded from"):
        check_control(ControlRequest("load", "x", "/x"), EngineConfig(**updating), "m")
    check_control(ControlRequest("unload", "x"), EngineConfig(**updating), "m")  # unloading needs no root
    check_control(ControlRequest("load", "x", "/x"), EngineConfig(**updating, lora_root=str(tmp_path)), "m")
    with pytest.raises(ValueError, match="lora_root must be an absolute directory path or empty"):
        EngineConfig(lora_root="adapters")
    assert EngineConfig.from_parameters({"lora_root": str(tmp_path)}).lora_root == str(tmp_path)
    assert EngineConfig.from_parameters({"lora_root": ""}).lora_root is None
    assert EngineConfig(lora_root=tmp_path).lora_root == str(tmp_path)


class SlowDisk:
    """safetensors' load_file (what reads an adapter's weights) held at its start until `release` is set,
    recording the thread of every read: a slow disk, on whatever thread reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reading, self.release = threading.Event(), threading.Event()
        self.threads: list[int] = []
        real = safetensors.torch.load_file

        def load_file(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.get_ident())
            self.reading.set()
            assert self.release.wait(60), "the test never released the read"
            return real(*args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "load_file", load_file)


def test_a_run_time_load_reads_its_files_off_the_engine_thread(layout: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = layout["root"], layout["outside"]
    outputs: dict[str, list[int]] = {}
    finished: dict[str, threading.Event] = {}

    def on_output(out: Any) -> None:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            assert out.error is None, out.error
            finished.setdefault(out.request_id, threading.Event()).set()

    def generate(request_id: str, prompt: list[int], lora: str | None) -> list[int]:
        finished.setdefault(request_id, threading.Event())
        loop.submit(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                       lora_name=lora))
        assert finished[request_id].wait(60), request_id
        return outputs[request_id]

    # the operator's own adapter lies outside lora_root: configured, it is not confined. max_lora_rank 4:
    # llama-0 (rank 4) and llama-2 (rank 2) can be served, llama-1 (rank 8) cannot.
    config = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", torch_compile="off",
                          enable_lora=True, max_lora_rank=4, allow_runtime_lora_updating=True, lora_root=str(root),
                          lora_modules=f"configured={outside}")
    loop = EngineLoop(lambda: EngineCore(config), on_output=on_output)
    try:
        loop.start()
        assert len(generate("configured", [3, 4, 5], "configured")) == MAX_TOKENS
        with pytest.raises(ValueError) as info:  # ... but loading it at run time is refused, as any path outside
            load_at_run_time(loop, ControlRequest("load", "again", str(outside)))
        assert str(info.value) == refusal("again", str(outside))

        disk = SlowDisk(monkeypatch)
        result: dict[str, Any] = {}

        def load() -> None:
            try:
                result["lora"] = load_at_run_time(loop, ControlRequest("load", "late", "llama-0"))
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                result["error"] = exc

        loader = threading.Thread(target=load)
        loader.start()
        assert disk.reading.wait(60)
        # the load's read is held up on its own thread: the engine's iterations go on meanwhile
        assert len(generate("meanwhile", [5, 6, 7, 8], None)) == MAX_TOKENS
        assert "late" not in {lora.name for lora in loop.list_loras()}
        disk.release.set()
        loader.join(60)
        assert "error" not in result, result.get("error")
        assert result["lora"].name == "late" and result["lora"].path == str((root / "llama-0").resolve())
        # it serves PEFT's tokens, and the engine read its files never: not to check it, not to put it in a slot
        prompt = [5, 6, 7]
        assert generate("with-late", prompt, "late") == peft_greedy("llama", "llama-0", tuple(prompt), str(root))
        assert disk.threads == [loader.ident]
        # a name already served is refused before any read
        with pytest.raises(ValueError, match="'late' is already served"):
            load_at_run_time(loop, ControlRequest("load", "late", "llama-2"))
        assert disk.threads == [loader.ident]
        # inside the root, an adapter the model cannot serve is refused naming it and the reason
        with pytest.raises(LoRAError, match=r"LoRA adapter 'wide' .* has rank 8, above max_lora_rank 4"):
            load_at_run_time(loop, ControlRequest("load", "wide", "llama-1"))
        me = threading.get_ident()
        assert disk.threads == [loader.ident, me]
        assert {lora.name for lora in loop.list_loras()} == {"configured", "late"}
        # unloaded, and another adapter loaded under its name: read afresh (on this thread), and served
        assert loop.remove_lora("late")
        load_at_run_time(loop, ControlRequest("load", "late", "empty/../llama-2"))
        assert disk.threads == [loader.ident, me, me]
        assert generate("late-2", prompt, "late") == peft_greedy("llama", "llama-2", tuple(prompt), str(root))
        assert disk.threads == [loader.ident, me, me]
    finally:
        loop.shutdown()
