"""--fused_loss and DFlash2's single-pass top-K (dflash_loss.py): the flag's values and refusals (one line
each), its fallback off CUDA, the library path's wiring checked through plain-torch stand-ins of the two
libraries' documented calls (the real kernels need CUDA: tools/gpu/fused_loss_check.py compares them on a
GPU, and its tiny CPU mode runs here), and the top-K taken from the loss's own logits against a second
pass through the head, in fp32, down to the bit."""

import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config

import dflash_loss
from dflash2_model import DFlash2DraftModel
from dflash_loss import loss_weights, selector_objective, weighted_block_loss
from dflash_loss_kernels import check_fused_loss, resolve_fused_loss, top_k_candidates
from dflash_target import drafter_config_for_target

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, BLOCK = 64, 16, 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors


def random_inputs(seed=0, dtype=torch.float32):
    """hidden and target_hidden [2, 5, B-1, 16] (hidden requires grad), head [64, 16] (logits of spread ~2),
    labels [2, 5, B-1] (the argmax at about half the positions, so some blocks run long), valid with holes."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, BLOCK - 1, HIDDEN, generator=g)
    target_hidden = torch.randn(2, 5, BLOCK - 1, HIDDEN, generator=g)
    head = torch.randn(VOCAB, HIDDEN, generator=g) / 2
    argmax = (hidden @ head.T).argmax(-1)
    labels = torch.where(torch.rand(argmax.shape, generator=g) < 0.5, argmax, torch.randint(0, VOCAB, argmax.shape, generator=g))
    valid = torch.rand(argmax.shape, generator=g) > 0.2
    return hidden.to(dtype).requires_grad_(True), target_hidden.to(dtype), head.to(dtype), labels, valid


def loss_and_grad(hidden, *args, **kwargs):
    """weighted_block_loss's outputs (detached) and the gradient of its loss with respect to hidden."""
    hidden.grad = None
    out = weighted_block_loss(hidden, *args, **kwargs)
    out[0].backward()
    return [o.detach() for o in out], hidden.grad.clone()


# ----------------------------------------------------------------------------------------------
# DFlash2's candidates from the loss pass


@pytest.mark.parametrize("loss,weighting", [("ce", "exp"), ("ce", "dpace"), ("kl", "exp")])
@pytest.mark.parametrize("chunk_size", [7, 4096])  # 7: chunks end inside blocks
@pytest.mark.parametrize("scaled", [False, True])  # the logit multiplier and cap (the top-K is of the raw logits)
def test_single_pass_top_k_equals_a_second_pass_through_the_head(loss, weighting, chunk_size, scaled):
    """weighted_block_loss(top_k=K) gives exactly the loss, gradient, acceptance and weights it gives without
    top-K, and exactly the ids of `top_k_candidates` (the second pass it replaces); their values are the K
    largest logits of each row, most likely first."""
    hidden, target_hidden, head, labels, valid = random_inputs()
    kwargs = dict(
        chunk_size=chunk_size,
        loss=loss,
        target_hidden=target_hidden,
        loss_weighting=weighting,
        output_multiplier=0.7 if scaled else 1.0,
        final_logit_softcapping=3.0 if scaled else None,
        return_row_weights=True,
    )
    top_k = 5
    (value, accepted, row_weights, top_ids), grad = loss_and_grad(hidden, head, labels, valid, loss_weights(BLOCK, 2.0), top_k=top_k, **kwargs)
    (value_2, accepted_2, row_weights_2), grad_2 = loss_and_grad(hidden, head, labels, valid, loss_weights(BLOCK, 2.0), **kwargs)
    rows = hidden.detach()[valid]  # [T, hidden], in label_valid.nonzero() order
    assert torch.equal(value, value_2) and torch.equal(grad, grad_2) and torch.equal(row_weights, row_weights_2)
    assert torch.equal(torch.nan_to_num(accepted, 7.0), torch.nan_to_num(accepted_2, 7.0))
    assert top_ids.shape == (rows.shape[0], top_k) and torch.equal(top_ids, top_k_candidates(rows, head, top_k, chunk_size))
    logits = rows @ head.T  # [T, vocab], in one piece
    assert torch.equal(top_ids, logits.topk(top_k).indices)  # random floats: no ties
    torch.testing.assert_close(logits.gather(1, top_ids), logits.topk(top_k).values, rtol=1e-6, atol=1e-6)
    # Nothing valid: an empty [0, K], still in its slot.
    *_, empty = weighted_block_loss(hidden, head, labels, torch.zeros_like(valid), loss_weights(BLOCK, 2.0), top_k=top_k, **kwargs)
    assert empty.shape == (0, top_k) and empty.dtype == torch.long


