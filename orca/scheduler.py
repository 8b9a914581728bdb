"""Orca's iteration-level scheduler: Algorithm 1 of the paper (see shared ORCA.md), exactly.

The scheduler decides and the engine executes: ``schedule()`` returns the next batch (a plan), the engine
runs one iteration of the model on it, and ``complete()`` takes the batch back. Up to n_workers batches may
be in flight at once, one per pipeline stage; a request is in at most one of them (a RUNNING request is
never selected again until its batch returns). Plain Python: no tensors here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from orca.kv_cache import KVSlotManager
from orca.request import FinishReason, Phase, Request


@dataclass
class ScheduledBatch:
    """One iteration's plan. ``admitted`` are the members scheduled for the first time, whose K/V
    reservation was made by this selection: the engine allocates their buffers before running."""

    batch_id: int
    requests: list[Request]
    admitted: list[Request] = field(default_factory=list)


class OrcaScheduler:
    """FCFS at iteration granularity with up-front K/V slot reservation.

    - At most max_bs requests per iteration.
    - A request is admitted (its max_tokens slots reserved) the first time it is selected; if that would
      exceed n_slots, selection stops (``break``, not ``continue``): a later, smaller request never jumps
      ahead of an earlier one that is waiting for memory.
    - Requests join at any iteration and leave at the iteration they finish.
    """

    def __init__(self, max_bs: int, slots: KVSlotManager, n_workers: int = 1) -> None:
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
            raise ValueError(f"max_bs must be an integer >= 1, got {max_bs!r}")
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be an integer >= 1, got {n_workers!r}")
        self.max_bs = max_bs
        self.n_workers = n_workers
        self.slots = slots
        # The request pool, in arrival order (insertion order of the dict = arrival order).
        self._pool: OrderedDict[str, Request] = OrderedDict()
        self._in_flight: deque[ScheduledBatch] = deque()
        self._next_batch_id = 0

    # -- queries ---------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pool

    def request_ids(self) -> list[str]:
        return list(self._pool)

    def has_unfinished(self) -> bool:
        return bool(self._pool)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_running(self) -> int:
        """Admitted requests: those holding a K/V reservation."""
        return sum(1 for r in self._pool.values() if r.reserved)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted."""
        return sum(1 for r in self._pool.values() if not r.reserved)

    def can_schedule(self) -> bool:
        return len(self._in_flight) < self.n_workers

    # -- events ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self._pool:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self._pool and request.arrival <= next(reversed(self._pool.values())).arrival:
            raise ValueError("requests must be added in arrival order")
        self._pool[request.request_id] = request

    def schedule(self) -> ScheduledBatch | None:
        """select() of Algorithm 1. Returns None when nothing can run (no candidates, memory full, or
        n_workers batches already in flight)."""
        if not self.can_schedule():
            return None
        batch: list[Request] = []
        admitted: list[Request] = []
        for req in self._pool.values():
            if req.running:
                continue
            if len(batch) == self.max_bs:
                break
            if req.phase is Phase.INITIATION and not req.reserved:
                if not self.slots.can_reserve(req):
                    break  # no queue jumping: later requests wait behind this one
                self.slots.reserve(req)
                admitted.append(req)
            batch.append(req)
        if not batch:
            return None
        for req in batch:
            req.running = True
        scheduled = ScheduledBatch(self._next_batch_id, batch, admitted)
        self._next_batch_id += 1
        self._in_flight.append(scheduled)
        return scheduled

    def complete(self, batch: ScheduledBatch) -> list[Request]:
        """A scheduled batch returned. The engine has already appended each member's new token and set
        finish_reason on those that finished. Frees finished requests' slots; returns them."""
        if not self._in_flight or self._in_flight[0] is not batch:
            raise RuntimeError("batches must complete in the order they were scheduled")
        self._in_flight.popleft()
        finished: list[Request] = []
        for req in batch.requests:
            req.running = False
            req.phase = Phase.INCREMENT
            if req.aborted and not req.finished:
                req.finish_reason = FinishReason.CANCELLED
            if req.finished:
                self._remove(req)
                finished.append(req)
        return finished

    def abort(self, request_id: str) -> Request | None:
        """Aborts a request. Returns it, finished as cancelled, if it was not in flight; a request in
        flight is only marked, and leaves (with its slots) when its batch completes."""
        req = self._pool.get(request_id)
        if req is None:
            return None
        if req.running:
            req.aborted = True
            return None
        req.finish_reason = FinishReason.CANCELLED
        self._remove(req)
        return req

    def _remove(self, req: Request) -> None:
        del self._pool[req.request_id]
        self.slots.release(req)
