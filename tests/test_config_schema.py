"""The config's one field list (downscale_plugin/config.py) and the README's key table agree."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import toml

from downscale_plugin.config import ConfigError, FasterDitConfig, MapConfig, config_fields, config_keys, load_config

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
    defaults = {key: f.default for key, f in config_fields().items()}
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


def test_nested_settings_take_flat_keys_and_check_themselves():
    """``map_draws`` fills ``cfg.map.draws``, ``sigma_policy`` fills ``cfg.fasterdit.sigma_policy``;
    a settings object built directly is checked against the same schema."""
    cfg = load_config(table={"mode": "map", "map_out": "m", "map_draws": 4, "direction_loss_weight": 0.2})
    assert (cfg.map.draws, cfg.map.out, cfg.fasterdit.direction_loss_weight) == (4, "m", 0.2)
    assert cfg.map == replace(MapConfig(), draws=4, out="m") and cfg.fasterdit == FasterDitConfig(direction_loss_weight=0.2)
    with pytest.raises(ConfigError, match=r"draws: 1 is out of range \(allowed: 2 to 4096\)"):
        MapConfig(draws=1)
    with pytest.raises(ConfigError, match="positions: 'near' is not allowed"):
        FasterDitConfig(positions="near")


def test_the_measurement_groups_keep_their_toml_keys_and_name_them_when_built_directly():
    """The certifier's, the map's and the provenance keys live in ``certify_config.py``, spelled as users always wrote
    them; a group built directly names the key as written, with what is allowed."""
    from downscale_plugin.certify_config import CertifyConfig, WindowsProvenance

    measured = {key for key in config_keys() if key.startswith(("map_", "certify_", "windows_"))}
    assert measured == {
        *(f"map_{k}" for k in ("ratios", "bins", "draws", "images", "margin", "simultaneous", "out", "reenc", "pixel")),
        *(f"certify_{k}" for k in ("budget", "draws", "spot_checks", "resume", "reuse", "cache", "unpaid")),
        *(f"windows_{k}" for k in ("model", "arch", "native", "margin", "method", "images", "version", "date", "foreign")),
    }
    with pytest.raises(ConfigError, match=r"certify_budget: 0.9 is out of range \(allowed: 0 to 0.5\)"):
        CertifyConfig(budget=0.9)
    with pytest.raises(ConfigError, match=r"windows_foreign: 'ignore' is not allowed \(allowed: error, warn\)"):
        WindowsProvenance(foreign="ignore")
    assert load_config(table={"mode": "auto", "map_out": "m", "certify_budget": 0.2}).certify == CertifyConfig(budget=0.2)


def test_host_check_defaults_to_error_takes_warn_and_names_its_values_on_a_bad_one():
    routed = {"routes": [{"scale": 0.5, "sigma_min": 0.9}]}
    assert load_config(table=routed).host_check == "error"
    assert load_config({"host_check": "warn"}, table=routed).host_check == "warn"
    with pytest.raises(ConfigError) as raised:
        load_config({"host_check": "ignore"}, table={"host_check": "off"})
    text = str(raised.value)
    assert "ds_host_check: 'ignore' is not allowed (allowed: error, warn)" in text
    assert "host_check: 'off' is not allowed (allowed: error, warn)" in text
