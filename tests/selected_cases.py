"""Run a parametrized test's selected cases up front, in parallel: the statistical suites
(tests/test_marginal.py, tests/test_router.py) draw one long simulation per case."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Hashable, Sequence

import pytest


def run_selected_cases(
    request: pytest.FixtureRequest,
    test_name: str,
    params: Sequence[str],
    run: Callable[[tuple], object],
    order: Callable[[tuple], Hashable],
) -> dict[tuple, object]:
    """Run each case of ``test_name`` selected in this session once (its ``params`` values as the key),
    in ``order`` (slowest first, for an even split), on both cores where the platform can fork."""
    wanted = sorted(
        {
            tuple(item.callspec.params[p] for p in params)
            for item in request.session.items
            if getattr(item, "originalname", None) == test_name
        },
        key=order,
    )
    if "fork" in multiprocessing.get_all_start_methods() and len(wanted) > 1:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            results = pool.map(run, wanted, chunksize=1)
    else:
        results = [run(case) for case in wanted]
    return dict(zip(wanted, results, strict=True))
