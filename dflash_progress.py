"""What a run reports: logging set-up, the log window of the training loop and its scalars (loss,
first-position accuracy, the tau estimate, both sides' rates), the trackers and train_log.jsonl,
the training curves, the profiler window, the divergence check, and the error line each failed rank
leaves for launch.py. The settings it reads come as a `ProgressSettings`.
"""

import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_checkpoint import checkpoint_dirs
from dflash_compile import flex_compile_stats
from dflash_features import FeatureSupply
from dflash_liveness import StoppedByLauncher, report_failure
from dflash_loss import estimate_acceptance_length
from dflash_schedule import ResumePoint, Schedule

REPO_DIR = Path(__file__).resolve().parent

logger = logging.getLogger("train_dflash")  # a training run's log lines all read `train_dflash:`


@dataclass(frozen=True)
class ProgressSettings:
    """The settings a run's reports read: `train_dflash.TrainSettings`' fields of the same names (their
    `--help` says more), as `train_dflash.settings_for` copies them."""

    output_dir: str  # train_log.jsonl, the trackers' runs/, the curves and the profile go here
    report_to: str  # trackers: tensorboard, wandb, none, ...
    logging_steps: int  # a log line every N optimizer steps
    profile_steps: int  # optimizer steps profiled after the first PROFILE_AFTER_STEPS (0: none)
    learning_rate: float  # the peak; the log's lr is it times the schedule's factor
    max_grad_norm: float  # named, with the learning rate, when the loss diverges
    gradient_accumulation_steps: int  # micro-batches per optimizer step: a window's steps from its micro-batches
    num_anchors: int  # in the run's summary line


# Tests: each drafter rank appends the sample ids it trained, and its final weights' digest, to
# {DFLASH_DEBUG_LOG}.rank{global rank}.jsonl.
DEBUG_LOG = os.environ.get("DFLASH_DEBUG_LOG")


def setup_logging(rank: int) -> None:
    """Log lines with time and rank; INFO on rank 0, WARNING elsewhere (the lead raises its own level later)."""
    logging.basicConfig(format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", level=logging.INFO if rank == 0 else logging.WARNING)
    # huggingface_hub gives its logger a handler of its own AND lets records reach the root's, so
    # each of its warnings (Hub retries) printed twice; the root handler alone formats them like ours.
    hub_logger = logging.getLogger("huggingface_hub")
    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    # Every rank reports its own compile-lock waits and compiles: who compiled, who waited.
    logging.getLogger("dflash_compile").setLevel(logging.INFO)
    if rank != 0:
        logging.getLogger("dflash_data").setLevel(logging.ERROR)  # the data warnings once, from rank 0


def raised_here(error: BaseException) -> bool:
    """Whether `error` was raised by this repo's own code (a deliberate message naming the setting or
    file and the fix) rather than inside a library."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().parent == REPO_DIR


def record_error(line: str) -> None:
    """Leave this rank's error line where torch's elastic agent looks for a worker's failure (the
    file TORCHELASTIC_ERROR_FILE names, set for each rank by torchrun and by accelerate's
    multi-process launch), so that `launch.py` can end a failed run's output with its first error."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        extra = {"timestamp": str(int(time.time())), "time_ns": str(time.time_ns())}
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": extra}}, f)


def out_of_memory_line(error: torch.OutOfMemoryError) -> str:
    """One line for a device out of memory: what torch says of the device (the request, what is free, the other
    processes holding memory; not its allocator advice) and the settings that lower a step's memory."""
    said = str(error).split(" Of the allocated memory")[0].strip()
    return (
        f"the GPU ran out of memory ({said}). Lower --per_device_batch_size, --num_anchors or --max_seq_length, or "
        "trade time for memory with --checkpoint_drafter_layers or --context_chunk_size N (docs/training.md); other "
        "processes on the same GPU count too (nvidia-smi). Checkpoints already written are kept: rerun with "
        "--resume_from_checkpoint latest"
    )


