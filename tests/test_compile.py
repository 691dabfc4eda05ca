"""Compile safety of flex_attention (docs/compile-safety.md): one compiler at a time across ranks and threads, others
load the warm cache, no silent dense fallback, lock timeouts that name the holder.

Every compile here uses the shapes of test_model's flex test (tiny_drafter(block_size=4), _batch()), so
within one pytest session they are compiled once. Flex has no CPU backward: CPU runs forward only.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import filelock
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import dflash_compile as dc
import dflash_masks
import dflash_model as dm
from dflash_compile import (
    COMPILE_LOCK_DIR_ENV,
    CompileLockTimeout,
    DenseAttentionFallbackError,
    check_flex_is_compiled,
    compile_lock,
    compile_lock_dir,
    flex_eager_reasons,
    flex_shape_key,
    setup_compile_cache,
)
from dflash_masks import create_anchor_block_mask, dense_anchor_block_mask

# The sizes of test_model.test_compiled_flex_forward_equals_sdpa_on_cpu.
SHAPES = dict(batch=2, heads=2, kv_heads=1, head_dim=8, context_len=24, num_anchors=6, block_size=4)


def attention_inputs(seed: int = 0, context_len: int = SHAPES["context_len"]):
    """q, k, v laid out as DFlashAttention lays them out, plus the BlockMask and its dense twin."""
    g = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, head_dim = SHAPES["batch"], SHAPES["heads"], SHAPES["kv_heads"], SHAPES["head_dim"]
    num_anchors, block_size = SHAPES["num_anchors"], SHAPES["block_size"]
    q_len = num_anchors * block_size
    q = torch.randn(batch, q_len, heads, head_dim, generator=g).transpose(1, 2)  # [batch, heads, Q, head_dim]
    k = torch.randn(batch, kv_heads, context_len + q_len, head_dim, generator=g)  # [batch, kv_heads, KV, head_dim]
    v = torch.randn(batch, kv_heads, context_len + q_len, head_dim, generator=g)
    anchors = torch.stack([torch.randperm(context_len - 1, generator=g)[:num_anchors].sort().values for _ in range(batch)])
    anchor_valid = torch.ones(batch, num_anchors, dtype=torch.bool)
    anchor_valid[1, -1] = False  # a padded slot
    block_mask = create_anchor_block_mask(anchors, anchor_valid, context_len, block_size)
    dense = dense_anchor_block_mask(anchors, anchor_valid, context_len, block_size)
    return q, k, v, block_mask, dense


@pytest.fixture
def fresh_flex_state(monkeypatch, tmp_path):
    """No flex compiled in this process yet (dynamo reset, our bookkeeping cleared), locks in tmp_path."""
    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    torch._dynamo.reset()
    dc._compiled_flex.clear()
    dc._warm_flex_keys.clear()
    dc._flex_compile_seconds.clear()
    yield tmp_path
    # Leave a consistent state: whatever is in _warm_flex_keys now is also in dynamo's cache.


# ---- ranks: 4 processes on one cold shared cache -------------------------------------------------

# The 4 ranks are forks of one process that has imported torch, transformers and the drafter (~6 s of
# CPU each in a fresh interpreter) and compiled nothing: each rank sets up its compile cache itself.
RANKS = textwrap.dedent(
    """
    import json, logging, os, sys, threading, time, traceback
    from pathlib import Path
    import torch
    import dflash_compile as dc
    import dflash_masks
    sys.path.insert(0, "tests")
    from test_model import _batch, tiny_drafter

    def rank_main(root, rank, world, shapes):
        dc.setup_compile_cache("shared", root, rank, compile_threads=1)
        handler = logging.FileHandler(root / f"lock_log_{rank}.txt")
        handler.setFormatter(logging.Formatter("%(created).6f %(message)s"))
        dc.log.addHandler(handler)
        dc.log.setLevel(logging.INFO)
        torch.set_num_threads(1)
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(threads=torch._inductor.config.compile_threads))
        thread.start(); thread.join()

        (root / f"ready_{rank}").touch()  # start line: nobody compiles before all 4 are ready
        while len(list(root.glob("ready_*"))) < world:
            time.sleep(0.02)
        dc.warm_up_flex_attention("cpu", dflash_masks.create_anchor_block_mask, **shapes, dtype=torch.float32, training=False)

        drafter = tiny_drafter(block_size=4)
        input_ids, loss_mask = _batch()
        features = torch.randn(2, input_ids.shape[1], 2 * 16)
        anchors, valid = dflash_masks.sample_anchors(loss_mask, 6, torch.Generator().manual_seed(rank))
        with torch.no_grad():
            flex = drafter(features, input_ids, anchors, valid, attention_backend="flex")
            sdpa = drafter(features, input_ids, anchors, valid, attention_backend="sdpa")
        counters = torch._dynamo.utils.counters["inductor"]
        (root / f"result_{rank}.json").write_text(json.dumps({
            "max_diff": (flex - sdpa).abs().max().item(),
            "stats": dc.flex_compile_stats(),
            "fx_cache_miss": counters["fxgraph_cache_miss"],
            "fx_cache_hit": counters["fxgraph_cache_hit"],
            "compile_threads_other_thread": seen["threads"],
        }))

    root, world, shapes = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(root, rank, world, shapes)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        ranks[pid] = rank
    failed = [ranks[pid] for pid in ranks if os.waitpid(pid, 0)[1] != 0]
    sys.exit(f"ranks {failed} failed" if failed else 0)
    """
)


def test_four_processes_on_a_cold_shared_cache_compile_one_at_a_time(tmp_path, repo_root):
    root = tmp_path / "inductor"  # cold: nothing compiled here yet
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo_root), "TORCHINDUCTOR_CACHE_DIR": str(root)}
    env.pop(COMPILE_LOCK_DIR_ENV, None)
    ranks = subprocess.run(
        [sys.executable, "-c", RANKS, str(root), "4", json.dumps(SHAPES)], cwd=repo_root, env=env, capture_output=True, text=True, timeout=420
    )
    assert ranks.returncode == 0, ranks.stderr[-4000:]
    results = [json.loads((root / f"result_{rank}.json").read_text()) for rank in range(4)]

    for r in results:
        assert r["max_diff"] < 1e-5, r  # compiled flex == SDPA with the dense mask, through the whole drafter
        # One locked compile per process, and the real forward reused the warm-up's graph.
        assert r["stats"]["compiles"] == 1 and r["stats"]["dynamo_graphs"] == 1, r
        assert r["compile_threads_other_thread"] == 1  # the cap reaches threads other than the caller's
    # Exactly one process compiled (FX graph cache miss); the other three loaded its output.
    assert sorted(r["fx_cache_miss"] for r in results) == [0, 0, 0, 1], results
    assert all(r["fx_cache_hit"] >= 1 for r in results if r["fx_cache_miss"] == 0), results

    # The lock log: one acquire/release interval per process, none overlapping.
    intervals = []
    for rank in range(4):
        lines = (root / f"lock_log_{rank}.txt").read_text().splitlines()
        acquired = [float(line.split()[0]) for line in lines if " acquired by " in line]
        released = [float(line.split()[0]) for line in lines if " released by " in line]
        assert len(acquired) == len(released) == 1, lines
        intervals.append((acquired[0], released[0]))
    intervals.sort()
    for (_, end), (next_start, _) in zip(intervals, intervals[1:]):
        assert end <= next_start, f"two compilers at once: {intervals}"
    assert not (root / "flex_compile.lock.holder").exists()


# ---- threads: 4 at once on first use -------------------------------------------------------------


def test_four_threads_on_first_use_compile_once(fresh_flex_state):
    q, k, v, block_mask, dense = attention_inputs()
    barrier = threading.Barrier(4)
    outputs, errors = [None] * 4, []

    def first_use(i):
        try:
            barrier.wait()
            with torch.no_grad():  # grad mode is per thread
                outputs[i] = dc.get_compiled_flex_attention("cpu")(q, k, v, block_mask)
        except Exception as error:  # noqa: BLE001 - reported by the assert below
            errors.append(error)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    stats = dc.flex_compile_stats()
    assert stats["compiles"] == 1 and stats["dynamo_graphs"] == 1, stats


def test_compiled_calls_and_a_compile_exclude_each_other():
    # torch <= 2.11: a thread calling compiled code while another compiles dies (the FX-tracing flag is process-wide).
    entered, leave = threading.Event(), threading.Event()

    def call():
        with dc._running_compiled_flex():
            entered.set()
            leave.wait(10)

    with dc._compiling_flex():
        caller = threading.Thread(target=call)
        caller.start()
        assert not entered.wait(0.3), "a compiled call ran during a compile"
    assert entered.wait(5)  # released when the compile ends
    compiled = threading.Event()

    def compile_():
        with dc._compiling_flex():
            compiled.set()

    compiler = threading.Thread(target=compile_)
    compiler.start()
    assert not compiled.wait(0.3), "a compile started while a compiled call was running"
    leave.set()
    assert compiled.wait(5)
    caller.join()
    compiler.join()


def test_shape_key_tracks_what_dynamo_specialises_on():
    q, k, v, block_mask, _ = attention_inputs(seed=0)
    q2, k2, v2, block_mask2, _ = attention_inputs(seed=1)  # same shapes, other anchors and values
    assert flex_shape_key(q, k, v, block_mask) == flex_shape_key(q2, k2, v2, block_mask2)
    longer = attention_inputs(context_len=40)
    assert flex_shape_key(*longer[:4]) != flex_shape_key(q, k, v, block_mask)  # a new length bucket
    assert flex_shape_key(q.contiguous(), k, v, block_mask) != flex_shape_key(q, k, v, block_mask)  # strides
    key = flex_shape_key(q, k, v, block_mask)
    with torch.no_grad():
        assert flex_shape_key(q, k, v, block_mask) != key  # grad mode
    expanded = create_anchor_block_mask(torch.zeros(1, 6, dtype=torch.long).expand(2, 6), torch.ones(2, 6, dtype=torch.bool), 24, 4)
    assert flex_shape_key(q, k, v, expanded) != flex_shape_key(q, k, v, block_mask)  # closure tensor strides


# ---- no silent dense path --------------------------------------------------------------------------


def test_dense_fallback_guard_states_the_score_bytes():
    sizes = dict(batch=2, heads=32, q_len=512 * 16, kv_len=3072 + 512 * 16)
    with pytest.raises(DenseAttentionFallbackError) as info:
        check_flex_is_compiled("cuda", False, **sizes, reason="TORCHDYNAMO_DISABLE=1")
    message = str(info.value)
    assert f"{2 * 32 * 8192 * 11264 * 4} bytes" in message and "23622320128 bytes (22.0 GiB)" in message
    assert "TORCHDYNAMO_DISABLE=1" in message and "warm_up_flex_attention" in message
    check_flex_is_compiled("cuda", True, **sizes)  # compiled: fine
    check_flex_is_compiled("cpu", False, **sizes)  # CPU: tests and tiny sizes may run dense


def test_eager_reasons_name_each_dense_path(monkeypatch):
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)  # compiles nothing until called
    assert flex_eager_reasons(compiled) == []
    assert any("disabled" in r for r in flex_eager_reasons(flex_attention))  # torch.compile gave back the eager function
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert any("TORCHDYNAMO_DISABLE" in r for r in flex_eager_reasons(compiled))
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
        assert any("error_on_nested_fx_trace" in r for r in flex_eager_reasons(compiled))
    with torch._dynamo.config.patch(suppress_errors=True):
        assert any("suppress_errors" in r for r in flex_eager_reasons(compiled))
    with torch.compiler.set_stance("force_eager"):
        assert any("force_eager" in r for r in flex_eager_reasons(compiled))
    with monkeypatch.context() as patch:
        patch.setattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", True)  # as while another thread compiles
        assert any("another thread is compiling" in r for r in flex_eager_reasons(compiled))
    assert flex_eager_reasons(compiled) == []


def test_attention_refuses_uncompiled_flex_off_cpu(monkeypatch, tmp_path):
    # TORCHDYNAMO_DISABLE makes torch.compile return flex_attention itself. Meta tensors stand in for a
    # GPU at full size (no memory): the guard must fire before anything runs, warm-up included.
    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    _, _, _, block_mask, _ = attention_inputs()
    q = torch.empty(2, 32, 8192, 128, device="meta")
    k = v = torch.empty(2, 8, 11264, 128, device="meta")
    try:
        with pytest.raises(DenseAttentionFallbackError, match=r"torch.compile is disabled.*23622320128 bytes"):
            dm.attention(q, k, v, block_mask)
    finally:
        dc._compiled_flex.pop("meta", None)  # drop the uncompiled wrapper built under TORCHDYNAMO_DISABLE
    assert not (tmp_path / "flex_compile.lock.holder").exists()  # the lock was released on the error


# ---- lock timeouts and cache setup ---------------------------------------------------------------


def test_lock_timeout_names_the_holder_and_the_lock_path(monkeypatch, tmp_path):
    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    lock_path, holder_path = tmp_path / "flex_compile.lock", tmp_path / "flex_compile.lock.holder"
    other_rank = filelock.FileLock(str(lock_path))  # another rank's hold: a FileLock of its own
    other_rank.acquire()
    holder = {"pid": 4242, "host": "node-7", "thread": "MainThread", "what": "flex_attention on cuda:3", "since": time.time()}
    holder_path.write_text(json.dumps(holder))
    try:
        start = time.monotonic()
        with pytest.raises(CompileLockTimeout) as info:
            with compile_lock("test", timeout_s=0.5):
                pass
        assert 0.4 < time.monotonic() - start < 5
    finally:
        other_rank.release()
    message = str(info.value)
    assert "pid 4242 on node-7" in message and "flex_attention on cuda:3" in message and str(lock_path) in message
    # Free again: we hold it, the sidecar names us while we do and disappears on release.
    with compile_lock("test", timeout_s=5):
        assert json.loads(holder_path.read_text())["pid"] == os.getpid()
    assert not holder_path.exists()


def test_lock_timeout_inside_one_process_names_the_holding_thread(monkeypatch, tmp_path):
    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    held, release = threading.Event(), threading.Event()

    def hold():
        with compile_lock("a worker thread's warm-up"):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, name="holder-thread")
    holder.start()
    assert held.wait(10)
    try:
        with pytest.raises(CompileLockTimeout) as info:
            with compile_lock("test", timeout_s=0.3):
                pass
    finally:
        release.set()
        holder.join()
    message = str(info.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message and "holder-thread" in message
    assert str(tmp_path / "flex_compile.lock") in message


def test_setup_compile_cache_modes(monkeypatch, tmp_path):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", COMPILE_LOCK_DIR_ENV):
        monkeypatch.setenv(name, "")  # recorded, so teardown restores what was there before
        monkeypatch.delenv(name)
    monkeypatch.setattr(dc, "_warm_flex_keys", set())  # as if nothing had compiled in this process
    root = tmp_path.resolve()
    assert setup_compile_cache("per_rank", tmp_path, rank=3) == root
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "rank_3")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "rank_3" / "triton")
    assert compile_lock_dir() == root  # the lock stays at the shared root
    assert setup_compile_cache("shared", tmp_path, rank=3) == root
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root)
    with pytest.raises(ValueError, match="--compile_cache"):
        setup_compile_cache("per_node", tmp_path)
    monkeypatch.setattr(dc, "_warm_flex_keys", {("a compiled key",)})
    with pytest.raises(RuntimeError, match="before the first"):
        setup_compile_cache("shared", tmp_path)


def test_compiled_drafter_layers_and_loss_match_eager_and_compile_under_the_lock(fresh_flex_state, caplog):
    """DFlashDraftModel.compile_layers + weighted_block_loss(compiled=True), on CPU through SDPA (flex has no
    CPU backward): the same loss and gradients as eager; every compile, forward and backward, happens
    in the locked warm-up (one per layer and shape), and a second step at the same shape compiles nothing."""
    import logging

    from test_model import _batch, tiny_drafter

    from dflash_loss import loss_weights, weighted_block_loss

    def step(drafter, compiled):
        torch.manual_seed(0)
        input_ids, loss_mask = _batch()
        features = torch.randn(2, input_ids.shape[1], 2 * 16)
        anchors, valid = dflash_masks.sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1))
        hidden = drafter(features, input_ids, anchors, valid, attention_backend="sdpa")
        labels, label_valid = dflash_masks.block_labels(input_ids, loss_mask, anchors, valid, 4)
        loss, _ = weighted_block_loss(
            hidden[:, :, 1:], drafter.target_lm_head.weight, labels, label_valid, loss_weights(4, gamma=3.0), compiled=compiled
        )
        drafter.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]

    eager_loss, eager_grads = step(tiny_drafter(block_size=4).train(), compiled=False)
    drafter = tiny_drafter(block_size=4).train()
    drafter.compile_layers()
    with caplog.at_level(logging.DEBUG, logger="dflash_compile"):  # a warm inductor cache logs its fast compiles at DEBUG
        loss, grads = step(drafter, compiled=True)
    compiles = dc.flex_compile_stats()["compiles"]
    # 2 layers (forward+backward each) + the loss chunk; each announced by the lock.
    assert compiles == 3, caplog.text
    assert caplog.text.count("Compilation time") == 3 and caplog.text.count("drafter layer") >= 2
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    loss_again, _ = step(drafter, compiled=True)
    assert dc.flex_compile_stats()["compiles"] == 3 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    torch.testing.assert_close(loss_again, loss)


def test_compiled_distribution_loss_with_dpace_matches_eager_and_compiles_once(fresh_flex_state):
    """weighted_block_loss(compiled=True) with the LK hybrid and D-PACE weights: the compiled per-row chunk gives the
    eager loss and gradient, compiles under the lock once, and a second call compiles nothing."""
    from dflash_loss import weighted_block_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 5, 8, generator=g).requires_grad_(True)  # [batch, N, B-1, hidden]
    target_hidden = torch.randn(2, 3, 5, 8, generator=g)
    head = torch.randn(40, 8, generator=g)
    labels = torch.randint(0, 40, (2, 3, 5), generator=g)
    valid = torch.rand(2, 3, 5, generator=g) > 0.3
    results = []
    for compiled in (False, True, True):
        loss, accepted = weighted_block_loss(
            hidden,
            head,
            labels,
            valid,
            None,
            chunk_size=4,
            compiled=compiled,
            final_logit_softcapping=5.0,
            loss="lk",
            target_hidden=target_hidden,
            loss_weighting="dpace",
        )
        (grad,) = torch.autograd.grad(loss, hidden)
        results.append((loss, accepted, grad))
        if compiled:
            assert dc.flex_compile_stats()["compiles"] == 1
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(other[1], results[0][1], equal_nan=True)
        torch.testing.assert_close(other[2], results[0][2], rtol=1e-4, atol=1e-6)


def test_compile_safety_and_the_loss_sit_under_the_model(repo_root):
    """dflash_compile.py imports no module of this repo, dflash_loss_kernels.py only dflash_compile.py and
    dflash_loss.py only dflash_loss_kernels.py:
    what a warm-up needs from the drafter (the mask builder, the shapes) is passed in, and the loss
    takes hidden states and the head's weight, not the model."""
    import ast

    project = {p.stem for p in repo_root.glob("*.py")}
    for name, allowed in (("dflash_compile.py", set()), ("dflash_loss_kernels.py", {"dflash_compile"}), ("dflash_loss.py", {"dflash_loss_kernels"})):
        tree = ast.parse((repo_root / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert imported & project == allowed, (name, imported & project)
