"""Split mode (--target_ranks N): target ranks make context features, drafter ranks train on them.

On every node, local ranks [0, N) run the frozen target, alone or in tensor-parallel groups of
--target_tp_size ranks that share one copy; the node's other ranks train the drafter under
DeepSpeed ZeRO-2 with all drafter ranks as its data-parallel group (docs/topology.md). A training
run (dflash_topology.py, dflash_features.py, train_dflash.py) uses the pieces below in the order it
meets them:

- `node_ranks`, `check_shared_output_dir`, `check_split`: the nodes, one --output_dir they all see,
  a split that fits them.
- `make_tensor_parallel_groups`, `join_tensor_parallel_init`: the target groups, and the other
  ranks' part in DeepSpeed AutoTP's one world broadcast.
- `make_rank_layout`: who does what, which target group feeds which micro-batch (always one on the
  drafter's own node), and the process groups (created on every rank).
- `DrafterGroupMPU`: the `mpu` object that points DeepSpeed's data parallelism at the drafter group.
- `FeatureSender` / `FeatureReceiver`: `(input_ids, loss_mask, context features)` from a target rank
  to a drafter rank, point to point (NCCL on GPU, gloo on CPU) behind a fixed-size int64 header.
  A worker thread and a bounded queue on each side let both sides run `depth` batches ahead, so a
  drafter never waits while the target ranks keep up.
- `join_deepspeed_save`: the target ranks' part of the whole-world barriers in DeepSpeed's
  `save_checkpoint`.
- `broadcast_drafter_weights` / `broadcast_scalars`: held-out evaluation on the first target group.

Rank liveness, which colocated runs use too, is dflash_liveness.py; the `--target_ranks auto`
calibration is dflash_topology.py's, beside `time_rank_split`.
"""

import inspect
import os
import queue
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_target import decoder_and_layers

# ----------------------------------------------------------------------------------------------
# Nodes, rank layout and process groups
#
# `--target_ranks N` counts per node: on every node, local ranks [0, N) are target ranks and the
# rest drafter ranks. Target ranks form tensor-parallel groups of K = `--target_tp_size`
# consecutive local ranks (one copy of the target each; K = 1: one rank, one whole copy). Each
# node's target groups feed that node's drafter ranks only, so the large feature tensors never
# cross nodes; only the drafters' gradient all-reduce (DeepSpeed ZeRO-2 over all drafter ranks)
# and the small checkpoint and logging collectives do.


def node_ranks(rank: int, world: int, device: torch.device) -> list[list[int]]:
    """The global ranks of each node, each list in local-rank order. Collective.

    The node of a rank is torchrun's GROUP_RANK (accelerate launch --machine_rank); several
    launches on one machine are then several nodes, which is how multi-node runs are simulated.
    Raises ValueError when the nodes have different numbers of ranks (the per-node layout needs
    the same on all)."""
    mine = torch.tensor([int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))], device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    by_node: dict[int, list[tuple[int, int]]] = {}
    for r, t in enumerate(everyone):
        node, local = t.tolist()
        by_node.setdefault(node, []).append((local, r))
    nodes = [[r for _, r in sorted(members)] for _, members in sorted(by_node.items())]
    if len({len(members) for members in nodes}) > 1:
        raise ValueError(
            f"the nodes have different numbers of processes ({[len(m) for m in nodes]}): launch the same "
            f"--num_processes / --num_machines on every node (accelerate launch), the rank split is per node"
        )
    return nodes


def check_split(num_target_ranks: int, tp_size: int, ranks_per_node: int, num_nodes: int = 1) -> None:
    """Reject a split that cannot be laid out on `num_nodes` nodes of `ranks_per_node` ranks (called
    before anything loads). Raises ValueError naming --target_ranks / --target_tp_size and the fix."""
    where = (
        f"each of the {num_nodes} nodes ({ranks_per_node} processes per node; --target_ranks counts per node)"
        if num_nodes > 1
        else f"a world of {ranks_per_node} process(es)"
    )
    if not 0 <= num_target_ranks < ranks_per_node:
        raise ValueError(
            f"--target_ranks {num_target_ranks} leaves no drafter rank in {where}: use 0 (colocated) to "
            f"{ranks_per_node - 1}, or launch more processes (accelerate launch --num_processes)."
        )
    if tp_size < 1:
        raise ValueError(f"--target_tp_size must be >= 1, got {tp_size}")
    if tp_size > 1 and num_target_ranks == 0:
        raise ValueError(
            f"--target_tp_size {tp_size} needs target ranks: in colocated mode (--target_ranks 0) every rank holds the "
            f"whole target. Pass --target_ranks {tp_size} (a multiple of --target_tp_size, counted per node) or auto."
        )
    if num_target_ranks % tp_size:
        raise ValueError(
            f"--target_ranks {num_target_ranks} is not a multiple of --target_tp_size {tp_size}: the target ranks of a node "
            f"form groups of {tp_size} ranks that share one copy of the target. Pass --target_ranks "
            f"{max(tp_size, num_target_ranks - num_target_ranks % tp_size)}."
        )


