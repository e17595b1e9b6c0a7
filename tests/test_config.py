"""Config schema: every bad config is rejected naming its key; the three sources merge as documented."""

from __future__ import annotations

import textwrap

import pytest
import toml

from downscale_plugin.config import (
    ConfigError,
    DownscaleConfig,
    RouteRule,
    Span,
    load_config,
)
from downscale_plugin.hosts.kohya.conventions import config_from_training_toml, flatten_training_toml, network_args_dict, split_network_args

ROUTE = {"route": "1024:768", "sigma_min": 0.65, "sigma_max": 0.95}


def problems(**sources) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(**sources)
    assert info.value.problems, "ConfigError without problems"
    for p in info.value.problems:
        assert p in str(info.value)
    return info.value.problems


def with_routes(*routes, **top) -> dict:
    return {"table": {**top, "routes": list(routes)}}


def ds_args(**kwargs) -> dict:
    """network_args as sd-scripts passes them (prefixed strings), split like create_network does."""
    plugin, inner = split_network_args({f"ds_{k}": v for k, v in kwargs.items()})
    assert not inner
    return {"network_args": plugin}


def plugin_toml(text: str) -> dict:
    return {"plugin_toml": toml.loads(textwrap.dedent(text))}


# (sources for load_config, fragments the single problem must contain)
BAD = {
    # unknown keys, with did-you-mean
    "unknown-top-key": (with_routes(ROUTE, gaet="strict"), ["[plugins.downscale] gaet: unknown key", "did you mean 'gate'"]),
    "unknown-route-key": (with_routes({**ROUTE, "sigma_mx": 0.9}), ["routes[0].sigma_mx: unknown key", "did you mean 'sigma_max'"]),
    "unknown-network-arg": (
        {"network_args": split_network_args({"ds_gaet": "strict", "ds_routes": "1024:768@0.65-0.95"})[0]},
        ["[network_args] ds_gaet: unknown key", "did you mean 'ds_gate'"],
    ),
    "unknown-key-in-plugin-toml": (
        plugin_toml('max_trys = 3\nroutes = [{route = "1024:768", sigma_min = 0.6}]'),
        ["[downscale_config] max_trys: unknown key", "did you mean 'max_tries'"],
    ),
    # windows
    "inverted-window": (with_routes({**ROUTE, "sigma_min": 0.9, "sigma_max": 0.6}), ["routes[0].sigma_max", "inverted"]),
    "empty-window": (with_routes({**ROUTE, "sigma_min": 0.7, "sigma_max": 0.7}), ["routes[0].sigma_max", "empty"]),
    "sigma_min-negative": (with_routes({**ROUTE, "sigma_min": -0.1}), ["routes[0].sigma_min", "[0, 1)"]),
    "sigma_min-one": (with_routes({"route": "1024:768", "sigma_min": 1.0}), ["routes[0].sigma_min", "[0, 1)"]),
    "sigma_max-above-one": (with_routes({**ROUTE, "sigma_max": 1.5}), ["routes[0].sigma_max", "(0, 1]"]),
    "sigma_max-zero": (with_routes({"route": "1024:768", "sigma_min": 0.0, "sigma_max": 0.0}), ["routes[0].sigma_max", "(0, 1]"]),
    "priority-rule-without-sigma_max": (
        with_routes({"route": "1024:768", "sigma_min": 0.65}, {"route": "1024:896", "sigma_min": 0.5, "sigma_max": 0.6}),
        ["routes[0].sigma_max: required"],
    ),
    "missing-sigma_min": (with_routes({"route": "1024:768", "sigma_max": 0.9}), ["routes[0].sigma_min: required"]),
    # route / scale
    "route-upscale": (with_routes({**ROUTE, "route": "768:1024"}), ["routes[0].route", "smaller than NATIVE"]),
    "route-ratio-one": (with_routes({**ROUTE, "route": "1024:1024"}), ["routes[0].route", "smaller than NATIVE"]),
    "route-target-zero": (with_routes({**ROUTE, "route": "1024:0"}), ["routes[0].route", "positive"]),
    "route-x-separator": (with_routes({**ROUTE, "route": "1024x768"}), ["routes[0].route", "'NATIVE:TARGET'"]),
    "route-three-parts": (with_routes({**ROUTE, "route": "1024:768:512"}), ["routes[0].route", "'NATIVE:TARGET'"]),
    "route-missing-target": (with_routes({**ROUTE, "route": "1024:"}), ["routes[0].route", "'NATIVE:TARGET'"]),
    "route-negative": (with_routes({**ROUTE, "route": "-1024:768"}), ["routes[0].route", "'NATIVE:TARGET'"]),
    "route-not-string": (with_routes({**ROUTE, "route": 1024}), ["routes[0].route", "must be a string"]),
    "route-and-scale": (with_routes({**ROUTE, "scale": 0.75}), ["routes[0]: give exactly one of 'route'", "'scale'"]),
    "neither-route-nor-scale": (with_routes({"sigma_min": 0.6, "sigma_max": 0.9}), ["routes[0]: give exactly one of 'route'"]),
    "scale-one": (with_routes({"scale": 1.0, "sigma_min": 0.6}), ["routes[0].scale", "strictly between 0 and 1"]),
    "scale-above-one": (with_routes({"scale": 1.5, "sigma_min": 0.6}), ["routes[0].scale"]),
    "scale-zero": (with_routes({"scale": 0, "sigma_min": 0.6}), ["routes[0].scale"]),
    "scale-negative": (with_routes({"scale": -0.5, "sigma_min": 0.6}), ["routes[0].scale"]),
    # spans
    "span-unknown-mode": (with_routes({**ROUTE, "span": "middle"}), ["routes[0].span", "early, late, spread"]),
    "span-fraction-above-one": (with_routes({**ROUTE, "span": "late:1.5"}), ["routes[0].span", "strictly between 0 and 1"]),
    "span-fraction-zero": (with_routes({**ROUTE, "span": "early:0"}), ["routes[0].span", "strictly between 0 and 1"]),
    "span-fraction-one": (with_routes({**ROUTE, "span": "early:1"}), ["routes[0].span", "strictly between 0 and 1"]),
    "span-fraction-not-number": (with_routes({**ROUTE, "span": "spread:x"}), ["routes[0].span", "not a number"]),
    "span-not-string": (with_routes({**ROUTE, "span": 0.5}), ["routes[0].span", "must be a string"]),
    # wrong types
    "bool-for-sigma_min": (with_routes({**ROUTE, "sigma_min": True}), ["routes[0].sigma_min"]),
    "bool-for-scale": (with_routes({"scale": True, "sigma_min": 0.6}), ["routes[0].scale"]),
    "bool-for-tier_tolerance": (with_routes(ROUTE, tier_tolerance=True), ["[plugins.downscale] tier_tolerance", "must be a number"]),
    "bool-for-max_tries": (with_routes(ROUTE, max_tries=True), ["[plugins.downscale] max_tries", "must be an integer"]),
    "float-for-max_tries": (with_routes(ROUTE, max_tries=2.5), ["[plugins.downscale] max_tries", "must be an integer"]),
    "string-for-bool-in-toml": (
        plugin_toml('enable = "true"\nroutes = [{route = "1024:768", sigma_min = 0.6}]'),
        ["[downscale_config] enable", "must be a boolean"],
    ),
    "string-for-int-in-toml": (
        plugin_toml('seed = "1"\nroutes = [{route = "1024:768", sigma_min = 0.6}]'),
        ["[downscale_config] seed", "must be an integer"],
    ),
    "string-for-sigma-in-toml": (
        plugin_toml('routes = [{route = "1024:768", sigma_min = "0.6"}]'),
        ["routes[0].sigma_min", "must be a number"],
    ),
    "enable-yes-in-network_args": (ds_args(enable="yes", routes="1024:768@0.6-"), ["[network_args] ds_enable", "not a boolean"]),
    "max_tries-not-int-in-network_args": (
        ds_args(max_tries="abc", routes="1024:768@0.6-"),
        ["[network_args] ds_max_tries: 'abc' is not an integer"],
    ),
    "routes-not-array": ({"table": {"routes": ROUTE}}, ["[plugins.downscale] routes", "array of tables"]),
    "route-entry-not-table": (with_routes("1024:768@0.6-"), ["routes[0]: must be a table"]),
    "route-name-not-string": (with_routes({**ROUTE, "name": 3}), ["routes[0].name", "must be a string"]),
    "inner-empty": (with_routes(ROUTE, inner=""), ["[plugins.downscale] inner", "non-empty"]),
    # network_args route strings
    "ds_routes-no-dash": (ds_args(routes="1024:768@0.65"), ["[network_args] ds_routes", "'LO-HI' or 'LO-'"]),
    "ds_routes-no-window": (ds_args(routes="1024:768"), ["[network_args] ds_routes", "'ROUTE@LO-HI'"]),
    "ds_routes-too-many-fields": (ds_args(routes="1024:768@0.6-0.9@late@x"), ["[network_args] ds_routes", "'ROUTE@LO-HI'"]),
    "ds_routes-bad-number": (ds_args(routes="1024:768@a-0.9"), ["[network_args] ds_routes"]),
    "ds_routes-bad-scale": (ds_args(routes="xhalf@0.6-"), ["[network_args] ds_routes"]),
    "ds_routes-inverted": (ds_args(routes="1024:768@0.9-0.6"), ["routes[0].sigma_max", "inverted"]),
    # enable with nothing to route
    "enable-without-routes": ({"table": {"gate": "strict"}}, ["routes: at least one route is required while enable = true"]),
    "enable-true-empty-routes": (with_routes(enable=True), ["routes: at least one route is required"]),
    # shadowing
    "rule-shadowed-same-tier": (
        with_routes({**ROUTE, "sigma_min": 0.5}, {"route": "1024:896", "sigma_min": 0.6, "sigma_max": 0.9}),
        ["routes[1]: can never fire", "routes[0]"],
    ),
    "rule-shadowed-by-scale": (
        with_routes({"scale": 0.5, "sigma_min": 0.4, "sigma_max": 1.0}, {"route": "768:512", "sigma_min": 0.5, "sigma_max": 0.9}),
        ["routes[1]: can never fire"],
    ),
    "rule-shadowed-identical-window": (
        with_routes({"route": "1024:768", "sigma_min": 0.5, "sigma_max": 0.9}, {"route": "1024:896", "sigma_min": 0.5, "sigma_max": 0.9}),
        ["routes[1]: can never fire"],
    ),
    # enums and ranges
    "bad-gate": (with_routes(ROUTE, gate="strcit"), ["[plugins.downscale] gate", "coupled, strict", "did you mean 'strict'"]),
    "bad-arch": (with_routes(ROUTE, arch="flux1"), ["[plugins.downscale] arch", "did you mean 'flux'"]),
    "bad-arch-network_args": (ds_args(arch="sd2", routes="1024:768@0.6-"), ["[network_args] ds_arch", "sdxl"]),
    "tier_tolerance-zero": (with_routes(ROUTE, tier_tolerance=0.0), ["[plugins.downscale] tier_tolerance", "out of range"]),
    "tier_tolerance-half": (with_routes(ROUTE, tier_tolerance=0.5), ["[plugins.downscale] tier_tolerance", "out of range"]),
    "tier_tolerance-negative": (with_routes(ROUTE, tier_tolerance=-0.1), ["[plugins.downscale] tier_tolerance"]),
    "max_tries-zero": (with_routes(ROUTE, max_tries=0), ["[plugins.downscale] max_tries", "out of range"]),
    "max_tries-too-many": (with_routes(ROUTE, max_tries=65), ["[plugins.downscale] max_tries", "out of range"]),
    "seed-negative": (with_routes(ROUTE, seed=-1), ["[plugins.downscale] seed", "out of range"]),
    # FasterDiT keys
    "direction_loss_weight-negative": (
        with_routes(ROUTE, direction_loss_weight=-0.1),
        ["[plugins.downscale] direction_loss_weight", "finite number >= 0"],
    ),
    "direction_loss_weight-bool": (with_routes(ROUTE, direction_loss_weight=True), ["direction_loss_weight", "finite number >= 0"]),
    "direction_loss_weight-string-in-toml": (
        plugin_toml('direction_loss_weight = "0.1"\nroutes = [{route = "1024:768", sigma_min = 0.6}]'),
        ["[downscale_config] direction_loss_weight", "finite number >= 0"],
    ),
    "direction_loss_weight-nan-in-network_args": (
        ds_args(direction_loss_weight="nan", routes="1024:768@0.6-"),
        ["[network_args] ds_direction_loss_weight", "finite number >= 0"],
    ),
    "direction_loss_weight-not-number-in-network_args": (
        ds_args(direction_loss_weight="strong", routes="1024:768@0.6-"),
        ["[network_args] ds_direction_loss_weight"],
    ),
    "direction_loss_only_routed-yes": (
        ds_args(direction_loss_only_routed="yes", routes="1024:768@0.6-"),
        ["[network_args] ds_direction_loss_only_routed", "not a boolean"],
    ),
    "direction_loss_only_routed-string-in-table": (
        with_routes(ROUTE, direction_loss_only_routed="true"),
        ["[plugins.downscale] direction_loss_only_routed", "must be a boolean"],
    ),
    "bad-sigma_policy": (
        with_routes(ROUTE, sigma_policy="snr-match"),
        ["[plugins.downscale] sigma_policy", "keep, res_shift, snr_match", "did you mean 'snr_match'"],
    ),
    "bad-positions-network_args": (
        ds_args(positions="interp", routes="1024:768@0.6-"),
        ["[network_args] ds_positions", "plain, interpolate"],
    ),
    "unknown-fasterdit-network-arg": (
        ds_args(sigma_polcy="keep", routes="1024:768@0.6-"),
        ["ds_sigma_polcy", "did you mean 'ds_sigma_policy'"],
    ),
    "zero-weight-without-routes": ({"table": {"direction_loss_weight": 0.0}}, ["routes: at least one route is required"]),
    # mode = "map"
    "map-without-map_out": ({"table": {"mode": "map"}}, ['map_out: required when mode = "map"']),
    "map-with-routes": (with_routes(ROUTE, mode="map", map_out="m"), ['routes: not used when mode = "map"', "remove routes"]),
    "map-with-sigma_policy": ({"table": {"mode": "map", "map_out": "m", "sigma_policy": "res_shift"}}, ["sigma_policy", 'mode = "map"']),
    "bad-mode": ({"table": {"mode": "measure", "map_out": "m"}}, ["[plugins.downscale] mode", "train, map"]),
    "bad-after_map": (ds_args(mode="map", map_out="m", after_map="continue"), ["[network_args] ds_after_map", "stop, train"]),
    "map_ratios-one": ({"table": {"mode": "map", "map_out": "m", "map_ratios": [0.75, 1.0]}}, ["map_ratios", "strictly between 0 and 1"]),
    "map_ratios-empty": ({"table": {"mode": "map", "map_out": "m", "map_ratios": []}}, ["map_ratios", "non-empty list"]),
    "map_ratios-duplicate-network_args": (
        ds_args(mode="map", map_out="m", map_ratios="0.5,0.5"),
        ["[network_args] ds_map_ratios", "duplicates"],
    ),
    "map_ratios-not-number-network_args": (ds_args(mode="map", map_out="m", map_ratios="0.5,half"), ["[network_args] ds_map_ratios"]),
    "map_draws-one": ({"table": {"mode": "map", "map_out": "m", "map_draws": 1}}, ["map_draws", "out of range (allowed: 2 to 4096)"]),
    "map_draws-odd": (ds_args(mode="map", map_out="m", map_draws="5"), ["map_draws: 5 must be even"]),
    "map_images-one": ({"table": {"mode": "map", "map_out": "m", "map_images": 1}}, ["map_images", "out of range"]),
    "map_margin-zero": ({"table": {"mode": "map", "map_out": "m", "map_margin": 0.0}}, ["map_margin", "strictly between 0.0 and 1.0"]),
    "map_bins-not-covering": ({"table": {"mode": "map", "map_out": "m", "map_bins": "0,0.5,3"}}, ["map_bins", "cover (0, 1]"]),
    "map_bins-not-string": ({"table": {"mode": "map", "map_out": "m", "map_bins": [0, 0.5, 1]}}, ["map_bins", "must be a string"]),
    "map_out-empty": ({"table": {"mode": "map", "map_out": ""}}, ["map_out", "non-empty string"]),
    "map_reenc-in-train-mode": (with_routes(ROUTE, map_reenc=True), ['map_reenc: true is only allowed with mode = "map"']),
    "map_pixel-not-bool-network_args": (ds_args(mode="map", map_out="m", map_pixel="yes"), ["[network_args] ds_map_pixel", "true, false"]),
    # plugin TOML
    "plugin-toml-names-another": (
        plugin_toml('downscale_config = "other.toml"\nroutes = [{route = "1024:768", sigma_min = 0.6}]'),
        ["[downscale_config] downscale_config", "cannot name another"],
    ),
}


