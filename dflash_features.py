"""Where a drafter rank's context features come from: its own target forward (colocated mode, with
the next micro-batches collated in a worker thread and, with --cache_target_outputs, the target's
outputs kept on the device after the first epoch), or the target ranks over the network (split
mode, `dflash_split.FeatureReceiver`). Also the target rank's side of split mode: its share of the
micro-batches through the target, sent to the drafter rank that trains each.

    from dflash_features import TargetFeatureExtractor

    extractor = TargetFeatureExtractor(target, target_layer_ids=[1, 9, 17, 25, 33])  # target from dflash_target.load_target
    context_features = extractor(input_ids, attention_mask)  # [batch, S, 5 * hidden]

The drafter is conditioned on the outputs of target decoder layers
`target_layer_ids` (0-based, i.e. HF `output_hidden_states[id + 1]`), concatenated in list
order. `TargetFeatureExtractor` captures them with forward hooks on the decoder layers, never from
`hidden_states[-1]`: transformers overwrites that entry with the final-norm output, which
serving engines never hand to the drafter. The forward stops after the deepest captured
layer (later layers are dropped, or skipped when the target is kept whole for evaluation; the LM
head is never called), and the drafter borrows the target's embedding and LM head by reference.

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
import torch.nn as nn
from transformers import PreTrainedModel

from dflash_compile import CUDAGraphCall, compile_once_locked, running_compiled
from dflash_data import collate_batch
from dflash_model import DFlashConfig
from dflash_schedule import ResumePoint, Schedule, ScheduleSettings, is_eval_step, is_save_step
from dflash_split import BATCH, PADDING, FeatureReceiver, FeatureSender, Stopwatch, join_deepspeed_save
from dflash_target import decoder_and_layers

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


class TargetFeatureExtractor:
    """Runs the frozen target and returns the outputs of decoder layers `target_layer_ids`.

    target_layer_ids: 0-based decoder-layer indices; layer `i`'s output is HF
        `output_hidden_states[i + 1]`, captured by forward hooks (not from `hidden_states[-1]`,
        which transformers replaces with the final-norm output).
    truncate: drop the decoder layers after `max(target_layer_ids)` from the target IN PLACE
        (their memory is freed); the target can no longer produce logits afterwards. The LM head
        is kept (the drafter uses it). Truncated or not, the forward of `__call__` stops after the
        deepest captured layer, unless `predict_next`.
    predict_next: also return the target's greedy next token at every position (argmax of its
        logits): the forward runs every layer, the final norm and the LM head. Needs truncate=False.
    last_hidden: also return the target's last hidden state (the final-norm output, the LM head's
        input) at every position, from which a drafter rank recomputes the target's distribution
        with the head it holds (the distribution losses of dflash_loss.py): the forward runs every
        layer and the final norm. Needs truncate=False.

    Attributes the drafter borrows by reference: `embed_tokens` (input embedding, [vocab_size,
    hidden]) and `lm_head` (output head; the same weight as `embed_tokens` for tied targets
    like SmolLM2). Sizes: `hidden_size`, `num_target_layers` (the untruncated layer count,
    written into the drafter's config), `vocab_size` (rows of the embedding).
    """

    def __init__(
        self, target: PreTrainedModel, target_layer_ids: list[int], truncate: bool = True, predict_next: bool = False, last_hidden: bool = False
    ):
        if truncate and (predict_next or last_hidden):
            raise ValueError("TargetFeatureExtractor(predict_next=True or last_hidden=True) needs the whole target: pass truncate=False")
        decoder, layers_name, layers = decoder_and_layers(target)
        # The untruncated count (the drafter config needs it). The config keeps it even when an
        # earlier extractor already truncated this target's layer list.
        self.num_target_layers = getattr(target.config.get_text_config(), "num_hidden_layers", None) or len(layers)
        target_layer_ids = [int(i) for i in target_layer_ids]
        if not target_layer_ids:
            raise ValueError("target_layer_ids is empty: give at least one target decoder layer index.")
        bad = [i for i in target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {target_layer_ids} has {bad} outside [0, {self.num_target_layers - 1}]: the target "
                f"has {self.num_target_layers} decoder layers and the ids are 0-based (id i = hidden_states[i + 1])."
            )
        if max(target_layer_ids) >= len(layers):
            raise ValueError(
                f"target_layer_ids {target_layer_ids} needs layer {max(target_layer_ids)}, but this target was already "
                f"truncated to {len(layers)} layers by an earlier TargetFeatureExtractor; load the target again."
            )
        if len(set(target_layer_ids)) != len(target_layer_ids):
            raise ValueError(f"target_layer_ids {target_layer_ids} contains duplicates; each layer may appear once.")
        self.target_layer_ids = target_layer_ids

        # Keep references before truncating: the head sits outside the decoder, the embedding inside it.
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.hidden_size = target.config.get_text_config().hidden_size
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.dtype = self.embed_tokens.weight.dtype

        if truncate:
            layers = nn.ModuleList(layers[: max(target_layer_ids) + 1])
            setattr(decoder, layers_name, layers)  # the dropped layers lose their last reference here
        self.decoder, self.layers_name = decoder, layers_name  # called without the LM head
        self.layers, self.truncated, self.predict_next, self.last_hidden = layers, truncate, predict_next, last_hidden

        self._captured: dict[int, torch.Tensor] | None = None  # only filled during __call__
        self._graphed = None  # a CUDAGraphCall of the forward, after use_cuda_graphs()
        self.additive_mask = getattr(target.config, "_attn_implementation", None) == "eager"
        self._hook_handles = [layers[i].register_forward_hook(self._make_hook(i)) for i in target_layer_ids]

    def _make_hook(self, layer_id: int):
        def hook(module, args, output):
            if self._captured is not None:
                # Decoder layers return a tensor in transformers 5; older / remote-code ones a tuple.
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()  # not inference_mode: the drafter's autograd must be able to save these tensors
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """input_ids [batch, S] long, attention_mask [batch, S] (1 = real token, right padding)
        -> context_features [batch, S, len(target_layer_ids) * hidden] in the target dtype,
        layer outputs concatenated in `target_layer_ids` order. With `predict_next` and/or
        `last_hidden` a tuple, in this order: (context_features, next_ids [batch, S] int64 (next_ids[:, t]
        the target's argmax after position t), last_hidden [batch, S, hidden] in the target dtype)."""
        if self._graphed is not None and input_ids.is_cuda:
            # A copy: the graph's output buffers are overwritten by the next replay, while the drafter's
            # autograd (and in split mode the sender thread) may still hold these tensors.
            output = self._graphed(input_ids, attention_mask)
            return tuple(t.clone() for t in output) if isinstance(output, tuple) else output.clone()
        return self._features(input_ids, attention_mask, explicit_mask=False)

    def _features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, explicit_mask: bool):
        """The forward behind `__call__`. explicit_mask: pass the decoder a ready 4D mask (causal and
        padding, [batch, 1, S, S]) instead of the 2D one, so that transformers builds nothing from
        the data (its mask code may check the padding on the host, which a CUDA graph cannot hold)."""
        mask = attention_mask
        if explicit_mask:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            mask = (positions[None, :] <= positions[:, None])[None, None] & attention_mask.bool()[:, None, None, :]  # [batch, 1, S, S]
            if self.additive_mask:
                mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(~mask, torch.finfo(self.dtype).min)
        self._captured = {}
        # A target kept whole (for evaluation) runs only the layers up to the deepest captured one
        # here too: the decoder iterates a prefix of its layer list for the duration of this call.
        full = None if self.truncated or self.predict_next or self.last_hidden else getattr(self.decoder, self.layers_name)
        if full is not None:
            setattr(self.decoder, self.layers_name, nn.ModuleList(full[: max(self.target_layer_ids) + 1]))
        try:
            output = self.decoder(input_ids=input_ids, attention_mask=mask, use_cache=False)
            features = [self._captured[i] for i in self.target_layer_ids]  # each [batch, S, hidden]
        finally:
            self._captured = None
            if full is not None:
                setattr(self.decoder, self.layers_name, full)
        features = torch.cat(features, dim=-1)  # [batch, S, len(ids) * hidden]
        if not (self.predict_next or self.last_hidden):
            return features
        last = output[0]  # the final-norm hidden states [batch, S, hidden] (a ModelOutput or a tuple)
        return (features, *([self._greedy_next(last)] if self.predict_next else []), *([last] if self.last_hidden else []))

    def _greedy_next(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax of the LM head over the final-norm hidden states [batch, S, hidden] -> [batch, S]
        int64, in chunks of positions that bound the logits to ~2**28 elements (a 150k vocabulary
        at batch 8 x 4096 would otherwise take 10 GB in bf16). Logit scaling and soft-capping are
        monotone, so the raw head's argmax is the target's."""
        batch, seq_len, _ = hidden.shape
        chunk = max(1, 2**28 // (batch * self.vocab_size))
        return torch.cat([self.lm_head(hidden[:, i : i + chunk]).argmax(-1) for i in range(0, seq_len, chunk)], dim=1)

    def use_cuda_graphs(self) -> None:
        """Replay the feature forward from CUDA graphs, one per input shape (`CUDAGraphCall`, one
        memory pool for all), on CUDA inputs: the whole truncated target forward then costs one
        launch instead of one per kernel, which is most of its time for a small target at a small
        batch. Training pads lengths to a fixed multiple and fills short batches up, so few shapes
        occur. Compiled layers (`compile_layers`) compile in the warm-up before the capture.

        Raises:
            ValueError: if the target's attention takes no 4D mask (flash attention, flex).
        """

        implementation = getattr(self.decoder.config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"CUDA graphs for the target need sdpa or eager attention; this target uses {implementation!r}")
        self.additive_mask = implementation == "eager"
        self._graphed = CUDAGraphCall(lambda input_ids, attention_mask: self._features(input_ids, attention_mask, explicit_mask=True))

    def compile_layers(self) -> None:
        """torch.compile the forward of each decoder layer that runs (dynamic=False, no grad), for the
        feature forward of `__call__` only.

        Fuses the norms, RoPE, SwiGLU and residual adds around the matmuls (measured at Qwen3-8B
        shapes on an H200 in BENCHMARKS.md). Layers of one architecture share one graph per shape;
        the first call at each new shape (per layer) compiles under the compile lock, like the
        drafter's (`dflash_compile.compile_once_locked`). The capture hooks stay eager around it.
        A target kept whole also verifies drafts with a growing KV cache (evaluation), whose every
        new length would compile a graph: outside the feature forward its layers run eagerly.
        """
        for index, layer in enumerate(self.layers):
            # A layer compiled for an earlier extractor of this target keeps its graphs, now switched by this one.
            eager = getattr(layer.forward, "eager_forward", layer.forward)
            compiled = getattr(layer.forward, "compiled_forward", None) or _locked_compiled_forward(torch.compile(eager, dynamic=False), index)
            layer.forward = self._features_only(eager, compiled)

    def _features_only(self, eager, compiled):
        """A layer forward that runs `compiled` inside this extractor's feature forward (while it
        captures) and `eager` anywhere else."""

        def forward(*args, **kwargs):
            return (eager if self._captured is None else compiled)(*args, **kwargs)

        forward.eager_forward, forward.compiled_forward = eager, compiled
        return forward

    def remove_hooks(self) -> None:
        """Detach the capture hooks from the target's layers."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


def _signature(value):
    """What dynamo specialises a static graph on: shapes and dtypes of tensors, None-ness, plain values."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__


def _locked_compiled_forward(compiled, index: int):
    """A decoder layer's compiled forward whose first call at each new input signature runs under
    the compile lock (it is the compile)."""

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        key = ("target_layer", index, str(hidden.device), _signature(args), _signature(sorted(kwargs.items())))
        result = []
        what = f"target layer {index} forward on {hidden.device}, {hidden.dtype}, hidden {list(hidden.shape)}"
        compile_once_locked(key, what, lambda: result.append(compiled(*args, **kwargs)), hidden.device)
        if result:
            return result[0]
        with running_compiled():
            return compiled(*args, **kwargs)

    return forward


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
                data.dataset["num_tokens"][:],  # one slice: list(Column) reads index by index
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
