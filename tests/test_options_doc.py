"""docs/OPTIONS.md is orca.EngineConfig's docstring rendered by scripts/options_doc.py, and that docstring
documents every field: the option reference cannot drift from the code (no server, no model)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from orca import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "options_doc.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("options_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_field_has_one_entry_in_the_docstring() -> None:
    docs = _load_script().option_docs(EngineConfig)  # ValueError names missing, unknown and repeated entries
    assert list(docs) == [f.name for f in dataclasses.fields(EngineConfig)]
    assert all(text.strip() for text in docs.values())


def test_the_sections_the_entries_cite_exist() -> None:
    """A quoted phrase in an entry ("Results: ...", "The converted-checkpoint cache") names a section of
    README.md or docs/BENCHMARKS.md (a heading, or a paragraph's bold lead), by its title or a prefix."""
    titles = []
    for doc in ("README.md", "docs/BENCHMARKS.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        titles += re.findall(r"^#+ (.+)$", text, re.M) + re.findall(r"\*\*([^*]+?)\.?\*\*", text)
    for name, text in _load_script().option_docs(EngineConfig).items():
        assert text.count('"') % 2 == 0, f"{name}: an unpaired quote"
        quoted = text.split('"')[1::2]  # "..." pairs, in order
        for cited in (q for q in quoted if " " in q):
            assert any(title.startswith(cited) for title in titles), f"{name}: no section {cited!r}"


def test_options_md_is_what_the_script_renders() -> None:
    script = _load_script()
    assert (ROOT / "docs" / "OPTIONS.md").read_text(encoding="utf-8") == script.render(EngineConfig), (
        "docs/OPTIONS.md is stale: run python scripts/options_doc.py"
    )
    assert script.main(["--check"]) == 0


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "OPTIONS.md"
    stale.write_text("stale\n")
    assert _load_script().main(["--check", "--output", str(stale)]) == 1


def test_the_rendered_defaults_are_config_pbtxt_strings_for_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_MODEL", raising=False)
    script = _load_script()
    raw = {f.name: script.pbtxt_default(f) for f in dataclasses.fields(EngineConfig)}
    assert EngineConfig.from_parameters(raw) == EngineConfig()


def test_an_undocumented_or_unknown_field_is_an_error() -> None:
    @dataclasses.dataclass
    class Options:
        """- a: documented.
        - b: documented
          over two lines.
        - c: no such field.
        """

        a: int = 1
        b: int = 2
        d: int = 3

    expected = r"without a '- name: text' entry: \['d'\]; entries that name no field: \['c'\]"
    with pytest.raises(ValueError, match=expected):
        _load_script().option_docs(Options)
