"""The data and the bookkeeping of tools/gpu/speculators_compare.sh, which trains speculators' DFlash
drafter and ours on the same target and the same replies:

    # our tokenization of the replies, and the target's hidden states of every row, in speculators' layout
    python3 tools/speculators_compare.py features --target_model T --train_data R.jsonl \
        --target_layer_ids 1 8 14 20 27 --output DIR
    # speculators' trainer (speculators installed), timed, its peak memory and step rates recorded
    python3 tools/speculators_compare.py train RUN_DIR --data DIR --steps N --batch_samples 64 -- FLAGS...
    # the comparison table (markdown on stdout) and OUT_DIR/results.json
    python3 tools/speculators_compare.py table OUT_DIR

The layout speculators 0.9.0 reads (`speculators.train.data.ArrowDataset` over its file backend):

- DIR: a `datasets` save_to_disk folder, torch format, columns `input_ids` (int64 [T]), `loss_mask`
  (int64 [T], 1 on assistant tokens and their end-of-turn token) and `seq_len` (int).
- DIR/hidden_states/hs_{row}.safetensors: `token_ids` (int64 [T], equal to the row's input_ids, or
  speculators drops the row) and `hidden_states` (bf16 [T, n + 1, hidden]). Slots 0..n-1 are the
  outputs of our target layers `target_layer_ids` (0-based; HF hidden_states[id + 1], which is the id
  speculators is given: its `--target-layer-ids` index HF hidden states). Slot n is the output of the
  target's last decoder layer BEFORE the final norm: speculators applies the target's norm and LM
  head to it for the labels (the target's argmax) and, with a distribution loss, the target's
  distribution.

Its trainer takes a validation split off the end of the rows (`--train-data-ratio` in (0, 1)), so
the folder holds the replies, then `val_rows` copies of the first rows, and `meta.json` gives the
ratio that keeps exactly the replies for training.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROWS = ("spec_default", "spec_paper", "spec_adamw", "ours_recipe", "ours_best")
ROW_TEXT = {
    "spec_default": "speculators 0.9.0, its defaults (5 layers, D-PACE, Muon, sliding 2048, causal in-block)",
    "spec_paper": "speculators 0.9.0, the paper's objective (exp decay gamma 7, CE, full attention)",
    "spec_adamw": "speculators 0.9.0, its defaults with AdamW 8e-4, no decay, cosine, 4% warmup",
    "ours_recipe": "ours, the previous recipe (DFlash, AdamW 8e-4 cosine; ABLATION_BASE of tools/gpu/helpers.sh)",
    "ours_best": "ours, the recipe + the best lever",
}


# ----------------------------------------------------------------------------------------------
# features: the rows and the target's hidden states


def capture_layer_ids(target_layer_ids: list[int], num_target_layers: int) -> tuple[list[int], list[int]]:
    """(layer ids to capture, slot order): the extractor captures each layer once, and the file's slots
    are the target layer ids in order followed by the last decoder layer (pre-norm).

    Example: ids [1, 8] of a 30-layer target -> capture [1, 8, 29], slots [0, 1, 2]; ids [1, 29] ->
    capture [1, 29], slots [0, 1, 1] (layer 29 is both a feature and the last slot)."""
    last = num_target_layers - 1
    capture = list(target_layer_ids) + ([] if last in target_layer_ids else [last])
    return capture, [capture.index(i) for i in target_layer_ids] + [capture.index(last)]


@torch.no_grad()
def write_hidden_states(
    extractor,
    slots: list[int],
    samples: list[dict],
    hs_dir: Path,
    pad_token_id: int,
    batch_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    first_file: int = 0,
    threads: int = 4,
) -> None:
    """hs_{first_file + i}.safetensors for each sample i: `token_ids` int64 [T] (its input_ids) and
    `hidden_states` [T, len(slots), hidden] in `dtype`, the extractor's captured layers in `slots`
    order. Batches of similar length run through the target together (right padding; padding never
    reaches a real position of a causal target). Each file is written to a temp name and renamed."""
    from safetensors.torch import save_file

    from dflash_data import collate_batch

    hs_dir.mkdir(parents=True, exist_ok=True)
    device = extractor.embed_tokens.weight.device
    hidden = extractor.hidden_size
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))

    def save(index: int, token_ids: torch.Tensor, states: torch.Tensor) -> None:
        path = hs_dir / f"hs_{first_file + index}.safetensors"
        save_file({"token_ids": token_ids, "hidden_states": states}, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending = []
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch = collate_batch([samples[i] for i in rows], pad_token_id)
            features = extractor(batch["input_ids"].to(device), batch["attention_mask"].to(device))  # [B, S, C*hidden]
            features = features.unflatten(-1, (-1, hidden))[:, :, slots].to(dtype).cpu()  # [B, S, n+1, hidden]
            for j, i in enumerate(rows):
                n = len(samples[i]["input_ids"])
                token_ids = torch.as_tensor(samples[i]["input_ids"], dtype=torch.long)  # [T]
                pending.append(pool.submit(save, i, token_ids, features[j, :n].contiguous()))
            if len(pending) > 4 * batch_size:  # bound the host memory held by unwritten files
                for future in pending:
                    future.result()
                pending = []
        for future in pending:
            future.result()


def features_main(args: argparse.Namespace) -> None:
    import datasets

    from dflash_data import build_train_dataset
    from dflash_features import TargetFeatureExtractor
    from dflash_target import load_target_config, load_target_model

    out = Path(args.output)
    if (out / "meta.json").is_file():
        print(f"{out}: already written")
        return
    start = time.perf_counter()
    config, tokenizer = load_target_config(args.target_model)
    chat_kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None
    dataset = build_train_dataset(
        args.train_data, tokenizer, max_seq_length=args.max_seq_length, chat_template_kwargs=chat_kwargs, seed=args.seed, max_samples=args.max_samples
    )
    samples = dataset.select_columns(["input_ids", "loss_mask"]).to_list()
    val = [samples[i % len(samples)] for i in range(args.val_rows)]  # speculators' validation split, never trained on
    target = load_target_model(args.target_model, config, dtype=getattr(torch, args.target_dtype) if args.target_dtype else None)
    num_layers = config.get_text_config().num_hidden_layers
    capture, slots = capture_layer_ids(args.target_layer_ids, num_layers)
    extractor = TargetFeatureExtractor(target, capture, truncate=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_hidden_states(extractor, slots, samples + val, tmp / "hidden_states", tokenizer.pad_token_id, batch_size=args.batch_size)
    rows = samples + val
    table = datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows], "seq_len": [len(r["input_ids"]) for r in rows]}
    )
    table.set_format("torch")
    table.save_to_disk(str(tmp))
    tokens = [len(r["input_ids"]) for r in samples]
    meta = {
        "rows": len(samples),
        "val_rows": len(val),
        # split_idx = int(len(all rows) * ratio) = rows exactly (half a row of margin against rounding)
        "train_data_ratio": (len(samples) + 0.5) / len(rows),
        "tokens": sum(tokens),
        "mean_tokens": sum(tokens) / len(tokens),
        "max_tokens": max(tokens),
        "loss_tokens": sum(sum(r["loss_mask"]) for r in samples),
        "target_model": args.target_model,
        "num_target_layers": num_layers,
        "hidden_size": extractor.hidden_size,
        "target_layer_ids": list(args.target_layer_ids),
        "speculators_target_layer_ids": [i + 1 for i in args.target_layer_ids],
        "slots": "target_layer_ids in order, then the last decoder layer's output before the final norm",
        "target_dtype": str(extractor.dtype).replace("torch.", ""),
        "file_dtype": "bfloat16",
        "seconds": time.perf_counter() - start,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(json.dumps(meta))


# ----------------------------------------------------------------------------------------------
# train: speculators' trainer, measured, resumable across capped calls

STOPPED = 3  # train's exit code when it stopped after a checkpoint for the call's time: run it again to go on


class CallTimeSpent(Exception):
    """Raised after a checkpoint when the next one would end past the call's deadline."""


