#!/usr/bin/env bash
# The compile-race check on one GPU (requirements installed): cold naive runs, expected to
# reproduce the race (FX-tracing error or a hang past 90 s): 3 as users write it (torch.compile's
# default dynamic shapes) and, beside them, 3 with dynamic=False (one static graph per length); the
# attention layer is not checkpointed, so each thread compiles its forward with grad (see
# tools/gpu/bench_compile_race.py for why that can deadlock). Then 10 cold runs of the trainer's locked
# compile path, expected clean (5 compiling at once are slower, hence its longer cutoff). Logs and
# a BENCHMARKS.md with the tables go to $1.
#   bash tools/gpu/compile_race.sh OUTPUT_DIR      (about 4 minutes on an H200)
set -uo pipefail  # a run that reproduces the race is not a script failure
out=$(realpath -m "${1:?usage: bash tools/gpu/compile_race.sh OUTPUT_DIR}")
cd "$(dirname "$0")/../.."
source tools/gpu/setup.sh  # staging only: every run compiles into a fresh cache dir of its own
mkdir -p "$out/logs" "$out/logs1"
cp BENCHMARKS.md "$out/BENCHMARKS.md"
python3 tools/gpu/bench_compile_race.py race --pattern naive --runs 3 --parallel 3 --timeout 90 \
  --log-dir "$out/logs" --record-to "$out/BENCHMARKS.md" > "$out/naive.txt" 2>&1 &
python3 tools/gpu/bench_compile_race.py race --pattern naive --runs 3 --parallel 3 --timeout 90 --naive-dynamic false \
  --log-dir "$out/logs1" --record-to "$out/BENCHMARKS.md" > "$out/naive_static.txt" 2>&1 &
wait
cat "$out/naive.txt" "$out/naive_static.txt"
python3 tools/gpu/bench_compile_race.py race --pattern ours --runs 10 --parallel 5 --timeout 240 \
  --log-dir "$out/logs" --record-to "$out/BENCHMARKS.md" 2>&1 | tee "$out/ours.txt"
