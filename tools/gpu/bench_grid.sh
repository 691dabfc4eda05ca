#!/usr/bin/env bash
# bench_dflash.py on one GPU at Qwen3-8B shapes: the (anchors x seq x batch) grid for the variant
# train_dflash.py uses (compiled layers and loss chunk), then the headline shapes for the levers one
# at a time (baseline, compiled layers alone, loss chunks of 2048 and 8192 rows), and the eager
# against the compiled target's feature supply. The tables are appended to a copy of BENCHMARKS.md
# in OUT_DIR, the logs beside it.
#
#   bash tools/gpu/bench_grid.sh OUT_DIR      (about 20 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:?usage: bash tools/gpu/bench_grid.sh OUT_DIR}")
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
step grid 560 python3 bench_dflash.py --variant compile_layers+fused_ce_compiled --steps 4 --warmup 2 --budget_s 470 \
  --record-to "$OUT/BENCHMARKS.md"
step levers 380 python3 bench_dflash.py --quick --variant baseline --variant compile_layers --variant loss_chunk_2048 \
  --variant loss_chunk_8192 --budget_s 300 --record-to "$OUT/BENCHMARKS.md"
step target 400 python3 bench_dflash.py --quick --compile_target --variant compile_layers+fused_ce_compiled --budget_s 330 \
  --record-to "$OUT/BENCHMARKS.md"
grep -h "^| " "$OUT"/{grid,levers,target}.log | head -60
