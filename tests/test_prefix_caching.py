"""Prefix caching parity (issue 25): reusing cached K/V never changes a token.

Greedy float32, tiny GPT-2 and tiny Llama (grouped-query attention), block sizes 1, 4 and 16. Each scenario
is a base prompt and prompts sharing prefixes of every length around block boundaries with it (k*bs - 1,
k*bs, k*bs + 1 tokens), the base prompt again, the base cut to one block and one block + 1 token, exact
prefixes of the base's prompt + output, and a prompt built on another request's prompt + output. It runs
one request after another (each sees everything the earlier ones computed) and all submitted at once
(max_bs 4: later requests see what the earlier ones have computed so far), through engines with caching
on and off. Every request's tokens must be transformers' greedy tokens; with caching on, the sequential
run's num_cached_tokens must be what the block arithmetic says (the longest common prefix with an earlier
request's computed tokens, whole blocks only, short of the prompt's last token), and 0 with caching off.
Also: chunked prefill and preemption (with eviction from a small pool), both admission policies, eviction
order (least recently used, only when no block is free), two requests reading the same cached blocks in one
iteration under each attention backend (flex too, through each request's block table), cache_salt
isolation, every block coming back, tensor parallelism 2 on gloo, and cache_salt validation.

The engines run with one torch thread: the tiny models are dominated by per-op overhead, and on a small
shared machine two threads make every iteration several times slower.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Sequence

import pytest
from _fixtures import (
    hf_greedy,
    one_torch_thread,  # noqa: F401 - autouse: one torch thread
    tiny_checkpoint,
    tiny_core,
    tiny_reference,
)

from orca import EngineConfig, EngineCore, SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A pool far larger than any scenario's K/V, so nothing is ever evicted in the exact-arithmetic runs.
BIG_POOL = 8192
# The base sequence of every scenario (ids below both tiny vocabularies and their EOS ids).
_BASE = tuple(random.Random(25).randrange(0, 190) for _ in range(64))
# Per block size: the k of the shared-prefix lengths k*bs - 1, k*bs, k*bs + 1.
BOUNDARY_BLOCKS = {1: (1, 4, 8), 4: (1, 2, 4), 16: (1, 2, 3)}


# -- the reference and the scenarios -------------------------------------------------------------------------
@functools.cache
def reference(family: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """transformers' greedy tokens for the prompt alone (batch of one)."""
    return tuple(hf_greedy(tiny_reference(family), list(prompt), MAX_TOKENS))


def _tail(m: int, avoid: int) -> tuple[int, ...]:
    """Three tokens to follow a shared prefix of m tokens; the first differs from the base's next token,
    so the common prefix with the base is exactly m tokens."""
    rng = random.Random(1000 + m)
    first = rng.choice([t for t in range(190) if t != avoid])
    return (first, rng.randrange(0, 190), rng.randrange(0, 190))


