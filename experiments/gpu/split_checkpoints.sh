#!/usr/bin/env bash
# Split mode's safety on 2 GPUs under NCCL, with a small random Qwen3 target (8 layers, hidden 1024):
#   checkpoints  one target rank + one drafter rank, a checkpoint at steps 10 and 20 (the target rank
#                joins DeepSpeed's world barriers), then a resume from step 10 with --target_ranks auto
#                (it must keep the checkpoint's split): the two final drafters must match
#   killed rank  the target rank is SIGKILLed mid-run, without torchrun's agent (which would kill the
#                drafter itself): the drafter rank sits in an NCCL receive that never errors, and only
#                the heartbeat can stop it (expected: exit 1 within about 45 s)
# Results in OUT_DIR/summary.txt, logs beside it.
#
#   bash experiments/gpu/split_checkpoints.sh OUT_DIR      (about 4 minutes on 2 H200s)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:?usage: bash experiments/gpu/split_checkpoints.sh OUT_DIR}")
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
W=$ROOT/shaped
python3 experiments/gpu/shaped_targets.py "$W" "$DATA_DIR/gsm8k/train.jsonl"
args=(--target_model "$W/small" --target_random_init --train_data "$W/conv8.jsonl" --max_samples 400 --max_seq_length 768
      --per_device_batch_size 2 --num_anchors 128 --logging_steps 5 --attention_backend flex --report_to none --num_proc 8)
launch=(accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py)
step checkpoints 240 "${launch[@]}" "${args[@]}" --max_steps 20 --save_steps 10 --target_ranks 1 --output_dir "$OUT/straight"
step resume 240 "${launch[@]}" "${args[@]}" --max_steps 20 --save_steps 10 --target_ranks auto \
  --resume_from_checkpoint "$OUT/straight/checkpoint-10" --output_dir "$OUT/resumed"
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import sys
from safetensors.torch import load_file
out = sys.argv[1]
a, b = load_file(f"{out}/straight/final/model.safetensors"), load_file(f"{out}/resumed/final/model.safetensors")
print("resumed vs straight, max |diff| over the drafter's weights:", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
PY
python3 - "$OUT" "${args[@]}" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import os, signal, socket, subprocess, sys, time
from datetime import timedelta
import torch.distributed as dist
out, args = sys.argv[1], sys.argv[2:] + ["--output_dir", f"{sys.argv[1]}/killed", "--num_train_epochs", "50", "--save_steps", "0",
                                         "--logging_steps", "1", "--target_ranks", "1"]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
procs = [subprocess.Popen([sys.executable, "train_dflash.py", *args], stdout=open(f"{out}/killed_rank{r}.log", "w"),
                          stderr=subprocess.STDOUT, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True"))
         for r in range(2)]
log, started = f"{out}/killed/train_log.jsonl", time.time()
while not (os.path.exists(log) and len(open(log).readlines()) >= 5):
    if time.time() - started > 180 or any(p.poll() is not None for p in procs):
        print("killed rank: training did not start", [p.poll() for p in procs]); break
    time.sleep(0.5)
procs[0].send_signal(signal.SIGKILL); killed = time.time()
try:
    code = procs[1].wait(timeout=90)
    print(f"killed rank: target rank SIGKILLed, drafter rank exited {code} after {time.time() - killed:.0f} s")
except subprocess.TimeoutExpired:
    print("killed rank: drafter rank still running 90 s after the target rank died"); procs[1].kill()
PY
tail -3 "$OUT/killed_rank1.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