def exit_after_failure(error: BaseException) -> None:
    """How a rank ends after `error`: it tells the other ranks first (they stop within seconds
    instead of waiting for this rank's heartbeat to lapse), then prints one `error: ...` line for a
    bad setting or data (a ValueError; exit status 2) or a device out of memory (status 1), or the
    traceback of anything else (status 1), and records the line for launch.py. A rank that fails only because another failed first says so
    in one line (dflash_liveness) and prints nothing more. DFLASH_TRACEBACK=1 shows every
    traceback. Never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # on its way out already: the launcher's SIGTERM must not cut the report short
    others_told, after_another = report_failure(error)
    quiet = not os.environ.get("DFLASH_TRACEBACK")
    if after_another and quiet:
        code = 1  # the "stopping rank ... after an earlier failure" line names the cause; this rank's traceback would bury it
    elif isinstance(error, StoppedByLauncher) and quiet:
        line = f"error: {error}"  # no rank posted a failure: it died without one, or the user stopped the launch
        print(line, file=sys.stderr)
        record_error(line)
        code = 1
    elif isinstance(error, torch.OutOfMemoryError) and quiet:
        line = f"error: {out_of_memory_line(error)}"
        print(line, file=sys.stderr)
        record_error(line)
        code = 1
    elif isinstance(error, ValueError) and quiet:
        # Bad settings or data: one clear message, no traceback. A ValueError from inside a
        # library may be a bug instead, so for that one say how to see where it came from.
        hint = "" if raised_here(error) else " (unexpected: set DFLASH_TRACEBACK=1 to see the traceback)"
        line = f"error: {error}{hint}"
        print(line, file=sys.stderr)
        record_error(line)
        code = 2
    else:
        if not isinstance(error, (SystemExit, KeyboardInterrupt)):
            record_error(f"error: {type(error).__name__}: {error} (traceback above)")
        if not others_told:
            raise error
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A worker thread or the process group may still wait on a peer: leave without joining them.
    os._exit(code) if others_told else sys.exit(code)


def debug_log(rank: int, record: dict) -> None:
    if DEBUG_LOG:
        with open(f"{DEBUG_LOG}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the parameters' bytes (as float32, in order): equal digests, equal weights."""
    return hashlib.sha256(b"".join(p.detach().float().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()


def start_trackers(settings: ProgressSettings, hparams: dict, resumed_step: int = 0) -> list:
    """accelerate's trackers for --report_to, started on the calling rank (the lead). accelerate
    runs them on global rank 0 only, which in split mode is a target rank, so the instances made
    here have that gate switched off. TensorBoard writes to {output_dir}/runs/; a run resumed from
    the checkpoint of step `resumed_step` hides the events the earlier run wrote after that step
    (SummaryWriter's purge_step), which it logs again."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, filter_trackers

    if settings.report_to == "none":
        return []
    trackers = []
    for kind in filter_trackers(settings.report_to.split(","), settings.output_dir):
        tracker_class = LOGGER_TYPE_TO_CLASS[str(kind)]
        if tracker_class.requires_logging_directory:
            # The run name is the subfolder of output_dir (TensorBoard: {output_dir}/runs/events.out.tfevents.*).
            purge = {"purge_step": resumed_step + 1} if resumed_step and str(kind) == "tensorboard" else {}
            tracker = tracker_class("runs", settings.output_dir, **purge)
        else:
            tracker = tracker_class("dflash")  # the project name (wandb, ...)
        tracker.main_process_only = False
        tracker.start()
        tracker.store_init_configuration(hparams)
        trackers.append(tracker)
    return trackers


def plot_training_curves(output_dir: Path) -> None:
    """{output_dir}/training_curves.png: loss, and tau (estimated and held-out) over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_file = output_dir / "train_log.jsonl"
    rows = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.is_file() else []
    train = [r for r in rows if "loss" in r]
    if not train:
        return
    held_out = [r for r in rows if "eval_tau" in r]
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    # Markers: a short run logs a single point, which a bare line would not draw.
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], "o-")
    ax_loss.set(xlabel="optimizer step", ylabel="weighted CE loss", title="loss")
    ax_tau.plot([r["step"] for r in train], [r["tau_estimate"] for r in train], "o-", label="estimate from the training blocks")
    if held_out:
        ax_tau.plot([r["step"] for r in held_out], [r["eval_tau"] for r in held_out], "o-", label="held-out, speculative decoding")
    ax_tau.set(xlabel="optimizer step", ylabel="acceptance length tau", title="tau")
    ax_tau.legend()
    fig.tight_layout()
    fig.savefig(output_dir / "training_curves.png", dpi=100)
    plt.close(fig)


