"""The ``snr`` diagnostic: log-SNR densities for native and routed steps, a summary and a PNG.

Curves, on one λ axis (extended log-SNR, ``snr``):

- native: every step at the native grid (std s_native pooled over all latents);
- per route, "all σ at this grid": the same sampler at the small latent's std, i.e. the native curve
  of the route's buckets moved by its offset 2·log(s_small/s_native) (the ratio is measured on the
  latents the route can take, against their own native copies; the small std used is s_native ×
  that ratio);
- the training mixture: Monte Carlo of the router, first matching eligible rule per bucket (spans
  ignored: every rule active), routed σ moved by ``sigma_policy``. With ``snr_match`` it equals the
  native curve by construction.

Densities are closed-form where the sampler has one (``snr.log_snr_pdf``), histograms otherwise.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..arch import ArchSpec
from ..grid import tokens
from ..sigma import SigmaSampler
from .latent_stds import LatentStds, RouteStds
from .policies import policy_factor, shift_sigma
from .snr import log_snr, log_snr_histogram, log_snr_pdf


@dataclass
class RouteCurve:
    stds: RouteStds
    density: np.ndarray  # every σ at this grid (the route's buckets)
    routed_fraction: float  # of all steps, in the mixture
    res_shift_k: float  # √(m/n), averaged over the route's buckets by latent count


@dataclass
class SnrReport:
    edges: np.ndarray
    native_std: float
    native: np.ndarray
    mixture: np.ndarray
    routes: list[RouteCurve]
    policy: str
    closed_form: bool
    native_mean: float
    mixture_mean: float
    tv_distance: float  # ½∫|mixture − native|, both Monte Carlo on the same bins
    nonfinite: float  # fraction of draws with σ exactly 0 or 1 (λ = ±∞), left out of every curve

    @property
    def centers(self) -> np.ndarray:
        return 0.5 * (self.edges[1:] + self.edges[:-1])


def _weights(counts: Counter) -> dict[tuple[int, int], float]:
    total = sum(counts.values())
    return {hw: c / total for hw, c in counts.items()}


def _closed_form(sampler, counts: Counter, std: float, centers: np.ndarray) -> np.ndarray:
    """λ density of the bucket mixture ``counts`` at data std ``std`` (μ of flux_shift is per bucket)."""
    return sum(w * log_snr_pdf(centers, sampler, hw, std) for hw, w in _weights(counts).items())


def _finite(parts: list[torch.Tensor]) -> np.ndarray:
    lam = torch.cat(parts).numpy() if parts else np.zeros(0)
    return lam[np.isfinite(lam)]


def build_report(
    stds: LatentStds, sampler, arch: ArchSpec, policy: str = "keep", samples: int = 200_000, bins: int = 160, seed: int = 0
) -> SnrReport:
    """Densities and the training mixture for ``sampler`` (a ``SigmaSampler`` or a ``DdpmSampler``)."""
    gen = torch.Generator().manual_seed(seed)
    s_native = stds.native.std
    native, mixed = [], []
    shifted: dict[int, list[torch.Tensor]] = {r.index: [] for r in stds.routes}
    routed: Counter = Counter()
    for hw, weight in _weights(stds.buckets).items():
        sigma = sampler.sample(max(1, round(samples * weight)), hw, generator=gen).double().reshape(-1)
        lam = log_snr(sigma, s_native)
        mix = lam.clone()
        taken = torch.zeros_like(sigma, dtype=torch.bool)
        for route in stds.routes:
            small_hw = route.grids.get(hw)
            if small_hw is None:
                continue
            shifted[route.index].append(lam + route.log_snr_offset)
            hit = route.rule.in_window(sigma) & ~taken
            taken |= hit
            routed[route.index] += int(hit.sum())
            k = policy_factor(policy, tokens(hw, arch), tokens(small_hw, arch), route.native.std, route.small.std)
            mix[hit] = log_snr(shift_sigma(sigma[hit], k), s_native * route.ratio)
        native.append(lam)
        mixed.append(mix)
    draws = sum(len(x) for x in native)
    native_lam, mixed_lam = _finite(native), _finite(mixed)
    pooled = np.concatenate([native_lam, mixed_lam, *(_finite(v) for v in shifted.values())])
    lo, hi = np.quantile(pooled, [0.001, 0.999])
    pad = 0.05 * (hi - lo)
    edges = np.linspace(lo - pad, hi + pad, bins + 1)
    centers = 0.5 * (edges[1:] + edges[:-1])
    closed = isinstance(sampler, SigmaSampler) and sampler.has_closed_form
    native_mc = log_snr_histogram(native_lam, edges, draws)
    mixture = log_snr_histogram(mixed_lam, edges, draws)
    curves = []
    for route in stds.routes:
        if not route.counts:
            continue
        if closed:
            density = _closed_form(sampler, route.counts, s_native * route.ratio, centers)
        else:
            eligible = _finite(shifted[route.index])
            density = log_snr_histogram(eligible, edges, sum(len(x) for x in shifted[route.index]))
        res_k = sum(w * math.sqrt(tokens(route.grids[hw], arch) / tokens(hw, arch)) for hw, w in _weights(route.counts).items())
        curves.append(RouteCurve(route, density, routed[route.index] / draws, res_k))
    return SnrReport(
        edges=edges,
        native_std=s_native,
        native=_closed_form(sampler, stds.buckets, s_native, centers) if closed else native_mc,
        mixture=mixture,
        routes=curves,
        policy=policy,
        closed_form=closed,
        native_mean=float(native_lam.mean()),
        mixture_mean=float(mixed_lam.mean()),
        tv_distance=float(0.5 * np.sum(np.abs(mixture - native_mc) * np.diff(edges))),
        nonfinite=1.0 - len(native_lam) / draws,
    )


def format_report(report: SnrReport, stds: LatentStds, sampler_text: str, source_text: str) -> str:
    """The console summary: stds, each route's offset and effective shift, the mixture's drift."""
    buckets = ", ".join(f"{h}x{w}:{c}" for (h, w), c in sorted(stds.buckets.items()))
    lines = [
        f"sampler: {sampler_text}",
        f"latents: {source_text}; {sum(stds.buckets.values())} latents, latent buckets (h x w: count) {buckets}",
        f"native data std s = {report.native_std:.4f}; log-SNR = 2·log((1−σ)s/σ); "
        f"densities {'closed form' if report.closed_form else 'Monte Carlo'}",
        "",
        f"  {'route':<16}{'window':<14}{'latents':>8}{'s_native':>10}{'s_small':>10}{'ratio':>8}{'Δlog-SNR':>10}"
        f"{'eff.shift':>11}{'res k':>8}{'routed':>8}  snr_match σ' at window edges",
    ]
    for curve in report.routes:
        r = curve.stds
        hi = 1.0 if r.rule.sigma_max is None else r.rule.sigma_max
        edges = ", ".join(f"{s:g}→{float(shift_sigma(s, r.ratio)):.3f}" for s in (r.rule.sigma_min, hi))
        lines.append(
            f"  r{r.index} {r.rule.label:<13}{r.rule.window_text():<14}{sum(r.counts.values()):>8}{r.native.std:>10.4f}"
            f"{r.small.std:>10.4f}{r.ratio:>8.4f}{r.log_snr_offset:>+10.3f}{r.effective_shift:>11.4f}{curve.res_shift_k:>8.3f}"
            f"{curve.routed_fraction:>8.1%}  {edges}"
        )
    missing = [f"r{r.index} {r.rule.label}" for r in stds.routes if not r.counts]
    if missing:
        lines.append(f"  no latent is eligible for: {', '.join(missing)}")
    lines += [
        "",
        "  ratio = s_small/s_native (the snr_match factor); Δlog-SNR = 2·log(ratio) at every σ; eff.shift = 1/ratio: a small step",
        "  at σ has the log-SNR of a native step at eff.shift·σ/(1+(eff.shift−1)·σ); res k = √(small/native tokens) (res_shift).",
        f"training mixture (sigma_policy {report.policy}): mean log-SNR {report.mixture_mean:+.3f} vs native {report.native_mean:+.3f}, "
        f"total variation {report.tv_distance:.4f}",
    ]
    if report.nonfinite:
        lines.append(f"  {report.nonfinite:.2%} of draws had σ exactly 0 or 1 (log-SNR ±∞) and are left out of the curves")
    return "\n".join(lines)


def plot_report(report: SnrReport, path: str) -> None:
    """Two panels: the λ densities, and λ(σ) for native and each small latent with the windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = report.centers
    ax.plot(x, report.native, color="black", lw=2, label=f"native (s={report.native_std:.3f})")
    bx.plot(*_lambda_of_sigma(report.native_std), color="black", lw=2, label="native")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for curve, color in zip(report.routes, colors, strict=False):
        r = curve.stds
        label = f"r{r.index} {r.rule.label} all σ (Δ={r.log_snr_offset:+.2f})"
        ax.plot(x, curve.density, color=color, ls="--", label=label)
        bx.plot(*_lambda_of_sigma(report.native_std * r.ratio), color=color, ls="--", label=f"r{r.index} small latent")
        bx.axvspan(r.rule.sigma_min, 1.0 if r.rule.sigma_max is None else r.rule.sigma_max, color=color, alpha=0.12)
    ax.step(report.edges[:-1], report.mixture, where="post", color="crimson", lw=1.2, label=f"training mixture ({report.policy})")
    ax.set_xlabel("extended log-SNR  2·log((1−σ)·s/σ)")
    ax.set_ylabel("density")
    ax.set_title("log-SNR PDF under the host sampler")
    ax.legend(fontsize=8)
    bx.set_xlabel("σ")
    bx.set_ylabel("log-SNR")
    bx.set_title("log-SNR of σ (shaded: route windows)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lambda_of_sigma(std: float) -> tuple[np.ndarray, np.ndarray]:
    sigma = torch.linspace(0.002, 0.998, 400, dtype=torch.float64)
    return sigma.numpy(), log_snr(sigma, std).numpy()
