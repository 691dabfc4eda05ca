"""Compile safety: torch.compile and CUDA graphs for the trainer, without the cold-cache race.

The story. The drafter's training mask is block-sparse, and `flex_attention` runs it without
materialising the score matrix only when it is compiled; called eagerly it falls back to dense math
attention that needs hundreds of GB at real sizes (an instant OOM). So flex is compiled lazily, once
per device, on its first call. On a cold cache that first compile is where training used to die:
several threads compiling at the same moment raised `Detected that you are using FX to symbolically
trace a dynamo-optimized function` in the drafter's forward (the FX tracing flag is process-wide, so
within a process it is threads that collide: worker threads, and autograd's backward threads on
CUDA), and several ranks sharing one cache directory collided on its files (corrupt or mismatched
entries, duplicated compile work). Clearing the cache made it come back, suppressing the error only
hid it, and removing the compile wrapper ran out of memory. The durable fix is synchronisation:
one compiler at a time per node, the others wait and then load the warm cache (docs/compile-safety.md).

The rules of this module:
  1. `setup_compile_cache` picks the inductor/Triton cache dirs and the node-wide lock dir, once per
     process, before anything compiles.
  2. The first call of compiled flex at each new shape signature (`flex_shape_key`) compiles and
     warms up (forward, and backward on CUDA) under `compile_lock`: an in-process lock for threads,
     then a file lock shared by all ranks of the node, with a sidecar file naming the holder. While
     it compiles, the process's other compiled calls wait (the gate, `running_compiled`). New length
     buckets take the same path, so they never reopen the race and never fall back to dense.
  3. `warm_up_flex_attention` does that for the training shapes in the main thread, before any
     worker thread starts, so the threaded phase of training finds every graph compiled. It does
     not know the drafter: the caller passes the mask builder and the shapes.
  4. `compile_once_locked` gives every other compiled piece (drafter layers, the loss chunk, target
     layers) the same discipline; `flex_compile_stats` counts all of them for the training log.
  5. On a GPU, flex never runs uncompiled: `DenseAttentionFallbackError` instead of an OOM.

`CUDAGraphCall`, the other way this project makes a hot function fast (batch-1 decoding, batched
regeneration, the target's feature forward), lives here too.

This module imports nothing of the project: `dflash_model` and `dflash_features` import it.
"""

import contextlib
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import filelock
import torch
import torch.utils.checkpoint
from torch.nn.attention.flex_attention import BlockMask, flex_attention

log = logging.getLogger(__name__)

# Dynamo keeps one compiled graph per shape signature of a frame (flex_attention's, a drafter
# layer's, a target layer's). Lengths padded to multiples of 128 up to 3072 give 24 buckets, times
# train and eval, times the few input variants of a layer (layer 0's input needs no grad; a target
# batch with or without padding), times the last, smaller batch: 100-200 graphs for a long max
# length. Dynamo's default (8) would be hit by the 9th bucket, and past the limit dynamo runs the
# function eagerly (for flex: dense); `fail_on_recompile_limit_hit` turns that into an error instead.
FLEX_RECOMPILE_LIMIT = 256
# A cold flex forward+backward compile takes minutes, and with per-rank caches every rank of the
# node compiles in turn while holding the lock: 30 minutes is generous for 8 ranks.
COMPILE_LOCK_TIMEOUT_S = 1800.0
COMPILE_LOCK_DIR_ENV = "DFLASH_COMPILE_LOCK_DIR"  # set by setup_compile_cache, inherited by child processes
COMPILE_LOCK_TIMEOUT_ENV = "DFLASH_COMPILE_LOCK_TIMEOUT"  # seconds


class DenseAttentionFallbackError(RuntimeError):
    """flex_attention would run uncompiled, i.e. materialise the whole score matrix."""


class CompileLockTimeout(TimeoutError):
    """The node-wide compile lock was not acquired in time; the message names the holder and the lock path."""


