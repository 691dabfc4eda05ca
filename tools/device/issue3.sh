#!/usr/bin/env bash
# Device run for issue 3: the compile race on torch 2.11 + CUDA, cold caches.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
cp BENCHMARKS.md $OUT/BENCHMARKS.md
L=/tmp/racelogs; mkdir -p $L
python3 bench_compile_race.py race --pattern ours --runs 5 --timeout 150 --log-dir $L --record-to $OUT/BENCHMARKS.md 2>&1 | tail -15
python3 bench_compile_race.py race --pattern ours --runs 1 --timeout 150 --loss-checkpoint nonreentrant --log-dir $L --record-to $OUT/BENCHMARKS.md 2>&1 | tail -6
python3 bench_compile_race.py race --pattern naive --runs 1 --timeout 150 --log-dir $L --record-to $OUT/BENCHMARKS.md 2>&1 | tail -6
timeout 120 python3 bench_compile_race.py checkpoint --record-to $OUT/BENCHMARKS.md 2>&1 | tail -8
timeout 60 python3 bench_compile_race.py mask --record-to $OUT/BENCHMARKS.md 2>&1 | tail -5
tar czf $OUT/racelogs.tgz -C /tmp racelogs