PROFILE_AFTER_STEPS = 20  # --profile_steps starts here: the first steps compile every shape


def profile_window(profiler, step: int, settings: ProgressSettings, on_cuda: bool):
    """--profile_steps: start torch.profiler after optimizer step PROFILE_AFTER_STEPS, stop it
    settings.profile_steps steps later and write the tables (by GPU and by host time) and the trace.
    On CUDA, torch's sync debug mode also reports every operation in the window that made the host
    wait for the device (an `.item()`, a copy to pageable memory, ...); profile.txt lists them by
    call stack. Returns the profiler while it runs, else None."""
    if step == PROFILE_AFTER_STEPS:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
        profiler = torch.profiler.profile(activities=activities)
        profiler.__enter__()
        profiler.dflash_syncs = Counter()  # call stack -> host waits there
        if on_cuda:
            profiler.dflash_warnings = warnings.catch_warnings()
            profiler.dflash_warnings.__enter__()
            warnings.simplefilter("always")  # every sync, not the first per source line
            shown = warnings.showwarning

            def record_sync(message, category, filename, lineno, file=None, line=None):
                if "synchronizing CUDA operation" not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                stack = "".join(traceback.format_stack(limit=12)[:-1])  # without this function
                profiler.dflash_syncs[stack] += 1

            warnings.showwarning = record_sync
            torch.cuda.set_sync_debug_mode("warn")
    elif profiler is not None and step == PROFILE_AFTER_STEPS + settings.profile_steps:
        if on_cuda:
            torch.cuda.set_sync_debug_mode("default")
            profiler.dflash_warnings.__exit__(None, None, None)
            torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        out = Path(settings.output_dir)
        # GPU time shows what the kernels cost; host time shows launch, sync and Python overhead.
        tables, averages = [f"optimizer steps {PROFILE_AFTER_STEPS + 1}..{step}"], profiler.key_averages()
        for sort_by in (["self_cuda_time_total"] if on_cuda else []) + ["self_cpu_time_total"]:
            tables.append(f"sorted by {sort_by}\n{averages.table(sort_by=sort_by, row_limit=50)}")
        if on_cuda:
            tables.append(
                f"host waits for the device (torch.cuda.set_sync_debug_mode; explicit synchronize() calls are not "
                f"listed): {profiler.dflash_syncs.total()} in {settings.profile_steps} steps"
            )
            tables += [f"{count} x\n{stack}" for stack, count in profiler.dflash_syncs.most_common()]
        (out / "profile.txt").write_text("\n".join(tables) + "\n")
        profiler.export_chrome_trace(str(out / "profile_trace.json"))
        logger.info("Profiled steps %d..%d: %s", PROFILE_AFTER_STEPS + 1, step, out / "profile.txt")
        return None
    return profiler


