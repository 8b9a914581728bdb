"""The iteration timeline: what the engine did, iteration by iteration, written to a file. This docstring is
the schema; when it is on and how to draw it: docs/design.md, "Iteration timeline".

The file: JSON lines, one record per line, each an object with a ``type``. Times are seconds since the
recorder started (``t``, ``start``), from the monotonic clock; the header gives the wall-clock time of
that origin. Request ids are the engine's.

- ``header`` (the first line of every file, rotated ones too): ``version`` (1), ``run`` (an id of this
  recording: files of another run at the same path are never mixed in), ``origin_unix`` (wall-clock
  seconds at t = 0), ``pid``, ``scheduling`` ("iteration-level", or "request-level" for the baseline of
  orca/frontend/request_level.py), ``model`` (the checkpoint), ``max_bs``, ``block_size``, ``kv_total_blocks``,
  ``kv_admission``, ``max_num_batched_tokens`` (null = no budget), ``n_workers``, ``prefix_caching``.
- ``arrival``: a request joined the engine: ``t`` (when it reached the server: its arrival time as the
  front end gave it, which is when it joined unless it waited in front of the engine, e.g. in Triton's
  dynamic batcher for ``request_level_gpt``), ``id``, ``prompt_tokens``, ``max_tokens`` (new tokens),
  ``joined`` (when it joined the engine; only when more than a millisecond after ``t``), ``constrained``
  (a structured output masks its tokens; only when true).
- ``iteration``: one iteration, written when its result has been processed, in batch id order:
  ``id`` (the batch id: increasing), ``start`` (plan submitted), ``duration`` (submit to collect),
  ``waiting`` (queue length: requests not admitted once this iteration was selected), ``running``
  (admitted requests at that moment), ``kv_blocks`` (K/V blocks allocated after the iteration, before
  finished requests free theirs), ``kv_used_tokens`` (tokens whose keys and values the pool holds then),
  ``num_tokens`` (tokens fed), ``requests`` (the batch, one object per member: ``id``; ``phase``:
  "prompt" (a whole prompt or a chunk of it), "increment" (one token after a computed prefix: Orca's
  increment phase) or "recompute" (re-feeding a preempted request's prompt and tokens); ``start`` (the
  position of its first token fed); ``tokens`` (tokens fed); ``blocks`` (K/V blocks it holds);
  ``cached`` (admitted by this selection: its first tokens whose K/V it took from the prefix cache, so
  ``start`` = ``cached``; else 0); ``sampled`` (this iteration drew its next token); with speculative
  decoding, ``proposed`` (of ``tokens``, the proposed ones fed after its last token; only when some) and
  ``accepted`` (of them, the ones kept: the iteration drew ``accepted`` + 1 tokens)), ``admitted`` (ids
  admitted by this selection),
  ``preempted`` (ids whose blocks this selection took back: they wait again), ``finished`` (objects
  ``id``, ``reason``, ``tokens`` (generated in all)), and ``error`` (why the iteration failed, or null).
- ``finish``: a request that ended between iterations (cancelled while waiting or between iterations, or
  every request when the engine failed): ``t``, ``id``, ``reason``, ``tokens``.
- ``batch``: request-level scheduling only (orca/frontend/request_level.py), after each batch: ``t``, ``batch``,
  ``members`` (objects ``id``, ``run_tokens`` (what it ran for: the batch's longest), ``kept_tokens`` (what
  its own stop condition kept; the rest were computed and thrown away), ``reason``).

So, for every request: its generated tokens are the number of iterations where it ``sampled`` plus its
``accepted`` proposals, and without speculation the iterations where it sampled are its increments + 1
unless it was preempted after its first token (each readmission recomputes, and draws one token at the
end of its recomputation).

Size: at most ``max_bytes`` per file (a single record longer than that gets a file of its own); when the
next record would not fit, ``path`` becomes ``path.1``, ``path.1`` becomes ``path.2`` and so on, keeping
``backups`` rotated files; older ones are deleted. A new recorder starts afresh: it removes ``path`` and
its rotated files first. Each record is flushed as it is written, so a trace is readable while the engine
runs and after it crashes (``read_timeline`` skips a last line cut short).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca.config import TRACE_DEFAULT_BACKUPS, TRACE_DEFAULT_MAX_BYTES, TRACE_MIN_MAX_BYTES

if TYPE_CHECKING:
    from orca.core.block_manager import BlockManager
    from orca.core.request import Request
    from orca.core.scheduler import OrcaScheduler, ScheduledBatch

VERSION = 1
PHASES = ("prompt", "increment", "recompute")


def rotated_paths(path: str | os.PathLike[str], backups: int) -> list[Path]:
    """path, path.1, ..., path.<backups>: newest first."""
    base = Path(path)
    return [base] + [base.with_name(f"{base.name}.{i}") for i in range(1, backups + 1)]


class RotatingWriter:
    """JSON lines into ``path``, at most ``max_bytes`` per file, ``backups`` rotated files kept. Every file
    starts with ``header`` (whatever it holds when the file is opened)."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, backups: int, header: dict[str, Any]) -> None:
        if max_bytes < TRACE_MIN_MAX_BYTES:
            raise ValueError(f"max_bytes must be >= {TRACE_MIN_MAX_BYTES}, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.header = header
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for p in rotated_paths(self.path, backups + 8):  # a fresh start (also files of a larger backups)
            p.unlink(missing_ok=True)
        self._file = self.path.open("wb")
        self._size = 0
        self._records = 0  # in the current file, after its header
        self._rotated = False
        self._write_header()

    def _write_header(self) -> None:
        line = _line(self.header)
        self._file.write(line)
        self._file.flush()
        self._size = len(line)
        self._records = 0

    @property
    def empty(self) -> bool:
        """Nothing but the header written yet (and never rotated)."""
        return self._records == 0 and not self._rotated

    def rewrite_header(self) -> None:
        """Writes the header again over itself; only while ``empty``."""
        if not self.empty:
            raise RuntimeError("the header can be rewritten only before any record")
        self._file.seek(0)
        self._file.truncate()
        self._write_header()

    def write(self, record: dict[str, Any]) -> None:
        line = _line(record)
        if self._records and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()
        self._size += len(line)
        self._records += 1

    def _rotate(self) -> None:
        self._file.close()
        paths = rotated_paths(self.path, self.backups)
        if self.backups == 0:
            self.path.unlink()
        else:
            paths[-1].unlink(missing_ok=True)
            for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
                if newer.exists():
                    newer.replace(older)
        self._file = self.path.open("wb")
        self._rotated = True
        self._write_header()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _r(seconds: float) -> float:
    return round(seconds, 6)


@dataclass
class _Selected:
    """What the recorder keeps of a batch between its selection and its completion."""

    start: float
    record: dict[str, Any]


class TimelineRecorder:
    """The engine's side: called only when tracing is on (LLMEngine.timeline is not None)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = TRACE_DEFAULT_MAX_BYTES,
        backups: int = TRACE_DEFAULT_BACKUPS,
        **header: Any,
    ) -> None:
        self._origin = time.monotonic()
        self.header: dict[str, Any] = {
            "type": "header", "version": VERSION, "run": uuid.uuid4().hex[:12], "origin_unix": time.time(),
            "pid": os.getpid(), "scheduling": "iteration-level", **header,
        }
        self.path = Path(path)
        self._writer = RotatingWriter(path, max_bytes, backups, self.header)
        self._selected: dict[int, _Selected] = {}

    def _t(self, now: float) -> float:
        return _r(now - self._origin)

    def set_info(self, **fields: Any) -> None:
        """Changes header fields (e.g. scheduling): rewrites the header while nothing else is written,
        else writes an ``info`` record (and later rotated files carry them in their header)."""
        self.header.update(fields)
        if self._writer.empty:
            self._writer.rewrite_header()
        else:
            self._writer.write({"type": "info", **fields})

    def arrival(self, req: Request, now: float) -> None:
        arrived = min(req.arrival_time, now)
        record = {
            "type": "arrival", "t": self._t(arrived), "id": req.request_id, "prompt_tokens": req.num_prompt_tokens,
            "max_tokens": req.params.max_tokens,
        }
        if now - arrived > 1e-3:
            record["joined"] = self._t(now)
        if req.constraint is not None:
            record["constrained"] = True
        self._writer.write(record)

    def finish(self, req: Request, now: float) -> None:
        self._writer.write({
            "type": "finish", "t": self._t(now), "id": req.request_id,
            "reason": req.finish_reason.value if req.finish_reason else None, "tokens": len(req.output_token_ids),
        })

    def selected(self, batch: ScheduledBatch, scheduler: OrcaScheduler, blocks: BlockManager, now: float) -> None:
        """A batch was selected and is about to be submitted."""
        members = []
        for m in batch.members:
            req = m.request
            phase = "increment" if m.increment else ("recompute" if req.num_preemptions else "prompt")
            members.append({
                "id": req.request_id, "phase": phase, "start": m.start, "tokens": m.num_tokens,
                "blocks": blocks.num_held(req.request_id),
                "cached": m.start if not m.increment and req in batch.admitted else 0, "sampled": m.sample,
            })
            if m.spec_token_ids:  # speculative decoding: proposed tokens fed after its last one
                members[-1]["proposed"] = len(m.spec_token_ids)
        self._selected[batch.batch_id] = _Selected(now, {
            "type": "iteration", "id": batch.batch_id, "start": self._t(now), "duration": 0.0,
            "waiting": scheduler.num_waiting, "running": scheduler.num_running,
            "kv_blocks": 0, "kv_used_tokens": 0, "num_tokens": batch.num_tokens, "requests": members,
            "admitted": [r.request_id for r in batch.admitted],
            "preempted": [r.request_id for r in batch.preempted],
            "finished": [], "error": None,
        })

    def completed(
        self, batch_id: int, now: float, finished: Iterable[Request], kv_blocks: int, kv_used_tokens: int,
        error: str | None, accepted: dict[str, int] | None = None,
    ) -> None:
        """Its result was processed: writes the iteration's record. `accepted`: of the members that verified
        proposed tokens, how many each kept (each also drew one token after them)."""
        sel = self._selected.pop(batch_id)
        record = sel.record
        record["duration"] = _r(now - sel.start)
        record["kv_blocks"], record["kv_used_tokens"], record["error"] = kv_blocks, kv_used_tokens, error
        if error is not None:
            for member in record["requests"]:
                member["sampled"] = False
        for member in record["requests"]:
            if "proposed" in member:
                member["accepted"] = (accepted or {}).get(member["id"], 0) if error is None else 0
        record["finished"] = [
            {"id": r.request_id, "reason": r.finish_reason.value if r.finish_reason else None,
             "tokens": len(r.output_token_ids)}
            for r in finished
        ]
        self._writer.write(record)

    def dropped(self) -> None:
        """The batches in flight will never complete (the workers failed)."""
        self._selected.clear()

    def event(self, kind: str, now: float, **fields: Any) -> None:
        """Another record (e.g. request-level's ``batch``)."""
        self._writer.write({"type": kind, "t": self._t(now), **fields})

    def close(self) -> None:
        self._writer.close()


# -- reading it back ------------------------------------------------------------------------------------
@dataclass
class Timeline:
    """A trace read back: the header (of the newest file, with any ``info`` applied), iterations in id
    order, and the other records (arrival, finish, batch, ...) in file order."""

    header: dict[str, Any]
    iterations: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def read_timeline(path: str | os.PathLike[str]) -> Timeline:
    """Reads ``path`` and its rotated files (path.1, path.2, ...: oldest first) of the same run as
    ``path``. ValueError when ``path`` is not a timeline. A last line cut short (the writer died while
    writing it) is skipped."""
    base = Path(path)
    if not base.is_file():
        raise ValueError(f"{base}: no such trace file")
    files = []
    i = 1
    while (rotated := base.with_name(f"{base.name}.{i}")).is_file():
        files.append(rotated)
        i += 1
    files = [*reversed(files), base]
    newest = _read_lines(base)
    if not newest or newest[0].get("type") != "header":
        raise ValueError(f"{base} is not an orca timeline (no header line)")
    run = newest[0].get("run")
    if newest[0].get("version") != VERSION:
        raise ValueError(f"{base}: timeline version {newest[0].get('version')!r}, this reader reads {VERSION}")
    timeline = Timeline(header=dict(newest[0]))
    for f in files:
        records = newest if f == base else _read_lines(f)
        if not records or records[0].get("type") != "header" or records[0].get("run") != run:
            continue  # another run's file
        timeline.files.append(f)
        for record in records[1:]:
            kind = record.get("type")
            if kind == "iteration":
                timeline.iterations.append(record)
            elif kind == "info":
                timeline.header.update({k: v for k, v in record.items() if k != "type"})
            else:
                timeline.events.append(record)
    timeline.iterations.sort(key=lambda it: it["id"])
    return timeline


def _read_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_bytes().split(b"\n")
    records = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1:  # no newline after it: a line cut short
                break
            raise ValueError(f"{path}:{n + 1}: not a JSON line") from None
    return records


__all__ = [
    "PHASES", "RotatingWriter", "Timeline", "TimelineRecorder",
    "read_timeline", "rotated_paths",
]
