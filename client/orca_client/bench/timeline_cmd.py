"""``orca-bench timeline``: an iteration timeline (a trace file written by the engine: EngineConfig.trace,
LLM(..., trace=path), a Triton model's trace parameter, or orca-bench trace --timeline) as a
Chrome/Perfetto trace JSON (one track per request, one for the iterations: open it in ui.perfetto.dev)
and a PNG: requests as horizontal bars coloured by phase over iterations, as in the Orca paper's Figure
4, with the batch size, the queue and the K/V pool in use below. Reads the rotated files (TRACE.1, ...)
too.

This module is the subcommand; the trace file is read by orca.core.timeline, and drawn by orca_client.timeline
(the Perfetto JSON and the picture).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orca_client.bench.common import write_json
from orca_client.bench.options import doc_description, positive_int


def draw_timeline(trace: str, perfetto: str | None, png: str | None, title: str | None = None,
                  x: str = "iteration", max_requests: int | None = None) -> dict[str, Any]:
    """Reads a trace (orca.core.timeline.read_timeline), writes the Perfetto JSON and the PNG
    (orca_client.timeline), prints and returns its summary."""
    from orca.core.timeline import read_timeline
    from orca_client import timeline as tl

    timeline = read_timeline(trace)
    summary = tl.summarize(timeline)
    print(f"{trace}: {summary['scheduling']} scheduling, {summary['requests']} requests "
          f"({summary['finished']} finished), {summary['iterations']} iterations in {summary['seconds']:.3f} s, "
          f"mean batch size {summary['mean_batch_size']:.2f} (max {summary['max_batch_size']}, max_bs "
          f"{summary['max_bs']}), {summary['tokens_generated']} tokens generated, "
          f"{summary['preemptions']} preemptions, {summary['discarded_tokens']} tokens thrown away, "
          f"wait before the first iteration mean {summary['mean_wait_seconds']:.3f} s "
          f"(max {summary['max_wait_seconds']:.3f} s)")
    if perfetto:
        tl.write_perfetto(timeline, perfetto)
        print(f"wrote {perfetto}")
    if png:
        tl.plot(timeline, png, title=title, x=x, max_requests=max_requests)
        print(f"wrote {png}")
    return summary


def cmd_timeline(args: argparse.Namespace) -> int:
    base = Path(args.trace)
    perfetto = str(base.with_suffix(".perfetto.json")) if args.perfetto is None else args.perfetto
    png = str(base.with_suffix(".png")) if args.png is None else args.png
    summary = draw_timeline(args.trace, perfetto, png, args.title, args.x, args.max_requests)
    if args.json:
        write_json(args.json, summary)
    return 0


def add_parser(sub: Any) -> None:
    tl = sub.add_parser("timeline", help="an iteration timeline as a Perfetto trace JSON and a PNG",
                        description=doc_description(__doc__))
    tl.add_argument("trace", metavar="TRACE", help="the trace file (JSON lines; TRACE.1, TRACE.2, ... are read too)")
    tl.add_argument("--perfetto", metavar="PATH",
                    help="Chrome/Perfetto trace JSON to write (default: TRACE with suffix .perfetto.json; \"\": none)")
    tl.add_argument("--png", metavar="PATH", help="picture to write (default: TRACE with suffix .png; \"\": none)")
    tl.add_argument("--x", choices=("iteration", "time"), default="iteration",
                    help="the picture's horizontal axis: iterations (the paper's Figure 4) or seconds "
                         "(default: %(default)s)")
    tl.add_argument("--title", help="a name put before the scheduling (iteration- or request-level) in the picture's "
                    "heading, e.g. the model (default: none)")
    tl.add_argument("--max-requests", type=positive_int, metavar="N",
                    help="draw only the first N requests (default: all)")
    tl.add_argument("--json", metavar="PATH", help="write the summary to this JSON file")
    tl.set_defaults(func=cmd_timeline)
