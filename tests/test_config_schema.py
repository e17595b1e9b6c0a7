"""The config's one field list (downscale_plugin/config.py) and the README's key table agree."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import toml

from downscale_plugin.config import DownscaleConfig, config_keys, load_config

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_key_rows() -> dict[str, str]:
    """Key → its default column, for every row of the README's ``| key | default | meaning |`` table."""
    text = README.read_text(encoding="utf-8")
    table = text[text.index("| key | default | meaning |") :].split("\n\n", 1)[0].splitlines()[2:]
    rows = {}
    for line in table:
        first, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for key in re.findall(r"`([a-z_]+)`", first):
            rows[key] = default if "," not in first else ""
    return rows


def test_readme_table_lists_exactly_the_config_keys():
    assert set(readme_key_rows()) == set(config_keys())


def test_readme_defaults_are_the_field_defaults():
    """Single-key rows whose default is a TOML literal state the field's default."""
    defaults = {f.name: f.default for f in fields(DownscaleConfig)}
    checked = 0
    for key, cell in readme_key_rows().items():
        literal = re.fullmatch(r"`([^`]+)`", cell)
        if literal and key in defaults:
            assert toml.loads(f"v = {literal.group(1)}")["v"] == defaults[key], key
            checked += 1
    assert checked >= 10


def test_every_key_has_help_and_parses_from_its_own_schema():
    assert all(config_keys().values())
    cfg = load_config(table={"gate": "strict", "max_tries": 3, "routes": [{"scale": 0.5, "sigma_min": 0.9}]})
    assert (cfg.gate, cfg.max_tries) == ("strict", 3)
