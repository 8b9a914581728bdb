"""Parallel sampling: a request with SamplingParams.n > 1 served as n engine requests (vLLM's ParentRequest).

Each child gets its own id (child_request_id) and sampling (child_params: n = 1, seed + i when the parent
has a seed, so each is reproducible and they differ); ParentRequest merges the children's latest outputs in
child order. Used by orca_gpt's Triton model (vllm_backend's n-element layout).
"""

from __future__ import annotations

from dataclasses import replace

from orca.frontend.output_processor import RequestOutput
from orca.sampling_params import MAX_INT64, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}.{index}"


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The n children's sampling: n = 1 each; with a seed, child i draws with seed + i (wrapping within the
    seed's range)."""
    return [
        replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % (MAX_INT64 + 1))
        for i in range(params.n)
    ]


class ParentRequest:
    """The n children of one request: each one's latest output, which of them finished."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.child_ids = [child_request_id(request_id, i) for i in range(n)]
        self.latest: list[RequestOutput | None] = [None] * n
        self._index = {child: i for i, child in enumerate(self.child_ids)}

    @property
    def n(self) -> int:
        return len(self.child_ids)

    def index(self, child_id: str) -> int:
        return self._index[child_id]

    def update(self, out: RequestOutput) -> int:
        """Records a child's output; returns its index."""
        i = self._index[out.request_id]
        self.latest[i] = out
        return i

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self.latest)

    def unfinished_children(self) -> list[str]:
        return [child for child, out in zip(self.child_ids, self.latest) if out is None or not out.finished]