class CandidateScores(nn.Module):
    """A stand-in for DFlash2's candidate selector: the unary logits plus a learned per-candidate term of the hidden state."""

    def __init__(self):
        super().__init__()
        self.projection = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, hidden, predecessor_ids, candidate_ids, unary):
        return unary + self.projection(hidden).gather(1, candidate_ids)


def test_the_selector_objective_on_the_loss_pass_candidates_equals_the_two_pass_form():
    hidden, _, head, labels, valid = random_inputs(seed=1)
    scores = CandidateScores()
    predecessors = torch.randint(0, VOCAB, labels.shape, generator=torch.Generator().manual_seed(2))

    def run(candidate_ids):
        hidden.grad = None
        scores.zero_grad()
        loss, accepted = selector_objective(
            scores, 5, hidden, head, labels, valid, predecessors, row_weights, chunk_size=7, output_multiplier=0.7, candidate_ids=candidate_ids
        )
        loss.backward()
        return loss.detach(), accepted, hidden.grad.clone(), scores.projection.weight.grad.clone()

    _, _, row_weights, top_ids = weighted_block_loss(hidden, head, labels, valid, loss_weights(BLOCK), chunk_size=7, return_row_weights=True, top_k=5)
    one, two = run(top_ids), run(None)
    for a, b in zip(one, two):
        assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


def tiny_dflash2():
    """A DFlash2 drafter at hidden 32 (selector top-5) with random target tables attached."""
    target = Qwen3Config(
        hidden_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=VOCAB
    )
    config = drafter_config_for_target(
        target, mask_token_id=VOCAB - 1, num_draft_layers=1, block_size=4, drafter="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=5
    )
    torch.manual_seed(0)
    drafter = DFlash2DraftModel(config)
    for name, param in drafter.named_parameters():
        param.data.normal_(1.0 if "norm" in name else 0.0, 0.5)
    drafter.attach_target(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB, bias=False))
    return drafter


def test_the_trainer_takes_dflash2s_candidates_from_the_loss_pass(monkeypatch):
    """MicroBatchLoss of a DFlash2 drafter never runs the second pass (`top_k_candidates`), and its loss and
    gradients equal those of the two-pass form (the loss asked for no top-K, the selector finding its own)."""
    import train_dflash
    from train_dflash import Compute, MicroBatchLoss, TrainSettings

    drafter = tiny_dflash2().train()
    settings = TrainSettings(target_model="x", train_data=["x"], drafter="dflash2", num_anchors=6, block_size=4, loss_weighting="dpace")
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
    loss_fn = MicroBatchLoss(settings, drafter.config, compute, None, drafter.target_lm_head)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (2, 20), generator=g)
    loss_mask = torch.ones(2, 20, dtype=torch.bool)
    loss_mask[:, :4] = False
    features = torch.randn(2, 20, len(drafter.config.target_layer_ids) * 32, generator=g)

    def step():
        drafter.zero_grad(set_to_none=True)
        loss, accepted = loss_fn(drafter, features, input_ids, loss_mask, input_ids, (0, 0, 0, 0))
        loss.backward()
        return loss.detach(), accepted, {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}

    def second_pass(*args, **kwargs):
        raise AssertionError("top_k_candidates ran: the selector's candidates took a second pass through the head")

    with monkeypatch.context() as patch:
        patch.setattr(dflash_loss, "top_k_candidates", second_pass)
        loss, accepted, grads = step()
    with monkeypatch.context() as patch:  # the two-pass form: the loss returns no candidates, the selector finds its own
        patch.setattr(train_dflash, "weighted_block_loss", lambda *a, **k: weighted_block_loss(*a, **{**k, "top_k": 0}))
        loss_2, accepted_2, grads_2 = step()
    assert torch.equal(loss, loss_2) and torch.equal(torch.nan_to_num(accepted, 7.0), torch.nan_to_num(accepted_2, 7.0))
    assert grads.keys() == grads_2.keys() and any("candidate_selector" in name for name in grads)
    for name in grads:
        assert torch.equal(grads[name], grads_2[name]), name


# ----------------------------------------------------------------------------------------------
# --fused_loss


