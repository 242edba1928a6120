"""Generated documentation stays true to the code it documents."""

from __future__ import annotations

from pathlib import Path

from core.settings import render_env_example, render_markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_settings_table_matches_settings_when_generated():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- settings-table:start -->\n", "<!-- settings-table:end -->"
    table = readme[readme.index(start) + len(start) : readme.index(end)]
    assert table == render_markdown_table(), "README settings table is stale: regenerate it from core.settings"


def test_env_example_lists_every_setting_when_generated():
    assert (ROOT / "deploy" / "env.example").read_text() == render_env_example(), (
        "deploy/env.example is stale: python -m core.settings --env > deploy/env.example"
    )


def test_readme_shows_the_two_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