class _MetricRecords:
    """A logging handler that keeps speculators' per-step metric records (train loss, eal, profile),
    each tagged with the attempt (one process of `train`) that logged it."""

    def __init__(self, path: Path, attempt: int):
        import logging

        class Handler(logging.Handler):
            def emit(inner, record):
                message = record.msg
                if isinstance(message, dict) and "train" in message:
                    message = {**message, "attempt": attempt}
                    self.rows.append(message)
                    with open(path, "a") as f:
                        f.write(json.dumps(message, default=float) + "\n")

        self.rows: list[dict] = []
        self.handler = Handler()


def packed_batches_per_epoch(lengths: list[int], total_seq_len: int, seed: int) -> int:
    """Optimizer steps in one epoch of speculators' trainer on one GPU (its multipack sampler)."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1, rank=0, seed=seed)
    return len(sampler)


def resumed_step(checkpoints: Path) -> int:
    """The optimizer steps speculators' trainer has behind it when it resumes from `checkpoints`: the
    `global_step` of the training_state.json in its highest numbered epoch folder (where it resumes
    from), 0 when there is none."""
    epochs = [p for p in checkpoints.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()] if checkpoints.is_dir() else []
    if not epochs:
        return 0
    state = max(epochs, key=lambda p: int(p.name)) / "training_state.json"
    return int(json.loads(state.read_text()).get("global_step", 0)) if state.is_file() else 0


def keep_records_before(path: Path, step: int) -> list[dict]:
    """Drop the metric records of steps >= `step` from the JSONL file `path` (a run cut short logged
    steps after its last checkpoint; the resumed run logs them again) and return those kept."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if r["global_step"] < step]
    path.write_text("".join(json.dumps(r, default=float) + "\n" for r in rows))
    return rows


