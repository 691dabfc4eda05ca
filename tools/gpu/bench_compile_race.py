"""Reproduce the flex_attention compile race on one GPU, and show that the trainer's compile locks prevent it.

Each `race` run is a fresh process on a fresh, cold TORCHINDUCTOR_CACHE_DIR. Three threads start
together, each with its OWN sequence length (--lengths, default 256, 384 and 512, as ranks with
different batches have), so each triggers its own compile at the same moment. Each thread trains
--steps steps: an attention layer calling flex_attention with the anchor BlockMask, a chunked
LM-head cross-entropy under reentrant activation checkpointing (use_reentrant=True), and the
backward. Then it goes on training until every thread has done its steps, as a rank keeps
training while its neighbours compile. Two ways the naive pattern fails:

  - FX-tracing error: a thread calls the compiled flex while another thread traces its own
    compile; tracing sets a process-wide FX flag that the compiled function's entry checks.
  - hang: AOTAutograd compiles flex's backward lazily, at the first backward, which on CUDA runs
    in autograd's one worker thread per device, shared by every Python thread. That compile waits
    for dynamo's process-wide compile lock while another thread holds it to compile its forward
    with grad, whose joint forward/backward trace needs that same autograd worker thread.

The second needs a forward compiled WITH grad in a Python thread, so the attention layer runs
without checkpointing by default (a reentrant checkpoint would run its first forward without
grad); --layer-checkpoint checkpoints it too (reentrant: its forward then runs again inside
backward, in autograd's worker thread).
Patterns:

    naive      a per-device `torch.compile(flex_attention)` (torch's default dynamic shapes; or
               --naive-dynamic false), built lazily by whichever thread comes first and called by
               every thread, no locks, no warm-up
    ours       dflash_compile's machinery: setup_compile_cache, then warm_up_flex_attention in
               the main thread for every length (compile + forward/backward warm-up under the
               compile locks), then the threads, whose flex calls go through the same locked path
    ours-lazy  dflash_compile's locks only, no warm-up: threads hit their first shapes themselves

Outcome of a run: "fx-error" (the text `Detected that you are using FX to symbolically trace a
dynamo-optimized function` anywhere in the run's output) or "hang" (killed after --timeout
seconds) reproduce the race; any other failure is "error (unrelated)", reported but never counted
as a reproduction; "clean" finished without an error. A table per pattern (runs, reproduced,
unrelated errors, clean, median seconds) is printed and appended to BENCHMARKS.md.

    # one H200; cold runs in parallel, each on its own cache dir (tools/gpu/compile_race.sh runs both)
    python tools/gpu/bench_compile_race.py race --pattern naive --runs 3 --parallel 3 --timeout 90
    python tools/gpu/bench_compile_race.py race --pattern ours --runs 10 --parallel 5
    # checkpoint mode of the chunked loss: step time and peak memory, 8192 rows x 151936 vocab x 4096 hidden, bf16
    python tools/gpu/bench_compile_race.py checkpoint
    # eager vs compiled create_block_mask at a real size
    python tools/gpu/bench_compile_race.py mask
    # CPU smoke of the logic (tiny sizes, forward only: flex has no CPU backward), nothing recorded
    OMP_NUM_THREADS=1 python tools/gpu/bench_compile_race.py race --device cpu --pattern ours --runs 1 --no-record
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo's flat modules (dflash_compile, dflash_model)

# Attention and loss sizes of a race run (the sequence lengths come from --lengths). "small" is
# realistic-but-small for one GPU (one drafter layer of a 1024-wide model, 64 anchors x 16);
# "tiny" is for the CPU smoke.
SIZES = {
    "small": dict(batch=1, heads=8, kv_heads=2, head_dim=128, num_anchors=64, block_size=16, vocab=32768),
    "tiny": dict(batch=1, heads=2, kv_heads=1, head_dim=16, num_anchors=8, block_size=16, vocab=512),
}
DEFAULT_LENGTHS = {"cuda": [256, 384, 512], "cpu": [64, 96, 128]}
RESULT_PREFIX = "RESULT "
# What a thread dies of when another thread of the process compiles (the FX-tracing flag is process-wide).
FX_TRACE_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
REPRODUCED = ("fx-error", "hang")


# ----------------------------------------------------------------------------------------------
# Shared pieces: the chunked loss with a selectable checkpoint mode, and BENCHMARKS.md


def weighted_ce_chunk(rows, head_weight, labels, weights):
    """One chunk of the loss: sum of w * CE(rows @ head_weight^T, labels), fp32 logits.

    rows: [T, hidden]; head_weight: [vocab, hidden]; labels: [T] int64; weights: [T] float32.
    Returns a scalar float32 (the weighted sum, not yet normalised).
    """
    import torch.nn.functional as F

    logits = (rows @ head_weight.t()).float()  # [T, vocab]
    return (F.cross_entropy(logits, labels, reduction="none") * weights).sum()


def chunked_loss(rows, head_weight, labels, weights, chunk_size: int, checkpoint_mode: str):
    """LM head + weighted CE in chunks (the shape of a DFlash loss), with the checkpoint mode as a knob.

    Args:
        rows: [T, hidden]; head_weight: [vocab, hidden]; labels: [T] int64; weights: [T] float32.
        checkpoint_mode: "reentrant", "nonreentrant" or "none" (no checkpointing: every chunk's
            fp32 logits stay alive until backward).
    Returns:
        scalar float32, sum of w * CE / sum of w.
    """
    from torch.utils.checkpoint import checkpoint

    total = rows.new_zeros((), dtype=weights.dtype)
    for start in range(0, rows.shape[0], chunk_size):
        chunk = (rows[start : start + chunk_size], head_weight, labels[start : start + chunk_size], weights[start : start + chunk_size])
        if checkpoint_mode == "none":
            total = total + weighted_ce_chunk(*chunk)
        else:
            total = total + checkpoint(weighted_ce_chunk, *chunk, use_reentrant=checkpoint_mode == "reentrant")
    return total / weights.sum()


def record(title: str, lines: list[str], environment: str, path: str | None) -> None:
    """Append a dated section to BENCHMARKS.md (default: the repo's; created with a short header if missing)."""
    path = Path(path) if path else REPO / "BENCHMARKS.md"
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

    import dflash_compile as dc
    import dflash_masks
    import dflash_model as dm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s", stream=sys.stderr)
    size = SIZES[args.size or ("small" if args.device == "cuda" else "tiny")]
    lengths = args.lengths or DEFAULT_LENGTHS[args.device]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    train = device.type == "cuda"  # flex_attention has no CPU backward: CPU runs forward only
    batch, heads, kv_heads, head_dim = size["batch"], size["heads"], size["kv_heads"], size["head_dim"]
    num_anchors, block_size = size["num_anchors"], size["block_size"]
    q_len, hidden = num_anchors * block_size, heads * head_dim

    # The naive pattern: one compiled wrapper per device, built by the first thread to need it, and
    # every thread's first call at its own length compiling at the same moment.
    naive_compiled = {}

    def naive_attention(q, k, v, block_mask):
        flex = naive_compiled.get(str(q.device))
        if flex is None:
            # As users write it: torch.compile's default dynamic=None, so the second length recompiles
            # with dynamic shapes while the other threads call the compiled function.
            options = {} if args.naive_dynamic == "default" else {"dynamic": False}
            flex = naive_compiled.setdefault(str(q.device), torch.compile(dc.flex_attention, **options))
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    attend = naive_attention if args.pattern == "naive" else dm.attention
    start = time.perf_counter()
    if args.pattern != "naive":
        dc.setup_compile_cache("shared", None, rank=0, compile_threads=args.compile_threads)
    if args.pattern == "ours":
        for seq_len in dict.fromkeys(lengths):
            shapes = dict(
                batch=batch,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                context_len=seq_len,
                num_anchors=num_anchors,
                block_size=block_size,
                dtype=dtype,
            )
            if train:
                dc.warm_up_flex_attention(device, dflash_masks.create_anchor_block_mask, **shapes, training=True)
            if not train or (args.layer_checkpoint and args.loss_checkpoint == "reentrant"):  # its first forward runs without grad
                dc.warm_up_flex_attention(device, dflash_masks.create_anchor_block_mask, **shapes, training=False)
    warm_seconds = time.perf_counter() - start
    compiles_before = dc.flex_compile_stats()["compiles"]

    def train_steps(index: int, seq_len: int, barrier: threading.Barrier, errors: list) -> None:
        try:
            torch.manual_seed(index)
            proj = nn.ModuleDict(
                {name: nn.Linear(hidden, hidden if name in ("q", "o") else kv_heads * head_dim, bias=False) for name in ("q", "k", "v", "o")}
            ).to(device, dtype)
            head_weight = torch.randn(size["vocab"], hidden, device=device, dtype=dtype) * hidden**-0.5  # frozen LM head
            barrier.wait()
            step = 0
            # A thread keeps stepping until every thread has done --steps: its flex calls then overlap
            # the other threads' compiles, as a training rank's steps do.
            while step < args.steps or not all_done.is_set():
                context = torch.randn(batch, seq_len, hidden, device=device, dtype=dtype)
                x = torch.randn(batch, q_len, hidden, device=device, dtype=dtype, requires_grad=train)
                loss_mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
                anchors, anchor_valid = dflash_masks.sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(step))
                block_mask = dflash_masks.create_anchor_block_mask(anchors, anchor_valid, seq_len, block_size)

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
                    if args.layer_checkpoint:
                        h = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=mode == "reentrant")
                    else:
                        h = layer(x)
                    loss = chunked_loss(h.reshape(-1, hidden), head_weight, labels, weights, q_len // 4, mode)
                    loss.backward()
                else:
                    with torch.no_grad():
                        loss = chunked_loss(layer(x).reshape(-1, hidden), head_weight, labels, weights, q_len // 4, "none")
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss {loss.item()} at step {step}")
                step += 1
                if step == args.steps:
                    logging.info("length %d: %d steps done after %.1f s", seq_len, step, time.perf_counter() - threaded_start)
                    count_done()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            logging.info("length %d: stopped after %d steps", seq_len, step)
        except Exception as error:  # every thread's error goes into the result line
            errors.append(f"thread {index}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
            traceback.print_exc()
            all_done.set()  # the others stop too: the run has failed

    barrier, errors = threading.Barrier(args.threads), []
    all_done, done_lock, done_count = threading.Event(), threading.Lock(), [0]

    def count_done() -> None:  # one more thread has done its --steps
        with done_lock:
            done_count[0] += 1
            if done_count[0] == args.threads:
                all_done.set()

    threads = [
        threading.Thread(target=train_steps, args=(i, lengths[i % len(lengths)], barrier, errors), name=f"worker-{i}") for i in range(args.threads)
    ]
    threaded_start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = dc.flex_compile_stats() if args.pattern != "naive" else {"compiles": 0}
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


def classify_run(timed_out: bool, result: dict | None, output: str) -> str:
    """The outcome of one run: "hang" (killed at the timeout), "fx-error" (the FX-tracing error text
    anywhere in its output), "error" (any other failure: unrelated to the race), or "clean".

    Args:
        timed_out: the run was killed after --timeout seconds.
        result: the child's RESULT dict, or None if it printed none (it crashed).
        output: everything the child wrote (its log).
    """
    if timed_out:
        return "hang"
    if FX_TRACE_ERROR in output or (result and any(FX_TRACE_ERROR in e for e in result["errors"])):
        return "fx-error"
    if result is None or result["status"] != "ok":
        return "error"
    return "clean"


def summary_table(pattern: str, outcomes: list[str], seconds: list[float]) -> list[str]:
    """The recorded table: one row per pattern. A hang counts at its cutoff in the median."""
    reproduced = sum(o in REPRODUCED for o in outcomes)
    unrelated = outcomes.count("error")
    return [
        "| pattern | runs | reproduced (FX error or hang) | unrelated errors | clean | median seconds |",
        "|---|---|---|---|---|---|",
        f"| {pattern} | {len(outcomes)} | {reproduced} | {unrelated} | {outcomes.count('clean')} | {statistics.median(seconds):.1f} |",
    ]


def race_run(args, run: int) -> dict:
    """One child process on its own cold cache dir, killed (with its compile workers) after --timeout seconds."""
    cache_dir = Path(tempfile.mkdtemp(prefix=f"race_{args.pattern}_{run}_", dir=args.cache_root))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    env.pop("DFLASH_COMPILE_LOCK_DIR", None)
    if args.compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
    elif args.parallel > 1:  # parallel runs share the cores: inductor's default would start cores x runs workers
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel))
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "race-child",
        "--pattern",
        args.pattern,
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--steps",
        str(args.steps),
        "--loss-checkpoint",
        args.loss_checkpoint,
    ]
    if args.layer_checkpoint:
        command.append("--layer-checkpoint")
    command += ["--naive-dynamic", args.naive_dynamic]
    if args.lengths:
        command += ["--lengths", *map(str, args.lengths)]
    if args.size:
        command += ["--size", args.size]
    if args.compile_threads:
        command += ["--compile-threads", str(args.compile_threads)]
    log_path = Path(args.log_dir) / f"race_{args.pattern}_{run}.log"
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
    if not args.keep_cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    result = next((json.loads(line[len(RESULT_PREFIX) :]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)), None)
    output = log_path.read_text(errors="replace") + stdout
    outcome = classify_run(timed_out, result, output)
    if timed_out:
        error = f"killed after {args.timeout:.0f} s (log: {log_path})"
    elif result is None:
        tail = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        error = f"exit code {child.returncode}: {tail[0][:200]}"
    else:
        error = "; ".join(result["errors"])[:300]
    if outcome == "fx-error" and FX_TRACE_ERROR not in error:
        error = f"{FX_TRACE_ERROR} (in {log_path}); {error}"[:300]
    compiles = "" if result is None or result["compiles_in_threads"] is None else str(result["compiles_in_threads"])
    return {
        "run": run,
        "outcome": outcome,
        "seconds": seconds,
        "compiles": compiles,
        "error": error,
        "environment": result["environment"] if result else None,
    }


