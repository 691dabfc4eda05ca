"""Sequence parallelism (DeepSpeed Ulysses, --sequence_parallel_size) on CPU over gloo: one sample
sharded over 2 ranks gives the loss and gradients of the unsharded step, and a short training run at
SP=2 exports the drafter of the same run at SP=1, counting each sample once. In one process: padding
to a multiple of the size, the refusal to resume at another size, the target side's sample count,
groups within a node, and the checks made before the target loads."""

import copy
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import free_port, run_args
from test_split import accelerate_launch, final_weights, read_jsonl

REPO = Path(__file__).resolve().parents[1]
VOCAB, MASK_ID, HIDDEN, BLOCK, ANCHORS, SEQ = 64, 63, 32, 4, 8, 24

# (drafter, loss_weighting, loss_normalize) of each case: the fixed weights and the paper's
# normaliser, D-PACE's confidence weights with the count normaliser, and DFlash2 (its convolutions
# along each block and its selector's loss beside the drafter's).
CASES = [("dflash", "exp", "weights"), ("dflash", "dpace", "count"), ("dflash2", "exp", "weights")]


def one_case(case, sp):
    """The drafter, its loss function (SP=1) and one micro-batch of 2 rows, the same on every rank."""
    from transformers import Qwen3Config

    from dflash2_model import DFlash2DraftModel
    from dflash_loss import loss_weights
    from dflash_masks import sample_anchors
    from dflash_model import DFlashDraftModel
    from dflash_target import drafter_config_for_target
    from train_dflash import Compute, MicroBatchLoss, TrainSettings

    drafter_kind, weighting, normalize = case
    torch.manual_seed(0)
    target_config = Qwen3Config(
        hidden_size=HIDDEN, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=VOCAB
    )
    config = drafter_config_for_target(target_config, mask_token_id=MASK_ID, num_draft_layers=2, block_size=BLOCK, drafter=drafter_kind)
    drafter = (DFlash2DraftModel if drafter_kind == "dflash2" else DFlashDraftModel)(config)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    nn.init.normal_(head.weight, std=0.5)  # logits that are not all ~0
    drafter.attach_target(nn.Embedding(VOCAB, HIDDEN), head)
    settings = TrainSettings(
        target_model="x",
        train_data=["x"],
        num_anchors=ANCHORS,
        block_size=BLOCK,
        drafter=drafter_kind,
        loss_weighting=weighting,
        loss_normalize=normalize,
        sequence_parallel_size=sp,
    )
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
    loss_fn = MicroBatchLoss(settings, config, compute, loss_weights(BLOCK, 2.0) if weighting == "exp" else None, head)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, MASK_ID, (2, SEQ), generator=g)
    loss_mask = torch.ones(2, SEQ, dtype=torch.bool)
    loss_mask[:, :5] = False  # the prompt
    loss_mask[1, SEQ - 14 :] = False  # a right-padded row: fewer eligible anchors than slots, so padded slots too
    features = torch.randn(2, SEQ, 2 * HIDDEN, generator=g)
    assert not sample_anchors(loss_mask, ANCHORS, torch.Generator().manual_seed(0))[1].all()
    return drafter, loss_fn, (features, input_ids, loss_mask, input_ids)


def loss_and_grads(drafter, loss_fn, batch):
    loss, accepted = loss_fn(drafter, *batch, (0, 0, 0, 0))
    loss.backward()
    return loss.detach(), accepted, {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}


