"""Report text every front end shares: one percent format, one route listing and one line of FasterDiT
settings, so ``check``, ``plan``, the start banner and the end summary show them the same way."""

from __future__ import annotations

from collections.abc import Sequence

from .config import FasterDitConfig, RouteRule

ROUTE_HEADER = f"{'#':<4}{'route':<14}{'window':<16}{'span':<12}"


def pct(fraction: float) -> str:
    """A fraction as a percentage with one decimal (``0.146`` → ``"14.6 %"``)."""
    return f"{100.0 * fraction:.1f} %"


def route_rows(rules: Sequence[RouteRule]) -> list[str]:
    """One fixed-width row per rule, in priority order, under :data:`ROUTE_HEADER`: index, route
    (its name, else its edges), window, span; a report appends its own columns."""
    return [f"r{i:<3}{rule.label:<14}{rule.window_text():<16}{str(rule.span or '-'):<12}" for i, rule in enumerate(rules)]


def fasterdit_text(settings: FasterDitConfig) -> str:
    """The routed steps' settings as their TOML keys and values (``direction_loss_weight 0, ..., attention plain``)."""
    return (
        f"direction_loss_weight {settings.direction_loss_weight:g}, "
        f"direction_loss_only_routed {str(settings.direction_loss_only_routed).lower()}, "
        f"sigma_policy {settings.sigma_policy}, positions {settings.positions}, attention {settings.attention}"
    )