@pytest.mark.parametrize(("sources", "fragments"), list(BAD.values()), ids=list(BAD))
def test_bad_config_names_the_key(sources, fragments):
    found = problems(**sources)
    assert len(found) == 1, found
    for fragment in fragments:
        assert fragment in found[0], (fragment, found[0])


def test_bad_config_case_count():
    assert len(BAD) >= 25


def test_missing_downscale_config_file(tmp_path):
    found = problems(**ds_args(downscale_config="nope.toml", routes="1024:768@0.6-"), base_dir=str(tmp_path))
    assert found == [f"downscale_config: file not found: {tmp_path / 'nope.toml'}"]


def test_invalid_downscale_config_file(tmp_path):
    (tmp_path / "bad.toml").write_text("gate = \n")
    found = problems(table={"downscale_config": "bad.toml", "routes": [ROUTE]}, base_dir=str(tmp_path))
    assert len(found) == 1 and found[0].startswith("downscale_config:") and "not valid TOML" in found[0]


def test_bad_ds_routes_entry_names_the_key_the_entry_and_the_form():
    found = problems(**ds_args(routes="1024:768@a-0.95"))
    assert len(found) == 1, found
    assert found[0].startswith("[network_args] ds_routes: entry '1024:768@a-0.95': sigma_min 'a' is not a number"), found
    assert "ROUTE@LO-HI[@SPAN]" in found[0] and "NATIVE:TARGET" in found[0] and "xSCALE" in found[0]
    assert "could not convert" not in found[0]


