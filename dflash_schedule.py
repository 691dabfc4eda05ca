"""The run's order, the same on every rank: the micro-batches of each epoch and which drafter rank
trains each (length-grouped or shuffled, padded with zero-loss fillers so that every drafter rank takes the
same steps), the optimizer steps of the run, and the steps that save a checkpoint or evaluate.

`settings` below is a `ScheduleSettings`; `data` the run's `train_dflash.TrainData`.
"""

import math
from dataclasses import dataclass

from dflash_data import length_grouped_batches, shuffled_batches

BATCH_ORDERS = ("length_grouped", "random")  # --batch_order: how an epoch's samples form micro-batches


@dataclass(frozen=True)
class ScheduleSettings:
    """The settings the run's order and length depend on: `train_dflash.TrainSettings`' fields of the
    same names (their `--help` says more), as `train_dflash.settings_for` copies them."""

    per_device_batch_size: int  # samples per micro-batch
    gradient_accumulation_steps: int  # micro-batches per optimizer step, on each drafter rank
    sequence_parallel_size: int  # drafter ranks that train one micro-batch together
    seed: int  # each epoch's order of micro-batches
    batch_order: str  # length_grouped (similar lengths share a micro-batch) or random
    max_steps: int  # optimizer steps in all; -1: num_train_epochs sets the length
    num_train_epochs: int


@dataclass
class ResumePoint:
    """Where training starts (`find_resume_point`): a checkpoint's trainer state, or step 0."""

    path: str | None  # the checkpoint directory, None for a fresh run
    state: dict  # its trainer_state.json; {} for a fresh run

    @property
    def global_step(self) -> int:
        return self.state.get("global_step", 0)

    @property
    def epoch(self) -> int:
        return self.state.get("epoch", 0)

    @property
    def micro_step(self) -> int:
        return self.state.get("micro_step_in_epoch", 0)


