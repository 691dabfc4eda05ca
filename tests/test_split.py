"""Split mode (--target_ranks N) on CPU over gloo: 1 target rank + 2 drafter ranks, trained on the
target's argmax labels (--label_source target_argmax), which travel with the features.

One split run (a module fixture) is checked from several sides: every sample trained exactly once
per epoch, identical weights on both drafter ranks, bit-identical to the colocated run on 2 ranks
(which the `auto` calibration picks for this tiny target), checkpoint and resume. Killing or
freezing a rank stops the others within a minute. The split run is launched the way a user launches
it (accelerate launch); the runs compared with it and the kill tests start the ranks themselves (see
`launch_ranks`), as forked runs of one process that has imported the trainer's libraries.
"""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import launch_ranks, run_args, stop_ranks
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def accelerate_launch(args, env, nproc, timeout=300, config="accelerate_configs/cpu.yaml"):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", str(nproc), "train_dflash.py", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def forked_launch(args, env, nproc, log_dir, runs, timeout=300):
    """The ranks of a run as forked runs of `runs` (conftest's launch_ranks), for runs that are
    compared with the split run rather than launched as users launch them; a CompletedProcess whose
    returncode is the first failing rank's (else 0) and whose stderr holds every rank's output."""
    log_dir.mkdir(parents=True, exist_ok=True)
    store, procs = launch_ranks(args, env, nproc, log_dir, runs=runs)
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        stop_ranks(procs)
        del store
    output = "".join((log_dir / f"rank{rank}.log").read_text() for rank in range(nproc))
    return subprocess.CompletedProcess(args, next((code for code in codes if code), 0), "", output)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def final_weights(output_dir):
    return load_file(Path(output_dir) / "final" / "model.safetensors")


def assert_same_weights(a, b):
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# What every run compared with the split run shares: a DFlash2 drafter (its selector's loss beside the
# drafter's), labels from the target's argmax and, for the LK loss against the target's distribution,
# its last hidden state (both travel with the features), D-PACE weights, and 16 anchors per sample, so
# that a drafter step (its LM head, the target's head for LK and the selector's top-k, over 16 x 7
# block positions) costs clearly more than the target's forward (its head over <= 192 tokens) and
# --target_ranks auto's choice of colocated here does not hinge on timing noise (measured: the
# target supplies ~5x what a drafter rank takes; colocated needs > 1.22x). The selector's codebooks
# are 16 wide, not 256: two 151,936 x 256 codebooks made each step's update and ZeRO-2 reduction
# cost more than its loss. 10 samples: 5 micro-batches of 2 per epoch, so the 2 drafter ranks take 3
# micro-steps per epoch, the last with a zero-loss filler. The default DFlash drafter with CE runs
# split in test_topology.py.
SHARED = dict(drafter="dflash2", label_source="target_argmax", num_anchors=16, loss="lk", loss_weighting="dpace", selector_rank=16, max_samples=10)


