"""Where a drafter rank's context features come from: its own target forward (colocated mode, with
the next micro-batches collated in a worker thread and, with --cache_target_outputs, the target's
outputs kept on the device after the first epoch), or the target ranks over the network (split
mode, `dflash_split.FeatureReceiver`). Also the target rank's side of split mode: its share of the
micro-batches through the target, sent to the drafter rank that trains each.

`settings` below is a `FeatureSettings`, `compute` the run's `train_dflash.Compute`, `data` its
`train_dflash.TrainData`.
"""

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from dflash_data import collate_batch
from dflash_model import DFlashConfig
from dflash_schedule import ResumePoint, Schedule, ScheduleSettings, is_eval_step, is_save_step
from dflash_split import BATCH, PADDING, FeatureReceiver, FeatureSender, Stopwatch, join_deepspeed_save
from dflash_target import TargetFeatureExtractor

logger = logging.getLogger("train_dflash")  # a training run's log lines all read `train_dflash:`


@dataclass(frozen=True)
class FeatureSettings:
    """The settings the supply and the serving of context features read: `train_dflash.TrainSettings`'
    fields of the same names (their `--help` says more), as `train_dflash.settings_for` copies them."""

    loss: str  # ce, or a loss against the target's distribution: its last hidden state then follows the features
    cache_target_outputs: bool  # colocated: keep each sample's target outputs on the device after its first forward
    prefetch_batches: int  # micro-batches kept ready ahead of training (the transport's queue depth in split mode)
    per_device_batch_size: int  # rows of a colocated micro-batch under flex (a short last one is filled up)
    gradient_accumulation_steps: int  # micro-batches per optimizer step: where the save and evaluation steps fall
    sequence_parallel_size: int  # drafter ranks that train one micro-batch together (a target rank counts it once)
    save_steps: int  # a checkpoint every N optimizer steps (0: never): the transport stays quiet across it
    eval_steps: int  # held-out tau every N optimizer steps (0: only at the end): the first target group evaluates


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host through pinned memory without blocking (a copy from pageable
    memory would wait for everything queued on the GPU)."""
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)  # no copy where it already is (CPU ranks may say cpu:0)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def prefetch(items, fn, depth: int = 2):
    """Yield `(*item, fn(item))` for every item, with fn running up to `depth` items ahead in one
    worker thread: CPU work (collation) leaves the critical path. The worker runs no compiled code."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = deque()
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) > depth:
                item, future = pending.popleft()
                yield (*item, future.result())
        while pending:
            item, future = pending.popleft()
            yield (*item, future.result())


def target_features(extractor: TargetFeatureExtractor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The target's part of one micro-batch: (target outputs [batch, S, n*hidden (+ hidden)] in the
    target dtype, label_ids [batch, S] int64).

    The target outputs are the context features (n target layers' outputs), followed, for a loss
    against the target's distribution (an extractor made with last_hidden), by the target's last
    hidden state: one tensor, so that the target-output cache and split mode's transport carry both
    as they carry the features alone; `MicroBatchLoss` splits it again. label_ids[:, t] is the token
    position t is trained to predict: the data's own token (--label_source data: label_ids is
    input_ids), or the target's argmax after position t - 1 (target_argmax; an extractor made with
    predict_next)."""
    output = extractor(input_ids, attention_mask)
    if not (extractor.predict_next or extractor.last_hidden):
        return output, input_ids
    features, *rest = output
    label_ids = torch.cat([input_ids[:, :1], rest.pop(0)[:, :-1]], dim=1) if extractor.predict_next else input_ids
    if extractor.last_hidden:
        features = torch.cat([features, rest.pop(0)], dim=-1)  # [batch, S, n*hidden + hidden]
    return features, label_ids


def target_output_dim(draft_config: DFlashConfig, loss: str) -> int:
    """Width of the target outputs `target_features` makes: the context features, plus the target's
    last hidden state for a loss against its distribution (any --loss but ce)."""
    return (len(draft_config.target_layer_ids) + (loss != "ce")) * draft_config.hidden_size


def available_memory(device: torch.device) -> tuple[int, int]:
    """(bytes available now, bytes in all) of the memory `device`'s tensors live in: the GPU's free
    memory, or the host's available memory (MemAvailable: free pages plus the page cache and other
    memory the kernel gives back on demand; free pages alone are few on any busy machine)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    host = psutil.virtual_memory()
    return host.available, host.total


