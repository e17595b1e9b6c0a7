"""Certify once, reuse (``mapping/reuse.py``): the key, the cache, the files users share, and ``mode = "auto"``
reusing cached windows on the sd-scripts doubles at zero cost, or re-certifying and saying which key fields differ."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import toml
from host_modules import double_args, trainer_class
from test_sd_scripts_auto import ARGV, auto_config
from test_sd_scripts_map import steps  # noqa: F401  # the fixture recording each host step's latents

from downscale_plugin.__main__ import main
from downscale_plugin.mapping import reuse
from downscale_plugin.mapping.reuse import Entry, EntryError, WindowsKey, file_hash, lookup, read_entry, store

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan", "token_costs")

KEY = WindowsKey(
    model="sha256:" + "ab" * 32,
    encoders="clip_l=sha256:11; t5xxl=sha256:22; ae=sha256:33",
    arch="flux",
    network="networks.lora_flux",
    rank=16,
    buckets=("128x128", "96x128"),
    sampler="σ deciles at 128x128: 0.1 0.2",
    loss="loss_type='l2', min_snr_gamma=None",
    host="sd-scripts",
    host_revision="sha256:0123456789abcdef",
    code="sha256:fedcba9876543210",
    ratios=(0.5, 0.75),
    bins="0,0.5,1",
    margin=0.05,
    alpha=0.05,
)
WINDOWS = 'arch = "flux"\nwindows_margin = 0.05\n\n[[routes]]\nroute = "1024:512"\nsigma_min = 0.5\n'
CHANGED = {
    "model": "sha256:" + "cd" * 32,
    "arch": "sdxl",
    "network": "networks.lora",
    "rank": 32,
    "buckets": ("128x128",),
    "sampler": "σ deciles at 128x128: 0.1 0.3",
    "host": "musubi-tuner",
    "encoders": "clip_l=sha256:11; t5xxl=sha256:99; ae=sha256:33",
    "loss": "loss_type='huber', min_snr_gamma=None",
    "host_revision": "sha256:1123456789abcdef",
    "code": "sha256:0edcba9876543210",
    "ratios": (0.5,),
    "bins": "0,0.25,0.5,1",
    "margin": 0.1,
    "alpha": 0.01,
}


def test_every_key_field_changes_the_digest_and_is_named():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(WindowsKey)}
    for name, value in CHANGED.items():
        other = dataclasses.replace(KEY, **{name: value})
        assert other.digest() != KEY.digest(), name
        assert other.differences(KEY)[0].startswith(f"{name}: cached {getattr(KEY, name)!r}, this run {getattr(other, name)!r}")
        assert len(other.differences(KEY)) == 1
    # order carries no meaning: the same buckets and ratios listed otherwise are the same key
    assert dataclasses.replace(KEY, buckets=("96x128", "128x128", "96x128"), ratios=(0.75, 0.5)).digest() == KEY.digest()


def test_file_hash_is_the_whole_files_sha256_remembered_per_size_and_mtime(tmp_path):
    import hashlib
    import os

    model = tmp_path / "model.safetensors"
    model.write_bytes(b"\0" * (3 << 20) + b"a")
    whole = "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()
    assert file_hash(str(model), str(tmp_path / "cache")) == whole
    stat = model.stat()
    model.write_bytes(b"\0" * (3 << 20) + b"b")  # one byte past the chunks a sampled hash would read, same size
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert file_hash(str(model), str(tmp_path / "cache")) == "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest() != whole
    memo = json.loads((tmp_path / "cache" / reuse.HASH_MEMO).read_text())
    assert memo[str(model.resolve())]["size"] == (3 << 20) + 1


def _entry(windows=WINDOWS, cost=41.5, key=KEY, outcome="safe", horizon=2000.0, budget=300.0, date="2026-12-05T07:00:00Z"):
    return Entry(key, cost, date, "test", windows, outcome, horizon, budget, "0.2.0")


def test_store_then_lookup_hits_and_a_mismatch_names_the_nearest_entrys_fields(tmp_path):
    path = store(_entry(), str(tmp_path))
    hit = lookup(KEY, str(tmp_path))
    assert hit.entry is not None and hit.entry.path == path and hit.entry.cost == 41.5 and hit.entry.windows_text == WINDOWS
    other = dataclasses.replace(KEY, rank=32, buckets=("128x128",))
    miss = lookup(other, str(tmp_path))
    assert miss.entry is None
    assert "rank: cached 16, this run 32" in miss.reason and "buckets: cached ('128x128', '96x128'), this run ('128x128',)" in miss.reason
    assert "model" not in miss.reason.split("differs in:")[1]
    assert "no cached windows in" in lookup(KEY, str(tmp_path / "empty")).reason


def test_windows_that_a_literal_string_cannot_hold_round_trip_quoted():
    text = "# a note with ''' in it\n" + WINDOWS
    entry = _entry(text)
    assert toml.loads(entry.render())["windows"] == text


def _entry_doc(**changes):
    doc = toml.loads(read_entry(store(_entry(), "/tmp/reuse_entry_doc")).render())
    for dotted, value in changes.items():
        table, _, name = dotted.rpartition(".")
        holder = doc[table] if table else doc
        if value is None:
            del holder[name]
        else:
            holder[name] = value
    return doc


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "format: 'other' (allowed: 'downscale-plugin windows 2')"),
        ({"format": "downscale-plugin windows 1"}, "format: 'downscale-plugin windows 1' is an older plugin's entry"),
        ({"outcome": "fine"}, "outcome: 'fine' (allowed: safe, none_safe, stake, budget, horizon)"),
        ({"outcome": "stake"}, "outcome: 'stake' (no safe window), but the windows open 1 route(s)"),
        ({"horizon": -1}, "horizon: -1 must be a number >= 0 (inf: none)"),
        ({"budget": None}, "budget: missing"),
        ({"windows_digest": None}, "windows_digest: missing"),
        ({"key.bins": "0,2"}, "key.bins: '0,2' must be σ bins"),
        ({"key.model": None}, "key.model: missing"),
        ({"key.rank": "16"}, "key.rank: '16' must be an integer"),
        ({"key.buckets": ["128"]}, "key.buckets: ['128'] must be an array of latent grids \"HxW\""),
        ({"key.ratios": [1.5]}, "key.ratios: [1.5] must be an array of ratios strictly between 0 and 1"),
        ({"key.colour": "red"}, "key.colour: unknown key"),
        ({"cost": -1}, "cost: -1 must be a number >= 0"),
        ({"cost": None}, "cost: missing"),
        ({"windows": "gate = 'loose'"}, "windows: [downscale_config] gate: 'loose' is not allowed (allowed: coupled, strict)"),
        ({"windows": WINDOWS.replace('"flux"', '"sdxl"')}, "windows: arch 'sdxl' is not the key's arch 'flux'"),
        ({"extra": 1}, "extra: unknown key"),
    ],
)
def test_an_invalid_windows_file_is_refused_naming_the_key(tmp_path, changes, message):
    path = tmp_path / "shared.toml"
    path.write_text(toml.dumps(_entry_doc(**changes)))
    with pytest.raises(EntryError) as err:
        read_entry(str(path))
    assert message in str(err.value)
    assert main(["windows", "--cache", str(tmp_path / "cache"), "import", str(path)]) == 2
    assert not (tmp_path / "cache").exists()


def test_export_import_round_trip_through_the_cli(tmp_path, capsys):
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    store(_entry(), mine)
    assert main(["windows", "--cache", mine, "list"]) == 0
    listed = capsys.readouterr().out
    assert KEY.digest() in listed and "flux" in listed and "41.5" in listed
    shared = tmp_path / "flux-dev-r16.toml"
    assert main(["windows", "--cache", mine, "export", KEY.digest()[:6], str(shared)]) == 0
    assert WINDOWS in shared.read_text()  # the windows read as written, not as one escaped string
    assert main(["windows", "--cache", theirs, "import", str(shared)]) == 0
    shown = capsys.readouterr().out  # the provenance, before it is stored
    assert f"key {KEY.digest()}: flux on sd-scripts (host revision {KEY.host_revision})" in shown
    assert "certified 2026-12-05T07:00:00Z by test (plugin 0.2.0) for 41.5 native-step equivalents; ended 'safe'" in shown
    assert "windows: 1024:512 (0.5, 1]" in shown
    hit = lookup(KEY, theirs)
    assert hit.entry is not None and hit.entry.windows_text == WINDOWS and hit.entry.cost == 41.5
    plugin = tmp_path / "windows.toml"
    assert main(["windows", "--cache", theirs, "export", "--plugin_toml", KEY.digest(), str(plugin)]) == 0
    assert plugin.read_text() == WINDOWS
    # other windows under the same key are not replaced silently
    other = tmp_path / "other.toml"
    store(_entry(WINDOWS.replace("sigma_min = 0.5", "sigma_min = 0.0"), 1.0), str(tmp_path / "third"))
    other.write_text((tmp_path / "third" / f"{KEY.digest()}.toml").read_text())
    assert main(["windows", "--cache", theirs, "import", str(other)]) == 2
    assert "--replace" in capsys.readouterr().err
    assert main(["windows", "--cache", theirs, "import", "--replace", str(other)]) == 0
    assert "sigma_min = 0.0" in lookup(KEY, theirs).entry.windows_text
    assert main(["windows", "--cache", theirs, "remove", KEY.digest()]) == 0 and lookup(KEY, theirs).entry is None


# -- mode = "auto" on the sd-scripts doubles ------------------------------------------------------------------


def _run(tmp_path, model, **changes):
    """A flux auto run on the doubles whose base model is the file ``model``; ``changes``: args or plugin keys."""
    keys = {k: v for k, v in changes.items() if k.startswith(("map_", "certify_"))}
    args = double_args("flux", *ARGV, downscale=auto_config(tmp_path, **{"map_margin": 0.99, **keys}))
    args.pretrained_model_name_or_path = str(model)
    for name, value in changes.items():
        if name not in keys:
            setattr(args, name, value)
    trainer = trainer_class("flux")()
    trainer.train(args)
    return trainer.last_run


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "flux1-dev.safetensors"
    path.write_bytes(bytes(range(256)) * 64)
    return path


@pytest.mark.usefixtures("range_clipped_read")
def test_a_second_auto_run_with_the_same_key_reuses_the_windows_at_zero_cost(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    calls = steps("flux")  # spied from the first run on: a changed host function is another key (host_revision)
    first = _run(tmp_path / "a", model, network_dim=4)
    certified = first.network.downscale_run.cfg.routes
    entries = list(windows_cache.glob("*.toml"))
    assert certified and len(entries) == 1
    entry = read_entry(str(entries[0]))
    assert entry.key.model.startswith("sha256:") and entry.key.rank == 4 and entry.key.host == "sd-scripts" and entry.cost > 0
    calls.clear()
    with caplog.at_level(logging.INFO):
        second = _run(tmp_path / "b", model, network_dim=4)
    run = second.network.downscale_run
    assert run.cfg.routes == certified
    assert [shape for shape, _ in calls if shape[0] == 1] == []  # not one probe pass
    train = [shape for shape, _ in calls if shape[0] == 4]
    assert len(train) == 48 and (4, 4, 8, 8) in train[:3]  # routed from the first steps, not after 4 native batches
    assert not (tmp_path / "b" / "auto" / "certify.json").exists()
    assert "reusing the cached windows" in caplog.text and "zero certification cost" in caplog.text
    assert (
        f"certification: none in this run (0 native-step equivalents of the run's FLOP model): windows reused from {entries[0]}"
        in caplog.text
    )
    assert json.loads(run.extra_metadata["ss_downscale_map"])["method"] == "reused"


def test_a_key_mismatch_recertifies_and_names_the_fields(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    calls = steps("flux")  # spied from the first run on: a changed host function is another key (host_revision)
    _run(tmp_path / "a", model, network_dim=4)
    calls.clear()
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "b", model, network_dim=8, map_margin=0.9)
    assert [shape for shape, _ in calls if shape[0] == 1]  # the certifier drew its probes again
    assert "rank: cached 4, this run 8" in caplog.text and "margin: cached 0.99, this run 0.9" in caplog.text
    assert (tmp_path / "b" / "auto" / "certify.json").exists() and len(list(windows_cache.glob("*.toml"))) == 2


def test_reuse_off_neither_reads_nor_writes_the_cache(tmp_path, model, windows_cache, steps):  # noqa: F811
    calls = steps("flux")  # spied from the first run on: a changed host function is another key (host_revision)
    _run(tmp_path / "a", model, network_dim=4)
    calls.clear()
    _run(tmp_path / "b", model, network_dim=4, certify_reuse="off")
    assert [shape for shape, _ in calls if shape[0] == 1] and len(list(windows_cache.glob("*.toml"))) == 1


def test_musubi_wan22_keys_both_experts_and_reuses_at_zero_cost(tmp_path, windows_cache):
    """musubi-tuner's Wan 2.2: the key hashes both experts' files; a second run with the same files draws no probe."""
    from test_musubi_auto import WAN
    from test_musubi_auto import auto_config as musubi_config
    from test_musubi_doubles import run

    low, high = tmp_path / "low.safetensors", tmp_path / "high.safetensors"
    low.write_bytes(b"low" * 1000)
    high.write_bytes(b"high" * 1000)
    argv = [*WAN, "--task", "t2v-A14B", "--dit", str(low), "--dit_high_noise", str(high), "--timestep_sampling", "uniform",
            "--items_per_bucket", "16", "--max_train_steps", "80", "--seed", "3"]  # fmt: skip
    config = musubi_config(tmp_path, map_margin=0.99)
    run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "a", downscale=config)
    (entry,) = [read_entry(str(p)) for p in windows_cache.glob("*.toml")]
    assert entry.key.model == f"{file_hash(str(low))} + {file_hash(str(high))}" and entry.key.host == "musubi-tuner"
    second = run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "b", downscale=config)
    assert len(second.last_transformer.calls) == 80  # one forward per step (batch 1): no probe draw
    high.write_bytes(b"HIGH" * 1000)  # another high-noise expert: another key
    third = run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "c", downscale=config)
    assert len(third.last_transformer.calls) > 80


@pytest.mark.usefixtures("range_clipped_read")
def test_a_resumed_run_routes_by_its_states_windows_not_the_cache(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    """``--resume`` of a state saved after the certification: the state's windows route it (and say so), as without a cache."""
    calls = steps("flux")  # spied from the first run on: a changed host function is another key (host_revision)
    _run(tmp_path / "a", model, network_dim=4, save_state=True, save_every_n_steps=8, output_dir=str(tmp_path / "a" / "out"))
    state = tmp_path / "a" / "out" / "last-step00000008-state"
    calls.clear()
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "b", model, network_dim=4, resume=str(state), skip_until_initial_step=True)
    assert "windows cache: not read by a resumed run" in caplog.text
    assert "the resumed state was saved after the measurement" in caplog.text and [s for s, _ in calls if s[0] == 1] == []


