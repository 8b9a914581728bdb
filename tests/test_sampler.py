"""The sampler: counter-based uniforms, greedy, temperature, top-k, top-p, and per-request seeds that do
not depend on the rest of the batch. Pure tensor code on tiny vocabularies; deterministic seeds throughout,
so the statistical checks cannot flake."""

from __future__ import annotations

import random

import pytest
import torch

from orca.core.plan import SamplingSpec
from orca.sampling_params import SamplingParams
from orca.worker.sampler import SamplingTensors, counter_uniform, sample


def spread_seeds(n: int, seed: int = 0) -> torch.Tensor:
    """n distinct, far-apart 63-bit seeds (what the engine draws for requests that give none)."""
    rng = random.Random(seed)
    return torch.tensor([rng.getrandbits(63) for _ in range(n)], dtype=torch.int64)


def tensors(
    n: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seeds: torch.Tensor | None = None,
    step: int = 0,
) -> SamplingTensors:
    """SamplingTensors for n rows that share the same options."""
    return SamplingTensors(
        temperature=torch.full((n,), temperature, dtype=torch.float32),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p, dtype=torch.float32),
        seeds=spread_seeds(n) if seeds is None else seeds,
        steps=torch.full((n,), step, dtype=torch.int64),
        all_greedy=temperature == 0,
        any_filter=temperature > 0 and (top_k > 0 or top_p < 1),
    )


def empirical(logits: torch.Tensor, n: int, **options: object) -> torch.Tensor:
    """Frequencies of sample() over n seeds for one row of logits."""
    ids = sample(logits.expand(n, -1), tensors(n, **options))  # type: ignore[arg-type]
    return torch.bincount(ids, minlength=logits.shape[-1]).double() / n


def chi_square(freq: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    mask = probs > 0
    expected = probs[mask].double() * n
    return float((((freq[mask] * n) - expected) ** 2 / expected).sum())


# -- counter_uniform -------------------------------------------------------------------------------
def test_counter_uniform_is_in_the_open_unit_interval_and_roughly_uniform() -> None:
    seeds = spread_seeds(256)
    u = counter_uniform(seeds, torch.arange(256), 4096)  # (256, 4096): a million draws
    assert u.shape == (256, 4096) and u.dtype == torch.float32
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.double().mean()) - 0.5) < 0.002
    assert abs(float(u.double().var()) - 1 / 12) < 0.002
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert torch.allclose(hist, torch.full_like(hist, 1 / 16), atol=0.002)


def test_counter_uniform_depends_only_on_seed_step_and_token() -> None:
    seeds, steps = torch.tensor([11, 22, 33]), torch.tensor([0, 5, 9])
    u = counter_uniform(seeds, steps, 50)
    alone = torch.cat([counter_uniform(seeds[i : i + 1], steps[i : i + 1], 50) for i in range(3)])
    assert torch.equal(u, alone)
    assert torch.equal(counter_uniform(seeds, steps, 20), u[:, :20])  # token t's number ignores the vocab size
    assert not torch.equal(u[1], counter_uniform(seeds[1:2], steps[1:2] + 1, 50)[0])  # next step: new numbers


def test_counter_uniform_never_returns_one() -> None:
    # Found by a brute-force scan: the hash of (seed 2**20 + 820578, step 0, token 0) has all top 24 bits
    # set, which happens for about one (seed, step, token) in 2**24, i.e. in ~0.3% of the draws of a
    # 49152-token vocabulary.
    u = counter_uniform(torch.tensor([(1 << 20) + 820578]), torch.tensor([0]), 1)
    assert float(u) < 1.0


def test_adjacent_seeds_draw_independent_numbers() -> None:
    u = counter_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 1000)
    assert float((u[0, 1:] == u[1, :-1]).double().mean()) < 0.01


def test_requests_with_adjacent_seeds_sample_independently() -> None:
    # Flat logits: the draw is the argmax of the noise alone. With the shifted noise, seed s + 1 picks
    # exactly the token before the one seed s picks, at every step: the two "random" streams are one stream.
    vocab, n_steps = 64, 40
    logits = torch.zeros(2, vocab)
    shifted = 0
    for step in range(n_steps):
        a, b = sample(logits, tensors(2, seeds=torch.tensor([1, 2]), step=step)).tolist()
        shifted += b == a - 1
    assert shifted < n_steps // 4


