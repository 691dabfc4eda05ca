"""The optimizers: AdamW, and DeepSpeed's Muon under ZeRO-2 matched to torch.optim.Muon's update size;
the learning-rate schedules; clipping the gradient before Muon; the refusals (Muon clipping with accumulated
micro-batches, resuming another optimizer's run)."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import free_port

from dflash2_model import DFlash2Config, DFlash2DraftModel
from dflash_checkpoint import check_same_optimizer, muon_param_names, resume_engine
from dflash_model import DFlashConfig, DFlashDraftModel
from dflash_schedule import ResumePoint
from dspark_model import DSparkConfig, DSparkDraftModel
from train_dflash import TrainSettings, muon_param_groups, parse_settings

REPO = Path(__file__).resolve().parents[1]


def tiny_drafter() -> DFlashDraftModel:
    config = DFlashConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=64,
        block_size=4,
        num_target_layers=4,
        rope_theta=10000.0,
        dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 2]},
    )
    return DFlashDraftModel(config)


def test_muon_groups_scale_each_matrix_as_torch_match_rms_adamw():
    settings = TrainSettings(target_model="t", train_data=["d"], optimizer="muon", learning_rate=1e-3)
    assert (settings.weight_decay, settings.max_grad_norm) == (0.1, 0.0)  # Muon's defaults
    drafter = tiny_drafter()
    groups = {g["name"]: g for g in muon_param_groups(drafter, settings)}
    # fc reads 2 target layers x 32; q/k/v/gate/up read 32; o reads 4 x 8 = 32; down reads 64
    assert set(groups) == {"muon_in64", "muon_in32", "adamw"}
    assert groups["muon_in32"]["lr"] == pytest.approx(1e-3 * 0.2 * 32**0.5)
    assert groups["muon_in64"]["lr"] == pytest.approx(1e-3 * 0.2 * 8)
    for name in ("muon_in32", "muon_in64"):  # lr x decay = torch's 1e-3 x 0.1, whatever the group's lr
        assert groups[name]["lr"] * groups[name]["weight_decay"] == pytest.approx(1e-4)
    assert (groups["adamw"]["lr"], groups["adamw"]["weight_decay"]) == (1e-3, 0.01)
    assert all(p.ndim == 1 for p in groups["adamw"]["params"])
    assert sum(len(g["params"]) for g in groups.values()) == len(list(drafter.parameters()))
    in64 = {id(p) for p in groups["muon_in64"]["params"]}
    assert id(drafter.fc.weight) in in64 and id(drafter.layers[0].mlp.down_proj.weight) in in64


DSPARK_HEADS = ["confidence_head.proj.bias", "confidence_head.proj.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]


def test_muon_groups_keep_dspark_heads_on_adamw():
    settings = TrainSettings(target_model="t", train_data=["d"], optimizer="muon", learning_rate=1e-3)
    base = tiny_drafter().config.to_dict()
    drafter = DSparkDraftModel(DSparkConfig(**{**base, "markov_rank": 8}))
    groups = {g["name"]: g for g in muon_param_groups(drafter, settings)}
    names = {id(p): n for n, p in drafter.named_parameters()}
    on_adamw = sorted(names[id(p)] for p in groups["adamw"]["params"])
    assert [n for n in on_adamw if "head" in n] == DSPARK_HEADS
    assert all(n.endswith("norm.weight") for n in on_adamw if "head" not in n)  # and the norm gains, as for DFlash
    assert id(drafter.fc.weight) in {id(p) for p in groups["muon_in64"]["params"]}


def test_muon_groups_keep_dflash2_codebooks_and_base_kernels_on_adamw():
    """speculators' rule: Muon trains matrices; the selector's vocabulary-sized codebooks and the
    convolutions' 3-D base kernels (per-channel taps) go to AdamW, its projections to Muon."""
    settings = TrainSettings(target_model="t", train_data=["d"], optimizer="muon", learning_rate=1e-3)
    base = tiny_drafter().config.to_dict()
    drafter = DFlash2DraftModel(DFlash2Config(**{**base, "conv_group_size": 8}))
    groups = {g["name"]: g for g in muon_param_groups(drafter, settings)}
    names = {id(p): n for n, p in drafter.named_parameters()}
    on_adamw = {names[id(p)] for p in groups["adamw"]["params"]}
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= on_adamw
    assert "layers.0.attention_conv.base_kernel" in on_adamw and "layers.1.mlp_conv.base_kernel" in on_adamw
    assert all(n.endswith(("norm.weight", "codebook", "base_kernel")) for n in on_adamw), on_adamw
    on_muon = {names[id(p)] for g in groups.values() if g["name"] != "adamw" for p in g["params"]}
    assert {"candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight"} <= on_muon
    assert on_adamw | on_muon == set(names.values())


