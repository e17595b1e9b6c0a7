"""The plugin never reseeds or rewinds the host's global generators (issue 10, items 2 and 3).

Item 2: over whole runs on the host doubles, one per sampler family (flux, sd3, lumina, ddpm), in
train mode (the start banner's plan Monte Carlo, the coupled gate's seeded draws) and in ``mode =
"map"``, ``RngTrap`` (tests/rng_trap.py) sees no global seeding, no state set except ``rng.forked``
putting back what it saved, and no ``seed_forked`` outside a fork covering its devices. A simulated
CUDA device shows the forks cover the device the host draws on and seed no other, in training steps and in the
in-run certifier's and map's draws over a kohya backend whose step draws on it. The trap itself
is shown to catch the 783fcdb banner (``torch.manual_seed`` inside ``fork_rng(devices=[])``).

Item 3: with the SD/SDXL noise options (multires noise, noise offset and its random strength and
adaptive scale, ip-noise gamma and its random strength) and the flow options each flow host honours,
a run whose routes cannot fire is the host's run bit for bit (losses, σ, weights, and torch's,
Python's and NumPy's generators after it), and in a run that routes some steps every step the
router leaves to the host is the host's own step bit for bit (``NativeStepCheck``).
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from host_modules import ARCHS, run_double
from rng_trap import PLUGIN_DIR, NativeStepCheck, RngTrap, rng_states, same

from downscale_plugin import rng
from downscale_plugin.hosts.sd_scripts import auto as _auto  # noqa: F401  # loaded before the trap wraps each module's seed_forked
from downscale_plugin.hosts.sd_scripts import families as sd_scripts_families
from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start
from downscale_plugin.mapping import certify as _certify  # noqa: F401
from downscale_plugin.router import Router

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")

RES = "128,128"
FAMILIES = {"flux": "flux", "sd3": "sd3", "lumina": "lumina", "sdxl": "ddpm"}  # one trainer per sampler family
SOME_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.4, "sigma_max": 0.8}]}
NEVER_FIRES = {"routes": [{"scale": 0.5, "sigma_min": 0.0, "sigma_max": 0.001}]}  # eligible; no host σ lies in (0, 0.001)
NOT_ELIGIBLE = {"routes": [{"route": "2048:1024", "sigma_min": 0.0}]}  # no bucket of the run is in the tier
# A window holding about 30 % of each family's default σ law: B = 1 and B = 2 runs have native and routed steps.
THIRD = {"flux": (0.65, 0.85), "sd3": (0.37, 0.67), "lumina": (0.8, 0.9), "ddpm": (0.5, 0.75)}
MAP_QUICK = {"map_ratios": [0.5], "map_bins": "0,0.5,1", "map_draws": 2, "map_images": 2}

MULTIRES = ("--multires_noise_iterations", "3")
OFFSET = ("--noise_offset", "0.1")
IP = ("--ip_noise_gamma", "0.1")
ALL_NOISE = (*MULTIRES, "--multires_noise_discount", "0.5", *OFFSET, "--noise_offset_random_strength",
             "--adaptive_noise_scale", "0.05", *IP, "--ip_noise_gamma_random_strength")  # fmt: skip
# The options each family's host honours (tu:6071-6107; ftu:519-527 and ltu:863-871 read ip-noise only;
# sd3_train_utils reads none of them). A family is also given all of them: the ones its host ignores
# must change nothing either.
NOISE_OPTIONS = {
    "ddpm": [
        MULTIRES,
        (*MULTIRES, "--multires_noise_discount", "0.5"),
        OFFSET,
        (*OFFSET, "--noise_offset_random_strength"),
        (*OFFSET, "--adaptive_noise_scale", "0.05"),
        (*OFFSET, "--noise_offset_random_strength", "--adaptive_noise_scale", "-0.05"),
        IP,
        (*IP, "--ip_noise_gamma_random_strength"),
        ALL_NOISE,
    ],
    "flux": [IP, (*IP, "--ip_noise_gamma_random_strength"), ALL_NOISE],
    "lumina": [IP, (*IP, "--ip_noise_gamma_random_strength"), ALL_NOISE],
    "sd3": [ALL_NOISE],
}
NOISE_CASES = [
    pytest.param(arch, options, id=f"{arch}-{'-'.join(o.lstrip('-') for o in options)}")
    for arch, family in FAMILIES.items()
    for options in NOISE_OPTIONS[family]
] + [pytest.param("sd1", ALL_NOISE, id="sd1-all")]


def seeded_run(arch: str, *argv: str, **kwargs):
    """A doubles run from fixed Python/NumPy states (the trainer seeds torch from ``--seed`` itself)."""
    random.seed(11)
    np.random.seed(11)
    return run_double(arch, *argv, **kwargs)


# -- item 2: the trap over whole runs ---------------------------------------------------------------


@pytest.fixture
def rng_trap():
    """The trap, active for the whole test; the test asserts on what it saw."""
    with RngTrap() as trap:
        yield trap


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_whole_train_run_never_reseeds_or_rewinds_a_global_generator(arch, rng_trap, monkeypatch):
    samples = []
    sample = sd_scripts_families.HostSampler.sample
    monkeypatch.setattr(sd_scripts_families.HostSampler, "sample", lambda self, *a, **k: samples.append(a[0]) or sample(self, *a, **k))
    noise = ALL_NOISE if FAMILIES[arch] == "ddpm" else IP
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "8", "--seed", "4", *noise)
    low, high = THIRD[FAMILIES[arch]]
    run = seeded_run(arch, *argv, downscale={"routes": [{"scale": 0.5, "sigma_min": low, "sigma_max": high}]}).last_run
    accounting = run.network.downscale_run.accounting
    assert rng_trap.violations == [], rng_trap.report()
    assert sd_scripts_start.PLAN_MC_SAMPLES in samples  # the banner's plan Monte Carlo ran under the trap
    assert accounting.total_steps == 8 and 0 < accounting.counts.steps[-1] < 8  # routed and native steps both ran under the trap
    assert rng_trap.restores >= 3 * 9 and rng_trap.seeded >= 1  # CPU, random, NumPy of every step's fork and the plan's; its seed


@pytest.mark.parametrize("after_map", ["stop", "train"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_whole_map_run_never_reseeds_or_rewinds_a_global_generator(arch, after_map, rng_trap, tmp_path):
    downscale = {"mode": "map", "map_out": str(tmp_path / "map"), "after_map": after_map, **MAP_QUICK}
    argv = ("--resolution", RES, "--max_train_steps", "4", "--seed", "4", *(ALL_NOISE if FAMILIES[arch] == "ddpm" else IP))
    try:
        seeded_run(arch, *argv, downscale=downscale)
    except SystemExit as stop:
        assert after_map == "stop" and stop.code in (0, None)
    assert (tmp_path / "map" / "windows.toml").is_file()
    assert rng_trap.violations == [], rng_trap.report()
    draws = 2 * 3 * 3 * 2  # images × bins × arms × draws, each seeded inside its own fork
    assert rng_trap.seeded >= draws and rng_trap.restores >= 3 * draws  # CPU, Python, NumPy per draw


@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.usefixtures("token_costs")
def test_a_whole_auto_run_never_reseeds_or_rewinds_a_global_generator(arch, rng_trap, tmp_path):
    """The certifier's paired draws inject their noise and seed each draw's fork; nothing global moves."""
    downscale = {"mode": "auto", "map_out": str(tmp_path / "auto"), "map_ratios": [0.5], "map_bins": "0,0.5,1"}
    downscale.update(certify_draws=2, certify_budget=0.5, map_margin=0.99, certify_unpaid="buy")
    argv = ("--resolution", RES, "--train_batch_size", "4", "--max_train_steps", "24", "--dataset_size", "16", "--seed", "4")
    seeded_run(arch, *argv, *(ALL_NOISE if FAMILIES[arch] == "ddpm" else IP), downscale=downscale)
    assert (tmp_path / "auto" / "certify.json").is_file()
    assert rng_trap.violations == [], rng_trap.report()
    assert rng_trap.seeded >= 4 * 2 * 2  # a look: 4 probes × 2 draws × (native + route), each seeded inside its own fork


def _old_banner_sample(self, n, latent_hw, generator=None):
    """``HostSampler.sample`` as 783fcdb had it: ``torch.manual_seed`` inside ``fork_rng(devices=[])``."""
    seed = generator.initial_seed() if generator is not None else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bound = self.family.bind(self.args, self.noise_scheduler, torch.zeros(1, 1, *latent_hw), "cpu", self.dtype)
        return torch.cat([bound.draw(min(256, n - i)) for i in range(0, n, 256)]).float()


def test_the_trap_catches_the_783fcdb_banner_reseed(rng_trap, monkeypatch):
    monkeypatch.setattr(sd_scripts_families.HostSampler, "sample", _old_banner_sample)
    seeded_run("flux", "--resolution", RES, "--max_train_steps", "2", "--seed", "4", downscale=SOME_ROUTED)
    found = "\n".join(rng_trap.violations)
    assert "torch.manual_seed(0,) under plugin code at downscale_plugin/plan.py" in found  # the banner's reseed ...
    assert "torch.cuda.manual_seed_all(0,) under plugin code" in found  # ... which reseeds every CUDA device
    assert "torch.set_rng_state under plugin code" in found  # fork_rng restores the CPU only (not random/NumPy/devices)


def test_the_trap_flags_plugin_frames_only_and_checks_every_fork(rng_trap):
    probe = "import random, numpy, torch\nrandom.seed(1)\nnumpy.random.seed(1)\ntorch.seed()\ntorch.set_rng_state(torch.get_rng_state())\n"
    exec(compile(probe, os.path.join(PLUGIN_DIR, "lab", "probe.py"), "exec"), {})  # the stand-in host may seed
    exec(compile(probe, __file__, "exec"), {})  # so may the tests and the host
    assert rng_trap.violations == [] and rng_trap.host_seeds >= 3
    with rng.forked():
        rng.seed_forked(5)
        torch.rand(3)
        random.random()
    assert rng_trap.violations == [] and rng_trap.restores == 3 and rng_trap.seeded == 1  # CPU, Python, NumPy: as saved
    exec(compile(probe, os.path.join(PLUGIN_DIR, "hosts", "probe.py"), "exec"), {})  # plugin code
    rng.seed_forked(5)  # outside any fork: the run's CPU stream reset
    found = rng_trap.violations
    for label in ("random.seed", "numpy.random.seed", "torch.seed", "torch.cuda.manual_seed_all", "torch.set_rng_state", "seed_forked"):
        assert any(v.startswith(label) for v in found), (label, found)
    assert all("downscale_plugin/hosts/probe.py:" in v for v in found if not v.startswith("seed_forked"))


def test_plugin_source_has_no_global_seeding_outside_rng_py():
    """A static guard for what the runtime trap cannot see: a generator object seeded directly (``torch.default_generator``,
    ``torch.cuda.default_generators``), or a global seeding name the runs above never reach."""
    pattern = re.compile(
        r"torch\.(random\.)?(manual_seed|seed|set_rng_state|fork_rng)\b|torch\.(cuda|mps|xpu)\.\w*(seed|set_rng_state)"
        r"|default_generators?\b|\brandom\.(seed|setstate)\b|np\.random\.(seed|set_state)\b|numpy\.random\.(seed|set_state)\b"
    )
    found = []
    for path in Path(PLUGIN_DIR).rglob("*.py"):
        rel = path.relative_to(PLUGIN_DIR).as_posix()
        if rel.startswith("lab/") or rel == "rng.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and not code.strip().startswith(('"', "'")):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert found == []


# -- a simulated CUDA device -------------------------------------------------------------------------


class FakeCudaGenerator:
    """A CUDA device's default generator: state, seeds and draws, recorded."""

    def __init__(self, index: int):
        self.index, self.state, self.seeds, self.draws = index, torch.tensor([index, 0], dtype=torch.int64), [], 0

    def get_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()

    def manual_seed(self, value: int):
        self.seeds.append(value)
        self.state = torch.tensor([self.index, value & 0x7FFFFFFF], dtype=torch.int64)
        return self

    def draw(self, n: int) -> torch.Tensor:
        """n uniforms from this device's stream (a function of its state), advancing it as a real draw would."""
        gen = torch.Generator().manual_seed(int(self.state[1]) * 1_000_003 + int(self.state[0]))
        self.state = self.state + torch.tensor([0, 1 + n])
        self.draws += 1
        return torch.rand(n, generator=gen, dtype=torch.float64)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two fake CUDA devices (current: cuda:0) behind torch.cuda's RNG API; ``seed_all`` records reseeds of every device."""
    gens = (FakeCudaGenerator(0), FakeCudaGenerator(1))
    seed_all = []

    def index(device="cuda"):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return 0 if device.index is None else device.index

    monkeypatch.setattr(torch.cuda, "default_generators", gens, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gens[index(device)].get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": gens[index(device)].set_state(state))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seed_all.append)
    return SimpleNamespace(gens=gens, seed_all=seed_all)


class FakeCudaHost:
    """A flow host whose σ sampler draws on the accelerator, the fake ``cuda:0`` (as sd-scripts' ``torch.rand((bsz,),
    device=device)`` does on a GPU run); its tensors stay on the CPU, which this build has."""

    __name__ = "fake_cuda_host"

    def __init__(self, device_generator: FakeCudaGenerator):
        self.device_generator = device_generator

    def get_noisy_model_input_and_timesteps(self, args, noise_scheduler, latents, noise, device, dtype):
        sigmas = self.device_generator.draw(latents.shape[0]).float().view(-1, 1, 1, 1)
        return (1 - sigmas) * latents + sigmas * noise, sigmas.flatten() * 1000, sigmas


def _fake_cuda_steps(gens, devices, steps: int = 40) -> tuple[list[int], list[bool]]:
    """The hook and router on a host whose sampler draws on the fake ``cuda:0``; the router forks ``devices``. Returns the
    steps whose host call did not start from the step's entry states, and which steps routed."""
    from downscale_plugin.hosts.sd_scripts.families import FlowFamily
    from downscale_plugin.hosts.sd_scripts.hook import DownscaleHook

    cuda0 = gens[0]
    family = FlowFamily(FakeCudaHost(cuda0), "flux")
    args = SimpleNamespace(ip_noise_gamma=None, timestep_sampling="uniform")
    scheduler = SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000))
    cfg = sd_scripts_start.plugin_config({}, SimpleNamespace(downscale=SOME_ROUTED))
    hook = DownscaleHook(Router.from_config(cfg, "flux", seed=3, total_forwards=50, devices=devices), family)
    accelerator = SimpleNamespace(device=torch.device("cuda", 0), unwrap_model=lambda m: m)
    reached, moved, routed = [], [], []

    def host_step(args, accelerator, noise_scheduler, latents, *rest, is_train=True):
        reached.append((cuda0.get_state(), torch.get_rng_state()))  # where the host's own draws start
        noisy, t, _ = family.module.get_noisy_model_input_and_timesteps(args, noise_scheduler, latents, latents, "cpu", torch.float32)
        return noisy, latents, t, None

    for step in range(steps):
        latents = torch.randn(4, 4, 16, 16)
        entry = (cuda0.get_state(), torch.get_rng_state())
        hook.dispatch(host_step, args, accelerator, scheduler, latents, None, None, None, None, torch.float32, True)
        routed.append(hook.last.routed)
        if not same(reached[-1], entry) or not torch.equal(cuda0.state, entry[0] + torch.tensor([0, 5])):  # + the host's 4-σ draw
            moved.append(step)
    return moved, routed


