"""What the router did, and what it saved (docs/ARCHITECTURE.md §5).

Per train step one :class:`StepRecord` (route, σ, tokens run); :class:`Accounting` keeps running
counts: route fractions against the plan's prediction, fallbacks, a token histogram, per-route
losses (the host's ``loss/average`` mixes grids, so it cannot show a route drifting) and the
realized FLOP saving under a :class:`FlopModel`. Counts are plain sums, so ranks combine by
adding them (:meth:`Accounting.reduced` with ``accelerator.reduce``, or :meth:`~Accounting.state`
and :meth:`~Accounting.merge`). The per-step reduction also shows whether every rank ran the same
route that step; steps where they did not (each waits for the slowest rank) are counted.
"""

from __future__ import annotations

import copy
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .arch import ArchSpec, get_arch
from .config import RouteRule
from .flops import FlopModel
from .grid import eligibility_table, tokens
from .text import pct

FALLBACK_REASONS = ("law_fill", "lead_fill", "other")  # how a coupled step filled the σ its rejection rounds did not find


@dataclass(frozen=True)
class StepRecord:
    """One train step: route (``rule_index`` −1 = native), per-sample σ and tokens per sample.

    ``sigmas`` are the drawn σ (what the window gate read); ``run_sigmas`` the σ the step ran at
    when a σ policy mapped them (None: the drawn ones).
    """

    step: int
    rule_index: int
    route: str
    sigmas: list[float]
    tokens_native: int
    tokens_run: int
    resampled: int = 0
    fallback: str | None = None
    loss: float | None = None
    run_sigmas: list[float] | None = None

    @property
    def sigmas_run(self) -> list[float]:
        return self.sigmas if self.run_sigmas is None else self.run_sigmas

    @classmethod
    def from_decision(
        cls,
        step: int,
        decision: Any,
        latent_hw: tuple[int, int],
        arch: str | ArchSpec,
        loss: float | None = None,
        run_sigmas: torch.Tensor | None = None,
    ) -> StepRecord:
        """Build from a :class:`~downscale_plugin.router.RouteDecision` and the step's native latent grid."""
        spec = arch if isinstance(arch, ArchSpec) else get_arch(arch)
        native = tokens(latent_hw, spec)
        return cls(
            step=step,
            rule_index=decision.rule_index,
            route=decision.rule.label if decision.rule is not None else "native",
            sigmas=[float(s) for s in decision.sigmas.reshape(-1).tolist()],
            tokens_native=native,
            tokens_run=tokens(decision.target_hw, spec) if decision.target_hw is not None else native,
            resampled=decision.resampled,
            fallback=decision.fallback,
            loss=loss,
            run_sigmas=None if run_sigmas is None or run_sigmas is decision.sigmas else [float(s) for s in run_sigmas.reshape(-1).tolist()],
        )


