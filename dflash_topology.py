"""The rank topology of a run: the process group and nodes, what each rank loads (the whole target,
a tensor-parallel slice of it, or only its embedding and LM head), the `--target_ranks auto` timing
and the choice of the split from it, settling the split once it is known, and a target rank's whole run.

The split's plumbing underneath (rank layout, feature transport) is dflash_split.py, the ranks'
heartbeats dflash_liveness.py; docs/topology.md explains the choices. `settings` below is a
`TopologySettings`, `compute` the run's `train_dflash.Compute`, `data` its `train_dflash.TrainData`.
"""

import datetime
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed

from dflash_compile import setup_compile_cache
from dflash_data import collate_batch
from dflash_decoding import evaluate_acceptance
from dflash_features import FeatureSettings, TargetFeatureExtractor, serve_context_features, target_features
from dflash_liveness import Liveness, start_liveness
from dflash_model import DFlashConfig, DFlashDraftModel, SequenceParallel
from dflash_progress import debug_log, setup_logging, weights_digest
from dflash_schedule import ResumePoint, ScheduleSettings, epoch_batches
from dflash_split import (
    broadcast_drafter_weights,
    broadcast_scalars,
    check_deepspeed_save_barriers,
    check_deepspeed_tp_init,
    check_shared_output_dir,
    check_split,
    join_tensor_parallel_init,
    make_rank_layout,
    make_tensor_parallel_groups,
    node_ranks,
    strip_target_layers,
)
from dflash_target import check_target_fits, check_target_scaling, estimate_target_bytes, load_target_embeddings, load_target_model, parameter_bytes

logger = logging.getLogger("train_dflash")  # a training run's log lines all read `train_dflash:`


COLLECTIVE_TIMEOUT_MIN = 60  # process-group timeout (NCCL's default is 10 minutes)


CALIBRATION_BATCHES = 3  # --target_ranks auto: micro-batches timed per rank (each after an untimed run)
COLOCATED_MARGIN = 1.10  # colocated must beat the best split by 10% (the split frees the drafters' memory of the target)


@dataclass(frozen=True)
class TopologySettings:
    """The settings the rank topology reads: `train_dflash.TrainSettings`' fields of the same names
    (their `--help` says more), as `train_dflash.settings_for` copies them."""

    # the launch: ranks, nodes, compile caches, heartbeats
    target_ranks: str  # target ranks per node: "0" (colocated), a number, or "auto"
    target_tp_size: int  # target ranks that share one copy of the target (tensor parallelism)
    sequence_parallel_size: int  # drafter ranks that train one sample together
    compile_cache: str  # "shared" or "per_rank"
    compile_cache_dir: str | None
    compile_threads: int | None
    liveness_timeout_s: float
    seed: int
    output_dir: str  # one folder that every node sees
    # the target on this rank
    target_model: str
    target_gguf_file: str | None
    target_random_init: bool
    target_cuda_graphs: bool
    label_source: str  # "data" or "target_argmax" (the target runs whole)
    loss: str  # "ce", or a loss against the target's distribution (the target runs whole)
    # held-out evaluation (split mode: on the first target group)
    eval_data: str | None
    eval_max_new_tokens: int
    eval_prompt_lookup: bool


@dataclass
class Cluster:
    """This process's place in the launch (`setup_distributed`)."""

    accelerator: Accelerator
    rank: int  # global rank
    world: int  # processes in all
    device: torch.device
    nodes: list  # per node, its global ranks (`node_ranks`)
    liveness: Liveness | None  # heartbeats between ranks (`start_liveness`), None with one process


def init_distributed(on_cuda: bool) -> Accelerator:
    """Process group first (gloo on CPU), then accelerate's state, so DeepSpeed finds both ready."""
    backend = "nccl" if on_cuda else "gloo"
    if "WORLD_SIZE" not in os.environ:
        # One process started without a launcher (python train_dflash.py, or accelerate launch with
        # no config): DeepSpeed still needs a process group (and asserts LOCAL_RANK), so make a
        # world of one; an in-memory store needs no port.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    # cpu=True matters: without it accelerate treats several CPU processes as not distributed.
    # Collectives may wait long for a legitimate reason (the lead's held-out evaluation keeps the
    # other drafter ranks in a barrier); a dead or frozen rank is caught by the liveness check.
    PartialState(cpu=not on_cuda, backend=backend, timeout=datetime.timedelta(minutes=COLLECTIVE_TIMEOUT_MIN))
    # An accelerate config's parallelism_config (sp size) has been read into --sequence_parallel_size;
    # the drafter's sequence-parallel groups are made here (`make_sequence_parallel_groups`), over the
    # drafter ranks only. The Accelerator must not build its own mesh over the whole world from it
    # (and on CPU it refuses the config).
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    return Accelerator(cpu=not on_cuda)


