"""``orca-bench timeline``: an iteration timeline (orca/core/timeline.py) as a Chrome/Perfetto trace and a picture.

- ``to_perfetto``: Chrome's trace event format (JSON; open it in https://ui.perfetto.dev or
  chrome://tracing). Process "iterations": one slice per iteration (batch size, tokens, queue, K/V blocks,
  admissions, finishes, preemptions in its args) and counters for batch size, queue length and K/V blocks.
  Process "requests": one track per request, a slice per iteration it was in, named by its phase (prompt,
  increment, recompute; "discarded" for request-level members computing tokens their own stop condition
  had already ended), "waiting" slices from arrival or preemption to its next iteration, and instants for
  preemptions and finishes. Times in microseconds from the trace's origin.
- ``plot``: the Orca paper's Figure 4 drawn from what really ran: requests as horizontal bars over
  iterations (or seconds), coloured by phase, grey while waiting; below, the batch size per iteration
  (with max_bs) and the queue length, and the K/V pool in use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASE_COLOURS = {
    "prompt": "#e6862a",  # initiation: a whole prompt or a chunk
    "increment": "#2f6fb3",  # one token
    "recompute": "#c0392b",  # re-feeding after a preemption
    "discarded": "#9e9e9e",  # request-level: computed, thrown away
}
WAITING_COLOUR = "#e4e4e4"


@dataclass
class Membership:
    """A request in one iteration."""

    index: int  # position of the iteration in the timeline (0, 1, ...)
    iteration: int  # its id
    phase: str
    tokens: int
    start: int
    blocks: int
    sampled: bool
    cached: int = 0  # admitted in this iteration: its first tokens found in the prefix cache
    accepted: int = 0  # speculative decoding: proposed tokens it kept (it drew accepted + 1 tokens)

    @property
    def drawn(self) -> int:
        """Tokens this iteration generated for the request."""
        return self.accepted + 1 if self.sampled else 0


@dataclass
class RequestTrack:
    """One request's life, as the timeline saw it."""

    id: str
    arrival: float | None = None  # seconds (None: arrived before the oldest record kept)
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    memberships: list[Membership] = field(default_factory=list)
    preempted_at: list[int] = field(default_factory=list)  # iteration indices whose selection preempted it
    finish_reason: str | None = None
    finish_tokens: int | None = None
    finish_time: float | None = None
    finish_index: int | None = None  # the iteration it finished in (None: between iterations)
    kept_tokens: int | None = None  # request-level: what its own stop condition kept

    @property
    def increments(self) -> int:
        return sum(1 for m in self.memberships if m.phase == "increment")

    @property
    def sampled(self) -> int:
        """Tokens generated, over its iterations."""
        return sum(m.drawn for m in self.memberships)


def request_tracks(timeline: Any) -> list[RequestTrack]:
    """Each request's track, in arrival order (a request whose arrival was rotated out of the trace: by
    its first iteration). Request-level members get phase "discarded" for the iterations after their last
    kept token."""
    tracks: dict[str, RequestTrack] = {}

    def track(request_id: str) -> RequestTrack:
        if request_id not in tracks:
            tracks[request_id] = RequestTrack(request_id)
        return tracks[request_id]

    its = timeline.iterations
    for e in timeline.events:
        if e["type"] == "arrival":
            tr = track(e["id"])
            tr.arrival, tr.prompt_tokens, tr.max_tokens = e["t"], e["prompt_tokens"], e["max_tokens"]
    for k, it in enumerate(its):
        for m in it["requests"]:
            track(m["id"]).memberships.append(
                Membership(
                    k, it["id"], m["phase"], m["tokens"], m["start"], m["blocks"], m["sampled"], m.get("cached", 0),
                    m.get("accepted", 0),
                )
            )
        for rid in it["preempted"]:
            track(rid).preempted_at.append(k)
        for f in it["finished"]:
            tr = track(f["id"])
            tr.finish_reason, tr.finish_tokens = f["reason"], f["tokens"]
            tr.finish_time, tr.finish_index = it["start"] + it["duration"], k
    for e in timeline.events:
        if e["type"] == "finish":
            tr = track(e["id"])
            tr.finish_reason, tr.finish_tokens, tr.finish_time, tr.finish_index = e["reason"], e["tokens"], e["t"], None
        elif e["type"] == "batch":
            for member in e["members"]:
                track(member["id"]).kept_tokens = member["kept_tokens"]
    for tr in tracks.values():
        if tr.kept_tokens is not None:
            drawn = 0
            for m in tr.memberships:
                if drawn >= tr.kept_tokens and m.phase == "increment":
                    m.phase = "discarded"
                drawn += m.drawn

    def when(tr: RequestTrack) -> float:
        if tr.arrival is not None:
            return tr.arrival
        if tr.memberships:
            return its[tr.memberships[0].index]["start"]
        return tr.finish_time or 0.0

    return sorted(tracks.values(), key=when)