def _set_config_in_every_thread(config_module, name: str, value) -> None:
    """`config_module.<name> = value` for every thread, autograd's backward threads included.

    From torch 2.12 an assignment to a dynamo/inductor config sets it for the calling thread only
    (the override lives in a ContextVar): a value set in the main thread would not reach the
    threads in which autograd runs a CUDA backward, where AOTAutograd compiles backward graphs.
    The entry's default is what every thread without an override of its own reads, so it is
    changed as well. On older torch the assignment alone is already process-wide.
    """
    setattr(config_module, name, value)
    entry = getattr(config_module, "_config", {}).get(name)
    if entry is not None and hasattr(entry, "default"):
        entry.default = value


def setup_compile_cache(
    mode: str, root: str | os.PathLike | None = None, rank: int = 0, *, compile_threads: int | None = None, lock_timeout_s: float | None = None
) -> Path:
    """Point inductor's and Triton's caches at a node-local root; return the node-wide lock directory.

    Call it once per process, before anything compiles: right after the launcher has set the rank
    (LOCAL_RANK), before `Accelerator()` / `deepspeed.initialize` and before the drafter is built.
    Inductor reads the cache directory at compile time, so a later call would leave part of the
    compiled state in the old directory.

    Args:
        mode: the trainer's --compile_cache. "shared": every rank of the node uses `root`; the first
            rank to take the lock compiles and fills it, the others load from it. "per_rank": rank r
            uses `root/rank_{r}`, so no cache file is ever shared (the escape hatch for cache
            corruption across ranks); every rank then compiles itself, one at a time, because the
            lock stays at `root`.
        root: the cache root; default $TORCHINDUCTOR_CACHE_DIR, else inductor's default
            /tmp/torchinductor_$USER. Keep it on a local disk: the lock file must be seen by every
            rank of this node and by no other node.
        rank: this process's rank (local or global: it only names the per-rank directory).
        compile_threads: the trainer's --compile_threads, inductor compile workers for this process.
            None keeps inductor's default, min(32, cores) per process: 8 ranks of one node would
            start up to 8 x 32 compile workers on the same cores. A good cap is
            max(1, cores // ranks_per_node).
        lock_timeout_s: how long `compile_lock` waits before failing (default 1800 s).
    Returns:
        The lock directory (= root), also exported as $DFLASH_COMPILE_LOCK_DIR.
    Raises:
        ValueError: on a mode other than "shared" / "per_rank" or compile_threads < 1.
        RuntimeError: if flex_attention was already compiled in this process.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if mode not in ("shared", "per_rank"):
        raise ValueError(f"--compile_cache must be 'shared' or 'per_rank', got {mode!r}")
    if compile_threads is not None and compile_threads < 1:
        raise ValueError(f"--compile_threads must be >= 1, got {compile_threads}")
    if _warm_flex_keys:
        raise RuntimeError("setup_compile_cache() must run before the first flex_attention compile of the process")
    root = Path(root or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).resolve()
    cache_dir = root if mode == "shared" else root / f"rank_{rank}"
    (cache_dir / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    os.environ[COMPILE_LOCK_DIR_ENV] = str(root)
    if lock_timeout_s is not None:
        os.environ[COMPILE_LOCK_TIMEOUT_ENV] = str(lock_timeout_s)
    if compile_threads is not None:
        import torch._inductor.config

        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)  # child processes
        _set_config_in_every_thread(torch._inductor.config, "compile_threads", compile_threads)
    log.info(
        "compile cache (%s): inductor %s, triton %s, lock dir %s, compile threads %s",
        mode,
        cache_dir,
        cache_dir / "triton",
        root,
        compile_threads or "inductor default",
    )
    return root


def compile_lock_dir() -> Path:
    """The node-wide lock directory: $DFLASH_COMPILE_LOCK_DIR, else the inductor cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = Path(os.environ.get(COMPILE_LOCK_DIR_ENV) or cache_dir())
    path.mkdir(parents=True, exist_ok=True)
    return path