@functools.cache
def scenario(family: str, bs: int) -> tuple[tuple[int, ...], ...]:
    """The prompts, in submission order (the last three depend on transformers' output, so on the family)."""
    ks = BOUNDARY_BLOCKS[bs]
    n_base = ks[-1] * bs + 5
    base = _BASE[:n_base]
    prompts = [base]
    for k in ks:
        for m in (k * bs - 1, k * bs, k * bs + 1):
            prompts.append(base[:m] + _tail(m, base[m]))
    prompts.append(base)  # the whole prompt equal to an earlier one
    prompts.append(base[:bs])  # one block: its only block holds its last token, so nothing is reused
    prompts.append(base[: bs + 1])
    full = base + reference(family, base)  # the base's prompt + output; its last token was never fed
    prompts.append(full[: n_base + 3])  # an exact prefix of an earlier prompt + output
    prompts.append(full)
    # On another request's prompt + output (blocks filled by generated tokens of a non-base request).
    other = prompts[1 + 3 * 1 + 2]  # the shared prefix of ks[1] * bs + 1 tokens
    prompts.append(other + reference(family, other) + _tail(999, -1))
    assert len(set(prompts)) == len(prompts) - 1  # (only the repeated base)
    assert max(len(p) for p in prompts) + MAX_TOKENS <= 128  # the tiny models' context
    return tuple(prompts)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_cached(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], bs: int) -> list[int]:
    """num_cached_tokens of each request run alone after all the earlier ones, with nothing evicted: the
    longest common prefix with an earlier request's computed tokens (its prompt and every output token
    but the last, which is never fed), rounded down to whole blocks, capped at (prompt_len - 1) // bs * bs."""
    result = []
    for i, prompt in enumerate(prompts):
        best = max((_common_prefix(prompt, [*prompts[j], *outputs[j][:-1]]) for j in range(i)), default=0)
        result.append(min(best // bs * bs, (len(prompt) - 1) // bs * bs))
    return result


# -- running requests through a core -------------------------------------------------------------------------
def make_core(family: str, bs: int, caching: bool, **options) -> EngineCore:
    options = {"n_slots": BIG_POOL, "max_bs": 4, **options}
    return tiny_core(family, block_size=bs, enable_prefix_caching=caching, **options)


def run(
    core: EngineCore, prompts: Sequence[Sequence[int]], *, together: bool, salt: str | None = None, tag: str = ""
) -> tuple[list[tuple[int, ...]], list[int]]:
    """Runs the prompts one after another (each finished before the next is added) or all added at once;
    returns each request's tokens and num_cached_tokens."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    finished: set[str] = set()

    def drain() -> None:
        for _ in range(10_000):
            if not core.has_unfinished():
                return
            for out in core.step():
                assert out.error is None, out.error
                tokens[out.request_id].extend(out.new_token_ids)
                assert cached.setdefault(out.request_id, out.num_cached_tokens) == out.num_cached_tokens
                if out.finished:
                    assert out.finish_reason == "length" and out.request_id not in finished
                    finished.add(out.request_id)
        raise AssertionError("the engine did not finish its requests")

    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        core.validate(list(prompt), GREEDY, salt)
        core.add_request(rid, list(prompt), GREEDY, cache_salt=salt)
        tokens[rid] = []
        if not together:
            drain()
    drain()
    assert finished == set(ids)
    return [tuple(tokens[rid]) for rid in ids], [cached[rid] for rid in ids]


def run_both_ways(core: EngineCore, prompts: Sequence[Sequence[int]]) -> tuple:
    """The scenario one request after another, then all at once under another salt (so the first run's
    blocks cannot serve it), every block back after each; shuts the core down. (seq, together, stats)."""
    try:
        seq = run(core, prompts, together=False, tag="seq")
        assert_every_block_back(core)
        together = run(core, prompts, together=True, salt="together", tag="all")
        stats = core.stats()
        assert_every_block_back(core)
    finally:
        core.shutdown()
    return seq, together, stats


def assert_every_block_back(core: EngineCore) -> None:
    """No request holds a block: every block is free or cached and unreferenced (evictable)."""
    blocks = core.blocks
    assert blocks.owners() == {}
    assert blocks.num_allocated_blocks == 0 and core.stats().kv_allocated_blocks == 0
    assert blocks.num_free_blocks == blocks.num_blocks  # free + evictable
    assert all(blocks.refs(b) == 0 for b in range(blocks.num_blocks))
    assert blocks.num_evictable_blocks == blocks.num_cached_blocks  # every cached block is unreferenced
    if not blocks.enable_caching:
        assert blocks.num_cached_blocks == 0


# -- 1. exact reuse around block boundaries, both families, block sizes 1, 4, 16, both admission policies ------
# Each family and each block size meets both admission policies.
BOUNDARY_CASES = [
    ("gpt2", 1, "on_demand"),
    ("gpt2", 4, "reserve"),
    ("gpt2", 16, "on_demand"),
    ("llama", 1, "reserve"),
    ("llama", 4, "on_demand"),
    ("llama", 16, "reserve"),
]


@pytest.mark.parametrize(("family", "bs", "admission"), BOUNDARY_CASES)
def test_reuse_around_block_boundaries_matches_no_caching_and_transformers(
    family: str, bs: int, admission: str
) -> None:
    prompts = scenario(family, bs)
    expected_tokens = [reference(family, p) for p in prompts]
    expected = expected_cached(prompts, expected_tokens, bs)
    # The arithmetic is not trivially 0: m shared tokens reuse m // bs blocks (k*bs - 1 tokens: k - 1 blocks,
    # k*bs or k*bs + 1 tokens: k blocks, when bs > 1).
    ms = [m for k in BOUNDARY_BLOCKS[bs] for m in (k * bs - 1, k * bs, k * bs + 1)]
    assert expected[1 : 1 + len(ms)] == [m // bs * bs for m in ms]
    assert expected[prompts.index(prompts[0], 1)] == (len(prompts[0]) - 1) // bs * bs > 0  # the repeated base
    for caching in (True, False):
        core = make_core(family, bs, caching, kv_admission=admission)
        try:
            seq_tokens, seq_cached = run(core, prompts, together=False, tag="seq")
            assert_every_block_back(core)
            before = core.stats()
            # All at once, under a salt of their own: the sequential run's blocks are out of reach.
            together_tokens, together_cached = run(core, prompts, together=True, salt="together", tag="all")
            after = core.stats()
            assert_every_block_back(core)
        finally:
            core.shutdown()
        assert seq_tokens == expected_tokens, f"caching {caching}: one after another"
        assert together_tokens == expected_tokens, f"caching {caching}: all at once"
        assert after.preemptions == 0  # (the big pool: the arithmetic below counts on it)
        if caching:
            assert seq_cached == expected
            assert before.prefix_cache_hits == sum(expected) > 0
            assert before.prefix_cache_queries == sum(len(p) for p in prompts)
            assert before.prefix_cache_blocks > 0
            # All at once, a request can only find what earlier arrivals have computed so far.
            assert all(c % bs == 0 and c <= e for c, e in zip(together_cached, expected)), together_cached
            assert after.prefix_cache_hits - before.prefix_cache_hits == sum(together_cached) > 0
        else:
            assert seq_cached == together_cached == [0] * len(prompts)
            assert after.prefix_cache_hits == after.prefix_cache_queries == after.prefix_cache_blocks == 0


# -- 2 and 3. chunked prefill and preemption, both admission policies --------------------------------------------
PRESSURE_CASES = [
    pytest.param("llama", 4, {"max_num_batched_tokens": 8, "kv_admission": "reserve"}, id="llama-chunked-reserve"),
    pytest.param("gpt2", 16, {"max_num_batched_tokens": 8, "kv_admission": "on_demand"}, id="gpt2-chunked-on_demand"),
    # 8 blocks of 4: the scenario's largest request (25 + 4 tokens) just fits; the cache must evict, and four
    # requests at once do not fit (on_demand preempts).
    pytest.param("llama", 4, {"n_slots": 32, "kv_admission": "on_demand"}, id="llama-preempt"),
    pytest.param(
        "gpt2", 4, {"n_slots": 32, "max_num_batched_tokens": 8, "kv_admission": "on_demand"},
        id="gpt2-chunked-preempt",
    ),
]


@pytest.mark.parametrize(("family", "bs", "options"), PRESSURE_CASES)
def test_chunked_prefill_and_preemption_match_no_caching(family: str, bs: int, options: dict) -> None:
    prompts = scenario(family, bs)
    expected_tokens = [reference(family, p) for p in prompts]
    small_pool = "n_slots" in options
    results = {}
    for caching in (True, False):
        core = make_core(family, bs, caching, **options)
        seq, together, stats = run_both_ways(core, prompts)
        results[caching] = seq, together, stats
        assert seq[0] == expected_tokens, f"caching {caching}: one after another"
        assert together[0] == expected_tokens, f"caching {caching}: all at once"
        if small_pool:
            assert stats.preemptions > 0, f"caching {caching}: the pool must be small enough to preempt"
    (seq_on, together_on, stats_on), (seq_off, together_off, stats_off) = results[True], results[False]
    assert seq_off[1] == together_off[1] == [0] * len(prompts)
    assert stats_off.prefix_cache_hits == stats_off.prefix_cache_queries == 0
    assert stats_on.prefix_cache_hits > 0 and sum(together_on[1]) > 0
    expected = expected_cached(prompts, expected_tokens, bs)
    if small_pool:  # blocks get evicted: at most what the arithmetic allows, never a partial block
        assert all(c % bs == 0 and c <= e for c, e in zip(seq_on[1], expected)), seq_on[1]
        assert 0 < sum(seq_on[1]) < sum(expected)  # (some prefix was evicted before it was asked for)
    else:  # a token budget changes nothing of what is cached
        assert seq_on[1] == expected


# -- eviction: least recently used, and only when no free block is left ----------------------------------------------
@pytest.mark.parametrize(("n_slots", "expected"), [(32, [0, 0, 8, 0, 8, 0]), (BIG_POOL, [0, 0, 8, 0, 8, 8])])
def test_eviction_is_least_recently_used_and_only_when_the_pool_is_full(n_slots: int, expected: list[int]) -> None:
    """Block size 4, max_tokens 4, on_demand, one request at a time (each computes prompt + 3 tokens).
    With 8 blocks: A (12 tokens) leaves its 3 full blocks cached, B (12 tokens, unrelated) takes free blocks
    and leaves its 3; A again takes A0 and A1 by reference (its third block is a twin of A2, left uncached)
    and releases them as the most recently used. C (20 tokens, unrelated) needs 6 blocks with 2 free: it
    evicts the 4 least recently used, A2, B2, B1 and B0. So A finds its 2 blocks, B nothing. With a pool
    that never fills, nothing is evicted and B finds its 2 blocks."""
    family, bs = "llama", 4
    rng = random.Random(4)
    a = _BASE[:12]
    b = tuple(rng.randrange(0, 190) for _ in range(12))
    c = tuple(rng.randrange(0, 190) for _ in range(20))
    prompts = [a, b, a, c, a, b]
    core = make_core(family, bs, True, n_slots=n_slots, kv_admission="on_demand")
    try:
        tokens, cached = run(core, prompts, together=False)
        assert_every_block_back(core)
    finally:
        core.shutdown()
    assert tokens == [reference(family, p) for p in prompts]
    assert cached == expected


# -- requests sharing cached blocks in the same iteration, per attention backend ------------------------------------
@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        "batched",
        "flex",
    ],
)
def test_requests_sharing_blocks_in_one_iteration(backend: str) -> None:
    """b takes a's cached prompt blocks by reference and both run in the same iterations (a in increment, b
    in initiation, then both in increment): every attention backend must let both read the shared blocks
    (flex through each request's block table in its mask)."""
    family, bs = "gpt2", 4
    prompt = scenario(family, bs)[0][:10]  # 2 full blocks and 2 tokens
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = hf_greedy(tiny_reference(family), list(prompt), 3)
    # (a small pool: flex on a CPU evaluates its mask over every slot of the pool)
    core = make_core(family, bs, True, n_slots=32, attention_backend=backend)
    try:
        core.add_request("a", list(prompt), params)
        (out,) = core.step()  # a's prompt: its 2 full blocks enter the cache
        core.add_request("b", list(prompt), params)
        tokens: dict[str, list[int]] = {"a": list(out.new_token_ids), "b": []}
        cached = {}
        first = True
        while core.has_unfinished():
            outputs = core.step()
            if first:  # b's prompt beside a's increment, over the same 2 blocks
                assert sorted(o.request_id for o in outputs) == ["a", "b"]
                assert core.blocks.table("a")[:2] == core.blocks.table("b")[:2]
                assert all(core.blocks.refs(block) == 2 for block in core.blocks.table("b")[:2])
                first = False
            for out in outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
        assert cached == {"a": 0, "b": 8}
        assert tokens == {"a": expected, "b": expected}
        assert_every_block_back(core)
    finally:
        core.shutdown()


# -- 4. cache_salt -------------------------------------------------------------------------------------------------
def test_cache_salt_isolates_prefixes() -> None:
    family, bs = "llama", 4
    prompt = scenario(family, bs)[0]
    longer = prompt + reference(family, prompt)[:4] + _tail(77, -1)  # on the prompt and its first outputs
    full = (len(prompt) - 1) // bs * bs
    extended = expected_cached([prompt, longer], [reference(family, prompt), ()], bs)[1]
    assert extended > full
    core = make_core(family, bs, True)
    try:
        steps = [  # (salt, prompt, cached tokens expected)
            ("a", prompt, 0),  # first of its salt
            ("b", prompt, 0),  # another salt: the "a" blocks are not its
            ("a", prompt, full),
            (None, prompt, 0),  # no salt is a salt of its own
            ("A", prompt, 0),
            ("a", longer, extended),
            ("b", longer, extended),
            (None, prompt, full),
            ("\u00e9" * 3, prompt, 0),
            ("\u00e9" * 3, longer, extended),
        ]
        for i, (salt, p, cached) in enumerate(steps):
            tokens, got = run(core, [p], together=False, salt=salt, tag=f"s{i}-")
            assert got == [cached], (i, salt)
            assert tokens == [reference(family, p)], (i, salt)
        assert_every_block_back(core)
    finally:
        core.shutdown()


# -- 6. tensor parallelism 2 on gloo ----------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_tensor_parallel_prefix_caching_matches_no_caching() -> None:
    family, bs = "llama", 4
    prompts = scenario(family, bs)
    expected_tokens = [reference(family, p) for p in prompts]
    expected = expected_cached(prompts, expected_tokens, bs)
    results = {}
    for caching in (True, False):
        core = EngineCore(EngineConfig(
            model=str(tiny_checkpoint(family)), device="cpu", tensor_parallel_size=2, block_size=bs,
            n_slots=BIG_POOL, max_bs=4, enable_prefix_caching=caching,
        ))
        seq, together, stats = run_both_ways(core, prompts)
        results[caching] = seq, together, stats
        assert seq[0] == together[0] == expected_tokens, f"caching {caching}"
    (seq_on, together_on, stats_on), (seq_off, together_off, stats_off) = results[True], results[False]
    assert seq_on[1] == expected
    assert stats_on.prefix_cache_hits > 0 and sum(together_on[1]) > 0
    assert seq_off[1] == together_off[1] == [0] * len(prompts)
    assert stats_off.prefix_cache_hits == 0


# -- 7. validation ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def validating_core() -> Iterator[EngineCore]:
    core = make_core("gpt2", 4, True, n_slots=256)
    yield core
    core.shutdown()


@pytest.mark.parametrize(
    ("salt", "got"),
    [(5, "got int"), (b"salt", "got bytes"), (["a"], "got list"), ("", "got 0 characters"),
     ("x" * 1025, "got 1025 characters")],
    ids=["int", "bytes", "list", "empty", "1025-chars"],
)
def test_bad_cache_salt_is_refused(validating_core: EngineCore, salt: object, got: str) -> None:
    with pytest.raises(ValueError, match=f"cache_salt must be a string of 1 to 1024 characters, {got}"):
        validating_core.validate([1, 2, 3], GREEDY, salt)


def test_good_cache_salts_are_accepted(validating_core: EngineCore) -> None:
    for salt in (None, "x", "x" * 1024, "\u00e9\u4e2d"):
        validating_core.validate([1, 2, 3], GREEDY, salt)
