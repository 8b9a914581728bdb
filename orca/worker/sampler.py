"""Turns one iteration's logits into one token per request, vectorised over the batch.

Greedy (temperature 0), temperature, top-k and top-p, per request. The uniform for (seed, output step,
token id) is a counter-based hash computed for the whole (B, V) block at once, so a seeded request draws
the same alone or in any batch, with no per-request generator. The draw is the exponential race (argmax
of p / E, E ~ Exp(1)), which samples exactly from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orca.core.plan import SamplingSpec, TokenLogprobs
from orca.models.device import upload
from orca.sampling_params import MIN_TEMPERATURE

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)



def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_STEP = _signed(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic): a new tensor."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place (cheaper than a new tensor per op): a bijection of int64 that
    spreads every input bit over every output bit."""
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B,) seeds and (B,) steps -> (B, V) uniforms in (0, 1), a hash of (seed, step, token).

    Seed and step are mixed before the token is added, so nearby seeds or steps give unrelated streams."""
    # int64 multiplication wraps modulo 2**64 on every device, as the hash wants. Not cached across calls
    # (the fake-CUDA tests' fake mode must not meet another's tensor).
    token_terms = torch.arange(vocab, device=seeds.device, dtype=torch.int64).mul_(_GOLDEN)
    stream = _mix(_mix(seeds * _GOLDEN + _GOLDEN) + steps * _STEP)  # (B,)
    x = _mix(stream.unsqueeze(1) + token_terms)  # (B, V), a new tensor mixed in place
    # Top 23 bits: k + 0.5 is exact in float32 for k < 2**23, so the result is never 0 and never 1.
    return _shr(x, 41).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-request sampling options as (B,) tensors, built once per iteration; none for an all-greedy
    batch, which only takes the argmax (saving five uploads)."""

    temperature: torch.Tensor | None  # float32; 0 = greedy
    top_k: torch.Tensor | None  # int64; 0 = off
    top_p: torch.Tensor | None  # float32; 1 = off
    seeds: torch.Tensor | None  # int64
    steps: torch.Tensor | None  # int64: index of the token being drawn
    all_greedy: bool
    any_filter: bool

    @classmethod
    def from_specs(cls, specs: list[SamplingSpec], steps: list[int], device: torch.device) -> SamplingTensors:
        """specs[i] and steps[i] (the index of the output token being drawn) of the batch's i-th row."""
        greedy = [s.temperature < MIN_TEMPERATURE for s in specs]
        if all(greedy):
            return cls(None, None, None, None, None, all_greedy=True, any_filter=False)
        return cls(
            temperature=upload([s.temperature for s in specs], torch.float32, device),
            top_k=upload([s.top_k for s in specs], torch.int64, device),
            top_p=upload([s.top_p for s in specs], torch.float32, device),
            seeds=upload([_signed(s.seed) for s in specs], torch.int64, device),
            steps=upload(steps, torch.int64, device),
            all_greedy=False,
            any_filter=any(not g and (s.top_k > 0 or s.top_p < 1) for s, g in zip(specs, greedy)),
        )


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits (B, V) float32 -> next token ids (B,) int64."""
    greedy_ids = logits.argmax(dim=-1)  # (B,)
    if st.all_greedy:
        return greedy_ids
    vocab = logits.shape[-1]
    greedy = st.temperature < MIN_TEMPERATURE  # (B,)
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    # Subtracting the row max first keeps logits / temp finite for small temperatures.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp.unsqueeze(1)  # (B, V)
    if st.any_filter:
        scaled = _apply_top_k_top_p(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(dim=-1)  # (B, V)
    exp_noise = -counter_uniform(st.seeds, st.steps, vocab).log()  # (B, V) ~ Exp(1)
    sampled_ids = (probs / exp_noise).argmax(dim=-1)  # (B,)
    return torch.where(greedy, greedy_ids, sampled_ids)


def apply_allowed_tokens(logits: torch.Tensor, masks: list[tuple[int, bytes]]) -> None:
    """Structured outputs: sets, in place, the logits of each row's disallowed tokens to -inf (packed
    bitmask, orca/core/constraint.py: bit j of int32 word i = token 32 i + j), so greedy, sampling and
    logprobs see only allowed tokens. Tokens past the mask's words are disallowed."""
    vocab = logits.shape[-1]
    packed = np.frombuffer(b"".join(m for _, m in masks), dtype=np.uint8).reshape(len(masks), -1)
    # Little-endian words: byte k of word i holds tokens 32 i + 8 k ... + 7, lowest bit first.
    bits = np.unpackbits(packed, axis=1, count=vocab, bitorder="little")  # (R, V) 0/1, zeros past the mask
    # An additive bias (bit - 1) * max * 2: 0 where allowed, overflowing to exactly -inf where not, without
    # a branchy masked_fill.
    bias = torch.from_numpy(bits).to(logits.device, torch.float32).sub_(1).mul_(_FLOAT32_MAX).mul_(2.0)
    index = upload([row for row, _ in masks], torch.int64, logits.device)
    logits.index_add_(0, index, bias)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets logits outside each row's top-k and top-p nucleus to -inf (the most likely token always
    survives)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # (1, V)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # (B, 1)
    drop = ranks >= k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # A token is outside the nucleus when the tokens ranked above it already hold top_p of the mass.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int], specs: list[SamplingSpec], request_ids: list[str]
) -> dict[str, TokenLogprobs]:
    """The drawn tokens' log-probabilities for `rows` of the batch (requests whose spec asks): fp32
    log_softmax of the raw logits (before temperature, top-k, top-p, as vLLM returns by default), the
    drawn token's rank (1 + how many tokens are strictly more likely) and the spec.logprobs most likely."""
    index = upload(rows, torch.int64, logits.device)
    lp = logits.index_select(0, index).float().log_softmax(dim=-1)  # (R, V)
    chosen = token_ids.index_select(0, index)  # (R,)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1))  # (R, 1)
    ranks = (lp > chosen_lp).sum(dim=-1) + 1  # (R,)
    k = min(max(specs[i].logprobs or 0 for i in rows), lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], chosen[:0].unsqueeze(0).expand(len(rows), 0))
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist()
    top_ids_l, top_lp_l = top_ids.tolist(), top_lp.tolist()
    out = {}
    for j, i in enumerate(rows):
        n = min(specs[i].logprobs or 0, k)
        out[request_ids[i]] = TokenLogprobs(
            chosen_l[j], chosen_lp_l[j], ranks_l[j], tuple(top_ids_l[j][:n]), tuple(top_lp_l[j][:n])
        )
    return out
