"""Builds a Triton model repository of orca_gpt variants that differ only in engine parameters, so that
one `make serve`-like Triton serves them side by side and `orca-bench trace --models a,b,...` compares
them in one run (docs/BENCHMARKS.md).

    python scripts/variant_repository.py OUT NAME:key=value,key=value [NAME:...]
    python scripts/variant_repository.py /tmp/repo orca_fp32: orca_chunked:max_num_batched_tokens=64

Each NAME is a copy of model_repository/orca_gpt with those config.pbtxt parameters set (an unknown key is
refused when Triton loads the model, with the list of allowed ones).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "model_repository" / "orca_gpt"


def make_variant(out: Path, name: str, params: dict[str, str]) -> Path:
    target = out / name
    shutil.copytree(SOURCE, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    text = re.sub(r'^name: "orca_gpt"', f'name: "{name}"', config.read_text(), count=1, flags=re.M)
    for key, value in params.items():
        line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        pattern = re.compile(rf'^parameters \{{ key: "{re.escape(key)}" value: \{{ string_value: "[^"]*" \}} \}}', re.M)
        text, n = pattern.subn(line, text)
        if n == 0:
            text += line + "\n"
    config.write_text(text)
    return target


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any(":" not in spec for spec in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for spec in argv[1:]:
        name, _, options = spec.partition(":")
        params = dict(kv.split("=", 1) for kv in options.split(",") if kv)
        print(make_variant(out, name, params))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
