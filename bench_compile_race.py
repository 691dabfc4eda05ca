"""Reproduce the flex_attention compile race of DESIGN §3 on one GPU, and measure what issue 3 asks to measure.

Each `race` run is a fresh process on a fresh, cold TORCHINDUCTOR_CACHE_DIR. Three threads start
together, each doing training steps: an attention layer (flex_attention with the anchor BlockMask,
inside activation checkpointing), a chunked LM-head cross-entropy under activation checkpointing,
and the backward (on CUDA autograd runs it in its own device thread). Patterns:

    naive      a plain per-device `torch.compile(flex_attention)`, built and called lazily by
               whichever thread comes first, no locks (the code the project started from)
    ours       dflash_model's path: setup_compile_cache, warm_up_flex_attention in the main thread
               (compile + forward/backward warm-up under the compile locks), then the threads
    ours-lazy  dflash_model's locks only, no warm-up: threads hit the first-seen shapes themselves

A run that does not finish within --timeout seconds is killed and counted as a timeout (the naive
pattern hangs on torch 2.11). Results are printed as a table and appended to BENCHMARKS.md.

    # on one H200, torch 2.11; each run is a cold compile (a minute or two), so split the runs
    # over commands that each fit a 10-minute limit. On a machine whose working tree does not come
    # back, append to a copy: cp BENCHMARKS.md $OUT/; ... --record-to $OUT/BENCHMARKS.md
    python bench_compile_race.py race --pattern ours --runs 3 --log-dir $OUT
    python bench_compile_race.py race --pattern ours --runs 2 --log-dir $OUT
    python bench_compile_race.py race --pattern naive --runs 1 --timeout 150 --log-dir $OUT
    python bench_compile_race.py race --pattern ours-lazy --runs 1 --log-dir $OUT
    # checkpoint mode of the chunked loss: step time and peak memory, 8192 rows x 151936 vocab x 4096 hidden, bf16
    python bench_compile_race.py checkpoint
    # eager vs compiled create_block_mask at a real size
    python bench_compile_race.py mask
    # CPU smoke of the logic (tiny, forward only: flex has no CPU backward), nothing recorded
    OMP_NUM_THREADS=1 python bench_compile_race.py race --device cpu --pattern ours --runs 1 --no-record
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Attention and loss sizes of a race run. "small" is realistic-but-small for one GPU (one drafter
# layer of a 1024-wide model, 64 anchors x 16 over a 1024-token context); "tiny" is for CPU smoke.
SIZES = {
    "small": dict(batch=1, heads=8, kv_heads=2, head_dim=128, context_len=1024, num_anchors=64, block_size=16, vocab=32768),
    "tiny": dict(batch=1, heads=2, kv_heads=1, head_dim=16, context_len=128, num_anchors=8, block_size=16, vocab=512),
}
RESULT_PREFIX = "RESULT "


# ----------------------------------------------------------------------------------------------
# Shared pieces: the chunked loss with a selectable checkpoint mode, and BENCHMARKS.md


def chunked_loss(rows, head_weight, labels, weights, chunk_size: int, checkpoint_mode: str):
    """dflash_loss's chunk loop (LM head + weighted CE per chunk) with the checkpoint mode as a knob.

    Args:
        rows: [T, hidden]; head_weight: [vocab, hidden]; labels: [T] int64; weights: [T] float32.
        checkpoint_mode: "reentrant", "nonreentrant" or "none" (no checkpointing: every chunk's
            fp32 logits stay alive until backward).
    Returns:
        scalar float32, sum of w * CE / sum of w.
    """
    from torch.utils.checkpoint import checkpoint

    from dflash_model import _weighted_ce_chunk

    total = rows.new_zeros((), dtype=weights.dtype)
    for start in range(0, rows.shape[0], chunk_size):
        chunk = (rows[start : start + chunk_size], head_weight, labels[start : start + chunk_size], weights[start : start + chunk_size])
        if checkpoint_mode == "none":
            ce_sum, _ = _weighted_ce_chunk(*chunk)
        else:
            ce_sum, _ = checkpoint(_weighted_ce_chunk, *chunk, use_reentrant=checkpoint_mode == "reentrant")
        total = total + ce_sum
    return total / weights.sum()


def record(title: str, lines: list[str], environment: str, path: str | None) -> None:
    """Append a dated section to BENCHMARKS.md (default: the repo's; created with a short header if missing)."""
    path = Path(path) if path else Path(__file__).resolve().parent / "BENCHMARKS.md"
    if not path.exists():
        path.write_text(
            "# Benchmarks\n\nMeasured results, newest last. Each entry names the date, the machine, the torch "
            "version and the exact command; scripts append here themselves.\n"
        )
    command = "python " + " ".join(sys.argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    with path.open("a") as f:
        f.write(f"\n## {stamp} {title}\n\n{environment}, command: `{command}`\n\n" + "\n".join(lines) + "\n")
    print(f"appended to {path}")


def environment_line(device: str) -> str:
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    return f"{name}, torch {torch.__version__}"


# ----------------------------------------------------------------------------------------------
# race: one run (the child process)


def race_child(args) -> None:
    """One run: warm up (ours), start the threads together, print a RESULT line. Runs in its own process."""
    import logging

    import torch
    import torch.nn as nn
    import torch.utils.checkpoint

    import dflash_model as dm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s", stream=sys.stderr)
    size = SIZES[args.size or ("small" if args.device == "cuda" else "tiny")]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    train = device.type == "cuda"  # flex_attention has no CPU backward: CPU runs forward only
    batch, heads, kv_heads, head_dim = size["batch"], size["heads"], size["kv_heads"], size["head_dim"]
    seq_len, num_anchors, block_size = size["context_len"], size["num_anchors"], size["block_size"]
    q_len, hidden = num_anchors * block_size, heads * head_dim

    # The naive pattern, as the project's first drafter had it: a lock around building the wrapper,
    # none around the compile, which happens lazily inside the first call of each thread.
    naive_compiled, naive_lock = {}, threading.Lock()

    def naive_attention(q, k, v, block_mask):
        with naive_lock:
            flex = naive_compiled.setdefault(str(q.device), torch.compile(dm.flex_attention, dynamic=False))
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    attend = naive_attention if args.pattern == "naive" else dm.attention
    start = time.perf_counter()
    if args.pattern != "naive":
        dm.setup_compile_cache("shared", None, rank=0, compile_threads=args.compile_threads)
    if args.pattern == "ours":
        shapes = dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, context_len=seq_len,
                      num_anchors=num_anchors, block_size=block_size, dtype=dtype)
        if train:
            dm.warm_up_flex_attention(device, **shapes, training=True)
        if not train or args.loss_checkpoint == "reentrant":  # a reentrant checkpoint's first forward runs without grad
            dm.warm_up_flex_attention(device, **shapes, training=False)
    warm_seconds = time.perf_counter() - start
    compiles_before = dm.flex_compile_stats()["compiles"]

    def train_steps(index: int, barrier: threading.Barrier, errors: list) -> None:
        try:
            torch.manual_seed(index)
            proj = nn.ModuleDict({name: nn.Linear(hidden, hidden if name in ("q", "o") else kv_heads * head_dim, bias=False)
                                  for name in ("q", "k", "v", "o")}).to(device, dtype)
            head_weight = torch.randn(size["vocab"], hidden, device=device, dtype=dtype) * hidden**-0.5  # frozen LM head
            barrier.wait()
            for step in range(args.steps):
                context = torch.randn(batch, seq_len, hidden, device=device, dtype=dtype)
                x = torch.randn(batch, q_len, hidden, device=device, dtype=dtype, requires_grad=train)
                loss_mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
                anchors, anchor_valid = dm.sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(step))
                block_mask = dm.create_anchor_block_mask(anchors, anchor_valid, seq_len, block_size)

                def heads_first(t, n):  # [batch, T, n * head_dim] -> [batch, n, T, head_dim]
                    return t.view(batch, t.shape[1], n, head_dim).transpose(1, 2)

                def layer(x):  # the tensor layouts of DFlashAttention.forward, so the warm-up's graphs fit
                    q = heads_first(proj["q"](x), heads)  # [batch, heads, Q, head_dim]
                    k = torch.cat([heads_first(proj["k"](context), kv_heads), heads_first(proj["k"](x), kv_heads)], dim=2)
                    v = torch.cat([heads_first(proj["v"](context), kv_heads), heads_first(proj["v"](x), kv_heads)], dim=2)
                    out = attend(q, k, v, block_mask)  # [batch, heads, Q, head_dim]; k, v: [batch, kv_heads, S + Q, head_dim]
                    return proj["o"](out.transpose(1, 2).reshape(batch, q_len, hidden))  # [batch, Q, hidden]

                labels = torch.randint(0, size["vocab"], (batch * q_len,), device=device)
                weights = torch.rand(batch * q_len, device=device)
                if train:
                    mode = args.loss_checkpoint
                    h = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=mode == "reentrant")
                    loss = chunked_loss(h.reshape(-1, hidden), head_weight, labels, weights, q_len // 4, mode)
                    loss.backward()
                else:
                    with torch.no_grad():
                        loss = chunked_loss(layer(x).reshape(-1, hidden), head_weight, labels, weights, q_len // 4, "none")
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss {loss.item()} at step {step}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as error:  # noqa: BLE001 - every thread's error goes into the result line
            errors.append(f"thread {index}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
            traceback.print_exc()

    barrier, errors = threading.Barrier(args.threads), []
    threads = [threading.Thread(target=train_steps, args=(i, barrier, errors), name=f"worker-{i}") for i in range(args.threads)]
    threaded_start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = dm.flex_compile_stats() if args.pattern != "naive" else {"compiles": 0}
    result = {
        "status": "error" if errors else "ok",
        "seconds": round(time.perf_counter() - start, 1),
        "warm_up_seconds": round(warm_seconds, 1),
        "threads_seconds": round(time.perf_counter() - threaded_start, 1),
        "compiles_in_threads": stats["compiles"] - compiles_before if args.pattern != "naive" else None,
        "errors": errors,
        "environment": environment_line(device.type),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# race: the runs (the parent process)


def race(args) -> None:
    """--runs fresh processes on fresh cold cache dirs, each killed after --timeout seconds; table + BENCHMARKS.md."""
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows, environment = [], None
    for run in range(args.runs):
        cache_dir = Path(tempfile.mkdtemp(prefix=f"race_{args.pattern}_{run}_", dir=args.cache_root))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
        env.pop("DFLASH_COMPILE_LOCK_DIR", None)
        command = [sys.executable, os.path.abspath(__file__), "race-child", "--pattern", args.pattern, "--device", args.device,
                   "--threads", str(args.threads), "--steps", str(args.steps), "--loss-checkpoint", args.loss_checkpoint]
        if args.size:
            command += ["--size", args.size]
        if args.compile_threads:
            command += ["--compile-threads", str(args.compile_threads)]
        log_path = log_dir / f"race_{args.pattern}_{run}.log"
        start = time.perf_counter()
        with log_path.open("w") as log_file:
            child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True)
            try:
                stdout, _ = child.communicate(timeout=args.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # the whole session: the child and its compile workers
                stdout, _ = child.communicate()
                timed_out = True
        seconds = time.perf_counter() - start
        result = next((json.loads(line[len(RESULT_PREFIX):]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)), None)
        if timed_out:
            status, error = "timeout", f"killed after {args.timeout} s (log: {log_path})"
        elif result is None:
            tail = [line for line in log_path.read_text().splitlines() if line.strip()][-1:] or ["no output"]
            status, error = "error", f"exit code {child.returncode}: {tail[0][:200]}"
        else:
            status, error = result["status"], "; ".join(result["errors"])[:300]
            environment = environment or result["environment"]
        compiles = "" if result is None or result["compiles_in_threads"] is None else str(result["compiles_in_threads"])
        rows.append(f"| {args.pattern} | {run} | {status} | {seconds:.1f} | {compiles} | {error} |")
        print(rows[-1], flush=True)
        if not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    table = ["| pattern | run | result | seconds | compiles in threads | error |", "|---|---|---|---|---|---|", *rows]
    print("\n".join(table))
    ok = sum(" | ok | " in row for row in rows)
    print(f"{args.pattern}: {ok}/{len(rows)} runs ok (threads {args.threads}, loss checkpoint {args.loss_checkpoint}, timeout {args.timeout} s)")
    if not args.no_record:
        record(f"compile race, pattern {args.pattern}: {ok}/{len(rows)} ok", table, environment or environment_line(args.device), args.record_to)


# ----------------------------------------------------------------------------------------------
# checkpoint: reentrant vs non-reentrant chunked loss


def checkpoint_modes(args) -> None:
    """Step time (forward + backward) and peak memory of the chunked loss under each checkpoint mode."""
    import torch

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    head_weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * args.hidden**-0.5  # frozen LM head
    labels = torch.randint(0, args.vocab, (args.rows,), device=device)
    weights = torch.rand(args.rows, device=device)
    table = ["| mode | rows x vocab x hidden | chunk | step ms | peak over inputs GiB |", "|---|---|---|---|---|"]
    for mode in args.modes:
        rows = torch.randn(args.rows, args.hidden, device=device, dtype=dtype, requires_grad=True)
        times = []
        for step in range(args.steps + 1):  # step 0 warms up allocator and kernels
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
            start = time.perf_counter()
            loss = chunked_loss(rows, head_weight, labels, weights, args.chunk, mode)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - start)
            rows.grad = None
        peak = (torch.cuda.max_memory_allocated() - baseline) / 2**30 if device.type == "cuda" else float("nan")
        table.append(f"| {mode} | {args.rows} x {args.vocab} x {args.hidden} | {args.chunk} | {1000 * sum(times) / len(times):.1f} | {peak:.2f} |")
        print(table[-1], flush=True)
        del rows, loss
    print("\n".join(table))
    if not args.no_record:
        record("chunked loss checkpoint mode", table, environment_line(device.type), args.record_to)


# ----------------------------------------------------------------------------------------------
# mask: eager vs compiled create_block_mask


def mask(args) -> None:
    """Time and peak memory of create_anchor_block_mask eager vs torch.compile(create_block_mask)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import dflash_model as dm

    device = torch.device(args.device)
    compiled = torch.compile(create_block_mask, dynamic=False)
    q_len = args.num_anchors * args.block_size
    table = ["| builder | batch | Q x KV | first call s | median ms | peak GiB |", "|---|---|---|---|---|---|"]
    for name in ("eager", "compiled"):
        times = []
        for call in range(args.steps + 1):
            loss_mask = torch.ones(args.batch, args.context_len, dtype=torch.bool, device=device)
            anchors, valid = dm.sample_anchors(loss_mask, args.num_anchors, torch.Generator().manual_seed(call))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
            start = time.perf_counter()
            if name == "eager":
                dm.create_anchor_block_mask(anchors, valid, args.context_len, args.block_size)
            else:
                mask_mod = dm.anchor_block_mask_mod(anchors, valid, args.context_len, args.block_size)
                compiled(mask_mod, args.batch, None, q_len, args.context_len + q_len, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = (torch.cuda.max_memory_allocated() - baseline) / 2**30 if device.type == "cuda" else float("nan")
        median = sorted(times[1:])[len(times[1:]) // 2]
        table.append(f"| {name} | {args.batch} | {q_len} x {args.context_len + q_len} | {times[0]:.2f} | {1000 * median:.1f} | {peak:.2f} |")
        print(table[-1], flush=True)
    print("\n".join(table))
    if not args.no_record:
        record("create_block_mask eager vs compiled", table, environment_line(device.type), args.record_to)


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p, device_default="cuda"):
        p.add_argument("--device", default=device_default, choices=["cuda", "cpu"], help="cpu: a smoke test of the logic")
        p.add_argument("--no-record", action="store_true", help="do not append to BENCHMARKS.md")
        p.add_argument("--record-to", default=None, help="the BENCHMARKS.md to append to (default: the repo's)")

    for name in ("race", "race-child"):
        p = commands.add_parser(name, help="compile race runs" if name == "race" else argparse.SUPPRESS)
        common(p)
        p.add_argument("--pattern", choices=["naive", "ours", "ours-lazy"], default="ours")
        p.add_argument("--threads", type=int, default=3, help="threads training at once")
        p.add_argument("--steps", type=int, default=3, help="training steps per thread")
        p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on cuda, tiny on cpu")
        p.add_argument("--loss-checkpoint", choices=["reentrant", "nonreentrant"], default="reentrant",
                       help="checkpoint mode of the attention layer and the chunked loss (reentrant is the harder case)")
        p.add_argument("--compile-threads", type=int, default=None, help="inductor compile workers (ours)")
        if name == "race":
            p.add_argument("--runs", type=int, default=5)
            p.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is killed and counted as a timeout")
            p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "bench_compile_race"), help="one log per run")
            p.add_argument("--cache-root", default=None, help="where the fresh cache dirs go (default: the temp dir)")
            p.add_argument("--keep-cache", action="store_true")

    p = commands.add_parser("checkpoint", help="reentrant vs non-reentrant chunked loss: step time, peak memory")
    common(p)
    p.add_argument("--modes", nargs="+", choices=["reentrant", "nonreentrant", "none"], default=["reentrant", "nonreentrant", "none"])
    p.add_argument("--rows", type=int, default=8192, help="label positions (num_anchors x (B - 1) x batch)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096, help="rows per chunk (dflash_loss's chunk_size)")
    p.add_argument("--steps", type=int, default=5)

    p = commands.add_parser("mask", help="eager vs compiled create_block_mask: time, peak memory")
    common(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context-len", type=int, default=3072)
    p.add_argument("--num-anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)

    args = parser.parse_args()
    {"race": race, "race-child": race_child, "checkpoint": checkpoint_modes, "mask": mask}[args.command](args)


if __name__ == "__main__":
    main()
