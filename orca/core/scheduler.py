"""Orca's iteration-level scheduler (Algorithm 1) over a paged K/V block pool.

``schedule()`` returns the next batch and ``complete()`` takes it back; up to n_workers batches are in
flight, a request in at most one. Each iteration selects, FCFS: increments, then prompt work within the
token budget (chunked prefill), then speculative proposals with what is left. Admission stops at the first
request that does not fit (``break``: no queue jumping), except one waiting for a LoRA slot, which is passed
over. The policies (``reserve``, ``on_demand``), prefix caching and chunking are in docs/design.md
("Iteration-level scheduling", "The K/V manager", "Prefix caching", "Chunked prefill"). Plain Python.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from orca.config import KV_ADMISSION_POLICIES
from orca.core.block_manager import BlockManager, hash_block, root_hash
from orca.core.lora import LoRARequest, LoRASlots
from orca.core.request import FinishReason, Request


@dataclass
class ScheduledRequest:
    """One member of a batch: feed ``num_tokens`` tokens from position ``start``; ``new_blocks`` are the
    blocks its table gained in this selection; ``sample`` when the chunk ends at its last known token, so
    the iteration draws its next token."""

    request: Request
    num_tokens: int
    start: int
    new_blocks: list[int]
    sample: bool
    increment: bool  # Orca's increment phase (one token after a computed prefix)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals fed after its last token
    num_rejected: int = 0  # of them, rejected (set by the engine before complete()): their slots are not computed


@dataclass
class ScheduledBatch:
    """One iteration's selection. ``admitted`` joined this iteration (first time, or again after a
    preemption); ``preempted`` lost their blocks in this selection and went back to waiting."""

    batch_id: int
    members: list[ScheduledRequest]
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)  # (slot, adapter) to put in first

    @property
    def requests(self) -> list[Request]:
        return [m.request for m in self.members]

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.members)


class OrcaScheduler:
    def __init__(
        self,
        max_bs: int,
        blocks: BlockManager,
        n_workers: int = 1,
        kv_admission: str = "reserve",
        max_num_batched_tokens: int | None = None,
        spec_disable_batch_size: int | None = None,
        loras: LoRASlots | None = None,
    ) -> None:
        for name, value in (("max_bs", max_bs), ("n_workers", n_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if kv_admission not in KV_ADMISSION_POLICIES:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSION_POLICIES)}, got {kv_admission!r}")
        if max_num_batched_tokens is not None and (
            isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int)
            or max_num_batched_tokens < 1
        ):
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1 or None, got {max_num_batched_tokens!r}")
        self.max_bs = max_bs
        self.n_workers = n_workers
        self.blocks = blocks
        self.kv_admission = kv_admission
        self.max_num_batched_tokens = max_num_batched_tokens
        self.spec_disable_batch_size = spec_disable_batch_size  # EngineConfig.speculative_disable_by_batch_size
        self.loras = loras  # the workers' LoRA slots (orca/core/lora.py); None = LoRA off
        # The request pool, in arrival order.
        self._pool: OrderedDict[str, Request] = OrderedDict()
        self._in_flight: deque[ScheduledBatch] = deque()
        self._next_batch_id = 0
        self.num_preemptions = 0  # cumulative
        self.prefix_cache_queries = 0  # cumulative: tokens of the requests looked up at admission
        self.prefix_cache_hits = 0  # ... and of them, found in the prefix cache

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
        """Admitted requests: those holding K/V blocks."""
        return sum(1 for r in self._pool.values() if r.admitted)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted (new, or preempted)."""
        return sum(1 for r in self._pool.values() if not r.admitted)

    @property
    def kv_used_tokens(self) -> int:
        """Tokens whose keys and values the pool holds for the admitted requests (a block shared through
        the prefix cache counted once)."""
        held = sum(r.num_computed_tokens for r in self._pool.values() if r.admitted)
        return held - self.blocks.num_shared_references * self.blocks.block_size

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
        batch = ScheduledBatch(self._next_batch_id, [])
        budget = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else float("inf")
        chosen: set[str] = set()
        candidates = [r for r in self._pool.values() if not r.running]
        # 1. Increments: one token each.
        for req in candidates:
            if not req.in_increment:  # (also skips those preempted earlier in this pass)
                continue
            if len(batch.members) == self.max_bs or budget < 1:
                break
            new_blocks = self._grow(req, req.num_computed_tokens + 1, batch, chosen)
            if new_blocks is None:
                break  # memory is full for this request and everything later: stop selecting
            batch.members.append(ScheduledRequest(req, 1, req.num_computed_tokens, new_blocks, True, True))
            chosen.add(req.request_id)
            budget -= 1
        budget = self._select_prompt_work(batch, candidates, chosen, budget)
        # 3. Proposed tokens (speculative decoding) with what is left, unless the batch is too large to gain.
        if self.spec_disable_batch_size is None or len(batch.members) < self.spec_disable_batch_size:
            for m in batch.members:
                if m.increment and m.request.spec_token_ids and budget >= 1:
                    budget -= self._add_proposals(m, int(min(len(m.request.spec_token_ids), budget)))
        return self._launch(batch)

    def _add_proposals(self, m: ScheduledRequest, most: int) -> int:
        """Extends an increment with up to `most` of its request's proposals, as many as free blocks hold
        (no preemption); returns how many."""
        req = m.request
        end = m.start + 1
        fits = (self.blocks.num_held(req.request_id) + self.blocks.num_free_blocks) * self.blocks.block_size - end
        k = max(0, min(most, fits))
        if k:
            m.new_blocks += self.blocks.grow(req.request_id, end + k)
            m.spec_token_ids = req.spec_token_ids[:k]
            m.num_tokens = 1 + k
        return k

    def _select_prompt_work(self, batch: ScheduledBatch, candidates: list[Request], chosen: set[str],
                            budget: float) -> float:
        """Prompt work: admitted requests still in their prompt, then waiting ones (admitted here); returns
        what is left of the budget. Admitted work goes first: a waiting request must not deadlock the pool."""
        for admitted_pass in (True, False):
            for req in candidates:
                if req.request_id in chosen or req.in_increment or req.admitted != admitted_pass:
                    continue
                if len(batch.members) == self.max_bs or budget < 1 or req in batch.preempted:
                    return budget  # (a request preempted in this selection waits, and all after it)
                n = int(min(req.num_uncomputed_tokens, budget))
                start = req.num_computed_tokens
                if req.admitted:
                    new_blocks = self._grow(req, start + n, batch, chosen)
                    if new_blocks is None:
                        return budget
                else:
                    if req.lora is not None and not self.loras.can_acquire(req.lora.lora_id):  # type: ignore[union-attr]
                        continue  # its adapter waits for a slot; requests of resident adapters go ahead
                    cached = self._cached_prefix(req) if self.blocks.enable_caching else []
                    if cached:
                        start = len(cached) * self.blocks.block_size
                        n = int(min(req.num_tokens - start, budget))
                    target = req.max_num_tokens if self.kv_admission == "reserve" else start + n
                    if not self.blocks.can_grow(req.request_id, target, cached):
                        return budget  # no queue jumping: later requests wait behind this one
                    new_blocks = self.blocks.grow(req.request_id, target, cached)
                    if req.lora is not None:
                        slot, load = self.loras.acquire(req.lora.lora_id)  # type: ignore[union-attr]
                        if load:
                            batch.lora_loads.append((slot, req.lora))
                    req.admitted = True
                    req.num_computed_tokens = start
                    if req.num_preemptions == 0:
                        req.num_cached_tokens = start
                    if self.blocks.enable_caching:
                        self.prefix_cache_queries += req.num_tokens
                        self.prefix_cache_hits += start
                    batch.admitted.append(req)
                sample = n == req.num_uncomputed_tokens
                batch.members.append(ScheduledRequest(req, n, start, new_blocks, sample, False))
                chosen.add(req.request_id)
                budget -= n
        return budget

    def _launch(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        if not batch.members:  # (every preemption is for a member, so none happened)
            return None
        for m in batch.members:
            m.request.running = True
        self._next_batch_id += 1
        self._in_flight.append(batch)
        return batch

    def _grow(self, req: Request, num_tokens: int, batch: ScheduledBatch, chosen: set[str]) -> list[int] | None:
        """Blocks so that an admitted request holds num_tokens tokens; under on_demand, preempts later
        arrivals that are neither in flight nor in this batch when the pool is short. None when even
        that cannot make room (the request then waits, keeping what it holds)."""
        need = self.blocks.blocks_needed(req.request_id, num_tokens)
        if need == 0:  # most decode steps: its last block has room
            return []
        if need <= self.blocks.num_free_blocks:
            return self.blocks.grow(req.request_id, num_tokens)
        if self.kv_admission == "reserve":  # cannot happen: the reservation covers max_tokens
            raise RuntimeError(f"{req.request_id} outgrew its reservation")
        victims = [
            r for r in reversed(self._pool.values())
            if r.admitted and not r.running and r.request_id not in chosen and r.arrival > req.arrival
        ]
        reclaimable = self.blocks.num_released_by(r.request_id for r in victims)
        if need > self.blocks.num_free_blocks + reclaimable:
            return None
        for victim in victims:  # latest arrival first
            if need <= self.blocks.num_free_blocks:
                break
            self._preempt(victim)
            batch.preempted.append(victim)
        return self.blocks.grow(req.request_id, num_tokens)

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix of full blocks, short of its last token."""
        return self.blocks.lookup(self._block_hashes(req, (req.num_tokens - 1) // self.blocks.block_size))

    def _block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's hash chain over its first num_blocks full blocks (computed once per block)."""
        hashes, size = req.block_hashes, self.blocks.block_size
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else root_hash(req.cache_salt, req.lora.lora_id if req.lora else 0)
            hashes.append(hash_block(parent, req.token_ids(len(hashes) * size, size)))
        return hashes

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        self._release_lora(req)
        req.admitted = False
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1

    def complete(self, batch: ScheduledBatch) -> list[Request]:
        """A scheduled batch returned. The engine has already appended each sampled token and set
        finish_reason on those that finished. Advances each member's computed tokens, frees the blocks of
        finished requests; returns them."""
        if not self._in_flight or self._in_flight[0] is not batch:
            raise RuntimeError("batches must complete in the order they were scheduled")
        self._in_flight.popleft()
        finished: list[Request] = []
        for m in batch.members:
            req = m.request
            req.running = False
            req.num_computed_tokens = m.start + m.num_tokens - m.num_rejected
            if self.blocks.enable_caching and req.finish_reason is not FinishReason.ERROR:
                full = req.num_computed_tokens // self.blocks.block_size
                self.blocks.cache_blocks(req.request_id, self._block_hashes(req, full), full)
            if req.aborted and not req.finished:
                req.finish_reason = FinishReason.CANCELLED
            if req.finished:
                self._remove(req)
                finished.append(req)
        return finished

    def abort(self, request_id: str) -> Request | None:
        """Aborts a request. Returns it, finished as cancelled, if it was not in flight; a request in
        flight is only marked, and leaves (with its blocks) when its batch completes."""
        req = self._pool.get(request_id)
        if req is None:
            return None
        if req.running:
            req.aborted = True
            return None
        req.finish_reason = FinishReason.CANCELLED
        self._remove(req)
        return req

    def drop_all(self) -> list[Request]:
        """Forgets every request and batch in flight (the workers failed); returns the requests that were
        unfinished, in arrival order, their blocks freed."""
        dropped = list(self._pool.values())
        self._in_flight.clear()
        for req in dropped:
            req.running = False
            self._remove(req)
        return dropped

    def _remove(self, req: Request) -> None:
        del self._pool[req.request_id]
        self.blocks.free(req.request_id)
        self._release_lora(req)
        req.admitted = False

    def _release_lora(self, req: Request) -> None:
        """An admitted request leaves: its adapter's slot loses a user (orca/core/lora.py)."""
        if req.admitted and req.lora is not None:
            self.loras.release(req.lora.lora_id)  # type: ignore[union-attr]