def test_keying_and_caching_leave_a_run_that_opens_nothing_bitwise_the_hosts(tmp_path, model, windows_cache):
    """The key's σ fingerprint draws the host's sampler (forked) and the model file is hashed: a certification that
    opens nothing, cached, leaves the losses and the adapter bitwise the plain run's."""
    import torch

    args = double_args("flux", *ARGV, network_module="networks.lora_flux")
    args.pretrained_model_name_or_path, args.network_dim = str(model), 4
    plain = trainer_class("flux")()
    plain.train(args)
    run = _run(tmp_path, model, network_dim=4, map_margin=1e-9)
    assert len(list(windows_cache.glob("*.toml"))) == 1 and run.network.downscale_run.cfg.routes == ()
    assert run.losses == plain.last_run.losses
    theirs = plain.last_run.network.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in run.network.state_dict().items())


@pytest.mark.usefixtures("range_clipped_read")
def test_an_unwritable_cache_costs_the_reuse_not_the_run(tmp_path, model, caplog):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    with caplog.at_level(logging.INFO):
        run = _run(tmp_path, model, network_dim=4, certify_cache=str(blocker))
    assert "the windows cache could not be written" in caplog.text and run.network.downscale_run.cfg.routes


def test_the_adapters_own_network_args_are_keyed_the_plugins_are_not(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    calls = steps("flux")  # spied from the first run on: a changed host function is another key (host_revision)
    _run(tmp_path / "a", model, network_dim=4)
    calls.clear()
    _run(tmp_path / "b", model, network_dim=4, network_args=["ds_gate=coupled"])  # a plugin key: the same key
    assert [s for s, _ in calls if s[0] == 1] == []
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "c", model, network_dim=4, network_args=["conv_dim=4", "ds_gate=coupled"])
    assert "network: cached 'networks.lora_flux', this run 'networks.lora_flux (conv_dim=4)'" in caplog.text
    assert [s for s, _ in calls if s[0] == 1]