def test_forks_cover_the_cuda_device_the_host_draws_on_and_seed_no_other(fake_cuda, rng_trap):
    cuda0, cuda1 = fake_cuda.gens
    devices = rng.accelerator_devices(torch.device("cuda"))  # an accelerator on "cuda": the current device
    assert devices == (torch.device("cuda", 0),)
    moved, routed = _fake_cuda_steps(fake_cuda.gens, devices)
    assert moved == []  # the dry run, the lead and the redraws left cuda:0 (and the CPU) as they were; only the host drew
    assert any(routed) and not all(routed)
    assert cuda0.seeds and cuda0.draws > 2 * 40  # the gate's seeded draws ran on cuda:0, seeded through its own generator
    assert cuda1.seeds == [] and cuda1.draws == 0 and torch.equal(cuda1.state, torch.tensor([1, 0]))  # never another device
    assert fake_cuda.seed_all == [] and rng_trap.violations == [], rng_trap.report()


def test_a_fork_without_the_hosts_device_is_caught(fake_cuda):
    """The check above can fail: forking the CPU only (what ``fork_rng(devices=[])`` did) lets the dry run advance cuda:0."""
    moved, _ = _fake_cuda_steps(fake_cuda.gens, devices=(), steps=10)
    assert moved == list(range(10))