def summarize(timeline: Any) -> dict[str, Any]:
    """The numbers printed under the picture and by the command."""
    its = timeline.iterations
    tracks = request_tracks(timeline)
    header = timeline.header
    sizes = [len(it["requests"]) for it in its]
    phases: dict[str, int] = {}
    for tr in tracks:
        for m in tr.memberships:
            phases[m.phase] = phases.get(m.phase, 0) + 1
    span = (its[-1]["start"] + its[-1]["duration"] - its[0]["start"]) if its else 0.0
    waits = [_first_wait(tr, its) for tr in tracks]
    waits = [w for w in waits if w is not None]
    return {
        "scheduling": header.get("scheduling"),
        "iterations": len(its),
        "requests": len(tracks),
        "finished": sum(1 for tr in tracks if tr.finish_reason is not None),
        "mean_batch_size": sum(sizes) / len(sizes) if sizes else 0.0,
        "max_batch_size": max(sizes, default=0),
        "max_bs": header.get("max_bs"),
        "preemptions": sum(len(it["preempted"]) for it in its),
        "tokens_generated": sum(tr.sampled for tr in tracks),
        "discarded_tokens": phases.get("discarded", 0),
        "member_iterations": phases,
        "mean_wait_seconds": sum(waits) / len(waits) if waits else 0.0,  # arrival to first iteration
        "max_wait_seconds": max(waits, default=0.0),
        "seconds": span,
        "busy_seconds": sum(it["duration"] for it in its),
    }


# -- Perfetto --------------------------------------------------------------------------------------------
_ITERATIONS_PID, _REQUESTS_PID = 1, 2


