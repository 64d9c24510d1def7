"""remat.reshard / remat.verify through the Rust resharder: layouts round trip byte for
byte, dry runs write nothing and predict the write, one-rank parts finalize."""

from __future__ import annotations

import os
import pathlib

import pytest

import remat

np = pytest.importorskip("numpy")
st = pytest.importorskip("safetensors.numpy")

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared"
FIXTURE = SHARED / "fixtures" / "torch-dcp-hf-w4"


def original():
    rng = np.random.default_rng(7)
    return {
        "embed.weight": rng.standard_normal((10, 3)).astype(np.float32),
        "norm.weight": rng.standard_normal(7).astype(np.float16),
        "step": np.array(12345, dtype=np.int64),
        "conv.weight": rng.integers(0, 255, (5, 4, 3), dtype=np.uint8),
        "mlp.up": rng.standard_normal((9, 6)).astype(np.float64),
    }


@pytest.fixture()
def source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    st.save_file(original(), str(src / "model.safetensors"))
    return src


def load_all(directory):
    """Every tensor of every .safetensors file in ``directory``."""
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            for key, value in st.load_file(str(pathlib.Path(directory) / name)).items():
                assert key not in tensors, f"{key} in two files of {directory}"
                tensors[key] = value
    return tensors


def test_layouts_round_trip_byte_for_byte(source, tmp_path):
    w3 = tmp_path / "remat-w3"
    report = remat.reshard(source, w3, 3)
    assert report["source_format"] == "hf" and report["source_world_size"] == 1
    assert report["tensors"] == 5 and report["world_size"] == 3 and report["files_written"] == 3
    assert report["summary"] == f"{source}: hf layout, 1 rank, 5 tensors, 1 -> 3 ranks (remat layout)"
    dcp2 = tmp_path / "dcp-w2"
    assert remat.reshard(w3, dcp2, 2, format="dcp")["source_format"] == "remat"
    whole = tmp_path / "hf"
    remat.reshard(dcp2, whole, 1, format="hf")
    back = load_all(whole)
    want = original()
    assert sorted(back) == sorted(want)
    for name, tensor in want.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert back[name].tobytes() == tensor.tobytes(), name
    for layout in (w3, dcp2, whole):
        v = remat.verify(source, layout)
        assert v["same"] and v["difference"] is None and v["tensors"] == 5, layout


def test_verify_names_the_first_difference(source, tmp_path):
    changed = original()
    changed["mlp.up"][4, 2] += 1.0
    other = tmp_path / "other"
    other.mkdir()
    st.save_file(changed, str(other / "model.safetensors"))
    v = remat.verify(source, other)
    assert not v["same"]
    d = v["difference"]
    assert d["tensor"] == "mlp.up" and d["element"] == [4, 2]
    assert d["message"].startswith(f"{source} and {other} differ: tensor `mlp.up` differs first at element [4, 2]")


def test_a_dry_run_writes_nothing_and_predicts_the_write(source, tmp_path):
    dst = tmp_path / "dst"
    dry = remat.reshard(source, dst, 3, format="dcp", dry_run=True, max_buffer="1MiB")
    assert not dst.exists()
    assert dry["dry_run"] and dry["max_buffer"] == 1 << 20 and dry["threads"] >= 1
    assert [r["rank"] for r in dry["ranks"]] == [0, 1, 2]
    assert 0 < dry["peak_buffer"] <= 1 << 20
    wrote = remat.reshard(source, dst, 3, format="dcp", max_buffer=1 << 20)
    assert wrote["ranks"] == dry["ranks"]
    on_disk = sum(os.path.getsize(dst / n) for n in os.listdir(dst) if n.endswith(".safetensors"))
    assert sum(r["bytes_written"] for r in dry["ranks"]) == on_disk


@pytest.mark.parametrize(
    "text, bytes_",
    [("1GB", 10**9), ("1gb", 10**9), ("1GiB", 1 << 30), ("1.5GB", 1_500_000_000), ("64k", 64_000)],
)
def test_max_buffer_units_mean_what_they_mean_everywhere(source, tmp_path, text, bytes_):
    # One meaning for every front end: GB is 10^9 bytes (`remat reshard --max-buffer` too).
    dry = remat.reshard(source, tmp_path / "dst", 3, dry_run=True, max_buffer=text)
    assert dry["max_buffer"] == bytes_


def test_placement_rules_and_presets_change_the_layout(source, tmp_path):
    default = remat.reshard(source, tmp_path / "a", 2, dry_run=True)["ranks"]
    replicated = remat.reshard(
        source, tmp_path / "b", 2, dry_run=True, place={"embed.*": "replicate"}
    )["ranks"]
    # embed.weight (10 x 3 f32) is written by both ranks instead of one, headers aside.
    grown = sum(r["bytes_written"] for r in replicated) - sum(r["bytes_written"] for r in default)
    assert grown >= 10 * 3 * 4
    simple = remat.reshard(source, tmp_path / "c", 2, preset="simple")
    assert simple["files_written"] == 2
    assert remat.verify(source, tmp_path / "c")["same"]


def test_one_rank_at_a_time_then_finalize(source, tmp_path):
    dst = tmp_path / "dst"
    for rank in range(3):
        r = remat.reshard(source, dst, 3, rank=rank)
        assert [s["rank"] for s in r["ranks"]] == [rank]
    done = remat.reshard(source, dst, 3, finalize=True)
    assert done["finalized"] and done["parts"] == 3
    assert remat.verify(source, dst)["same"]


def test_the_pytorch_dcp_fixture_reshards_to_its_consolidated_copy(tmp_path):
    if not FIXTURE.is_dir():
        pytest.skip(f"shared fixture {FIXTURE} is absent (../shared beside the checkout)")
    # Reads ../shared/fixtures/torch-dcp-hf-w4: a real PyTorch DCP checkpoint on 4 ranks.
    out = tmp_path / "w3"
    report = remat.reshard(FIXTURE, out, 3, format="dcp")
    assert report["source_format"] == "dcp" and report["source_world_size"] == 4
    assert [f for f, _ in report["skipped"]] == [str(FIXTURE / "full.safetensors")]
    v = remat.verify(out, FIXTURE / "full.safetensors")
    assert v["same"] and v["tensors"] == 9, v