def _tag(text: str) -> str:
    """Tracker-safe key fragment (TensorBoard tags allow [A-Za-z0-9_.-/])."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)


@dataclass
class Counts:
    """Every count :class:`Accounting` sums over steps, ranks and resumed runs, as one field list
    that ``state``, ``merge`` and ``reduced`` iterate instead of naming each counter.

    Lists hold one value per route slot (rules, then native), ``fallbacks`` one per reason; the
    rest are sums (σ over routed samples; FLOPs and tokens over all samples).
    """

    steps: list[float]
    samples: list[float]
    loss_sum: list[float]
    loss_count: list[float]
    fallbacks: dict[str, float]
    resampled: float = 0.0
    sigma_drawn: float = 0.0
    sigma_run: float = 0.0
    flops_native: float = 0.0
    flops_run: float = 0.0
    tokens_native: float = 0.0
    tokens_run: float = 0.0

    @classmethod
    def empty(cls, slots: int, reasons: Sequence[str]) -> Counts:
        return cls(*([0.0] * slots for _ in range(4)), dict.fromkeys(reasons, 0.0))

    def state(self) -> dict[str, Any]:
        return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}

    def add(self, state: Mapping[str, Any]) -> None:
        """Add another :meth:`state` (a reason this accounting does not know counts as ``other``)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), state[f.name]
            if isinstance(mine, list):
                setattr(self, f.name, [a + b for a, b in zip(mine, theirs, strict=True)])
            elif isinstance(mine, dict):
                for reason, count in theirs.items():
                    mine[reason if reason in mine else "other"] += count
            else:
                setattr(self, f.name, mine + theirs)

    def values(self) -> list[float]:
        """Every count as one flat vector, in field order (what ranks sum)."""
        out: list[float] = []
        for f in fields(self):
            value = getattr(self, f.name)
            out.extend(value if isinstance(value, list) else value.values() if isinstance(value, dict) else [value])
        return out

    def like(self, take: Iterator[float]) -> Counts:
        """A copy of this layout filled from a flat vector in :meth:`values` order."""
        filled: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                filled[f.name] = [next(take) for _ in value]
            elif isinstance(value, dict):
                filled[f.name] = {key: next(take) for key in value}
            else:
                filled[f.name] = next(take)
        return Counts(**filled)

    def padded(self, slots: int) -> Counts:
        """These counts with ``slots`` empty route slots in front (rules added before the native slot)."""
        return replace(
            self, **{f.name: [0.0] * slots + getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), list)}
        )