def test_the_start_wiring_forks_the_accelerators_device(monkeypatch):
    """The run's router forks exactly ``accelerator_devices`` of the run accelerator's device."""
    asked = []
    resolve = sd_scripts_start.accelerator_devices
    monkeypatch.setattr(sd_scripts_start, "accelerator_devices", lambda device: asked.append(device) or resolve(device))
    run = seeded_run("flux", "--resolution", RES, "--max_train_steps", "1", downscale=SOME_ROUTED).last_run
    assert asked and all(device is run.accelerator.device for device in asked)
    assert run.network.downscale_run.router.devices == resolve(run.accelerator.device)


# -- the in-run measurements (map, auto) on a host that draws on the simulated CUDA device ------------

PROBE_BINS = "0,0.5,1"  # two σ bins, no σ = 1 endpoint


def _device_normal(gen: FakeCudaGenerator, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normals from a fake device's stream: what ``torch.randn_like`` of a tensor on that device draws."""
    u = gen.draw(int(np.prod(shape))).clamp(1e-12, 1 - 1e-12)
    return (torch.erfinv(2 * u - 1) * 2**0.5).float().view(shape)


class FakeCudaProbeHost:
    """A kohya trainer's step on a GPU, one probe → its loss, for the in-run measurements: σ drawn on the device
    (``torch.rand((bsz,), device=device)``), the noise and the ip-noise ``torch.randn_like(latents)`` of latents on the
    device (``torch.randn_like`` is patched to draw from the fake ``cuda:0``; the certifier's paired noise fills the
    first one). The step hook's forcing (``ForcedSteps``) sets the arm's grid (the latents area-downsampled) and σ.
    The "DiT" is a 1x1 conv, its weights the trainable adapter. ``entries``: per step, the ``cuda:0`` state it started
    from, how many seeds ``cuda:0`` had had by then and the last one."""

    def __init__(self, cuda0: FakeCudaGenerator, monkeypatch, images: int = 4):
        from downscale_plugin.hosts.kohya.probes import ForcedSteps

        gen = torch.Generator().manual_seed(21)
        self.cuda0, self.hook, self.entries = cuda0, ForcedSteps(), []
        self.dit = torch.nn.Conv2d(4, 4, 1)
        with torch.no_grad():
            for p in self.dit.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        self.probes = [{"latents": torch.randn(1, 4, 16, 16, generator=gen)} for _ in range(images)]
        monkeypatch.setattr(torch, "randn_like", lambda x, *a, **k: _device_normal(cuda0, tuple(x.shape)).to(x.dtype))

    def step(self, probe: dict) -> torch.Tensor:
        from downscale_plugin.grid import area_downsample

        self.entries.append((self.cuda0.get_state(), len(self.cuda0.seeds), self.cuda0.seeds[-1:]))
        latents = probe["latents"]
        sigma = self.cuda0.draw(latents.shape[0]).float()  # the host's σ draw, on the device
        if self.hook.forced is not None:
            target_hw, forced = self.hook.forced
            latents = latents if target_hw is None else area_downsample(latents, target_hw)
            sigma = torch.full_like(sigma, forced)
        noise = torch.randn_like(latents)
        xi = torch.randn_like(latents)  # ip-noise: sd-scripts' second randn_like, on the device
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * latents + s * (noise + 0.1 * xi)
        return torch.nn.functional.mse_loss(self.dit(noisy), noise - latents)

    def backend(self, out_dir, devices=None):
        """The measurement's backend as the kohya session builds it for an accelerator on ``"cuda"`` (its devices
        ``accelerator_devices(accelerator.device)``); with ``devices``, a ``ProbeBackend`` forking those instead."""
        from downscale_plugin.hosts.kohya.backend import ProbeBackend
        from downscale_plugin.hosts.kohya.probes import ForcedSteps, ProbeSession

        if devices is not None:
            return ProbeBackend(self.probes, self.step, self.hook.forcing, list(self.dit.parameters()), "flux", devices, {}, seed=5)

        class Session(ProbeSession):
            hook_class = ForcedSteps

            def probe_step(self, arguments):
                return arguments["step"]

            def describe(self, arguments):
                return {"model": "a 1x1 conv", "model_identity": None}

        run = SimpleNamespace(cfg=SimpleNamespace(map=SimpleNamespace(out=str(out_dir))), arch="flux", seed=5)
        ctx = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cuda")))
        session = Session(run, ctx, None, SimpleNamespace(batch_size=2), None, len(self.probes))
        self.hook = session.make_hook()
        session.probes = list(self.probes)
        arguments = {"accelerator": SimpleNamespace(unwrap_model=lambda m: m), "network": self.dit, "step": self.step}
        backend = session.backend(arguments)
        assert session.devices == rng.accelerator_devices(torch.device("cuda")) and backend.rng_devices == session.devices
        return backend


def _certify_in_run(backend, out_dir) -> str:
    """The auto session's certification (``certify_in_run``), one route, two bins, D = 2, looks at 2 and 4 probes:
    its evidence and bounds, every float as its exact repr."""
    from downscale_plugin.bins import parse_bins
    from downscale_plugin.mapping.arms import latent_arm
    from downscale_plugin.mapping.certify import CertifySettings
    from downscale_plugin.mapping.in_run import certify_in_run
    from downscale_plugin.mapping.sequential import Looks

    settings = CertifySettings(margin=0.5, draws=2, looks=Looks(at=(2, 4)), budget=1000.0, seed=5, spot_checks=1)
    bins = parse_bins(PROBE_BINS, endpoint=False)
    done = certify_in_run(backend, [latent_arm(0.5)], bins, settings, lambda lo, hi: max(hi - lo, 0.0), "uniform σ", str(out_dir), "t")
    assert all(len(t.values) >= 2 for t in done.result.tests) and {t.bin for t in done.result.tests} == {0, 1}  # evidence in both bins
    return repr([(t.route, t.bin, t.images, t.values, t.bound, t.verdict) for t in done.result.tests])


def _map_in_run(backend, out_dir) -> str:
    """The map session's estimator (``run_map``, without the session's outer fork: each draw's own must restore),
    two probes, two bins, D = 2: its cells, every float as its exact repr."""
    from downscale_plugin.bins import parse_bins
    from downscale_plugin.mapping.arms import build_arms
    from downscale_plugin.mapping.estimator import MapSettings, run_map

    settings = MapSettings(margin=0.5, draws=2, images=2, seed=5)
    result = run_map(backend, build_arms([0.5]), parse_bins(PROBE_BINS, endpoint=False), settings, progress=False)
    return repr(result.cells)


MEASUREMENTS = {"certify": _certify_in_run, "map": _map_in_run}


def _untouchable(gen: FakeCudaGenerator, monkeypatch) -> list[str]:
    """Records every read or write of ``gen``'s state."""
    touched: list[str] = []
    get, put = gen.get_state, gen.set_state
    monkeypatch.setattr(gen, "get_state", lambda: touched.append("get") or get())
    monkeypatch.setattr(gen, "set_state", lambda state: touched.append("set") or put(state))
    return touched


def _advance_all(cuda0: FakeCudaGenerator) -> None:
    """The run's own draws between two measurements: every global stream moves on."""
    cuda0.draw(7)
    torch.rand(3)
    random.random()
    np.random.rand()


@pytest.mark.parametrize("measure", list(MEASUREMENTS))
def test_in_run_measurements_fork_and_seed_the_cuda_device_the_host_draws_on(measure, fake_cuda, rng_trap, monkeypatch, tmp_path):
    """``mode = "auto"``'s certifier and ``mode = "map"``'s estimator over a kohya backend whose step draws σ and noise on
    ``cuda:0``: the run's streams (``cuda:0``, CPU, Python, NumPy) end where they were, each draw started from its own
    seed on ``cuda:0``, the evidence is a function of the seed alone, and no other device is touched or reseeded."""
    cuda0, cuda1 = fake_cuda.gens
    touched = _untouchable(cuda1, monkeypatch)
    host = FakeCudaProbeHost(cuda0, monkeypatch)
    backend = host.backend(tmp_path)
    assert backend.rng_devices == (torch.device("cuda", 0),)
    cuda0.draw(3)  # the run is mid-stream on its device
    before = (cuda0.get_state(), rng_states())
    first = MEASUREMENTS[measure](backend, tmp_path)
    assert same((cuda0.get_state(), rng_states()), before)  # (1) training continues as if nothing had run
    steps = len(host.entries)
    assert steps >= 16 and [n for _, n, _ in host.entries] == list(range(1, steps + 1))  # (2) one cuda:0 seed per draw ...
    assert all(torch.equal(state, torch.tensor([0, last[0] & 0x7FFFFFFF])) for state, _, last in host.entries)  # ... just before it
    assert len(set(cuda0.seeds)) > 1 and rng_trap.seeded == steps  # distinct per-draw seeds, each inside a fork covering cuda:0
    assert rng_trap.restores >= 4 * steps  # every draw's fork put back the CPU, cuda:0, Python and NumPy as it saved them

    _advance_all(cuda0)
    before = (cuda0.get_state(), rng_states())
    again = MEASUREMENTS[measure](backend, tmp_path)
    assert again == first  # (2) the same seed, from other run states: the same evidence, bit for bit
    assert same((cuda0.get_state(), rng_states()), before)
    assert cuda0.seeds[:steps] == cuda0.seeds[steps:]  # the same seeds, in the same order

    assert cuda1.seeds == [] and cuda1.draws == 0 and touched == [] and torch.equal(cuda1.state, torch.tensor([1, 0]))  # (3)
    assert fake_cuda.seed_all == [] and rng_trap.violations == [], rng_trap.report()  # never manual_seed_all, nothing global


@pytest.mark.parametrize("devices", [(), (torch.device("cuda", 1),)], ids=["cpu-only", "cuda1"])
@pytest.mark.parametrize("measure", list(MEASUREMENTS))
def test_a_measurement_backend_forking_the_wrong_devices_is_caught(measure, devices, fake_cuda, monkeypatch, tmp_path):
    """The checks above can fail: a backend whose ``rng_devices`` miss the host's ``cuda:0`` (none, or another device)
    lets the measurement's draws advance the run's device stream, unseeded, so its evidence follows the run's state."""
    cuda0, cuda1 = fake_cuda.gens
    host = FakeCudaProbeHost(cuda0, monkeypatch)
    backend = host.backend(tmp_path, devices=devices)
    before, cpu = cuda0.get_state(), rng_states()
    first = MEASUREMENTS[measure](backend, tmp_path)
    assert not torch.equal(cuda0.state, before) and cuda0.seeds == []  # cuda:0 moved on, never seeded
    assert same(rng_states(), cpu)  # the CPU, Python and NumPy were forked: the miss is the device's alone
    assert MEASUREMENTS[measure](backend, tmp_path) != first  # from where the first left cuda:0: other evidence
    assert bool(cuda1.seeds) == bool(devices)  # the wrong device was the one seeded


# -- log records: rich's console handler draws Python's random per record ------------------------------


class DrawingConsole(logging.Handler):
    """What rich's ``RichHandler`` (both kohya trainers' console) does to Python's ``random``: every record it renders
    draws ``randint`` (``rich.style.Style``'s link ids for the record's path column). ``records``: (file, line) each."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        random.randint(0, 999999)
        self.records.append((record.pathname, record.lineno))


@pytest.fixture
def drawing_console():
    """The root logger at INFO with a :class:`DrawingConsole`, as sd-scripts' ``setup_logging`` leaves it (with rich)."""
    root, console = logging.getLogger(), DrawingConsole()
    level = root.level
    root.addHandler(console)
    root.setLevel(logging.INFO)
    yield console
    root.removeHandler(console)
    root.setLevel(level)


def test_plugin_log_records_leave_pythons_random_as_they_found_it(drawing_console):
    from downscale_plugin.hosts.kohya import run as kohya_run

    state = random.getstate()
    kohya_run.logger.info("downscale_plugin: a record %s", 1)
    kohya_run.logger.warning("downscale_plugin: another")
    assert random.getstate() == state and len(drawing_console.records) == 2
    assert drawing_console.records[0] == (__file__, inspect.currentframe().f_lineno - 3)  # the caller, not rng.py
    logging.getLogger("not.the.plugin").info("a host record")  # the check can fail: an ordinary logger's record draws
    assert random.getstate() != state


def test_every_plugin_module_logs_through_the_random_keeping_logger():
    found = [
        f"{path.relative_to(PLUGIN_DIR).as_posix()}:{number}: {line.strip()}"
        for path in Path(PLUGIN_DIR).rglob("*.py")
        if path.name != "rng.py" and not path.relative_to(PLUGIN_DIR).as_posix().startswith("lab/")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"logging\.(getLogger|info|warning|error|debug|exception|log)\(", line.split("#")[0])
    ]
    assert found == []