# -- no frozen failures, a key that names what the windows depend on, integrity, one certification at a time ----------

EMPTY = 'arch = "flux"\nwindows_margin = 0.05\nenable = false\n'


def test_a_provisional_failure_is_reused_only_by_a_run_that_cannot_buy_more(tmp_path):
    store(_entry(EMPTY, outcome="stake", horizon=1000.0, budget=100.0), str(tmp_path))
    for horizon, budget in ((1000.0, 100.0), (500.0, 50.0)):  # nothing more to buy: its verdict stands, at cost 0
        hit = lookup(KEY, str(tmp_path), horizon, budget)
        assert hit.entry is not None and "this run could buy no more" in hit.reason
    longer = lookup(KEY, str(tmp_path), 2000.0, 100.0)
    assert (
        longer.entry is None
        and "a longer horizon (this run 2000 later passes, the cached certification 1000 later passes)" in longer.reason
    )
    larger = lookup(KEY, str(tmp_path), 1000.0, 150.0)
    assert larger.entry is None and "a larger budget (this run 150.0, the cached certification 100.0" in larger.reason
    assert lookup(KEY, str(tmp_path), math.inf, 100.0).entry is None  # no pay rule (certify_unpaid = "buy") buys more than any horizon
    store(_entry(EMPTY, outcome="none_safe", horizon=1000.0, budget=100.0), str(tmp_path))  # every test read to its verdict
    assert lookup(KEY, str(tmp_path), math.inf, 1e9).entry is not None