def sharded_step_worker(rank, world, port, out_dir):
    """Rank `rank` of 2: every case at SP=1 (on rank 0, alone) and at SP=2 (both ranks); the SP=2
    loss and gradients averaged over the ranks, as DeepSpeed averages them over drafter ranks."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu"
    )
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed

    import train_dflash  # noqa: F401  (first: it marks DeepSpeed's CPU shared-memory op unbuilt, minutes of g++ otherwise)

    deepspeed.comm.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)  # Ulysses' all-to-alls go through deepspeed.comm
    from dflash_model import SequenceParallel

    sp = SequenceParallel(torch.distributed.new_group([0, 1]), rank, world)
    results = []
    for case in CASES:
        drafter, loss_fn, batch = one_case(case, sp=world)
        reference = loss_and_grads(copy.deepcopy(drafter), dataclasses.replace(loss_fn, sequence_parallel=None), batch) if rank == 0 else None
        loss, accepted, grads = loss_and_grads(drafter, dataclasses.replace(loss_fn, sequence_parallel=sp), batch)
        torch.distributed.all_reduce(loss)
        for grad in grads.values():
            torch.distributed.all_reduce(grad)
        results.append((reference, (loss / world, accepted, {k: g / world for k, g in grads.items()})))
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    torch.distributed.destroy_process_group()


def test_a_step_at_sp2_gives_the_loss_and_gradients_of_sp1(tmp_path):
    """One micro-batch (2 rows of 24 tokens, 8 anchor slots of 4, some padded) through a 2-layer
    drafter with 4 heads / 2 KV heads: sharded over 2 ranks with DeepSpeed's Ulysses attention
    (each rank 12 context positions and 4 anchors' blocks, every position for 2 of the heads inside
    attention), the loss, the accepted shares and every parameter's gradient (averaged over the ranks,
    as DeepSpeed averages them) equal the unsharded step's. Measured max abs differences (float32
    summation order): loss 0 / 2.4e-7 / 9.5e-7 (of 7.0 / 3.3 / 10.4), gradients 3e-8 / 3e-8 / 1.2e-7,
    for the three CASES. The two ranks are forks of this process, after the trainer's modules
    (DeepSpeed's with them) are imported here: spawned, each imported them again (~10 s of CPU
    each). Each rank runs torch on one thread, so it uses no OpenMP pool from before the fork."""
    import train_dflash  # noqa: F401  (sets DS_ACCELERATOR before it imports DeepSpeed)

    mp.start_processes(sharded_step_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    results = torch.load(tmp_path / "results.pt")
    for case, (reference, sharded) in zip(CASES, results):
        (loss1, accepted1, grads1), (loss2, accepted2, grads2) = reference, sharded
        assert loss1.item() > 0.1, case
        assert set(grads1) == set(grads2) and len(grads1) >= 10, case
        worst = max((grads1[k] - grads2[k]).abs().max().item() for k in grads1)
        print(f"{case}: loss {loss1.item():.6f} vs {loss2.item():.6f} (diff {abs(loss1 - loss2).item():.1e}); max grad diff {worst:.1e}")
        assert abs(loss1 - loss2).item() < 1e-5, case
        torch.testing.assert_close(accepted2, accepted1, equal_nan=True)
        assert worst < 1e-5, case
        assert max(g.abs().max().item() for g in grads1.values()) > 1e-3, "gradients that are not all ~0"


def test_sp2_training_exports_the_drafter_of_the_sp1_run(trainable_qwen3_target, gsm8k_path, train_env, train_runs, tmp_path):
    """3 optimizer steps on the tiny Qwen3 target (2 samples of <= 192 tokens per step, 16 anchors,
    2 drafter layers), once on one rank and once on 2 ranks launched with
    accelerate_configs/cpu_sp2.yaml (one sequence-parallel group, SP=2 from the accelerate config):
    the same loss log and the same exported drafter, up to float32 summation order; both logs count
    each step's 2 samples and their tokens once (a group's ranks do not each add them).
    Measured max abs weight difference: 4.7e-7 (the tolerance is 1e-5); the same with 1 target rank
    feeding the 2 (--target_ranks 1, run by hand). ~55 s on 2 busy cores."""
    args = dict(max_samples=6, max_steps=3, num_train_epochs=1, logging_steps=1)
    started = time.time()
    one = train_runs.run("train_dflash.py", run_args(trainable_qwen3_target, gsm8k_path, tmp_path / "sp1", **args), timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    two = accelerate_launch(
        run_args(trainable_qwen3_target, gsm8k_path, tmp_path / "sp2", **args), train_env, nproc=2, config="accelerate_configs/cpu_sp2.yaml"
    )
    print(f"two runs: {time.time() - started:.0f} s")
    assert two.returncode == 0, two.stderr[-4000:]
    assert "Sequence parallelism: drafter ranks in groups of 2 ([0, 1]), each group one sample at a time" in two.stderr
    log1, log2 = (read_jsonl(tmp_path / run / "train_log.jsonl") for run in ("sp1", "sp2"))
    assert [row["step"] for row in log1] == [row["step"] for row in log2] == [1, 2, 3]
    for row1, row2 in zip(log1, log2):
        assert row1["loss"] == pytest.approx(row2["loss"], abs=1e-5)
        assert row1["tau_estimate"] == pytest.approx(row2["tau_estimate"], abs=1e-5)
    # Each step trains one micro-batch of 2 samples, once: a group counts its samples and tokens once,
    # not once per rank. A row's rate times its step time (one step per row) is the count.
    total_tokens = int(re.search(r"Training data: 6 samples, (\d+) tokens", one.stderr).group(1))
    for log in (log1, log2):
        assert [round(row["samples_per_s"] * row["step_time_s"], 6) for row in log] == [2, 2, 2]
        tokens = [round(row["tokens_per_s"] * row["step_time_s"], 6) for row in log]
        assert all(t == int(t) for t in tokens) and sum(tokens) == total_tokens, (tokens, total_tokens)
    assert [row["tokens_per_s"] * row["step_time_s"] for row in log1] == pytest.approx([row["tokens_per_s"] * row["step_time_s"] for row in log2])
    weights1, weights2 = final_weights(tmp_path / "sp1"), final_weights(tmp_path / "sp2")
    assert set(weights1) == set(weights2)
    worst = max((weights1[k] - weights2[k]).abs().max().item() for k in weights1)
    print(f"max abs weight difference SP=1 vs SP=2: {worst:.1e}")
    assert worst < 1e-5


@pytest.mark.parametrize("backend, pad_to, sp, expected", [("sdpa", None, 3, 24), ("flex", None, 3, 384), ("sdpa", 5, 2, 10), ("sdpa", None, 2, 8)])
def test_batches_pad_to_a_multiple_of_the_sequence_parallel_size(backend, pad_to, sp, expected):
    """Every rank of a group holds 1/P of a batch's positions, so batches pad to the least common
    multiple of the backend's multiple (or --pad_to_multiple_of) and P. Samples of 13 and 7 tokens:
    padded to the backend's 8 or 128 alone they would not split in 3, nor padded to 5 (15) in 2."""
    from dflash_data import collate_batch
    from dflash_model import SequenceParallel
    from train_dflash import TrainSettings, resolve_compute

    settings = TrainSettings(
        target_model="x", train_data=["x"], sequence_parallel_size=sp, num_anchors=6 * sp, pad_to_multiple_of=pad_to, attention_backend=backend
    )
    compute = resolve_compute(settings, torch.device("cpu"))
    assert compute.pad_multiple == expected
    samples = [{"input_ids": list(range(1, 14)), "loss_mask": [True] * 13}, {"input_ids": list(range(1, 8)), "loss_mask": [True] * 7}]
    batch = collate_batch(samples, pad_token_id=0, pad_to_multiple_of=compute.pad_multiple)
    assert batch["input_ids"].shape == (2, expected * -(-13 // expected))
    shards = [SequenceParallel(None, rank, sp).shard(batch["input_ids"]) for rank in range(sp)]
    assert torch.equal(torch.cat(shards, dim=1), batch["input_ids"])


def test_a_checkpoint_resumes_only_at_the_sequence_parallel_size_that_wrote_it(monkeypatch, tmp_path):
    """The order of micro-batches depends on --sequence_parallel_size (each appears once per rank of a
    group), so a checkpoint records it and resuming at another size is refused, in one line naming the
    checkpoint and both sizes. Checked through save_checkpoint's trainer_state.json (the DeepSpeed
    engine and the barriers replaced) and make_schedule, both ways: SP=2 resumed at 1, SP=1 at 2."""
    import json

    from dflash_checkpoint import save_checkpoint
    from dflash_schedule import ResumePoint, make_schedule
    from train_dflash import TrainData, TrainSettings

    class Engine:
        def save_checkpoint(self, path, tag):
            os.makedirs(Path(path) / tag)

    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: None)
    layout = type("Layout", (), dict(is_lead=True, drafter_group=None, dp_rank=0, dp_world=2, target_ranks_per_node=0))()
    data = TrainData(dataset=None, lengths=[(7 * i) % 23 + 1 for i in range(12)], eval_prompts=None, chat_kwargs=None)

    def settings(sp):
        return TrainSettings(
            target_model="x", train_data=["x"], output_dir=str(tmp_path / f"sp{sp}"), per_device_batch_size=2, sequence_parallel_size=sp, save_steps=1
        )

    for written, resumed in ((2, 1), (1, 2)):
        save_checkpoint(Engine(), settings(written), layout, 1, 0, 2)
        path = tmp_path / f"sp{written}" / "checkpoint-1"
        state = json.loads((path / "trainer_state.json").read_text())
        assert make_schedule(settings(written), data, ResumePoint(str(path), state), 2).micro_steps_left > 0  # the same size resumes
        with pytest.raises(ValueError) as refused:
            make_schedule(settings(resumed), data, ResumePoint(str(path), state), 2)
        assert str(refused.value).startswith(
            f"--resume_from_checkpoint {path} was written with --sequence_parallel_size {written}, this run has {resumed}"
        )
        assert "\n" not in str(refused.value)


def test_target_rank_counts_each_sample_once_for_a_sequence_parallel_group(monkeypatch, caplog):
    """Split mode at SP=2: one target rank feeds one group of 2 drafter ranks, sending each micro-batch
    to both; its closing line and the counters in its headers (the supply rate the log compares with
    the drafters' demand) count the 6 samples and their tokens once, not twice. The feature
    sends are recorded instead of made (as test_split's transport test does)."""
    import logging

    from datasets import Dataset

    import dflash_split
    from dflash_features import serve_context_features
    from dflash_schedule import train_plan
    from dflash_split import END, HEADER, RankLayout
    from train_dflash import TrainSettings

    lengths = [5, 9, 7, 12, 6, 11]
    dataset = Dataset.from_dict({"input_ids": [list(range(1, n + 1)) for n in lengths], "loss_mask": [[1] * n for n in lengths]})
    headers = []

    def record_send(tensor, dest, group=None):
        if tensor.shape == (len(HEADER),):
            headers.append(tensor.tolist())

    class Extractor:  # the target's forward: features of width 8
        predict_next = last_hidden = False

        def __call__(self, input_ids, attention_mask):
            return torch.zeros(*input_ids.shape, 8)

    monkeypatch.setattr(dflash_split.dist, "send", record_send)
    settings = TrainSettings(target_model="x", train_data=["x"], per_device_batch_size=2, sequence_parallel_size=2, save_steps=0)
    layout = RankLayout(0, 3, [[0, 1, 2]], [[0]], [1, 2], None, None, None, None, None)
    plan = train_plan(lengths, settings, 0, 0, 3, drafter_ranks=2)  # one epoch: 3 micro-batches, each for both ranks
    with caplog.at_level(logging.INFO, logger="train_dflash"):
        serve_context_features(plan, dataset, type("Tokenizer", (), {"pad_token_id": 0}), Extractor(), layout, settings, torch.device("cpu"), 8, 0)
    assert len(headers) == 2 * 3 + 2  # every micro-batch to both drafter ranks, then END to each
    assert f"Target rank 0 done: 6 samples, {sum(lengths)} tokens" in caplog.text
    samples, tokens = HEADER.index("target_samples"), HEADER.index("target_tokens")
    assert [(h[0], h[samples], h[tokens]) for h in headers[-2:]] == [(END, 6, sum(lengths))] * 2


def sp_layout(rank, nodes, num_target_ranks):
    """A RankLayout of one-rank target groups, without process groups (those need a distributed run)."""
    from dflash_split import RankLayout

    groups = [[members[i]] for members in nodes for i in range(num_target_ranks)]
    targets = {g[0] for g in groups}
    return RankLayout(rank, sum(map(len, nodes)), nodes, groups, [r for m in nodes for r in m if r not in targets], None, None, None, None, None)


@pytest.mark.parametrize(
    "nodes, num_target_ranks, size, expected",
    [
        (2, 2, 2, [[2, 3], [4, 5], [6, 7], [10, 11], [12, 13], [14, 15]]),
        (2, 0, 4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
        (1, 1, 3, [[1, 2, 3], [4, 5, 6]]),
        (2, 1, 2, "each of the 2 nodes has 7 drafter ranks, not a multiple of 2"),  # [7, 9] would span the nodes
        (2, 0, 3, "each of the 2 nodes has 8 drafter ranks, not a multiple of 3"),  # 16 ranks in all are not either
        (2, 2, 4, "each of the 2 nodes has 6 drafter ranks, not a multiple of 4"),  # 12 in all are: [6, 7, 10, 11] would span
    ],
)
def test_sequence_parallel_groups_lie_within_a_node(monkeypatch, nodes, num_target_ranks, size, expected):
    """make_sequence_parallel_groups on 8 ranks per node (7 on one node): groups of `size` consecutive
    drafter ranks, never across a node, the ones the schedule gives one micro-batch (consecutive
    drafter ranks); where a node's drafter ranks do not divide into groups, one error line before any
    group is made. torch.distributed.new_group records the groups instead of making them."""
    from test_model import tiny_drafter

    from dflash_topology import make_sequence_parallel_groups

    per_node = 7 if nodes == 1 else 8
    node_list = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    made = []
    monkeypatch.setattr(torch.distributed, "new_group", lambda ranks: made.append(list(ranks)) or tuple(ranks))
    config = tiny_drafter().config
    config.num_attention_heads = config.num_key_value_heads = 12  # divisible by 2, 3 and 4
    if isinstance(expected, str):
        with pytest.raises(ValueError) as refused:
            make_sequence_parallel_groups(sp_layout(node_list[0][-1], node_list, num_target_ranks), size, config)
        assert str(refused.value).startswith(f"--sequence_parallel_size {size}: {expected}, and a group must lie within one node")
        assert "\n" not in str(refused.value) and made == []
        return
    for rank in range(nodes * per_node):
        made.clear()
        layout = sp_layout(rank, node_list, num_target_ranks)
        mine = make_sequence_parallel_groups(layout, size, config)
        assert made == expected  # every rank makes every group, in the same order
        if layout.is_target:
            assert mine is None
        else:
            group = next(g for g in expected if rank in g)
            assert (mine.group, mine.rank, mine.size) == (tuple(group), group.index(rank), size)
            assert group == layout.drafter_ranks[layout.dp_rank // size * size :][:size]  # the schedule's group


def test_a_node_whose_drafter_ranks_do_not_divide_into_groups_is_refused_before_anything_loads(monkeypatch):
    """setup_distributed, the first thing a rank does after parsing its settings: on 2 nodes of 8 ranks
    with --target_ranks 1 and SP 2 (14 drafter ranks in all, 7 per node) it refuses in one line. The
    process group, compile caches and liveness are replaced; node_ranks gives the 2 nodes."""
    import types

    import dflash_topology
    from train_dflash import TrainSettings

    accelerator = types.SimpleNamespace(process_index=0, num_processes=16, device=torch.device("cpu"))
    for name, value in (
        ("setup_compile_cache", lambda *a, **k: None),
        ("init_distributed", lambda on_cuda: accelerator),
        ("start_liveness", lambda *a: None),
        ("check_shared_output_dir", lambda *a: None),
        ("node_ranks", lambda rank, world, device: [list(range(8)), list(range(8, 16))]),
    ):
        monkeypatch.setattr(dflash_topology, name, value)

    def settings(target_ranks):
        return TrainSettings(target_model="x", train_data=["x"], target_ranks=target_ranks, sequence_parallel_size=2)

    with pytest.raises(ValueError) as refused:
        dflash_topology.setup_distributed(settings("1"))
    assert str(refused.value).startswith("--sequence_parallel_size 2: each of the 2 nodes has 7 drafter ranks, not a multiple of 2")
    assert dflash_topology.setup_distributed(settings("2")).nodes == [list(range(8)), list(range(8, 16))]


def test_heads_that_do_not_split_are_refused_before_the_target_loads(tiny_qwen3_target, monkeypatch, tmp_path):
    """The tiny Qwen3 target gives the drafter 4 attention and 2 KV heads: SP 4 is refused in one line
    from the target's config alone, before the rank layout is planned and the target loads. With 4 KV
    heads the run goes on to that point. The process group and the data are replaced (a world of 4)."""
    import types

    import train_dflash
    from dflash_schedule import ResumePoint
    from dflash_topology import Cluster

    def target_loads(*args, **kwargs):
        raise AssertionError("the target was about to load")

    cluster = Cluster(types.SimpleNamespace(), 0, 4, torch.device("cpu"), [[0, 1, 2, 3]], None)
    monkeypatch.setattr(train_dflash, "setup_distributed", lambda settings: cluster)
    monkeypatch.setattr(train_dflash, "load_data", lambda *args: None)
    monkeypatch.setattr(train_dflash, "find_resume_point", lambda *args: ResumePoint(None, {}))
    monkeypatch.setattr(train_dflash, "plan_rank_roles", target_loads)
    monkeypatch.setattr(train_dflash, "load_target_parts", target_loads)
    argv = [
        "--target_model",
        str(tiny_qwen3_target),
        "--train_data",
        "README.md",
        "--output_dir",
        str(tmp_path),
        "--sequence_parallel_size",
        "4",
        "--num_draft_layers",
        "1",
        "--report_to",
        "none",
    ]
    with pytest.raises(ValueError) as refused:
        train_dflash.main(argv)
    assert str(refused.value) == (
        "--sequence_parallel_size 4: Ulysses gives each rank 1/4 of the drafter's heads, but it has 4 "
        "attention heads and 2 KV heads; pick a size that divides both, or set "
        "--draft_num_attention_heads / --draft_num_key_value_heads"
    )
    with pytest.raises(AssertionError, match="the target was about to load"):
        train_dflash.main(argv + ["--draft_num_key_value_heads", "4"])