@pytest.mark.usefixtures("token_costs")
def test_an_auto_run_that_opens_nothing_under_a_drawing_console_is_the_host_run_bit_for_bit(drawing_console, tmp_path):
    """The certifier's log lines and the first step's resume line, rendered by a console that draws Python's random
    (rich's, by default in sd-scripts), must leave the host's later Python draws (--flip_aug, caption shuffling) as
    they would have been: the run ends with every global generator where the plain run's ends."""
    downscale = {"mode": "auto", "map_out": str(tmp_path / "auto"), "map_ratios": [0.5], "map_bins": "0,0.5,1"}
    downscale.update(certify_draws=2, certify_budget=0.5, map_margin=1e-9, certify_unpaid="buy")
    argv = ("--resolution", RES, "--train_batch_size", "4", "--max_train_steps", "24", "--dataset_size", "16", "--seed", "4")
    plain = seeded_run("flux", *argv, network_module=ARCHS["flux"][2]).last_run
    plain_states, plain_weights, plain_records = rng_states(), _weights(plain), len(drawing_console.records)
    run = seeded_run("flux", *argv, downscale=downscale).last_run
    assert (tmp_path / "auto" / "certify.json").is_file() and len(drawing_console.records) > 2 * plain_records  # the plugin logged
    assert run.losses == plain.losses and same(_weights(run), plain_weights)
    assert same(rng_states(), plain_states)


