"""orca-bench serve's own parts (client/orca_client/bench/serve.py): its profiles, how it reads a guidellm
report (a real one, trimmed to the keys it reads: tests/guidellm_report.json) and per-process CPU from
/proc. The hops against a real server are in tests/test_openai.py; guidellm and vLLM's server themselves
run only in the benchmark (docs/PEERS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from orca_client import bench
from orca_client.bench.serve import Profile, cpu_seconds, cpu_share, parse_profiles, summarize_guidellm


def test_profiles_parse_and_name_guidellms_own() -> None:
    assert parse_profiles("synchronous, concurrent:16") == [Profile("synchronous"), Profile("concurrent", 16)]
    assert [p.guidellm for p in parse_profiles("synchronous,concurrent:4")] == [
        "kind=synchronous", "kind=concurrent,streams=4"]
    for bad in ("", "concurrent", "concurrent:0", "poisson:2", "synchronous:3"):
        with pytest.raises(ValueError):
            parse_profiles(bad)


def test_a_guidellm_report_is_summarized() -> None:
    report = json.loads((Path(__file__).parent / "guidellm_report.json").read_text())
    s = summarize_guidellm(report)
    m = report["benchmarks"][0]["metrics"]
    assert s["requests"] == 48 and s["errored"] == 0
    assert s["output_tokens_per_second"] == round(m["output_tokens_per_second"]["successful"]["mean"], 2)
    assert s["itl_ms"] == {"median": round(m["inter_token_latency_ms"]["successful"]["median"], 2),
                           "p90": round(m["inter_token_latency_ms"]["successful"]["percentiles"]["p90"], 2)}
    assert s["ttft_ms"]["p90"] >= s["ttft_ms"]["median"] > 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_cpu_shares_see_a_busy_child_and_an_idle_parent() -> None:
    """A child spinning for 3 s, measured over 1.5 s of it while this process sleeps: about one core."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        before, start = cpu_seconds(os.getpid()), time.monotonic()
        time.sleep(1.5)
        after = cpu_seconds(os.getpid())
        seconds = time.monotonic() - start
    finally:
        child.wait(30)
    assert child.pid in after and os.getpid() in after
    child_share = (after[child.pid][1] - before[child.pid][1]) / seconds
    assert 0.5 <= child_share <= 1.1
    shares = cpu_share(before, after, seconds)
    assert max(shares.values()) >= 0.5 and sum(shares.values()) <= (os.cpu_count() or 1) + 0.2


def test_the_serve_subcommand_is_orca_benchs() -> None:
    args = bench.build_parser().parse_args(["serve", "--systems", "orca", "--profiles", "concurrent:2"])
    assert args.func.__name__ == "cmd_serve" and args.profiles == "concurrent:2"
