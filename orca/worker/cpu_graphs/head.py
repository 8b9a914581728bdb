"""An int8 LM head's matmul as a compiled graph of its own: the weight frozen in, so that inductor's
weight-only GEMM template packs it, chosen against torch's kernel by max_autotune at load
(docs/BENCHMARKS.md, "Results: the LM head's compiled graph (2026-11-27, midday)"). The head runs after the
forward pass, eagerly, on the sampled rows alone: the runner installs this object as its `matmul`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from orca import tuning
from orca.models.quantization import QuantizedLinear
from orca.worker.cpu_graphs.inductor import frozen_compiling

if TYPE_CHECKING:
    from orca.worker.cpu_graphs.runner import CPUGraphs


class CompiledHead:
    """The head's matmul: its float copy from `float_rows` rows (linear_backend hybrid), else the compiled
    int8 kernel (one graph for any row count: unbacked, autotuned at one row)."""

    def __init__(self, head: QuantizedLinear, runner: CPUGraphs) -> None:
        self.layer = head
        self.compiled = torch.compile(_HeadMatmul(head), dynamic=True, fullgraph=True)
        self.runner = runner  # (its stance, guards and weights' fingerprint hold for the head too)
        # From tuning.COMPILED_HEAD_FLOAT_ROWS rows at the least: the compiled int8 kernel wins below.
        self.float_rows = (max(head.float_min_rows, tuning.COMPILED_HEAD_FLOAT_ROWS)
                           if head.float_packed is not None else None)
        self.ready = False

    @classmethod
    def install(cls, model: nn.Module, runner: CPUGraphs) -> CompiledHead | None:
        """The compiled head of `model`, installed as its head's matmul, where the head is an int8 layer."""
        head = getattr(model, "lm_head", None)
        if not isinstance(head, QuantizedLinear) or head.kind != "int8":
            return None
        compiled = cls(head, runner)
        head.__dict__["matmul"] = compiled
        return compiled

    def uninstall(self) -> None:
        self.layer.__dict__.pop("matmul", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_rows is not None and x.shape[0] >= self.float_rows:
            return self.layer.float_matmul(x)
        if not self.ready:  # the warm-up's first sampled row: compiles, in this process
            torch._dynamo.decorators.mark_unbacked(x, 0, hint_override=1)
            with frozen_compiling(self.runner.fingerprint):
                y = self.compiled(x)
            self.ready = True
            return y
        runner = self.runner
        with torch.compiler.set_stance(runner.stance, skip_guard_eval_unsafe=not runner.all_guards):
            return self.compiled(x)


class _HeadMatmul(nn.Module):
    """What CompiledHead compiles: the head's format kernel, the head a submodule (its buffers the graph's
    constants)."""

    def __init__(self, head: QuantizedLinear) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return type(self.head).quantized_matmul(self.head, x)
