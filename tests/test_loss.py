"""The loss objectives of dflash_loss.py against plain PyTorch references: D-PACE weights (by hand and by
loops), the distribution losses kl / tv / nla / lk (autograd through full logits on a tiny vocabulary),
both normalisers, chunking, the logit multiplier and cap, and the accuracy output they must not change."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dflash_loss import block_target_hidden, dpace_weights, loss_weights, weighted_block_loss
from dflash_loss_kernels import (
    LOSSES,
    NLA_EPS,
    fused_linear_row_loss,
    fused_linear_weighted_ce,
    row_loss_and_grad_chunk,
    row_loss_and_grad_chunk_functional,
)
from dflash_model import scale_and_cap_logits

VOCAB, HIDDEN = 40, 8


def random_inputs(seed=0):
    """hidden and target_hidden [2, 3, 5, 8] (batch, anchors, B - 1, hidden; hidden requires grad), head
    [40, 8], labels [2, 3, 5], valid [2, 3, 5] (about 70% True, holes inside blocks too), exp weights of
    block size 6. Logits of spread ~3 so that p and q overlap partly."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 3, 5, HIDDEN, generator=g).requires_grad_(True)
    target_hidden = torch.randn(2, 3, 5, HIDDEN, generator=g)
    head = torch.randn(VOCAB, HIDDEN, generator=g) / 2
    labels = torch.randint(0, VOCAB, (2, 3, 5), generator=g)
    valid = torch.rand(2, 3, 5, generator=g) > 0.3
    return hidden, target_hidden, head, labels, valid, loss_weights(6, gamma=2.0)