def test_the_certifier_code_is_the_source_of_its_modules_read_at_run_time(tmp_path, monkeypatch):
    module = tmp_path / "reuse_probe_module.py"
    module.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = reuse.certifier_code(("reuse_probe_module",))
    assert before == reuse.certifier_code(("reuse_probe_module",)) != reuse.certifier_code()
    module.write_text("X = 2\n")
    reuse.certifier_code.cache_clear()
    assert reuse.certifier_code(("reuse_probe_module",)) != before
    assert set(reuse.CERTIFIER_MODULES) >= {
        f"downscale_plugin.mapping.{m}" for m in ("certify", "sequential", "safe_read", "estimator", "paired", "windows")
    }


def test_an_entry_is_used_only_as_certified_inside_its_keys_routes_and_bins(tmp_path):
    path = tmp_path / "entry.toml"
    doc = toml.loads(_entry().render())
    widened = WINDOWS.replace("sigma_min = 0.5", "sigma_min = 0.0")  # (0.5, 1] widened to (0, 1] by hand
    path.write_text(toml.dumps({**doc, "windows": widened}))
    with pytest.raises(EntryError) as err:
        read_entry(str(path))
    assert f"{path} (key {KEY.digest()})" in str(err.value) and "windows_digest:" in str(err.value) and "edited?" in str(err.value)
    for windows, message in (
        (
            WINDOWS.replace("1024:512", "1024:256"),
            "windows: route 1 (1024:256 (0.5, 1]): ratio 0.25 is not one of the key's ratios [0.75, 0.5]",
        ),
        (WINDOWS.replace("1024:512", "2048:1024"), "tier 2048 px is not a tier of the key's buckets (887, 1024 px)"),
        (WINDOWS.replace("sigma_min = 0.5", "sigma_min = 0.4"), "sigma_min 0.4 is not an edge of the key's bins 0,0.5,1"),
    ):  # a digest recomputed to match: the windows must still be ones this key's certification could write
        path.write_text(toml.dumps({**doc, "windows": windows, "windows_digest": reuse.windows_digest(windows)}))
        with pytest.raises(EntryError) as err:
            read_entry(str(path))
        assert message in str(err.value)
    assert main(["windows", "--cache", str(tmp_path / "cache"), "import", str(path)]) == 2 and not (tmp_path / "cache").exists()


