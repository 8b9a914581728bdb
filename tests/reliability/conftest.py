"""The reliability suite (tests/reliability/): load, cancellation, faults and shutdown against the real
tritonserver. Helpers live in _reliability.py.

Two sizes of the same tests: the CI size runs in `make test` on the tiny models of tests/_server.py; the
full size, marked ``stress``, runs the shipped SmolLM2 orca_gpt and only when asked for (`make test-stress`,
which passes ``-m stress``; or ORCA_STRESS=1). Every other run skips the stress tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _reliability


def _stress_requested(config: pytest.Config) -> bool:
    return "stress" in (config.getoption("markexpr") or "") or os.environ.get("ORCA_STRESS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _stress_requested(config):
        return
    skip = pytest.mark.skip(reason="full-size reliability run: make test-stress (pytest -m stress)")
    for item in items:
        if "stress" in item.keywords:
            item.add_marker(skip)