def make_tensor_parallel_groups(nodes: list[list[int]], tp_size: int, rank: int) -> tuple[list[list[int]], dist.ProcessGroup | None]:
    """Groups of `tp_size` consecutive local ranks on every node (as many as fit); collective.

    The first N / tp_size groups of a node become its target groups for --target_ranks N, so
    `--target_ranks auto` can time the target in these groups and keep them. Returns (the groups'
    global ranks, node by node; this rank's group handle, None if it is in none or tp_size is 1)."""
    groups, mine = [], None
    for members in nodes:
        for start in range(0, len(members) - tp_size + 1, tp_size):
            ranks = members[start : start + tp_size]
            groups.append(ranks)
            if tp_size > 1:
                handle = dist.new_group(ranks)
                if rank in ranks:
                    mine = handle
    return groups, mine


@dataclass
class RankLayout:
    """Roles and groups of one rank. Colocated mode (no target ranks) is the special case where
    every rank is a drafter rank and the drafter group is the whole world."""

    rank: int
    world: int
    nodes: list[list[int]]  # global ranks of each node, in local-rank order
    target_groups: list[list[int]]  # one copy of the target each (tensor-parallel over its ranks, all on one node); empty when colocated
    drafter_ranks: list[int]  # every node's ranks after its target ranks, in global order
    drafter_group: dist.ProcessGroup  # DeepSpeed's data-parallel group; handle is a non-member marker on target ranks
    self_group: dist.ProcessGroup  # this rank alone: DeepSpeed's (trivial) model-parallel group
    transport_group: dist.ProcessGroup | None  # all ranks, used only for feature send/recv (split mode)
    tp_group: dist.ProcessGroup | None  # this target rank's tensor-parallel group (tp_size > 1)
    eval_group: dist.ProcessGroup | None  # the lead and the first target group: held-out evaluation (split mode)

    @property
    def split(self) -> bool:
        return bool(self.target_groups)

    @property
    def target_ranks(self) -> list[int]:
        return sorted(r for group in self.target_groups for r in group)

    @property
    def target_ranks_per_node(self) -> int:
        return len(self.target_ranks) // len(self.nodes)

    @property
    def tp_size(self) -> int:
        return len(self.target_groups[0]) if self.target_groups else 1

    @property
    def is_target(self) -> bool:
        return self.rank in self.target_ranks

    @property
    def target_group(self) -> list[int]:
        """The ranks sharing this target rank's copy of the target ([] on a drafter rank)."""
        return next((g for g in self.target_groups if self.rank in g), [])

    @property
    def is_sender(self) -> bool:
        """The first rank of each target group sends the group's (replicated) features."""
        return self.is_target and self.rank == self.target_group[0]

    @property
    def is_evaluator(self) -> bool:
        """Split mode: the first target group keeps the whole target and runs held-out evaluation for the lead."""
        return self.split and self.rank in self.target_groups[0]

    @property
    def is_lead(self) -> bool:
        """The first drafter rank logs, checkpoints, evaluates (colocated) and pushes to the Hub."""
        return self.rank == self.drafter_ranks[0]

    @property
    def dp_rank(self) -> int:
        return self.drafter_ranks.index(self.rank) if self.rank in self.drafter_ranks else -1

    @property
    def dp_world(self) -> int:
        return len(self.drafter_ranks)

    def node_of(self, rank: int) -> int:
        return next(n for n, members in enumerate(self.nodes) if rank in members)

    def senders_of(self, drafter_rank: int) -> list[int]:
        """The target groups' senders on `drafter_rank`'s node: all that ever send to it."""
        node = self.node_of(drafter_rank)
        return [g[0] for g in self.target_groups if self.node_of(g[0]) == node]

    def drafters_of(self, sender: int) -> list[int]:
        """The drafter ranks on `sender`'s node: all it ever sends to."""
        node = self.node_of(sender)
        return [r for r in self.drafter_ranks if self.node_of(r) == node]

    def source_of(self, index: int) -> int:
        """The sender that makes global micro-batch `index` (trained by drafter rank index % dp_world).
        A node's target groups take its drafters' micro-batches in turn; on one node with one-rank
        groups that is target rank index % N."""
        drafter, micro_step = self.drafter_ranks[index % self.dp_world], index // self.dp_world
        senders, local = self.senders_of(drafter), self.drafters_of(drafter)
        return senders[(micro_step * len(local) + local.index(drafter)) % len(senders)]

    def describe(self) -> str:
        """One line for the log: who feeds whom, node by node."""
        parts = []
        for n, members in enumerate(self.nodes):
            groups = [g for g in self.target_groups if g[0] in members]
            targets = sorted(r for g in groups for r in g)
            drafters = [r for r in self.drafter_ranks if r in members]
            where = f"node {n}: " if len(self.nodes) > 1 else ""
            tp = f" (tensor-parallel groups {groups})" if self.tp_size > 1 else ""
            parts.append(f"{where}target ranks {targets}{tp} feed drafter ranks {drafters}")
        return "; ".join(parts) + f"; rank {self.drafter_ranks[0]} leads"


