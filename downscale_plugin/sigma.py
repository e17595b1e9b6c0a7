"""The σ axis: host-like σ samplers, their exact laws, and DDPM t ↔ flow σ.

These mirror sd-scripts' Flux-family ``--timestep_sampling`` modes (``uniform``, ``sigmoid``,
``shift``, ``flux_shift``, Lumina's ``nextdit_shift``), its scheduler-grid mode (``sigma`` and the
other density modes) and SD1/SDXL's DDPM timesteps (:class:`DdpmSampler`), so that ``plan`` can
predict route frequencies, the statistical tests have a reference, and the lab trainer draws σ
exactly like the host. In a real run the router calls the host's own sampler; a *law*
(:class:`ContinuousLaw`, :class:`DiscreteLaw`) only fills in what the coupled gate's bounded
rejection could not find: the host's σ distribution restricted to a category, drawn exactly from a
private generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

CLOSED_FORM_MODES = ("uniform", "sigmoid", "shift", "flux_shift")
LAW_MODES = (*CLOSED_FORM_MODES, "nextdit_shift")  # closed forms; nextdit_shift is Lumina's (lumina_train_util)
DENSITY_SCHEMES = ("logit_normal", "mode", "uniform", "sigma_sqrt", "cosmap", "none")


def flux_mu(latent_hw: tuple[int, int]) -> float:
    """sd-scripts' ``flux_shift`` μ: linear in the packed token count, 0.5 at 256 to 1.15 at 4096."""
    h, w = latent_hw
    slope = (1.15 - 0.5) / (4096 - 256)
    return slope * ((h // 2) * (w // 2)) + 0.5 - slope * 256


def _logit(x: float) -> float:
    return math.log(x) - math.log1p(-x)


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


Classify = Callable[[torch.Tensor], torch.Tensor]  # σ → category index per σ (the router's first-match rule)


@dataclass(frozen=True)
class ContinuousLaw:
    """A continuous host σ law: ``cdf`` and its inverse ``quantile`` in float64.

    ``conditional`` draws by inverse CDF inside a window, so a window of mass 1e-4 costs no more
    than a wide one. Points have no mass, so a category's mass is the sum over the open intervals
    between the window edges that it owns.
    """

    cdf: Callable[[float], float]
    quantile: Callable[[torch.Tensor], torch.Tensor]

    def mass(self, lo: float, hi: float) -> float:
        return max(0.0, self.cdf(hi) - self.cdf(lo))

    def conditional(self, n: int, lo: float, hi: float, generator: torch.Generator) -> torch.Tensor:
        """n σ from the law restricted to (lo, hi), float64."""
        a, b = self.cdf(lo), self.cdf(hi)
        u = a + (b - a) * torch.rand(n, dtype=torch.float64, generator=generator)
        return self.quantile(u)

    def _pieces(self, classify: Classify, edges: Sequence[float]) -> list[tuple[int, float, float, float]]:
        """(category, lo, hi, mass) of each open interval between consecutive edges."""
        spans = list(pairwise(sorted({-math.inf, math.inf, *edges})))
        mids = [(a + b) / 2 if math.isfinite(a + b) else (b - 1.0 if math.isfinite(b) else a + 1.0) for a, b in spans]
        cats = classify(torch.tensor(mids, dtype=torch.float64)).tolist()
        return [(c, a, b, self.mass(a, b)) for c, (a, b) in zip(cats, spans, strict=True)]

    def masses(self, classify: Classify, edges: Sequence[float]) -> dict[int, float]:
        """Each category's probability; ``edges`` are every window bound ``classify`` compares against."""
        out: dict[int, float] = {}
        for c, _, _, m in self._pieces(classify, edges):
            out[c] = out.get(c, 0.0) + m
        return out

    def draw(self, n: int, category: int, classify: Classify, edges: Sequence[float], generator: torch.Generator) -> torch.Tensor:
        """n σ from the law restricted to ``category`` (a union of intervals), float64."""
        pieces = [p for p in self._pieces(classify, edges) if p[0] == category and p[3] > 0.0]
        weights = torch.tensor([p[3] for p in pieces], dtype=torch.float64)
        pick = torch.multinomial(weights, n, replacement=True, generator=generator)
        out = torch.empty(n, dtype=torch.float64)
        for i, (_, lo, hi, _) in enumerate(pieces):
            where = (pick == i).nonzero().flatten()
            if where.numel():
                out[where] = self.conditional(where.numel(), lo, hi, generator)
        return out


@dataclass(frozen=True)
class DiscreteLaw:
    """A host σ law on atoms: ``values`` (the σ the host returns, as the router is handed them), ``probs`` (float64),
    and ``labels``, the host's own timestep for each atom (several timesteps may share one σ value in
    bf16, so an atom is the pair, not the σ)."""

    values: torch.Tensor
    probs: torch.Tensor
    labels: torch.Tensor

    def cdf(self, x: float) -> float:
        return float(self.probs[self.values.double() <= x].sum())

    def masses(self, classify: Classify, edges: Sequence[float] = ()) -> dict[int, float]:
        """Each category's probability: the atoms are classified as the router classifies host σ, so
        ``values`` must have the dtype of the σ the host adapter hands the router (``edges``: unused)."""
        cats = classify(self.values)
        return {int(c): float(self.probs[cats == c].sum()) for c in torch.unique(cats).tolist()}

    def draw_atoms(self, n: int, category: int, classify: Classify, generator: torch.Generator) -> torch.Tensor:
        """Indices of n atoms drawn from the law restricted to ``category``."""
        weights = torch.where(classify(self.values) == category, self.probs, torch.zeros_like(self.probs))
        return torch.multinomial(weights, n, replacement=True, generator=generator)

    def draw(self, n: int, category: int, classify: Classify, edges: Sequence[float], generator: torch.Generator) -> torch.Tensor:
        return self.values[self.draw_atoms(n, category, classify, generator)].double()


SigmaLaw = ContinuousLaw | DiscreteLaw


def density_cdf(scheme: str, logit_mean: float = 0.0, logit_std: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """CDF of sd-scripts' ``compute_density_for_timestep_sampling`` u (float64), None for ``mode``
    (no closed-form inverse). Every scheme other than logit_normal and mode draws u uniform there."""
    if scheme == "mode":
        return None
    if scheme == "logit_normal":
        return lambda x: torch.special.ndtr((torch.logit(x.clamp(0.0, 1.0)) - logit_mean) / logit_std)
    return lambda x: x.clamp(0.0, 1.0)


def grid_law(
    values: torch.Tensor, labels: torch.Tensor, scheme: str, logit_mean: float = 0.0, logit_std: float = 1.0
) -> DiscreteLaw | None:
    """The scheduler-grid mode's law: index ⌊u·T⌋ of the host's grid, so atom i has F_u((i+1)/T) − F_u(i/T)."""
    cdf = density_cdf(scheme, logit_mean, logit_std)
    if cdf is None:
        return None
    n = values.numel()
    edges = cdf(torch.arange(n + 1, dtype=torch.float64) / n)
    return DiscreteLaw(values.reshape(-1), edges[1:] - edges[:-1], labels.reshape(-1))


def _sigmoid_quantile(u: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sigmoid(scale * torch.special.ndtri(u))


def _time_shift(mu: float, s: torch.Tensor) -> torch.Tensor:
    """sd-scripts' ``time_shift(mu, 1, s)`` (flux_train_utils): e^μ / (e^μ + 1/s − 1)."""
    m = math.exp(mu)
    return m / (m + (1.0 / s - 1.0))


@dataclass(frozen=True)
class SigmaSampler:
    """A host σ sampler for one native latent grid.

    ``mode`` is sd-scripts' ``--timestep_sampling``; any mode not in ``LAW_MODES`` is the
    host's scheduler-grid path (``u`` from ``weighting_scheme``'s density, σ read off a
    ``FlowMatchEulerDiscreteScheduler`` grid shifted by ``discrete_flow_shift``).
    """

    mode: str = "sigmoid"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    num_train_timesteps: int = 1000

    @property
    def has_closed_form(self) -> bool:
        return self.mode in LAW_MODES

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw n σ (float32, CPU) with the host's formulas."""
        if self.mode == "uniform":
            return torch.rand(n, generator=generator)
        if self.mode == "nextdit_shift":
            return _time_shift(flux_mu(latent_hw), torch.rand(n, generator=generator).clamp(min=1e-7))
        if self.mode in ("sigmoid", "shift", "flux_shift"):
            s = torch.sigmoid(self.sigmoid_scale * torch.randn(n, generator=generator))
            if self.mode == "shift":
                k = self.discrete_flow_shift
                s = (s * k) / (1 + (k - 1) * s)
            elif self.mode == "flux_shift":
                s = _time_shift(flux_mu(latent_hw), s)
            return s
        u = self._density(n, generator)
        idx = (u * self.num_train_timesteps).long().clamp_(max=self.num_train_timesteps - 1)
        return self.scheduler_sigmas()[idx]

    def _density(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        if self.weighting_scheme == "logit_normal":
            return torch.sigmoid(torch.normal(self.logit_mean, self.logit_std, size=(n,), generator=generator))
        u = torch.rand(n, generator=generator)
        if self.weighting_scheme == "mode":
            u = 1 - u - self.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        return u

    def scheduler_sigmas(self) -> torch.Tensor:
        """The σ grid of diffusers' FlowMatchEulerDiscreteScheduler(shift) indexed like the host."""
        n = self.num_train_timesteps
        t = torch.linspace(1, n, n, dtype=torch.float32).flip(0)
        s = t / n
        k = self.discrete_flow_shift
        return k * s / (1 + (k - 1) * s)

    def cdf(self, x: float, latent_hw: tuple[int, int]) -> float:
        """P(σ <= x) in closed form (``LAW_MODES``)."""
        if not self.has_closed_form:
            raise ValueError(f"timestep_sampling={self.mode!r} has no closed form; use Monte Carlo")
        if x <= 0.0:
            return 0.0
        if x >= 1.0:
            return 1.0
        if self.mode == "uniform":
            return x
        if self.mode in ("flux_shift", "nextdit_shift"):
            x = 1.0 / (1.0 + math.exp(flux_mu(latent_hw)) * (1.0 / x - 1.0))
            if self.mode == "nextdit_shift":
                return x
        elif self.mode == "shift":
            k = self.discrete_flow_shift
            x = x / (k - (k - 1) * x)
        return _normal_cdf(_logit(x) / self.sigmoid_scale)

    def quantile(self, u: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        """The inverse of :meth:`cdf` (float64): σ = quantile(U) has the host's law for U uniform."""
        u = u.to(torch.float64)
        if self.mode in ("uniform", "nextdit_shift"):
            return u if self.mode == "uniform" else _time_shift(flux_mu(latent_hw), u)
        s = _sigmoid_quantile(u, self.sigmoid_scale)
        if self.mode == "shift":
            k = self.discrete_flow_shift
            return (s * k) / (1 + (k - 1) * s)
        return _time_shift(flux_mu(latent_hw), s) if self.mode == "flux_shift" else s

    def mass(self, lo: float, hi: float | None, latent_hw: tuple[int, int]) -> float:
        """P(lo < σ < hi) (``hi=None``: P(σ > lo)); the CDFs are continuous so strictness is free."""
        top = 1.0 if hi is None else self.cdf(hi, latent_hw)
        return max(0.0, top - self.cdf(lo, latent_hw))

    def law(self, latent_hw: tuple[int, int]) -> SigmaLaw | None:
        """This sampler's exact law on one grid: closed form, the scheduler grid's atoms, or None
        (a density without a closed-form CDF)."""
        if self.has_closed_form:
            return ContinuousLaw(lambda x: self.cdf(x, latent_hw), lambda u: self.quantile(u, latent_hw))
        grid = self.scheduler_sigmas()
        return grid_law(grid, grid * self.num_train_timesteps, self.weighting_scheme, self.logit_mean, self.logit_std)


def ddpm_alphas_cumprod(num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012) -> torch.Tensor:
    """ᾱ_t of the ``scaled_linear`` DDPM schedule SD1.x/SDXL train with."""
    betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def ddpm_t_to_sigma(t: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Flow-equivalent σ of a DDPM timestep by equal SNR: σ = √(1−ᾱ) / (√ᾱ + √(1−ᾱ))."""
    a = alphas_cumprod.to(torch.float64)[t.long().cpu()]
    s = torch.sqrt(1.0 - a)
    return (s / (torch.sqrt(a) + s)).to(torch.float32)


def sigma_to_ddpm_t(sigma: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ddpm_t_to_sigma`: the timestep whose flow σ is nearest (exact on the grid)."""
    grid = ddpm_t_to_sigma(torch.arange(len(alphas_cumprod)), alphas_cumprod)
    sigma = sigma.to(torch.float32).cpu()
    right = torch.searchsorted(grid, sigma).clamp(1, len(grid) - 1)
    left = right - 1
    pick_left = (sigma - grid[left]).abs() <= (grid[right] - sigma).abs()
    return torch.where(pick_left, left, right)


@dataclass(frozen=True)
class DdpmSampler:
    """SD1.x/SDXL: t uniform on [min_timestep, max_timestep) (sd-scripts' ``get_timesteps``), as flow σ.

    The distribution is discrete (one atom per timestep), so its window masses are exact counts.
    ``--zero_terminal_snr`` (a rescaled ᾱ) is not modelled.
    """

    min_timestep: int = 0
    max_timestep: int = 1000
    num_train_timesteps: int = 1000

    has_closed_form = True

    def grid(self) -> torch.Tensor:
        t = torch.arange(self.min_timestep, self.max_timestep)
        return ddpm_t_to_sigma(t, ddpm_alphas_cumprod(self.num_train_timesteps))

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
        t = torch.randint(self.min_timestep, self.max_timestep, (n,), generator=generator)
        return ddpm_t_to_sigma(t, ddpm_alphas_cumprod(self.num_train_timesteps))

    def mass(self, lo: float, hi: float | None, latent_hw: tuple[int, int]) -> float:
        g = self.grid()
        inside = g > lo if hi is None else (g > lo) & (g < hi)
        return float(inside.double().mean())

    def law(self, latent_hw: tuple[int, int]) -> DiscreteLaw:
        return ddpm_law(self.min_timestep, self.max_timestep, ddpm_alphas_cumprod(self.num_train_timesteps))


def ddpm_law(t_min: int, t_max: int, alphas_cumprod: torch.Tensor) -> DiscreteLaw:
    """``train_util.get_timesteps``' law: t uniform on [t_min, t_max), or t_max alone when the range is empty."""
    t = torch.arange(t_min, t_max) if t_min < t_max else torch.tensor([t_max])
    return DiscreteLaw(ddpm_t_to_sigma(t, alphas_cumprod), torch.full((t.numel(),), 1.0 / t.numel(), dtype=torch.float64), t)


def sd3_law(
    t_min: int, t_max: int, shift: float, scheme: str, dtype: torch.dtype, logit_mean: float = 0.0, logit_std: float = 1.0
) -> DiscreteLaw | None:
    """``sd3_train_utils.get_noisy_model_input_and_timesteps``' law: u' = s·u / (1 + (s − 1)·u), t = ⌊u'·(t_max − t_min)⌋ + t_min
    cast to ``dtype``, σ = t / 1000 in ``dtype``; atom k has F_u'((k + 1 − t_min)/span) − F_u'((k − t_min)/span)."""
    cdf = density_cdf(scheme, logit_mean, logit_std)
    if cdf is None:
        return None
    span = t_max - t_min
    y = torch.arange(span + 1, dtype=torch.float64) / span
    edges = cdf(y / (shift - (shift - 1.0) * y))  # F_u' via the inverse of the shift
    t = torch.arange(t_min, t_max).to(dtype)
    return DiscreteLaw((t / 1000).double(), edges[1:] - edges[:-1], t)
