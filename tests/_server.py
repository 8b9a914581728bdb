"""The end-to-end test model repository: orca_gpt exactly as shipped (SmolLM2 by default) beside tiny
random GPT-2 variants that exercise queueing, cancellation and long runs in milliseconds per iteration."""

from __future__ import annotations

import shutil
from pathlib import Path

from checkpoints import make_gpt2

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO_ROOT / "model_repository" / "orca_gpt"

# name -> engine parameters overriding the shipped config.pbtxt
TINY_MODELS = {
    # A long context so a request can run for seconds: room to act while it is in flight.
    "orca_tiny": {"max_bs": "8", "n_slots": "8192"},
    # One request per iteration and a queue of two: the third waiting request is refused.
    "orca_tiny_q": {"max_bs": "1", "max_queue": "2", "n_slots": "4096"},
}


def _with_parameters(config: str, name: str, params: dict[str, str]) -> str:
    lines = []
    for line in config.splitlines():
        if line.startswith("name:"):
            line = f'name: "{name}"'
        for key, value in params.items():
            if line.startswith(f'parameters {{ key: "{key}"'):
                line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        lines.append(line)
    return "\n".join(lines) + "\n"


def build_test_repository(root: Path) -> tuple[Path, Path]:
    """Returns (model repository, tiny GPT-2 checkpoint directory)."""
    repo = root / "model_repository"
    tiny = make_gpt2(root / "tiny-gpt2", n_positions=2048)
    shutil.copytree(SHIPPED_MODEL, repo / "orca_gpt")
    config = (SHIPPED_MODEL / "config.pbtxt").read_text()
    for name, params in TINY_MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(SHIPPED_MODEL / "1" / "model.py", repo / name / "1" / "model.py")
        text = _with_parameters(config, name, {"model": str(tiny), **params})
        (repo / name / "config.pbtxt").write_text(text)
    return repo, tiny