def to_perfetto(timeline: Any) -> dict[str, Any]:
    """The trace in Chrome's trace event format (a JSON object with ``traceEvents``)."""
    us = 1e6
    its = timeline.iterations
    header = timeline.header
    n_workers = max(1, int(header.get("n_workers") or 1))
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": _ITERATIONS_PID, "name": "process_name", "args": {"name": "iterations"}},
        {"ph": "M", "pid": _ITERATIONS_PID, "name": "process_sort_index", "args": {"sort_index": 0}},
        {"ph": "M", "pid": _REQUESTS_PID, "name": "process_name", "args": {"name": "requests"}},
        {"ph": "M", "pid": _REQUESTS_PID, "name": "process_sort_index", "args": {"sort_index": 1}},
    ]
    for slot in range(n_workers):  # batches in flight overlap: one track per pipeline slot
        name = "iterations" if n_workers == 1 else f"iterations (in flight {slot})"
        events.append({"ph": "M", "pid": _ITERATIONS_PID, "tid": slot + 1, "name": "thread_name",
                       "args": {"name": name}})
    tracks = request_tracks(timeline)
    queue = _queue(timeline, tracks)
    for k, it in enumerate(its):
        ts = it["start"] * us
        events.append({
            "ph": "X", "pid": _ITERATIONS_PID, "tid": it["id"] % n_workers + 1, "name": f"iteration {it['id']}",
            "cat": "iteration", "ts": ts, "dur": it["duration"] * us,
            "args": {
                "batch_size": len(it["requests"]), "num_tokens": it["num_tokens"], "waiting": it["waiting"],
                "running": it["running"], "kv_blocks": it["kv_blocks"], "kv_used_tokens": it["kv_used_tokens"],
                "admitted": it["admitted"], "preempted": it["preempted"],
                "finished": [f"{f['id']} ({f['reason']})" for f in it["finished"]], "error": it["error"],
            },
        })
        events.append({"ph": "C", "pid": _ITERATIONS_PID, "name": "batch size", "ts": ts,
                       "args": {"requests": len(it["requests"]), "tokens": it["num_tokens"]}})
        events.append({"ph": "C", "pid": _ITERATIONS_PID, "name": "queue", "ts": ts,
                       "args": {"waiting": queue[k]}})
        events.append({"ph": "C", "pid": _ITERATIONS_PID, "name": "K/V blocks", "ts": ts,
                       "args": {"allocated": it["kv_blocks"]}})
    for tid, tr in enumerate(tracks, start=1):
        events.append({"ph": "M", "pid": _REQUESTS_PID, "tid": tid, "name": "thread_name", "args": {"name": tr.id}})
        events.append({"ph": "M", "pid": _REQUESTS_PID, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": tid}})
        for start, end in _waiting_spans(tr, its):
            if end > start:
                events.append({"ph": "X", "pid": _REQUESTS_PID, "tid": tid, "name": "waiting", "cat": "waiting",
                               "ts": start * us, "dur": (end - start) * us})
        if tr.arrival is not None:
            events.append({"ph": "i", "s": "t", "pid": _REQUESTS_PID, "tid": tid, "name": "arrival",
                           "ts": tr.arrival * us,
                           "args": {"prompt_tokens": tr.prompt_tokens, "max_tokens": tr.max_tokens}})
        for m in tr.memberships:
            it = its[m.index]
            events.append({
                "ph": "X", "pid": _REQUESTS_PID, "tid": tid, "name": m.phase, "cat": m.phase,
                "ts": it["start"] * us, "dur": it["duration"] * us,
                "args": {"iteration": m.iteration, "tokens": m.tokens, "position": m.start, "kv_blocks": m.blocks,
                         "sampled": m.sampled, "accepted": m.accepted},
            })
        for k in tr.preempted_at:
            events.append({"ph": "i", "s": "t", "pid": _REQUESTS_PID, "tid": tid, "name": "preempted",
                           "ts": its[k]["start"] * us})
        if tr.finish_time is not None:
            events.append({"ph": "i", "s": "t", "pid": _REQUESTS_PID, "tid": tid,
                           "name": f"finished ({tr.finish_reason})", "ts": tr.finish_time * us,
                           "args": {"reason": tr.finish_reason, "tokens": tr.finish_tokens,
                                    "kept_tokens": tr.kept_tokens}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {k: v for k, v in header.items() if k != "type"}}


def _first_wait(tr: RequestTrack, its: Sequence[dict[str, Any]]) -> float | None:
    """Seconds from the request's arrival to its first iteration (None: either is not in the trace)."""
    if tr.arrival is None or not tr.memberships:
        return None
    return max(0.0, its[tr.memberships[0].index]["start"] - tr.arrival)


def _queue(timeline: Any, tracks: Sequence[RequestTrack]) -> list[int]:
    """Per iteration, the requests waiting: the engine's queue (``waiting``), or for request-level
    scheduling, whose queue is Triton's batcher (the engine's own is empty there), the requests whose
    waiting span (from their arrival) holds the iteration's start."""
    its = timeline.iterations
    if timeline.header.get("scheduling") != "request-level":
        return [it["waiting"] for it in its]
    spans = [span for tr in tracks for span in _waiting_spans(tr, its)]
    return [sum(1 for a, b in spans if a <= it["start"] < b) for it in its]


def _waiting_spans(tr: RequestTrack, its: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) seconds the request waited: arrival to its first iteration, and each preemption to the
    iteration that readmitted it."""
    spans = []
    starts = [its[m.index]["start"] for m in tr.memberships]
    if tr.arrival is not None:
        first = starts[0] if starts else tr.finish_time
        if first is not None:
            spans.append((tr.arrival, first))
    for k in tr.preempted_at:
        t = its[k]["start"]
        later = [s for s in starts if s > t]
        end = later[0] if later else tr.finish_time
        if end is not None:
            spans.append((t, end))
    return spans


# -- the picture -----------------------------------------------------------------------------------------
def plot(timeline: Any, path: str | Path, title: str | None = None, x: str = "iteration",
         max_requests: int | None = None) -> None:
    """The picture (PNG): requests over iterations (x="iteration") or seconds (x="time")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if x not in ("iteration", "time"):
        raise ValueError(f"x must be iteration or time, got {x!r}")
    its = timeline.iterations
    if not its:
        raise ValueError("the trace has no iteration")
    header = timeline.header
    all_tracks = request_tracks(timeline)
    tracks = all_tracks if max_requests is None else all_tracks[:max_requests]
    by_time = x == "time"
    left = [it["start"] for it in its] if by_time else list(range(len(its)))
    width = [it["duration"] for it in its] if by_time else [1.0] * len(its)

    def position(t: float) -> float:
        """A time on the x axis: for iterations, the index of the first iteration starting at or after t."""
        if by_time:
            return t
        for k, it in enumerate(its):
            if it["start"] >= t:
                return float(k)
        return float(len(its))

    n = len(tracks)
    fig, (ax, ax_bs, ax_kv) = plt.subplots(
        3, 1, figsize=(13, 2.6 + min(0.22 * n, 9.0)), sharex=True,
        gridspec_kw={"height_ratios": [max(2.0, min(0.22 * n, 9.0)), 1.1, 1.0]},
    )
    bar_h = 0.72
    for row, tr in enumerate(tracks):
        y = n - 1 - row
        for start, end in _waiting_spans(tr, its):
            a, b = position(start), position(end)
            if b > a:
                ax.broken_barh([(a, b - a)], (y - bar_h / 4, bar_h / 2), facecolors=WAITING_COLOUR)
        segments: dict[str, list[tuple[float, float]]] = {}
        for m in tr.memberships:
            segments.setdefault(m.phase, []).append((left[m.index], width[m.index]))
        for phase, segs in segments.items():
            ax.broken_barh(_merge(segs), (y - bar_h / 2, bar_h), facecolors=PHASE_COLOURS.get(phase, "black"))
        for k in tr.preempted_at:
            ax.plot(left[k], y, marker="v", color=PHASE_COLOURS["recompute"], markersize=5)
        if tr.finish_reason == "cancelled" and tr.finish_time is not None:
            end = (left[tr.finish_index] + width[tr.finish_index]) if tr.finish_index is not None else position(
                tr.finish_time)
            ax.plot(end, y, marker="x", color="black", markersize=6)
    ax.set_ylim(-0.8, n - 0.2)
    step = max(1, n // 24)
    ax.set_yticks([n - 1 - r for r in range(0, n, step)])
    prefix, labels = _labels([tr.id for tr in tracks])
    ax.set_yticklabels([labels[r] for r in range(0, n, step)], fontsize=7)
    ax.set_ylabel(f"requests ({prefix}…)" if prefix else "requests", fontsize=9)
    legend = [Patch(color=PHASE_COLOURS["prompt"], label="prompt (initiation)"),
              Patch(color=PHASE_COLOURS["increment"], label="increment")]
    phases_seen = {m.phase for tr in tracks for m in tr.memberships}
    if "recompute" in phases_seen:
        legend.append(Patch(color=PHASE_COLOURS["recompute"], label="recompute (after preemption)"))
    if "discarded" in phases_seen:
        legend.append(Patch(color=PHASE_COLOURS["discarded"], label="computed, thrown away"))
    legend.append(Patch(color=WAITING_COLOUR, label="waiting"))
    outside = {"loc": "upper left", "bbox_to_anchor": (1.005, 1.0), "fontsize": 8, "frameon": False}
    ax.legend(handles=legend, **outside)

    sizes = [len(it["requests"]) for it in its]
    ax_bs.bar(left, sizes, width=width, align="edge", color="#7a9cc6", label="batch size")
    queue = _queue(timeline, all_tracks)  # every request, also those max_requests leaves out
    queue_label = "queue (waiting in Triton's batcher)" if header.get("scheduling") == "request-level" else (
        "queue (waiting)")
    ax_bs.plot([left[k] + width[k] / 2 for k in range(len(its))], queue,
               color="#d35400", linewidth=1.2, label=queue_label)
    if header.get("max_bs"):
        ax_bs.axhline(header["max_bs"], color="grey", linestyle="--", linewidth=1, label=f"max_bs {header['max_bs']}")
    ax_bs.set_ylabel("requests")
    ax_bs.legend(**outside)
    total = header.get("kv_total_blocks") or 0
    bs = header.get("block_size") or 1
    centres = [left[k] + width[k] / 2 for k in range(len(its))]
    ax_kv.fill_between(centres, [it["kv_blocks"] for it in its], step="mid", color="#b5d3a8",
                       label="blocks allocated")
    ax_kv.plot(centres, [it["kv_used_tokens"] / bs for it in its], color="#3d7a2a", drawstyle="steps-mid",
               linewidth=1.2, label="blocks' worth of tokens held")
    peak = max(it["kv_blocks"] for it in its)
    if total and peak > total / 2:  # near the pool's size: show all of it
        ax_kv.axhline(total, color="grey", linestyle="--", linewidth=1, label=f"pool: {total} blocks")
        peak = total
    ax_kv.set_ylim(0, max(1, peak) * 1.1)
    ax_kv.set_ylabel("K/V blocks" + (f" (of {total})" if total else ""), fontsize=9)
    ax_kv.legend(**outside)
    ax_kv.set_xlabel("seconds" if by_time else "iteration")
    s = summarize(timeline)
    heading = f"{header.get('scheduling', '?')} scheduling"
    if title:
        heading = f"{title} ({heading})"
    fig.suptitle(
        f"{heading}: {s['requests']} requests, {s['iterations']} iterations in {s['seconds']:.2f} s, "
        f"mean batch {s['mean_batch_size']:.1f}"
        + (f", {s['preemptions']} preemptions" if s["preemptions"] else "")
        + (f", {s['discarded_tokens']} tokens thrown away" if s["discarded_tokens"] else ""),
        fontsize=11,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _merge(segments: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Adjacent (start, width) segments joined into one."""
    merged: list[list[float]] = []
    for start, w in sorted(segments):
        if merged and abs(merged[-1][0] + merged[-1][1] - start) < 1e-9:
            merged[-1][1] += w
        else:
            merged.append([start, w])
    return [(a, b) for a, b in merged]


def _labels(ids: list[str]) -> tuple[str, list[str]]:
    """The ids' common prefix (up to a separator) and what is left of each: orca_gpt-orca_gpt_0_0-7 -> 7."""
    if len(ids) < 2:
        return "", ids
    common = ids[0]
    for i in ids[1:]:
        while not i.startswith(common):
            common = common[:-1]
    cut = max(common.rfind(sep) for sep in "-_.:/") + 1
    return ids[0][:cut], [i[cut:] for i in ids]


def write_perfetto(timeline: Any, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_perfetto(timeline), separators=(",", ":")) + "\n")


__all__ = ["PHASE_COLOURS", "RequestTrack", "plot", "request_tracks", "summarize", "to_perfetto", "write_perfetto"]