def _describe_lock_holder(holder_path: Path) -> str:
    """'pid 123 on host-a (thread MainThread, <what>, since 12:00:01)' from the holder sidecar file."""
    try:
        holder = json.loads(holder_path.read_text())
    except (OSError, ValueError):
        return f"a holder not named yet (no readable {holder_path})"
    return (
        f"pid {holder['pid']} on {holder['host']} (thread {holder['thread']}, {holder['what']}, "
        f"since {time.strftime('%H:%M:%S', time.localtime(holder['since']))})"
    )


_compile_thread_lock = threading.RLock()  # threads of this process
_compile_file_locks: dict[str, filelock.FileLock] = {}  # lock path -> its one FileLock (re-entrant for the holding thread)


@contextlib.contextmanager
def compile_lock(what: str, timeout_s: float | None = None):
    """Hold the node-wide compile lock: one compiler at a time across this process's threads and all ranks of the node.

    First an in-process RLock (threads), then a `filelock.FileLock` at
    `compile_lock_dir()/flex_compile.lock` (ranks). While it is held, the sidecar file
    `flex_compile.lock.holder` names the holder (pid, host, thread, what, since), so a rank that
    waits or times out can say whom it waits for. The OS drops a file lock when its process dies,
    so a timeout always means a live holder. Logs the wait, the acquisition and the release.

    Args:
        what: what the holder compiles, for the logs and the sidecar file.
        timeout_s: give up after this long; default $DFLASH_COMPILE_LOCK_TIMEOUT, else 1800 s.
    Raises:
        CompileLockTimeout: naming the holder (pid, host) and the lock path.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get(COMPILE_LOCK_TIMEOUT_ENV, COMPILE_LOCK_TIMEOUT_S))
    lock_path = compile_lock_dir() / "flex_compile.lock"
    holder_path = lock_path.with_name(lock_path.name + ".holder")
    me = f"pid {os.getpid()} on {socket.gethostname()}"
    started = time.monotonic()

    def timed_out() -> CompileLockTimeout:
        return CompileLockTimeout(
            f"{me} waited {timeout_s:.0f} s for the compile lock {lock_path}, held by "
            f"{_describe_lock_holder(holder_path)}. A cold compile takes minutes: if the holder is "
            f"alive and compiling, raise the timeout (setup_compile_cache(lock_timeout_s=...) or "
            f"${COMPILE_LOCK_TIMEOUT_ENV}); if it is stuck, inspect it (py-spy dump --pid PID) "
            f"before killing it."
        )

    if not _compile_thread_lock.acquire(blocking=False):
        log.info("%s waits for the compile lock (held in this process by %s)", me, _describe_lock_holder(holder_path))
        if not _compile_thread_lock.acquire(timeout=timeout_s):
            raise timed_out()
    try:
        if str(lock_path) not in _compile_file_locks:
            _compile_file_locks[str(lock_path)] = filelock.FileLock(str(lock_path))
        file_lock = _compile_file_locks[str(lock_path)]
        try:
            file_lock.acquire(timeout=0)
        except filelock.Timeout:
            log.info("%s waits for the compile lock %s, held by %s", me, lock_path, _describe_lock_holder(holder_path))
            try:
                file_lock.acquire(timeout=max(timeout_s - (time.monotonic() - started), 0.0))
            except filelock.Timeout:
                raise timed_out() from None
        outermost = file_lock.lock_counter == 1
        acquired = time.monotonic()
        if outermost:
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "thread": threading.current_thread().name, "what": what, "since": time.time()}
            tmp_path = holder_path.with_name(f"{holder_path.name}.{os.getpid()}.tmp")
            tmp_path.write_text(json.dumps(holder))
            os.replace(tmp_path, holder_path)  # readers never see half a file
            log.info("compile lock %s acquired by %s for %s (waited %.1f s)", lock_path, me, what, acquired - started)
        try:
            yield
        finally:
            if outermost:
                holder_path.unlink(missing_ok=True)  # before the release, so it never names the next holder
                log.info("compile lock %s released by %s after %.1f s", lock_path, me, time.monotonic() - acquired)
            file_lock.release()
    finally:
        _compile_thread_lock.release()


def check_flex_is_compiled(device_type: str, compiled: bool, *, batch: int, heads: int, q_len: int, kv_len: int, reason: str = "") -> None:
    """Refuse to run flex_attention uncompiled on a GPU (pure logic, testable on CPU).

    Uncompiled flex_attention materialises the [batch, heads, Q, KV] fp32 score matrix:
    batch * heads * Q * KV * 4 bytes per layer call. Worked example, 2 rows x 32 heads x
    (512 anchors x 16) queries x (3072 + 8192) keys = 23,622,320,128 bytes = 22 GiB, before the
    softmax and its backward copies. On CPU (tests, tiny sizes) that is allowed.

    Args:
        device_type: "cuda", "cpu", ... (`tensor.device.type`).
        compiled: whether the call would run the compiled graph.
        batch, heads, q_len, kv_len: the attention sizes of the call.
        reason: why it would not be compiled, for the message.
    Raises:
        DenseAttentionFallbackError: on any non-CPU device when not `compiled`.
    """
    if compiled or device_type == "cpu":
        return
    score_bytes = batch * heads * q_len * kv_len * 4
    raise DenseAttentionFallbackError(
        f"flex_attention would run uncompiled on {device_type} ({reason or 'compilation is off'}); the dense "
        f"fallback materialises the [batch {batch}, heads {heads}, Q {q_len}, KV {kv_len}] fp32 score matrix, "
        f"{score_bytes} bytes ({score_bytes / 2**30:.1f} GiB) per layer call. Unset TORCHDYNAMO_DISABLE, "
        f"TORCH_COMPILE_DISABLE and TORCHDYNAMO_SUPPRESS_ERRORS, keep torch._dynamo.config."
        f"error_on_nested_fx_trace=True and torch.compiler's stance 'default', and call "
        f"warm_up_flex_attention() in the main thread before starting worker threads; for small "
        f"debugging runs use --attention_backend sdpa."
    )


def flex_eager_reasons(compiled_fn) -> list[str]:
    """Why calling `compiled_fn` (a torch.compile'd flex_attention) now would run it eagerly; [] if it would not.

    Each reason is a state in which dynamo hands a compiled function's call to the plain Python
    function, which for flex_attention is the dense path.
    """
    config = torch._dynamo.config
    reasons = []
    if compiled_fn is flex_attention or config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        reasons.append("torch.compile is disabled: TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1")
    if config.suppress_errors:
        reasons.append("torch._dynamo.config.suppress_errors (TORCHDYNAMO_SUPPRESS_ERRORS) runs a function that fails to compile eagerly")
    if not config.error_on_nested_fx_trace:
        reasons.append(
            "torch._dynamo.config.error_on_nested_fx_trace=False runs compiled functions eagerly whenever "
            "any thread of the process is FX-tracing, i.e. compiling"
        )
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    if stance not in ("default", "fail_on_recompile"):
        reasons.append(f"torch.compiler.set_stance({stance!r}) runs compiled functions eagerly")
    fx_trace = torch.fx._symbolic_trace
    if getattr(fx_trace, "is_fx_symbolic_tracing", fx_trace.is_fx_tracing)():  # the check dynamo's wrapper makes
        reasons.append(
            "another thread is compiling: the FX-tracing flag is process-wide, so this call would fail with "
            "'Detected that you are using FX to symbolically trace a dynamo-optimized function' or run eagerly"
        )
    return reasons


def flex_shape_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> tuple:
    """Everything compiled flex specialises on, as a hashable key: equal keys run the same graph.

    Device, dtype and grad mode; shape, strides and requires_grad of q, k, v; the BlockMask's shape
    and block size; its mask_mod's code and closure (tensor shapes and strides, int values: dynamo
    guards on all of them). A key not seen before means a compile, which `get_compiled_flex_attention` runs under
    the compile lock.
    """

    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, str(value.device))
        return value if isinstance(value, (int, float, bool, str)) else type(value).__name__

    mask_mod = block_mask.mask_mod
    closure = tuple(describe(cell.cell_contents) for cell in (getattr(mask_mod, "__closure__", None) or ()))
    return (
        str(q.device),
        q.dtype,
        torch.is_grad_enabled(),
        *((tuple(t.shape), t.stride(), t.requires_grad) for t in (q, k, v)),
        tuple(block_mask.shape),
        block_mask.BLOCK_SIZE,
        getattr(mask_mod, "__code__", mask_mod),
        closure,
    )


_dynamo_configured = False


def _configure_dynamo_for_flex() -> None:
    """The dynamo limits compiled flex relies on (see FLEX_RECOMPILE_LIMIT), for every thread of the process."""
    global _dynamo_configured
    if _dynamo_configured:
        return
    _dynamo_configured = True
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.7
    fail = "fail_on_recompile_limit_hit" if hasattr(config, "fail_on_recompile_limit_hit") else "fail_on_cache_limit_hit"
    _set_config_in_every_thread(config, limit, max(FLEX_RECOMPILE_LIMIT, getattr(config, limit)))
    _set_config_in_every_thread(config, fail, True)
    log.info("dynamo: %s=%d, %s=True (compiled flex_attention must never run eagerly)", limit, getattr(config, limit), fail)


def _flex_dynamo_graphs() -> int:
    """How many compiled graphs dynamo holds for flex_attention's frame (-1 if this torch cannot say)."""
    try:
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(flex_attention.__code__))
    except (AttributeError, RuntimeError):
        return -1


