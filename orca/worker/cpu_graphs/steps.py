"""Decode steps as compiled graphs of their own, attention inside them (decode_attention.py): the graph of
every token count calls attention as an opaque op, whose write, Python and SDPA call cost more than
these loops at a few rows (docs/BENCHMARKS.md, "Results: a single stream's step in a graph of its own",
"Results: decode steps of a few requests in a graph of their own").

Three such graphs, each built by a factory below: a lone request's decode step (one row, the graph
specialised to it), a lone request's verification of its proposed tokens (2 to tuning.VERIFYING_MAX_ROWS
rows, unbacked), and a decode step of 2 to tuning.FEW_MAX_ROWS requests. Their inputs are the pool, as
blocks, and block tables (unbacked: one graph for any context); the step's keys and values come back
beside the hidden rows and are written after the graph.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from orca.worker.cpu_graphs.decode_attention import FewDecode, LoneDecode, StepInputs
from orca.worker.cpu_graphs.inductor import GRAPH_OPTIONS, frozen_compiling, guards_to_keep


class GraphStep:
    """One decode step's graph: `module(input_ids, positions, blocks, *tables) -> (hidden, written)`.
    `unbacked_rows`: any row count (else the warm-up's, one); `frozen`: compiled with the weights frozen in
    (FROZEN_OPTIONS: int8 layers, for inductor's int8 template)."""

    def __init__(self, module: nn.Module, unbacked_rows: bool, frozen: bool) -> None:
        self.compiled = torch.compile(module, dynamic=False, options={"guard_filter_fn": guards_to_keep})
        self.unbacked_rows, self.frozen = unbacked_rows, frozen
        self.ready = False
        self.steps = 0  # iterations it ran (the tests read it)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor, block_size: int,
                 inputs: StepInputs, stance: str, all_guards: bool, fingerprint: str) -> torch.Tensor:
        """(T, E): the model's hidden rows; writes the step's keys and values into `kv_pool`."""
        self.steps += 1
        blocks = kv_pool.unflatten(3, (-1, block_size))  # (layers, 2, KVH, blocks, block size, D)
        if not self.ready:  # the warm-up's iteration: compiles, in this process
            import torch._inductor.config as inductor_config

            for table in inputs.tables:  # any number of cached blocks (and of requests): one graph
                for dim in range(table.dim()):
                    torch._dynamo.decorators.mark_unbacked(table, dim)
            if self.unbacked_rows:
                torch._dynamo.decorators.mark_unbacked(input_ids, 0)
                torch._dynamo.decorators.mark_unbacked(positions, 0)
            with frozen_compiling(fingerprint) if self.frozen else inductor_config.patch(**GRAPH_OPTIONS):
                hidden, written = self.compiled(input_ids, positions, blocks, *inputs.tables)
            self.ready = True
        else:
            with torch.compiler.set_stance(stance, skip_guard_eval_unsafe=not all_guards):
                hidden, written = self.compiled(input_ids, positions, blocks, *inputs.tables)
        kv_pool.index_copy_(3, inputs.slot_mapping, written.permute(0, 2, 3, 1, 4))  # (layers, T, 2, KVH, D)
        return hidden


class _LoneModel(nn.Module):
    """The model over one request's rows, attention reading its cached keys and values through `table`;
    returns the hidden rows and the step's keys and values, (layers, T, 2, KVH, D)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lone = LoneDecode(blocks, table, positions[0])
        hidden = self.model(input_ids, positions, lone)
        return hidden, torch.stack(lone.written)


class _LoneRowsModel(_LoneModel):
    """The same for a verification's rows, its forward a code object of its own: dynamo keeps graphs by
    code object, so the one-row graph and the graph of an unbacked row count each stay the only graph of
    theirs (which skip_guard_eval_unsafe then calls unchecked)."""


_LoneRowsModel.forward = types.FunctionType(  # type: ignore[method-assign]
    _LoneModel.forward.__code__.replace(co_name="forward_rows"), _LoneModel.forward.__globals__, "forward")


class _FewModel(nn.Module):
    """The model over one row per request, attention reading each request's cached keys and values through
    its row of `tables`; returns the hidden rows and the step's keys and values."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                tables: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        few = FewDecode(blocks, tables, past)
        hidden = self.model(input_ids, positions, few)
        return hidden, torch.stack(few.written)


def lone_step(view: nn.Module, frozen: bool) -> GraphStep:
    """A lone request's decode step, one row."""
    return GraphStep(_LoneModel(view), unbacked_rows=False, frozen=frozen)


def lone_rows_step(view: nn.Module, frozen: bool) -> GraphStep:
    """A lone request's verification, 2 to tuning.VERIFYING_MAX_ROWS rows."""
    return GraphStep(_LoneRowsModel(view), unbacked_rows=True, frozen=frozen)


def few_step(view: nn.Module) -> GraphStep:
    """A decode step of 2 to tuning.FEW_MAX_ROWS requests (not frozen: inductor's int8 template was measured
    at one row only)."""
    return GraphStep(_FewModel(view), unbacked_rows=True, frozen=False)
