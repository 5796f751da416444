"""docs/configuration.md's settings table is generated from EngineConfig (scripts/config_table.py):
it fails here when the committed table and the code drift apart, as test_interfaces does for the
generated config.pbtxt files."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from specguide.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_settings_table_is_the_generated_one():
    script = _script()
    doc = script.DOC.read_text()
    assert doc == script.render(doc), "run `.venv/bin/python scripts/config_table.py`"


def test_the_table_has_every_setting_with_its_default():
    table = _script().table()
    for f in dataclasses.fields(EngineConfig):
        assert f"| `{f.name}` |" in table, f.name
    assert '| `max_seq_len` | int | `0` |' in table
    assert '| `drafter` | str | `"hybrid"` | one of `ngram`' in table


def test_every_setting_has_a_description():
    comments = _script().field_comments(EngineConfig)
    choices = _script().CHOICES
    missing = [f.name for f in dataclasses.fields(EngineConfig) if not comments.get(f.name) and f.name not in choices]
    assert missing == [], f"settings without a comment in config.py: {missing}"