def test_every_bad_ds_routes_entry_is_reported():
    (found,) = problems(**ds_args(routes="1024:768@0.6-0.9,x0.5@0.2-0.b,xhalf@0.1-,1024:896@0.5"))
    for fragment in ("entry 'x0.5@0.2-0.b': sigma_max '0.b'", "entry 'xhalf@0.1-': scale 'half'", "entry '1024:896@0.5': window '0.5'"):
        assert fragment in found, (fragment, found)
    assert "1024:768@0.6-0.9" not in found.split(" (form:")[0]  # the good entry is not blamed


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_tries", "abc", "ds_max_tries: 'abc' is not an integer"),
        ("seed", "1.5", "ds_seed: '1.5' is not an integer"),
        ("tier_tolerance", "wide", "ds_tier_tolerance: 'wide' is not a number"),
        ("direction_loss_weight", "strong", "ds_direction_loss_weight: 'strong' is not a number"),
        ("map_ratios", "0.5,x", "ds_map_ratios: 'x' is not a number (form: comma-separated linear ratios"),
        ("gate", "sometimes", "ds_gate: 'sometimes' is not allowed (allowed: coupled, strict)"),
        ("map_bins", "0,0.5,4:0.5,x,2", "ds_map_bins: '0,0.5,4:0.5,x,2': 'x' in segment '0.5,x,2' is not a number"),
        ("map_bins", "0,0.5:0.5,1,2", "ds_map_bins: '0,0.5:0.5,1,2': segment '0,0.5' must be LO,HI,K"),
    ],
)
def test_network_args_values_are_named_as_typed(key, value, message):
    extra = {"mode": "map", "map_out": "m"} if key.startswith("map_") else {"routes": "1024:768@0.6-"}
    found = problems(**ds_args(**{key: value}, **extra))
    assert any(p.startswith(f"[network_args] {message}") for p in found), found
    assert not any("could not convert" in p or "invalid literal" in p for p in found), found