# -- greedy and filters ----------------------------------------------------------------------------
def test_greedy_is_argmax() -> None:
    logits = torch.randn(64, 97, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, tensors(64, temperature=0.0)), logits.argmax(-1))


@pytest.mark.parametrize(
    "options", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "temperature": 5.0}, {"top_p": 1e-6, "top_k": 3}]
)
def test_filters_that_keep_one_token_are_greedy(options: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(512, 101, generator=gen) * 3
    assert torch.equal(sample(logits, tensors(512, **options)), logits.argmax(-1))


@pytest.mark.parametrize("options", [{"top_k": 1}, {"top_p": 0.5}])
def test_a_filtered_token_is_never_sampled(options: dict) -> None:
    seed = (1 << 20) + 820578  # token 0 draws u == 1.0 at step 0 (see test_counter_uniform_never_returns_one)
    logits = torch.tensor([[-4.0, 0.0, 5.0, 1.0]])  # token 2 holds > 97% of the mass
    st = tensors(1, seeds=torch.tensor([seed]), **options)
    assert sample(logits, st).tolist() == [2]


@pytest.mark.parametrize(
    "temperature",
    [
        1e-3,
        1e-20,
        1e-39,
    ],
)
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    # SamplingParams accepts any finite temperature > 0; as it goes to 0 sampling must become greedy.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 97, generator=gen) * 10
    assert torch.equal(sample(logits, tensors(64, temperature=temperature)), logits.argmax(-1))


def test_mixed_batch_rows_follow_their_own_options() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=gen) * 2
    reqs = [
        _request(0, SamplingParams(temperature=0)),
        _request(1, SamplingParams(temperature=0.8, top_k=5, seed=3)),
        _request(2, SamplingParams(temperature=1.0, top_k=1, seed=4)),
        _request(3, SamplingParams(temperature=1.2, top_p=0.9, seed=5)),
    ]
    st = _tensors(reqs)
    assert not st.all_greedy and st.any_filter
    ids = sample(logits, st)
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()
    assert ids[1] in logits[1].topk(5).indices
    # Each sampled row draws the same token alone as inside the batch.
    for i in (1, 3):
        alone = sample(logits[i : i + 1], _tensors([reqs[i]]))
        assert alone.item() == ids[i].item()


def _request(i: int, params: SamplingParams) -> SamplingSpec:
    """What a worker receives for a request in a plan (orca/core/plan.py)."""
    seed = params.seed if params.seed is not None else 99
    return SamplingSpec(params.temperature, params.top_k, params.top_p, seed)


def _tensors(specs: list[SamplingSpec]) -> SamplingTensors:
    return SamplingTensors.from_specs(specs, [0] * len(specs), torch.device("cpu"))


# -- the sampled distribution ----------------------------------------------------------------------
# chi-square with 5 degrees of freedom (6 tokens): P(X > 30) ~ 1.5e-5; the seeds are fixed, so a pass
# is reproducible and a biased sampler fails by orders of magnitude (hundreds or more).
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
N = 40_000


def test_temperature_one_samples_the_softmax() -> None:
    probs = LOGITS[0].softmax(-1)
    freq = empirical(LOGITS, N, temperature=1.0)
    assert chi_square(freq, probs, N) < 30
    assert freq[-1] > 0  # even a ~0.6% token is drawn


def test_temperature_rescales_the_distribution() -> None:
    probs = (LOGITS[0] / 0.5).softmax(-1)
    freq = empirical(LOGITS, N, temperature=0.5)
    assert chi_square(freq, probs, N) < 30
    assert not chi_square(freq, LOGITS[0].softmax(-1), N) < 30  # discriminating: not the T=1 softmax


def test_top_k_renormalises_over_the_k_most_likely() -> None:
    probs = torch.zeros(6)
    probs[:3] = LOGITS[0, :3].softmax(-1)
    freq = empirical(LOGITS, N, top_k=3)
    assert freq[3:].sum() == 0
    assert chi_square(freq, probs, N) < 30


def test_top_p_keeps_the_smallest_nucleus_holding_p() -> None:
    full = LOGITS[0].softmax(-1)  # 0.561, 0.206, 0.125, 0.076, ...: 0.561 + 0.206 < 0.8 <= + 0.125
    probs = torch.zeros(6)
    probs[:3] = full[:3] / full[:3].sum()
    freq = empirical(LOGITS, N, top_p=0.8)
    assert freq[3:].sum() == 0
    assert chi_square(freq, probs, N) < 30