# -- item 3: SD/SDXL (and flow) noise options, bit for bit -------------------------------------------


def _weights(run) -> dict:
    return {k: v.clone() for k, v in run.network.state_dict().items()}


@pytest.mark.parametrize(("arch", "options"), NOISE_CASES)
@pytest.mark.parametrize("config", [NEVER_FIRES, NOT_ELIGIBLE], ids=["window-never-hit", "not-eligible"])
def test_a_run_whose_routes_cannot_fire_is_the_host_run_bit_for_bit(arch, options, config):
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "4", "--seed", "6", *options)
    plain = seeded_run(arch, *argv, network_module=ARCHS[arch][2]).last_run
    plain_states, plain_weights = rng_states(), _weights(plain)
    run = seeded_run(arch, *argv, downscale=config).last_run
    assert run.network.downscale_run.accounting.demote_fraction() == 0.0  # no step routed
    assert run.losses == plain.losses
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(run.unet.calls, plain.unet.calls, strict=True))
    assert same(_weights(run), plain_weights)
    assert same(rng_states(), plain_states)  # torch's, Python's and NumPy's generators end where the host's do


@pytest.mark.parametrize(("arch", "options"), NOISE_CASES)
@pytest.mark.parametrize("batch", [1, 2])
def test_every_step_left_to_the_host_is_the_host_step_bit_for_bit(arch, options, batch):
    argv = ("--resolution", RES, "--train_batch_size", str(batch), "--max_train_steps", "24", "--seed", "7", *options)
    low, high = THIRD[FAMILIES.get(arch, "ddpm")]
    with NativeStepCheck() as check:
        seeded_run(arch, *argv, downscale={"routes": [{"scale": 0.5, "sigma_min": low, "sigma_max": high}]})
    assert check.failures == []
    assert check.native > 0 and check.replayed > 0  # both kinds of step ran


def test_the_native_step_check_can_fail(monkeypatch):
    """The router's fork as it was before rng.py (``torch.random.fork_rng``: CPU only) lets the DDPM dry run's multires
    noise advance Python's ``random``: every step the router leaves to the host then starts from a different state."""
    monkeypatch.setattr("downscale_plugin.router.forked", lambda devices=(): torch.random.fork_rng(devices=[]))
    with NativeStepCheck() as check:
        seeded_run("sdxl", "--resolution", RES, "--max_train_steps", "4", "--seed", "7", *MULTIRES, downscale=NEVER_FIRES)
    assert check.native == 4 and sum("differ" in f for f in check.failures) >= 4