def test_network_args_item_without_equals():
    with pytest.raises(ConfigError) as info:
        network_args_dict(["ds_gate=strict", "ds_seed"])
    assert info.value.problems == ["network_args: 'ds_seed' is not of the form key=value"]


# --- all problems at once ---------------------------------------------------------------------


def test_two_bad_keys_two_problems():
    found = problems(**with_routes(ROUTE, gate="fast", max_tries=0))
    assert len(found) == 2
    assert any(p.startswith("[plugins.downscale] gate:") for p in found)
    assert any(p.startswith("[plugins.downscale] max_tries:") for p in found)


def test_problems_from_every_source_and_route_reported_together():
    found = problems(
        network_args={"gate": "nope"},
        table={"seed": -3, "routes": [{**ROUTE, "sigma_max": 2.0}, {"scale": 1.2, "sigma_min": 0.2, "span": "middle"}]},
        plugin_toml={"arch": "flux2", "max_tries": 9},
    )
    heads = sorted(p.split(":")[0] for p in found)
    assert heads == sorted(
        [
            "[network_args] ds_gate",
            "[plugins.downscale] seed",
            "[downscale_config] arch",
            "routes[0].sigma_max",
            "routes[1].scale",
            "routes[1].span",
        ]
    )


def test_training_toml_problems_collected(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text(
        textwrap.dedent(
            """
            [network_arguments]
            network_args = ["ds_gate=strict", "oops"]

            [downscale]
            gate = "strict"

            [plugins.downscale]
            max_tries = 0
            routes = [{route = "1024:768", sigma_min = 0.6}]
            """
        )
    )
    with pytest.raises(ConfigError) as info:
        config_from_training_toml(str(path))
    found = info.value.problems
    assert len(found) == 3, found
    assert any(p.startswith("[downscale]: a one-level table") and "[plugins.downscale]" in p for p in found)
    assert any(p.startswith("network_args: 'oops'") for p in found)
    assert any(p.startswith("[plugins.downscale] max_tries") for p in found)


def test_one_level_downscale_table_rejected(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text('[general]\nseed = 1\n\n[downscale]\ngate = "strict"\nroutes = [{route = "1024:768", sigma_min = 0.6}]\n')
    with pytest.raises(ConfigError) as info:
        config_from_training_toml(str(path))
    first, *rest = info.value.problems
    assert first.startswith("[downscale]: a one-level table is flattened") and "[plugins.downscale]" in first
    # The plugin itself (reading [plugins.downscale]) then has no routes: that is reported too.
    assert [p.split(":")[0] for p in rest] == ["routes"]


def test_training_toml_missing(tmp_path):
    with pytest.raises(ConfigError, match="config_file: file not found"):
        config_from_training_toml(str(tmp_path / "absent.toml"))


# --- good configs -----------------------------------------------------------------------------

A = {"route": "1024:768", "sigma_min": 0.6}
B = {"route": "1024:768", "sigma_min": 0.65, "sigma_max": 0.95}
C = {"scale": 0.5, "sigma_min": 0.3, "sigma_max": 0.5}


def test_precedence_key_by_key_and_routes_replaced_whole():
    cfg = load_config(
        network_args={"seed": "7", "gate": "strict"},
        table={"max_tries": 5, "seed": 2, "routes": [B, C]},
        plugin_toml={"gate": "coupled", "max_tries": 3, "tier_tolerance": 0.2, "seed": 1, "arch": "sd3", "routes": [A]},
    )
    assert cfg.seed == 7  # network_args over table over file
    assert cfg.gate == "strict"  # network_args over file
    assert cfg.max_tries == 5  # table over file
    assert cfg.tier_tolerance == 0.2  # file only
    assert cfg.arch == "sd3"  # file only
    assert cfg.routes == (RouteRule(0.65, 0.95, native=1024, target=768), RouteRule(0.3, 0.5, scale=0.5))


def test_network_args_routes_replace_table_routes():
    cfg = load_config(network_args={"routes": "x0.75@0.6-"}, table={"routes": [B, C]})
    assert cfg.routes == (RouteRule(0.6, None, scale=0.75),)


def test_defaults_when_only_routes_given():
    cfg = load_config(table={"routes": [A]})
    assert cfg == DownscaleConfig(routes=(RouteRule(0.6, None, native=1024, target=768),))
    assert (cfg.enable, cfg.gate, cfg.max_tries, cfg.seed, cfg.arch) == (True, "coupled", 8, None, None)


def test_fasterdit_defaults_are_off():
    cfg = load_config(table={"routes": [A]})
    assert (
        cfg.fasterdit.direction_loss_weight,
        cfg.fasterdit.direction_loss_only_routed,
        cfg.fasterdit.sigma_policy,
        cfg.fasterdit.positions,
    ) == (0.0, False, "keep", "plain")


def test_fasterdit_keys_from_network_args_strings_win_over_the_table():
    plugin, inner = split_network_args(
        {
            "ds_direction_loss_weight": "0.25",
            "ds_direction_loss_only_routed": "true",
            "ds_sigma_policy": "snr_match",
            "ds_positions": "interpolate",
            "ds_routes": "x0.5@0.6-",
            "conv_dim": "4",
        }
    )
    table = {"direction_loss_weight": 1, "sigma_policy": "res_shift", "positions": "plain", "routes": [A]}
    cfg = load_config(plugin, table)
    assert inner == {"conv_dim": "4"}
    expected = (0.25, True, "snr_match", "interpolate")
    assert (
        cfg.fasterdit.direction_loss_weight,
        cfg.fasterdit.direction_loss_only_routed,
        cfg.fasterdit.sigma_policy,
        cfg.fasterdit.positions,
    ) == expected
    weight = load_config(table=table).fasterdit.direction_loss_weight
    assert weight == 1.0 and type(weight) is float


def test_direction_loss_alone_needs_no_routes():
    cfg = load_config(network_args={"direction_loss_weight": "0.1"})
    assert cfg.enable and cfg.routes == () and cfg.fasterdit.direction_loss_weight == 0.1


def test_map_mode_needs_no_routes_and_takes_its_keys_from_every_source():
    plugin, _ = split_network_args({"ds_mode": "map", "ds_map_ratios": "0.75, 0.5", "ds_map_draws": "4", "ds_after_map": "train"})
    table = {"map_out": "m", "map_draws": 16, "map_images": 3, "map_simultaneous": True}
    cfg = load_config(plugin, table, plugin_toml={"map_margin": 0.1, "map_bins": "0,0.5,1", "map_images": 99})
    assert cfg.routes == () and (cfg.mode, cfg.after_map, cfg.map.out) == ("map", "train", "m")
    assert cfg.map.ratios == (0.75, 0.5) and cfg.map.draws == 4 and cfg.map.images == 3  # network_args > table > plugin TOML
    assert (cfg.map.margin, cfg.map.bins, cfg.map.simultaneous) == (0.1, "0,0.5,1", True)
    assert (cfg.map.reenc, cfg.map.pixel) == (False, False)
    vae_arms = load_config(split_network_args({"ds_map_pixel": "true"})[0], {"mode": "map", "map_out": "m", "map_reenc": True})
    assert (vae_arms.map.reenc, vae_arms.map.pixel) == (True, True)
    defaults = load_config(table={"routes": [A]})
    assert (defaults.mode, defaults.after_map, defaults.map.ratios, defaults.map.draws, defaults.map.out) == (
        "train",
        "stop",
        (0.875, 0.75, 0.5),
        8,
        None,
    )


def test_disabled_needs_no_routes():
    cfg = load_config(network_args={"enable": "false"})
    assert cfg.enable is False and cfg.routes == ()


def test_plugin_toml_file_relative_to_base_dir(tmp_path):
    (tmp_path / "ds.toml").write_text('gate = "strict"\nseed = 3\n[[routes]]\nroute = "1024:768"\nsigma_min = 0.6\n')
    cfg = load_config(network_args={"downscale_config": "ds.toml", "seed": "4"}, base_dir=str(tmp_path))
    assert (cfg.gate, cfg.seed) == ("strict", 4)
    assert cfg.routes == (RouteRule(0.6, None, native=1024, target=768),)
    assert str(tmp_path / "ds.toml") in cfg.sources


def test_downscale_config_in_both_sources_network_args_wins(tmp_path):
    (tmp_path / "a.toml").write_text('gate = "strict"\nroutes = [{route = "1024:768", sigma_min = 0.6}]\n')
    (tmp_path / "b.toml").write_text('gate = "coupled"\nroutes = [{route = "1024:896", sigma_min = 0.5}]\n')
    cfg = load_config(network_args={"downscale_config": "a.toml"}, table={"downscale_config": "b.toml"}, base_dir=str(tmp_path))
    assert cfg.gate == "strict"
    assert cfg.routes[0].target == 768


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "1024:768@0.65-0.95,1024:896@0.5-@late:0.75",
            (RouteRule(0.65, 0.95, native=1024, target=768), RouteRule(0.5, None, native=1024, target=896, span=Span("late", 0.75))),
            id="stacked-with-span",
        ),
        pytest.param("x0.75@0.6-", (RouteRule(0.6, None, scale=0.75),), id="scale-open-top"),
        pytest.param(
            " 1024:768@0.65-0.95 , x0.5@0.2-0.4@spread:0.25 ,",
            (RouteRule(0.65, 0.95, native=1024, target=768), RouteRule(0.2, 0.4, scale=0.5, span=Span("spread", 0.25))),
            id="spaces-and-trailing-comma",
        ),
        pytest.param("1024:768@0-1", (RouteRule(0.0, 1.0, native=1024, target=768),), id="closed-unit-window"),
        pytest.param("1024:768@0.6-@early", (RouteRule(0.6, None, native=1024, target=768, span=Span("early", 0.5)),), id="span-default"),
    ],
)
def test_ds_routes_string(text, expected):
    plugin, _ = split_network_args({"ds_routes": text})
    assert load_config(plugin).routes == expected


