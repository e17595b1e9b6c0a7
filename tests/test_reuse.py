"""Certify once, reuse (``mapping/reuse.py``): the key, the cache, the files users share, and ``mode = "auto"``
reusing cached windows on the sd-scripts doubles at zero cost, or re-certifying and saying which key fields differ."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import toml
from host_modules import double_args, trainer_class
from test_sd_scripts_auto import ARGV, auto_config
from test_sd_scripts_map import steps  # noqa: F401  # the fixture recording each host step's latents

from downscale_plugin.__main__ import main
from downscale_plugin.mapping import reuse
from downscale_plugin.mapping.reuse import EntryError, WindowsKey, file_hash, lookup, read_entry, store

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan", "token_costs")

KEY = WindowsKey(
    model="sha256:" + "ab" * 32,
    arch="flux",
    network="networks.lora_flux",
    rank=16,
    buckets=("128x128", "96x128"),
    sampler="σ deciles at 128x128: 0.1 0.2",
    host="sd-scripts",
    version="0.2.0",
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
    "version": "0.3.0",
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
        assert other.differences(KEY) == [f"{name}: cached {getattr(KEY, name)!r}, this run {getattr(other, name)!r}"]
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


def test_store_then_lookup_hits_and_a_mismatch_names_the_nearest_entrys_fields(tmp_path):
    path = store(KEY, WINDOWS, 41.5, "2026-12-05T07:00:00Z", "test", str(tmp_path))
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
    entry = reuse.Entry(KEY, 1.0, "d", "", text)
    assert toml.loads(entry.render())["windows"] == text


def _entry_doc(**changes):
    doc = toml.loads(read_entry(store(KEY, WINDOWS, 1.0, "d", "", "/tmp/reuse_entry_doc")).render())
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
        ({"format": "other"}, "format: 'other' (allowed: 'downscale-plugin windows 1')"),
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
    store(KEY, WINDOWS, 41.5, "2026-12-05T07:00:00Z", "test", mine)
    assert main(["windows", "--cache", mine, "list"]) == 0
    listed = capsys.readouterr().out
    assert KEY.digest() in listed and "flux" in listed and "41.5" in listed
    shared = tmp_path / "flux-dev-r16.toml"
    assert main(["windows", "--cache", mine, "export", KEY.digest()[:6], str(shared)]) == 0
    assert WINDOWS in shared.read_text()  # the windows read as written, not as one escaped string
    assert main(["windows", "--cache", theirs, "import", str(shared)]) == 0
    hit = lookup(KEY, theirs)
    assert hit.entry is not None and hit.entry.windows_text == WINDOWS and hit.entry.cost == 41.5
    plugin = tmp_path / "windows.toml"
    assert main(["windows", "--cache", theirs, "export", "--plugin_toml", KEY.digest(), str(plugin)]) == 0
    assert plugin.read_text() == WINDOWS
    # other windows under the same key are not replaced silently
    other = tmp_path / "other.toml"
    store(KEY, WINDOWS.replace("0.5\n", "0.6\n"), 1.0, "d", "", str(tmp_path / "third"))
    other.write_text((tmp_path / "third" / f"{KEY.digest()}.toml").read_text())
    assert main(["windows", "--cache", theirs, "import", str(other)]) == 2
    assert "--replace" in capsys.readouterr().err
    assert main(["windows", "--cache", theirs, "import", "--replace", str(other)]) == 0
    assert "sigma_min = 0.6" in lookup(KEY, theirs).entry.windows_text
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


def test_a_second_auto_run_with_the_same_key_reuses_the_windows_at_zero_cost(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    first = _run(tmp_path / "a", model, network_dim=4)
    certified = first.network.downscale_run.cfg.routes
    entries = list(windows_cache.glob("*.toml"))
    assert certified and len(entries) == 1
    entry = read_entry(str(entries[0]))
    assert entry.key.model.startswith("sha256:") and entry.key.rank == 4 and entry.key.host == "sd-scripts" and entry.cost > 0
    calls = steps("flux")
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
    _run(tmp_path / "a", model, network_dim=4)
    calls = steps("flux")
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "b", model, network_dim=8, map_margin=0.9)
    assert [shape for shape, _ in calls if shape[0] == 1]  # the certifier drew its probes again
    assert "rank: cached 4, this run 8" in caplog.text and "margin: cached 0.99, this run 0.9" in caplog.text
    assert (tmp_path / "b" / "auto" / "certify.json").exists() and len(list(windows_cache.glob("*.toml"))) == 2


def test_reuse_off_neither_reads_nor_writes_the_cache(tmp_path, model, windows_cache, steps):  # noqa: F811
    _run(tmp_path / "a", model, network_dim=4)
    calls = steps("flux")
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


def test_a_resumed_run_routes_by_its_states_windows_not_the_cache(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    """``--resume`` of a state saved after the certification: the state's windows route it (and say so), as without a cache."""
    _run(tmp_path / "a", model, network_dim=4, save_state=True, save_every_n_steps=8, output_dir=str(tmp_path / "a" / "out"))
    state = tmp_path / "a" / "out" / "last-step00000008-state"
    calls = steps("flux")
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


def test_an_unwritable_cache_costs_the_reuse_not_the_run(tmp_path, model, caplog):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    with caplog.at_level(logging.INFO):
        run = _run(tmp_path, model, network_dim=4, certify_cache=str(blocker))
    assert "the windows cache could not be written" in caplog.text and run.network.downscale_run.cfg.routes


def test_the_adapters_own_network_args_are_keyed_the_plugins_are_not(tmp_path, model, windows_cache, steps, caplog):  # noqa: F811
    _run(tmp_path / "a", model, network_dim=4)
    calls = steps("flux")
    _run(tmp_path / "b", model, network_dim=4, network_args=["ds_gate=coupled"])  # a plugin key: the same key
    assert [s for s, _ in calls if s[0] == 1] == []
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "c", model, network_dim=4, network_args=["conv_dim=4", "ds_gate=coupled"])
    assert "network: cached 'networks.lora_flux', this run 'networks.lora_flux (conv_dim=4)'" in caplog.text
    assert [s for s, _ in calls if s[0] == 1]
