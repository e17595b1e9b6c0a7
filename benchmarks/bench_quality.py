"""The same adapter, sooner? Time to quality of routed LoRA fine-tunes on three concepts, as
``docs/fidelity/quality/PROTOCOL.md`` (version 4) fixes it; the protocol is the specification.

Per concept (``lab.concept.task_data``) and seed, every arm is a twin of the native run
(``hosts/lab/twin.py``) on the shipped multi-size base (``lab.base.load_base("multires")``), trained to
one unit of the native twin's training FLOPs over S steps with the learning rate cosine over the FLOPs
spent (``--schedule steps``: the sensitivity analysis, cosine over S steps), validated at 8 points per
unit on held-out crops at every σ stratum (the protocol's eight plus the midpoint of each routed band
that holds none), every item's loss stored; at the end, 8 samples (``lab/generate.py``) and their
spectrum distance to the held-out images. Arms: ``native``, ``default`` (the concept map's windows at
ε = 0.2), ``eps<X>`` (the other margin, chosen by ``windows``), ``interp`` (the windows at ε = 0.2 of the concept map
with interpolated positions, run with them), ``seed_recipe``, ``all0.5``.

Subcommands (the lead runs them in this order):

    python benchmarks/bench_quality.py windows --concept hatch --map MAP_JSON   # windows/<concept>_eps<X>.toml + the other margin
    python benchmarks/bench_quality.py windows --concept hatch --map INTERP_MAP_JSON --positions interpolate  # the interp arm's
    python benchmarks/bench_quality.py pilot --concepts hatch,subject,style --jobs 2      # decides S per concept
    python benchmarks/bench_quality.py study --concepts hatch,subject,style --jobs 2      # resumable
    python benchmarks/bench_quality.py study --concepts style --schedule steps --jobs 2   # the sensitivity analysis
    python benchmarks/bench_quality.py report                                            # aggregates what is stored
    python benchmarks/bench_quality.py bands --concepts hatch --seeds 0                  # exploratory: the sample metric by octave

Every run records its code revision and the protocol's; a code revision that does not descend from
the protocol's is refused, and so is a stored run whose study files changed since (``STUDY_PATHS``).
Version 0 (the hatched posters alone) is kept as run: ``docs/fidelity/quality/v0_hatch/README.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, for the workers too
OUT = ROOT / "docs" / "fidelity" / "quality"
PROTOCOL = "docs/fidelity/quality/PROTOCOL.md"

CONCEPTS = {"hatch": "fine_detail", "subject": "subject", "style": "style"}  # PROTOCOL §2, in its order: name → task.kind
FIXED_SIGMAS = (0.05, 0.2, 0.4, 0.6, 0.75, 0.85, 0.925, 0.975)  # PROTOCOL §3
DEFAULT_MARGIN = 0.2
OTHER_MARGINS = ((0.3, 0.4, 0.5), (0.1, 0.05))  # PROTOCOL §4: the first that routes another share, wider first
NARROW_MARGIN = 0.1  # PROTOCOL §4, §6 (version 4): the ε = 0.1 comparison, run when no wider margin is non-inferior everywhere
NARROW = f"eps{NARROW_MARGIN:g}"  # its arm, and its runs' folder suffix
SEEDS = tuple(range(16))
CONTROL_SEEDS = tuple(range(8))
PILOT_SEEDS = (100, 101)
PILOT_STEPS = (400, 800)
PILOT_MIN_GAIN, PILOT_MAX_LAST_QUARTER = 0.05, 0.10
SENSITIVITY = {"arms": ("native", "default"), "seeds": tuple(range(8))}  # on sensitivity_concept(): PROTOCOL §1
CONTROL = "all0.5"
INTERP = "interp"  # PROTOCOL §4 (version 2): the default margin's windows with interpolated positions
INTERP_SETTING = ("keep", "interpolate", "plain")  # its map arms' (sigma_policy, positions, attention)
QUALITY = 0.9
MARGIN_SHARE = 0.1  # δ = this × mean native G
REPS, BOOT_SEED = 2000, 0
NATIVE_LATENT = (64, 64)  # the native size 256 × 256 px at the codec's 4 px per cell
SAMPLE_SEEDS, SAMPLE_STEPS = tuple(range(8)), 24
REFERENCE_CROPS = 16  # held-out crops at the native size for the reference spectrum
ROWS_PER_FORWARD = 4  # validation: bitwise the whole-bucket forward, ~15 % less CPU at one thread
SEED_RECIPE = [{"route": "256:192", "sigma_min": 0.65, "sigma_max": 0.95}, {"route": "256:224", "sigma_min": 0.5}]
ALL_HALF = [{"route": "256:128", "sigma_min": 0.0}]
# What a run's figures depend on besides its settings and its arm's table: a change here makes stored runs stale.
STUDY_PATHS = (
    "downscale_plugin/lab",
    "downscale_plugin/hosts/lab/twin.py",
    "downscale_plugin/hosts/lab/adapter.py",
    "downscale_plugin/hosts/lab/sampler.py",
    "downscale_plugin/hosts/sd_scripts/hook.py",
    "downscale_plugin/hosts/sd_scripts/families.py",
    "downscale_plugin/router.py",
    "downscale_plugin/sigma.py",
    "downscale_plugin/grid.py",
    "downscale_plugin/rng.py",
    "downscale_plugin/mapping/paired.py",
    "downscale_plugin/flops.py",
)


# ---- revisions ----


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def protocol_revision() -> str | None:
    """The commit that last changed PROTOCOL.md."""
    out = _git("log", "-1", "--format=%H", "--", PROTOCOL)
    return out.strip() or None if out else None


def is_ancestor(older: str | None, newer: str | None) -> bool:
    """Whether commit ``older`` is among ``newer``'s ancestors (or is it); False for a revision this checkout lacks."""
    if not older or not newer:
        return False
    try:
        return subprocess.run(["git", "merge-base", "--is-ancestor", older, newer], cwd=ROOT, capture_output=True).returncode == 0
    except OSError:
        return False


def descends_from_protocol(revision: str | None) -> bool:
    """Whether ``revision`` has the protocol's commit among its ancestors (or is it)."""
    return is_ancestor(protocol_revision(), revision)


def code_state() -> dict[str, str | None]:
    """HEAD and a hash of the uncommitted change to ``STUDY_PATHS`` ("" when clean)."""
    head = _git("rev-parse", "HEAD")
    diff = _git("diff", "HEAD", "--", *STUDY_PATHS) or ""
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *STUDY_PATHS) or ""
    change = diff + untracked
    return {"revision": head.strip() if head else None, "uncommitted": hashlib.sha256(change.encode()).hexdigest()[:16] if change else ""}


def stale_reason(run: dict[str, Any], now: dict[str, str | None]) -> str | None:
    """Why a stored run cannot be reused at the current code (None: it can)."""
    then = run.get("code")
    if not then or not then.get("revision"):
        return "it records no code revision"
    if not descends_from_protocol(then["revision"]):
        return f"its code revision {then['revision'][:12]} does not descend from the protocol's ({(protocol_revision() or '?')[:12]})"
    if then["uncommitted"] != now["uncommitted"]:
        return f"it ran with another uncommitted change to the study's files ({then['uncommitted'] or 'none'})"
    if then["revision"] == now["revision"]:
        return None
    changed = _git("diff", "--name-only", then["revision"], now["revision"] or "HEAD", "--", *STUDY_PATHS)
    if changed is None:
        return f"its revision {then['revision'][:12]} is not in this checkout"
    return f"the study's files changed since {then['revision'][:12]}: {', '.join(changed.split())}" if changed.strip() else None


# ---- windows, the other margin, strata and weights ----


def training_law():
    """The lab trainer's σ sampler as a law (``hosts/lab/sampler.py``, the trainer's own args)."""
    from downscale_plugin.hosts.lab.sampler import lab_sampler
    from downscale_plugin.lab.trainer import lab_args

    return lab_sampler(lab_args())


def law_mass(lo: float, hi: float) -> float:
    return training_law().mass(lo, hi, NATIVE_LATENT)


def bands(table: dict[str, Any] | None) -> list[tuple[float, float]]:
    """The σ bands (lo, hi] an arm's table routes (hi = 1 for an open window)."""
    from downscale_plugin.config import load_config

    if not table or table.get("enable") is False:
        return []
    return [(r.sigma_min, 1.0 if r.sigma_max is None else r.sigma_max) for r in load_config(plugin_toml=table).routes]


def route_windows(table: dict[str, Any] | None) -> list[tuple[str, float, float | None]]:
    """An arm's windows, route by route (none for native or a windowless table)."""
    from downscale_plugin.config import load_config

    if not table or table.get("enable") is False:
        return []
    return sorted((r.label, r.sigma_min, r.sigma_max) for r in load_config(plugin_toml=table).routes)