def test_toml_ints_accepted_for_float_keys():
    cfg = load_config(**plugin_toml("max_tries = 4\n[[routes]]\nscale = 0.5\nsigma_min = 0\nsigma_max = 1\n"))
    (rule,) = cfg.routes
    assert (rule.sigma_min, rule.sigma_max) == (0.0, 1.0)
    assert type(rule.sigma_min) is float and type(rule.sigma_max) is float
    assert cfg.max_tries == 4


def test_non_shadowing_stacks_accepted():
    cfg = load_config(
        table={
            "routes": [
                {"route": "1024:768", "sigma_min": 0.5, "sigma_max": 0.95},
                {"route": "768:512", "sigma_min": 0.6, "sigma_max": 0.9},  # another tier
                {"route": "1024:896", "sigma_min": 0.4, "sigma_max": 0.9},  # reaches below routes[0]
                {"scale": 0.5, "sigma_min": 0.6, "sigma_max": 0.9},  # every tier, not only 1024
            ]
        }
    )
    assert [r.label for r in cfg.routes] == ["1024:768", "768:512", "1024:896", "x0.5"]


def test_spanned_rule_shadows_nothing():
    cfg = load_config(
        table={"routes": [{**B, "sigma_min": 0.5, "span": "early:0.3"}, {"route": "1024:896", "sigma_min": 0.6, "sigma_max": 0.9}]}
    )
    assert len(cfg.routes) == 2


