#!/usr/bin/env bash
# Long samples on one GPU at Qwen3-8B shapes (bench_dflash.py --long): the target's forward per sample
# and the drafter's training step (512 anchors, batch 1, compiled layers and loss as train_dflash.py
# trains) at 3,072 / 4k / 8k / 16k / 32k / 64k tokens per sample, with 5 full-attention drafter layers
# and with 4 sliding-window (2,048) + 1 full; then the memory levers (--context_chunk_size 8192,
# --checkpoint_drafter_layers) at 32k and 64k. The tables are appended to a copy of BENCHMARKS.md in
# OUT_DIR; every finished row is in OUT_DIR/long_rows.jsonl.
#
#   bash tools/gpu/long_samples.sh OUT_DIR [ROWS]      (one call of at most 9 minutes)
#   TINY=1 bash tools/gpu/long_samples.sh OUT_DIR      (the same steps on a CPU: tiny config, 96-512 tokens)
#
# Resumable: a row that would start after ~7.5 minutes is left for the next call. Give that call the
# long_rows.jsonl the last one wrote (copied into the working tree, e.g. results/long-samples/long_rows.jsonl)
# as ROWS: its rows are kept, and only the missing ones run (the compile cache is cold on a fresh machine,
# so each call costs the compiles of the shapes it runs: ~20-40 s per new length).
#
# PREDICTIONS, written before any GPU run (H200; formulas below; the 3,072 row measured 148.8 ms and
# 31.3 GB on 2026-12-04, the target 95 ms at 450 TFLOP/s, BENCHMARKS.md):
#   drafter ms/sample = 118 (the block stream and the head: per anchor, constant in the length)
#                     + flex attention FLOPs / 200 TFLOP/s (pairs = 512 x 16 x mean anchor ~ 9S/16 per
#                       full layer; ~2,048 per query in a sliding layer)
#                     + context fc and K/V (0.59 GFLOP per token) / 450 TFLOP/s
#                     + mask builds (5.7 ms at 3,072, growing with S + 8,192; two with sliding layers)
#   peak GB           = 31.3 + (S - 3,072) x 145 KB (features 40 KB, hidden_norm 32 KB, 5 layers' K/V
#                       and k_norm / RoPE intermediates 72 KB; bench_dflash.context_bytes_per_token);
#                       82 KB per token with --context_chunk_size
#   target ms/sample  = linear FLOPs / 450 TFLOP/s + causal attention FLOPs / 400 TFLOP/s (34 layers)
#   target peak GB    = 15.6 (34 of 36 layers) + S x 140 KB (its 5 captured layer outputs 40 KB, the
#                       MLP's transients)
#
#   tokens | full: ms/sample (x 3,072) | 4 sliding + 1 full | peak GB (chunked) | target ms | target GB | both ms
#    3,072 | 145 (1.00x)               | 149                | 31.3 (31.3)       |    96     | 16.0      |   241
#    4,096 | 153 (1.03x)               | 154                | 31.4 (31.4)       |   131     | 16.2      |   284
#    8,192 | 184 (1.23x)               | 171                | 32.0 (31.7)       |   286     | 16.7      |   469
#   16,384 | 245 (1.64x)               | 199                | 33.2 (32.4)       |   665     | 17.9      |   909
#   32,768 | 367 (2.47x)               | 256                | 35.6 (33.7)       | 1,703     | 20.2      | 2,070
#   65,536 | 612 (4.11x)               | 369                | 40.4 (36.4)       | 4,901     | 24.8      | 5,513
# So: the drafter's 32k sample costs ~2.5x its 3,072 one (goal <= 4x), and 64k fits an H200 (and an
# H100) with room: nothing of the drafter's step blows up once the anchors are a fixed count per sample.
# The sliding layout gains past 8k (its 4 windowed layers' attention stops growing): ~1.4x faster at 32k.
# The target's forward grows faster than the drafter's step (its attention is quadratic): from 0.4x of
# the drafter's time at 3,072 to ~4.6x at 32k, so colocated, a 32k sample costs ~8.6x a 3,072 one
# (~0.8x per token). --checkpoint_drafter_layers: -3 to -6 GB, +20-30% drafter time;
# --context_chunk_size 8192: -2 GB at 32k, -4 GB at 64k, +2-4% drafter time.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:?usage: bash tools/gpu/long_samples.sh OUT_DIR [ROWS]}")
mkdir -p "$OUT"
if [[ ${TINY:-0} == 1 ]]; then
  export ROOT=$OUT/root
  mode=(--device cpu --tiny) levers=(--long_lengths 256,512 --variant baseline+context_chunk_64 --variant baseline+checkpoint_layers)
else
  mode=() levers=(--long_lengths 32768,65536 --variant compile_layers+fused_ce_compiled+context_chunk_8192
                  --variant compile_layers+fused_ce_compiled+checkpoint_layers)
fi
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
rows=$OUT/long_rows.jsonl
[[ -n ${2:-} && ! -f $rows ]] && cp "$2" "$rows"
# Each step stops starting rows at --budget_s; the step's cap leaves time for the running row.
start=$(date +%s)
left() { echo $((${1} - ($(date +%s) - start))); }
step long 510 python3 bench_dflash.py --long "${mode[@]}" --rows "$rows" --steps 3 --warmup 1 --budget_s 400 --record-to "$OUT/BENCHMARKS.md"
if (( $(left 450) > 60 )); then
  step long_levers $(left 530) python3 bench_dflash.py --long "${mode[@]}" --rows "$rows" --drafter_only --long_layouts all_full \
    "${levers[@]}" --steps 3 --warmup 1 --budget_s $(left 450) --record-to "$OUT/BENCHMARKS.md"
fi
grep -h "^| \|not run" "$OUT"/long*.log | tail -40