def make_rank_layout(
    num_target_ranks: int,
    rank: int,
    world: int,
    nodes: list[list[int]] | None = None,
    tp_groups: tuple[list[list[int]], dist.ProcessGroup | None] | None = None,
) -> RankLayout:
    """Local ranks [0, num_target_ranks) of every node run the target, in the tensor-parallel groups
    `tp_groups` (from `make_tensor_parallel_groups`; default one rank per group); the rest train.
    Collective: every rank calls it with the same arguments, because `new_group` must be entered by
    all ranks in the same order.

    nodes: from `node_ranks` (default: one node of `world` ranks).
    Raises ValueError for a split `check_split` rejects.
    """
    nodes = nodes or [list(range(world))]
    groups, tp_group = tp_groups or ([[r] for members in nodes for r in members], None)
    tp_size = len(groups[0])
    check_split(num_target_ranks, tp_size, len(nodes[0]), len(nodes))
    target_groups = [g for g in groups if nodes[next(n for n, m in enumerate(nodes) if g[0] in m)].index(g[0]) < num_target_ranks]
    target_ranks = {r for g in target_groups for r in g}
    drafter_ranks = [r for r in range(world) if r not in target_ranks]
    drafter_group = dist.new_group(drafter_ranks)
    self_group = None
    for r in range(world):  # one single-rank group per rank, created in the same order everywhere
        group = dist.new_group([r])
        if r == rank:
            self_group = group
    transport_group = dist.new_group(list(range(world))) if target_groups else None
    eval_group = dist.new_group(sorted({drafter_ranks[0], *target_groups[0]})) if target_groups else None
    return RankLayout(
        rank,
        world,
        nodes,
        target_groups,
        drafter_ranks,
        drafter_group,
        self_group,
        transport_group,
        tp_group if rank in target_ranks else None,
        eval_group,
    )


class DrafterGroupMPU:
    """The `mpu` argument of `deepspeed.initialize`: data parallelism over the drafter group, no
    model parallelism. DeepSpeed 0.19.8 reads the data-parallel group, size, rank and ranks (engine,
    ZeRO-2 optimizer, batch-size check in its config) and the model-parallel group, size and rank
    (gradient-norm reduction, checkpoint names). Without an mpu it uses a copy of the whole world,
    and a ZeRO-2 step on the drafter ranks alone waits forever for the target ranks.
    No `initialize_sequence_parallel` attribute: DeepSpeed would take that for a sequence-parallel
    mpu and fall back to the world group."""

    def __init__(self, layout: RankLayout):
        self.layout = layout

    def get_data_parallel_group(self):
        return self.layout.drafter_group

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp_world

    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.layout.drafter_ranks)

    def get_model_parallel_group(self):
        return self.layout.self_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def strip_target_layers(target: torch.nn.Module) -> None:
    """Drop every decoder layer of the target in place: a drafter rank only borrows the target's
    embedding and LM head (the target ranks compute the features)."""
    decoder, layers_name, _ = decoder_and_layers(target)
    setattr(decoder, layers_name, torch.nn.ModuleList())