def test_the_flag_parses_and_defaults_to_the_reference():
    from train_dflash import parse_settings

    assert parse_settings(["--target_model", "x", "--train_data", "a"])[0].fused_loss == "none"
    for name in ("liger", "cce"):
        assert parse_settings(["--target_model", "x", "--train_data", "a", "--fused_loss", name])[0].fused_loss == name


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--fused_loss", "triton"], "--fused_loss must be one of none, liger, cce, got 'triton'"),
        (["--fused_loss", "liger", "--loss", "kl"], "--fused_loss liger computes only --loss ce, got --loss kl"),
        (["--fused_loss", "cce", "--loss", "tv"], "--fused_loss cce computes only --loss ce, got --loss tv"),
        (["--fused_loss", "liger", "--drafter", "dspark"], "--fused_loss liger computes only --loss ce, got --loss dspark"),
        (["--fused_loss", "cce", "--dtype", "float32"], "--fused_loss cce needs bf16 hidden states"),
    ],
)
def test_refusals_are_one_line_and_name_the_flag(flags, message):
    from train_dflash import parse_settings

    with pytest.raises(ValueError) as error:
        parse_settings(["--target_model", "x", "--train_data", "a", *flags])
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_off_cuda_the_reference_runs_with_one_log_line(caplog):
    """A CPU (CI, the demo) runs a --fused_loss config through the reference kernels, the same loss, and says so once."""
    from train_dflash import parse_settings, resolve_compute

    settings, _ = parse_settings(["--target_model", "x", "--train_data", "a", "--fused_loss", "liger"])
    with caplog.at_level(logging.INFO, logger="train_dflash"):
        compute = resolve_compute(settings, torch.device("cpu"))
    assert compute.fused_loss == "none"
    lines = [r.getMessage() for r in caplog.records if "--fused_loss" in r.getMessage()]
    assert lines == ["--fused_loss liger runs on CUDA only: on cpu the loss runs through the reference kernels (the same loss)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train_dflash"):
        assert resolve_compute(parse_settings(["--target_model", "x", "--train_data", "a"])[0], torch.device("cpu")).fused_loss == "none"
    assert not [r for r in caplog.records if "--fused_loss" in r.getMessage()]


def test_on_cuda_a_missing_library_is_refused_in_one_line_naming_pip(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    for name, package in (("liger", "liger-kernel"), ("cce", "cut-cross-entropy")):
        with pytest.raises(ValueError) as error:
            resolve_fused_loss(name, torch.device("cuda"))
        assert f"pip install {package}" in str(error.value) and "\n" not in str(error.value)
    assert resolve_fused_loss("none", torch.device("cuda")) == "none"
    install_stand_ins(monkeypatch)
    assert resolve_fused_loss("liger", torch.device("cuda")) == "liger" and resolve_fused_loss("cce", torch.device("cuda")) == "cce"
    check_fused_loss("liger", "ce", "float32")  # Liger takes float32


def install_stand_ins(monkeypatch, drop_cap=False):
    """Plain-torch stand-ins for the calls library_linear_ce makes, as the libraries document them:
    `liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss(reduction, softcap, return_predicted_tokens)
    (lin_weight, _input, target)` -> .loss, .predicted_tokens; `cut_cross_entropy.linear_cross_entropy(e, c,
    targets, softcap=, reduction=)`. drop_cap: a stand-in that ignores the cap (to see the test fail on it)."""

    def ce(rows, weight, targets, softcap, reduction):
        logits = (rows @ weight.T).float()  # [T, vocab], in the rows' dtype first, as the kernels' matmuls
        if softcap and not drop_cap:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits, targets, reduction=reduction), logits.argmax(-1)

    class LigerFusedLinearCrossEntropyLoss(nn.Module):
        def __init__(self, reduction="mean", softcap=None, return_predicted_tokens=False):
            super().__init__()
            self.reduction, self.softcap, self.predicted = reduction, softcap, return_predicted_tokens

        def forward(self, lin_weight, _input, target):
            loss, predicted = ce(_input, lin_weight, target, self.softcap, self.reduction)
            return types.SimpleNamespace(loss=loss, predicted_tokens=predicted if self.predicted else None)

    liger = types.ModuleType("liger_kernel")
    liger.transformers = types.ModuleType("liger_kernel.transformers")
    liger.transformers.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss
    cce = types.ModuleType("cut_cross_entropy")
    cce.linear_cross_entropy = lambda e, c, targets, softcap=None, reduction="mean": ce(e, c, targets, softcap, reduction)[0]
    monkeypatch.setitem(sys.modules, "liger_kernel", liger)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger.transformers)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", cce)