def test_an_old_format_entry_is_a_miss_that_says_so_never_a_crash(tmp_path):
    doc = toml.loads(_entry().render())
    doc["format"] = "downscale-plugin windows 1"
    (tmp_path / f"{KEY.digest()}.toml").write_text(toml.dumps(doc))
    found = lookup(KEY, str(tmp_path))
    assert found.entry is None and "1 entry of an older plugin's format not read" in found.reason


def test_one_certification_per_key_at_a_time(tmp_path):
    first, second = reuse.KeyLock(KEY, str(tmp_path)), reuse.KeyLock(KEY, str(tmp_path))
    assert first.acquire() and not second.acquire() and not second.wait(0.05, poll=0.01)
    first.release()
    assert second.acquire()
    second.release()


def test_a_failure_is_not_frozen_a_run_that_can_buy_more_certifies_again(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    calls = steps("flux")
    short = {
        "network_dim": 4,
        "map_margin": 1e-9,
        "map_ratios": [0.5, 0.75],
        "certify_budget": 0.21,
    }  # nothing safe at ε ≈ 0; the budget (40.3: one safe read fits) ends the search before every test reads to a verdict
    _run(tmp_path / "a", model, **short)
    (path,) = windows_cache.glob("*.toml")
    entry = read_entry(str(path))
    assert entry.outcome == "budget" and entry.budget == pytest.approx(40.32) and entry.key.code.startswith("sha256:")
    calls.clear()
    _run(tmp_path / "b", model, **short)  # the same run could buy no more: the verdict stands, at cost 0
    assert [s for s, _ in calls if s[0] == 1] == []
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "c", model, **{**short, "certify_budget": 0.5})
    assert [s for s, _ in calls if s[0] == 1]
    assert "this run can buy more evidence: a larger budget (this run 96.0, the cached certification 40.3" in caplog.text
    assert read_entry(str(path)).budget == pytest.approx(96.0)