def epoch_batches(lengths: list[int], settings: ScheduleSettings, epoch: int, drafter_ranks: int) -> list[list[int] | None]:
    """The epoch's micro-batches in global order; micro-batch i goes to drafter rank i % drafter_ranks.

    Every sample appears exactly once. All drafter ranks must take the same number of steps
    (gradients are all-reduced), so the list is padded with None to a multiple of
    drafter_ranks x gradient_accumulation_steps; a rank given None runs a zero-loss filler step.
    With --sequence_parallel_size P, each micro-batch appears P times in a row: the P consecutive
    drafter ranks of a sequence-parallel group train it together.
    """
    sp = settings.sequence_parallel_size
    make_batches = shuffled_batches if settings.batch_order == "random" else length_grouped_batches
    batches = make_batches(lengths, settings.per_device_batch_size, settings.seed, epoch)
    batches += [None] * (-len(batches) % (drafter_ranks // sp * settings.gradient_accumulation_steps))
    return [batch for batch in batches for _ in range(sp)]


def train_plan(lengths: list[int], settings: ScheduleSettings, start_epoch: int, skip_micro: int, micro_steps: int, drafter_ranks: int):
    """The micro-steps still to train, in the order every rank agrees on (target ranks make and
    send them in this order, drafter ranks receive and train them in it).

    Yields (epoch, micro_step, batches) for `micro_steps` micro-steps from (start_epoch, skip_micro):
    micro_step counts per drafter rank within the epoch, and batches[d] = (sample indices, trains)
    is drafter rank d's micro-batch, global index micro_step * drafter_ranks + d. trains False marks
    a filler step: it runs on the rank's first micro-batch of the epoch with the loss masked out.
    """
    epoch, first = start_epoch, skip_micro
    while micro_steps > 0:
        batches = epoch_batches(lengths, settings, epoch, drafter_ranks)
        for micro_step in range(first, len(batches) // drafter_ranks):
            if micro_steps == 0:
                return
            row = batches[micro_step * drafter_ranks : (micro_step + 1) * drafter_ranks]
            yield epoch, micro_step, [(ids, True) if ids is not None else (batches[d] or batches[0], False) for d, ids in enumerate(row)]
            micro_steps -= 1
        epoch, first = epoch + 1, 0


def real_micro_batches(num_samples: int, settings: ScheduleSettings, micro_step: int, drafter_ranks: int) -> int:
    """How many micro-batches of the optimizer step that `micro_step` (counted per drafter rank within
    its epoch, as train_plan yields it) belongs to hold samples; the rest of the step's
    drafter_ranks x gradient_accumulation_steps are fillers. An epoch holds ceil(num_samples /
    per_device_batch_size) real micro-batches, then its fillers (epoch_batches)."""
    per_step = drafter_ranks * settings.gradient_accumulation_steps
    real = -(-num_samples // settings.per_device_batch_size) * settings.sequence_parallel_size  # each once per rank of its group
    first = (micro_step // settings.gradient_accumulation_steps) * per_step
    return max(0, min(per_step, real - first))


@dataclass(frozen=True)
class Schedule:
    """How many steps the run takes and which micro-batches are left (`make_schedule`)."""

    total_steps: int  # optimizer steps of the whole run
    steps_per_epoch: int
    num_epochs: int
    micro_steps_left: int  # per drafter rank, from the resume point

    def plan(self, data, settings: ScheduleSettings, resume: ResumePoint, drafters: int):
        """The micro-steps still to train (`train_plan`), the same on every rank."""
        return train_plan(data.lengths, settings, resume.epoch, resume.micro_step, self.micro_steps_left, drafters)


def make_schedule(settings: ScheduleSettings, data, resume: ResumePoint, drafters: int) -> Schedule:
    """Steps per epoch and in all (--max_steps or --num_train_epochs); a checkpoint resumes only with
    the number of drafter ranks, the --sequence_parallel_size and the --batch_order that wrote it."""
    micro_steps_per_epoch = len(epoch_batches(data.lengths, settings, 0, drafters)) // drafters
    steps_per_epoch = micro_steps_per_epoch // settings.gradient_accumulation_steps
    total_steps = settings.max_steps if settings.max_steps > 0 else steps_per_epoch * settings.num_train_epochs
    if resume.state.get("drafter_ranks", drafters) != drafters:
        raise ValueError(
            f"--resume_from_checkpoint {resume.path} was written by {resume.state['drafter_ranks']} drafter ranks, this run has "
            f"{drafters}: resume with the same number of processes and --target_ranks {resume.state.get('target_ranks', 0)}"
        )
    if resume.path and resume.state.get("sequence_parallel_size", 1) != settings.sequence_parallel_size:
        raise ValueError(
            f"--resume_from_checkpoint {resume.path} was written with --sequence_parallel_size "
            f"{resume.state.get('sequence_parallel_size', 1)}, this run has {settings.sequence_parallel_size}: the order of "
            f"micro-batches depends on it; resume with the same size"
        )
    written_order = resume.state.get("batch_order", "length_grouped")
    if resume.path and written_order != settings.batch_order:
        raise ValueError(
            f"--resume_from_checkpoint {resume.path} was written with --batch_order {written_order}, this run has "
            f"{settings.batch_order}: the order of micro-batches depends on it; resume with --batch_order {written_order}"
        )
    micro_steps_left = max(0, total_steps - resume.global_step) * settings.gradient_accumulation_steps
    return Schedule(total_steps, steps_per_epoch, math.ceil(total_steps / steps_per_epoch), micro_steps_left)


def is_save_step(step: int, save_steps: int) -> bool:
    """Whether a checkpoint is written after optimizer step `step`, with --save_steps `save_steps` (0:
    never); every rank must agree."""
    return save_steps > 0 and step % save_steps == 0


def is_eval_step(step: int, eval_steps: int) -> bool:
    """Whether held-out tau is measured after optimizer step `step`, with --eval_steps `eval_steps` (0:
    only at the end; with --eval_data). Every rank must agree: in split mode the first target group
    evaluates. The last step is evaluated if it is not one."""
    return eval_steps > 0 and step % eval_steps == 0