def cache_margin(device: torch.device, capacity: int) -> int:
    """Bytes the target-output cache leaves for training beyond what is allocated when the cache is
    made (the models are loaded by then; the step's activations and AdamW's moments, allocated at the
    first step, are not): a quarter of a GPU, whose step may take tens of GiB at long sequences, or
    2 GiB of the host."""
    return capacity // 4 if device.type == "cuda" else 2 * 2**30


class TargetOutputCache:
    """Every training sample's target outputs, kept on the device after the target's first forward
    over the sample: later epochs read them back instead of running the target again.

    One flat buffer holds the samples end to end: features [total tokens, n*hidden] in the target
    dtype and, for --label_source target_argmax, label ids [total tokens] int64; sample i occupies
    rows offsets[i] .. offsets[i] + num_tokens[i]. Only real tokens are kept: a batch read back has
    zero features and the input ids as labels on its padding, which no anchor block attends to and
    the loss mask leaves out, so the loss and its gradients are those of the target's own forward.

    Raises ValueError when the buffer plus `cache_margin` does not fit in the memory available now
    (`available_memory`).
    """

    def __init__(self, num_tokens: list[int], feature_dim: int, dtype: torch.dtype, device: torch.device, with_labels: bool):
        self.num_tokens = np.asarray(num_tokens, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.num_tokens)[:-1]])
        self.filled = np.zeros(len(num_tokens), dtype=bool)
        self.device = device
        self.serving = False  # set at the first micro-batch read back (logged once)
        total = int(self.num_tokens.sum())
        need = total * (feature_dim * dtype.itemsize + (8 if with_labels else 0))
        available, capacity = available_memory(device)
        margin = cache_margin(device, capacity)
        if need + margin > available:
            raise ValueError(
                f"--cache_target_outputs needs {need / 2**30:.1f} GiB on {device} for {total:,} tokens x {feature_dim} "
                f"features, plus {margin / 2**30:.1f} GiB kept for training, and {available / 2**30:.1f} GiB of "
                f"{capacity / 2**30:.1f} are available: leave it off, or train on fewer or shorter samples "
                f"(--max_samples, --max_seq_length)"
            )
        self.features = torch.empty(total, feature_dim, dtype=dtype, device=device)
        self.labels = torch.empty(total, dtype=torch.long, device=device) if with_labels else None
        logger.info(
            "Target outputs: %.1f MiB reserved on %s for %d samples, %d tokens; each sample is cached at its first forward",
            need / 2**20,
            device,
            len(num_tokens),
            total,
        )

    def holds(self, indices: list[int]) -> bool:
        """Whether every sample of `indices` is cached."""
        return bool(self.filled[indices].all())

    def _rows(self, indices: list[int], seq_len: int, batch_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions in a [batch * S] batch, rows of the buffer) of the samples' real tokens, both
        int64 on the device; sample n of `indices` is the batch's row batch_rows[n] (default n)."""
        lengths = self.num_tokens[indices]
        batch_rows = np.arange(len(indices)) if batch_rows is None else np.asarray(batch_rows)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        batch_pos = np.repeat(batch_rows * seq_len, lengths) + within
        buffer_rows = np.repeat(self.offsets[indices], lengths) + within
        return to_device(torch.from_numpy(batch_pos), self.device), to_device(torch.from_numpy(buffer_rows), self.device)

    def store(self, indices: list[int], features: torch.Tensor, label_ids: torch.Tensor) -> None:
        """Keep the samples not cached yet of a batch the target just made, sample n of `indices` in
        row n: features [batch, S, n*hidden], label_ids [batch, S] (ignored without labels)."""
        new_rows = [n for n, i in enumerate(indices) if not self.filled[i]]
        if not new_rows:
            return
        samples = [indices[n] for n in new_rows]
        batch_pos, buffer_rows = self._rows(samples, features.shape[1], new_rows)
        self.features.index_copy_(0, buffer_rows, features.reshape(-1, features.shape[-1]).index_select(0, batch_pos))
        if self.labels is not None:
            self.labels.index_copy_(0, buffer_rows, label_ids.reshape(-1).index_select(0, batch_pos))
        self.filled[samples] = True

    def load(self, indices: list[int], input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (context_features [batch, S, n*hidden], label_ids [batch, S] int64) of a batch
        whose first len(indices) rows are those samples (filler rows after them get zeros); label_ids
        is input_ids without cached labels and on padding."""
        rows, seq_len = input_ids.shape
        batch_pos, buffer_rows = self._rows(indices, seq_len)
        features = torch.zeros(rows * seq_len, self.features.shape[1], dtype=self.features.dtype, device=self.device)
        features.index_copy_(0, batch_pos, self.features.index_select(0, buffer_rows))
        label_ids = input_ids
        if self.labels is not None:
            label_ids = input_ids.reshape(-1).clone().index_copy_(0, batch_pos, self.labels.index_select(0, buffer_rows))
        return features.view(rows, seq_len, -1), label_ids.view(rows, seq_len)


class FeatureSupply:
    """Where a drafter rank's micro-batches and context features come from: the target ranks over
    the network (split; `FeatureReceiver`), or this rank's own target forward (colocated), with the
    time each side took, for the rates in the log."""

    def __init__(
        self,
        settings: FeatureSettings,
        layout,
        draft_config: DFlashConfig,
        data,
        tokenizer,
        extractor,
        compute,
        device: torch.device,
        schedule: Schedule,
        schedule_settings: ScheduleSettings,
        resume: ResumePoint,
    ):
        self.settings, self.layout, self.data, self.tokenizer = settings, layout, data, tokenizer
        self.extractor, self.compute, self.device = extractor, compute, device
        self.receiver = None
        if layout.split:
            self.receiver = FeatureReceiver(
                layout.transport_group,
                layout.senders_of(layout.rank),
                device,
                settings.prefetch_batches,
                self._schedule(schedule.plan(data, schedule_settings, resume, layout.dp_world), resume.global_step),
                feature_dim=target_output_dim(draft_config, settings.loss),
                dtype=compute.dtype,
            )
        self.target_time = Stopwatch(device)  # colocated: this rank's target forwards
        self.cache = None
        if settings.cache_target_outputs:
            self.cache = TargetOutputCache(
                list(data.dataset["num_tokens"]),
                target_output_dim(draft_config, settings.loss),
                compute.dtype,
                device,
                with_labels=extractor.predict_next,
            )
        # Colocated: the next micro-batches are collated in a worker thread while this one trains.
        plan = schedule.plan(data, schedule_settings, resume, layout.dp_world)
        self.steps = plan if self.receiver is not None else prefetch(plan, self._collate_own, depth=settings.prefetch_batches)

    def _schedule(self, plan, first_step: int):
        """(source target rank, epoch, global index) of each micro-batch this rank trains; None where
        a checkpoint is saved (receiving pauses until the save is done)."""
        layout, accumulation = self.layout, self.settings.gradient_accumulation_steps
        for micro_done, (epoch, micro_step, _) in enumerate(plan, start=1):
            index = micro_step * layout.dp_world + layout.dp_rank
            yield layout.source_of(index), epoch, index
            if micro_done % accumulation == 0 and is_save_step(first_step + micro_done // accumulation, self.settings.save_steps):
                yield None

    def _collate_own(self, step):
        """Colocated: this rank's micro-batch of `step`, collated and pinned in a worker thread while
        the GPU trains the previous one. With flex a short last batch is filled up with rows that
        train nothing, so that it compiles no new shape."""
        indices = step[2][self.layout.dp_rank][0]
        batch = collate_batch(
            self.data.dataset.select(indices),
            self.tokenizer.pad_token_id,
            self.compute.pad_multiple,
            rows=self.settings.per_device_batch_size if self.compute.backend == "flex" else None,
        )
        return {k: v.pin_memory() for k, v in batch.items()} if self.compute.on_cuda else batch

    def next(self, collated: list, indices: list[int], trains: bool):
        """(input_ids [batch, S], loss_mask [batch, S], label_ids [batch, S], context_features [batch, S,
        n*hidden (+ hidden, `target_features`)], tokens) of this rank's next micro-batch, on the
        device, except a colocated rank's loss mask (on the host). A filler step (trains False) has
        no loss mask."""
        if self.receiver is not None:
            item = self.receiver.get()
            return item["input_ids"], item["loss_mask"], item["label_ids"], item["context_features"], item["num_tokens"]
        batch, device = collated[0], self.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        loss_mask = batch["loss_mask"]  # stays on the host: the loss finds its rows there (MicroBatchLoss)
        if not trains:
            loss_mask = torch.zeros_like(loss_mask)  # filler step: no anchor, zero loss, same collectives
        with self.target_time.time():
            if self.cache is not None and self.cache.holds(indices):
                if not self.cache.serving:
                    logger.info("Every sample of this micro-batch is cached: the target's outputs now come from the cache")
                    self.cache.serving = True
                context_features, label_ids = self.cache.load(indices, input_ids)
            else:
                context_features, label_ids = target_features(self.extractor, input_ids, batch["attention_mask"].to(device, non_blocking=True))
                if self.cache is not None:
                    self.cache.store(indices, context_features, label_ids)
        return input_ids, loss_mask, label_ids, context_features, sum(self.data.lengths[i] for i in indices)

    def wait_s(self) -> float:
        """Seconds this rank has waited for features from the target ranks (0 colocated)."""
        return self.receiver.wait_s if self.receiver else 0.0


def serve_context_features(
    plan,
    dataset,
    tokenizer,
    extractor: TargetFeatureExtractor,
    layout,
    settings: FeatureSettings,
    device: torch.device,
    pad_multiple: int,
    global_step: int,
    evaluate=None,
) -> None:
    """A target rank's whole run (split mode): its group's share of the plan's micro-batches
    (`layout.source_of`), tokens collated, the truncated target forward, the features sent by the
    group's first rank to the drafter rank that trains them (the other ranks of a tensor-parallel
    group run the same forward, whose collectives need them, and send nothing). Joins the drafters'
    checkpoint saves at the same steps; `evaluate` (the first group, with --eval_data) runs the
    lead's held-out evaluations at the same steps as the lead. With --sequence_parallel_size P every
    rank of a group gets the group's micro-batch; its samples and tokens count once, in the copy for
    the group's first rank, so the supply rate is in samples trained, as the drafters' demand is."""
    sender = None
    if layout.is_sender:
        sender = FeatureSender(layout.transport_group, layout.drafters_of(layout.rank), device, settings.prefetch_batches)
    group_sender, drafters = layout.target_group[0], layout.dp_world
    started = time.perf_counter()
    for micro_done, (epoch, micro_step, batches) in enumerate(plan, start=1):
        for d, (indices, trains) in enumerate(batches):
            index = micro_step * drafters + d
            if layout.source_of(index) != group_sender:
                continue
            busy = time.perf_counter()
            batch = collate_batch(dataset.select(indices), tokenizer.pad_token_id, pad_multiple)
            input_ids = batch["input_ids"].to(device)
            loss_mask = batch["loss_mask"].to(device) if trains else torch.zeros_like(batch["loss_mask"], device=device)
            features, label_ids = target_features(extractor, input_ids, batch["attention_mask"].to(device))  # stay on the GPU
            if sender is None:
                continue
            if device.type == "cuda":
                # Busy time is GPU time, not launch time. An event on this stream, not a device-wide
                # synchronize, which would also wait for the sender thread's send in flight.
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            sender.put(
                layout.drafter_ranks[d],
                BATCH if trains else PADDING,
                epoch,
                index,
                input_ids,
                loss_mask,
                label_ids,
                features,
                int(batch["attention_mask"].sum()),
                time.perf_counter() - busy,
                counted=d % settings.sequence_parallel_size == 0,
            )
        if micro_done % settings.gradient_accumulation_steps == 0:
            global_step += 1
            if is_save_step(global_step, settings.save_steps):
                if sender is not None:
                    sender.flush()  # no send in flight across the world barriers (dflash_split.py, "Checkpoints in split mode")
                join_deepspeed_save()
            if evaluate is not None and is_eval_step(global_step, settings.eval_steps):
                evaluate()
    if sender is None:
        logger.info("Target rank %d done (tensor-parallel with ranks %s; rank %d sent the features)", layout.rank, layout.target_group, group_sender)
    else:
        sender.finish()  # before the final evaluation: the lead receives every END first, then evaluates
        elapsed = time.perf_counter() - started
        logger.info(
            "Target rank %d done: %d samples, %d tokens in %.0f s; %.2f samples/s and %.0f tokens/s while busy, "
            "idle %.0f%% of the time (waiting for the drafter ranks)",
            layout.rank,
            sender.samples,
            sender.tokens,
            elapsed,
            sender.samples / max(sender.busy_s, 1e-9),
            sender.tokens / max(sender.busy_s, 1e-9),
            100 * sender.idle_s / max(elapsed, 1e-9),
        )
    if evaluate is not None and not is_eval_step(global_step, settings.eval_steps):
        evaluate()
