from dataclasses import fields

import pytest
import torch

from downscale_plugin.accounting import Accounting, Counts, StepRecord
from downscale_plugin.config import RouteRule
from downscale_plugin.flops import FlopModel, predicted_saving
from downscale_plugin.plan import route_histogram
from downscale_plugin.router import RouteDecision

RULES = (RouteRule(0.65, 0.95, native=1024, target=768), RouteRule(0.5, None, native=1024, target=896))


def _macs_per_block(n: int, hidden: int, mlp_ratio: float) -> float:
    """Multiply-accumulates of one pre-norm transformer block on n tokens, counted matmul by matmul."""
    qkv = 3 * n * hidden * hidden
    scores = n * n * hidden  # QKᵀ over all heads
    mix = n * n * hidden  # AV
    out = n * hidden * hidden
    mlp = 2 * n * hidden * int(mlp_ratio * hidden)
    return qkv + scores + mix + out + mlp


def test_flop_model_coefficients_come_from_the_shape():
    m = FlopModel(hidden=64, depth=3, mlp_ratio=4.0, text_tokens=7)
    assert m.a == 2 * 3 * 64**2 * (4 + 8)
    assert m.b == 4 * 3 * 64
    for n_img in (1, 50, 300):
        n = n_img + 7
        assert m.flops(n_img) == pytest.approx(2 * 3 * _macs_per_block(n, 64, 4.0))
    assert FlopModel(64, 3, attention=False).flops(100) == pytest.approx(FlopModel(64, 3).a * 100)


def test_predicted_saving_of_a_known_histogram():
    m = FlopModel(hidden=128, depth=2)
    hist = {4096: 50.0, 2304: 30.0, 3136: 20.0}
    native = {4096: 100.0}
    expected = 1 - (50 * m.flops(4096) + 30 * m.flops(2304) + 20 * m.flops(3136)) / (100 * m.flops(4096))
    assert predicted_saving(hist, native, m) == pytest.approx(expected)
    assert predicted_saving(hist, native) == pytest.approx(1 - (50 * 4096 + 30 * 2304 + 20 * 3136) / 409600)
    # Quadratic attention makes the FLOP saving larger than the token saving.
    assert predicted_saving(hist, native, m) > predicted_saving(hist, native)
    assert route_histogram({-1: 0.5, 0: 0.3, 1: 0.2}, {-1: 4096, 0: 2304, 1: 3136}, weight=100) == pytest.approx(hist)


def _rec(step, rule_index, n=4, loss=None, fallback=None, resampled=0):
    tokens_run = {-1: 4096, 0: 2304, 1: 3136}[rule_index]
    label = "native" if rule_index < 0 else RULES[rule_index].label
    return StepRecord(step, rule_index, label, [0.5] * n, 4096, tokens_run, resampled, fallback, loss)


def _filled(model=None, records=None, **kwargs):
    acc = Accounting(RULES, model, {-1: 0.5, 0: 0.266, 1: 0.234}, **kwargs)
    for rec in records if records is not None else _steps():
        acc.record(rec)
    return acc


def _steps():
    routes = [-1, -1, 0, 1, -1, 0, -1, 1, -1, -1]
    return [_rec(i + 1, r, loss=0.1 * (r + 2), fallback="law_fill" if i == 4 else None, resampled=i % 3) for i, r in enumerate(routes)]


def test_accounting_fractions_histogram_and_saving():
    m = FlopModel(hidden=128, depth=2)
    acc = _filled(m, predicted_flop_saving=0.2)
    assert acc.fractions() == pytest.approx({-1: 0.6, 0: 0.2, 1: 0.2})
    assert acc.demote_fraction() == pytest.approx(0.4)
    assert acc.counts.fallbacks["law_fill"] == 1
    assert acc.hist_run == {4096: 24.0, 2304: 8.0, 3136: 8.0}
    assert acc.flop_saving() == pytest.approx(predicted_saving(acc.hist_run, acc.hist_native, m))
    assert acc.token_saving() == pytest.approx(predicted_saving(acc.hist_run, acc.hist_native))
    s = acc.scalars()
    assert s["downscale/frac/r0_1024-768"] == pytest.approx(0.2)
    assert s["downscale/frac_pred/native"] == pytest.approx(0.5)
    assert s["downscale/demote_frac_pred"] == pytest.approx(0.5)
    assert s["downscale/loss/r1_1024-896"] == pytest.approx(0.3)
    assert s["downscale/loss/native"] == pytest.approx(0.1)
    assert s["downscale/flop_saving_pred"] == 0.2
    assert s["downscale/fallback/law_fill"] == 1
    assert s["downscale/resampled_frac"] == pytest.approx(sum(i % 3 for i in range(10)) / 40)
    assert all(isinstance(v, float) for v in s.values())
    text = acc.summary_text()
    assert "r0 1024:768" in text and "law_fill 1" in text and "FLOP saving" in text and "predicted 50.0 %" in text