_compiled_flex: dict[str, Callable] = {}  # device -> flex(q, k, v, block_mask), see get_compiled_flex_attention
_compiled_flex_lock = threading.Lock()
_warm_flex_keys: set[tuple] = set()  # flex_shape_key()s compiled and warmed in this process
_flex_compile_seconds: list[float] = []  # one entry per locked compile + warm-up
_flex_gate = threading.Condition()  # compiled flex calls (shared) vs a flex compile (exclusive), in this process
_flex_calls_running = 0
_flex_compiling = False


@contextlib.contextmanager
def _running_compiled_flex():
    """The shared side of the gate: a compiled flex call waits while this process compiles flex.

    On torch <= 2.11 a thread that calls compiled code while another thread compiles dies with
    'Detected that you are using FX to symbolically trace a dynamo-optimized function' (the FX
    tracing flag is process-wide). The compile lock serialises compiles; this gate also keeps calls
    out of a compile, so a new shape compiled lazily in one thread cannot break another thread.
    """
    global _flex_calls_running
    with _flex_gate:
        _flex_gate.wait_for(lambda: not _flex_compiling)
        _flex_calls_running += 1
    try:
        yield
    finally:
        with _flex_gate:
            _flex_calls_running -= 1
            _flex_gate.notify_all()


running_compiled = _running_compiled_flex  # the gate, for any compiled call (see compile_once_locked)