def warm_median(rows: list[dict], key: str = "tokens_per_s") -> float | None:
    """The median of each record's profile[key], leaving out the first fifth of every attempt's records
    (each attempt compiles again)."""
    values = []
    for attempt in sorted({r.get("attempt", 1) for r in rows}):
        rates = [r["profile"][key] for r in rows if r.get("attempt", 1) == attempt and r.get("profile")]
        values += rates[len(rates) // 5 :] or rates
    return statistics.median(values) if values else None


def detach_fused_loss_prune_hook() -> bool:
    """Let torch 2.11's Dynamo trace speculators' fused losses (the default, Triton kernels). Returns
    whether they were found (False without Triton: the CPU trial, which trains with the eager losses).

    speculators 0.9.0 builds its forward and backward loss kernels with one `triton.autotune`
    decorator, so both autotuners hold the same list of 21 tile configs, and gives them an
    `early_config_prune` hook. For a kernel with such a hook, Dynamo in torch 2.11 wraps the autotuner's
    config list with `VariableBuilder._wrap`, which registers it for mutation tracking without looking
    for an earlier registration. speculators compiles the drafter's forward with its loss, and Dynamo
    traces the loss's autograd.Function forward and backward in that one graph: the second launch
    registers the same list again and fails, `AssertionError: ListVariable(length=21) is already
    tracked for mutation` (torch 2.12.1 and 2.13 route the wrap through `VariableBuilder.__call__`,
    which reuses the tracked list). Without the hook Dynamo never wraps the list. The hook only drops
    tiles wider than the vocabulary's next power of two: none for a vocabulary above 16,384 tokens
    (SmolLM2: 49,152), and a wider tile still masks correctly."""
    try:
        from speculators.losses import fused
    except ImportError:
        return False
    for kernel in (fused.loss_forward_kernel, fused.loss_backward_kernel):
        kernel.early_config_prune = None
    return True


def stop_before_deadline(trainer_class, deadline: float) -> None:
    """After each checkpoint speculators' Trainer saves, raise CallTimeSpent when the time the last
    checkpoint interval took (the first one: from here, start-up and compiles included) would end
    past `deadline` (seconds since the epoch), unless training is complete. A run stopped this way
    resumes from that checkpoint: model, optimizers, schedulers and the step within the epoch."""
    save = trainer_class.maybe_save_checkpoint
    last = [time.time()]

    def maybe_save_checkpoint(self, epoch, local_step: int = 0):
        save(self, epoch, local_step=local_step)
        now = time.time()
        interval, last[0] = now - last[0], now
        finished = self.config.max_steps is not None and self.global_step >= self.config.max_steps
        if isinstance(epoch, int) and not finished and now + interval > deadline:
            raise CallTimeSpent(
                f"stopped after step {self.global_step}: the next checkpoint would end {now + interval - deadline:.0f} s past the call's deadline"
            )

    trainer_class.maybe_save_checkpoint = maybe_save_checkpoint


def train_main(args: argparse.Namespace, flags: list[str]) -> int:
    """speculators' trainer on a features folder, resumable: returns 0 when `args.steps` steps are done
    (RUN_DIR/summary.json written), STOPPED when it stopped after a checkpoint for `args.deadline`.
    RUN_DIR/progress.json says after every attempt how far the run is."""
    import logging

    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer
    from speculators.train.config import TrainConfig

    run, data = Path(args.run_dir), Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    if (run / "summary.json").is_file():
        print(f"{run}: already trained")
        return 0
    # A run cut short continues from its last checkpoint: speculators resumes from save_path by default,
    # mid-epoch from the step its training_state.json records (checkpoints every checkpoint_steps steps).
    run.mkdir(parents=True, exist_ok=True)
    progress_path = run / "progress.json"
    progress = _read_json(progress_path)
    attempt = progress.get("attempts", 0) + 1
    start_step = resumed_step(run / "checkpoints")
    log = run / "metrics.jsonl"
    keep_records_before(log, start_step)
    # A packed row of about batch_samples replies: the replies (and anchors) one of our steps trains on.
    total_seq_len = max(meta["max_tokens"], math.ceil(args.batch_samples * meta["mean_tokens"] / 128) * 128)
    per_epoch = packed_batches_per_epoch(_train_lengths(data, meta), total_seq_len, args.seed)
    epochs = math.ceil(args.steps / per_epoch)
    argv = [
        "--data-path",
        str(data),
        "--save-path",
        str(run / "checkpoints"),
        "--log-dir",
        str(run / "logs"),
        "--on-missing",
        "raise",
        "--train-data-ratio",
        repr(meta["train_data_ratio"]),
        "--total-seq-len",
        str(total_seq_len),
        "--max-steps",
        str(args.steps),
        "--epochs",
        str(epochs),
        "--checkpoint-freq",
        repr(min(1.0, args.checkpoint_steps / per_epoch)),
        "--seed",
        str(args.seed),
        *flags,
    ]
    (run / "argv.json").write_text(json.dumps(argv, indent=2))
    records = _MetricRecords(log, attempt)
    original = spec_cli.setup_metric_logger

    def setup_metric_logger(*a, **k):  # speculators' dictConfig replaces handlers: add ours after it
        original(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(records.handler)

    spec_cli.setup_metric_logger = setup_metric_logger
    if not torch.accelerator.is_available():
        _run_speculators_on_cpu()
    detach_fused_loss_prune_hook()
    if args.deadline:
        stop_before_deadline(spec_trainer.Trainer, args.deadline)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    print(
        f"{run}: attempt {attempt}, from step {start_step} of {args.steps} ({per_epoch} steps per epoch, "
        f"a checkpoint every {min(args.checkpoint_steps, per_epoch)})",
        flush=True,
    )
    start = time.perf_counter()
    stopped = None
    try:
        spec_cli.main(TrainConfig.resolve(argv))
    except CallTimeSpent as error:
        stopped = str(error)
    wall = time.perf_counter() - start
    logged = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    steps_done = resumed_step(run / "checkpoints")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    checkpoints = sorted(
        (p for p in (run / "checkpoints").iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit() and (p / "config.json").is_file()),
        key=lambda p: int(p.name),
    )
    progress = {
        "steps": args.steps,
        "steps_done": steps_done,
        "attempts": attempt,
        "state": "stopped" if stopped else "done",
        "train_seconds": progress.get("train_seconds", 0.0) + wall,
        "attempt_seconds": [*progress.get("attempt_seconds", []), round(wall, 1)],
        "peak_memory_gb": max([p for p in (progress.get("peak_memory_gb"), peak) if p is not None], default=None),
        "checkpoint": str(checkpoints[-1]) if checkpoints else None,
    }
    progress_path.write_text(json.dumps(progress, indent=2, default=float))
    if stopped:
        print(f"{run}: {stopped}; {steps_done} of {args.steps} steps are in {progress['checkpoint']}: run it again to go on")
        return STOPPED
    tokens_per_s = warm_median(logged)
    summary = {
        "steps": (max(r["global_step"] for r in logged) + 1) if logged else 0,
        "epochs": epochs,
        "batches_per_epoch": per_epoch,
        "total_seq_len": total_seq_len,
        "wall_s": progress["train_seconds"],
        "attempts": attempt,
        "tokens_per_s": tokens_per_s,
        "samples_per_s": tokens_per_s / meta["mean_tokens"] if tokens_per_s else None,
        "peak_memory_gb": progress["peak_memory_gb"],
        "last_train": logged[-1]["train"] if logged else None,
        "checkpoint": progress["checkpoint"],
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(json.dumps(summary, default=float))
    return 0


def _run_speculators_on_cpu() -> None:
    """speculators' Trainer moves the model and batches to `local_rank` (an accelerator index) and
    autocasts on the accelerator's type ('cuda' when there is none): on a machine without one (the CPU
    trial of the script) both become 'cpu'. Pass --draft-attn-impl sdpa and --loss-implementation
    eager there too (flex attention has no CPU backward; the fused losses are Triton kernels)."""
    import speculators.train.checkpointer as spec_checkpointer
    import speculators.train.trainer as spec_trainer

    spec_trainer.get_local_rank = lambda: "cpu"
    spec_checkpointer.get_current_device = lambda: "cpu"  # where a resumed run loads its checkpoint ('cuda:0' without an accelerator)
    init = spec_trainer.Trainer.__init__

    def cpu_init(self, *a, **k):
        init(self, *a, **k)
        self.device_type = "cpu"

    spec_trainer.Trainer.__init__ = cpu_init
    # Its step timer synchronizes the accelerator; nothing to wait for on a CPU.
    torch.accelerator.synchronize = lambda *a, **k: None


def _train_lengths(data: Path, meta: dict) -> list[int]:
    import datasets

    return list(datasets.load_from_disk(str(data)).with_format(None)["seq_len"][: meta["rows"]])


# ----------------------------------------------------------------------------------------------
# table


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _timings(out: Path) -> dict[str, float]:
    """Seconds per step name in OUT_DIR/timings.tsv (a resumed step's rows summed)."""
    seconds: dict[str, float] = {}
    path = out / "timings.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, value, _rc = line.split("\t")
        seconds[name] = seconds.get(name, 0.0) + float(value)
    return seconds


def row_result(out: Path, row: str, temperatures: list[str], timings: dict[str, float]) -> dict:
    """One row's numbers: steps, tau per temperature, samples/s, minutes, peak GB."""
    result = {"row": row, "what": ROW_TEXT.get(row, row)}
    if row.startswith("spec"):
        summary = _read_json(out / row / "summary.json")
        result.update(steps=summary.get("steps"), samples_per_s=summary.get("samples_per_s"), peak_memory_gb=summary.get("peak_memory_gb"))
        seconds = timings.get(f"train_{row}")
        result["features_minutes"] = timings.get("features", 0.0) / 60
    else:
        log = out / row / "train_log.jsonl"
        logs = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
        rates = [r["samples_per_s"] for r in logs if "samples_per_s" in r]
        peaks = [r["peak_memory_gb"] for r in logs if "peak_memory_gb" in r]
        result.update(
            steps=max((r["step"] for r in logs if "step" in r), default=None),
            samples_per_s=statistics.median(rates[1:]) if len(rates) > 1 else (rates[0] if rates else None),
            peak_memory_gb=max(peaks) if peaks else None,
        )
        seconds = timings.get(f"train_{row}")
        result["features_minutes"] = 0.0
    result["train_minutes"] = seconds / 60 if seconds is not None else None
    result["minutes"] = result["train_minutes"] + result["features_minutes"] if seconds is not None else None
    for t in temperatures:
        evaluation = _read_json(out / f"eval_{row}_t{t}.json")
        result[f"tau_t{t}"] = evaluation.get("acceptance_length")
        result[f"prompts_t{t}"] = evaluation.get("num_prompts")
        result[f"speedup_t{t}"] = evaluation.get("speedup")
    return result


def row_state(out: Path, row: str, temperatures: list[str]) -> dict:
    """What is done of one row: trained (speculators: steps done of its target, attempts, whether the
    last attempt stopped for the call's time), and the temperatures evaluated."""
    if row.startswith("spec"):
        progress = _read_json(out / row / "progress.json")
        state = {
            "trained": (out / row / "summary.json").is_file(),
            "steps_done": progress.get("steps_done"),
            "steps": progress.get("steps"),
            "attempts": progress.get("attempts", 0),
            "last_attempt": progress.get("state"),
        }
    else:
        log = out / row / "train_log.jsonl"
        logs = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
        state = {
            "trained": (out / row / "final" / "model.safetensors").is_file(),
            "steps_done": max((r["step"] for r in logs if "step" in r), default=None),
        }
    state["evaluated"] = [t for t in temperatures if (out / f"eval_{row}_t{t}.json").is_file()]
    state["done"] = state["trained"] and len(state["evaluated"]) == len(temperatures)
    return state


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table_main(args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    timings = _timings(out)
    rows = [row_result(out, row, args.temperatures, timings) for row in args.rows]
    rows = [r for r in rows if r["steps"] is not None or any(r[f"tau_t{t}"] is not None for t in args.temperatures)]
    temps = args.temperatures
    header = ["row", *[f"tau T={t}" for t in temps], "steps", "samples/s", "GPU-minutes", "peak GB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        minutes = _fmt(r["minutes"], ".1f")
        if r["features_minutes"] and r["minutes"] is not None:
            minutes += f" ({r['train_minutes']:.1f} + {r['features_minutes']:.1f} features)"
        cells = [
            f"{r['row']}: {r['what']}",
            *[_fmt(r[f"tau_t{t}"]) for t in temps],
            _fmt(r["steps"], "d"),
            _fmt(r["samples_per_s"], ".1f"),
            minutes,
            _fmt(r["peak_memory_gb"], ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    prompts = sorted({r[f"prompts_t{t}"] for r in rows for t in temps if r[f"prompts_t{t}"]})
    lines.append("")
    lines.append(
        f"tau on {'/'.join(map(str, prompts)) or '-'} held-out prompts (top_p 1.0, seed 0). samples/s: speculators' median "
        "tokens/s per step (after the first fifth) over the replies' mean length; ours, the median of the logged windows "
        "after the first. Minutes: the training step's wall time (start-up and compiles included, those of every call "
        "a resumed speculators row took), plus, for speculators, writing the target's hidden states once (shared by "
        "its rows). Peak GB: torch's peak allocation."
    )
    meta = _read_json(out / "features" / "meta.json")
    extra = {k: round(v / 60, 2) for k, v in timings.items()}
    (out / "results.json").write_text(json.dumps({"rows": rows, "features": meta, "step_minutes": extra}, indent=2, default=float))
    print("\n".join(lines))
    # What is done so far, for the next call (OUT_DIR/state.json and one line per row).
    states = {row: row_state(out, row, temps) for row in args.rows}
    (out / "state.json").write_text(json.dumps(states, indent=2))
    for row, state in states.items():
        trained = "trained" if state["trained"] else "not trained"
        if state.get("steps") and not state["trained"]:
            trained = f"trained {state['steps_done'] or 0} of {state['steps']} steps in {state['attempts']} attempts (resumes)"
        evaluated = " ".join(f"T={t}" for t in state["evaluated"]) or "none"
        print(f"state: {row}: {trained}; evaluated: {evaluated}{'; done' if state['done'] else ''}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags: list[str] = []
    if "--" in argv:
        flags, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    f = commands.add_parser("features", help="the rows and the target's hidden states, in speculators' layout")
    f.add_argument("--target_model", required=True)
    f.add_argument("--train_data", nargs="+", required=True)
    f.add_argument("--target_layer_ids", nargs="+", type=int, required=True, help="0-based target layers, as our trainer's")
    f.add_argument("--output", required=True)
    f.add_argument("--max_seq_length", type=int, default=512)
    f.add_argument("--max_samples", type=int, default=None)
    f.add_argument("--batch_size", type=int, default=64)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--val_rows", type=int, default=8)
    f.add_argument("--chat_template_kwargs", default=None)
    f.add_argument("--target_dtype", default=None, help="bfloat16 / float32; default bf16 on CUDA, fp32 on CPU, as our trainer")
    t = commands.add_parser("train", help="speculators' trainer on a features folder; flags after -- go to it")
    t.add_argument("run_dir")
    t.add_argument("--data", required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--batch_samples", type=int, default=64, help="replies per packed row, on average")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint_steps", type=int, default=25, help="a checkpoint every this many steps (the most a stop loses)")
    t.add_argument(
        "--deadline", type=float, default=0.0, help="unix seconds: stop after the last checkpoint that ends before it (exit code 3; 0: no deadline)"
    )
    b = commands.add_parser("table", help="the comparison table")
    b.add_argument("out_dir")
    b.add_argument("--rows", nargs="+", default=list(ROWS))
    b.add_argument("--temperatures", nargs="+", default=["0", "0.8"])
    args = parser.parse_args(argv)
    if args.command == "features":
        features_main(args)
    elif args.command == "train":
        sys.exit(train_main(args, flags))
    else:
        table_main(args)


if __name__ == "__main__":
    main()
