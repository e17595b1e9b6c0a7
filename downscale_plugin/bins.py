"""The σ bin grid of a map: segmented bins covering (0, 1], plus σ = 1 as its own endpoint bin.

Why an endpoint bin: at σ = 1 the input is pure noise and the anchor study measured it as its own
estimand (it steps up above every window bin next to it), so a window may only stay open at the
top when σ = 1 itself was measured safe. Why segmented: the gap changes fast below σ ≈ 0.1 and in
the top decile, slowly on the plateau between, so the default grid resolves both ends (the anchor's
verdict grid ``0,0.1,4 : 0.1,0.9,6 : 0.9,1,4`` + endpoint: 14 bins + {1.0}).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

DEFAULT_BINS = "0,0.1,4:0.1,0.9,6:0.9,1,4"


@dataclass(frozen=True)
class SigmaBins:
    """Segmented bins ``(edges[i], edges[i+1]]`` and, when ``endpoint``, a last bin holding σ = 1 only."""

    edges: tuple[float, ...]
    endpoint: bool = True

    def __post_init__(self) -> None:
        e = self.edges
        if len(e) < 2:
            raise ValueError(f"bins: need at least two edges, got {list(e)}")
        if any(b <= a for a, b in pairwise(e)):
            raise ValueError(f"bins: edges must be strictly increasing, got {list(e)}")
        if e[0] != 0.0 or e[-1] != 1.0:
            raise ValueError(f"bins: edges must cover (0, 1]: first edge 0 and last edge 1, got {e[0]:g} .. {e[-1]:g}")

    @property
    def n_segmented(self) -> int:
        return len(self.edges) - 1

    def __len__(self) -> int:
        return self.n_segmented + int(self.endpoint)

    def is_endpoint(self, i: int) -> bool:
        return self.endpoint and i == self.n_segmented

    def bounds(self, i: int) -> tuple[float, float]:
        """(lo, hi) of bin i; the endpoint bin is (1, 1)."""
        if self.is_endpoint(i):
            return 1.0, 1.0
        return self.edges[i], self.edges[i + 1]

    def center(self, i: int) -> float:
        lo, hi = self.bounds(i)
        return 0.5 * (lo + hi)

    def label(self, i: int) -> str:
        if self.is_endpoint(i):
            return "σ=1"
        lo, hi = self.bounds(i)
        return f"({lo:.4g},{hi:.4g}]"

    def sigmas(self, i: int, jitter: list[float]) -> list[float]:
        """One σ per draw, stratified: draw k lies in the k-th of D equal slices of the bin.

        ``jitter`` holds one number in [0, 1) per draw (the caller seeds it). Interleaved halves
        (even / odd draws) then both span the whole bin, which the self-floor split relies on.
        """
        if self.is_endpoint(i):
            return [1.0] * len(jitter)
        lo, hi = self.bounds(i)
        d = len(jitter)
        return [lo + (k + u) / d * (hi - lo) for k, u in enumerate(jitter)]

    def spec(self) -> str:
        """The edges as the ``--bins`` list form, for provenance."""
        text = ",".join(f"{x:.12g}" for x in self.edges)
        return text + ("+1" if self.endpoint else "")


def parse_bins(text: str, endpoint: bool = True) -> SigmaBins:
    """Parse ``LO,HI,K:LO,HI,K:...`` (K equal bins per segment) or a plain edge list ``0,0.2,...,1``.

    A trailing ``+1`` on an edge list (the :meth:`SigmaBins.spec` form) also asks for the endpoint.
    """
    text = text.strip()
    if text.endswith("+1"):
        text, endpoint = text[:-2], True
    try:
        if ":" in text or text.count(",") == 2 and _is_segment(text):
            edges: list[float] = []
            for seg in text.split(":"):
                parts = seg.split(",")
                if len(parts) != 3:
                    raise ValueError(f"segment {seg!r} must be LO,HI,K (3 numbers, got {len(parts)})")
                lo_f, hi_f, k_i = _number(parts[0], seg), _number(parts[1], seg), _number(parts[2], seg, int)
                if k_i < 1:
                    raise ValueError(f"segment {seg!r}: K must be >= 1")
                if edges and abs(edges[-1] - lo_f) > 1e-12:
                    raise ValueError(f"segment {seg!r} starts at {lo_f:g} but the previous one ended at {edges[-1]:g}")
                step = (hi_f - lo_f) / k_i
                start = [lo_f] if not edges else []
                edges += start + [lo_f + step * (j + 1) for j in range(k_i - 1)] + [hi_f]
        else:
            edges = [_number(x) for x in text.split(",")]
    except ValueError as err:
        raise ValueError(f"bins: {text!r}: {err} (form 'LO,HI,K:LO,HI,K' or an edge list '0,0.25,0.5,1')") from None
    return SigmaBins(tuple(round(x, 12) for x in edges), endpoint)


def _number(text: str, segment: str | None = None, kind: type = float) -> float:
    """``kind(text)``; the ValueError names the text (and its segment), not Python's conversion."""
    try:
        return kind(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{text.strip()!r}{f' in segment {segment!r}' if segment else ''} is not {what}") from None


def _is_segment(text: str) -> bool:
    """A single ``LO,HI,K`` segment (K an integer > 1) rather than a three-edge list like ``0,0.5,1``."""
    k = text.split(",")[2].strip()
    return k.isdigit() and int(k) > 1