# ----------------------------------------------------------------------------------------------
# Feature transport
#
# One message per micro-batch, sent in the order all ranks agree on (dflash_schedule.train_plan):
#   header    int64 [len(HEADER)]                      what follows, and the sender's counters
#   tokens    int64 [3, batch, S]                      rows: input_ids, loss_mask (0/1), label_ids
#   features  target dtype [batch, S, feature_dim]     context features, sent from the GPU
# The end of a run is a header of kind END and nothing after it, from every target rank to every
# drafter rank. Blocking send/recv in one thread per side: every pair sees its messages in the
# same global order, so no pair can wait on another in a cycle.

HEADER = (
    "kind",  # BATCH, PADDING (a zero-loss filler step that keeps the drafter ranks in step) or END
    "epoch",
    "index",  # position of the micro-batch in the epoch's global batch list
    "batch",
    "seq_len",
    "feature_dim",
    "dtype",  # index into DTYPES
    "num_tokens",  # real (unpadded) tokens in the batch
    "target_busy_us",  # sender's running totals: time in collate + forward,
    "target_idle_us",  # time blocked because the queue was full (drafters slower than supply),
    "target_samples",  # samples and tokens produced so far
    "target_tokens",
)
BATCH, PADDING, END = 1, 2, 3
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TransportError(RuntimeError):
    pass


def _stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


class FeatureSender:
    """Target side: `put` queues a batch (up to `depth` wait); a thread sends them in order.

    On GPU the thread sends on its own CUDA stream after the producer's `ready` event and blocks
    until each send has completed (the drafter received it), so at most depth + 1 batches of
    features are held on the target GPU.
    """

    def __init__(self, transport_group, drafter_ranks: list[int], device: torch.device, depth: int):
        self.group, self.drafter_ranks, self.device = transport_group, drafter_ranks, device
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.busy_s = self.idle_s = 0.0
        self.samples = self.tokens = 0
        self.thread = threading.Thread(target=self._run, name="dflash-feature-sender", daemon=True)
        self.thread.start()

    def put(
        self,
        dest: int,
        kind: int,
        epoch: int,
        index: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        label_ids: torch.Tensor,
        features: torch.Tensor,
        num_tokens: int,
        busy_s: float,
        counted: bool = True,
    ) -> None:
        """Queue one micro-batch for drafter rank `dest`. input_ids, loss_mask, label_ids (the token
        each position is trained to predict) [batch, S] and features [batch, S, feature_dim] on the
        target's device; busy_s: time spent making it. counted: False for the copies of a micro-batch
        that a sequence-parallel group's other ranks get (its samples and tokens are counted once)."""
        batch, seq_len, feature_dim = features.shape
        self.busy_s += busy_s
        if kind == BATCH and counted:
            self.samples += batch
            self.tokens += num_tokens
        tokens = torch.stack([input_ids, loss_mask.long(), label_ids])  # [3, batch, S]
        header = [kind, epoch, index, batch, seq_len, feature_dim, DTYPES.index(features.dtype), num_tokens, *self._counters()]
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        waited = time.perf_counter()
        self._put((dest, header, [tokens, features], ready))
        self.idle_s += time.perf_counter() - waited

    def finish(self) -> None:
        """END to every drafter rank, then wait until everything queued has been received."""
        for dest in self.drafter_ranks:
            self._put((dest, [END, 0, 0, 0, 0, 0, 0, 0, *self._counters()], [], None))
        self._put(None)
        while self.thread.is_alive():
            self.thread.join(timeout=1.0)
        self._raise_if_failed()

    def flush(self) -> None:
        """Block until every queued micro-batch has been received: no send is in flight afterwards.
        Called before DeepSpeed's world barriers (see "Checkpoints in split mode")."""
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                self._raise_if_failed()
                self.queue.all_tasks_done.wait(timeout=1.0)
        self._raise_if_failed()

    def _counters(self) -> list[int]:
        return [int(self.busy_s * 1e6), int(self.idle_s * 1e6), self.samples, self.tokens]

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise TransportError(f"sending context features failed: {self.error!r}") from self.error

    def _put(self, item) -> None:
        while True:  # in slices, so a failure of the thread surfaces here instead of a silent wait
            self._raise_if_failed()
            try:
                self.queue.put(item, timeout=1.0)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
                stream = torch.cuda.Stream(self.device)
            while (item := self.queue.get()) is not None:
                dest, header, tensors, ready = item
                with _stream_context(stream):
                    if ready is not None:
                        stream.wait_event(ready)  # the forward that made the features is done
                    dist.send(torch.tensor(header, dtype=torch.long, device=self.device), dest, group=self.group)
                    for tensor in tensors:
                        dist.send(tensor, dest, group=self.group)
                    if stream is not None:
                        stream.synchronize()  # block until received: bounds the features held on the GPU
                self.queue.task_done()
        except BaseException as error:  # handed to the main thread by _put / finish / flush
            self.error = error


