#!/bin/bash
# The CUDA checks of issue 28, for a machine with a GPU, torch and transformers (the device
# tool's machines have them; CI has no GPU and never runs this). Run from the repository
# root after building the extension here:
#   (cd python && maturin build --release -o /tmp/wheels) &&
#   unzip -o -j /tmp/wheels/remat-*.whl 'remat/_native*' -d python/remat/ &&
#   strip python/remat/_native.abi3.so        # about 7 MiB, ignored by git: carry it
# then, on the GPU machine: `OUT=<dir> LARGE_S=240 bash scripts/cuda_checks.sh`.
# Writes env.txt, cuda_tests.txt and (LARGE_S > 0) bench_large.txt under $OUT.
set -u
OUT=${OUT:-/tmp/remat-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
S=$(date +%s)
stamp() { echo "## $1 at +$(( $(date +%s) - S )) s"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys,torch,transformers;print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "import remat._native, remat.torch; print('remat imports')"; } 2>&1 | tee "$OUT/env.txt"
stamp tests
timeout "${TESTS_S:-150}" python3 -m pytest -q -m cuda python/tests/test_auto_cuda.py \
  -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1
tail -5 "$OUT/cuda_tests.txt"
if [ "${LARGE_S:-0}" -gt 0 ]; then
  stamp large-bench
  timeout "$LARGE_S" python3 -m remat.bench --device cuda --models llama-large --autocast bf16 \
    --budgets 0.5,0.3 --methods "${LARGE_METHODS:-ckpt,offload,remat}" --runs 3 \
    --time-limit 5 > "$OUT/bench_large.txt" 2>&1
  grep -v Warn "$OUT/bench_large.txt" | tail -40
fi
stamp end