def test_loss_reported_after_the_step_goes_to_the_last_route():
    acc = Accounting(RULES, loss_window=2)
    acc.record(_rec(1, 0))
    acc.record_loss(1.0)
    acc.record(_rec(2, -1))
    acc.record_loss(3.0)
    for loss in (2.0, 4.0, 6.0):
        acc.record(_rec(3, 0))
        acc.record_loss(loss)
    s = acc.scalars()
    assert s["downscale/loss/r0_1024-768"] == pytest.approx(5.0)  # window of the last two
    assert s["downscale/loss/native"] == pytest.approx(3.0)
    assert "downscale/loss/r1_1024-896" not in s
    assert acc.counts.loss_sum[0] / acc.counts.loss_count[0] == pytest.approx(13.0 / 4)


def test_unknown_fallback_reason_counts_as_other():
    acc = Accounting(RULES)
    acc.record(_rec(1, -1, fallback="something new"))
    assert acc.counts.fallbacks == {"law_fill": 0, "lead_fill": 0, "other": 1}


def _assert_same(x: Accounting, y: Accounting, ignore: tuple[str, ...] = ()) -> None:
    sx, sy = x.state(), y.state()
    assert sx.keys() == sy.keys()
    for key in set(sx) - set(ignore):
        mine, theirs = sx[key], sy[key]
        if key == "window":
            mine, theirs = [v for pair in mine for v in pair], [v for pair in theirs for v in pair]
        assert mine == pytest.approx(theirs), key
    assert {k: v for k, v in x.scalars().items() if "rank" not in k} == pytest.approx(y.scalars())


def test_merge_equals_one_accounting_of_all_steps():
    m = FlopModel(hidden=64, depth=2)
    steps = _steps()
    a, b = _filled(m, steps[:4]), _filled(m, steps[4:])
    a.merge(b.state())
    _assert_same(a, _filled(m, steps))


def test_reduce_sums_ranks_through_the_hook():
    m = FlopModel(hidden=64, depth=2)
    steps = _steps()
    vocab = Accounting.vocabulary([(128, 128)], RULES, "flux", 0.1)
    assert vocab == [2304, 3136, 4096]
    ranks = [_filled(m, steps[:3], token_values=vocab), _filled(m, steps[3:], token_values=vocab)]
    vectors = [torch.tensor(r._vector(), dtype=torch.float64) for r in ranks]
    seen = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.dtype)
        return sum(vectors)

    out = ranks[0].reduced(all_reduce)
    assert seen == [torch.float64]
    assert out.histogram_complete
    _assert_same(out, _filled(m, steps, token_values=vocab), ignore=("ranks",))  # one accounting compares no ranks
    assert out.summary_text().replace(_ranks_line(out), "") == _filled(m, steps).summary_text()


def _ranks_line(acc: Accounting) -> str:
    return "\n" + next(line for line in acc.summary_text().splitlines() if "ranks ran different routes" in line)


def test_reduce_counts_steps_where_ranks_ran_different_routes():
    # two ranks, three steps each reduced after it is recorded: same route, different routes, same route
    a, b = Accounting(RULES), Accounting(RULES)
    for ra, rb in ((0, 0), (1, -1), (-1, -1)):
        a.record(_rec(1, ra))
        b.record(_rec(1, rb))
        votes = torch.tensor(a._vector(), dtype=torch.float64) + torch.tensor(b._vector(), dtype=torch.float64)
        totals = [acc.reduced(lambda _t, votes=votes: votes) for acc in (a, b)]
    assert [(t.compared, t.disagreed) for t in totals] == [(3, 1), (3, 1)]
    assert a.reduced(lambda t: t).compared == 3  # no step since the last reduction: nothing new to compare
    assert totals[0].scalars()["downscale/rank_disagree_frac"] == pytest.approx(1 / 3)
    assert "ranks ran different routes on 1 of 3 steps (33.3 %" in totals[0].summary_text()
    assert "ranks ran" not in Accounting(RULES).summary_text()