class FeatureReceiver:
    """Drafter side: a thread receives the batches of `schedule` in order (up to `depth` ahead of
    use), then the END header of every target rank. `get` hands them to the training loop.

    schedule: (source rank, epoch, index) of every micro-batch this drafter rank will train, in order;
        iterated lazily by the thread (the plan of a long run is long). A None entry is a checkpoint
        save: the thread posts no receive past it until the main thread calls `resume()`.
    """

    def __init__(
        self,
        transport_group,
        target_ranks: list[int],
        device: torch.device,
        depth: int,
        schedule: Iterable[tuple[int, int, int]],
        feature_dim: int,
        dtype: torch.dtype,
    ):
        self.group, self.target_ranks, self.device = transport_group, target_ranks, device
        self.schedule, self.feature_dim, self.dtype = schedule, feature_dim, dtype
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.wait_s = 0.0  # main-thread time blocked in get(): the drafter waiting for supply
        self.target_counters: dict[int, dict] = {}  # latest counters seen from each target rank
        self.resumed = threading.Event()  # set by resume(): the thread may go past a None in the schedule
        self.thread = threading.Thread(target=self._run, name="dflash-feature-receiver", daemon=True)
        self.thread.start()

    def get(self) -> dict:
        """The next micro-batch: the header fields plus input_ids [batch, S] int64, loss_mask
        [batch, S] bool, label_ids [batch, S] int64 and context_features [batch, S, feature_dim],
        on this rank's device."""
        waited = time.perf_counter()
        while True:
            if self.error is not None:
                raise TransportError(f"receiving context features failed: {self.error}") from self.error
            try:
                item = self.queue.get(timeout=1.0)
                break
            except queue.Empty:
                continue
        self.wait_s += time.perf_counter() - waited
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for name in ("input_ids", "loss_mask", "label_ids", "context_features"):
                # Allocated on the receive stream, used on this one: keep the allocator from reusing
                # the memory before this stream is done with it.
                item[name].record_stream(current)
        return item

    def resume(self) -> None:
        """The checkpoint save at the schedule's next None is done: receiving may go on."""
        self.resumed.set()

    def finish(self) -> None:
        """Wait until the END header of every target rank has arrived (nothing unexpected after the last batch)."""
        while self.thread.is_alive():
            self.thread.join(timeout=1.0)
        if self.error is not None:
            raise TransportError(f"receiving context features failed: {self.error}") from self.error

    def supply_counters(self) -> torch.Tensor:
        """float64 [target ranks, 4]: each target rank's running (busy_us, idle_us, samples, tokens),
        as of the latest header received from it (zeros if none yet)."""
        counters = torch.zeros(len(self.target_ranks), 4, dtype=torch.float64)
        for src, values in list(self.target_counters.items()):
            counters[self.target_ranks.index(src)] = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
        return counters

    def _recv_header(self, src: int) -> dict:
        header = torch.empty(len(HEADER), dtype=torch.long, device=self.device)
        dist.recv(header, src, group=self.group)
        fields = dict(zip(HEADER, header.tolist()))  # .tolist() waits for the receive
        self.target_counters[src] = {k: fields[k] for k in HEADER[8:]}
        return fields

    def _run(self) -> None:
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
            with _stream_context(stream):
                for entry in self.schedule:
                    if entry is None:  # a checkpoint save: no receive in flight across its world barriers
                        self.resumed.wait()
                        self.resumed.clear()
                        continue
                    src, epoch, index = entry
                    item = self._recv_header(src)
                    if item["kind"] not in (BATCH, PADDING) or (item["epoch"], item["index"]) != (epoch, index):
                        raise TransportError(
                            f"expected micro-batch (epoch {epoch}, index {index}) from rank {src}, got header {item}: "
                            f"target and drafter ranks disagree on the batch plan (same settings and data on every rank?)"
                        )
                    if item["feature_dim"] != self.feature_dim or DTYPES[item["dtype"]] != self.dtype:
                        raise TransportError(
                            f"rank {src} sends features of width {item['feature_dim']} in {DTYPES[item['dtype']]}, "
                            f"this rank expects {self.feature_dim} in {self.dtype}"
                        )
                    shape = (item["batch"], item["seq_len"])
                    tokens = torch.empty((3, *shape), dtype=torch.long, device=self.device)  # [3, batch, S]
                    features = torch.empty((*shape, self.feature_dim), dtype=self.dtype, device=self.device)
                    dist.recv(tokens, src, group=self.group)
                    dist.recv(features, src, group=self.group)
                    item.update(input_ids=tokens[0], loss_mask=tokens[1].bool(), label_ids=tokens[2], context_features=features)
                    if stream is not None:
                        stream.synchronize()  # queued means arrived: get() time is then the true wait
                    self.queue.put(item)
                for src in self.target_ranks:
                    item = self._recv_header(src)
                    if item["kind"] != END:
                        raise TransportError(f"rank {src} sent more micro-batches than this drafter rank's plan ({item})")
        except BaseException as error:  # handed to the main thread by get / finish
            self.error = error