def reference_row_losses(z, u, labels, loss, lk_eta=3.0):
    """Per-position loss [..] and detached confidence from full logits z (drafter) and u (target), by
    the textbook formulas (TV as half the L1 distance, KL through F.kl_div)."""
    log_q, log_p = torch.log_softmax(z, -1), torch.log_softmax(u, -1)
    q, p = log_q.exp(), log_p.exp()
    overlap = torch.minimum(p, q).sum(-1)
    ce = F.cross_entropy(z.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # sum p (log p - log q)
    tv = 0.5 * (p - q).abs().sum(-1)
    if loss == "ce":
        return ce, torch.exp(-ce).detach()
    lam = torch.exp(-lk_eta * overlap.detach())
    per_position = {"kl": kl, "tv": tv, "nla": -torch.log(overlap + NLA_EPS), "lk": lam * kl + (1 - lam) * tv}[loss]
    return per_position, overlap.detach()


def reference_dpace(confidence, valid, alpha):
    """D-PACE by loops over blocks, straight from the definition."""
    weights = torch.zeros_like(confidence)
    for b in range(valid.shape[0]):
        for n in range(valid.shape[1]):
            s = [(1 - alpha) * confidence[b, n, i].item() + alpha if valid[b, n, i] else 1.0 for i in range(valid.shape[2])]
            for k in range(valid.shape[2]):
                if valid[b, n, k]:
                    weights[b, n, k] = sum(math.prod(s[: j + 1]) for j in range(k, valid.shape[2]) if valid[b, n, j])
    return weights


def reference_loss(
    hidden, target_hidden, head, labels, valid, weights, loss, weighting="exp", alpha=0.5, normalize="weights", multiplier=1.0, cap=None, lk_eta=3.0
):
    z = scale_and_cap_logits(hidden @ head.t(), multiplier, cap)  # [2, 3, 5, vocab], all positions
    u = scale_and_cap_logits(target_hidden @ head.t(), multiplier, cap)
    per_position, confidence = reference_row_losses(z, u, labels, loss, lk_eta)
    w = reference_dpace(confidence, valid, alpha) if weighting == "dpace" else weights.expand_as(labels) * valid
    total = (per_position * w)[valid].sum()
    return total / (w[valid].sum() if normalize == "weights" else valid.sum())


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("multiplier, cap", [(1.0, None), (0.5, 4.0)])
@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_each_loss_and_its_gradient_equal_autograd_through_full_logits(loss, multiplier, cap, chunk_size):
    hidden, target_hidden, head, labels, valid, weights = random_inputs()
    value, _ = weighted_block_loss(
        hidden,
        head,
        labels,
        valid,
        weights,
        chunk_size=chunk_size,
        output_multiplier=multiplier,
        final_logit_softcapping=cap,
        loss=loss,
        target_hidden=target_hidden,
    )
    (grad,) = torch.autograd.grad(value, hidden)
    expected = reference_loss(hidden, target_hidden, head, labels, valid, weights, loss, multiplier=multiplier, cap=cap)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert (grad[~valid] == 0).all()


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("normalize", ["weights", "count"])
def test_dpace_weighting_and_both_normalisers_equal_the_reference(loss, normalize):
    """D-PACE weights from every row's confidence, with 3-row chunks that split blocks across chunks."""
    hidden, target_hidden, head, labels, valid, weights = random_inputs(seed=1)
    value, _ = weighted_block_loss(
        hidden,
        head,
        labels,
        valid,
        None,
        chunk_size=3,
        loss=loss,
        target_hidden=target_hidden,
        loss_weighting="dpace",
        dpace_alpha=0.3,
        normalize=normalize,
        final_logit_softcapping=5.0,
    )
    (grad,) = torch.autograd.grad(value, hidden)
    expected = reference_loss(hidden, target_hidden, head, labels, valid, weights, loss, "dpace", 0.3, normalize, cap=5.0)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_dpace_weights_hand_computed():
    # The docstring's example, B - 1 = 3, alpha = 0.5, c = [0.8, 0.4, 0.6]: s = [0.9, 0.7, 0.8],
    # prefix products [0.9, 0.63, 0.504], W = [2.034, 1.134, 0.504]. Position 2 masked (counts as 1
    # inside the product): s = [0.9, 1, 0.8], prefix [0.9, 0.9, 0.72], W = [1.62, 0, 0.72].
    c = torch.tensor([[[0.8, 0.4, 0.6], [0.8, 0.4, 0.6]]])
    valid = torch.tensor([[[True, True, True], [True, False, True]]])
    torch.testing.assert_close(dpace_weights(c, valid), torch.tensor([[[2.034, 1.134, 0.504], [1.62, 0.0, 0.72]]]))
    # alpha = 1: the count of valid positions at or after k; alpha = 0, c = 1/2: W = [7/8, 3/8, 1/8].
    assert dpace_weights(c, valid, alpha=1.0).tolist() == [[[3.0, 2.0, 1.0], [2.0, 0.0, 1.0]]]
    assert dpace_weights(torch.full((1, 1, 3), 0.5), torch.ones(1, 1, 3, dtype=torch.bool), alpha=0.0).tolist() == [[[0.875, 0.375, 0.125]]]
    with pytest.raises(ValueError, match="--dpace_alpha"):
        dpace_weights(c, valid, alpha=1.5)


def test_dpace_ce_loss_and_gradient_hand_computed():
    # One block, B - 1 = 2, head = identity (logits = hidden), alpha = 0.5.
    # Position 1: logits [log 3, 0], label 0: q = [3/4, 1/4], CE = log(4/3), c = 3/4, s = 7/8.
    # Position 2: logits [0, 0], label 1: q = [1/2, 1/2], CE = log 2, c = 1/2, s = 3/4.
    # Prefix products 7/8, 21/32; W = [7/8 + 21/32, 21/32] = [49/32, 21/32], sum 70/32.
    # Loss = (49/32 log(4/3) + 21/32 log 2) / (70/32) = 0.7 log(4/3) + 0.3 log 2 = 0.409321 (weights),
    # (49/32 log(4/3) + 21/32 log 2) / 2 = 0.447696 (count).
    # Gradient = (W / sum W) (q - onehot): row 1 0.7 [-1/4, 1/4], row 2 0.3 [1/2, -1/2].
    hidden = torch.tensor([[[[math.log(3.0), 0.0], [0.0, 0.0]]]], requires_grad=True)  # [1, 1, 2, 2]
    labels = torch.tensor([[[0, 1]]])
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    value, accepted = weighted_block_loss(hidden, torch.eye(2), labels, valid, None, loss_weighting="dpace")
    assert abs(value.item() - 0.409321) < 1e-6
    (grad,) = torch.autograd.grad(value, hidden)
    torch.testing.assert_close(grad, torch.tensor([[[[-0.175, 0.175], [0.15, -0.15]]]]), rtol=0, atol=1e-6)
    count, _ = weighted_block_loss(hidden, torch.eye(2), labels, valid, None, loss_weighting="dpace", normalize="count")
    assert abs(count.item() - 0.447696) < 1e-6
    # argmax [log 3, 0] -> 0 = label; [0, 0] -> 0 (first max) != label 1.
    assert accepted.tolist() == [1.0, 0.0]


def test_normalisers_of_fixed_weights():
    """count divides the same weighted sum by the number of valid positions instead of the sum of weights."""
    hidden, target_hidden, head, labels, valid, weights = random_inputs()
    for loss in ("ce", "kl"):
        by_weights, _ = weighted_block_loss(hidden, head, labels, valid, weights, loss=loss, target_hidden=target_hidden)
        by_count, _ = weighted_block_loss(hidden, head, labels, valid, weights, loss=loss, target_hidden=target_hidden, normalize="count")
        total_weight = weights.expand_as(labels)[valid].sum()
        torch.testing.assert_close(by_count * valid.sum(), by_weights * total_weight, rtol=1e-6, atol=1e-6)


def test_accuracy_output_is_the_same_for_every_loss_and_weighting():
    hidden, target_hidden, head, labels, valid, weights = random_inputs()
    _, accepted = weighted_block_loss(hidden, head, labels, valid, weights)
    for loss in LOSSES:
        for weighting in ("exp", "dpace"):
            _, other = weighted_block_loss(
                hidden, head, labels, valid, weights, chunk_size=4, loss=loss, target_hidden=target_hidden, loss_weighting=weighting
            )
            assert torch.equal(torch.nan_to_num(other, nan=-1.0), torch.nan_to_num(accepted, nan=-1.0)), (loss, weighting)


def test_per_row_ce_equals_the_weighted_ce_kernel():
    """The per-row kernel with CE, weighted afterwards, equals the kernel that weights inside its chunks."""
    hidden, _, head, labels, valid, weights = random_inputs()
    rows = hidden[valid]  # [T, hidden]
    targets, row_weights = labels[valid], weights.expand_as(labels)[valid]
    weighted, hits = fused_linear_weighted_ce(rows, head, targets, row_weights, chunk_size=4)
    (grad,) = torch.autograd.grad(weighted, hidden)
    row_loss, confidence, row_hits = fused_linear_row_loss(hidden[valid], head, targets, None, chunk_size=5)
    (row_grad,) = torch.autograd.grad((row_weights * row_loss).sum(), hidden)
    torch.testing.assert_close((row_weights * row_loss).sum(), weighted, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row_grad, grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(confidence, torch.exp(-row_loss.detach()))
    assert torch.equal(row_hits, hits)


def test_with_a_one_hot_target_kl_and_nla_are_ce_and_the_confidences_agree():
    """p one-hot at the label: KL(p || q) = CE, A = q_label = exp(-CE), so nla = CE (up to eps) and D-PACE
    weights, hence the D-PACE losses, are the same for ce, kl and nla."""
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 8, (1, 4, 3), generator=g)
    valid = torch.ones(1, 4, 3, dtype=torch.bool)
    valid[0, 1, 1] = False
    hidden = torch.randn(1, 4, 3, 8, generator=g)
    target_hidden = 200.0 * F.one_hot(labels, 8).float()  # logits through the identity head: p[label] = 1 in fp32
    values = {
        loss: weighted_block_loss(hidden, torch.eye(8), labels, valid, None, loss=loss, target_hidden=target_hidden, loss_weighting="dpace")[0]
        for loss in ("ce", "kl", "nla")
    }
    torch.testing.assert_close(values["kl"], values["ce"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values["nla"], values["ce"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss", LOSSES)
def test_functional_chunk_equals_eager_chunk(loss):
    """The function that weighted_block_loss(compiled=True) compiles computes what the eager chunk does (checked eagerly here)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(9, VOCAB, generator=g)).bfloat16()
    target_logits = None if loss == "ce" else (3 * torch.randn(9, VOCAB, generator=g)).bfloat16()
    targets = torch.randint(0, VOCAB, (9,), generator=g)
    eager = row_loss_and_grad_chunk(logits.clone(), targets, None if target_logits is None else target_logits.clone(), loss, 0.5, 4.0)
    functional = row_loss_and_grad_chunk_functional(logits, targets, target_logits, loss, 0.5, 4.0)
    for a, b in zip(eager, functional):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_distribution_losses_run_one_more_head_matmul_than_ce():
    """kl: drafter logits, target logits, dlogits @ W per chunk (3 head matmuls); ce: 2. Nothing recomputed in backward."""
    hidden, target_hidden, head, labels, valid, weights = random_inputs()
    head_flops = 2 * int(valid.sum()) * HIDDEN * VOCAB
    for loss, matmuls in (("ce", 2), ("kl", 3)):
        with FlopCounterMode(display=False) as counter:
            value, _ = weighted_block_loss(hidden, head, labels, valid, weights, chunk_size=4, loss=loss, target_hidden=target_hidden)
            value.backward()
        assert counter.get_total_flops() == matmuls * head_flops, loss


def test_block_target_hidden_takes_the_position_before_each_label():
    target_hidden = torch.arange(2 * 10, dtype=torch.float32).view(2, 10, 1)  # value = 10 * row + position
    anchors = torch.tensor([[0, 7], [3, 8]])
    gathered = block_target_hidden(target_hidden, anchors, block_size=4)  # [2, 2, 3, 1]
    # Labels of anchor a sit at a + 1..a + 3; the target predicts them from a..a + 2 (clamped to 9).
    assert gathered[..., 0].tolist() == [[[0, 1, 2], [7, 8, 9]], [[13, 14, 15], [18, 19, 19]]]


def test_bad_settings_raise_value_errors_that_name_them():
    hidden, target_hidden, head, labels, valid, weights = random_inputs()
    with pytest.raises(ValueError, match="--loss must be one of ce, kl, tv, nla, lk"):
        weighted_block_loss(hidden, head, labels, valid, weights, loss="js")
    with pytest.raises(ValueError, match="--loss kl .* needs the target's last hidden state"):
        weighted_block_loss(hidden, head, labels, valid, weights, loss="kl")
    with pytest.raises(ValueError, match="target_hidden must be laid out like hidden"):
        weighted_block_loss(hidden, head, labels, valid, weights, loss="tv", target_hidden=target_hidden[:, :2])
    with pytest.raises(ValueError, match="--loss_weighting exp needs the per-position weights"):
        weighted_block_loss(hidden, head, labels, valid, None)
    with pytest.raises(ValueError, match="--loss_weighting must be one of"):
        weighted_block_loss(hidden, head, labels, valid, weights, loss_weighting="linear")
    with pytest.raises(ValueError, match="--loss_normalize must be one of"):
        weighted_block_loss(hidden, head, labels, valid, weights, normalize="mean")
    with pytest.raises(ValueError, match="--dpace_alpha"):
        weighted_block_loss(hidden, head, labels, valid, None, loss_weighting="dpace", dpace_alpha=-0.1)
    with pytest.raises(ValueError, match="--lk_eta"):
        weighted_block_loss(hidden, head, labels, valid, weights, loss="lk", target_hidden=target_hidden, lk_eta=-1.0)