class Accounting:
    """Running route, token, FLOP and loss counts for one rank; see the module docstring.

    ``predicted`` maps rule index (−1 native) to the planned step fraction and
    ``predicted_flop_saving`` is the plan's saving (both from :mod:`downscale_plugin.plan`).
    ``token_values`` fixes the histogram layout :meth:`reduced` sums across ranks (every rank must
    pass the same list; :meth:`vocabulary` builds it from the bucket list). ``loss_window``: the
    number of recent losses per route behind the ``downscale/loss/*`` scalars. ``sigma_policy``
    names the σ policy of routed steps; the drawn and the run σ of routed samples are summed apart.
    """

    def __init__(
        self,
        rules: Sequence[RouteRule],
        flop_model: FlopModel | None = None,
        predicted: Mapping[int, float] | None = None,
        *,
        predicted_flop_saving: float | None = None,
        fallback_reasons: Sequence[str] = FALLBACK_REASONS,
        token_values: Iterable[int] = (),
        loss_window: int = 100,
        sigma_policy: str = "keep",
    ):
        self.rules = tuple(rules)
        self.flop_model = flop_model
        self.predicted = dict(predicted) if predicted is not None else None
        self.predicted_flop_saving = predicted_flop_saving
        self.fallback_reasons = tuple(dict.fromkeys((*fallback_reasons, "other")))
        self.token_values = tuple(sorted(set(token_values)))
        self.loss_window = loss_window
        self.sigma_policy = sigma_policy
        slots = len(self.rules) + 1  # rules, then native
        self.counts = Counts.empty(slots, self.fallback_reasons)
        self.hist_run: dict[int, float] = {}
        self.hist_native: dict[int, float] = {}
        self.histogram_complete = True
        self._recent: list[deque[float]] = [deque(maxlen=loss_window) for _ in range(slots)]
        self._window = [(0.0, 0.0)] * slots  # (sum, count) of a reduced copy's recent losses
        self._last_slot: int | None = None
        self._vote = [0.0] * slots  # one-hot of the route recorded since the last reduction
        self.compared = 0.0  # steps whose routes were compared across ranks, and those where ranks disagreed
        self.disagreed = 0.0

    @staticmethod
    def vocabulary(
        buckets: Sequence[tuple[int, int]], rules: Sequence[RouteRule], arch: str | ArchSpec, tier_tolerance: float
    ) -> list[int]:
        """Every token count a step can run at for these latent buckets: the ``token_values`` layout."""
        spec = arch if isinstance(arch, ArchSpec) else get_arch(arch)
        found = {tokens(b, spec) for b in buckets}
        for row in eligibility_table(list(buckets), tuple(rules), spec, tier_tolerance):
            found.update(tokens(cell.target_hw, spec) for cell in row if cell.eligible)
        return sorted(found)

    def _slot(self, rule_index: int) -> int:
        return len(self.rules) if rule_index < 0 else rule_index

    def _key(self, slot: int) -> str:
        return "native" if slot == len(self.rules) else f"r{slot}_{_tag(self.rules[slot].label)}"

    def _name(self, slot: int) -> str:
        return "native" if slot == len(self.rules) else f"r{slot} {self.rules[slot].label}"

    def record(self, rec: StepRecord) -> None:
        slot = self._slot(rec.rule_index)
        n = len(rec.sigmas)
        self.counts.steps[slot] += 1
        self.counts.samples[slot] += n
        self.counts.resampled += rec.resampled
        if rec.rule_index >= 0:
            self.counts.sigma_drawn += sum(rec.sigmas)
            self.counts.sigma_run += sum(rec.sigmas_run)
        if rec.fallback is not None:
            reason = rec.fallback if rec.fallback in self.counts.fallbacks else "other"
            self.counts.fallbacks[reason] += 1
        self.counts.tokens_native += n * rec.tokens_native
        self.counts.tokens_run += n * rec.tokens_run
        if self.flop_model is not None:
            self.counts.flops_native += n * self.flop_model.flops(rec.tokens_native)
            self.counts.flops_run += n * self.flop_model.flops(rec.tokens_run)
        self.hist_native[rec.tokens_native] = self.hist_native.get(rec.tokens_native, 0.0) + n
        self.hist_run[rec.tokens_run] = self.hist_run.get(rec.tokens_run, 0.0) + n
        self._last_slot = slot
        self._vote = [float(i == slot) for i in range(len(self.counts.steps))]
        if rec.loss is not None:
            self._add_loss(slot, rec.loss)

    def record_loss(self, loss: float) -> None:
        """Attribute a loss known only after the step (the host's ``current_loss``) to the last route."""
        if self._last_slot is not None:
            self._add_loss(self._last_slot, float(loss))

    def _add_loss(self, slot: int, loss: float) -> None:
        self.counts.loss_sum[slot] += loss
        self.counts.loss_count[slot] += 1
        self._recent[slot].append(loss)

    # -- derived figures ------------------------------------------------------------------------

    @property
    def total_steps(self) -> float:
        return sum(self.counts.steps)

    def fractions(self) -> dict[int, float]:
        """Step fraction per rule index (−1 native)."""
        total = self.total_steps
        return {(-1 if s == len(self.rules) else s): (c / total if total else 0.0) for s, c in enumerate(self.counts.steps)}

    @property
    def routed_samples(self) -> float:
        return sum(self.counts.samples[:-1])

    def demote_fraction(self) -> float:
        total = self.total_steps
        return 1.0 - self.counts.steps[-1] / total if total else 0.0

    def token_saving(self) -> float:
        return 1.0 - self.counts.tokens_run / self.counts.tokens_native if self.counts.tokens_native else 0.0

    def flop_saving(self) -> float | None:
        if self.flop_model is None:
            return None
        return 1.0 - self.counts.flops_run / self.counts.flops_native if self.counts.flops_native else 0.0

    def _window_stats(self, slot: int) -> tuple[float, float]:
        recent = self._recent[slot]
        local = (sum(recent), float(len(recent)))
        return (local[0] + self._window[slot][0], local[1] + self._window[slot][1])

    def scalars(self) -> dict[str, float]:
        """``downscale/*`` floats for the host's trackers."""
        out: dict[str, float] = {"downscale/steps": self.total_steps, "downscale/demote_frac": self.demote_fraction()}
        fractions = self.fractions()
        if self.predicted is not None:
            out["downscale/demote_frac_pred"] = 1.0 - self.predicted.get(-1, 0.0)
        for slot in range(len(self.counts.steps)):
            index = -1 if slot == len(self.rules) else slot
            key = self._key(slot)
            out[f"downscale/frac/{key}"] = fractions[index]
            if self.predicted is not None:
                out[f"downscale/frac_pred/{key}"] = self.predicted.get(index, 0.0)
            total, count = self._window_stats(slot)
            if count:
                out[f"downscale/loss/{key}"] = total / count
        n = sum(self.counts.samples)
        if n:
            out["downscale/tokens_run_mean"] = self.counts.tokens_run / n
            out["downscale/tokens_native_mean"] = self.counts.tokens_native / n
            out["downscale/resampled_frac"] = self.counts.resampled / n
        routed = self.routed_samples
        if routed and self.sigma_policy != "keep":
            out["downscale/sigma_drawn_routed_mean"] = self.counts.sigma_drawn / routed
            out["downscale/sigma_run_routed_mean"] = self.counts.sigma_run / routed
        out["downscale/token_saving"] = self.token_saving()
        saving = self.flop_saving()
        if saving is not None:
            out["downscale/flop_saving"] = saving
        if self.predicted_flop_saving is not None:
            out["downscale/flop_saving_pred"] = self.predicted_flop_saving
        for reason, count in self.counts.fallbacks.items():
            out[f"downscale/fallback/{_tag(reason)}"] = count
        if self.compared:
            out["downscale/rank_disagree_frac"] = self.disagreed / self.compared
        return out

    def summary_text(self) -> str:
        """The end-of-run summary."""
        total = self.total_steps
        lines = [f"downscale: {total:.0f} train forwards, {sum(self.counts.samples):.0f} samples"]
        lines.append(f"  {'route':<22}{'steps':>9}{'frac':>9}{'pred':>9}{'mean loss':>12}")
        fractions = self.fractions()
        for slot in range(len(self.counts.steps)):
            index = -1 if slot == len(self.rules) else slot
            pred = pct(self.predicted.get(index, 0.0)) if self.predicted is not None else "-"
            loss = f"{self.counts.loss_sum[slot] / self.counts.loss_count[slot]:.4g}" if self.counts.loss_count[slot] else "-"
            lines.append(f"  {self._name(slot):<22}{self.counts.steps[slot]:>9.0f}{pct(fractions[index]):>9}{pred:>9}{loss:>12}")
        pred = f" (predicted {pct(1.0 - self.predicted.get(-1, 0.0))})" if self.predicted is not None else ""
        fallbacks = ", ".join(f"{r} {c:.0f}" for r, c in self.counts.fallbacks.items())
        n = sum(self.counts.samples)
        resampled = f"; σ redrawn for {pct(self.counts.resampled / n)} of samples" if n else ""
        lines.append(f"  routed {pct(self.demote_fraction())} of steps{pred}{resampled}; fallbacks: {fallbacks}")
        routed = self.routed_samples
        means = (
            f": routed samples drawn at mean σ {self.counts.sigma_drawn / routed:.4f}, run at {self.counts.sigma_run / routed:.4f}"
            if routed
            else ""
        )
        lines.append(f"  σ policy {self.sigma_policy}{means}")
        if self.compared:
            lines.append(
                f"  ranks ran different routes on {self.disagreed:.0f} of {self.compared:.0f} steps "
                f"({pct(self.disagreed / self.compared)}; each waits for the slowest rank)"
            )
        if n:
            lines.append(
                f"  tokens per sample: native {self.counts.tokens_native / n:.0f}, run {self.counts.tokens_run / n:.0f} "
                f"(token saving {pct(self.token_saving())})"
            )
        saving = self.flop_saving()
        if saving is not None:
            pred = f" vs {pct(self.predicted_flop_saving)} predicted" if self.predicted_flop_saving is not None else ""
            lines.append(f"  FLOP saving {pct(saving)} realized{pred}")
        if self.hist_run:
            hist = ", ".join(f"{n_tok}×{c:.0f}" for n_tok, c in sorted(self.hist_run.items(), reverse=True))
            scope = "" if self.histogram_complete else " (this rank only: tokens outside token_values)"
            lines.append(f"  token histogram (tokens × samples){scope}: {hist}")
        return "\n".join(lines)

    # -- combining ranks ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Plain counts, for ``gather_object`` style combining with :meth:`merge`: the :class:`Counts`
        fields, the recent-loss windows, the token histograms and the cross-rank comparison."""
        return {
            **self.counts.state(),
            "window": [self._window_stats(s) for s in range(len(self.counts.steps))],
            "hist_run": dict(self.hist_run),
            "hist_native": dict(self.hist_native),
            "ranks": (self.compared, self.disagreed),
        }

    def merge(self, state: Mapping[str, Any]) -> None:
        """Add another rank's :meth:`state` into this one (a reporting copy: its recent-loss window stays a fixed sum)."""
        self.counts.add(state)
        self._window = [(a + s, b + c) for (a, b), (s, c) in zip(self._window, state["window"], strict=True)]
        compared, disagreed = state.get("ranks", (0.0, 0.0))  # already over all ranks: the same in every rank's state
        self.compared, self.disagreed = max(self.compared, compared), max(self.disagreed, disagreed)
        for name in ("hist_run", "hist_native"):
            mine = getattr(self, name)
            for n_tok, c in state[name].items():
                mine[int(n_tok)] = mine.get(int(n_tok), 0.0) + c

    def _vector(self) -> list[float]:
        windows = [self._window_stats(s) for s in range(len(self.counts.steps))]
        outside = sum(1 for n_tok in (*self.hist_run, *self.hist_native) if n_tok not in self.token_values)
        return [
            *self.counts.values(),
            *(w[0] for w in windows),
            *(w[1] for w in windows),
            float(outside),
            *(self.hist_run.get(n_tok, 0.0) for n_tok in self.token_values),
            *(self.hist_native.get(n_tok, 0.0) for n_tok in self.token_values),
            *self._vote,
        ]

    def reduced(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str | None = None) -> Accounting:
        """A copy holding the sum over ranks: ``fn`` reduces a 1-D float64 tensor (``accelerator.reduce``).

        A collective: every rank must call it, with the same rules and ``token_values``. The token
        histogram is summed over ``token_values``; if any rank saw a token count outside it, the
        copy keeps this rank's histogram and says so (``histogram_complete`` False). When a step was
        recorded since the last call, the summed one-hot routes say whether all ranks ran one route:
        this accounting's ``compared``/``disagreed`` (the same on every rank) count it.
        """
        vec = torch.tensor(self._vector(), dtype=torch.float64, device=device)
        take = iter(fn(vec).detach().to("cpu", torch.float64).tolist())
        out = Accounting(
            self.rules,
            self.flop_model,
            self.predicted,
            predicted_flop_saving=self.predicted_flop_saving,
            fallback_reasons=self.fallback_reasons,
            token_values=self.token_values,
            loss_window=self.loss_window,
            sigma_policy=self.sigma_policy,
        )
        slots = len(self.counts.steps)

        def chunk(n: int) -> list[float]:
            return [next(take) for _ in range(n)]

        out.counts = self.counts.like(take)
        out._window = list(zip(chunk(slots), chunk(slots), strict=True))
        (outside,) = chunk(1)
        hist_run, hist_native = chunk(len(self.token_values)), chunk(len(self.token_values))
        if outside == 0:
            out.hist_run = {n_tok: c for n_tok, c in zip(self.token_values, hist_run, strict=True) if c}
            out.hist_native = {n_tok: c for n_tok, c in zip(self.token_values, hist_native, strict=True) if c}
        else:
            out.hist_run, out.hist_native = dict(self.hist_run), dict(self.hist_native)
            out.histogram_complete = False
        self._compare(chunk(slots))
        out.compared, out.disagreed = self.compared, self.disagreed
        return out

    def _compare(self, votes: list[float]) -> None:
        """Count one step's cross-rank comparison from the rank-summed one-hot routes (none if no step since the last)."""
        if sum(votes) > 0:
            self.compared += 1
            self.disagreed += float(max(votes) < sum(votes))
        self._vote = [0.0] * len(votes)