class Stopwatch:
    """Summed time of code regions on `device`. On GPU it records CUDA events instead of
    synchronising after every region; `seconds()` waits for them (call it when logging)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.total = 0.0

    @contextmanager
    def time(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            started = time.perf_counter()
            yield
            self.total += time.perf_counter() - started

    def seconds(self) -> float:
        for start, end in self.events:
            end.synchronize()
            self.total += start.elapsed_time(end) / 1000
        self.events.clear()
        return self.total


# ----------------------------------------------------------------------------------------------
# Checkpoints in split mode
#
# DeepSpeed 0.19.8's DeepSpeedEngine.save_checkpoint calls dist.barrier() on the WHOLE world
# twice (before and after writing), and all-reduces the tag across the world unless
# "checkpoint": {"tag_validation": "Ignore"}. The drafter ranks switch tag validation off; the
# target ranks enter the two barriers at the same optimizer step (every rank knows the save steps
# from the step count), so the drafters' save completes. Loading has no world collective.
#
# Under NCCL a barrier ends with a whole-device synchronize, so it also waits for any feature
# send or receive in flight on another stream, and that transfer's peer may itself be stuck in
# the barrier: a deadlock (gloo has no such wait). So the transport is quiet across a save: the
# target rank flushes its sender (everything sent has been received) before joining, and the
# drafter's receiver thread posts no receive past the save until the save is done
# (FeatureReceiver: a None in the schedule, then resume()).

DEEPSPEED_SAVE_BARRIERS = 2


def check_deepspeed_save_barriers() -> None:
    """Fail early, with the reason, if this DeepSpeed's save_checkpoint has a different number of
    world barriers than the target ranks join (a mismatch would hang the first save)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    found = inspect.getsource(DeepSpeedEngine.save_checkpoint).count("dist.barrier(")
    if found != DEEPSPEED_SAVE_BARRIERS:
        raise RuntimeError(
            f"this DeepSpeed's save_checkpoint has {found} world barriers, split mode joins "
            f"{DEEPSPEED_SAVE_BARRIERS} (DeepSpeed 0.19.8): pin deepspeed==0.19.8 (requirements.txt), or run "
            f"colocated (--target_ranks 0), or update DEEPSPEED_SAVE_BARRIERS in dflash_split.py"
        )


def join_deepspeed_save() -> None:
    """A target rank's part of one DeepSpeed save_checkpoint on the drafter ranks."""
    for _ in range(DEEPSPEED_SAVE_BARRIERS):
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# DeepSpeed AutoTP's world broadcast
#
# deepspeed.init_inference (dflash_target._load_tensor_parallel) ends, when tp_size > 1, with one
# dist.broadcast of the RNG state from rank 0 over the WHOLE world (DeepSpeed 0.19.8,
# InferenceEngine.__init__), not over the tensor-parallel group. Every rank therefore takes part in
# exactly one such broadcast: the ranks that load a tensor-parallel target inside init_inference,
# every other rank through join_tensor_parallel_init, at the same point of the run. It carries
# nothing the trainer needs (the other ranks discard it).

