"""``mode = "auto"`` in a kohya run: certify windows on the run's own model, then train with them.

Timeline (one process; docs/FIDELITY.md §9 has the method):

0. The session keys the run (``mapping/reuse.py``: the base model files' and the text encoders' and VAE's sha256,
   adapter, rank, buckets, σ law, loss settings, host and the source of its functions the plugin calls, the certifier's
   code, routes, bins, ε, α). Windows cached under that key route the run from its first step, at no cost, and
   nothing below happens (a cached certification that ended with no safe window for want of stake, budget or horizon
   only while this run could not buy more either); otherwise the banner says why (the nearest cached key's differing
   fields, or what this run can buy), the run takes the key's lock (another run certifying it: this one waits for its
   windows when its probes are in, ``reuse.LOCK_WAIT_S``), and step 4 caches what this run certifies.
1. The host's ``start`` builds the session (a host's subclass of :class:`AutoSession`). The run has no routes, so its first steps are native,
   bitwise the host's. What the run already shows (several processes, a ratio with no smaller grid,
   fewer train batches than the 16 probes need, a ``certify_resume`` file for other settings or another model) stops
   the run there. The certifier's plan is made then, from the buckets' σ mass and pass costs (``in_run.start_plan``)
   and printed in the banner; when no test can pay back its evidence within the run and the budget, the run trains
   native and says what would pay (``certify_unpaid = "refuse"``: stops instead).
2. Train batches are cut into single-sample probes (``probes.ProbeSession``) until the last look's
   16 are in.
3. Before the step of that batch, the certifier (``mapping/certify.py``) runs once over them, every
   draw the trainer class's own step at the route's grid and a σ of the bin, with paired
   noise, spending at most ``certify_budget`` × the run's native compute (``max_train_steps`` ×
   accumulation × batch single-sample native passes; a route pass counts its token fraction). As in
   the map, torch's, Python's and NumPy's RNG are restored and every ``.grad`` is set aside around each
   draw's backward (``estimator.param_grads``): ``.grad``, the optimizer and every later draw are the run's as if nothing had run.
4. The certified windows (``windows.toml`` in ``map_out``, with ``certify.json``: every bin's verdict,
   bound and evidence) become the run's routes; the saved weights carry ``ss_downscale_map``, and
   the end summary and the trackers (``downscale/certify/*``) give the certification's cost, the routed saving and the
   net, in native-step equivalents and as a share of the run.

Front-loaded, not spread: a window saves only on the steps after it opens, and the certifier's
verdicts are as valid at the start as later, so all of the budget is spent as soon as the probes are
in. The windows are not re-checked as the adapter trains (docs/FIDELITY.md §9 says what that
assumes); a later run continues the evidence with ``certify_resume``.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import toml
import torch

from ...arch import get_arch
from ...config import load_config
from ...grid import target_grid
from ...plan import format_plan
from ...rng import plugin_logger
from ...text import pct, route_rows
from .conventions import split_network_args
from .probes import ProbeSession
from .run import DownscaleRun

logger = plugin_logger(__name__)

COST_UNIT = "native-step equivalents of the run's FLOP model"  # the budget, the certification and the saving alike
MASS_SAMPLES = 8192  # host σ draws behind each bin's sampler mass (what a safe verdict is worth; not a bound)


class AutoSession(ProbeSession):
    """One ``auto`` run's state; see the module docstring. A host's subclass adds its probes
    (``ProbeSession``) and its σ sampler as ``plan`` draws it (:meth:`host_sampler`)."""

    mode = "auto"
    host = ""  # the host's name in a windows key (a host's subclass says)
    # The plugin's host-side modules a certification's draws run through, added to the certifier's code identity
    # (reuse.certifier_code): the probes' backend, the σ mass a bin is worth (this module); a host adds its own.
    code_modules: tuple[str, ...] = ("downscale_plugin.hosts.kohya.backend", "downscale_plugin.hosts.kohya.probes", __name__)
    loss_args: tuple[str, ...] = ()  # the host's args that change the gradient a step takes (a host's subclass says)
    no_encoders = "none"  # the key's encoders when the run names no text encoder or VAE file (a host's subclass says why)

    def __init__(self, run: DownscaleRun, ctx: Any, family: Any, buckets: Any, record: Any):
        self.refuse_missing_packages(run)  # before the certifier's import needs them
        from ...mapping.in_run import in_run_setup
        from ...mapping.sequential import Looks

        super().__init__(run, ctx, family, buckets, record, Looks().last)
        self.run_passes = self.forwards() * max(buckets.batch_size, 1)
        self.setup = in_run_setup(run.cfg, self.run_passes, run.seed)
        self.routes, self.bins, self.settings = self.setup.routes, self.setup.bins, self.setup.settings
        self.prior: dict[str, Any] | None = None
        self.result: Any = None
        self.paths: dict[str, str] = {}
        self.certify_s = 0.0
        self.started = time.perf_counter()
        self.plan: Any = None  # the certifier's plan at start (``in_run.start_plan``), when the buckets give the routes' costs
        self.skipped: str | None = None  # why no test can pay: the run trains native
        self.reads_cache = False  # the run reads the cache (certify_reuse = "on", not resumed)
        self.waiting = False  # another run holds the key's lock: wait for its windows when the probes are in
        self.key, self.reused, self.cache_text = self.consult_cache()
        if self.reused is None:  # reused windows need no probe, budget or evidence
            self.refuse(self.problems())
        self.lock = self.claim()
        run.scalar_extra.append(self.scalars)

    # -- the windows cache (mapping/reuse.py) ----------------------------------------------------

    def windows_key(self, cache: str) -> Any:
        """This run's :class:`~downscale_plugin.mapping.reuse.WindowsKey`: the base model files' and the text encoders'
        and VAE's sha256 (read once per file, remembered in ``cache``), the adapter module with its own ``network_args``
        and ``network_dim``, the buckets, the σ law of the host's sampler, the loss settings, the host and the source of
        its functions the plugin calls, the certifier's code and what is certified (routes, bins, ε, α)."""
        from ...mapping.reuse import WindowsKey, certifier_code, file_hash, sampler_fingerprint, source_digest

        args = self.ctx.args
        dim = getattr(args, "network_dim", None)
        grids = [tuple(hw) for hw in self.buckets.latent_buckets]
        given = dict(a.split("=", 1) for a in getattr(args, "network_args", None) or [] if "=" in a)  # as the trainers split them
        inner = sorted(f"{k.strip()}={v}" for k, v in split_network_args(given)[1].items())  # the adapter's own options
        encoders = [f"{name}={file_hash(path, cache)}" for name, path in self.encoder_files()]
        return WindowsKey(
            model=" + ".join(file_hash(path, cache) for path in self.model_files()),
            encoders="; ".join(encoders) or self.no_encoders,
            arch=self.run.arch,
            network=self.run.inner + (f" ({', '.join(inner)})" if inner else ""),
            rank=None if dim is None else int(dim),
            buckets=tuple(f"{h}x{w}" for h, w in grids),
            sampler=sampler_fingerprint(self.host_sampler(), grids, MASS_SAMPLES),
            loss=self.loss_settings(),
            host=self.host,
            host_revision=source_digest(self.host_functions()),
            code=certifier_code(self.code_modules),
            ratios=tuple(a.ratio for a in self.routes),
            bins=self.bins.spec(),
            margin=self.settings.margin,
            alpha=self.settings.looks.alpha,
        )

    def encoder_files(self) -> list[tuple[str, str]]:
        """(arg, path) of each text encoder's and VAE's file the run trains with (a host's subclass says which)."""
        return []

    def loss_settings(self) -> str:
        """The run's values of :attr:`loss_args` (those its host's parser has), one canonical string."""
        args = self.ctx.args
        return ", ".join(f"{name}={getattr(args, name)!r}" for name in sorted(self.loss_args) if hasattr(args, name)) or "none"

    def host_functions(self) -> list[Any]:
        """The host's functions and classes the plugin calls or whose steps it draws (their source is the key's
        ``host_revision``; a host's subclass lists them)."""
        raise NotImplementedError

    def means(self) -> tuple[float, float]:
        """(horizon, budget) of this run's certification: the later passes its windows would pay back over (inf: no pay
        rule) and its budget, in native-step equivalents: what decides whether it could buy more than a cached one."""
        s = self.settings
        return (math.inf if s.horizon is None else float(s.horizon)), float(s.budget)

    def consult_cache(self) -> tuple[Any, Any, str]:
        """(this run's key or None when nothing is cached, the cached entry to reuse or None, what the banner says)."""
        from ...mapping.reuse import cache_dir, entry_path, lookup

        certify = self.run.cfg.certify
        self.cache = cache_dir(certify.cache)
        if certify.reuse == "off":
            return None, None, 'windows cache: certify_reuse = "off": not read, not written'
        unhashable = [path or "?" for path in self.model_files() if not path or not os.path.isfile(path)]
        if unhashable:
            return None, None, f"windows cache: the base model {', '.join(unhashable)} is no file to hash: windows are not cached"
        encoders = [f"--{name} {path}" for name, path in self.encoder_files() if not os.path.isfile(path)]
        if encoders:
            return None, None, f"windows cache: the text encoder or VAE {', '.join(encoders)} is no file to hash: windows are not cached"
        if not self.buckets.latent_buckets:
            return None, None, "windows cache: the run's buckets are not known: windows are not cached"
        t0 = time.perf_counter()
        key = self.windows_key(self.cache)
        took = time.perf_counter() - t0
        if took >= 1.0:  # a model file's first sha256
            logger.info(
                "downscale_plugin: keyed the run for the windows cache in %.0f s (the base model's sha256, read once per file)", took
            )
        stored = f"the windows certified here are stored as {entry_path(key, self.cache)}"
        if certify.resume:
            return key, None, f"windows cache: certify_resume continues its evidence, the cache is not read; {stored}"
        if getattr(self.ctx.args, "resume", None):
            return key, None, f"windows cache: not read by a resumed run (--resume: its state's windows route it); {stored}"
        if certify.reuse == "refresh":
            return key, None, f'windows cache: certify_reuse = "refresh": {stored}'
        self.reads_cache = True
        found = lookup(key, self.cache, *self.means())
        return key, found.entry, f"windows cache: {found.reason}" + ("" if found.entry else f"\n  certifying; {stored}")

    def claim(self) -> Any:
        """The key's lock (``reuse.KeyLock``) for a run that certifies and caches, released when its entry is written or the
        run ends; held by another run, a run that reads the cache waits for that run's windows when its probes are in
        (:meth:`await_other`), one that does not (refresh, resume) certifies all the same."""
        from ...mapping.reuse import LOCK_WAIT_S, KeyLock

        if self.key is None or self.reused is not None or self.skipped is not None:
            return None
        lock = KeyLock(self.key, self.cache)
        self.run.patches.on_undo(lock.release)
        if not lock.acquire():
            self.waiting = self.reads_cache
            self.cache_text += f"\n  another run of this key is certifying it now ({lock.path}): " + (
                f"this run waits up to {LOCK_WAIT_S:.0f} s for its windows when its probes are in, else certifies anew"
                if self.waiting
                else "this run certifies too"
            )
        return lock

    def await_other(self) -> Any:
        """Wait (at most ``reuse.LOCK_WAIT_S``) for the run certifying this key, then its entry if this run may reuse it
        (``reuse.lookup``); None: certify anew, and the log says why."""
        from ...mapping.reuse import LOCK_WAIT_S, lookup

        t0 = time.perf_counter()
        free = self.lock.wait(LOCK_WAIT_S)
        waited = time.perf_counter() - t0
        found = lookup(self.key, self.cache, *self.means())
        if found.entry is not None:
            logger.info(
                "downscale_plugin: waited %.0f s for the other run of this key: %s; routing by it from train batch %d, no certification",
                waited,
                found.reason,
                self.batches,
            )
            return found.entry
        why = f"is still running after {waited:.0f} s" if not free else f"left nothing this run reuses ({found.reason})"
        logger.info("downscale_plugin: the other run certifying this key %s; certifying anew", why)
        return None

    def install(self) -> None:
        """Collect probes (:class:`ProbeSession`) unless no test can pay (then the run is the plain run), or with cached
        windows route by them from the first step."""
        if self.reused is None:
            if self.skipped is None:
                super().install()
            return
        self.route_by(self.reused)

    def route_by(self, entry: Any) -> None:
        """Route by a cached entry's windows from now on (the first step, or the step after another run certified them)."""
        self.reused = entry
        self.measured = True
        self.run.adopt_saved = self.adopt
        routes = load_config(plugin_toml=entry.windows()).routes
        self.run.retarget(routes)
        self.run.extra_metadata["ss_downscale_map"] = json.dumps(
            {
                "method": "reused",
                "entry": entry.path,
                "key": self.key.digest(),
                "windows": [f"{r.label} {r.window_text()}" for r in routes],
                "certified": entry.date,
                "certification_cost": entry.cost,
                "native_step_equivalents": 0.0,
                "unit": COST_UNIT,
            }
        )

    def problems(self) -> list[str]:
        """What makes certification in this run impossible, found before any compute."""
        cfg = self.run.cfg
        from ...mapping.in_run import start_plan, unpaid_problem

        problems = self.run_problems(cfg.map.ratios, "map_ratios", "probes") + self.setup.problems
        fractions = self.route_fractions()
        if fractions is not None and not self.setup.problems:
            self.plan = start_plan(self.setup, fractions, self.sigma_mass(self.buckets.latent_buckets, self.buckets.weights)[0])
            unpaid = unpaid_problem(cfg, self.plan, self.bins, self.run_passes)
            if unpaid is not None and (cfg.certify.unpaid != "skip"):
                problems.append(f'certify_unpaid = "{cfg.certify.unpaid}": {unpaid}; certify_unpaid = "skip" trains native instead')
            self.skipped = unpaid
        if cfg.certify.resume:
            problems += self._prior_problems(cfg.certify.resume)
        return problems

    def route_fractions(self) -> list[float] | None:
        """Each route's pass cost in native passes (:meth:`pass_fraction`), averaged over the run's buckets by their share."""
        buckets = self.buckets.latent_buckets
        if not buckets:
            return None
        spec = get_arch(self.run.arch)
        weights = self._weights(buckets, getattr(self.buckets, "weights", None))
        fractions = []
        for arm in self.routes:
            smalls = [target_grid(native, arm.ratio, spec) for native in buckets]
            if any(small is None for small in smalls):
                return None  # named by run_problems
            fractions.append(sum(w * self.pass_fraction(small, native) for w, small, native in zip(weights, smalls, buckets, strict=True)))
        return fractions

    @staticmethod
    def _weights(grids: list[Any], weights: Any) -> list[float]:
        """Each grid's share (equal when the host gives none)."""
        if not weights or len(weights) != len(grids) or not sum(weights) > 0:
            return [1.0 / len(grids)] * len(grids)
        return [w / sum(weights) for w in weights]

    def pass_fraction(self, small: tuple[int, ...], native: tuple[int, ...]) -> float:
        """A pass on the ``small`` latent grid (…, h, w) in native passes under the run's FLOP model (its token
        fraction without one): the unit of the budget, the certification's cost and the run's saving alike."""
        from ...mapping.in_run import pass_costs

        return pass_costs(self.run.totals.flop_model, self.run.arch)(small, native)

    def _prior_problems(self, path: str) -> list[str]:
        """A resumed ``certify.json`` continues a confidence sequence only under the same settings, model and arch."""
        from ...mapping.certify_cli import resume_problems

        try:
            with open(path) as fh:
                self.prior = json.load(fh)
        except (OSError, ValueError) as err:
            return [f"certify_resume: cannot read {path}: {err}"]
        problems = [f"certify_{p}" for p in resume_problems(self.prior, self.settings, self.bins, self.routes)]
        saved = self.prior.get("provenance", {}).get("backend", {})
        here = {"model_identity": self.model_identity(), "arch": self.run.arch}
        for key, value in here.items():
            if value is not None and saved.get(key) != value:
                text = f"certify_resume: {key}: the saved evidence is for {saved.get(key)!r}, this run is {value!r}"
                if self.run.cfg.windows.foreign == "error":
                    problems.append(f'{text} (windows_foreign = "warn" adds the evidence anyway)')
                else:
                    logger.warning('downscale_plugin: %s; windows_foreign = "warn": continuing it anyway', text)
        return problems

    def banner(self) -> str:
        if self.reused is not None:
            rules = "\n".join(f"  {row}".rstrip() for row in route_rows(self.run.cfg.routes)) or "  no route: the cached windows open none"
            return (
                f'  mode = "auto": reusing the {self.cache_text.removeprefix("windows cache: ")}: no probes, zero certification '
                f"cost; routing from the first step by\n{rules}"
            )
        s = self.settings
        if self.skipped is not None:
            return f'  mode = "auto": no certification, the run trains native (as the plain run): {self.skipped}'
        plan = self.plan.lines(self.bins, self.run_passes) if self.plan is not None else []
        return (
            f'  mode = "auto": the certifier runs when the first {self.images} training samples are in (batch {self.batches_needed}, '
            f"before its step); routes {', '.join(a.name for a in self.routes)}, σ bins {self.bins.spec()}, ε {s.margin:g}, "
            f"paired D = {s.draws}, looks {list(s.looks.at)}, safe on {s.looks.first_safe} distinct probe images, false-safe "
            f"≤ {s.looks.alpha:g} family-wise: at most {s.budget:.0f} {COST_UNIT} ({pct(self.run.cfg.certify.budget)} of the run's "
            f"{self.run_passes} single-sample passes), none on a window that cannot pay it back over the run's later passes; "
            f"the windows serve only the tiers of the buckets the probes come from; outputs to {self.out_dir}"
            + (f"; continuing the evidence of {self.run.cfg.certify.resume}" if self.prior else "")
            + "".join(f"\n  {line}" for line in plan)
            + f"\n  {self.cache_text}"
        )

    # -- certification --------------------------------------------------------------------------

    def host_sampler(self) -> Any:
        """The host's σ sampler as ``plan`` draws it (``sample(n, latent_hw, generator)``)."""
        raise NotImplementedError

    def sigma_mass(self, grids: list[tuple[int, int]], weights: Any = None) -> tuple[Any, str]:
        """P(lo < σ ≤ hi) (a point bin: P(σ = hi)) under the host's own sampler, averaged over ``grids`` (the probes',
        or the run's buckets by ``weights``: a flow shift depends on the grid), from :data:`MASS_SAMPLES` draws per grid
        made as ``plan`` makes them (a private generator: the run's draws are untouched)."""
        sampler = self.host_sampler()
        shares: dict[tuple[int, int], float] = {}
        for grid, w in zip(grids, self._weights(grids, weights), strict=True):
            shares[tuple(grid)] = shares.get(tuple(grid), 0.0) + w
        draws = {grid: sampler.sample(MASS_SAMPLES, grid, torch.Generator().manual_seed(self.run.seed)).double() for grid in shares}

        def mass(lo: float, hi: float) -> float:
            total = 0.0
            for grid, sigmas in draws.items():
                inside = (sigmas == hi) if hi <= lo else (sigmas > lo) & (sigmas <= hi)
                total += shares[grid] * float(inside.double().mean())
            return total

        named = ", ".join(f"{h}x{w}" for h, w in shares)
        return mass, f"the host's sampler ({MASS_SAMPLES} draws per latent grid, {named})"

    def complete(self, arguments: dict[str, Any]) -> None:
        from ...mapping.in_run import ForeignEvidence, certify_in_run

        if self.waiting and (entry := self.await_other()) is not None:
            self.lock.release()
            self.route_by(entry)
            return

        backend = self.backend(arguments)
        mass, mass_text = self.sigma_mass([tuple(g) for g in backend.grids])
        prior = (self.run.cfg.certify.resume, self.prior) if self.prior is not None else None
        try:
            done = certify_in_run(
                backend,
                self.routes,
                self.bins,
                self.settings,
                mass,
                mass_text,
                self.out_dir,
                self.command(),
                prior,
                self.run.cfg.windows.foreign,
                self.pass_fraction,
            )
        except ForeignEvidence as err:
            raise self.error(f'mode = "auto": {err}') from None
        for text in done.foreign:
            logger.warning('downscale_plugin: certify_resume: %s; windows_foreign = "warn": continuing it anyway', text)
        self.result, self.certify_s = done.result, done.seconds
        self.paths = {"toml": done.windows_toml, "json": done.certify_json}
        plan = done.result.plan.lines(self.bins, self.run_passes) if done.result.plan is not None else []
        logger.info(
            "downscale_plugin: certified before train batch %d (%.1f s)\n%s\n%s\nwrote %s\nwrote %s",
            self.batches,
            done.seconds,
            "\n".join([*plan, *done.result.notes]) or 'plan: none (certify_unpaid = "buy": no pay rule)',
            done.table,
            done.windows_toml,
            done.certify_json,
        )
        if self.key is not None:
            self.store(done)
        self.train_with(done.windows_toml)

    def store(self, done: Any) -> None:
        """Cache the certification under this run's key (its total cost, a resumed run's evidence included; how it ended,
        its horizon and budget: ``reuse.entry_of``), then let the next run of the key in (the lock)."""
        from ...mapping.reuse import entry_of, store
        from ...mapping.windows import utc_now

        with open(done.windows_toml) as fh:
            text = fh.read()
        before = done.result.provenance.get("resumed_from", {}).get("native_step_equivalents", 0.0)
        entry = entry_of(self.key, done.result, text, before + done.result.spent, utc_now(), self.command())
        try:
            path = store(entry, self.cache)
        except (OSError, ValueError) as err:  # an unwritable folder; windows the cache's own check refuses (reuse.EntryError)
            logger.warning("downscale_plugin: the windows cache could not be written (%s); the run goes on", err)
            return
        finally:
            if self.lock is not None:
                self.lock.release()
        logger.info("downscale_plugin: cached the certification as %s (key %s, %s)", path, self.key.digest(), entry.ended())

    def train_with(self, windows_path: str) -> None:
        """The certified windows become the run's routes: router, plan, accounting, metadata; log them."""
        from ...mapping.certify import scope_text

        run, s, result = self.run, self.settings, self.result
        derived = load_config(plugin_toml=toml.load(windows_path))
        plan = run.retarget(derived.routes)
        safe = [f"{t.route} {self.bins.label(t.bin)}" for t in result.safe_tests()]
        run.extra_metadata["ss_downscale_map"] = json.dumps(
            {
                "method": "certify",
                "windows_toml": windows_path,
                "certify_json": self.paths["json"],
                "windows": [f"{r.label} {r.window_text()}" for r in derived.routes],
                "safe_bins": safe,
                "before_train_batch": self.batches,
                "probes": self.images,
                "ratios": list(run.cfg.map.ratios),
                "bins": self.bins.spec(),
                "draws": s.draws,
                "margin": s.margin,
                "alpha": s.looks.alpha,
                "looks": list(s.looks.at),
                "spot_checks": result.spot_summary(),
                "scope": scope_text(result.provenance.get("backend", {})),
                "native_step_equivalents": round(result.spent, 3),
                "budget": round(s.budget, 3),
                "unit": COST_UNIT,
            }
        )
        if not run.cfg.routes:
            logger.warning(
                'downscale_plugin: mode = "auto": no route has a certified window at margin %g; training continues native', s.margin
            )
            return
        rules = "\n".join(f"  {row}".rstrip() for row in route_rows(run.cfg.routes))
        logger.info(
            'downscale_plugin: mode = "auto": training continues from batch %d with the certified windows (%s)\n%s',
            self.batches,
            windows_path,
            format_plan(plan) if plan else rules,
        )

    def net(self) -> tuple[float, float, float] | None:
        """(certification cost, routed saving so far, net) in native-step equivalents of the run's FLOP model (its
        token fraction without one: the unit the certifier priced passes in); None before a certification (cost 0 with
        cached windows)."""
        if self.result is None and self.reused is None:
            return None
        totals = self.run.totals
        saving = totals.flop_saving()
        saving = totals.token_saving() if saving is None else saving
        saved = saving * sum(totals.counts.samples)
        spent = self.result.spent if self.result is not None else 0.0
        return spent, saved, saved - spent

    def scalars(self) -> dict[str, float]:
        """``downscale/certify/*`` for the host's trackers: cost, routed saving and net, in native-step equivalents
        and as % of the run's passes."""
        net = self.net()
        if net is None:
            return {}
        out = {}
        for name, value in zip(("cost", "saving", "net"), net, strict=True):
            out[f"downscale/certify/{name}"] = value
            out[f"downscale/certify/{name}_pct"] = 100.0 * value / self.run_passes if self.run_passes else 0.0
        return out

    def summary_lines(self) -> list[str]:
        """The end summary's certification lines: cost, routed saving and net, in native-step equivalents and % of the run."""
        if self.skipped is not None:
            return [f"  certification: none, the run trained native: {self.skipped}"]
        net = self.net()
        of = lambda x: pct(x / self.run_passes) if self.run_passes else "n/a"  # noqa: E731
        if self.reused is not None and net is not None:
            return [
                f"  certification: none in this run (0 {COST_UNIT}): windows reused from {self.reused.path} (certified "
                f"{self.reused.date or '?'} for {self.reused.cost:.1f}); routed {pct(self.run.totals.demote_fraction())} of the run's steps",
                f"  net ({COST_UNIT}): routed saving {net[1]:.1f} ({of(net[1])}) − certification 0 = {net[2]:+.1f} ({of(net[2])}) "
                f"of the run's {self.run_passes} single-sample passes",
            ]
        if net is None:
            if self.measured:  # adopted from a resumed state
                return ["  certification: none in this run; the resumed state's windows, certified before it was saved, route it"]
            return []
        spent, saved, gain = net
        wall = time.perf_counter() - self.started
        flop = self.run.totals.flop_saving()
        train = max(wall - self.certify_s, 0.0)
        seconds = train * flop / (1.0 - flop) if flop is not None and flop < 1.0 else 0.0  # the routed steps' saving in s (FLOP model)
        return [
            f"  certification: {spent:.1f} native-step equivalents ({of(spent)} of the run, budget {pct(self.run.cfg.certify.budget)}), "
            f"{self.certify_s:.1f} s; {len(self.result.safe_tests())} safe bin(s); {self.result.spot_text()}; routed "
            f"{pct(self.run.totals.demote_fraction())} of the run's steps",
            f"  net ({COST_UNIT}): routed saving {saved:.1f} ({of(saved)}) − certification {spent:.1f} ({of(spent)}) = {gain:+.1f} "
            f"({of(gain)}) of the run's {self.run_passes} single-sample passes"
            + (
                f"; wall (FLOP-model estimate of the routed steps' saving minus the measured certification) {seconds - self.certify_s:+.1f} s of {wall:.1f} s"
                if flop is not None
                else ""
            ),
        ]