TRAINING_TOML = """
[general]
pretrained_model_name_or_path = "flux1-dev.safetensors"
seed = 42
mixed_precision = "bf16"
cache_latents_to_disk = true

[network_arguments]
network_module = "downscale_plugin"
network_dim = 16
network_args = ["inner=networks.lora_flux", "ds_gate=strict", "train_blocks=single", "ds_max_tries=4", "algo=lokr"]

[optimizer_arguments]
optimizer_type = "AdamW8bit"
learning_rate = 1e-4

[training_arguments]
max_train_steps = 1000
timestep_sampling = "flux_shift"

[plugins.downscale]
seed = 5
tier_tolerance = 0.15
max_tries = 2

[[plugins.downscale.routes]]
route = "1024:768"
sigma_min = 0.65
sigma_max = 0.95
name = "deep"

[[plugins.downscale.routes]]
route = "1024:896"
sigma_min = 0.5
span = "late:0.75"
"""


def _sd_scripts_flatten(config_dict):
    """sd-scripts train_util.read_config_from_file, the nesting-ignoring loop, verbatim in spirit."""
    ignore_nesting_dict = {}
    for section_name, section_dict in config_dict.items():
        if not isinstance(section_dict, dict):
            ignore_nesting_dict[section_name] = section_dict
            continue
        for key, value in section_dict.items():
            ignore_nesting_dict[key] = value
    return ignore_nesting_dict