DEEPSPEED_TP_INIT_BROADCASTS = 1


def check_deepspeed_tp_init() -> None:
    """Fail early, with the reason, if this DeepSpeed's init_inference has a different number of
    world broadcasts than the ranks outside the tensor-parallel groups join (a mismatch would hang)."""
    from deepspeed.inference.engine import InferenceEngine

    found = inspect.getsource(InferenceEngine.__init__).count("dist.broadcast(")
    if found != DEEPSPEED_TP_INIT_BROADCASTS:
        raise RuntimeError(
            f"this DeepSpeed's InferenceEngine.__init__ has {found} world broadcasts, --target_tp_size > 1 joins "
            f"{DEEPSPEED_TP_INIT_BROADCASTS} (DeepSpeed 0.19.8): pin deepspeed==0.19.8 (requirements.txt), or use "
            f"--target_tp_size 1, or update DEEPSPEED_TP_INIT_BROADCASTS in dflash_split.py"
        )


def join_tensor_parallel_init() -> None:
    """A rank that loads no tensor-parallel target: its part of init_inference's world broadcast."""
    from deepspeed.accelerator import get_accelerator

    state = get_accelerator().get_rng_state().to(get_accelerator().current_device_name())  # the shape init_inference sends
    dist.broadcast(state, 0)


# ----------------------------------------------------------------------------------------------
# Held-out evaluation in split mode, where the target is
#
# The first target group keeps the target whole (not truncated) and holds a drafter of its own.
# At every evaluation the lead broadcasts the drafter's weights over `eval_group` (the lead and
# that group), every rank of the group evaluates in lockstep (their tensor-parallel forwards are
# collectives), and the group's first rank broadcasts the result back. No rank holds a second
# whole target. Evaluation steps are known to every rank from the step count, like save steps.


def broadcast_drafter_weights(drafter: torch.nn.Module, group, src: int) -> None:
    """Copy the parameters and buffers of `src`'s drafter into every other member's (same
    architecture), over `group`, tensor by tensor in state-dict order. Sent as float32 (exact for
    bf16 and fp16 weights) so both sides agree on the layout whatever dtypes they hold."""
    device = next(drafter.parameters()).device
    with torch.no_grad():
        for tensor in drafter.state_dict().values():
            buffer = tensor.detach().to(device=device, dtype=torch.float32).contiguous()
            dist.broadcast(buffer, src, group=group)
            if dist.get_rank() != src:
                tensor.copy_(buffer)


def broadcast_scalars(values: list[float] | None, count: int, group, src: int, device: torch.device) -> list[float]:
    """`src`'s `values` (`count` floats; None elsewhere) on every member of `group`."""
    tensor = torch.tensor(values if values is not None else [0.0] * count, dtype=torch.float64, device=device)
    dist.broadcast(tensor, src, group=group)
    return tensor.tolist()


# ----------------------------------------------------------------------------------------------
# Shared --output_dir across nodes
#
# DeepSpeed's checkpoint shards are written by the drafter ranks of every node into one
# checkpoint directory, and any rank may read any of them on resume, so with more than one node
# --output_dir must be one filesystem that every node mounts. Checked once at the start: rank 0
# writes a marker file, every rank looks for it.


def check_shared_output_dir(output_dir: str, nodes: list[list[int]], rank: int, device: torch.device) -> None:
    """Collective. Raises ValueError on every rank when a node cannot see a file rank 0 wrote into
    `output_dir` (with more than one node; nothing is checked on one node)."""
    if len(nodes) < 2:
        return
    token = [f"{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(token, src=0, device=device)
    marker = os.path.join(output_dir, f".shared-check-{token[0]}")
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write(token[0])
    dist.barrier()
    try:
        with open(marker) as f:
            seen = f.read() == token[0]
    except OSError:
        seen = False
    everyone = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.tensor([float(seen)], device=device))
    dist.barrier()
    if rank == 0:
        os.remove(marker)
    blind = sorted({n for n, members in enumerate(nodes) for r in members if not everyone[r].item()})
    if blind:
        raise ValueError(
            f"--output_dir {output_dir} is not shared between the nodes: node(s) {blind} cannot see a file that node 0 "
            f"wrote there. Every node's drafter ranks write checkpoint shards into it and read them on resume: put "
            f"--output_dir on a filesystem that every node mounts at the same path (NFS, Lustre, ...), as an absolute path."
        )