@contextlib.contextmanager
def _compiling_flex():
    """The exclusive side: wait for running compiled calls to return, keep new ones out until the end.

    Only entered under `compile_lock`, so there is one compiler at a time.
    """
    global _flex_compiling
    with _flex_gate:
        _flex_compiling = True
        _flex_gate.wait_for(lambda: _flex_calls_running == 0)
    try:
        yield
    finally:
        with _flex_gate:
            _flex_compiling = False
            _flex_gate.notify_all()


def get_compiled_flex_attention(device: torch.device | str) -> Callable:
    """flex_attention compiled for `device`, as `flex(q, k, v, block_mask) -> out`; safe to call from any thread.

    The torch.compile wrapper is built once per device (dynamic=False: one static graph per shape
    signature; fullgraph=True: no graph break can leave part of it eager), and the dynamo limits
    are set then. Dynamo compiles on a call, not here: the first call at each new
    `flex_shape_key` compiles and warms up under `compile_lock` (`_compile_and_warm_up`), later
    calls at a warm key run the compiled graph directly. Every call (and every warm-up) first checks
    that it will run compiled (`check_flex_is_compiled`).

    The returned function takes q: [batch, heads, Q, head_dim]; k, v: [batch, kv_heads, KV, head_dim]
    (heads a multiple of kv_heads); block_mask: a BlockMask of shape [batch, 1, Q, KV]; and returns
    [batch, heads, Q, head_dim].
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    flex = _compiled_flex.get(key)
    if flex is None:
        with _compiled_flex_lock:
            if key not in _compiled_flex:
                _configure_dynamo_for_flex()
                compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
                _compiled_flex[key] = functools.partial(_run_compiled_flex, compiled)
            flex = _compiled_flex[key]
    return flex


def _run_compiled_flex(compiled: Callable, q, k, v, block_mask: BlockMask) -> torch.Tensor:
    """One call of compiled flex: the locked warm-up (first time at this shape), then, inside the gate, the dense guard and the graph."""
    if torch.compiler.is_dynamo_compiling():  # inside an outer torch.compile region: traced into its graph
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    key = flex_shape_key(q, k, v, block_mask)
    if key not in _warm_flex_keys:
        _compile_and_warm_up(compiled, key, q, k, v, block_mask)
    with _running_compiled_flex():  # the guard inside the gate: a compile elsewhere is waited for, not an error
        _check_runs_compiled(compiled, q, k)
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


def _check_runs_compiled(compiled: Callable, q: torch.Tensor, k: torch.Tensor) -> None:
    """`check_flex_is_compiled` for a call of `compiled` on q [batch, heads, Q, head_dim], k [batch, kv_heads, KV, head_dim]."""
    batch, heads, q_len, _ = q.shape
    reasons = flex_eager_reasons(compiled)
    check_flex_is_compiled(q.device.type, not reasons, batch=batch, heads=heads, q_len=q_len, kv_len=k.shape[2], reason="; ".join(reasons))


def _compile_and_warm_up(compiled: Callable, key: tuple, q, k, v, block_mask: BlockMask) -> None:
    """The first call at a new shape signature: compile and run once, forward and (CUDA) backward, under compile_lock.

    It runs on detached clones of the caller's q, k, v (same shapes, strides, dtypes and
    requires_grad, so dynamo and AOTAutograd build exactly the graphs the real call uses) and the
    caller's block_mask. The backward matters: AOTAutograd compiles it lazily at the first
    backward, on CUDA in autograd's own thread; running one here keeps that compile under the lock
    too. flex_attention has no CPU backward, so on CPU only the forward is warmed.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    backward = needs_grad and q.device.type == "cuda"
    what = (
        f"flex_attention {'forward+backward' if backward else 'forward'} on {q.device}, {q.dtype}, "
        f"q {list(q.shape)}, kv {list(k.shape)}, grad {needs_grad}"
    )
    with compile_lock(what):
        if key in _warm_flex_keys:
            return  # another thread compiled it while this one waited
        start = time.perf_counter()
        with _compiling_flex():
            _check_runs_compiled(compiled, q, k)  # before anything runs: a dense warm-up would OOM
            inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v)]
            assert all(a.stride() == t.stride() for a, t in zip(inputs, (q, k, v))), "clones must keep the strides"
            out = compiled(*inputs, block_mask=block_mask, enable_gqa=True)
            if backward:
                torch.autograd.grad(out, [t for t in inputs if t.requires_grad], torch.ones_like(out))
            if q.device.type == "cuda":
                torch.cuda.synchronize(q.device)
        seconds = time.perf_counter() - start
        _warm_flex_keys.add(key)
        _flex_compile_seconds.append(seconds)
        log.info("Compilation time: %.2f seconds (%s)", seconds, what)
        log.info(
            "flex_attention compile #%d of this process; dynamo holds %d flex_attention graphs (limit %d)",
            len(_flex_compile_seconds),
            _flex_dynamo_graphs(),
            FLEX_RECOMPILE_LIMIT,
        )