def check_finite_loss(loss: float, step: int, settings: ProgressSettings) -> None:
    """Stop a run whose logged loss (the mean over a logging window) is NaN or infinite.

    ds_configs/zero2.json turns DeepSpeed's bf16 overflow check off (a scan of every gradient and two
    host syncs per step, and bf16 has no loss scale to adjust), so a step with non-finite gradients
    is not skipped; the loss shows it at the next log, and the run stops there instead of training on.

    Raises:
        ValueError: naming the step, the settings to lower and the checkpoints to resume from.
    """
    if math.isfinite(loss):
        return
    first = max(step - settings.logging_steps + 1, 1)  # the window's first step: it diverged from there on
    saved = [p.name for p in checkpoint_dirs(settings.output_dir)]
    raise ValueError(
        f"the training loss is {loss} in optimizer steps {first}..{step}: the drafter diverged. Lower "
        f"--learning_rate (now {settings.learning_rate}) or --max_grad_norm (now {settings.max_grad_norm}) and "
        f"rerun, from scratch or with --resume_from_checkpoint set to a checkpoint of a step before {first}"
        + (f" ({settings.output_dir} has {', '.join(saved)})" if saved else "")
    )


@dataclass
class Progress:
    """The loop's small state, passed along: the step, the epoch, the current log window's sums,
    the latest held-out tau, the trackers and the progress bar, and the settings the reports read."""

    global_step: int
    trackers: list
    bar: object  # tqdm
    block_size: int  # the drafter's (its config's): the window's accuracy has one entry per drafted position
    settings: ProgressSettings
    loop_start: float = field(default_factory=time.perf_counter)
    epoch: int = 0
    eval_tau: float | None = None  # the latest held-out tau (the lead's), for the model card
    prompt_lookup_tau: float | None = None  # prompt lookup's on the same prompts (--eval_prompt_lookup)
    window: dict = field(default_factory=dict)  # sums since the last log line (`new_window`)

    def new_window(self, supply: FeatureSupply, device: torch.device) -> None:
        """Start the sums of a log window; loss and accuracy count real micro-batches only."""
        self.window = {
            "loss": torch.zeros((), device=device),
            "acc": torch.zeros(self.block_size - 1, device=device),
            "micro": 0,
            "real": 0,
            "tokens": 0,
            "samples": 0,
            "start": time.perf_counter(),
            "wait_s": supply.wait_s(),
            "target_s": supply.target_time.seconds(),
        }

    def add(self, loss: torch.Tensor, accepted: torch.Tensor, trains: bool, num_tokens: int, num_samples: int) -> None:
        """One micro-batch into the window; a filler counts as a micro-batch, nothing else."""
        if trains:
            self.window["loss"] += loss.detach()  # on the device: no host sync per micro-batch
            self.window["acc"] += torch.nan_to_num(accepted)
            self.window["real"] += 1
            self.window["tokens"] += num_tokens
            self.window["samples"] += num_samples
        self.window["micro"] += 1

    def record(self, scalars: dict, output_dir: str, with_step: bool = True) -> None:
        """Scalars to the trackers and, on the lead, a line of train_log.jsonl."""
        for tracker in self.trackers:
            tracker.log(scalars, step=self.global_step)
        with open(Path(output_dir) / "train_log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step, **scalars} if with_step else scalars) + "\n")


def window_scalars(progress: Progress, supply: FeatureSupply, settings: ProgressSettings, layout, scheduler, compute, device: torch.device) -> dict:
    """The log line of the window just ended, summed over the drafter ranks (a collective: every
    drafter rank calls it at the same step): loss, accuracy, tau estimate, rates of both sides."""
    window, drafters = progress.window, layout.dp_world
    elapsed = time.perf_counter() - window["start"]
    waited = supply.wait_s() - window["wait_s"]
    target_s = supply.target_time.seconds() - window["target_s"]
    drafter_s = max(elapsed - waited - target_s, 1e-9)  # this rank's time in drafter steps
    stats = torch.tensor(
        [
            window["loss"].item(),
            window["micro"],
            window["tokens"],
            window["samples"],
            waited,
            window["samples"] / drafter_s,
            window["samples"] / max(target_s, 1e-9),
            window["real"],
        ],
        device=device,
        dtype=torch.float64,
    )
    acc = window["acc"].double()
    torch.distributed.all_reduce(stats, group=layout.drafter_group)
    torch.distributed.all_reduce(acc, group=layout.drafter_group)
    acc = (acc / stats[7]).float()
    steps = stats[1].item() / drafters / settings.gradient_accumulation_steps
    scalars = {
        "loss": (stats[0] / stats[7]).item(),
        "acc_first": acc[0].item(),
        "tau_estimate": estimate_acceptance_length(acc),
        "tokens_per_s": stats[2].item() / elapsed,
        "samples_per_s": stats[3].item() / elapsed,  # end to end
        "step_time_s": elapsed / steps,
        "drafter_samples_per_s": stats[5].item(),  # demand: what the drafter ranks would take without waiting
        # --learning_rate times the schedule's factor now (Muon's matrices each run at a multiple of it)
        "lr": settings.learning_rate * scheduler.get_last_lr()[0] / scheduler.base_lrs[0],
        "epoch": progress.epoch,
        "elapsed_s": time.perf_counter() - progress.loop_start,  # wall time of the loop so far (compiles and evaluations included)
    }
    if supply.receiver is None:
        scalars["target_samples_per_s"] = stats[6].item()  # supply if the ranks only ran the target
    else:
        # The target ranks' running counters, as last seen in the headers on any drafter rank.
        counters = supply.receiver.supply_counters().to(device)  # [target ranks, (busy_us, idle_us, samples, tokens)]
        torch.distributed.all_reduce(counters, op=torch.distributed.ReduceOp.MAX, group=layout.drafter_group)
        # Since the start, not per window: headers run ahead of training by the prefetch depth,
        # and a target rank waiting at a checkpoint sends nothing new for a while.
        busy_s, idle_s = counters[:, 0].cpu() / 1e6, counters[:, 1].cpu() / 1e6
        scalars["target_samples_per_s"] = (counters[:, 2].cpu() / busy_s.clamp(min=1e-9)).sum().item()  # supply
        scalars["target_tokens_per_s"] = (counters[:, 3].cpu() / busy_s.clamp(min=1e-9)).sum().item()
        scalars["target_idle_frac"] = (idle_s / (busy_s + idle_s).clamp(min=1e-9)).mean().item()
        scalars["drafter_wait_s"] = stats[4].item() / drafters / steps  # per optimizer step
    if compute.backend == "flex":
        scalars["flex_compiles"] = flex_compile_stats()["compiles"]
    if device.type == "cuda":
        scalars["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        # Since the start: each retry freed the allocator's cache and synchronized to find memory. A count that
        # keeps rising means fragmentation, and slower steps (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
        scalars["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    return scalars


def start_progress(
    settings: ProgressSettings, resolved: dict, layout, schedule: Schedule, resume: ResumePoint, num_samples: int, world: int, block_size: int
) -> Progress:
    """The lead's output directory and trackers, the run's summary line, the progress bar.
    resolved: the run's resolved settings as a dict (`train_dflash.TrainSettings`, asdict), which
    the trackers record as the run's hyperparameters; block_size: the drafter's (its config's)."""
    if layout.is_lead:
        os.makedirs(settings.output_dir, exist_ok=True)
    # Trackers take flat scalars; lists and None become strings.
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in resolved.items()}
    trackers = start_trackers(settings, hparams, resume.global_step) if layout.is_lead else []
    anchors = f"{settings.num_anchors} anchors x block {block_size}"
    if resolved.get("anchor_sampling") == "pooled":
        anchors += f" (anchors: a sequence's mean, drawn over each micro-batch into {2 * settings.num_anchors} slots)"
    logger.info(
        "%d samples, %d ranks (%d drafter), %d optimizer steps (%d per epoch, %d epochs), %s",
        num_samples,
        world,
        layout.dp_world,
        schedule.total_steps,
        schedule.steps_per_epoch,
        schedule.num_epochs,
        anchors,
    )
    bar = tqdm(total=schedule.total_steps, initial=resume.global_step, disable=not layout.is_lead, desc="train", dynamic_ncols=True)
    return Progress(resume.global_step, trackers, bar, block_size, settings)


def format_tau(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
