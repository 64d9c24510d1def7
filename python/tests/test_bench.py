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
    rows = {line.split()[1]: line for line in out.splitlines()
            if line.startswith("llama-")}
    assert {"none", "ckpt-block", "remat@0.9", "remat@0.8"} <= rows.keys(), out
    none_peak = float(rows["none"].split()[2])
    for key in ("remat@0.9", "remat@0.8"):
        fields = rows[key].split()
        assert fields[2] != "-", rows[key]
        # remat's measured activation peak is below the no-checkpoint one.
        assert float(fields[2]) < none_peak, out
    assert "capture" in out and "planning" in out


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench.main(["--models", "vgg"])
    with pytest.raises(SystemExit):
        bench.main(["--budgets", "1.5"])


@pytest.mark.slow
def test_compile_contender_runs():
    torch.set_num_threads(1)
    case = bench.llama(True)
    rows, _ = bench.bench_case(case, [0.5], 1, {"compile"})
    compiled = [r for r in rows if r.method == "compile@0.5"]
    assert compiled and compiled[0].peak > 0, rows