def test_reduce_flags_a_histogram_outside_the_layout():
    acc = _filled(token_values=[4096])
    out = acc.reduced(lambda t: t)
    assert not out.histogram_complete
    assert out.hist_run == acc.hist_run
    assert out.fractions() == acc.fractions()
    assert "this rank only" in out.summary_text()


def test_record_from_a_router_decision():
    d = RouteDecision(0, RULES[0], torch.tensor([0.7, 0.8]), (96, 96), resampled=1)
    rec = StepRecord.from_decision(5, d, (128, 128), "flux", loss=0.25)
    assert (rec.rule_index, rec.route, rec.tokens_native, rec.tokens_run, rec.resampled) == (0, "1024:768", 4096, 2304, 1)
    assert rec.sigmas == pytest.approx([0.7, 0.8])
    native = StepRecord.from_decision(6, RouteDecision(-1, None, torch.tensor([0.1]), None, fallback="law_fill"), (128, 128), "flux")
    assert (native.rule_index, native.route, native.tokens_run, native.fallback) == (-1, "native", 4096, "law_fill")


def test_drawn_and_run_sigma_of_routed_samples_are_kept_apart_and_summed_over_ranks():
    m = FlopModel(hidden=64, depth=2)
    d = RouteDecision(0, RULES[0], torch.tensor([0.7, 0.8], dtype=torch.float64), (96, 96))
    native = RouteDecision(-1, None, torch.tensor([0.2, 0.3], dtype=torch.float64), None)
    recs = [
        StepRecord.from_decision(1, d, (128, 128), "flux", run_sigmas=torch.tensor([0.6, 0.7], dtype=torch.float64)),
        StepRecord.from_decision(2, d, (128, 128), "flux", run_sigmas=d.sigmas),  # keep: the decision's own σ
        StepRecord.from_decision(3, native, (128, 128), "flux", run_sigmas=native.sigmas),
    ]
    assert recs[0].sigmas_run == pytest.approx([0.6, 0.7]) and recs[0].sigmas == pytest.approx([0.7, 0.8])
    assert recs[1].run_sigmas is None and recs[1].sigmas_run == recs[1].sigmas

    def filled(records):
        acc = Accounting(RULES, m, sigma_policy="res_shift", token_values=[2304, 4096])
        for rec in records:
            acc.record(rec)
        return acc

    one = filled(recs)
    assert (one.counts.sigma_drawn, one.counts.sigma_run) == pytest.approx((3.0, 2.8))  # routed samples only
    assert one.scalars()["downscale/sigma_drawn_routed_mean"] == pytest.approx(0.75)
    assert one.scalars()["downscale/sigma_run_routed_mean"] == pytest.approx(0.7)
    assert "σ policy res_shift: routed samples drawn at mean σ 0.7500, run at 0.7000" in one.summary_text()
    ranks = [filled(recs[:1]), filled(recs[1:])]
    vectors = [torch.tensor(r._vector(), dtype=torch.float64) for r in ranks]
    reduced = ranks[0].reduced(lambda t: sum(vectors))
    _assert_same(reduced, one, ignore=("ranks",))
    assert reduced.summary_text().replace(_ranks_line(reduced), "") == one.summary_text()
    ranks[0].merge(ranks[1].state())
    _assert_same(ranks[0], one, ignore=("ranks",))  # ranks[0] compared its step in reduced()
    keep = Accounting(RULES, m)
    keep.record(recs[1])
    assert "σ policy keep: routed samples drawn at mean σ 0.7500, run at 0.7500" in keep.summary_text()
    assert "downscale/sigma_run_routed_mean" not in keep.scalars()


def test_every_counter_survives_state_merge_and_reduce():
    """All :class:`Counts` fields travel through ``state``/``merge`` and the rank reduction, so a
    counter added to the dataclass cannot be left out of either."""
    acc = Accounting(RULES)
    values = iter(range(1, 1000))
    for f in fields(Counts):
        value = getattr(acc.counts, f.name)
        if isinstance(value, list):
            setattr(acc.counts, f.name, [float(next(values)) for _ in value])
        elif isinstance(value, dict):
            setattr(acc.counts, f.name, {key: float(next(values)) for key in value})
        else:
            setattr(acc.counts, f.name, float(next(values)))
    merged = Accounting(RULES)
    merged.merge(acc.state())
    assert merged.counts == acc.counts == acc.reduced(lambda t: t).counts
    assert set(acc.state()) >= {f.name for f in fields(Counts)}