def routed_share(table: dict[str, Any] | None) -> float:
    """The training σ law's mass on the union of an arm's bands: the share of steps it routes (every lab
    bucket lies in the windows' tier, so a window applies to every step whose σ falls in it)."""
    merged: list[list[float]] = []
    for lo, hi in sorted(bands(table)):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return sum(law_mass(lo, hi) for lo, hi in merged)


def other_margin(shares: dict[float, float]) -> float | None:
    """PROTOCOL §4: the first of 0.3, 0.4, 0.5 whose share differs from ε = 0.2's, else the first of 0.1, 0.05; None if none does."""
    for group in OTHER_MARGINS:
        for eps in group:
            if abs(shares[eps] - shares[DEFAULT_MARGIN]) > 1e-12:
                return eps
    return None


def sensitivity_concept(out: Path = OUT) -> str:
    """PROTOCOL §1 (version 3): the concept whose ``default`` windows route the largest share of the training σ
    law's steps, the first in the protocol's order on a tie: where more, cheaper steps make the schedule matter most."""
    shares = {c: json.loads(choice_path(c, out).read_text())["routed_share"][f"{DEFAULT_MARGIN:g}"] for c in CONCEPTS}
    return max(CONCEPTS, key=lambda c: (shares[c], -list(CONCEPTS).index(c)))


def windows_path(concept: str, eps: float, out: Path = OUT) -> Path:
    return out / "windows" / f"{concept}_eps{eps:g}.toml"


def choice_path(concept: str, out: Path = OUT) -> Path:
    return out / "windows" / f"{concept}.json"


def interp_path(concept: str, out: Path = OUT) -> Path:
    return out / "windows" / f"{concept}_interp_eps{DEFAULT_MARGIN:g}.toml"


def derive_windows(concept: str, map_json: Path, out: Path = OUT) -> dict[str, Any]:
    """Re-read a concept map at ε = 0.2 and the candidate other margins (the map command's own read and
    windows writer), apply the other-margin rule, and store the windows of 0.2, the chosen margin and 0.1
    (the ε = 0.1 comparison's, version 4) and the choice (``windows/<concept>.json``)."""
    import toml

    from downscale_plugin.mapping.estimator import MapResult
    from downscale_plugin.mapping.windows import windows_toml

    blob = json.loads(map_json.read_text())
    texts, shares = {}, {}
    for eps in (DEFAULT_MARGIN, *OTHER_MARGINS[0], *OTHER_MARGINS[1]):
        result = MapResult.from_json(blob, margin=eps)
        command = f"python benchmarks/bench_quality.py windows --concept {concept} --map {map_json}"
        texts[eps] = windows_toml(result, f"{result.provenance.get('command', '?')}; re-derived at ε = {eps:g}: {command}")
        shares[eps] = routed_share(toml.loads(texts[eps]))
    other = other_margin(shares)
    (out / "windows").mkdir(parents=True, exist_ok=True)
    for eps in dict.fromkeys((DEFAULT_MARGIN, NARROW_MARGIN) if other is None else (DEFAULT_MARGIN, other, NARROW_MARGIN)):
        windows_path(concept, eps, out).write_text(texts[eps])
    choice = {"concept": concept, "map": str(map_json), "default": DEFAULT_MARGIN, "other": other,
              "routed_share": {f"{e:g}": s for e, s in shares.items()},
              "note": None if other is not None else "no other margin routes another share: the eps arm is not run (PROTOCOL §4)"}  # fmt: skip
    choice_path(concept, out).write_text(json.dumps(choice, indent=1) + "\n")
    return choice


def derive_interp_windows(concept: str, map_json: Path, out: Path = OUT) -> Path:
    """PROTOCOL §4 (version 2), arm ``interp``: the windows at ε = 0.2 of the concept map's latent arms with interpolated
    positions (keep policy, plain attention), as the map writes them (``positions = "interpolate"`` in the file)."""
    from downscale_plugin.mapping.estimator import MapResult
    from downscale_plugin.mapping.windows import windows_toml

    result = MapResult.from_json(json.loads(map_json.read_text()), margin=DEFAULT_MARGIN)
    if INTERP_SETTING not in result.route_settings():
        raise ValueError(f"{map_json}: no latent arms with interpolated positions (map --positions interpolate)")
    command = f"python benchmarks/bench_quality.py windows --concept {concept} --map {map_json} --positions interpolate"
    text = windows_toml(result, f"{result.provenance.get('command', '?')}; re-derived at ε = {DEFAULT_MARGIN:g}: {command}",
                        setting=INTERP_SETTING)  # fmt: skip
    (out / "windows").mkdir(parents=True, exist_ok=True)
    interp_path(concept, out).write_text(text)
    return interp_path(concept, out)


def concept_arms(concept: str, out: Path = OUT) -> dict[str, dict[str, Any] | None]:
    """The concept's arms in the protocol's order, each with its plugin table (None: native)."""
    from downscale_plugin.config import read_plugin_toml

    path = choice_path(concept, out)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no windows for {concept!r}; run: python benchmarks/bench_quality.py windows --concept {concept} --map MAP_JSON"
        )
    choice = json.loads(path.read_text())
    arms: dict[str, dict[str, Any] | None] = {"native": None, "default": read_plugin_toml(str(windows_path(concept, DEFAULT_MARGIN, out)))}
    if choice["other"] is not None:
        arms[f"eps{choice['other']:g}"] = read_plugin_toml(str(windows_path(concept, choice["other"], out)))
    if not interp_path(concept, out).is_file():
        raise FileNotFoundError(
            f"{interp_path(concept, out)}: no interpolated-positions windows for {concept!r}; run: python "
            f"benchmarks/bench_quality.py windows --concept {concept} --map MAP_JSON --positions interpolate"
        )
    arms[INTERP] = read_plugin_toml(str(interp_path(concept, out)))
    arms["seed_recipe"] = {"routes": list(SEED_RECIPE)}
    arms[CONTROL] = {"routes": list(ALL_HALF)}
    return arms


def narrow_arms(concept: str, out: Path = OUT) -> dict[str, dict[str, Any] | None]:
    """PROTOCOL §4 (version 4), the ε = 0.1 comparison's arms: ``native`` and the concept map's windows at 0.1."""
    from downscale_plugin.config import read_plugin_toml

    path = windows_path(concept, NARROW_MARGIN, out)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no ε = 0.1 windows for {concept!r}; run: python benchmarks/bench_quality.py windows --concept {concept} --map MAP_JSON"
        )
    return {"native": None, NARROW: read_plugin_toml(str(path))}


def part_arms(concept: str, part: str, out: Path = OUT) -> tuple[dict[str, dict[str, Any] | None], list[float]]:
    """A study part's arms for one concept and its strata: §3's rule over the primary arms, and for the ε = 0.1
    comparison over them and its own (its windows may route a band none of the primary's strata lies in)."""
    primary = concept_arms(concept, out)
    if part != NARROW:
        return primary, concept_sigmas(primary)
    narrow = narrow_arms(concept, out)
    return narrow, concept_sigmas({**primary, NARROW: narrow[NARROW]})


def map_cost(concept: str, out: Path = OUT) -> dict[str, Any] | None:
    """PROTOCOL §4: the concept map's cost, not counted in an arm's time but reported beside the table, from the map
    itself: the wall seconds of its collection at one torch thread (model setup apart), and its size in native-step
    equivalents (every probe, σ bin and draw takes a gradient pass per arm: two native, one per route at its token
    fraction r²), which a user pays whatever the model's size. The interp arm's map is the same command with
    interpolated positions, the same size."""
    source = choice_path(concept, out)
    if not source.is_file():
        return None
    path = json.loads(source.read_text())["map"]
    blob = json.loads((ROOT / path).read_text())
    bins = len(blob["bins"]["edges"]) - 1 + bool(blob["bins"]["endpoint"])
    per_draw = sum(1.0 if a["kind"] == "native" else a["ratio"] ** 2 for a in blob["arms"])
    settings = blob["settings"]
    return {"map": path, "wall_s": blob["provenance"]["wall_s"], "setup_s": blob["provenance"]["setup_s"],
            "native_step_equivalents": settings["images"] * bins * settings["draws"] * per_draw,
            "code_revision": blob["provenance"].get("code_revision")}  # fmt: skip


def windowless(table: dict[str, Any] | None) -> bool:
    """An arm whose map certified no window (``enable = false``) is the native run: recorded, not trained."""
    return table is not None and table.get("enable") is False


def concept_sigmas(arms: dict[str, dict[str, Any] | None]) -> list[float]:
    from downscale_plugin.quality import strata_sigmas

    return strata_sigmas(FIXED_SIGMAS, [b for table in arms.values() for b in bands(table)])


def training_law_weights(sigmas: list[float]) -> list[float]:
    """PROTOCOL §3's L̄ weights: the lab trainer's σ law's mass on each stratum's cell."""
    from downscale_plugin.quality import stratum_weights

    law = training_law()
    return stratum_weights(sigmas, lambda x: law.cdf(x, NATIVE_LATENT))


# ---- settings, paths, order ----