def test_resume_refuses_a_muon_checkpoint_of_another_split(tmp_path):
    """A Muon checkpoint records which weights Muon trained; a version that splits them otherwise
    refuses it in one line before DeepSpeed loads an optimizer state that does not fit."""
    drafter = tiny_drafter()
    for param in drafter.parameters():
        param.use_muon = param.ndim == 2
    loaded = []
    engine = types.SimpleNamespace(module=drafter, load_checkpoint=lambda path, tag: loaded.append(path))
    now = muon_param_names(drafter)
    assert now and "fc.weight" in now and not any("norm" in n for n in now)
    saved = [n for n in now if n != "fc.weight"]  # as if an older rule had left fc to AdamW
    match = rf"Muon on {len(now) - 1} weights, and this version puts {len(now)} on Muon \(first difference: fc.weight, now on Muon\)"
    with pytest.raises(ValueError, match=match) as error:
        resume_engine(engine, ResumePoint(str(tmp_path), {"muon_params": saved}), 0)
    assert "\n" not in str(error.value) and not loaded
    resume_engine(engine, ResumePoint(str(tmp_path), {"muon_params": now}), 0)  # the same split loads
    assert loaded == [str(tmp_path)]


# ZeRO-2 steps of start_deepspeed's optimizer on given gradients (a loss linear in the weights), in processes of
# their own (torch.distributed on gloo, one process per drafter rank, every rank the same gradient); the first rank
# saves the weights before and after each step. Step k's gradient is scales[k] x a fixed random draw.
STEP_SCRIPT = r"""
import os, sys, types, torch
sys.path.insert(0, sys.argv[1])
import train_dflash as t
from dflash_model import DFlashConfig, DFlashDraftModel
from dflash_schedule import ResumePoint
from dspark_model import DSparkConfig, DSparkDraftModel
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=world_size)
world = torch.distributed.group.WORLD
layout = types.SimpleNamespace(dp_world=world_size, dp_rank=rank, drafter_group=world, drafter_ranks=list(range(world_size)),
                               self_group=world, split=False)
torch.manual_seed(0)
shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, vocab_size=64, block_size=4, num_target_layers=4, rope_theta=10000.0,
             dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 2]})
if sys.argv[6] == "dspark":  # with its Markov head (rank 8) and confidence head
    drafter = DSparkDraftModel(DSparkConfig(markov_rank=8, **shape))
else:
    drafter = DFlashDraftModel(DFlashConfig(**shape))
settings = t.TrainSettings(target_model="t", train_data=["d"], optimizer=sys.argv[3], learning_rate=1e-3, warmup_ratio=0.0,
                           lr_scheduler="linear", max_grad_norm=float(sys.argv[4]) if sys.argv[4] != "default" else None)
compute = t.Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
scales = [float(x) for x in sys.argv[7].split(",")]
grads = [{n: scale * torch.randn_like(p) for n, p in drafter.named_parameters()} for scale in scales]
engine, scheduler = t.start_deepspeed(settings, drafter, layout, types.SimpleNamespace(total_steps=10), compute, ResumePoint(None, {}))
after, lrs = [], []
for step_grads in grads:
    lrs.append(scheduler.get_last_lr())
    loss = sum((p * step_grads[n]).sum() for n, p in engine.module.named_parameters())
    engine.backward(loss)
    engine.step()
    after.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
if rank == 0:
    torch.save({"before": before, "after": after, "grads": grads, "lrs": lrs}, sys.argv[5])
"""