def test_config_from_realistic_training_toml(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text(TRAINING_TOML)
    cfg, flat = config_from_training_toml(str(path))
    assert flat == _sd_scripts_flatten(toml.loads(TRAINING_TOML))
    assert flat["seed"] == 42 and flat["learning_rate"] == 1e-4 and flat["timestep_sampling"] == "flux_shift"
    assert "gate" not in flat and "routes" not in flat and "plugins" not in flat
    assert isinstance(flat["downscale"], dict)
    assert cfg.gate == "strict"  # network_args
    assert cfg.max_tries == 4  # network_args over [plugins.downscale]
    assert cfg.inner == "networks.lora_flux"
    assert (cfg.seed, cfg.tier_tolerance) == (5, 0.15)
    assert cfg.routes == (
        RouteRule(0.65, 0.95, native=1024, target=768, name="deep"),
        RouteRule(0.5, None, native=1024, target=896, span=Span("late", 0.75)),
    )


def test_training_toml_plugin_file_relative_to_toml(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "ds.toml").write_text('gate = "strict"\nroutes = [{scale = 0.75, sigma_min = 0.6}]\n')
    (tmp_path / "cfg" / "train.toml").write_text('[general]\nseed = 1\n\n[plugins.downscale]\ndownscale_config = "ds.toml"\nseed = 9\n')
    cfg, _ = config_from_training_toml(str(tmp_path / "cfg" / "train.toml"))
    assert (cfg.gate, cfg.seed, cfg.routes) == ("strict", 9, (RouteRule(0.6, None, scale=0.75),))


def test_flatten_training_toml_matches_sd_scripts():
    data = toml.loads(TRAINING_TOML + '\ntop_level_key = "x"\n')
    assert flatten_training_toml(data) == _sd_scripts_flatten(data)


def test_split_network_args_leaves_inner_keys_alone():
    blocks = object()
    kwargs = {
        "ds_gate": "strict",
        "ds_routes": "1024:768@0.6-",
        "inner": "lycoris.kohya",
        "downscale_config": "ds.toml",
        "algo": "lokr",
        "preset": "attn-mlp",
        "train_blocks": blocks,
        "conv_dim": "4",
        "dsx": "1",
        "d_s_gate": "x",
    }
    plugin, inner = split_network_args(kwargs)
    assert plugin == {"gate": "strict", "routes": "1024:768@0.6-", "inner": "lycoris.kohya", "downscale_config": "ds.toml"}
    assert inner == {"algo": "lokr", "preset": "attn-mlp", "train_blocks": blocks, "conv_dim": "4", "dsx": "1", "d_s_gate": "x"}
    assert inner["train_blocks"] is blocks


def test_network_args_dict_like_sd_scripts():
    assert network_args_dict(["ds_gate = strict", "inner=networks.lora_flux", "ds_routes=1024:768@0.6-0.9"]) == {
        "ds_gate": "strict",
        "inner": "networks.lora_flux",
        "ds_routes": "1024:768@0.6-0.9",
    }
    assert network_args_dict(None) == {}
