#!/usr/bin/env bash
# The README's two install paths, as a user runs them, checked end to end:
#   1. `cargo install --path crates/remat-cli`: the binary installs, runs, and stays small
#      (the release profile keeps line tables only; MAX_BINARY_MIB is the line we hold).
#   2. The Python package: maturin builds the wheel, and a fresh virtual environment with no
#      Rust toolchain on PATH installs it from that file alone and plans in process; the
#      wheel's metadata says what `pip install "./python[torch]"` pulls.
# Usage: scripts/check_install.sh PYTHON   (an interpreter whose environment has maturin)
# Reuses the workspace's target/ (or $CARGO_TARGET_DIR) so that nothing is compiled twice.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${1:?usage: scripts/check_install.sh PYTHON (an interpreter with maturin)}
max_binary_mib=40
work=$(mktemp -d "${TMPDIR:-/tmp}/remat-install.XXXXXX")
trap 'rm -rf "$work"' EXIT

# ---- 1. the binary --------------------------------------------------------------------
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo install --quiet --locked --path crates/remat-cli \
  --root "$work/cargo-root"
binary="$work/cargo-root/bin/remat"
"$binary" --version
size=$(stat -c %s "$binary")
echo "remat binary: $((size / 1024 / 1024)) MiB (at most $max_binary_mib MiB)"
if (( size > max_binary_mib * 1024 * 1024 )); then
  echo "error: the installed remat binary is $size bytes, over $max_binary_mib MiB" >&2
  exit 1
fi

# ---- 2. the wheel, in a fresh environment without Rust ----------------------------------
bin_dir=$(dirname "$python")
(cd python && PATH="$bin_dir:$PATH" "$python" -m maturin build --quiet --release \
  -o "$work/wheels")
wheel=$(ls "$work"/wheels/remat-*.whl)
"$python" - "$wheel" <<'EOF'
import sys, zipfile
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [l for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
wanted = {"torch": False, "numpy": False}
for line in requires:
    for name in wanted:
        marker = line.replace("'", '"')
        if line.split(":", 1)[1].strip().startswith(name) and 'extra == "torch"' in marker:
            wanted[name] = True
missing = [name for name, found in wanted.items() if not found]
if missing:
    sys.exit(f"error: the wheel's [torch] extra does not pull {missing}: {requires}")
print("wheel:", wheel.rsplit("/", 1)[-1], "| [torch] extra:", ", ".join(wanted))
EOF
python3 -m venv "$work/fresh"
# No cargo, rustc or maturin on this PATH: the wheel must install from the file alone.
clean_path=/usr/local/bin:/usr/bin:/bin
for tool in cargo rustc maturin; do
  if PATH=$clean_path command -v "$tool" >/dev/null; then
    echo "error: $tool is on the clean PATH ($clean_path); the check would prove nothing" >&2
    exit 1
  fi
done
PATH=$clean_path "$work/fresh/bin/pip" install --quiet --no-index "$wheel"
(cd "$work" && PATH=$clean_path "$work/fresh/bin/python" - <<'EOF'
import json, remat
# A training step of an eight-layer chain in remat's graph format, planned in process.
layers = 8
nodes = [{"name": f"f{i}", "phase": "forward", "compute_time": 10.0, "output_bytes": 1 << 20,
          "inputs": [i - 1] if i else []} for i in range(layers)]
nodes.append({"name": "loss", "phase": "backward", "compute_time": 1.0, "output_bytes": 8,
              "inputs": [layers - 1]})
for i in reversed(range(layers)):
    nodes.append({"name": f"b{i}", "phase": "backward", "compute_time": 20.0,
                  "output_bytes": 1 << 20, "inputs": [len(nodes) - 1] + ([i - 1] if i else [])})
graph = {"format": "remat-graph", "version": 1, "name": "chain", "time_unit_s": 1e-6,
         "static_bytes": 4096, "nodes": nodes}
plan = remat.plan(json.dumps(graph), 0.6)
assert plan.peak_bytes <= plan.budget_bytes, (plan.peak_bytes, plan.budget_bytes)
print("imported remat from", remat.__file__)
print(plan)
EOF
)
echo "install paths: ok"