def arm_seeds(arm: str) -> tuple[int, ...]:
    return CONTROL_SEEDS if arm == CONTROL else SEEDS


def pilot_path(out: Path, concept: str) -> Path:
    return out / "pilot" / f"{concept}.json"


def concept_steps(args: argparse.Namespace, concept: str) -> int:
    """S: ``--steps`` (smoke runs) or the pilot's decision."""
    if args.steps:
        return args.steps
    path = pilot_path(Path(args.out), concept)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no pilot decision for {concept!r}; run: python benchmarks/bench_quality.py pilot --concepts {concept}"
        )
    return int(json.loads(path.read_text())["steps"])


def settings_of(args: argparse.Namespace, concept: str, steps: int, sigmas: list[float], schedule: str) -> dict[str, Any]:
    """What a run's figures depend on besides the code and its table: a stored run is reused only under the same."""
    return {"concept": concept, "steps": steps, "schedule": schedule, "sigmas": sigmas, "rank": args.rank, "lr": args.lr,
            "batch_size": 1, "points": args.points, "val_per_bucket": args.val_per_bucket, "val_draws": args.val_draws,
            "val_seed": 0, "base": "quick" if args.quick else "multires", "samples": args.samples}  # fmt: skip


def study_part(args: argparse.Namespace) -> str:
    """Which of the protocol's studies a command addresses: the primary, the schedule sensitivity (§1, ``steps``) or
    the ε = 0.1 comparison (§4, version 4)."""
    return "steps" if args.schedule == "steps" else NARROW if args.narrow else "primary"


def runs_folder(out: Path, concept: str, part: str = "primary") -> Path:
    return out / "runs" / (concept if part == "primary" else f"{concept}_{part}")


def run_path(out: Path, concept: str, arm: str, seed: int, part: str = "primary", steps: int | None = None) -> Path:
    if steps is not None:  # a pilot run
        return out / "pilot" / concept / f"native_s{seed}_S{steps}.json"
    return runs_folder(out, concept, part) / f"{arm}_s{seed}.json"


def study_order(concepts: list[str], arms_of: dict[str, list[str]], seeds: tuple[int, ...] = SEEDS) -> list[tuple[str, str, int]]:
    """PROTOCOL §7: seeds ascending; within a seed, concepts then arms in the protocol's order."""
    return [(c, a, s) for s in seeds for c in concepts for a in arms_of[c] if s in arm_seeds(a)]


# ---- one run ----


class Lab:
    """What a worker's runs of one concept share: the base, the concept's data, its validation set and
    the base model's items (a fresh adapter's ΔW is zero: every run's first point), its reference spectrum."""

    def __init__(self, concept: str, sigmas: list[float], args: argparse.Namespace) -> None:
        import numpy as np

        from downscale_plugin.flops import FlopModel
        from downscale_plugin.lab.concept import task_data
        from downscale_plugin.lab.data import LabData, LabDataConfig
        from downscale_plugin.lab.generate import reference_spectrum
        from downscale_plugin.lab.model import LabModelConfig, flop_shape

        if args.quick:
            from downscale_plugin.lab.pretrain import load_or_pretrain

            self.model_cfg = LabModelConfig()
            base = LabData(LabDataConfig(latent_channels=self.model_cfg.latent_channels))
            self.model = load_or_pretrain(self.model_cfg, quick=True, progress=False, data=base)
        else:
            from downscale_plugin.lab.base import load_base

            self.model = load_base("multires")
            self.model_cfg = self.model.cfg
            base = LabData(LabDataConfig(latent_channels=self.model_cfg.latent_channels))
        self.data = task_data(concept, base)
        self.flop_model = FlopModel(*flop_shape(self.model_cfg))
        self.val_set = self.data.validation_set(per_bucket=args.val_per_bucket, seed=0)
        self.sigmas, self.draws = tuple(sigmas), args.val_draws
        self.base_items = self.losses(None)
        crops = self.data.validation_source.crops(np.random.default_rng([0, 0x5EC7]), (4 * NATIVE_LATENT[0], 4 * NATIVE_LATENT[1]),
                                                  REFERENCE_CROPS, pixels=True)  # fmt: skip
        self.reference = reference_spectrum(crops["pixels"], self.data.codec)
        self.class_id = int(self.data.train.class_ids[0])

    def losses(self, deltas: dict | None):
        from downscale_plugin.lab.trainer import native_validation_losses

        return native_validation_losses(self.model, deltas, self.val_set, 0, self.sigmas, self.draws, rows_per_forward=ROWS_PER_FORWARD)

    def validate(self, deltas: dict):
        return self.base_items.clone() if all(not d.any() for d in deltas.values()) else self.losses(deltas)


def train_twin(lab: Lab, table: dict[str, Any] | None, seed: int, settings: dict[str, Any], validate):
    """One twin fine-tune to one unit of native FLOPs (or S steps under the steps schedule); returns it and its plugin."""
    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin
    from downscale_plugin.hosts.lab.twin import cosine_decay, run_to_budget

    plugin = None if table is None else LabPlugin.for_lab(load_config(plugin_toml=table), lab.model_cfg, lab.data, 1)
    steps, by_steps = settings["steps"], settings["schedule"] == "steps"
    run = run_to_budget(
        lab.model, lab.data, plugin, seed=seed, native_steps=steps, budget=1.0, points=settings["points"], lr=settings["lr"],
        rank=settings["rank"], validate=validate, flop_model=lab.flop_model, schedule=cosine_decay,
        step_budget=steps if by_steps else None,
    )  # fmt: skip
    return run, plugin


def sample_pixels(lab: Lab, deltas: dict | None, samples: int):
    """The protocol's samples (§5) of an adapter (None: the base), decoded."""
    from downscale_plugin.lab.generate import sample_latents

    latents = sample_latents(lab.model, deltas, lab.class_id, list(SAMPLE_SEEDS[:samples]), NATIVE_LATENT, SAMPLE_STEPS)
    return lab.data.codec.decode(latents)


def run_one(lab: Lab, arm: str, table: dict[str, Any] | None, seed: int, settings: dict[str, Any], samples: int) -> dict[str, Any]:
    """One twin fine-tune, validated on the FLOP grid, with its samples' spectrum distances at the end."""
    import torch

    from downscale_plugin.lab.generate import spectrum_distances

    val_cpu = [0.0]

    def validate(deltas: dict):
        t0 = time.process_time()
        out = lab.validate(deltas)
        val_cpu[0] += time.process_time() - t0
        return out

    cpu_start = time.process_time()
    run, plugin = train_twin(lab, table, seed, settings, validate)
    t0 = time.process_time()
    distances = spectrum_distances(sample_pixels(lab, run.deltas, samples), lab.reference)
    sample_cpu = time.process_time() - t0
    shape = list(lab.base_items.shape)  # [crops, strata, draws]
    weights = training_law_weights(list(lab.sigmas))
    curve = []
    for s, f, c, items in zip(run.steps, run.flops, run.seconds, run.items, strict=True):
        per_stratum = torch.tensor(items).reshape(shape).mean(dim=(0, 2)).tolist()
        curve.append({"step": s, "flops": f, "cpu_s": c, "lbar": sum(w * v for w, v in zip(weights, per_stratum, strict=True)),
                      "strata": per_stratum})  # fmt: skip
    return {
        "concept": settings["concept"], "arm": arm, "seed": seed, "settings": settings,
        "code": code_state(), "protocol_revision": protocol_revision(), "table": table,
        "threads": torch.get_num_threads(), "native_flops": run.native_flops,
        "weights": weights, "items_shape": shape, "curve": curve, "items": run.items,
        "tokens_run": run.tokens_run, "step_cpu_s": [round(t, 5) for t in run.step_seconds],
        "routed": [] if plugin is None else [t.rule_index for t in plugin.trace],
        "samples": {"noise_seeds": list(SAMPLE_SEEDS[:samples]), "steps": SAMPLE_STEPS, "spectrum_distance": distances},
        "cpu_s": {"total": time.process_time() - cpu_start, "validation": val_cpu[0], "samples": sample_cpu},
    }  # fmt: skip


# ---- exploratory: what moves the sample metric ----


def octave_bands(rings: int) -> list[tuple[int, int]]:
    """Rings 1 … ``rings`` in octaves [2^k, 2^(k+1) − 1], the last one closed at ``rings``."""
    bands, lo = [], 1
    while lo <= rings:
        hi = min(2 * lo - 1, rings)
        bands.append((lo, rings if hi == rings - 1 else hi))
        lo = bands[-1][1] + 1
    return bands


def band_reading(spectra, reference) -> list[dict[str, Any]]:
    """Per octave of rings, mean over samples: the log10 power offset (sample − reference; below 0: too little power
    there) and the band's part of the squared distance (the parts sum to the §5 metric squared)."""
    offset = spectra.double() - reference.double()
    size = 2 * offset.shape[-1]
    return [{"rings": [lo, hi], "period_px": [size / hi, size / lo], "offset": float(offset[:, lo - 1 : hi].mean()),
             "squared": float((offset[:, lo - 1 : hi] ** 2).sum(-1).mean())} for lo, hi in octave_bands(offset.shape[-1])]  # fmt: skip