def race(args) -> None:
    """--runs fresh processes on fresh cold cache dirs, --parallel at a time; summary table + BENCHMARKS.md."""
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    lengths = args.lengths or DEFAULT_LENGTHS[args.device]
    print(
        f"{args.pattern}: {args.runs} cold runs, {args.parallel} at a time; {args.threads} threads at lengths {lengths}, "
        f"loss checkpoint {args.loss_checkpoint}, timeout {args.timeout:.0f} s",
        flush=True,
    )
    runs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for run in pool.map(lambda i: race_run(args, i), range(args.runs)):
            runs.append(run)
            label = "error (unrelated)" if run["outcome"] == "error" else run["outcome"]
            print(f"| {args.pattern} | {run['run']} | {label} | {run['seconds']:.1f} | {run['compiles']} | {run['error']} |", flush=True)
    outcomes, seconds = [r["outcome"] for r in runs], [r["seconds"] for r in runs]
    table = summary_table(args.pattern, outcomes, seconds)
    details = ["", "| run | outcome | seconds | compiles in threads | error |", "|---|---|---|---|---|"] + [
        f"| {r['run']} | {'error (unrelated)' if r['outcome'] == 'error' else r['outcome']} | {r['seconds']:.1f} | {r['compiles']} | {r['error']} |"
        for r in runs
    ]
    print("\n".join(table + details))
    reproduced = sum(o in REPRODUCED for o in outcomes)
    print(
        f"{args.pattern}: the race reproduced in {reproduced} of {len(runs)} runs (FX error or hang), "
        f"{outcomes.count('error')} unrelated errors, {outcomes.count('clean')} clean"
    )
    if not args.no_record:
        environment = next((r["environment"] for r in runs if r["environment"]), None) or environment_line(args.device)
        settings = (
            f"{args.threads} threads at lengths {lengths}, loss checkpoint {args.loss_checkpoint}"
            f"{', attention layer checkpointed too' if args.layer_checkpoint else ', attention layer not checkpointed'}"
            f"{f', {args.compile_threads} inductor compile worker(s)' if args.compile_threads else ''}"
            f"{', torch.compile dynamic=False' if args.pattern == 'naive' and args.naive_dynamic == 'false' else ''}, "
            f"timeout {args.timeout:.0f} s, {args.parallel} runs in parallel"
        )
        record(
            f"compile race, pattern {args.pattern}: reproduced in {reproduced} of {len(runs)} cold runs",
            [settings, "", *table, *details],
            environment,
            args.record_to,
        )


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

    import dflash_masks

    device = torch.device(args.device)
    compiled = torch.compile(create_block_mask, dynamic=False)
    q_len = args.num_anchors * args.block_size
    table = ["| builder | batch | Q x KV | first call s | median ms | peak GiB |", "|---|---|---|---|---|---|"]
    for name in ("eager", "compiled"):
        times = []
        for call in range(args.steps + 1):
            loss_mask = torch.ones(args.batch, args.context_len, dtype=torch.bool, device=device)
            anchors, valid = dflash_masks.sample_anchors(loss_mask, args.num_anchors, torch.Generator().manual_seed(call))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
            start = time.perf_counter()
            if name == "eager":
                dflash_masks.create_anchor_block_mask(anchors, valid, args.context_len, args.block_size)
            else:
                mask_mod = dflash_masks.anchor_block_mask_mod(anchors, valid, args.context_len, args.block_size)
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
        p.add_argument(
            "--steps", type=int, default=3, help="training steps per thread at least; a thread goes on stepping until every thread has done them"
        )
        p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on cuda, tiny on cpu")
        p.add_argument(
            "--loss-checkpoint",
            choices=["reentrant", "nonreentrant"],
            default="reentrant",
            help="checkpoint mode of the chunked loss (and of the attention layer with --layer-checkpoint)",
        )
        p.add_argument(
            "--layer-checkpoint",
            action="store_true",
            help="checkpoint the attention layer too (default: only the loss; the layer's forward then "
            "compiles with grad in each thread, as in the probe that hung)",
        )
        p.add_argument(
            "--lengths",
            type=int,
            nargs="+",
            default=None,
            help="sequence length of each thread, cycled (default: 256 384 512 on cuda, 64 96 128 on cpu)",
        )
        p.add_argument("--compile-threads", type=int, default=None, help="inductor compile workers per run")
        p.add_argument(
            "--naive-dynamic",
            choices=["default", "false"],
            default="default",
            help="the naive pattern's torch.compile(flex_attention, dynamic=...): torch's default "
            "(automatic dynamic shapes after the first length) or False (one static graph per length)",
        )
        if name == "race":
            p.add_argument("--runs", type=int, default=5)
            p.add_argument("--parallel", type=int, default=1, help="runs at a time, each on its own cold cache dir")
            p.add_argument("--timeout", type=float, default=90.0, help="seconds before a run is killed and counted as a hang")
            p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "bench_compile_race"), help="one log per run")
            p.add_argument("--cache-root", default=None, help="where the fresh cache dirs go (default: the temp dir)")
            p.add_argument("--keep-cache", action="store_true")

    p = commands.add_parser("checkpoint", help="reentrant vs non-reentrant chunked loss: step time, peak memory")
    common(p)
    p.add_argument("--modes", nargs="+", choices=["reentrant", "nonreentrant", "none"], default=["reentrant", "nonreentrant", "none"])
    p.add_argument("--rows", type=int, default=8192, help="label positions (num_anchors x (B - 1) x batch)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096, help="rows per chunk (weighted_block_loss's chunk_size)")
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