@pytest.mark.parametrize("library,dtype", [("liger", torch.float32), ("cce", torch.bfloat16)])
@pytest.mark.parametrize("weighting,normalize", [("exp", "weights"), ("dpace", "count")])
def test_the_library_path_weights_its_per_row_ce_as_the_reference(monkeypatch, library, dtype, weighting, normalize):
    """Through the stand-ins, each library's per-row CE gets the reference's position weights (exp, or
    D-PACE from exp(-CE)), normaliser, logit multiplier and cap: loss, gradient, acceptance, weights and
    DFlash2's top-K as the reference path's (bf16 for cce, whose backward takes no float32)."""
    install_stand_ins(monkeypatch)
    hidden, _, head, labels, valid = random_inputs(seed=3, dtype=dtype)
    kwargs = dict(
        chunk_size=7,
        loss_weighting=weighting,
        normalize=normalize,
        output_multiplier=0.7,
        final_logit_softcapping=3.0,
        return_row_weights=True,
        top_k=5,
    )
    got, grad = loss_and_grad(hidden, head, labels, valid, loss_weights(BLOCK, 2.0), fused_loss=library, **kwargs)
    expected, expected_grad = loss_and_grad(hidden, head, labels, valid, loss_weights(BLOCK, 2.0), **kwargs)
    # bf16: the library scales the bf16 rows by the multiplier before the head, the reference its fp32 logits after
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=5e-3, atol=5e-4)
    torch.testing.assert_close(got[0], expected[0], **tolerance)
    torch.testing.assert_close(grad.float(), expected_grad.float(), **tolerance)
    torch.testing.assert_close(got[2], expected[2], **tolerance)  # row weights (D-PACE: from each row's CE)
    torch.testing.assert_close(got[1], expected[1], equal_nan=True)  # acceptance: argmax hits
    assert torch.equal(got[3], expected[3])  # the top-K
    with pytest.raises(AssertionError):  # the comparison can fail: a library call that loses the cap
        install_stand_ins(monkeypatch, drop_cap=True)
        dropped, dropped_grad = loss_and_grad(hidden, head, labels, valid, loss_weights(BLOCK, 2.0), fused_loss=library, **kwargs)
        torch.testing.assert_close(dropped_grad.float(), expected_grad.float(), **tolerance)


def test_the_loss_function_refuses_what_the_flag_refuses(monkeypatch):
    """Called directly (bench_dflash.py, tools): a distribution loss through a library, and cce on float32 rows."""
    install_stand_ins(monkeypatch)
    hidden, target_hidden, head, labels, valid = random_inputs()
    with pytest.raises(ValueError, match=r"^--fused_loss liger computes only --loss ce, got --loss kl: "):
        weighted_block_loss(hidden, head, labels, valid, loss_weights(BLOCK), loss="kl", target_hidden=target_hidden, fused_loss="liger")
    with pytest.raises(ValueError, match=r"^--fused_loss cce needs bf16 hidden states .*--dtype bfloat16, or --fused_loss liger$"):
        weighted_block_loss(hidden, head, labels, valid, loss_weights(BLOCK), fused_loss="cce")


def test_the_benchmark_times_the_libraries_as_levers():
    from dflash_bench_training import parse_variant

    assert parse_variant("compile_layers+fused_ce_compiled+fused_loss_liger").fused_loss == "liger"
    assert parse_variant("baseline+dpace+fused_loss_cce").fused_loss == "cce" and parse_variant("baseline").fused_loss == "none"
    with pytest.raises(ValueError, match=r"^--fused_loss liger computes only --loss ce, got --loss kl"):
        parse_variant("baseline+loss_kl+fused_loss_liger")
    with pytest.raises(ValueError, match=r"^--fused_loss must be one of none, liger, cce, got 'triton'"):
        parse_variant("baseline+fused_loss_triton")


# ----------------------------------------------------------------------------------------------
# tools/gpu/fused_loss_check.py


def test_the_gpu_check_runs_tiny_on_cpu_and_skips_the_libraries():
    """Its tiny mode: the reference rows within the bf16 tolerances, top-K the same as the second pass, the
    library rows skipped with the reason, exit 0."""
    result = subprocess.run(
        [sys.executable, "tools/gpu/fused_loss_check.py", "--tiny", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 9, result.stdout  # 3 cases x (reference, liger, cce)
    reference = [row for row in rows if "| reference |" in row]
    assert len(reference) == 3 and all("| same |" in row and row.endswith("| - | ok |") for row in reference), reference
    assert sum("skipped: CUDA only (Triton kernels)" in row for row in rows) == 6
    assert result.stdout.rstrip().endswith("every row that ran is within tolerance")


def test_the_gpu_check_exits_nonzero_on_a_mismatch(monkeypatch, capsys):
    """With the stand-ins run as if on CUDA, the library rows pass; a stand-in that loses the cap fails its rows, exit 1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fused_loss_check", REPO / "tools/gpu/fused_loss_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "resolve_fused_loss", lambda name, device: name)  # run the library rows here
    install_stand_ins(monkeypatch)
    assert check.main(["--tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert sum(row.endswith("| ok |") for row in out.splitlines() if row.startswith("| tiny |")) == 9, out
    install_stand_ins(monkeypatch, drop_cap=True)
    assert check.main(["--tiny", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    failed = [row for row in out.splitlines() if "MISMATCH" in row]
    assert len(failed) == 2 and all("| exp, cap 5 |" in row and "loss" in row for row in failed), out  # liger and cce under the cap
    assert out.rstrip().endswith("2 row(s) missed a tolerance")
