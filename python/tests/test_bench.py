"""python -m remat.bench: a quick run of the table (tiny Llama, no torch.compile)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from remat import bench  # noqa: E402


def test_live_bytes_counts_storages_not_views():
    live = bench.LiveBytes()
    a = torch.empty(1000, dtype=torch.float32)
    live.record(a)
    live.record(a.view(10, 100))  # same storage: no new bytes
    assert live.live == 4000
    b = torch.empty(10, dtype=torch.float64)
    live.record(b)
    assert live.peak == 4080
    del a
    live.record(None)
    assert live.live == 80 and live.peak == 4080
    # Storages from before the step (parameters) are not the step's, even through views.
    weight = torch.empty(100)
    live = bench.LiveBytes({weight.untyped_storage().data_ptr()})
    live.record(weight.t())
    assert live.live == 0


def test_small_run_prints_a_table_with_every_contender(capsys):
    torch.set_num_threads(1)
    code = bench.main(["--small", "--models", "llama", "--budgets", "0.9,0.8",
                       "--methods", "ckpt,remat", "--runs", "1"])
    assert code == 0
    out = capsys.readouterr().out
    table = out.split("at equal measured memory")[0]
    rows = {line.split()[1]: line for line in table.splitlines()
            if line.startswith("llama-") and len(line.split()) > 2}
    assert {"none", "ckpt-block", "remat=ckpt-block", "remat@0.9", "remat@0.8"} <= rows.keys(), out
    none_peak = float(rows["none"].split()[2])
    for key in ("remat@0.9", "remat@0.8", "remat=ckpt-block"):
        fields = rows[key].split()
        assert fields[2] != "-", rows[key]
        # remat's measured activation peak is below the no-checkpoint one.
        assert float(fields[2]) < none_peak, out
    # The equal-memory row holds no more than the contender it is paired with.
    assert float(rows["remat=ckpt-block"].split()[2]) <= float(rows["ckpt-block"].split()[2]), out
    assert "bound" in rows["remat=ckpt-block"], out
    assert "capture" in out and "planning" in out
    assert "at equal measured memory" in out and "llama-2x128: remat " in out, out


def test_rounds_interleave_contenders_and_drop_the_warm_up():
    order = []

    def contender(name):
        return bench.Contender(name, lambda: order.append(name))

    cs = [contender("a"), contender("b"), contender("c")]
    bench.time_interleaved(cs, 2, torch.device("cpu"))
    assert all(len(c.times) == 2 for c in cs)
    # One step of each per round, the starting contender rotating.
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_ratios_are_medians_of_per_round_ratios():
    # Round 2 ran slow for both (machine drift): the paired ratio does not see it.
    ratio, spread = bench._median_ratio([1.0, 4.0, 1.2, 0.8], [2.0, 8.0, 2.0, 2.0])
    assert ratio == 0.5 and spread == pytest.approx(0.05)


def _row(method, peak, step_s, pair=None, pair_ratio=float("nan"), spread=0.0):
    return bench.Row("m", method, peak, step_s, pair=pair, pair_ratio=pair_ratio,
                     pair_spread=spread)


def test_verdict_needs_no_more_memory_and_no_slower_step():
    base = [_row("none", 100, 1.0), _row("ckpt-block", 50, 1.3)]
    lines, met = bench.pairing_verdicts(base + [_row("remat=ckpt-block", 49, 1.1, "ckpt-block",
                                                     0.85, 0.05)])
    assert met == {"m": True} and "SLOWER" not in lines[0]
    # Slower beyond the noise.
    lines, met = bench.pairing_verdicts(base + [_row("remat=ckpt-block", 49, 1.5, "ckpt-block",
                                                     1.15, 0.05)])
    assert met == {"m": False} and "SLOWER" in lines[0]
    # Slower, but within the noise.
    _, met = bench.pairing_verdicts(base + [_row("remat=ckpt-block", 49, 1.35, "ckpt-block",
                                                 1.04, 0.05)])
    assert met == {"m": True}
    # More memory than the contender.
    lines, met = bench.pairing_verdicts(base + [_row("remat=ckpt-block", 51, 1.0, "ckpt-block",
                                                     0.8, 0.05)])
    assert met == {"m": False} and "(>)" in lines[0]
    # Infeasible: reported, and not a success.
    lines, met = bench.pairing_verdicts(base + [bench.Row("m", "remat=ckpt-block", 0, 0.0,
                                                          "infeasible: below the floor")])
    assert met == {"m": False} and "infeasible" in lines[0]


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench.main(["--models", "vgg"])
    with pytest.raises(SystemExit):
        bench.main(["--budgets", "1.5"])
    with pytest.raises(SystemExit):
        bench.main(["--runs", "0"])


@pytest.mark.slow
def test_compile_contender_runs():
    torch.set_num_threads(1)
    case = bench.llama(True)
    rows, _ = bench.bench_case(case, [0.5, 0.1], 1, {"compile"})
    compiled = {r.method: r for r in rows if r.method.startswith("compile@")}
    assert compiled["compile@0.5"].peak > 0, rows
    # Each compiled step keeps its own budget, though both are timed in the same rounds.
    assert compiled["compile@0.1"].peak < compiled["compile@0.5"].peak, rows