def zero2_steps(tmp_path, optimizer: str, max_grad_norm: str = "default", drafter: str = "dflash", scales=(10.0,), ranks: int = 1) -> dict:
    """The saved weights of `len(scales)` ZeRO-2 steps over `ranks` CPU processes: {"before", "after": [per step],
    "grads": [per step], "lrs": [per step]}."""
    out = tmp_path / f"steps_{optimizer}_{max_grad_norm}_{drafter}_{ranks}.pt"
    port = str(free_port())
    base = {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    args = [sys.executable, "-c", STEP_SCRIPT, str(REPO), port, optimizer, max_grad_norm, str(out), drafter, ",".join(map(str, scales))]
    processes = [
        subprocess.Popen(
            args,
            cwd=tmp_path,
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
    return torch.load(out)


def zero2_step(tmp_path, optimizer: str, max_grad_norm: str = "default", drafter: str = "dflash") -> dict:
    """One step at a gradient of norm far above 1: {"before", "after", "grads", "lr"} of that step."""
    steps = zero2_steps(tmp_path, optimizer, max_grad_norm, drafter)
    return {"before": steps["before"], "after": steps["after"][0], "grads": steps["grads"][0], "lr": steps["lrs"][0]}


def torch_muon_steps(before: dict, grads: list[dict], max_grad_norm: float) -> list[dict]:
    """The reference: torch.optim.Muon on the matrices (speculators' settings), torch's AdamW on the norm gains,
    the gradient clipped by clip_grad_norm_ before them (0: not clipped); the weights after each step."""
    reference = {n: p.clone().requires_grad_() for n, p in before.items()}
    matrices = [p for n, p in reference.items() if p.ndim >= 2]
    gains = [p for n, p in reference.items() if p.ndim < 2]
    muon = torch.optim.Muon(matrices, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(gains, lr=1e-3, weight_decay=0.01)
    after = []
    for step, step_grads in enumerate(grads):
        for group in (*muon.param_groups, *adamw.param_groups):
            group["lr"] = 1e-3 * (1 - step / 10)  # the linear schedule of 10 steps, no warmup
        for n, p in reference.items():
            p.grad = step_grads[n].clone()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(reference.values()), max_grad_norm)
        muon.step()
        adamw.step()
        after.append({n: p.detach().clone() for n, p in reference.items()})
    return after


def step_agreement(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """(size ratio, cosine) of two updates."""
    ratio = (ours.norm() / theirs.norm()).item()
    return ratio, torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0).item()


def test_deepspeed_muon_step_equals_torch_muon_unclipped(tmp_path):
    step = zero2_step(tmp_path, "muon")
    before, after = step["before"], step["after"]
    reference = torch_muon_steps(before, [step["grads"]], max_grad_norm=0)[0]
    for n in before:
        ours, theirs = after[n] - before[n], reference[n] - before[n]
        assert theirs.abs().max() > 1e-5, n  # the step moved the weight
        if before[n].ndim < 2:  # the norm gains: torch's AdamW on both sides
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-8)
            continue
        # torch's Newton-Schulz iteration runs in bf16, DeepSpeed's here in fp32 (`muon_newton_schulz_in_fp32`): measured
        # sizes within 0.4%, cosine >= 0.99984; with DeepSpeed's own bf16 on a CPU, cosine down to 0.9989. A no-op flag
        # (AdamW's first step, ~lr x sqrt(numel): 5x larger) or a clipped update (gradient norm ~400: 1/400) is far outside.
        ratio, cosine = step_agreement(ours, theirs)
        assert abs(ratio - 1) < 0.01 and cosine > 0.9997, f"{n}: DeepSpeed's Muon step differs from torch's: size x{ratio:.4f}, cosine {cosine:.5f}"


def test_muon_clips_the_gradient_before_its_momentum_as_torch(tmp_path):
    """--max_grad_norm with Muon clips the raw gradient before Muon's momentum, as clip_grad_norm_ before
    torch.optim.Muon: seen at the second step, where a first gradient 1000x larger than the second dominates an
    unclipped momentum and not a clipped one. Over two drafter ranks the same steps: each rank counts only the
    gradient slices it owns."""
    scales = (10.0, 0.01)
    steps = zero2_steps(tmp_path, "muon", "1.0", scales=scales)
    before, after = steps["before"], steps["after"]
    clipped = torch_muon_steps(before, steps["grads"], max_grad_norm=1.0)
    unclipped = torch_muon_steps(before, steps["grads"], max_grad_norm=0)
    for n in before:
        ours, theirs, other = (run[1][n] - run[0][n] for run in (after, clipped, unclipped))
        if before[n].ndim < 2:  # AdamW's gains: the clip scales both steps' gradients by different factors
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-8)
            continue
        ratio, cosine = step_agreement(ours, theirs)
        assert abs(ratio - 1) < 0.01 and cosine > 0.9997, f"{n}: the clipped Muon step differs from torch's: size x{ratio:.4f}, cosine {cosine:.5f}"
        assert step_agreement(ours, other)[1] < 0.9, f"{n}: the second step does not tell clipped from unclipped"
    two_ranks = zero2_steps(tmp_path, "muon", "1.0", scales=scales, ranks=2)
    for n in before:
        torch.testing.assert_close(two_ranks["after"][1][n], after[1][n], rtol=1e-4, atol=1e-6)


def test_deepspeed_muon_steps_dspark_heads_with_adamw(tmp_path):
    """DeepSpeed tags Muon's parameters by its own name rule, which would take DSpark's Markov and
    confidence heads: under start_deepspeed they take torch's AdamW step, the backbone Muon's."""
    step = zero2_step(tmp_path, "muon", drafter="dspark")
    before, after, grads = step["before"], step["after"], step["grads"]
    assert sorted(n for n in before if "head" in n) == DSPARK_HEADS
    reference = {n: before[n].clone().requires_grad_() for n in DSPARK_HEADS}
    for n, p in reference.items():
        p.grad = grads[n].clone()
    torch.optim.AdamW(list(reference.values()), lr=1e-3, weight_decay=0.01).step()
    for n in DSPARK_HEADS:
        torch.testing.assert_close(after[n] - before[n], reference[n].detach() - before[n], rtol=1e-4, atol=1e-8)
    # A backbone matrix took Muon's step: RMS ~0.2 x lr (match_rms_adamw), where AdamW's first step moves each weight by ~lr.
    moved = (after["fc.weight"] - before["fc.weight"]).pow(2).mean().sqrt().item()
    assert 0.1e-3 < moved < 0.4e-3, moved


def test_muon_clipping_needs_one_micro_batch_a_step_and_schedules_decay_to_zero(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"--max_grad_norm 1.0 with --optimizer muon clips the gradient of one micro-batch a step: pass --gradient_accumulation_steps 1 \(now 2\)",
    ):
        TrainSettings(target_model="t", train_data=["d"], optimizer="muon", max_grad_norm=1.0, gradient_accumulation_steps=2)
    assert TrainSettings(target_model="t", train_data=["d"], optimizer="muon", max_grad_norm=1.0).max_grad_norm == 1.0
    with pytest.raises(ValueError, match="--optimizer must be one of adamw, muon"):
        TrainSettings(target_model="t", train_data=["d"], optimizer="sgd")
    with pytest.raises(ValueError, match="--lr_scheduler must be one of cosine, linear"):
        TrainSettings(target_model="t", train_data=["d"], lr_scheduler="step")
    settings, _ = parse_settings(["--target_model", "t", "--train_data", "d", "--lr_scheduler", "linear", "--warmup_ratio", "0.1"])
    assert (settings.lr_scheduler, settings.warmup_ratio, settings.max_grad_norm, settings.weight_decay) == ("linear", 0.1, 1.0, 0.0)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_schedules_warm_up_then_decay_to_zero(kind):
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    make = get_cosine_schedule_with_warmup if kind == "cosine" else get_linear_schedule_with_warmup
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = make(optimizer, 2, 10)
    factors = []
    for _ in range(10):
        factors.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert factors[:3] == pytest.approx([0.0, 0.5, 1.0])
    midpoint = 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 4 / 8))).item() if kind == "cosine" else 4 / 8
    assert factors[6] == pytest.approx(midpoint)  # step 6: 4 of the 8 decay steps done
    assert scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


def test_resume_refuses_a_checkpoint_of_another_optimizer(tmp_path):
    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    check_same_optimizer(checkpoint, "adamw")  # no settings file: an AdamW run of before the flag
    (checkpoint / "training_settings.json").write_text(json.dumps({"optimizer": "muon"}))
    check_same_optimizer(checkpoint, "muon")
    with pytest.raises(ValueError, match=r"trained with --optimizer muon, this one asks for --optimizer adamw.*resume with --optimizer muon"):
        check_same_optimizer(checkpoint, "adamw")


def test_muon_clipping_refuses_an_optimizer_it_cannot_clip_in():
    """Without ZeRO-2's partitioned gradients (ZeRO stage 1, or no ZeRO) there is no flattening to clip before."""
    from train_dflash import clip_gradient_before_muon

    stage_one = types.SimpleNamespace(partition_gradients=False, bit16_groups=[[]])
    for optimizer in (stage_one, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)):
        with pytest.raises(ValueError, match=r"--max_grad_norm with --optimizer muon needs ZeRO stage 2 .*or pass --max_grad_norm 0"):
            clip_gradient_before_muon(optimizer, 1.0)