def test_a_stale_key_recertifies_naming_the_field(tmp_path, model, windows_cache, steps, caplog, monkeypatch):  # noqa: F811
    """Loss settings, the text encoders' and VAE's files and the host's functions are keyed: each change re-certifies."""
    calls = steps("flux")
    ae = tmp_path / "ae.safetensors"
    ae.write_bytes(b"ae" * 100)
    _run(tmp_path / "a", model, network_dim=4, ae=str(ae))
    assert read_entry(str(next(windows_cache.glob("*.toml")))).key.encoders == f"ae={file_hash(str(ae))}"
    flux = trainer_class("flux")
    original = flux.get_noise_pred_and_target
    for name, change, field in (
        ("loss", lambda: {"guidance_scale": 1.0}, "loss: cached"),
        ("ae", lambda: ae.write_bytes(b"AE" * 100) and {}, "encoders: cached 'ae=sha256:"),
        (
            "host",
            lambda: monkeypatch.setattr(flux, "get_noise_pred_and_target", lambda *a, **k: original(*a, **k)) or {},
            "host_revision: cached",
        ),
    ):
        calls.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            _run(tmp_path / name, model, network_dim=4, ae=str(ae), **change())
        assert [s for s, _ in calls if s[0] == 1], name  # the certifier drew its probes again
        assert field in caplog.text, name


