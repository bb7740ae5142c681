"""The documentation's generated pages match their sources, and the README and every
``--help`` stay free of commit ids.

The command-line reference (``docs/gen_cli.py``), the run-log schema (``docs/gen_schema.py``)
and the results pages (``docs/gen_results.py``) are committed; each test regenerates one and
compares it byte for byte, so a flag, a record field or a result file changed without
regenerating fails here. ``mkdocs build --strict`` runs in ``.ci/test.sh``.
"""

from __future__ import annotations

import argparse
import re

import pytest
from script_loader import ROOT, load_script

HEX_ID = re.compile(r"\b[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("script", ["gen_cli", "gen_schema"])
def test_reference_pages_are_generated(script: str) -> None:
    mod = load_script(f"docs/{script}.py", f"docs_{script}")
    assert mod.PAGE.read_text() == mod.render(), f"run `python docs/{script}.py` and commit"


def test_results_pages_are_generated() -> None:
    mod = load_script("docs/gen_results.py", "docs_gen_results")
    pages = mod.render_all()
    assert pages, "no results pages"
    for name, text in pages.items():
        path = mod.OUT / name
        assert path.is_file() and path.read_text() == text, (
            f"docs/results/{name} is stale; run `python docs/gen_results.py` and commit"
        )


def test_results_rows_come_from_the_files() -> None:
    """Every oracle result file has its rows, naming its card and revision."""
    mod = load_script("docs/gen_results.py", "docs_gen_results")
    page = mod.oracle_page()
    for path in sorted(mod.RESULTS.glob("oracle-*.json")):
        _, rev = mod._name_parts(path)
        assert f"`{rev}" in page, path.name


def test_readme_is_a_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not HEX_ID.findall(text), HEX_ID.findall(text)
    # The two commands, exactly.
    assert (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
        "pip install -e . && dynpipe demo" in text
    )
    assert "\n.ci/test.sh\n" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def _helps(parser: argparse.ArgumentParser):
    yield parser.prog, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _helps(sub)


def test_help_has_no_commit_ids() -> None:
    from dynpipe.cli import build_parser

    found = {prog: HEX_ID.findall(text) for prog, text in _helps(build_parser())}
    assert not any(found.values()), {k: v for k, v in found.items() if v}