def warm_up_flex_attention(
    device: torch.device | str,
    build_mask: Callable[..., BlockMask],
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    context_len: int,
    num_anchors: int,
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    training: bool = True,
    rules: tuple = ((False, None),),
) -> float:
    """Compile and warm the drafter's flex_attention for one shape, under the compile locks.

    Call it in the main thread, after `setup_compile_cache` and before any worker thread (data
    prefetch, feature receive) starts, for every (length bucket, training/eval) the run will
    start with. It builds its inputs the way `DFlashDraftModel.forward` does (q laid out
    [batch, Q, heads, head_dim] then transposed, k/v contiguous, `build_mask` over the same KV
    layout), so the real step finds the graph warm. A shape it missed is compiled at
    its first real call by the same locked path.

    Args:
        device: the rank's GPU ("cpu" in tests).
        build_mask: the drafter's mask builder, `build_mask(anchors, anchor_valid, context_len,
            block_size, causal, window) -> BlockMask` (`dflash_masks.create_anchor_block_mask`).
        batch: rows of a micro-batch; heads, kv_heads, head_dim: the drafter's attention sizes.
        context_len: S, a padded length bucket (a multiple of 128 on GPU).
        num_anchors: N, static; block_size: B. Q = N*B, KV = S + N*B.
        dtype: the drafter's compute dtype.
        training: True warms the grad graph (forward, and backward on CUDA); False the no-grad
            graph that eval passes use.
        rules: the distinct `DFlashConfig.attention_rule`s of the drafter's layers, (causal, window)
            each; every rule's mask compiles a graph of its own. Default the full rule only.
    Returns:
        Seconds spent compiling and warming (0.0 if this shape was warm already).
    """
    device = torch.device(device)
    q_len = num_anchors * block_size
    q = torch.randn(batch, q_len, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)  # [batch, heads, Q, head_dim]
    k = torch.randn(batch, kv_heads, context_len + q_len, head_dim, device=device, dtype=dtype)  # [batch, kv_heads, KV, head_dim]
    v = torch.randn_like(k)
    anchors = (torch.arange(num_anchors, device=device) % max(context_len - 1, 1)).repeat(
        batch, 1
    )  # [batch, N], contiguous like sample_anchors' output
    anchor_valid = torch.ones(batch, num_anchors, dtype=torch.bool, device=device)
    compiles = len(_flex_compile_seconds)
    with torch.set_grad_enabled(training):
        for t in (q, k, v):
            t.requires_grad_(training)
        for causal, window in dict.fromkeys(rules):
            block_mask = build_mask(anchors, anchor_valid, context_len, block_size, causal, window)
            get_compiled_flex_attention(device)(q, k, v, block_mask)
    return sum(_flex_compile_seconds[compiles:])