@pytest.mark.usefixtures("range_clipped_read")
def test_an_edited_entry_is_refused_and_the_run_certifies_anew(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    calls = steps("flux")
    _run(tmp_path / "a", model, network_dim=4, certify_budget=0.25)  # the budget buys one safe bin: the window (0.5, 1)
    (path,) = windows_cache.glob("*.toml")
    doc = toml.loads(path.read_text())
    routes = toml.loads(doc["windows"])
    assert [r["sigma_min"] for r in routes["routes"]] == [0.5]
    for route in routes["routes"]:  # every window widened by hand to (0, 1]
        route["sigma_min"] = 0.0
        route.pop("sigma_max", None)
    doc["windows"] = toml.dumps(routes)
    path.write_text(toml.dumps(doc))
    calls.clear()
    with caplog.at_level(logging.INFO):
        run = _run(tmp_path / "b", model, network_dim=4, certify_budget=0.25)
    assert [s for s, _ in calls if s[0] == 1]  # not routed by the edited windows: certified anew
    assert "the cached entry is refused, certifying anew" in caplog.text and "windows_digest:" in caplog.text
    assert [r.sigma_min for r in run.network.downscale_run.cfg.routes] == [0.5]


def test_a_second_run_of_a_key_being_certified_waits_for_its_windows(tmp_path, model, windows_cache, steps, caplog, monkeypatch):  # noqa: F811
    calls = steps("flux")
    _run(tmp_path / "a", model, network_dim=4)
    (path,) = windows_cache.glob("*.toml")
    key = read_entry(str(path)).key
    aside = tmp_path / "aside.toml"
    path.rename(aside)
    other = reuse.KeyLock(key, str(windows_cache))  # the first run, still certifying
    assert other.acquire()
    wait = reuse.KeyLock.wait

    def finishes_meanwhile(self, seconds, poll=0.5):
        aside.rename(path)  # the first run writes its entry and lets go while this one waits
        other.release()
        return wait(self, seconds, poll)

    monkeypatch.setattr(reuse.KeyLock, "wait", finishes_meanwhile)
    calls.clear()
    with caplog.at_level(logging.INFO):
        run = _run(tmp_path / "b", model, network_dim=4)
    assert "another run of this key is certifying it now" in caplog.text and "routing by it from train batch" in caplog.text
    assert [s for s, _ in calls if s[0] == 1] == []  # the probes were taken, no draw was
    assert json.loads(run.network.downscale_run.extra_metadata["ss_downscale_map"])["method"] == "reused"
    monkeypatch.setattr(reuse.KeyLock, "wait", wait)
    monkeypatch.setattr(reuse, "LOCK_WAIT_S", 0.05)
    path.rename(aside)
    assert other.acquire()  # a first run still certifying past the wait: this one certifies anew, and says so
    calls.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "c", model, network_dim=4)
    other.release()
    assert "the other run certifying this key is still running after 0 s; certifying anew" in caplog.text
    assert [s for s, _ in calls if s[0] == 1]
