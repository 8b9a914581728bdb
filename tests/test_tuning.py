"""orca/tuning.py holds the measured thresholds, each under a comment that cites the docs/BENCHMARKS.md
heading whose figures justify it: each quoted name in its comments is a heading that exists, verbatim (no
model)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_threshold_cites_a_benchmarks_heading() -> None:
    headings = {line.lstrip("#").strip() for line in (ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()
                if line.startswith("#")}
    source = (ROOT / "orca" / "tuning.py").read_text()
    lines = source.splitlines()
    uncited = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign):
            continue
        # The comment lines right above it; a constant right under another shares that one's (a short group).
        comments, i = [], node.lineno - 2
        while i >= 0 and lines[i].strip():
            if lines[i].lstrip().startswith("#"):
                comments.append(lines[i])
            elif comments:
                break
            i -= 1
        cited = re.findall(r'"([^"]+)"', "\n".join(comments))
        if not cited or not all(c in headings for c in cited):
            uncited.append((node.targets[0].id, [c for c in cited if c not in headings]))
    assert uncited == []
