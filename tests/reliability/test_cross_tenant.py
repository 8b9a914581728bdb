"""A cross-tenant probe of the prefix cache (README "Security"): tenant B, with its own API key, makes 100
guesses at prompts tenant A has just cached, and learns nothing (orca-openai --cache-salt-from-key).

Each round, A sends a fresh secret prompt (many full blocks and half a block more) twice: its repeat must
find every full block in the cache (cached_tokens, the positive control, checked every round, so the secret
is cached when B guesses). Then B sends two guesses of the same length, in random order: a right one, the
secret's first k blocks (k from 1 to all of them) and other tokens after, and a wrong one, the right one with
one token of its first block changed (so the two differ by one token). Every guess of B starts with a block no
other guess of B's started with: none can hit B's own earlier guesses. Streaming, the client times each
request's first token (TTFT).

* Salts from keys, cached_tokens reported (to see what a tenant could learn): every guess reports
  cached_tokens 0, and a right guess's usage is exactly a wrong one's.
* The negative control, the same probe without --cache-salt-from-key: a right guess reports its k blocks;
  the oracle exists there, so the probe can fail.
* Neither flag (the default): usage has no prompt_tokens_details (its cache is shared as in the control).

TTFT is printed, right guesses against wrong ones and A's repeat against its first request, and never asserted:
no test depends on a wall-clock window (the control's figures show what a timing attacker would see).

CI size: orca_tiny (tiny GPT-2, 2,048 positions), secrets of 96 blocks (1,544 tokens: a prefill of about 40 ms
on 2 idle cores, a hit about 15 ms). Full size (``stress``, make test-stress): the shipped SmolLM2 orca_gpt,
secrets of 32 blocks (seconds of prefill a request). A round allocates about three secrets' blocks, far fewer
than either model's pool: nothing A cached is evicted before B's guesses of the round.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from _reliability import report, size
from _server import orca_openai

KEY_A, KEY_B = "sk-probe-tenant-a", "sk-probe-tenant-b"
BLOCK = 16  # the shipped block_size, the tiny models' too
MODES = {  # orca-openai's options beside the two keys
    "salted": ("--cache-salt-from-key", "--enable-prompt-tokens-details"),
    "unsalted": ("--enable-prompt-tokens-details",),
    "default": (),
}


@dataclass(frozen=True)
class ProbeSize:
    model: str
    guesses: int  # B's: half right, half wrong, two a round
    secret_blocks: int  # full blocks in each of A's secrets
    vocab: int  # token ids are drawn from [1, vocab)
    timeout: float  # per request


def ci_size(default_mode: bool = False) -> ProbeSize:
    guesses = size("ORCA_CI_CROSS_TENANT_GUESSES", 100)
    if default_mode:  # only the absence of cached_tokens to check
        guesses = size("ORCA_CI_CROSS_TENANT_DEFAULT_GUESSES", 20)
    return ProbeSize("orca_tiny", int(guesses), int(size("ORCA_CI_CROSS_TENANT_BLOCKS", 96)), 210, 120)


def stress_size() -> ProbeSize:
    return ProbeSize("orca_gpt", int(size("ORCA_STRESS_CROSS_TENANT_GUESSES", 100)),
                     int(size("ORCA_STRESS_CROSS_TENANT_BLOCKS", 32)), 49000, 600)


@dataclass
class Answer:
    ttft: float  # seconds from sending to the first event with a choice
    usage: dict[str, Any]

    @property
    def cached(self) -> int | None:
        details = self.usage.get("prompt_tokens_details")
        return None if details is None else details["cached_tokens"]


@dataclass
class Round:
    k: int  # blocks of the secret the right guess begins with
    first: Answer  # A's secret, the first time
    repeat: Answer  # A's secret again
    right: Answer  # B's
    wrong: Answer  # B's


def ask(session: requests.Session, url: str, key: str, s: ProbeSize, prompt: list[int]) -> Answer:
    body = {"model": s.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, usage = None, None
    start = time.perf_counter()
    with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, stream=True,
                      timeout=s.timeout) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(chunk_size=None):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if event["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                usage = event["usage"]
    assert ttft is not None and usage is not None, f"no token or no usage: {prompt[:4]}..."
    return Answer(ttft, usage)


def probe(url: str, s: ProbeSize, seed: int) -> list[Round]:
    rng = random.Random(seed)
    length = s.secret_blocks * BLOCK + BLOCK // 2
    n_rounds = max(1, s.guesses // 2)

    def other(token: int) -> int:
        return rng.choice([t for t in range(1, min(s.vocab, 256)) if t != token])

    # k from 1 to every block, in random order: no k is tied to a time of the run (its load)
    ks = [1 + round(j * (s.secret_blocks - 1) / max(1, n_rounds - 1)) for j in range(n_rounds)]
    rng.shuffle(ks)
    rounds = []
    with requests.Session() as a, requests.Session() as b:
        for k in ks:
            secret = [rng.randrange(1, s.vocab) for _ in range(length)]
            right = secret[: k * BLOCK] + [other(secret[k * BLOCK])]
            right += [rng.randrange(1, s.vocab) for _ in range(length - len(right))]
            wrong = list(right)
            at = rng.randrange(BLOCK)
            wrong[at] = other(right[at])
            first = ask(a, url, KEY_A, s, secret)
            repeat = ask(a, url, KEY_A, s, secret)
            if rng.random() < 0.5:  # either first: neither always follows the owner's repeat
                got_right = ask(b, url, KEY_B, s, right)
                got_wrong = ask(b, url, KEY_B, s, wrong)
            else:
                got_wrong = ask(b, url, KEY_B, s, wrong)
                got_right = ask(b, url, KEY_B, s, right)
            rounds.append(Round(k, first, repeat, got_right, got_wrong))
    return rounds


def _ms(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 1) if values else None


def _values(values: list[int | None]) -> Any:
    """The cached_tokens seen: their set, or its range where it is large."""
    seen = sorted({v for v in values if v is not None})
    if None in values:
        return "absent" if not seen else [*seen, "absent"]
    return seen if len(seen) <= 4 else {"min": seen[0], "max": seen[-1], "distinct": len(seen)}


def figures(rounds: list[Round], s: ProbeSize, mode: str, duration: float) -> dict[str, Any]:
    right, wrong = [r.right.ttft for r in rounds], [r.wrong.ttft for r in rounds]
    long_ = [r for r in rounds if 2 * r.k >= s.secret_blocks]  # right guesses of half the secret or more
    wrong_median = statistics.median(wrong)
    return {
        "mode": mode, "options": list(MODES[mode]), "model": s.model, "guesses": 2 * len(rounds),
        "secret_tokens": s.secret_blocks * BLOCK + BLOCK // 2, "duration_s": round(duration, 1),
        "owner_first_ttft_ms": _ms([r.first.ttft for r in rounds]),
        "owner_repeat_ttft_ms": _ms([r.repeat.ttft for r in rounds]),
        "owner_repeat_cached_tokens": _values([r.repeat.cached for r in rounds]),
        "right_guess_ttft_ms": _ms(right), "wrong_guess_ttft_ms": _ms(wrong),
        "right_minus_wrong_ttft_ms_paired_median": _ms([r.right.ttft - r.wrong.ttft for r in rounds]),
        "right_guesses_below_the_wrong_median": round(sum(t < wrong_median for t in right) / len(right), 2),
        "rounds_whose_right_guess_was_faster": round(sum(r.right.ttft < r.wrong.ttft for r in rounds) / len(rounds), 2),
        "half_or_more_right_guesses": len(long_),
        "half_or_more_right_guess_ttft_ms": _ms([r.right.ttft for r in long_]),
        "half_or_more_right_minus_wrong_ttft_ms_paired_median": _ms([r.right.ttft - r.wrong.ttft for r in long_]),
        "half_or_more_right_below_the_wrong_median": (
            round(sum(r.right.ttft < wrong_median for r in long_) / len(long_), 2) if long_ else None),
        "half_or_more_rounds_whose_right_guess_was_faster": (
            round(sum(r.right.ttft < r.wrong.ttft for r in long_) / len(long_), 2) if long_ else None),
        "right_guess_cached_tokens": _values([r.right.cached for r in rounds]),
        "wrong_guess_cached_tokens": _values([r.wrong.cached for r in rounds]),
    }


def run_probe(server: Any, s: ProbeSize, mode: str, tmp_path: Path, seed: int) -> list[Round]:
    log = tmp_path / "orca-openai.log"
    with orca_openai(server, log, KEY_A, "--api-key", KEY_B, *MODES[mode]) as url:
        start = time.monotonic()
        rounds = probe(url, s, seed)
        duration = time.monotonic() - start
    figs = figures(rounds, s, mode, duration)
    path = report(f"cross_tenant_{mode}_{s.model}", figs, tmp_path)
    print(f"\ncross-tenant probe ({mode}): {path}\n" + "\n".join(f"  {k}: {v}" for k, v in figs.items()))
    length = s.secret_blocks * BLOCK + BLOCK // 2
    for r in rounds:  # the same prompt length everywhere: the usage differs only where the cache shows
        assert {x.usage["prompt_tokens"] for x in (r.first, r.repeat, r.right, r.wrong)} == {length}, r
    return rounds


def check_salted(rounds: list[Round], s: ProbeSize) -> None:
    full = s.secret_blocks * BLOCK
    for r in rounds:
        assert (r.first.cached, r.repeat.cached) == (0, full), r  # a fresh secret; the owner's repeat hits
        assert (r.right.cached, r.wrong.cached) == (0, 0), r  # B learns nothing, however much it guessed right
        assert r.right.usage == r.wrong.usage, r  # a right guess is answered as a wrong one


def check_unsalted(rounds: list[Round], s: ProbeSize) -> None:
    full = s.secret_blocks * BLOCK
    for r in rounds:
        assert (r.first.cached, r.repeat.cached) == (0, full), r
        assert (r.right.cached, r.wrong.cached) == (r.k * BLOCK, 0), r  # the oracle: B reads A's k blocks
    assert min(r.k for r in rounds) == 1 and (max(r.k for r in rounds) == s.secret_blocks or len(rounds) == 1)


def check_default(rounds: list[Round]) -> None:
    for r in rounds:
        for answer in (r.first, r.repeat, r.right, r.wrong):
            assert "prompt_tokens_details" not in answer.usage, answer
            assert set(answer.usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}, answer


# Seeds: each orca-openai's prompts are its own (the Triton's prefix cache outlives them; unsalted prompts
# would otherwise meet those of an earlier probe); the random token ids are this module's alone.
def test_another_key_learns_nothing_from_guesses_at_a_cached_prefix(orca_server: Any, tmp_path: Path) -> None:
    s = ci_size()
    check_salted(run_probe(orca_server, s, "salted", tmp_path, seed=1001), s)


def test_without_salts_from_keys_the_same_guesses_read_the_other_tenants_cache(
    orca_server: Any, tmp_path: Path
) -> None:
    s = ci_size()
    check_unsalted(run_probe(orca_server, s, "unsalted", tmp_path, seed=1002), s)


def test_by_default_usage_reports_no_cached_tokens(orca_server: Any, tmp_path: Path) -> None:
    check_default(run_probe(orca_server, ci_size(default_mode=True), "default", tmp_path, seed=1003))


@pytest.mark.stress
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("mode", ["salted", "unsalted"])
def test_cross_tenant_probe_stress(orca_server: Any, tmp_path: Path, mode: str) -> None:
    s = stress_size()
    rounds = run_probe(orca_server, s, mode, tmp_path, seed={"salted": 2001, "unsalted": 2002}[mode])
    (check_salted if mode == "salted" else check_unsalted)(rounds, s)