def compile_once_locked(key: tuple, what: str, warm_up: Callable[[], None], device: torch.device) -> None:
    """Run `warm_up` (a first call that makes torch.compile build its graphs for `key`) under
    `compile_lock` and the compile gate, once per key per process; counted in flex_compile_stats.

    The same discipline as flex's `_compile_and_warm_up`, for the other compiled pieces of a
    training step (drafter layers, the loss's per-chunk function, the target's layers). Call the
    compiled function itself afterwards inside `running_compiled()`.
    """
    if key in _warm_flex_keys:
        return
    _configure_dynamo_for_flex()
    with compile_lock(what):
        if key in _warm_flex_keys:
            return  # another thread compiled it while this one waited
        start = time.perf_counter()
        with _compiling_flex():
            warm_up()
            if device.type == "cuda":
                # This stream only: a device-wide sync would also wait for a feature send in flight.
                torch.cuda.current_stream(device).synchronize()
        seconds = time.perf_counter() - start
        _warm_flex_keys.add(key)
        _flex_compile_seconds.append(seconds)
        # Layers of one architecture share a graph: after the first, a new key is usually a cache hit.
        log.log(logging.INFO if seconds >= 0.1 else logging.DEBUG, "Compilation time: %.2f seconds (%s)", seconds, what)


