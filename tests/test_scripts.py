"""CPU smoke runs of the top-level scripts, each in a tiny mode, launched the way a user launches them,
so a stale import or a broken command line fails here. train_dflash.py's smoke run is in test_train.py
(test_short_run_exports_a_model_card_pushes_it_and_logs_through_the_bar).

The runs are subprocesses, started two at a time (`run_two_at_a_time`); in the module fixture every
test checks one script's run.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_two_at_a_time(commands: dict, env: dict, timeout: int = 300) -> dict:
    """{script: CompletedProcess} of `python script *args` for each {script: args}, two at a time: a
    run is mostly a single-threaded import, so two share the 2 CPU cores of CI."""

    def launch(script):
        return subprocess.run([sys.executable, script, *commands[script]], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(commands, pool.map(launch, commands)))


@pytest.fixture(scope="module")
def smoke_runs(tiny_qwen3_target, train_env, tmp_path_factory) -> dict:
    """{script: (CompletedProcess, its output folder)} for one tiny run of each script."""
    from transformers import AutoConfig

    from dflash_model import DFlashDraftModel
    from dflash_target import drafter_config_for_target

    root = tmp_path_factory.mktemp("smoke")
    drafter = root / "drafter"
    config = drafter_config_for_target(AutoConfig.from_pretrained(tiny_qwen3_target), mask_token_id=151669, num_draft_layers=1, block_size=4)
    DFlashDraftModel(config).save_pretrained(drafter)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 3?"}) + "\n" + json.dumps({"question": "Name a color."}) + "\n")
    run_dir = root / "trained"  # what plot_tau.py reads: a train_dflash.py --output_dir with held-out tau
    run_dir.mkdir()
    run_dir.joinpath("train_log.jsonl").write_text(
        "".join(
            json.dumps(row) + "\n"
            for row in [{"step": 5, "loss": 9.0, "tau_estimate": 1.1}, {"step": 5, "eval_tau": 1.2}, {"step": 10, "eval_tau": 1.4}]
        )
    )
    commands = {
        # A DFlash2 drafter: its step is DFlash's plus the selector's loss, so the run covers both.
        "bench_dflash.py": [
            "--device",
            "cpu",
            "--tiny",
            "--quick",
            "--variant",
            "baseline",
            "--objectives",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--no_append",
            "--drafter",
            "dflash2",
        ],
        # Dynamo off: the harness's threads, locks, warm-ups and loss run, without minutes of C++ compiles
        # (flex then runs eagerly, which the CPU allows).
        "tools/gpu/bench_compile_race.py": [
            "race",
            "--device",
            "cpu",
            "--pattern",
            "ours",
            "--runs",
            "2",
            "--parallel",
            "2",
            "--steps",
            "1",
            "--log-dir",
            str(root / "race_logs"),
            "--record-to",
            str(root / "BENCHMARKS.md"),
        ],
        "plot_tau.py": [str(run_dir), "--baseline", "prompt lookup=1.3", "--output", str(root / "tau.png")],
        "eval_dflash.py": [
            "--target_model",
            str(tiny_qwen3_target),
            "--draft_model",
            str(drafter),
            "--data",
            str(prompts),
            "--num_prompts",
            "1",
            "--max_new_tokens",
            "4",
            "--output",
            str(root / "eval.json"),
        ],
        "regenerate_data.py": [
            "--target_model",
            str(tiny_qwen3_target),
            "--prompts",
            str(prompts),
            "--output",
            str(root / "regenerated.jsonl"),
            "--max_new_tokens",
            "4",
            "--temperature",
            "0",
        ],
    }
    results = run_two_at_a_time(commands, dict(train_env, TORCHDYNAMO_DISABLE="1", HF_HUB_OFFLINE="1"))
    return {script: (result, root) for script, result in results.items()}


def _ok(smoke_runs, script):
    result, root = smoke_runs[script]
    assert result.returncode == 0, f"{script}: exit {result.returncode}\n{result.stderr[-4000:]}"
    return result, root


def test_bench_dflash_tiny(smoke_runs):
    result, _ = _ok(smoke_runs, "bench_dflash.py")
    assert "| baseline | 8 | 64 | 2 |" in result.stdout  # (a) drafter step, headline tiny shape
    assert "(b) target supply" in result.stdout and "(c) colocated on 1 GPU" in result.stdout  # measured without --drafter_only
    for lever in ("dpace", "loss_kl", "loss_tv", "loss_nla", "loss_lk"):  # --objectives: every loss objective beside CE
        assert f"| baseline+{lever} | 16 | 128 | 1 |" in result.stdout


def test_bench_compile_race_records_the_summary_table(smoke_runs):
    result, root = _ok(smoke_runs, "tools/gpu/bench_compile_race.py")
    recorded = (root / "BENCHMARKS.md").read_text()
    assert "| pattern | runs | reproduced (FX error or hang) | unrelated errors | clean | median seconds |" in recorded
    assert "| ours | 2 | 0 | 0 | 2 |" in recorded, recorded
    assert (
        "3 threads at lengths [64, 96, 128], loss checkpoint reentrant, attention layer not checkpointed, timeout 90 s, 2 runs in parallel"
        in recorded
    )
    assert len(list((root / "race_logs").glob("race_ours_*.log"))) == 2


def test_plot_tau(smoke_runs):
    _, root = _ok(smoke_runs, "plot_tau.py")
    assert (root / "tau.png").stat().st_size > 1000


def test_eval_dflash(smoke_runs):
    _, root = _ok(smoke_runs, "eval_dflash.py")
    results = json.loads((root / "eval.json").read_text())
    assert results["lossless"] is True and results["num_prompts"] == 1


def test_regenerate_data(smoke_runs):
    _, root = _ok(smoke_runs, "regenerate_data.py")
    rows = [json.loads(line) for line in (root / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["messages"][-1]["role"] == "assistant" for row in rows)


def test_race_outcomes_count_only_the_fx_error_and_hangs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_compile_race", REPO / "tools" / "gpu" / "bench_compile_race.py")
    race = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(race)

    fx = f"RuntimeError: {race.FX_TRACE_ERROR}. This is not supported at the moment."
    assert race.classify_run(True, None, "") == "hang"
    assert race.classify_run(False, None, f"Traceback ...\n{fx}\n") == "fx-error"  # the child died of it
    assert race.classify_run(False, {"status": "error", "errors": [f"thread 1: {fx}"]}, "") == "fx-error"
    assert race.classify_run(False, {"status": "error", "errors": ["thread 0: ImportError: cannot import name"]}, "") == "error"
    assert race.classify_run(False, None, "Segmentation fault") == "error"
    assert race.classify_run(False, {"status": "ok", "errors": []}, "") == "clean"
    table = race.summary_table("naive", ["hang", "fx-error", "error", "clean"], [90.0, 30.0, 5.0, 40.0])
    assert table[-1] == "| naive | 4 | 2 | 1 | 1 | 35.0 |"


def test_user_errors_of_the_tools_are_one_line_like_training(tmp_path):
    """A bad setting: `error: ...` on stderr, exit code 2, no traceback (as train_dflash.py answers)."""
    runs = {
        "eval_dflash.py": (
            [
                "--target_model",
                "x",
                "--draft_model",
                "y",
                "--data",
                "d.jsonl",
                "--max_new_tokens",
                "4",
                "--output",
                str(tmp_path / "r.json"),
                "--temperature",
                "-1",
            ],
            "error: --temperature must be >= 0",
        ),
        "regenerate_data.py": (
            ["--target_model", "x", "--prompts", "p.jsonl", "--output", str(tmp_path / "o.jsonl"), "--compile_decode", "maybe"],
            "error: --compile_decode must be auto, on or off, got 'maybe'",
        ),
    }
    # A missing or mistyped flag: the same one line, not argparse's usage text.
    flag_runs = {
        "eval_dflash.py": (
            ["--target_model", "x", "--draft_model", "y", "--data", "d.jsonl"],
            "error: the following arguments are required: --max_new_tokens, --output; see `python eval_dflash.py --help`",
        ),
        "regenerate_data.py": (
            ["--target_model", "x", "--prompts", "p.jsonl", "--batch_size", "many"],
            "error: --batch_size expects an integer, got 'many'; see `python regenerate_data.py --help`",
        ),
    }
    for cases in (runs, flag_runs):
        results = run_two_at_a_time({script: args for script, (args, _) in cases.items()}, {**os.environ, "HF_HUB_OFFLINE": "1"}, 120)
        for script, (_, message) in cases.items():
            result = results[script]
            assert result.returncode == 2 and "Traceback" not in result.stderr and "usage:" not in result.stderr, f"{script}: {result.stderr[-2000:]}"
            assert result.stderr.strip().splitlines()[-1].startswith(message), f"{script}: {result.stderr[-500:]}"


def test_the_gpu_tools_run_in_a_tiny_cpu_mode(tiny_qwen3_target, train_env, tmp_path):
    """The helper scripts of tools/ in their smallest CPU form, so that a stale import fails here."""
    files = tmp_path / "files"  # config + tokenizer, as a staged model folder without weights
    files.mkdir()
    for f in Path(tiny_qwen3_target).iterdir():
        if not f.name.endswith(".safetensors"):
            (files / f.name).write_bytes(f.read_bytes())
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(16)))
    bad_record = tmp_path / "bad.jsonl"  # skipped with --skip_bad_samples: anchor_flops still counts the 16 good ones
    bad_record.write_text(json.dumps({"prompt": "no assistant turn"}) + "\n")
    run = tmp_path / "sliding_w64"  # a training run that made its own held-out evaluation at the end
    (run / "final").mkdir(parents=True)
    (run / "train_log.jsonl").write_text(
        json.dumps({"step": 5, "tau_estimate": 2.0, "elapsed_s": 20.0})
        + "\n"  # estimate: their mean
        + json.dumps({"step": 10, "tau_estimate": 2.5, "elapsed_s": 31.0})
        + "\n"
        + json.dumps({"step": 10, "eval_tau": 2.5, "elapsed_s": 40.0})
        + "\n"
    )
    (run / "final" / "training_settings.json").write_text(json.dumps({"eval_num_prompts": 8}))
    (tmp_path / "eval_sliding_w64_t0.8.json").write_text(json.dumps({"acceptance_length": 1.875}))  # HELD_OUT's sampled evaluation
    runs = {
        "experiments/gpu/drafter_rank_memory.py": ["--out", str(tmp_path / "rank"), "--device", "cpu", "--tiny", "--steps", "2"],
        "tools/gpu/random_target.py": [str(files), str(tmp_path / "random")],
        "experiments/gpu/shaped_targets.py": [str(tmp_path / "shaped"), str(gsm8k)],
        "tools/gpu/ablation_table.py": [str(tmp_path)],
        "tools/gpu/bench_table.py": [str(tmp_path)],
        "experiments/gpu/decode_step_profile.py": [
            str(tiny_qwen3_target),
            str(tmp_path / "decode"),
            "--rows",
            "2",
            "--width",
            "8",
            "--max_new_tokens",
            "8",
            "--valid",
            "10",
            "--repeats",
            "1",
            "--device",
            "cpu",
        ],
        "experiments/tp_subgroup_check.py": ["--make_target", str(tmp_path / "tp")],
        "tools/anchor_flops.py": [
            str(gsm8k),
            str(bad_record),
            "--target_model",
            str(files),
            "--num_anchors",
            "64",
            "--max_seq_length",
            "96",
            "--batch_size",
            "4",
            "--anchor_slots_multiple",
            "8",
            "--skip_bad_samples",
        ],
    }
    out = {}
    for script, result in run_two_at_a_time(runs, dict(train_env, HF_HUB_OFFLINE="1")).items():
        assert result.returncode == 0, f"{script}: exit {result.returncode}\n{result.stderr[-3000:]}"
        out[script] = result.stdout
    assert json.loads(out["experiments/gpu/drafter_rank_memory.py"].splitlines()[0])["missing_layer_shards"]
    assert (tmp_path / "random" / "model.safetensors").is_file() and (tmp_path / "random" / "drafter" / "config.json").is_file()
    assert (tmp_path / "shaped" / "q8b" / "config.json").is_file() and (tmp_path / "shaped" / "conv8.jsonl").is_file()
    assert out["tools/gpu/ablation_table.py"].startswith("| run | held-out tau |")
    assert "| sliding_w64 | 2.50 | 8 | 1.88 | 2.25 | 10 | 31 |" in out["tools/gpu/ablation_table.py"]
    assert any((tmp_path / "tp").glob("*.safetensors"))
    decode = json.loads((tmp_path / "decode" / "results.json").read_text())
    assert set(decode) == {"eager_step_2_rows_ms", "pick_greedy_2_rows_ms", "pick_sampled_2_rows_ms"} and min(decode.values()) > 0
    assert "aten::" in (tmp_path / "decode" / "profile_step.txt").read_text()
    flops = json.loads(out["tools/anchor_flops.py"].splitlines()[-1])  # short answers: most of 64 slots are padding
    per_sample = flops["flop_per_sample"]
    assert flops["samples"] == 16 and 0 < flops["valid_slot_share"] < 0.25
    assert per_sample["drafter_useful"] < per_sample["drafter_executed_anchor_slots_multiple_8"] < 0.75 * per_sample["drafter_executed"]


def test_the_gpu_shell_scripts_parse():
    """The GPU machine is the only place the tools/gpu/*.sh scripts run whole; here bash at least
    parses each one, so that a syntax slip fails in CI rather than in a device call."""
    scripts = sorted([*(REPO / "tools" / "gpu").glob("*.sh"), *(REPO / "experiments" / "gpu").glob("*.sh")])
    assert len(scripts) >= 10
    for script in scripts:  # some parse errors (inside [[ ]]) leave bash -n's exit code 0: stderr tells
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0 and not result.stderr, f"{script.name}: {result.stderr}"


def test_the_ablation_base_restores_the_previous_recipe_under_the_shipped_config():
    """The ablation scripts train configs/smollm2-gsm8k-gpu.yaml with ABLATION_BASE (tools/gpu/helpers.sh) before
    each row's flags: that must give the optimisation their earlier rows were measured on, though the config now
    ships DFlash2 with Muon, and a row's own flags, after the base, must still win."""
    from train_dflash import parse_settings

    base = subprocess.run(
        ["bash", "-c", 'source tools/gpu/helpers.sh && printf "%s\\n" "${ABLATION_BASE[@]}"'], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    config = ["--config", "configs/smollm2-gsm8k-gpu.yaml", "--train_data", "data/demo_conversations.jsonl", "--eval_data", ""]

    def settings(*flags):
        return parse_settings([*config, *flags])[0]

    def optimisation(s):
        return (s.drafter, s.optimizer, s.learning_rate, s.lr_scheduler, s.warmup_ratio, s.loss_weighting, s.batch_order, s.num_train_epochs)

    assert optimisation(settings()) == ("dflash2", "muon", 1e-3, "linear", 0.01, "dpace", "random", 4)  # the shipped recipe
    assert optimisation(settings(*base)) == ("dflash", "adamw", 8e-4, "cosine", 0.04, "exp", "length_grouped", 6)
    row = settings(*base, "--drafter", "dflash2", "--optimizer", "muon", "--learning_rate", "1e-3")
    assert optimisation(row)[:3] == ("dflash2", "muon", 1e-3)


def test_the_ablation_table_pairs_each_run_with_the_first_by_question(tmp_path):
    """optimizer_ablation.sh's table: speculators' row names its evaluation after itself, ours after ours_best;
    the paired line is the mean and standard error of the per-question differences on the shared questions."""

    def evaluation(folder, name, taus):
        folder.mkdir(parents=True, exist_ok=True)
        per_prompt = [{"prompt_index": i, "acceptance_length": t} for i, t in enumerate(taus)]
        mean = sum(taus) / len(taus)
        (folder / f"eval_{name}_t0.json").write_text(json.dumps({"acceptance_length": mean, "per_prompt": per_prompt}))

    evaluation(tmp_path / "spec_default", "spec_default", [3.0, 2.0, 4.0])
    evaluation(tmp_path / "elsewhere" / "ours", "ours_best", [3.5, 2.0, 4.3, 9.9])  # a 4th question spec lacks: not paired
    result = subprocess.run(
        [sys.executable, "tools/gpu/ablation_table.py", "--runs", str(tmp_path), "spec_default", str(tmp_path / "elsewhere" / "ours")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    # differences 0.5, 0.0, 0.3: mean 0.2667, sample sd 0.2517, standard error 0.1453; ahead on 2 of 3
    assert "| ours | +0.27 +- 0.15 (ahead on 2 of 3) | - |" in result.stdout
    assert "| spec_default | 3.00 | - |" in result.stdout
    # A RUN relative to the working directory (not in OUT_DIR) is read from there; a missing one is named on stderr.
    result = subprocess.run(
        [sys.executable, str(REPO / "tools/gpu/ablation_table.py"), "--runs", "new_machine", "spec_default", "elsewhere/ours", "nowhere"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| ours | +0.27 +- 0.15 (ahead on 2 of 3) | - |" in result.stdout
    assert "no run folder new_machine/nowhere" in result.stderr


def test_the_optimizer_ablation_starts_a_run_only_when_the_gpu_has_room_for_it(tmp_path):
    """optimizer_ablation.sh's scheduler, with its neighbours stubbed (each row sleeps and logs when it ran): at
    GPU_GB 60 a DFlash2 row (35 GB) and a 5-layer row (17) share the GPU, and the 25-GB row waits until one ends
    (three at once ran out of memory on an H100); at GPU_GB 1000 and AT_ONCE 2, two at a time."""
    tree = tmp_path / "repo"
    (tree / "tools/gpu").mkdir(parents=True)
    (tree / "tools/gpu/optimizer_ablation.sh").write_text((REPO / "tools/gpu/optimizer_ablation.sh").read_text())
    for stub in ("setup.sh", "helpers.sh"):
        (tree / "tools/gpu" / stub).write_text("SMOLLM2=stub\n")
    # A row: log start, sleep (the 5-layer row the shortest), log end. ROWS/BEST_ARGS come from the script.
    (tree / "tools/gpu/speculators_compare.sh").write_text(
        'name=$(basename "$1"); echo "start $name $(date +%s.%N)" >> "$LOG"\n'
        "case $BEST_ARGS in *num_draft_layers*) sleep 1 ;; *) sleep 3 ;; esac\n"
        'echo "end $name $(date +%s.%N)" >> "$LOG"\n'
    )
    (tree / "tools/gpu/ablation_table.py").write_text("")

    def intervals(**env_extra):
        log = tmp_path / f"log_{env_extra['GPU_GB']}"
        env = dict(os.environ, LOG=str(log), TINY="1", RUNS="dflash2_muon_linear muon_linear_5layers muon_linear_random", **env_extra)
        subprocess.run(
            ["bash", "tools/gpu/optimizer_ablation.sh", str(tmp_path / "out"), str(tmp_path / "recipe")],
            cwd=tree,
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        times = {}
        for line in log.read_text().splitlines():
            what, name, at = line.split()
            times.setdefault(name, {})[what] = float(at)
        return times

    t = intervals(GPU_GB="60")
    assert t["muon_linear_5layers"]["start"] < t["dflash2_muon_linear"]["end"]  # 35 + 17 = 52 GB: together
    assert t["muon_linear_random"]["start"] >= t["muon_linear_5layers"]["end"]  # 35 + 17 + 25 > 60: it waits
    assert t["muon_linear_random"]["start"] < t["dflash2_muon_linear"]["end"]  # 35 + 25 = 60: then beside DFlash2
    t = intervals(GPU_GB="1000", AT_ONCE="2")
    assert t["muon_linear_5layers"]["start"] < t["dflash2_muon_linear"]["end"]
    assert t["muon_linear_random"]["start"] >= min(t["muon_linear_5layers"]["end"], t["dflash2_muon_linear"]["end"])