def setup_distributed(settings: TopologySettings) -> Cluster:
    """Logging, compile caches, the process group, liveness, the seed, nodes and the split's checks."""
    env_rank = int(os.environ.get("RANK", "0"))
    setup_logging(env_rank)  # rank 0 logs the setup; after the split the lead (first drafter rank) logs training too
    # Compile caches and the node-wide compile lock are fixed before anything compiles (docs/compile-safety.md).
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    setup_compile_cache(
        settings.compile_cache,
        settings.compile_cache_dir,
        int(os.environ.get("LOCAL_RANK", "0")),
        compile_threads=settings.compile_threads or max(1, (os.cpu_count() or 1) // ranks_per_node),
    )
    accelerator = init_distributed(torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    # Heartbeats from here on: if any rank dies, the others stop with an error instead of hanging.
    liveness = start_liveness(rank, world, settings.liveness_timeout_s)
    set_seed(settings.seed)
    device = accelerator.device
    # Nodes (accelerate launch --machine_rank), and with several, one --output_dir that all of them see.
    nodes = node_ranks(rank, world, device)
    check_shared_output_dir(settings.output_dir, nodes, rank, device)
    if settings.target_ranks != "auto":
        check_split(int(settings.target_ranks), settings.target_tp_size, len(nodes[0]), len(nodes))
        # Now, not after the target's weights load.
        check_sequence_parallel_ranks(settings.sequence_parallel_size, len(nodes[0]) - int(settings.target_ranks), len(nodes))
    elif settings.target_tp_size > 1:  # auto picks N among the multiples of --target_tp_size
        check_split(settings.target_tp_size, settings.target_tp_size, len(nodes[0]), len(nodes))
    return Cluster(accelerator, rank, world, device, nodes, liveness)


@dataclass
class RankRoles:
    """What this rank loads, decided before any weight loads (`plan_rank_roles`). layout is None
    while --target_ranks auto has still to time both sides."""

    layout: object | None  # dflash_split.RankLayout
    tp_groups: tuple  # (tensor-parallel groups of the node, this rank's group or None)
    holds_target: bool  # loads the target's layers
    tp_group: object | None  # the process group its target copy is split over
    evaluator: bool  # measures held-out tau (the target stays whole here)
    own_embeddings: bool  # loads the target's embedding and LM head on their own
    needs_drafter: bool


@dataclass
class TargetParts:
    """What this rank holds of the target (`load_target_parts`); None where it holds nothing of it."""

    target: torch.nn.Module | None
    extractor: TargetFeatureExtractor | None
    embed_tokens: torch.nn.Module | None
    lm_head: torch.nn.Module | None


def plan_rank_roles(settings: TopologySettings, cluster: Cluster, resume: ResumePoint) -> RankRoles:
    """The split, fixed or as in the checkpoint being resumed (docs/topology.md), and
    what this rank loads. --target_ranks counts per node; target ranks share a copy of the target in
    tensor-parallel groups of --target_tp_size ranks (DeepSpeed AutoTP). With auto (and no
    checkpoint) the layout is left to `time_rank_split`."""
    tp_size, rank, world = settings.target_tp_size, cluster.rank, cluster.world
    if settings.target_ranks != "auto":
        num_target_ranks = int(settings.target_ranks)
    elif "target_ranks" in resume.state:
        num_target_ranks = resume.state["target_ranks"]
        logger.info("--target_ranks auto: %d, as in the checkpoint being resumed", num_target_ranks)
    elif world == 1:
        num_target_ranks = 0
    else:
        num_target_ranks = None  # timed once the target is loaded
    tp_groups = make_tensor_parallel_groups(cluster.nodes, tp_size, rank)  # collective; the groups of either split
    layout = make_rank_layout(num_target_ranks, rank, world, cluster.nodes, tp_groups) if num_target_ranks is not None else None
    # What this rank loads. A drafter rank of a fixed split: the target's embedding and LM head
    # alone, never a decoder layer. `auto` times the target where it would run: on every rank with
    # --target_tp_size 1 (drafter ranks drop its layers afterwards), else in every group of the node.
    if layout is not None:
        holds_target = layout.is_target or not layout.split
        tp_group = layout.tp_group
    else:
        holds_target = tp_size == 1 or tp_groups[1] is not None
        tp_group = tp_groups[1]
    evaluator = settings.eval_data is not None and (layout is None or not layout.split or layout.is_evaluator)
    own_embeddings = (tp_size > 1 and (layout is None or not layout.is_target or evaluator)) or (
        layout is not None and layout.split and not layout.is_target
    )
    needs_drafter = layout is None or not layout.is_target or evaluator
    return RankRoles(layout, tp_groups, holds_target, tp_group, evaluator, own_embeddings, needs_drafter)


def load_target_parts(
    settings: TopologySettings, target_config, draft_config: DFlashConfig, cluster: Cluster, roles: RankRoles, compute
) -> TargetParts:
    """The target's weights this rank needs: the whole target (or its tensor-parallel slice) with a
    feature extractor, and/or its embedding and LM head alone (a drafter rank of a split)."""
    settings_tp = settings.target_tp_size
    vocab_rows = target_config.get_text_config().vocab_size
    if settings_tp > 1:
        check_deepspeed_tp_init()
    parts = TargetParts(None, None, None, None)
    if roles.holds_target:
        layout = roles.layout
        logger.info(
            "%s",
            check_target_fits(
                target_config,
                compute.dtype,
                cluster.device,
                tp_size=settings_tp if roles.tp_group is not None else 1,
                ranks_per_node=len(cluster.nodes[0]),
                colocated=layout is not None and not layout.split,
            ),
        )
        target = load_target_model(
            settings.target_model,
            target_config,
            gguf_file=settings.target_gguf_file,
            dtype=compute.dtype,
            device=cluster.device,
            random_init=settings.target_random_init,
            tp_group=roles.tp_group,
        )
        if settings.target_random_init:
            logger.warning("--target_random_init: the target has RANDOM weights; the drafter learns nothing useful")
        if roles.tp_group is not None:
            logger.info(
                "Rank %d holds %d bytes of the target's parameters (%d in all; tensor parallelism over ranks %s)",
                cluster.rank,
                parameter_bytes(target),
                estimate_target_bytes(target_config, compute.dtype)[0],
                torch.distributed.get_process_group_ranks(roles.tp_group),
            )
        if target.get_input_embeddings().weight.shape[0] != vocab_rows:
            raise ValueError(
                f"--target_model {settings.target_model}: its embedding has {target.get_input_embeddings().weight.shape[0]} rows "
                f"but its config says vocab_size {vocab_rows}; fix the config.json"
            )
        check_target_scaling(target, draft_config)
        # Truncating the target after its deepest captured layer frees the later layers, but tau
        # evaluation verifies drafts with the target's logits, and target_argmax labels are its
        # argmax, so where either runs the target stays whole.
        # A loss against the target's distribution needs its last hidden state: every layer runs too.
        predict, last_hidden = settings.label_source == "target_argmax", settings.loss != "ce"
        extractor = TargetFeatureExtractor(
            target,
            draft_config.target_layer_ids,
            truncate=not (roles.evaluator or predict or last_hidden),
            predict_next=predict,
            last_hidden=last_hidden,
        )
        parts = TargetParts(target, extractor, extractor.embed_tokens, extractor.lm_head)
    elif settings_tp > 1:
        join_tensor_parallel_init()  # DeepSpeed AutoTP's world broadcast (dflash_split.py)
    if roles.own_embeddings:  # the drafter needs the whole head; a tensor-parallel target's is split
        parts.embed_tokens, parts.lm_head = load_target_embeddings(
            settings.target_model,
            target_config,
            gguf_file=settings.target_gguf_file,
            dtype=compute.dtype,
            device=cluster.device,
            random_init=settings.target_random_init,
        )
    return parts


def to_compute_dtype(drafter: DFlashDraftModel, device: torch.device, dtype: torch.dtype) -> None:
    """Parameters in the compute dtype; the RoPE table stays fp32, as DeepSpeed leaves buffers."""
    for child in drafter.children():
        child.to(device=device, dtype=None if child is drafter.rotary_emb else dtype)


def measure_rates(batches: list, run_target: Callable, run_drafter: Callable, device: torch.device) -> torch.Tensor:
    """Time the target forward and the drafter step on the same real micro-batches on this rank.

    batches: micro-batches; run_target(batch) -> its output (the features); run_drafter(batch,
    output) runs a forward and backward. Each batch runs once untimed first: a new length bucket compiles
    there (flex, compiled layers), and the allocator warms up.
    Returns float64 [target_seconds, drafter_seconds, samples, tokens] over the timed runs;
    sum it over ranks (all_reduce) so every rank decides the same N.
    """

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    totals = torch.zeros(4, dtype=torch.float64)
    for batch in batches:
        run_drafter(batch, run_target(batch))
        sync()
        start = time.perf_counter()
        output = run_target(batch)
        sync()
        middle = time.perf_counter()
        run_drafter(batch, output)
        sync()
        totals += torch.tensor(
            [middle - start, time.perf_counter() - middle, len(batch["input_ids"]), float(batch["attention_mask"].sum())], dtype=torch.float64
        )
    return totals


def choose_target_ranks(target_samples_per_s: float, drafter_samples_per_s: float, ranks_per_node: int, tp_size: int = 1) -> tuple[int, list[str]]:
    """N target ranks per node of `ranks_per_node` ranks, from the rates at the same micro-batches.

    target_samples_per_s: what one copy of the target supplies (one rank, or one tensor-parallel
        group of `tp_size` ranks); drafter_samples_per_s: what one drafter rank consumes.
    With N target ranks (N / tp_size copies) a node moves min(N / tp_size * supply, (ranks - N) *
    demand) samples/s; colocated (only for tp_size 1: colocated ranks hold the whole target), every
    rank does both one after the other: ranks / (1/supply + 1/demand). N is a multiple of tp_size.
    The best split wins unless colocated is more than COLOCATED_MARGIN better; ties go to more
    supply (drafters that never wait). Returns (N, lines explaining the choice).
    Raises ValueError when no split leaves a drafter rank (ranks_per_node <= tp_size).
    """
    supply, demand, ranks = target_samples_per_s, drafter_samples_per_s, ranks_per_node
    copy = "one rank" if tp_size == 1 else f"one target group of {tp_size} ranks"
    lines = [
        f"{copy}: target forward {supply:.2f} samples/s; one rank: drafter step {demand:.2f} samples/s "
        f"(one target copy feeds {supply / demand:.1f} drafter ranks)"
    ]
    if ranks == 1:
        return 0, lines + ["a single process: colocated"]
    if tp_size >= ranks:
        raise ValueError(
            f"--target_tp_size {tp_size} leaves no drafter rank on a node of {ranks} processes: use a smaller "
            f"--target_tp_size or launch more processes per node"
        )
    options = []
    for n in range(tp_size, ranks, tp_size):
        made, used = n // tp_size * supply, (ranks - n) * demand
        options.append((min(made, used), made - used, n))
        balance = f"drafters wait {(1 - made / used) * 100:.0f}%" if made < used else f"targets idle {(1 - used / made) * 100:.0f}%"
        groups = f" ({n // tp_size} groups of {tp_size})" if tp_size > 1 else ""
        lines.append(f"  N={n}: {n} target{groups} + {ranks - n} drafter ranks -> {min(made, used):.2f} samples/s ({balance} of the time)")
    best_rate, _, best_n = max(options)
    if tp_size > 1:
        lines.append(f"  N=0: colocated is not an option: with --target_tp_size {tp_size} no rank holds the whole target")
    else:
        colocated = ranks / (1 / supply + 1 / demand)
        lines.append(f"  N=0: colocated -> {colocated:.2f} samples/s")
        if colocated > COLOCATED_MARGIN * best_rate:
            lines.append(f"colocated beats the best split (N={best_n}) by more than {(COLOCATED_MARGIN - 1) * 100:.0f}%: N=0")
            return 0, lines
    lines.append(f"N={best_n} moves the most samples/s")
    return best_n, lines


def time_rank_split(
    settings: TopologySettings,
    schedule_settings: ScheduleSettings,
    cluster: Cluster,
    roles: RankRoles,
    data,
    tokenizer,
    parts: TargetParts,
    drafter: DFlashDraftModel,
    loss_fn,
    compute,
):
    """--target_ranks auto: every rank that holds the target times its forward (a tensor-parallel group
    as one) and a drafter step (forward + backward, no update) on its own first micro-batches (of
    the run's order, `schedule_settings`); the sums over all ranks give every rank the same N.
    Returns the rank layout."""
    rank, device, nodes, tp_size = cluster.rank, cluster.device, cluster.nodes, settings.target_tp_size
    to_compute_dtype(drafter, device, compute.dtype)
    copies = roles.tp_groups[0]  # one target copy per group (per rank when tp_size is 1)
    copy = next((i for i, g in enumerate(copies) if rank in g), None) if roles.holds_target else None
    batches = []
    if copy is not None:
        own = [ids for ids in epoch_batches(data.lengths, schedule_settings, 0, len(copies))[copy :: len(copies)] if ids is not None]
        batches = [collate_batch(data.dataset.select(ids), tokenizer.pad_token_id, compute.pad_multiple) for ids in own[:CALIBRATION_BATCHES]]

    def run_target(batch):
        return target_features(parts.extractor, batch["input_ids"].to(device), batch["attention_mask"].to(device))

    def run_drafter(batch, output):
        features, label_ids = output
        loss, _ = loss_fn(drafter, features, batch["input_ids"].to(device), batch["loss_mask"], label_ids, (settings.seed, -1, rank))
        loss.backward()
        drafter.zero_grad(set_to_none=True)

    totals = measure_rates(batches, run_target, run_drafter, device).to(device)
    torch.distributed.all_reduce(totals)
    target_s, drafter_s, samples, tokens = totals.tolist()
    num_target_ranks, reasons = choose_target_ranks(samples / target_s, samples / drafter_s, len(nodes[0]), tp_size)
    logger.info(
        "--target_ranks auto over %d ranks%s%s (%d batches timed per target copy, %.0f tokens/sample):\n  %s\n=> --target_ranks %d",
        len(nodes[0]),
        f" per node ({len(nodes)} nodes)" if len(nodes) > 1 else "",
        f", tensor-parallel groups of {tp_size}" if tp_size > 1 else "",
        CALIBRATION_BATCHES,
        tokens / samples,
        "\n  ".join(reasons),
        num_target_ranks,
    )
    return make_rank_layout(num_target_ranks, rank, cluster.world, nodes, roles.tp_groups)


def settle_split(layout, settings: TopologySettings, draft_config: DFlashConfig, parts: TargetParts, drafter, compute, rank: int) -> None:
    """Once the layout is known: the lead logs training; in split mode a target rank that auto kept
    whole is truncated, and a drafter rank drops every target layer it timed; a drafter rank logs
    what it holds."""
    if layout.is_lead:
        logging.getLogger().setLevel(logging.INFO)
    if layout.split:
        check_deepspeed_save_barriers()
        logger.info("Split mode: %s", layout.describe())
        whole_for_labels = parts.extractor is not None and (parts.extractor.predict_next or parts.extractor.last_hidden)
        if layout.is_target and not layout.is_evaluator and not parts.extractor.truncated and not whole_for_labels:  # auto kept it whole while timing
            parts.extractor.remove_hooks()
            parts.extractor = TargetFeatureExtractor(parts.target, draft_config.target_layer_ids, truncate=True)
            if compute.compile_target:
                parts.extractor.compile_layers()
            if settings.target_cuda_graphs and compute.on_cuda:
                parts.extractor.use_cuda_graphs()
        elif not layout.is_target and parts.target is not None:  # auto: this drafter rank timed the target; it keeps none of it
            parts.extractor.remove_hooks()
            parts.extractor = None
            if settings.target_tp_size == 1:
                strip_target_layers(parts.target)  # the embedding and LM head it borrows stay
            else:
                parts.target = None
            if compute.on_cuda:
                torch.cuda.empty_cache()
    if layout.split and not layout.is_target:
        embed_tokens, lm_head = parts.embed_tokens, parts.lm_head
        held = parameter_bytes(*[m for m in (parts.target, embed_tokens, lm_head, drafter) if m is not None])
        tied = lm_head.weight is embed_tokens.weight
        logger.info(
            "Rank %d holds %.1f MiB (%d bytes) of parameters: the target's embedding %d bytes, its LM head %d bytes%s, the drafter %d bytes; %s",
            rank,
            held / 2**20,
            held,
            parameter_bytes(embed_tokens),
            0 if tied else parameter_bytes(lm_head),
            " (tied to the embedding)" if tied else "",
            parameter_bytes(drafter),
            "no target decoder layer" if parts.target is None else "the target without its decoder layers (timed by --target_ranks auto)",
        )


def check_sequence_parallel_ranks(size: int, drafters_per_node: int, num_nodes: int) -> None:
    """Reject a --sequence_parallel_size whose groups cannot be laid out within nodes: each node's
    drafter ranks must be a multiple of it. A group's ranks exchange activations all-to-all in every
    attention layer of every step, which between nodes would run over the network.
    Raises ValueError naming the flag and the fix."""
    if drafters_per_node % size == 0:
        return
    if num_nodes == 1:
        raise ValueError(
            f"--sequence_parallel_size {size}: the {drafters_per_node} drafter ranks do not divide into groups of "
            f"{size}; launch a multiple of {size} drafter ranks, or change --target_ranks"
        )
    raise ValueError(
        f"--sequence_parallel_size {size}: each of the {num_nodes} nodes has {drafters_per_node} drafter ranks, not a "
        f"multiple of {size}, and a group must lie within one node (its all-to-alls run in every attention layer); "
        f"launch a multiple of {size} drafter ranks per node, or change --target_ranks"
    )


def check_sequence_parallel_heads(size: int, draft_config: DFlashConfig) -> None:
    """Reject a --sequence_parallel_size that does not divide the drafter's attention and KV heads
    (Ulysses gives each rank of a group 1/size of them); checked before any weight loads.
    Raises ValueError naming the flag, both head counts and the fix."""
    heads, kv_heads = draft_config.num_attention_heads, draft_config.num_key_value_heads
    if heads % size or kv_heads % size:
        raise ValueError(
            f"--sequence_parallel_size {size}: Ulysses gives each rank 1/{size} of the drafter's heads, but it has "
            f"{heads} attention heads and {kv_heads} KV heads; pick a size that divides both, or set "
            f"--draft_num_attention_heads / --draft_num_key_value_heads"
        )


def sequence_parallel_groups(nodes: list[list[int]], drafter_ranks: list[int], size: int) -> list[list[int]]:
    """The sequence-parallel groups: `size` consecutive drafter ranks each, node by node, so that no
    group spans two nodes. The schedule gives drafter ranks drafter_ranks[k*size : (k+1)*size] one
    micro-batch together (`dflash_schedule.epoch_batches`), so those are the groups: with each
    node's drafter ranks a multiple of size (and a node's ranks consecutive global ranks, as
    torchrun numbers them), every such slice lies within a node.

    Example: 2 nodes of 8 ranks, --target_ranks 2, size 2: [[2, 3], [4, 5], [6, 7], [10, 11],
    [12, 13], [14, 15]]. With --target_ranks 1 each node has 7 drafter ranks, and [7, 9] would span
    the nodes: refused.

    Args:
        nodes: each node's global ranks, in local-rank order (`dflash_split.node_ranks`).
        drafter_ranks: the drafter ranks in global order (`RankLayout.drafter_ranks`).
    Raises:
        ValueError: a node's drafter ranks are not a multiple of size (`check_sequence_parallel_ranks`).
    """
    per_node = [[r for r in drafter_ranks if r in members] for members in nodes]
    for ranks in per_node:
        check_sequence_parallel_ranks(size, len(ranks), len(nodes))
    groups = [ranks[i : i + size] for ranks in per_node for i in range(0, len(ranks), size)]
    assert [r for group in groups for r in group] == list(drafter_ranks), (
        f"the nodes' drafter ranks {per_node} are not consecutive global ranks: the schedule's groups would span nodes"
    )
    return groups


def make_sequence_parallel_groups(layout, size: int, draft_config: DFlashConfig) -> SequenceParallel | None:
    """Sequence-parallel groups (DeepSpeed Ulysses) of `size` consecutive drafter ranks within a node
    (`sequence_parallel_groups`); collective (every rank, target ranks too, creates every group in
    the same order).

    A group trains one sample together: the schedule gives its ranks the same micro-batches
    (`dflash_schedule.epoch_batches`), each computes 1/size of its context positions and anchors'
    blocks, and the loss is summed over the group (`train_dflash.sequence_parallel_share`). Across
    groups it is data parallelism: ZeRO-2 still shards optimizer state and reduces gradients over
    all drafter ranks (DeepSpeed's data-parallel group, `DrafterGroupMPU`), and a group's ranks hold
    the same weights. Target ranks (and their tensor-parallel groups) are untouched: they make each
    sample's features as before, once for every rank of its group.

    Returns this rank's `SequenceParallel`, or None with size 1 or on a target rank.
    Raises ValueError when the drafter's heads or KV heads are not multiples of size, or a node's
    drafter ranks are not (both checked before the target loads too: `check_sequence_parallel_heads`,
    `setup_distributed`).
    """
    if size == 1:
        return None
    check_sequence_parallel_heads(size, draft_config)
    groups = sequence_parallel_groups(layout.nodes, layout.drafter_ranks, size)
    mine = None
    for ranks in groups:
        group = torch.distributed.new_group(ranks)
        if layout.rank in ranks:
            mine = SequenceParallel(group, ranks.index(layout.rank), size)
    if layout.is_lead:
        logger.info(
            "Sequence parallelism: drafter ranks in groups of %d (%s), each group one sample at a time; data parallelism over %d groups",
            size,
            ", ".join(map(str, groups)),
            len(groups),
        )
    return mine


# What a held-out evaluation sends back in split mode, in this order (NaN for a missing value).
EVAL_RESULTS = ("acceptance_length", "speculative_tokens_per_s", "prompt_lookup_acceptance_length")


def serve_held_out_evaluation(drafter: DFlashDraftModel, target, tokenizer, data, settings: TopologySettings, layout, device: torch.device) -> None:
    """Split mode, on the first target group: receive the lead's drafter weights, measure held-out tau
    with the target that is already here, send (tau, tokens/s) back (dflash_split.py, "Held-out evaluation")."""
    broadcast_drafter_weights(drafter, layout.eval_group, src=layout.drafter_ranks[0])
    debug_log(layout.rank, {"eval_weights_sha256": weights_digest(drafter)})
    # A tensor-parallel target: a growing KV cache and no CUDA graphs (a static cache sizes its
    # heads from the config, and each rank holds a slice of them).
    kv_cache, graphs = ("dynamic", "off") if layout.tp_size > 1 else ("auto", "auto")
    result = evaluate_acceptance(
        target,
        drafter,
        tokenizer,
        data.eval_prompts,
        settings.eval_max_new_tokens,
        chat_template_kwargs=data.chat_kwargs,
        kv_cache=kv_cache,
        cuda_graphs=graphs,
        prompt_lookup=settings.eval_prompt_lookup,
    )
    values = [result[key] if result.get(key) is not None else math.nan for key in EVAL_RESULTS] if layout.is_sender else None
    broadcast_scalars(values, len(EVAL_RESULTS), layout.eval_group, layout.target_groups[0][0], device)


def run_target_rank(
    settings: TopologySettings,
    feature_settings: FeatureSettings,
    cluster: Cluster,
    compute,
    data,
    tokenizer,
    layout,
    parts: TargetParts,
    drafter: DFlashDraftModel | None,
    plan,
    resume: ResumePoint,
) -> None:
    """A target rank's whole run (split mode): context features for the drafter ranks
    (`serve_context_features`, with `feature_settings`), and, with a drafter (the evaluating group,
    with --eval_data), the lead's held-out evaluations."""
    evaluate = None
    if drafter is not None:
        to_compute_dtype(drafter, cluster.device, compute.dtype)
        evaluate = functools.partial(serve_held_out_evaluation, drafter, parts.target, tokenizer, data, settings, layout, cluster.device)
    serve_context_features(
        plan, data.dataset, tokenizer, parts.extractor, layout, feature_settings, cluster.device, compute.pad_multiple, resume.global_step, evaluate
    )
