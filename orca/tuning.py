"""The engine's measured tuning thresholds, in one place: each with what it bounds and the heading of
docs/BENCHMARKS.md whose figures chose (or checked) its value. Each picks between paths that compute the
same thing (up to rounding): they tune speed, not results.

Structural constants stay beside their code: formats, alignments, kernel tile minimums a library or the
hardware imposes, what another library's lowering does (FLEX_DECODING_ROWS), recompile caps, protocol and
validation limits, and kernel launch defaults not yet tuned (paged_decode.py's).

This module imports nothing from orca, so every layer may import it. A test or a script that re-tunes a
threshold patches it here (monkeypatch.setattr(tuning, NAME, ...)); its consumers that must see the patch
read `tuning.NAME` at call time.
"""

from __future__ import annotations

import torch

# -- linear layers (orca/models/layers.py, orca/models/quantization.py, orca/worker/cpu_graphs/) --------------
# hybrid float32 linears: F.linear on the checkpoint's weights from this many rows, oneDNN's packed matmul below
# "The linears at prompt sizes"
HYBRID_MIN_ROWS = 384
# linear_backend auto keeps the checkpoint's weights beside the packed ones only within this share of the
# memory available at load: "The engine: `linear_backend` onednn against auto (hybrid)"
HYBRID_MEMORY_SHARE = 0.25
# hybrid quantized linears: the dequantized float copy (oneDNN) from this many rows, by the model's dtype and
# the weights' kind: float32 "Speed: the linear layers alone (`orca-bench linears`)"; bfloat16 (float16 as it)
# "Results: the single stream on an AVX512-BF16 host (2026-11-27, late morning)"
HYBRID_QUANTIZED_MIN_ROWS = {
    torch.float32: {"int8": 8, "int4": 12},
    torch.bfloat16: {"int8": 4, "int4": 6},
    torch.float16: {"int8": 4, "int4": 6},  # (as bfloat16: oneDNN packs float16 only where the CPU has it)
}
# a compiled int8 LM head takes its float copy from no fewer rows than this (the larger of it and its dtype's
# above): "Results: the LM head's compiled graph (2026-11-27, midday)"
COMPILED_HEAD_FLOAT_ROWS = 5

# -- attention and the CPU graphs' steps (orca/models/attention/, orca/worker/cpu_graphs/) ------------------------
# a decode step of 2 to this many requests runs the CPU graphs' few step, attention inside its graph:
# "Results: decode steps of a few requests in a graph of their own; the trace with the int4 default (2026-11-28)"
FEW_MAX_ROWS = 5
# a verifying request's rows: up to this many new tokens after cached ones (its proposals and the token before
# them) take the few-row paths (CPU graphs' lone verification, batched short groups, CUDA's paged decode kernel):
# "The paged decode kernel (`orca/models/attention/paged_decode.py`)",
# "Results: speculative decoding (n-gram), 2026-11-26" (its bullet: Verifying requests batched),
# "Results: a single stream's step in a graph of its own (2026-11-27, evening)"
VERIFYING_MAX_ROWS = 8
# the batched backend batches an iteration's increments from this many on (fewer: the reference's calls):
# "Where it came from", under "Results: the fast data plane, fourth step: batched increments (2026-11-24, morning)"
BATCHED_MIN_INCREMENTS = 3
# batched increments start a new group where the next row would pad the group by more than this many slots:
# "Results: what the batched target would take on a CPU (2026-11-28)"
BATCHED_GROUP_SLOTS = 384

# -- speculative decoding (orca/core/speculative.py) ------------------------------------------------------------
# a request pauses proposing after SPEC_MISSES_BEFORE_PAUSE verifications in a row that accepted nothing, for
# twice as many iterations each time, at most SPEC_MAX_PAUSE; what lookup's misses cost with them:
# "Where lookup misses: seeded sampling on random prompts (2026-11-26, night)"
SPEC_MISSES_BEFORE_PAUSE = 3
SPEC_MAX_PAUSE = 64