@pytest.fixture(scope="module")
def split_run(trainable_qwen3_target, gsm8k_path, train_env, tmp_path_factory):
    """1 target + 2 drafter ranks, 2 epochs (6 optimizer steps), a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("split") / "run"
    debug = out.parent / "debug"
    env = dict(train_env, DFLASH_DEBUG_LOG=str(debug))
    started = time.time()
    result = accelerate_launch(run_args(trainable_qwen3_target, gsm8k_path, out, target_ranks=1, save_steps=2, **SHARED), env, nproc=3)
    print(f"split run: {time.time() - started:.0f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, debug, result.stderr


def test_split_run_logs_both_sides_and_checkpoints(split_run):
    out, _, stderr = split_run
    assert "Split mode: target ranks [0] feed drafter ranks [1, 2]; rank 1 leads" in stderr
    assert "Loss weights D-PACE (alpha 0.50); --loss lk, normalised by the sum of weights" in stderr
    assert re.search(r"Target rank 0 done: 20 samples", stderr), "the target rank made 10 samples x 2 epochs"
    log = read_jsonl(out / "train_log.jsonl")
    assert [row["step"] for row in log] == [2, 4, 6]
    for row in log:
        assert math.isfinite(row["loss"]) and row["loss"] > 0
        # Supply (target forward), demand (drafter steps), end to end, and the drafters' wait.
        assert row["target_samples_per_s"] > 0 and row["target_tokens_per_s"] > 0 and 0 <= row["target_idle_frac"] <= 1
        assert row["drafter_samples_per_s"] > 0 and row["samples_per_s"] > 0 and row["drafter_wait_s"] >= 0
    # The tiny random target's head bounds what the drafter can express; the fall is modest but clear.
    assert log[-1]["loss"] < 0.95 * log[0]["loss"], log
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not list(out.glob(".tmp-*"))
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state == {"global_step": 2, "epoch": 0, "micro_step_in_epoch": 2, "target_ranks": 1, "drafter_ranks": 2}
    # Shards by drafter rank, written by the drafter ranks only.
    assert sorted(p.name for p in (out / "checkpoint-2").glob("rng_state_*")) == ["rng_state_0.pt", "rng_state_1.pt"]
    config = json.loads((out / "final" / "config.json").read_text())  # the lead (rank 1) exported
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 16
    from dflash_decoding import load_drafter

    reloaded = load_drafter(str(out / "final"), torch.float32, torch.device("cpu"))
    assert type(reloaded).__name__ == "DFlash2DraftModel"
    assert_same_weights(final_weights(out), {k: v for k, v in reloaded.state_dict().items() if k in final_weights(out)})


def test_every_sample_once_per_epoch_and_identical_drafters(split_run):
    out, debug, stderr = split_run
    num_samples = int(re.search(r"(\d+) samples, 3 ranks \(2 drafter\)", stderr).group(1))
    assert num_samples == 10
    rows = {rank: read_jsonl(f"{debug}.rank{rank}.jsonl") for rank in (1, 2)}
    assert not Path(f"{debug}.rank0.jsonl").exists(), "the target rank trains nothing"
    for epoch in (0, 1):
        trained = [i for rank in (1, 2) for row in rows[rank] if row.get("epoch") == epoch for i in row["ids"]]
        assert sorted(trained) == list(range(num_samples)), f"epoch {epoch}: each sample exactly once"
    # Epochs are reshuffled, and the drafter ranks trained different samples.
    assert [r["ids"] for r in rows[1] if r.get("epoch") == 0] != [r["ids"] for r in rows[1] if r.get("epoch") == 1]
    digests = {rank: [r["weights_sha256"] for r in rows[rank] if "weights_sha256" in r] for rank in (1, 2)}
    assert len(digests[1]) == 1 and digests[1] == digests[2], "ZeRO-2 keeps the drafter ranks' weights identical"


def test_auto_picks_colocated_here_and_matches_the_split_run_bit_for_bit(
    split_run, trainable_qwen3_target, gsm8k_path, train_env, train_runs, tmp_path
):
    """Colocated on 2 ranks trains the same batches per drafter rank with the same anchors as the
    split run with 2 drafter ranks, so the weights must match exactly: the transport changes
    nothing. Here the target's forward runs several times faster than a drafter step (`SHARED`), so the
    calibration keeps every rank busy with both (N=0). The ranks are forked runs (`forked_launch`)."""
    out, _, _ = split_run
    colocated = tmp_path / "colocated"
    args = run_args(trainable_qwen3_target, gsm8k_path, colocated, target_ranks="auto", **SHARED)
    result = forked_launch(args, train_env, 2, tmp_path / "logs", train_runs)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--target_ranks auto over 2 ranks" in result.stderr and "N=1: 1 target + 1 drafter ranks" in result.stderr
    assert "=> --target_ranks 0" in result.stderr and "Split mode" not in result.stderr
    assert_same_weights(final_weights(out), final_weights(colocated))


def test_resume_in_split_mode_is_bit_identical(split_run, trainable_qwen3_target, gsm8k_path, train_env, train_runs, tmp_path):
    """The ranks of the resumed run are forked runs (`forked_launch`)."""
    out, debug, _ = split_run
    resumed, resumed_debug = tmp_path / "resumed", tmp_path / "resumed_debug"
    env = dict(train_env, DFLASH_DEBUG_LOG=str(resumed_debug))
    # auto on resume keeps the checkpoint's split (the batch plan depends on it).
    # From step 2 of 3 in epoch 0: the resumed run finishes that epoch and runs the reshuffled next one.
    args = run_args(trainable_qwen3_target, gsm8k_path, resumed, target_ranks="auto", resume_from_checkpoint=out / "checkpoint-2", **SHARED)
    result = forked_launch(args, env, 3, tmp_path / "logs", train_runs)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--target_ranks auto: 1, as in the checkpoint being resumed" in result.stderr
    assert_same_weights(final_weights(out), final_weights(resumed))
    assert [row["step"] for row in read_jsonl(resumed / "train_log.jsonl")] == [4, 6]
    for rank in (1, 2):  # the resumed run trains exactly what the straight run trained after step 2
        straight = [r for r in read_jsonl(f"{debug}.rank{rank}.jsonl") if "ids" in r]
        assert [r for r in read_jsonl(f"{resumed_debug}.rank{rank}.jsonl") if "ids" in r] == straight[2:]


@pytest.mark.parametrize("victim, how", [(2, signal.SIGSTOP), (0, signal.SIGKILL)], ids=["freeze-drafter", "kill-target"])
def test_a_dead_rank_stops_the_others_within_a_minute(victim, how, trainable_qwen3_target, gsm8k_path, train_env, train_runs, tmp_path):
    """SIGKILL of the target rank: the drafters' receives fail at once (gloo sees the closed socket).
    SIGSTOP of a drafter rank keeps its sockets open, like a dead peer under NCCL: only the
    heartbeat can tell, after --liveness_timeout_s. The ranks are forked runs (conftest's train_runs)."""
    debug = tmp_path / "debug"
    env = dict(train_env, DFLASH_DEBUG_LOG=str(debug))
    args = run_args(trainable_qwen3_target, gsm8k_path, tmp_path / "out", target_ranks=1, num_train_epochs=100, liveness_timeout_s=10)
    store, procs = launch_ranks(args, env, 3, tmp_path, runs=train_runs)
    try:
        deadline = time.time() + 240
        while not (Path(f"{debug}.rank1.jsonl").exists() and len(Path(f"{debug}.rank1.jsonl").read_text().splitlines()) >= 3):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "the run did not start training"
            time.sleep(0.5)
        procs[victim].send_signal(how)
        stopped = time.time()
        for rank, proc in enumerate(procs):
            if rank != victim:
                code = proc.wait(timeout=60)
                assert code not in (0, None), f"rank {rank} exited {code}"
        print(f"{how.name} rank {victim}: the others exited after {time.time() - stopped:.0f} s")
        output = {rank: (tmp_path / f"rank{rank}.log").read_text() for rank in range(3) if rank != victim}
        if how == signal.SIGSTOP:
            for text in output.values():
                assert f"rank {victim} sent no heartbeat for" in text, text[-2000:]
        else:
            assert all("Traceback" in text or "stopping rank" in text for text in output.values())
    finally:
        stop_ranks(procs)
        del store


def test_choose_target_ranks():
    from dflash_topology import choose_target_ranks

    # A public measurement at Qwen3-8B shapes: one target GPU supplies ~50 samples/s, one drafter GPU takes ~7.
    n, lines = choose_target_ranks(50.0, 7.0, 8)
    assert n == 1 and any("N=1: 1 target + 7 drafter ranks -> 49.00 samples/s (targets idle 2% of the time)" in line for line in lines)
    assert choose_target_ranks(50.0, 7.0, 16)[0] == 2  # 2 x 50 >= 14 x 7
    assert choose_target_ranks(10.0, 10.0, 4)[0] == 2  # balanced sides: half and half
    # 2 ranks and a cheap target: a split leaves the target rank idle most of the time.
    n, lines = choose_target_ranks(50.0, 7.0, 2)
    assert n == 0 and "N=0" in lines[-1]
    assert choose_target_ranks(50.0, 7.0, 1)[0] == 0


@pytest.mark.parametrize("drafters, accumulation", [(1, 1), (2, 1), (3, 2)])
def test_train_plan_covers_every_sample_once_and_resumes(drafters, accumulation):
    from dflash_schedule import epoch_batches, train_plan
    from train_dflash import TrainSettings

    settings = TrainSettings(target_model="x", train_data=["x"], per_device_batch_size=2, gradient_accumulation_steps=accumulation, seed=3)
    lengths = [(7 * i) % 23 + 1 for i in range(19)]  # 10 micro-batches of 2 (the last one of 1)
    per_epoch = len(epoch_batches(lengths, settings, 0, drafters)) // drafters
    plan = list(train_plan(lengths, settings, 0, 0, 2 * per_epoch, drafters))
    assert len(plan) == 2 * per_epoch and per_epoch % accumulation == 0
    for epoch in (0, 1):
        rows = [batches for e, _, batches in plan if e == epoch]
        trained = sorted(i for batches in rows for ids, trains in batches if trains for i in ids)
        assert trained == list(range(len(lengths)))
        assert all(len(batches) == drafters and all(ids for ids, _ in batches) for batches in rows), "fillers have data"
    # Resuming mid-epoch continues the same plan.
    assert list(train_plan(lengths, settings, 0, 2, 2 * per_epoch - 2, drafters)) == plan[2:]


def test_transport_is_quiet_across_a_checkpoint(monkeypatch):
    """Under NCCL a barrier synchronises the whole device, so a feature send or receive in flight
    during DeepSpeed's save barriers deadlocks. The sender's flush() returns only when every queued
    batch has been received; the receiver posts no receive past a save (None in its schedule) until
    resume(). Checked here with dist.send/recv replaced by recorders."""
    import threading

    import dflash_split
    from dflash_split import BATCH, END, HEADER, FeatureReceiver, FeatureSender

    # Receiver: 2 micro-batches, a save, 1 more, then END.
    headers = [[BATCH, 0, i, 1, 4, 8, 0, 4] + [0] * 4 for i in range(3)] + [[END] + [0] * (len(HEADER) - 1)]
    received = []

    def fake_recv(tensor, src, group=None):
        if tensor.shape == (len(HEADER),):
            tensor.copy_(torch.tensor(headers[sum(kind == "header" for kind in received)]))
            received.append("header")
        else:
            received.append("data")

    monkeypatch.setattr(dflash_split.dist, "recv", fake_recv)
    schedule = [(0, 0, 0), (0, 0, 1), None, (0, 0, 2)]
    receiver = FeatureReceiver(None, [0], torch.device("cpu"), depth=8, schedule=iter(schedule), feature_dim=8, dtype=torch.float32)
    assert [receiver.get()["index"] for _ in range(2)] == [0, 1]
    time.sleep(0.5)  # the thread had time to run ahead (queue depth 8): it must not
    assert received == ["header", "data", "data"] * 2, "a receive was posted past the checkpoint"
    receiver.resume()
    assert receiver.get()["index"] == 2
    receiver.finish()
    assert received == ["header", "data", "data"] * 3 + ["header"]

    # Sender: flush() waits for sends that complete slowly (a drafter still receiving).
    sent, lock = [], threading.Lock()

    def slow_send(tensor, dest, group=None):
        time.sleep(0.1)
        with lock:
            sent.append(dest)

    monkeypatch.setattr(dflash_split.dist, "send", slow_send)
    sender = FeatureSender(None, [1], torch.device("cpu"), depth=4)
    for i in range(3):
        ids = torch.zeros(1, 4, dtype=torch.long)
        sender.put(1, BATCH, 0, i, ids, torch.ones(1, 4), ids, torch.zeros(1, 4, 8), 4, 0.0)
    sender.flush()
    assert len(sent) == 9, f"flush returned with {9 - len(sent)} sends still in flight"
    sender.finish()
    assert len(sent) == 10  # + END


@pytest.mark.parametrize("drafters, accumulation", [(1, 1), (2, 2)])
def test_schedule_counts_steps_and_refuses_another_number_of_drafter_ranks(drafters, accumulation):
    """make_schedule: steps per epoch from the plan, --max_steps or epochs in all, the micro-steps left
    after the resume point; a checkpoint of another number of drafter ranks is refused, naming the fix."""
    from dflash_schedule import ResumePoint, make_schedule
    from train_dflash import TrainData, TrainSettings

    lengths = [(7 * i) % 23 + 1 for i in range(19)]
    data = TrainData(dataset=None, lengths=lengths, eval_prompts=None, chat_kwargs=None)
    settings = TrainSettings(
        target_model="x", train_data=["x"], per_device_batch_size=2, gradient_accumulation_steps=accumulation, num_train_epochs=3
    )
    schedule = make_schedule(settings, data, ResumePoint(None, {}), drafters)
    assert schedule.total_steps == 3 * schedule.steps_per_epoch and schedule.num_epochs == 3
    assert schedule.micro_steps_left == schedule.total_steps * accumulation
    resumed = ResumePoint("ckpt", {"global_step": 2, "epoch": 0, "micro_step_in_epoch": 2 * accumulation, "drafter_ranks": drafters})
    resumed_schedule = make_schedule(settings, data, resumed, drafters)
    assert resumed_schedule.micro_steps_left == (schedule.total_steps - 2) * accumulation
    plan = list(resumed_schedule.plan(data, settings, resumed, drafters))
    assert plan[0][:2] == (0, 2 * accumulation) and len(plan) == (schedule.total_steps - 2) * accumulation
    with pytest.raises(ValueError, match="same number of processes"):
        make_schedule(settings, data, ResumePoint("ckpt", {"drafter_ranks": drafters + 1}), drafters)


def test_compute_follows_the_backend():
    """resolve_compute: auto is flex on a GPU and SDPA on CPU; padding and compilation follow the backend."""
    from train_dflash import TrainSettings, resolve_compute

    cpu = resolve_compute(TrainSettings(target_model="x", train_data=["x"]), torch.device("cpu"))
    assert (cpu.backend, cpu.pad_multiple, cpu.compile_drafter, cpu.compile_target) == ("sdpa", 8, False, False)
    flex = resolve_compute(TrainSettings(target_model="x", train_data=["x"], attention_backend="flex"), torch.device("cpu"))
    assert (flex.backend, flex.pad_multiple, flex.compile_drafter, flex.compile_target) == ("flex", 128, True, True)
    assert resolve_compute(TrainSettings(target_model="x", train_data=["x"], dtype="bfloat16"), torch.device("cpu")).dtype == torch.bfloat16