def diagnose_bands(args: argparse.Namespace) -> list[Path]:
    """Retrain an arm's twin (the protocol's settings, validation skipped: it draws from private generators, so the
    training is the stored run's), sample it as §5 does and split the metric by octave band, beside the base's samples.
    Exploratory, outside the protocol: no decision reads it. A stored run's distances are checked against the retrained."""
    import torch

    from downscale_plugin.lab.generate import radial_log_spectrum

    torch.set_num_threads(1)
    out, written = Path(args.out), []
    for concept in args.concept_list:
        tables = concept_arms(concept, Path(args.windows))
        settings = settings_of(args, concept, concept_steps(args, concept), concept_sigmas(tables), "flops")
        lab = Lab(concept, settings["sigmas"], args)
        readings = {"base": {"bands": band_reading(radial_log_spectrum(sample_pixels(lab, None, args.samples)), lab.reference)}}
        for seed in args.seed_list or [0]:
            for arm in args.arm_list or ["native", CONTROL]:
                run, _ = train_twin(lab, tables[arm], seed, settings, lambda _deltas, items=lab.base_items: items.clone())
                spectra = radial_log_spectrum(sample_pixels(lab, run.deltas, args.samples))
                distances = (spectra - lab.reference).norm(dim=-1)
                stored = run_path(out, concept, arm, seed)
                entry: dict[str, Any] = {"seed": seed, "steps": len(run.tokens_run), "distance": float(distances.mean()),
                                         "bands": band_reading(spectra, lab.reference)}  # fmt: skip
                if stored.is_file():
                    kept = json.loads(stored.read_text())["samples"]["spectrum_distance"]
                    entry["stored_distance_matches"] = bool(torch.allclose(distances, torch.tensor(kept, dtype=distances.dtype), atol=1e-6))
                readings[f"{arm}_s{seed}"] = entry
        path = out / "diagnostics" / f"sample_bands_{concept}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"concept": concept, "code": code_state(), "command": "python benchmarks/bench_quality.py bands "
                                    + " ".join(sys.argv[1:]), "note": "exploratory, outside PROTOCOL.md: which spectral octave "
                                    "moves the §5 sample metric; no decision reads it", "readings": readings}, indent=1) + "\n")  # fmt: skip
        written.append(path)
        for name, r in readings.items():
            cells = " | ".join(
                f"{b['period_px'][0]:.3g}–{b['period_px'][1]:.3g} px {b['offset']:+.2f} ({b['squared']:.1f})" for b in r["bands"]
            )
            print(f"{concept} {name}: {cells}", flush=True)
    return written


# ---- jobs ----


def planned_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run this command asks for, in the protocol's order, each with its settings and table
    (windowless arms left out: they are the native run)."""
    jobs = []
    if args.command == "pilot":
        for seed in PILOT_SEEDS:
            for concept in args.concept_list:
                sigmas = concept_sigmas(concept_arms(concept, Path(args.windows)))
                for steps in pilot_steps_needed(args, concept):
                    jobs.append({"concept": concept, "arm": "native", "seed": seed, "table": None, "pilot_steps": steps, "part": "primary",
                                 "settings": settings_of(args, concept, steps, sigmas, "flops")})  # fmt: skip
        return jobs
    arms_of, tables, settings, part = {}, {}, {}, study_part(args)
    for concept in args.concept_list:
        tables[concept], sigmas = part_arms(concept, part, Path(args.windows))
        names = [a for a in tables[concept] if not windowless(tables[concept][a])]
        if part == "steps":
            names = [a for a in names if a in SENSITIVITY["arms"]]
        if part == NARROW and NARROW not in names:
            names = []  # its windows are empty: the arm is the native run, and the comparison has nothing to compare
        arms_of[concept] = [a for a in names if a in args.arm_list] if args.arm_list else names
        settings[concept] = settings_of(args, concept, concept_steps(args, concept), sigmas, args.schedule)
    seeds = tuple(s for s in (SENSITIVITY["seeds"] if part == "steps" else SEEDS) if not args.seed_list or s in args.seed_list)
    for concept, arm, seed in study_order(args.concept_list, arms_of, seeds):
        jobs.append({"concept": concept, "arm": arm, "seed": seed, "table": tables[concept][arm], "pilot_steps": None,
                     "part": part, "settings": settings[concept]})  # fmt: skip
    return jobs


def pilot_steps_needed(args: argparse.Namespace, concept: str) -> list[int]:
    """400 first; 800 once a stored 400-step pilot fails the criterion."""
    out = Path(args.out)
    first = [json.loads(p.read_text()) for s in PILOT_SEEDS if (p := run_path(out, concept, "native", s, steps=PILOT_STEPS[0])).is_file()]
    if len(first) == len(PILOT_SEEDS) and not pilot_criterion(first)["met"]:
        return list(PILOT_STEPS)
    return [PILOT_STEPS[0]]


def pilot_criterion(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """PROTOCOL §1: on every pilot seed, native's improvement of L̄ ≥ 5 % of the base's and its last quarter < 10 % of it."""
    from downscale_plugin.quality import native_gain

    facts = native_gain(curves(runs), runs[0]["weights"])
    per_seed = [{"seed": r["seed"], "gain_fraction": float(g), "last_quarter_fraction": float(q)}
                for r, g, q in zip(runs, facts["gain_fraction"], facts["last_quarter_fraction"], strict=True)]  # fmt: skip
    met = all(p["gain_fraction"] >= PILOT_MIN_GAIN and p["last_quarter_fraction"] < PILOT_MAX_LAST_QUARTER for p in per_seed)
    return {"met": met, "seeds": per_seed}


def refusals(args: argparse.Namespace, jobs: list[dict[str, Any]]) -> list[str]:
    """Stored runs among ``jobs`` that cannot be reused here, each with why."""
    now, out, problems = code_state(), Path(args.out), []
    for job in jobs:
        path = run_path(out, job["concept"], job["arm"], job["seed"], job["part"], job["pilot_steps"])
        if not path.is_file():
            continue
        run = json.loads(path.read_text())
        reason = "its settings differ" if run["settings"] != job["settings"] else stale_reason(run, now)
        if reason is None and run["table"] != job["table"]:
            reason = "its arm's table changed"
        if reason:
            problems.append(f"{path.relative_to(out)}: {reason}")
    return problems


def work(args: argparse.Namespace) -> None:
    """A worker: claims the next unclaimed, not yet stored run (an exclusive ``.claim`` file) until none is left."""
    import torch

    torch.set_num_threads(1)
    out, labs = Path(args.out), {}
    for job in planned_runs(args):
        s = job["settings"]
        path = run_path(out, job["concept"], job["arm"], job["seed"], job["part"], job["pilot_steps"])
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path.with_suffix(".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, str(os.getpid()).encode())  # whose run it is: a later launch clears only a dead worker's claims
        os.close(fd)
        key = (job["concept"], tuple(s["sigmas"]))
        labs[key] = labs.get(key) or Lab(job["concept"], s["sigmas"], args)
        t0 = time.perf_counter()
        blob = run_one(labs[key], job["arm"], job["table"], job["seed"], s, args.samples)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(blob))
        os.replace(tmp, path)
        path.with_suffix(".claim").unlink(missing_ok=True)
        print(f"{path.relative_to(out)}: {len(blob['tokens_run'])} steps, CPU {blob['cpu_s']['total']:.0f} s "
              f"(validation {blob['cpu_s']['validation']:.0f} s, samples {blob['cpu_s']['samples']:.0f} s), wall {time.perf_counter() - t0:.0f} s, "
              f"L̄ {blob['curve'][0]['lbar']:.4f} -> {blob['curve'][-1]['lbar']:.4f}", flush=True)  # fmt: skip


def clear_stopped_claims(out: Path) -> None:
    """Free the runs a stopped study had claimed; a live worker's (another launch on this folder) stay claimed."""
    for claim in out.rglob("*.claim"):
        if not _alive(claim):
            claim.unlink(missing_ok=True)