def call_compiled_module(compiled: torch.nn.Module, key: tuple, what: str, tensors: tuple, *rest, checkpointed: bool = False):
    """`compiled(*tensors, *rest)` for a torch.compile'd module (a drafter decoder layer), whose first call
    at `key` compiles under the compile lock (`compile_once_locked`).

    That first call runs the module once on detached clones of `tensors` (same shapes, strides, dtypes,
    requires_grad) with a backward when grad is on (torch.autograd.grad to the clones, else to the
    parameters: it returns the gradients without writing .grad, so the parameters' .grad and
    DeepSpeed's gradient hooks are untouched), so both graphs exist before the real call and
    AOTAutograd's lazy backward compile never runs in autograd's own thread. `rest` (a mask) is
    passed as it is. `checkpointed`: the real call runs under activation checkpointing
    (non-reentrant): backward calls the compiled module again, at the same key, so the warm-up's
    graphs serve the recompute too and nothing compiles outside the lock.
    """
    grad = torch.is_grad_enabled()

    def warm_up():
        inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        out = compiled(*inputs, *rest)
        needs = [t for t in inputs if t.requires_grad] or [p for p in compiled.parameters() if p.requires_grad]
        if grad and needs:
            torch.autograd.grad(out, needs, torch.ones_like(out))

    compile_once_locked(key, what, warm_up, tensors[0].device)
    with running_compiled():
        if checkpointed and grad:
            return torch.utils.checkpoint.checkpoint(compiled, *tensors, *rest, use_reentrant=False)
        return compiled(*tensors, *rest)


def flex_compile_stats() -> dict:
    """Compile counters of this process, for the training log: every locked first call at a new
    shape key (flex, compiled drafter layers, the loss chunk, compiled target layers; a key whose
    graph dynamo already had counts too, at ~0 s).

    Returns:
        {"compiles": locked first calls so far, "compile_seconds": their total time,
        "dynamo_graphs": graphs dynamo holds for flex_attention's own frame (with eager drafter
        layers, more than the flex compiles means something compiled outside the lock:
        investigate with TORCH_LOGS=recompiles; compiled layers trace flex into their own graphs)}.
    """
    return {"compiles": len(_flex_compile_seconds), "compile_seconds": round(sum(_flex_compile_seconds), 2), "dynamo_graphs": _flex_dynamo_graphs()}


class CUDAGraphCall:
    """`fn(*inputs)` replayed from one CUDA graph per input shape.

    The first call at a shape runs `fn` twice on a side stream (warm-up: lazy initialisation,
    cuBLAS workspaces), then captures it; every later call copies the inputs into the captured
    buffers and replays the graph, which launches all of `fn`'s kernels at once. At batch size 1 a
    small model is launch-bound, so this is most of the speed of decoding on a GPU.

    `fn` must take and return tensors, run no host sync, and keep its other state at fixed
    addresses (a static KV cache) that it resets from its inputs (a replay re-runs only what the
    graph recorded). The graphs of one `CUDAGraphCall` share one memory pool (its footprint is the
    largest graph's, not their sum), so the returned tensors, the graphs' own buffers, are
    overwritten by the next call at any shape: use or copy them before calling again.
    Used by evaluation (batch-1 decoding), regeneration (batched decoding) and the target's
    feature forward in training.
    """

    def __init__(self, fn):
        self.fn = fn
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None

    def __call__(self, *inputs: torch.Tensor):
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        if key not in self.graphs:
            static_inputs = [t.clone() for t in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn(*static_inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                static_outputs = self.fn(*static_inputs)
            self.graphs[key] = (graph, static_inputs, static_outputs)
        graph, static_inputs, static_outputs = self.graphs[key]
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return static_outputs
