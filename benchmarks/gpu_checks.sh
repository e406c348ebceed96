#!/usr/bin/env bash
# One device command that checks what the CPU cannot (run on a lent GPU from the repository root; results under
# $OUT, or ./gpu_checks when $OUT is unset): the CUDA tests of the captured path, then the grid's groups that
# crashed before the cuBLAS-workspace fix (step_graph.CudaGraphs.capture), then the EAGLE-3 arms (sampled ones
# crashed the same way). Each part has its own time limit, so that a hang in one leaves the others' results.
#   bash benchmarks/gpu_checks.sh
set -uo pipefail
out="${OUT:-gpu_checks}"
mkdir -p "$out"
export PYTHONPATH=.
timeout 150 python -m pytest -q -m requires_cuda --tb=short tests/core/test_step_graph.py tests/core/test_model_changes.py \
  tests/core/test_captured_threads.py > "$out/cuda_tests.log" 2>&1
echo "cuda tests rc=$? $(tail -1 "$out/cuda_tests.log")"
timeout 240 python benchmarks/bench_gpu_grid.py --groups 8b-tuned 8b-depth --rounds 3 "$out/grid_depth.json" \
  > "$out/grid_depth.log" 2>&1
echo "grid 8b-tuned + 8b-depth rc=$?"
grep '^{"id"' "$out/grid_depth.log"
timeout 180 python benchmarks/bench_gpu_default.py --part eagle3 --rounds 3 --out "$out/eagle3.json" > "$out/eagle3.log" 2>&1
echo "eagle3 rc=$?"
tail -5 "$out/eagle3.log"