def _alive(claim: Path) -> bool:
    """Whether the worker that wrote ``claim`` still runs (a claim without a readable pid is a stopped one's)."""
    try:
        os.kill(int(claim.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def _worker_command(argv: list[str]) -> list[str]:
    """This command as a worker: ``--jobs`` (and its value) dropped, ``--worker`` added."""
    keep, skip = [], False
    for a in argv:
        if skip or a.startswith("--jobs"):
            skip = a == "--jobs"
            continue
        keep.append(a)
    return [sys.executable, __file__, *keep, "--worker"]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Refuse what cannot run here, then run ``--jobs`` workers (one torch thread each) until every run is stored."""
    now = code_state()
    if not descends_from_protocol(now["revision"]):
        print(f"bench_quality: the code revision {now['revision']} does not descend from the protocol's ({protocol_revision()}): "
              "a run must (PROTOCOL.md)", file=sys.stderr)  # fmt: skip
        return 2
    if study_part(args) == NARROW and (why := narrow_refusal(args)):
        print(f"bench_quality: --narrow: {why}", file=sys.stderr)
        return 2
    jobs = planned_runs(args)
    refused = refusals(args, jobs)
    if refused:
        print(f"bench_quality: {args.out} holds runs that cannot be reused (move them away or use another --out):", file=sys.stderr)
        print("\n".join(f"  {r}" for r in refused), file=sys.stderr)
        return 2
    clear_stopped_claims(Path(args.out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    codes = [w.wait() for w in [subprocess.Popen(_worker_command(argv), env=env) for _ in range(args.jobs)]]
    if any(codes):
        print(f"bench_quality: worker exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def narrow_refusal(args: argparse.Namespace) -> str | None:
    """Why PROTOCOL §6 does not call for the ε = 0.1 comparison, or None when it does: every other arm has all its
    seeds and no margin run is non-inferior on every concept. Read from the primary arms alone, so a comparison
    already under way resumes."""
    out, windows = Path(args.out), Path(args.windows)
    concepts = {c: summarize_concept(c, load_runs(runs_folder(out, c)), part_arms(c, "primary", windows)[0]) for c in CONCEPTS}
    decided = default_margin(concepts, list(CONCEPTS))
    if decided["value"] is None and decided["why"].endswith("the ε = 0.1 comparison runs next (PROTOCOL §4, §6)"):
        return None
    return f"PROTOCOL §6 does not call for the ε = 0.1 comparison: default margin {decided['value']} ({decided['why']})"


def decide_pilots(args: argparse.Namespace) -> dict[str, Any]:
    """Per concept, S from its stored pilot runs (PROTOCOL §1), stored as ``pilot/<concept>.json``."""
    out, decisions = Path(args.out), {}
    for concept in args.concept_list:
        record: dict[str, Any] = {"concept": concept, "seeds": list(PILOT_SEEDS), "protocol_revision": protocol_revision(),
                                  "code_revision": code_state()["revision"], "by_steps": {}}  # fmt: skip
        for steps in PILOT_STEPS:
            runs = [json.loads(p.read_text()) for s in PILOT_SEEDS if (p := run_path(out, concept, "native", s, steps=steps)).is_file()]
            if len(runs) == len(PILOT_SEEDS):
                record["by_steps"][str(steps)] = pilot_criterion(runs)
        verdicts = record["by_steps"]
        if str(PILOT_STEPS[0]) not in verdicts or (not verdicts[str(PILOT_STEPS[0])]["met"] and str(PILOT_STEPS[1]) not in verdicts):
            continue  # not yet decided: the next pilot call runs what is missing
        met400 = verdicts[str(PILOT_STEPS[0])]["met"]
        record["steps"] = PILOT_STEPS[0] if met400 else PILOT_STEPS[1]
        record["criterion_met"] = met400 or verdicts[str(PILOT_STEPS[1])]["met"]
        pilot_path(out, concept).write_text(json.dumps(record, indent=1) + "\n")
        decisions[concept] = record
    return decisions


# ---- aggregation ----


def curves(runs: list[dict[str, Any]]):
    """:class:`quality.Curves` of runs (their seeds in order): per-crop losses averaged over draws, FLOPs
    in native units. A run with fewer points (under the steps schedule a routed arm stops short of one
    unit) is padded with its last point repeated: its fit, reach and last value are unchanged."""
    import numpy as np

    from downscale_plugin.quality import Curves

    points = max(len(r["curve"]) for r in runs)
    pad = lambda xs: list(xs) + [xs[-1]] * (points - len(xs))  # noqa: E731
    losses = np.array([pad([np.reshape(items, r["items_shape"]).mean(axis=2) for items in r["items"]]) for r in runs])
    flops = np.array([pad([p["flops"] / r["native_flops"] for p in r["curve"]]) for r in runs])
    cpu = np.array([pad([p["cpu_s"] for p in r["curve"]]) for r in runs])
    return Curves(losses, flops, cpu)


def load_runs(folder: Path) -> dict[tuple[str, int], dict[str, Any]]:
    return {(b["arm"], b["seed"]): b for b in (json.loads(p.read_text()) for p in sorted(folder.glob("*.json")))}


def windowless_entry() -> dict[str, Any]:
    return {"windowless": True, "note": "the map certified no window: the plugin is off and the arm is the native run"}


def summarize_concept(concept: str, runs: dict[tuple[str, int], dict[str, Any]], tables: dict[str, Any]) -> dict[str, Any]:
    """One concept's block of ``summary.json`` (PROTOCOL §5)."""
    import numpy as np

    from downscale_plugin.quality import arm_statistics, decide, native_gain, paired_item_difference

    natives = {s: r for (a, s), r in runs.items() if a == "native"}
    if not natives:
        return {"task": {"name": concept, "kind": CONCEPTS.get(concept), "pretraining_overlap": False}, "arms": {}}
    first = natives[min(natives)]
    sigmas, weights = first["settings"]["sigmas"], first["weights"]
    nat_seeds = sorted(natives)
    facts = native_gain(curves([natives[s] for s in nat_seeds]), weights)
    delta = MARGIN_SHARE * float(np.mean(facts["gain"]))
    shape = first["items_shape"]
    block: dict[str, Any] = {
        "task": {"name": concept, "kind": CONCEPTS.get(concept), "pretraining_overlap": False},
        "steps": first["settings"]["steps"],
        "native_gain": float(np.mean(facts["gain"])),
        "native_gain_fraction": float(np.mean(facts["gain_fraction"])),
        "native_last_quarter_fraction": float(np.mean(facts["last_quarter_fraction"])),
        "native_last_quarter_fraction_max": float(np.max(facts["last_quarter_fraction"])),
        "native_train_cpu_s": float(np.mean([natives[s]["curve"][-1]["cpu_s"] for s in nat_seeds])),
        "delta": delta,
        "validation": {"sigmas": sigmas, "weights": weights,
                       "items": {"crops": shape[0], "draws": shape[2], "per_bucket": first["settings"]["val_per_bucket"],
                                 "seed": first["settings"]["val_seed"], "points": first["settings"]["points"]}},
        "arms": {},
    }  # fmt: skip
    for arm, table in tables.items():
        if windowless(table):
            block["arms"][arm] = windowless_entry()
            continue
        seeds = sorted(s for (a, s) in runs if a == arm and s in natives)
        if not seeds:
            continue
        arm_runs, nat_runs = [runs[arm, s] for s in seeds], [natives[s] for s in seeds]
        routed = [i for r in arm_runs for i in r["routed"]]
        entry: dict[str, Any] = {
            "seeds": seeds,
            "protocol_revision": arm_protocol(arm_runs),
            "code_revision": sorted(
                {r["code"]["revision"] + (f"+{r['code']['uncommitted']}" if r["code"]["uncommitted"] else "") for r in arm_runs}
            ),
            "steps_routed": (sum(i >= 0 for i in routed) / len(routed)) if routed else 0.0,
            "flops_saved_per_step": flops_saved_per_step(arm_runs),
            "bands": bands(table),
        }
        if arm != "native":
            stats = arm_statistics(curves(nat_runs), curves(arm_runs), weights, quality=QUALITY, reps=REPS, seed=BOOT_SEED)
            by = stats["equal_compute_by_stratum"]
            routed_strata = [any(lo < s <= hi for lo, hi in entry["bands"]) for s in sigmas]
            sample = paired_item_difference(np.array([r["samples"]["spectrum_distance"] for r in nat_runs]),
                                            np.array([r["samples"]["spectrum_distance"] for r in arm_runs]), reps=REPS, seed=BOOT_SEED)  # fmt: skip
            entry.update(
                time_to_quality=stats["time_to_quality"],
                equal_compute=stats["equal_compute"],
                equal_compute_by_sigma=[{"sigma": s, "diff": d, "lo": lo, "hi": hi} for s, d, lo, hi in zip(sigmas, by["diff"], by["lo"], by["hi"], strict=True)],
                sample_metric=sample,
                decision=decide(stats["equal_compute"], by, routed_strata, delta),
                sooner={k: stats["time_to_quality"][k]["hi"] < 1.0 for k in ("flops", "cpu")},
            )  # fmt: skip
            entry["short_of_non_inferior"] = short_of_non_inferior(entry, routed_strata, delta)
        block["arms"][arm] = entry
    if INTERP in tables:
        block["interp_windows_differ"] = route_windows(tables[INTERP]) != route_windows(tables["default"])
    control = block["arms"].get(CONTROL)
    if control and "decision" in control:
        block["control_shows_loss"] = {"loss": control["decision"] == "fails", "sample_metric": control["sample_metric"]["lo"] > 0}
    return block


def short_of_non_inferior(entry: dict[str, Any], routed: list[bool], delta: float) -> list[dict[str, Any]]:
    """What keeps an arm from PROTOCOL §5's *non-inferior*: L̄ (``sigma`` None) and each routed stratum whose
    interval reaches δ, as the README's first screen names them when no margin is non-inferior everywhere (§6)."""
    lbar = [{"sigma": None, **entry["equal_compute"]}] if entry["equal_compute"]["hi"] >= delta else []
    return lbar + [s for s, r in zip(entry["equal_compute_by_sigma"], routed, strict=True) if r and s["hi"] >= delta]


def control_reading(block: dict[str, Any]) -> str:
    """The report header's words on PROTOCOL §5's control check, naming which reading the control misses.

    A concept is uninformative on a reading where the control shows no loss, and only on that one: on the
    posters the control fails on L̄ while the full-band sample metric scores it closer to the held-out images
    (docs/fidelity/quality/diagnostics/README.md says why).
    """
    shows = block.get("control_shows_loss")
    if shows is None or all(shows.values()):
        return ""
    missed = [name for name, key in (("L̄ and its strata", "loss"), ("the sample metric", "sample_metric")) if not shows[key]]
    return f"; **the control shows no loss on {' or '.join(missed)}: uninformative on {'it' if len(missed) == 1 else 'them'}**"


def narrow_entry(concept: str, primary: dict[tuple[str, int], dict[str, Any]], runs: dict[tuple[str, int], dict[str, Any]],
                 windows: Path) -> dict[str, Any] | None:  # fmt: skip
    """PROTOCOL §4 (version 4): the ε = 0.1 arm as the concept's arm, from its own comparison with its own native twins
    (its strata, δ and native gain beside it under ``comparison``); None before any of its runs. Its native twins must
    equal the primary study's on every stratum both hold (``natives_match``), or the comparison is refused."""
    tables, _ = part_arms(concept, NARROW, windows)
    if windowless(tables[NARROW]):
        return windowless_entry()
    block = summarize_concept(concept, runs, tables)
    entry = block["arms"].get(NARROW)
    if entry is None or "decision" not in entry:
        return None
    entry["comparison"] = {key: block[key] for key in ("validation", "delta", "native_gain", "native_gain_fraction")}
    entry["comparison"]["natives_match"] = natives_match(primary, runs)
    return entry


def join_narrow(concepts: dict[str, Any], narrow: dict[str, dict[str, Any] | None]) -> None:
    """Add the ε = 0.1 arm to each concept once its comparison has run somewhere (§6 called for it); until then a
    concept where it is windowless does not list it, as no arm of it was ever due."""
    if any(e and not e.get("windowless") for e in narrow.values()):
        for concept, entry in narrow.items():
            if entry is not None:
                concepts[concept]["arms"][NARROW] = entry


def natives_match(primary: dict[tuple[str, int], dict[str, Any]], comparison: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """The largest difference between two studies' native twins of one seed on the strata both validate, over every
    point, crop and draw (the comparison's twins are the primary's: same seeds, adapters and data order, and each
    validation noise is drawn from its own (batch, stratum index, draw) generator); a difference above 1e-6 is refused."""
    import numpy as np

    seeds = sorted(s for (a, s) in comparison if a == "native" and ("native", s) in primary)
    worst = 0.0
    for seed in seeds:
        ours, theirs = comparison["native", seed], primary["native", seed]
        shared = [ours["settings"]["sigmas"].index(x) for x in theirs["settings"]["sigmas"]]
        if shared != list(range(len(shared))):
            raise ValueError(f"seed {seed}: the comparison's strata {ours['settings']['sigmas']} do not extend the primary's at its end")
        a = np.array([np.reshape(i, ours["items_shape"])[:, : len(shared)] for i in ours["items"]])
        b = np.array([np.reshape(i, theirs["items_shape"]) for i in theirs["items"]])
        worst = max(worst, float(np.abs(a - b).max()))
    if worst > 1e-6:
        raise ValueError(f"the ε = 0.1 comparison's native twins differ from the primary study's by up to {worst:.3g}: not the same twins")
    return {"seeds": seeds, "max_abs_diff": worst}


def flops_saved_per_step(runs: list[dict[str, Any]]) -> float:
    """1 − an arm's training FLOPs per step ÷ its native twin's (``native_flops`` over S steps), mean over seeds."""
    ratios = [(r["curve"][-1]["flops"] / len(r["tokens_run"])) / (r["native_flops"] / r["settings"]["steps"]) for r in runs]
    return 1 - sum(ratios) / len(ratios)


def arms_complete(concepts: dict[str, Any], expected: list[str]) -> bool:
    """Every concept has every arm decided on all the protocol's seeds (a windowless arm is its native run)."""
    return all(c in concepts and len([n for n in concepts[c]["arms"] if n != "native"]) >= 3
               and all(e.get("windowless") or ("decision" in e and tuple(e["seeds"]) == arm_seeds(n))
                       for n, e in concepts[c]["arms"].items() if n != "native") for c in expected)  # fmt: skip


def non_inferior(entry: dict[str, Any]) -> bool:
    """PROTOCOL §5's decision; a windowless arm routes nothing, so it is its native run and non-inferior by construction."""
    return bool(entry.get("windowless")) or entry.get("decision") == "non-inferior"


def default_margin(concepts: dict[str, Any], expected: list[str]) -> dict[str, Any]:
    """PROTOCOL §6 (version 4): the widest ε among the arms run that is non-inferior on every concept; failing that,
    once the ε = 0.1 comparison has run, the narrowest margin run that fails on no concept (None when each fails
    somewhere); None until every concept has every arm on every seed. ``why`` names each margin's shortfall."""
    if not arms_complete(concepts, expected):
        return {"value": None, "why": "not every concept has complete arms"}
    run = {eps: [concepts[c]["arms"][name] for c in expected if name in concepts[c]["arms"]] for name, eps in margin_arms(concepts).items()}
    everywhere = {eps for eps, entries in run.items() if len(entries) == len(expected)}
    ok = [eps for eps in everywhere if all(non_inferior(e) for e in run[eps])]
    if ok:
        return {"value": max(ok), "why": "the widest margin non-inferior on every concept"}
    short = "; ".join(f"{eps:g} on {shortfall(concepts, expected, eps)}" for eps in sorted(run))
    if NARROW_MARGIN not in everywhere:
        return {
            "value": None,
            "why": f"no margin run is non-inferior on every concept ({short}): the ε = 0.1 comparison runs next (PROTOCOL §4, §6)",
        }
    safe = [eps for eps in everywhere if not any(e.get("decision") == "fails" for e in run[eps])]
    if safe:
        return {"value": min(safe), "why": f"no margin run is non-inferior on every concept ({short}): the narrowest that fails on none"}
    return {"value": None, "why": f"every margin run fails on some concept ({short}): no default margin (PROTOCOL §6)"}


def margin_arms(concepts: dict[str, Any]) -> dict[str, float]:
    """The arms that read a concept map at one margin, by name: ``default`` at 0.2 and ``eps<X>`` at X."""
    names = {n for c in concepts.values() for n in c["arms"]}
    return {n: DEFAULT_MARGIN if n == "default" else float(n[3:]) for n in sorted(names) if n == "default" or n.startswith("eps")}


def shortfall(concepts: dict[str, Any], expected: list[str], eps: float) -> str:
    """Where the arms at margin ``eps`` fall short of non-inferior: each concept with the strata that reach δ."""
    name = next(n for n, e in margin_arms(concepts).items() if e == eps)
    parts = []
    for c in expected:
        entry = concepts[c]["arms"].get(name, {})
        if entry and not non_inferior(entry):
            where = ", ".join("L̄" if s["sigma"] is None else f"σ {s['sigma']:g}" for s in entry.get("short_of_non_inferior", []))
            parts.append(f"{c} ({entry['decision']}: {where})")
    return ", ".join(parts) or "none"


def default_positions(concepts: dict[str, Any], expected: list[str]) -> dict[str, Any]:
    """PROTOCOL §6, positions: ``interpolate`` only if the interp arm is non-inferior on every concept and its FLOPs
    time to quality is below the default arm's wherever their windows differ (a windowless arm's is native's, 1)."""
    if not arms_complete(concepts, expected):
        return {"value": None, "why": "not every concept has complete arms"}
    ratio = lambda e: 1.0 if e.get("windowless") else e["time_to_quality"]["flops"]["ratio"]  # noqa: E731
    for c in expected:
        arms = concepts[c]["arms"]
        interp, default = arms[INTERP], arms["default"]
        if not non_inferior(interp):
            return {"value": "plain", "why": f"the interp arm is {interp['decision']} on {c}"}
        if concepts[c]["interp_windows_differ"] and not ratio(interp) < ratio(default):
            return {
                "value": "plain",
                "why": f"on {c} the interp arm is not sooner in FLOPs than the default arm ({ratio(interp):.3f} vs {ratio(default):.3f})",
            }
    return {"value": "interpolate", "why": "the interp arm is non-inferior on every concept and sooner wherever its windows differ"}


def arm_protocol(runs: list[dict[str, Any]]) -> str:
    """The protocol revision one arm's runs ran under (each records it); an arm run under two is refused, its seeds
    would not be one arm's."""
    revisions = {r["protocol_revision"] for r in runs}
    if len(revisions) != 1:
        raise ValueError(
            f"one arm's runs ran under several protocol revisions ({', '.join(sorted(map(str, revisions)))}): report each apart"
        )
    return revisions.pop()


def runs_protocol(revisions: set[str]) -> str | None:
    """The summary's protocol revision: the newest its arms ran under, which must descend from every other (a later
    version adds to what earlier runs did, as version 4's ε = 0.1 comparison does); this checkout's when nothing ran."""
    if not revisions:
        return protocol_revision()
    newest = [r for r in revisions if all(is_ancestor(other, r) for other in revisions)]
    if not newest:
        raise ValueError(f"the runs ran under protocol revisions no one of which descends from the others ({', '.join(sorted(revisions))})")
    return newest[0]


def summarize(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out, windows, part = Path(args.out), Path(args.windows), study_part(args)
    concepts, narrow = {}, {}
    for concept in args.concept_list:
        runs = load_runs(runs_folder(out, concept, part))
        concepts[concept] = summarize_concept(concept, runs, part_arms(concept, part, windows)[0])
        concepts[concept]["map_cost"] = map_cost(concept, windows)
        if part == "primary" and windows_path(concept, NARROW_MARGIN, windows).is_file():
            narrow[concept] = narrow_entry(concept, runs, load_runs(runs_folder(out, concept, NARROW)), windows)
    join_narrow(concepts, narrow)
    revisions = {e["protocol_revision"] for c in concepts.values() for e in c["arms"].values() if "protocol_revision" in e}
    primary = part == "primary"
    dm = default_margin(concepts, list(CONCEPTS)) if primary else {"value": None, "why": f"a secondary study ({part})"}
    dp = default_positions(concepts, list(CONCEPTS)) if primary else {"value": None, "why": f"a secondary study ({part})"}
    code = code_state()
    return {
        "protocol_revision": runs_protocol(revisions),
        "default_margin": dm["value"],
        "default_margin_why": dm["why"],
        "default_positions": dp["value"],
        "default_positions_why": dp["why"],
        "schedule": args.schedule,
        "code_revision": (code["revision"] or "?") + (f"+{code['uncommitted']}" if code["uncommitted"] else ""),
        "command": "python benchmarks/bench_quality.py " + " ".join(argv),
        "bootstrap": {
            "reps": REPS,
            "seed": BOOT_SEED,
            "level": 0.95,
            "resampled": "seeds and validation crops (samples), independently",
            "interval": "estimate ± t(n − 1) · SE, SE the replicates' SD × √(n / (n − 1)), n the fewer of seeds and crops (PROTOCOL §5)",
        },
        "concepts": concepts,
    }


def _iv(d: dict[str, Any] | None, fmt: str = "+.4f") -> str:
    return "—" if not d else f"{format(d['diff'], fmt)} [{format(d['lo'], fmt)}, {format(d['hi'], fmt)}]"


def _ratio(d: dict[str, Any]) -> str:
    capped = "" if d["reached"] == d["seeds"] else " (≥)"
    return f"{d['ratio']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]{capped} {d['reached']}/{d['seeds']}"


CONCEPT_LABELS = {"hatch": "hatch (fine detail at the grid's Nyquist)", "subject": "subject (one motorcycle)",
                  "style": "style (a grade and a halftone screen)"}  # fmt: skip


def arm_label(arm: str, default_margin: float | None) -> str:
    """An arm's name for readers: its windows' margin, and whether that is the package's default."""
    named = {"seed_recipe": "the seed paper's recipe", CONTROL: "every step at 0.5 (the control)",
             INTERP: f"windows at ε = {DEFAULT_MARGIN:g}, interpolated positions"}  # fmt: skip
    if arm in named:
        return named[arm]
    eps = DEFAULT_MARGIN if arm == "default" else float(arm.removeprefix("eps"))
    return f"windows at ε = {eps:g}" + (" (default margin)" if eps == default_margin else "")


def readme_table(summary: dict[str, Any]) -> str:
    """The README's first-screen table (PROTOCOL §6 and the issue's layout): per concept and arm, steps routed, time
    to 90 % in FLOPs and CPU (arm ÷ native, interval, '≥' where a seed never reached it) and the worst stratum at
    equal FLOPs (arm − native; bold where its interval lies wholly above the concept's margin δ)."""
    lines = ["| concept | arm | steps routed | FLOPs to 90 % | CPU s to 90 % | worst stratum at equal FLOPs |", "|---|---|---|---|---|---|"]
    for name, c in summary["concepts"].items():
        label = CONCEPT_LABELS.get(name, name)
        for arm, e in c["arms"].items():
            if arm == "native" or not (e.get("windowless") or "decision" in e):
                continue
            row_label, label = label, ""
            if e.get("windowless"):
                lines.append(
                    f"| {row_label} | {arm_label(arm, summary['default_margin'])} | 0 % (no window certified: the native run) | 1 | 1 | — |"
                )
                continue
            tq, worst = e["time_to_quality"], max(e["equal_compute_by_sigma"], key=lambda s: s["diff"])
            cell = f"σ {worst['sigma']:g}: {worst['diff']:+.3f} [{worst['lo']:+.3f}, {worst['hi']:+.3f}]".replace("-", "−")
            if worst["lo"] > c["delta"]:
                cell = f"σ {worst['sigma']:g}: **{worst['diff']:+.3f}** [{worst['lo']:+.3f}, {worst['hi']:+.3f}]".replace("-", "−")
            ratio = lambda d: ("≥ " if d["reached"] < d["seeds"] else "") + f"{d['ratio']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"  # noqa: E731
            lines.append(f"| {row_label} | {arm_label(arm, summary['default_margin'])} | {100 * e['steps_routed']:.1f} % | "
                         f"{ratio(tq['flops'])} | {ratio(tq['cpu'])} | {cell} |")  # fmt: skip
    return "\n".join(lines) + "\n" + readme_verdict(summary) + map_cost_line(summary)


def readme_verdict(summary: dict[str, Any]) -> str:
    """The first screen's words under the table (PROTOCOL §6): the default margin with the rule's reason, in bold
    where no margin was shown non-inferior on every concept or every margin fails somewhere (the reason names each
    margin's concepts and strata), and which margins are sooner in FLOPs, or in bold that none is anywhere."""
    why, value = summary["default_margin_why"], summary["default_margin"]
    why = why[0].upper() + why[1:]
    if why.startswith(("No margin run", "Every margin run")):
        why = f"**{why}**"
    margin = "none" if value is None else f"ε = {value:g}"
    sooner = {
        arm_label(arm, value): [c for c, block in summary["concepts"].items() if block["arms"].get(arm, {}).get("sooner", {}).get("flops")]
        for arm in margin_arms(summary["concepts"])
    }
    sooner = {label: concepts for label, concepts in sooner.items() if concepts}
    if sooner:
        where = "; ".join(f"{label} on {', '.join(concepts)}" for label, concepts in sooner.items())
        speed = f"Sooner in FLOPs (the interval's upper end below 1): {where}."
    else:
        speed = "**No margin is sooner in FLOPs on any concept.**"
    return f"\nDefault margin (PROTOCOL §6): {margin}. {why}. {speed}\n"


README = ROOT / "README.md"
README_TABLE = (
    "<!-- quality table: written by `python benchmarks/bench_quality.py report --readme` -->",
    "<!-- end of the quality table -->",
)


def splice_readme(text: str, table: str) -> str:
    """``text`` (the README) with the block between its quality-table markers replaced by ``table``, so the first
    screen's numbers are the stored summary's and nothing else."""
    begin, end = README_TABLE
    head, sep, rest = text.partition(begin + "\n")
    _, sep_end, tail = rest.partition(end)
    if not sep or not sep_end:
        raise ValueError(f"the README lacks its quality-table markers {begin!r} … {end!r}")
    return f"{head}{begin}\n{table.rstrip(chr(10))}\n{end}{tail}"


def map_cost_line(summary: dict[str, Any]) -> str:
    """The concept maps' cost beside the table (PROTOCOL §4): its size in native steps against the native run's S,
    and its wall seconds against a native run's training CPU on the same concept."""
    maps = [c for c in summary["concepts"].values() if c.get("map_cost") and "native_train_cpu_s" in c]
    if not maps:
        return ""
    span = lambda xs, f: "–".join(dict.fromkeys((format(min(xs), f), format(max(xs), f))))  # noqa: E731
    steps = [c["map_cost"]["native_step_equivalents"] for c in maps]
    return (f"\nThe windows come from one `map` per concept, not counted in the times above: {span(steps, ',.0f')} native-step "
            f"equivalents each, {span([c['map_cost']['native_step_equivalents'] / c['steps'] for c in maps], '.0f')} × the native "
            f"run's {span([c['steps'] for c in maps], 'd')} steps ({span([c['map_cost']['wall_s'] for c in maps], ',.0f')} s at one torch thread, "
            f"{span([c['map_cost']['wall_s'] / c['native_train_cpu_s'] for c in maps], '.0f')} × its training CPU).\n")  # fmt: skip


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"# Quality study (PROTOCOL.md at {str(summary['protocol_revision'])[:12]}; schedule over {summary['schedule']})",
        "",
        f"Code {summary['code_revision'][:12]}; `{summary['command']}`. Intervals: 95 %, the estimate ± t(n − 1) · SE, SE from a two-way bootstrap "
        f"({REPS} replicates, seed {BOOT_SEED}). Default margin (PROTOCOL §6): {summary['default_margin']} ({summary['default_margin_why']}); "
        f"default positions: {summary['default_positions']} ({summary['default_positions_why']}).",
        "",
        "| concept | arm | seeds | steps routed | FLOPs saved per step | FLOPs to 90 % (reached) | CPU s to 90 % (reached) | L̄ at one unit, arm − native | worst stratum | sample metric | decision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in summary["concepts"].items():
        for arm, e in c["arms"].items():
            if e.get("windowless"):
                lines.append(f"| {name} | {arm} | — | {e['note']} | | | | | | | |")
                continue
            if "decision" not in e:
                lines.append(f"| {name} | {arm} | {len(e['seeds'])} | | | | | | | | (the reference) |")
                continue
            worst = max(e["equal_compute_by_sigma"], key=lambda s: s["diff"])
            tq = e["time_to_quality"]
            sooner = ", sooner" if e["sooner"]["flops"] else ""
            lines.append(
                f"| {name} | {arm} | {len(e['seeds'])} | {100 * e['steps_routed']:.1f} % | {100 * e['flops_saved_per_step']:.1f} % | "
                f"{_ratio(tq['flops'])} | {_ratio(tq['cpu'])} | {_iv(e['equal_compute'])} | σ {worst['sigma']:g}: {_iv(worst)} | "
                f"{_iv(e['sample_metric'], '+.3f')} | {e['decision']}{sooner} |"
            )
    for name, c in summary["concepts"].items():
        if "validation" not in c:
            continue
        arms = [a for a, e in c["arms"].items() if "decision" in e and "comparison" not in e]
        lines += [
            "",
            f"## {name} ({c['task']['kind']}): S = {c['steps']}, native improvement {c['native_gain']:.4f} "
            f"({100 * c['native_gain_fraction']:.1f} % of the base's L̄; last quarter {100 * c['native_last_quarter_fraction']:.1f} %, "
            f"max {100 * c['native_last_quarter_fraction_max']:.1f} %); δ = {c['delta']:.4f}" + control_reading(c),
            "",
            (
                f"The concept map (`{c['map_cost']['map']}`), not counted in the arms' times (PROTOCOL §4): {c['map_cost']['wall_s']:,.0f} s "
                f"at one thread; a native run trains in {c['native_train_cpu_s']:.0f} CPU s."
                if c.get("map_cost")
                else "No concept map recorded."
            ),
            "",
            "Arm − native at one unit of native FLOPs, per stratum (weight = the training σ law's mass on its cell):",
            "",
            "| σ | weight | " + " | ".join(arms) + " |",
            "|---|---|" + "---|" * len(arms),
        ]
        for k, (s, w) in enumerate(zip(c["validation"]["sigmas"], c["validation"]["weights"], strict=True)):
            lines.append(f"| {s:g} | {w:.3f} | " + " | ".join(_iv(c["arms"][a]["equal_compute_by_sigma"][k]) for a in arms) + " |")
        if "comparison" in c["arms"].get(NARROW, {}):
            lines += comparison_lines(c["arms"][NARROW])
    lines += ["", "## The README's table", "", readme_table(summary).rstrip("\n")]
    return "\n".join(lines) + "\n"


def comparison_lines(entry: dict[str, Any]) -> list[str]:
    """The ε = 0.1 comparison's strata table (PROTOCOL §4, version 4): its own strata, weights, δ and native twins."""
    cmp = entry["comparison"]
    lines = ["", f"The ε = 0.1 comparison, against its own native twins (δ = {cmp['delta']:.4f}; they equal the primary study's on "
                 f"its strata within {cmp['natives_match']['max_abs_diff']:.1g}):", "", f"| σ | weight | {NARROW} |", "|---|---|---|"]  # fmt: skip
    for s, w, d in zip(cmp["validation"]["sigmas"], cmp["validation"]["weights"], entry["equal_compute_by_sigma"], strict=True):
        lines.append(f"| {s:g} | {w:.3f} | {_iv(d)} |")
    return lines


# ---- command line ----


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("windows", "pilot", "study", "report", "bands"))
    parser.add_argument("--concepts", default=",".join(CONCEPTS), help=f"comma-separated, of {', '.join(CONCEPTS)}")
    parser.add_argument("--concept", help="windows: the concept whose map is read")
    parser.add_argument("--map", help="windows: the concept map's map.json")
    parser.add_argument(
        "--positions",
        default="plain",
        choices=("plain", "interpolate"),
        help="windows: the plain arms' windows at 0.2 and the other margin (default), or the interp arm's (a map with --positions interpolate)",
    )
    parser.add_argument(
        "--schedule",
        default="flops",
        choices=("flops", "steps"),
        help="cosine over the FLOPs spent (primary) or over S steps (the sensitivity analysis, on one concept: PROTOCOL §1)",
    )
    parser.add_argument(
        "--narrow",
        action="store_true",
        help=f"the ε = {NARROW_MARGIN:g} comparison (PROTOCOL §4, §6, version 4): arms native and {NARROW} in runs/<concept>_{NARROW}/, "
        "validated on the strata its windows add; run only when §6 calls for it (report merges it into summary.json)",
    )
    parser.add_argument(
        "--readme", action="store_true", help="report: also write the primary study's table into README.md (between its markers)"
    )
    parser.add_argument("--arms", default="", help="study: only these arms (default: every arm of each concept)")
    parser.add_argument("--seeds", default="", help="study: only these seeds (default: the protocol's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one process and one torch thread each (default 2)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--windows", default=str(OUT), help="the folder holding windows/ (default: --out's protocol folder)")
    # Smoke settings only: a run records them, so a smoke run is never mistaken for the protocol's.
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--points", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--val_per_bucket", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--val_draws", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=len(SAMPLE_SEEDS), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=1e-2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concept_list = [c for c in args.concepts.split(",") if c]
    problems = [f"--concepts: {c!r} is not a concept (allowed: {', '.join(CONCEPTS)})" for c in args.concept_list if c not in CONCEPTS]
    args.arm_list = [a for a in args.arms.split(",") if a]
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        problems.append(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    if args.command == "windows" and (args.concept not in CONCEPTS or not args.map):
        problems.append(f"windows needs --concept (one of {', '.join(CONCEPTS)}) and --map MAP_JSON")
    if args.readme and (args.command != "report" or args.schedule != "flops" or args.narrow):
        problems.append("--readme: only with report on the primary study (no --schedule steps, no --narrow)")
    if args.narrow and args.schedule == "steps":
        problems.append("--narrow is the ε = 0.1 comparison under the primary schedule: not with --schedule steps")
    if args.schedule == "steps" and args.command != "windows":
        try:
            concept = sensitivity_concept(Path(args.windows))
        except (OSError, KeyError, ValueError) as e:
            problems.append(f"--schedule steps: the sensitivity concept is read from the windows' choices ({e})")
        else:
            if args.concept_list != [concept]:
                problems.append(f"--schedule steps is the sensitivity analysis: --concepts {concept} only (PROTOCOL §1)")
    problems += [
        f"--{k} must be >= 1" for k in ("points", "val_per_bucket", "val_draws", "samples", "rank", "jobs") if getattr(args, k) < 1
    ]
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    if args.command == "windows" and args.positions == "interpolate":
        print(f"wrote {derive_interp_windows(args.concept, Path(args.map), Path(args.windows))}")
        return 0
    if args.command == "windows":
        choice = derive_windows(args.concept, Path(args.map), Path(args.windows))
        print(json.dumps(choice, indent=1))
        return 0
    if args.worker:
        work(args)
        return 0
    if args.command == "bands":
        print("wrote", ", ".join(map(str, diagnose_bands(args))))
        return 0
    if args.command == "pilot":
        for _ in PILOT_STEPS:  # 400 steps; 800 where 400 fails the criterion
            code = launch(args, argv)
            if code:
                return code
        print(json.dumps(decide_pilots(args), indent=1))
        return 0
    if args.command == "study":
        code = launch(args, argv)
        if code:
            return code
    summary = summarize(args, argv)
    part = study_part(args)
    name = "summary.json" if part == "primary" else f"summary_{part}.json"
    (out / name).write_text(json.dumps(summary, indent=1) + "\n")
    text = report(summary)
    (out / name.replace("summary", "report").replace(".json", ".md")).write_text(text)
    if args.readme:
        README.write_text(splice_readme(README.read_text(), readme_table(summary)))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
