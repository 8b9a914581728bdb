"""The stop rule, in one place: the engine applies it to every sampled token, and the request-level
baseline (orca/request_level.py) applies it afterwards to cut each padded member back."""

from __future__ import annotations

from collections.abc import Container

from orca.detokenizer import IncrementalDetokenizer
from orca.request import FinishReason
from orca.sampling_params import SamplingParams


def apply_stop_rules(
    token: int,
    num_generated: int,
    params: SamplingParams,
    eos_token_ids: Container[int],
    detokenizer: IncrementalDetokenizer | None,
) -> tuple[FinishReason | None, str]:
    """Whether generation stops at `token`, the `num_generated`-th generated token, and the new text.

    A stop token id, or EOS unless ignore_eos, gives "stop"; else reaching max_tokens gives "length". A
    stop string found in the text gives "stop" too, even when the last allowed token completed it (the
    text then ends before the stop string)."""
    reason: FinishReason | None = None
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        reason = FinishReason.STOP
    elif num_generated >= params.max_tokens:
        reason = FinishReason.LENGTH
    if detokenizer is None:
        return reason, ""
    delta = detokenizer.add(token, final=reason is not None)
    if detokenizer.stopped:
        reason = FinishReason.STOP
    return reason, delta
