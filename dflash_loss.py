"""The DFlash training objective: per-position loss weights, the weighted cross-entropy through the
target's frozen LM head (fused with its input gradient, in chunks), and the tau estimate from the
per-position accuracy (arXiv 2602.06036).

The fused kernel: the gradient of CE with respect to the logits is known in closed form (softmax -
onehot), so each chunk's logits serve the loss and the input gradient at once and are then dropped:
at most `chunk_size x vocab` logits exist at a time, the head matmul runs twice per chunk instead of
three times (logits, checkpoint recompute, dlogits @ W), and nothing vocab-sized is kept for backward
(the idea of Liger-Kernel's fused linear cross-entropy). `dflash_loss` defines the DFlash loss (which
rows, which weights, the normalisation, the accuracy) and calls `fused_linear_weighted_ce`.

Notation: rows = positions in a chunk, T = valid positions in the micro-batch, vocab = LM head rows,
B = block size, N = anchors per row.
"""

import functools
from collections.abc import Callable

import torch

from dflash_compile import compile_once_locked, running_compiled

# ----------------------------------------------------------------------------------------------
# Position weights


# Decay of the per-position loss weight w_k = exp(-(k - 1) / gamma), by block size: the paper's
# values (arXiv 2602.06036). Other block sizes use `default_loss_gamma`'s fitted line.
DEFAULT_LOSS_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_loss_gamma(block_size: int) -> float:
    """The loss decay gamma for a block size: the paper's value for B = 16, 10, 8, else a fitted line.

    The line is the least-squares fit through the paper's three points (8, 4), (10, 5), (16, 7):
    gamma = (19 * B + 62) / 52, about 0.365 * B + 1.19 (it gives 4.12, 4.85, 7.04 at those points).
    Worked examples: B = 4 -> 2.65, B = 12 -> 5.58, B = 32 -> 12.88. It grows with B, so a longer
    block still weights its later positions, and stays above 1.9 for every B >= 2.

    Args:
        block_size: B, tokens per block (anchor included), >= 2.
    Returns:
        gamma > 0.
    Raises:
        ValueError: if block_size < 2.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (an anchor plus at least one drafted token), got {block_size}")
    return DEFAULT_LOSS_GAMMA.get(block_size, (19 * block_size + 62) / 52)


def loss_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """Per-position loss weights `w_k = exp(-(k - 1) / gamma)` for k = 1..B-1 (arXiv 2602.06036).

    Early positions matter most: a draft is accepted only up to its first miss. Worked example,
    B = 16, gamma = 7: w_1 = 1.0, w_2 = 0.867, w_8 = 0.368, w_15 = 0.135.

    Args:
        gamma: decay; default `default_loss_gamma(block_size)` (7 for B = 16, 5 for B = 10, 4 for
            B = 8, a fitted line elsewhere).
    Returns:
        [B-1] float32.
    Raises:
        ValueError: if block_size < 2 or gamma <= 0.
    """
    if gamma is None:
        gamma = default_loss_gamma(block_size)
    if gamma <= 0:
        raise ValueError(f"--loss_decay_gamma must be > 0, got {gamma}")
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


# ----------------------------------------------------------------------------------------------
# The fused LM head + weighted cross-entropy, chunk by chunk


def weighted_ce_and_grad_chunk(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                                multiplier: float = 1.0, softcap: float | None = None):
    """One chunk of the loss: logits [rows, vocab] -> (sum w*CE fp32, dlogits in the logits dtype,
    hit [rows] bool). Works in place on one fp32 copy of the chunk, so eager mode makes few
    vocab-sized passes.

    The CE is taken on z = `dflash_model.scale_and_cap_logits(logits, multiplier, softcap)`, what the
    engines sample from. dCE/dz = w * (softmax(z) - onehot), and the chain rule back to the raw logits
    multiplies by dz/dlogits = multiplier * (1 - tanh^2) (the tanh factor only with a cap).
    """
    x = logits.float()  # [rows, vocab]
    if multiplier != 1.0:
        x.mul_(multiplier)
    capped = None
    if softcap:
        capped = x.div_(softcap).tanh_()  # tanh(z / c), kept for the chain rule
        x = capped * softcap
    lse = torch.logsumexp(x, dim=-1)  # [rows]
    ce = lse - x.gather(1, targets[:, None]).squeeze(1)
    hit = x.argmax(dim=-1) == targets
    x.sub_(lse[:, None]).exp_().mul_(weights[:, None])  # w * softmax
    x.scatter_add_(1, targets[:, None], -weights[:, None])  # - w * onehot
    if capped is not None:
        x.mul_(1 - capped.square_())
    if multiplier != 1.0:
        x.mul_(multiplier)
    return (ce * weights).sum(), x.to(logits.dtype), hit


def weighted_ce_and_grad_chunk_functional(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                                           multiplier: float = 1.0, softcap: float | None = None):
    """`weighted_ce_and_grad_chunk` without in-place ops, for torch.compile to fuse into a few kernels."""
    x = logits.float() * multiplier  # [rows, vocab]
    if softcap:
        capped = torch.tanh(x / softcap)
        x = capped * softcap
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [rows, 1]
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == targets[:, None]  # fused, never stored
    dz = weights[:, None] * (torch.exp(x - lse) - onehot.float())
    if softcap:
        dz = dz * (1 - capped * capped)
    dlogits = (dz * multiplier).to(logits.dtype)
    ce = lse.squeeze(1) - x.gather(1, targets[:, None]).squeeze(1)
    return (ce * weights).sum(), dlogits, x.argmax(dim=-1) == targets


class _FusedLinearWeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(rows_i @ W^T, t_i) with d/d rows computed in the forward, chunk by chunk.

    The gradient of CE with respect to the logits is known in closed form (softmax - onehot), so
    each chunk's logits are used for the loss and the input gradient at once and then dropped:
    the head matmul runs twice per chunk (logits, dlogits @ W) instead of three times (logits,
    checkpoint recompute, dlogits @ W), and nothing vocab-sized is kept for backward (the idea of
    Liger-Kernel's fused linear cross-entropy). W is the target's frozen head: no weight gradient.
    """

    @staticmethod
    def forward(ctx, rows, weight, targets, row_weights, chunk_size, ce_grad_chunk):
        needs_grad = rows.requires_grad
        grad_rows = torch.empty_like(rows) if needs_grad else None  # [T, hidden]
        hits = torch.empty(targets.shape, dtype=torch.bool, device=rows.device)  # [T]
        total = rows.new_zeros((), dtype=torch.float32)
        for start in range(0, rows.shape[0], chunk_size):
            end = min(start + chunk_size, rows.shape[0])
            logits = rows[start:end] @ weight.t()  # [rows, vocab], bf16 on GPU
            ce_sum, dlogits, hit = ce_grad_chunk(logits, targets[start:end], row_weights[start:end])
            del logits
            if needs_grad:
                grad_rows[start:end] = dlogits @ weight  # [rows, hidden]
            total = total + ce_sum
            hits[start:end] = hit
        ctx.save_for_backward(grad_rows if needs_grad else rows.new_empty(0))
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, grad_hits):
        (grad_rows,) = ctx.saved_tensors
        return grad_rows * grad_total.to(grad_rows.dtype), None, None, None, None, None


def fused_linear_weighted_ce(rows: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, row_weights: torch.Tensor,
                             chunk_size: int, ce_grad_chunk: Callable = weighted_ce_and_grad_chunk, multiplier: float = 1.0,
                             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i w_i * CE_i over the rows, and each row's argmax hit.

    Args:
        rows: [T, hidden], the drafter's hidden states at the valid label positions.
        head_weight: [vocab, hidden], the frozen LM head (no gradient reaches it).
        targets: [T] int64; row_weights: [T] float32.
        chunk_size: rows per chunk.
        ce_grad_chunk: the per-chunk softmax / dlogits / argmax: the eager `weighted_ce_and_grad_chunk`,
            or a compiled `weighted_ce_and_grad_chunk_functional` (GPU training,
            `compiled_ce_grad_chunk`).
        multiplier, softcap: the logit scaling and cap applied before the CE (as the engines apply
            them before sampling).
    Returns:
        (weighted CE sum, scalar float32; backpropagate it once), hits [T] bool.
    """
    if multiplier != 1.0 or softcap:
        ce_grad_chunk = functools.partial(ce_grad_chunk, multiplier=multiplier, softcap=softcap)
    return _FusedLinearWeightedCE.apply(rows, head_weight, targets, row_weights, chunk_size, ce_grad_chunk)


# ----------------------------------------------------------------------------------------------
# The DFlash loss and its metrics


_compiled_ce = None


def compiled_ce_grad_chunk(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                           multiplier: float = 1.0, softcap: float | None = None):
    """`weighted_ce_and_grad_chunk`, torch.compile'd (dynamic shapes: the rows vary per step);
    `dflash_loss(..., compiled=True)` uses it. Compiles under the compile lock
    at the first call (and again for a 1-row chunk, which dynamo specialises). Measured at
    Qwen3-8B shapes on an H200 (bench_dflash.py): 92.4 -> 83.8 ms/sample. Runs outside autograd
    (inside the fused loss's forward), so nothing compiles in a backward thread."""
    global _compiled_ce
    if _compiled_ce is None:
        _compiled_ce = torch.compile(weighted_ce_and_grad_chunk_functional, dynamic=True)
    key = ("ce_grad_chunk", str(logits.device), logits.dtype, logits.shape[0] > 1, logits.shape[1], multiplier, softcap)
    what = f"loss chunk (softmax, dlogits, argmax) on {logits.device}, {logits.dtype}, vocab {logits.shape[1]}"
    compile_once_locked(key, what, lambda: _compiled_ce(logits, targets, weights, multiplier, softcap), logits.device)
    with running_compiled():
        return _compiled_ce(logits, targets, weights, multiplier, softcap)


def dflash_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 4096,
    compiled: bool = False,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    valid_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-weighted cross-entropy through the target's LM head, in chunks (arXiv 2602.06036).

    loss = sum_i w_k(i) * CE_i / sum_i w_k(i) over valid positions i of the micro-batch, never a
    plain mean over padded positions.

    Only valid label positions go through the head (padding and block position 0 never cost a
    vocab-sized matmul), and at most `chunk_size x vocab` logits exist at once instead of
    `N*(B-1) x vocab`. The input gradient is computed in the forward (`fused_linear_weighted_ce`),
    so there is no activation checkpointing, no recompute of the head, and nothing compiled runs
    in autograd's backward threads. Measured on an H200 at Qwen3-8B shapes (BENCHMARKS.md,
    bench_dflash.py): 92.4 vs 98.9 ms/sample and 37.3 vs 38.2 GB against the earlier
    checkpointed form (non-reentrant checkpointing, itself chosen over reentrant: 67.4 vs 68.0 ms
    for the loss alone at 8192 rows, equal memory, and no recompute in autograd's threads).

    Args:
        hidden: [batch, N, B-1, hidden], drafter output at block positions 1..B-1.
        head_weight: [vocab, hidden], the target's LM head weight (frozen).
        labels, label_valid: [batch, N, B-1] from `block_labels`.
        weights: [B-1] float32 from `loss_weights`.
        chunk_size: rows per chunk.
        compiled: run the per-chunk softmax / dlogits / argmax through `compiled_ce_grad_chunk`
            (GPU training) instead of the eager `weighted_ce_and_grad_chunk`.
        output_multiplier, final_logit_softcapping: the drafter config's logit scaling and cap
            (`scale_and_cap_logits`), applied to the head's logits before the CE, as the engines
            apply them before sampling.
        valid_index: [T, 3] int64 on hidden's device, `label_valid.nonzero()` found ahead (the trainer
            finds it on the host); None: found here, which waits for the device once.
    Returns:
        loss: scalar float32 (0 with a graph, if nothing is valid). Backpropagate it once.
        accepted: [B-1] float32; at block position k = 1..B-1, the share of blocks with a label at k
            whose argmax is right at every position 1..k (NaN where no block has a label at k). Entry
            0 is the first position's accuracy; `estimate_acceptance_length` turns it into tau.
    """
    positions = label_valid.shape[-1]
    # One nonzero (one wait for the device, unless found ahead) gives the valid rows; gathering by these
    # indices costs no further wait, where each boolean-mask index would wait once more, and again in its backward.
    b_index, n_index, k_index = (label_valid.nonzero() if valid_index is None else valid_index).unbind(1)  # each [T] int64
    rows = hidden[b_index, n_index, k_index]  # [T, hidden]
    targets = labels[b_index, n_index, k_index]  # [T]
    row_weights = weights.to(rows.device)[k_index]  # [T]
    if rows.shape[0] == 0:
        return hidden.sum() * 0.0, torch.full((positions,), float("nan"), device=hidden.device)
    ce_grad_chunk = compiled_ce_grad_chunk if compiled else weighted_ce_and_grad_chunk
    weighted_ce, hit = fused_linear_weighted_ce(rows, head_weight.detach(), targets, row_weights, chunk_size, ce_grad_chunk,
                                                output_multiplier, final_logit_softcapping)
    loss = weighted_ce / row_weights.sum()
    # A block's draft is accepted up to its first wrong (or unlabelled) position, as verification
    # stops there; counting runs, not per-position accuracies, keeps the errors' correlation.
    correct = torch.zeros_like(label_valid)  # [batch, N, B-1] bool
    correct[b_index, n_index, k_index] = hit
    accepted = (correct.to(torch.int32).cumprod(dim=-1).bool() & label_valid).sum(dim=(0, 1)).float()  # [B-1]
    return loss, accepted / label_valid.sum(dim=(0, 1)).float()


def estimate_acceptance_length(accepted: torch.Tensor) -> float:
    """Acceptance length tau from the training blocks: `1 + sum_k P(draft right at positions 1..k)`.

    The 1 is the target's bonus token. A block is drafted in one pass from its context, as at
    inference, so on the target's own greedy replies this is the tau the drafter reaches on those
    replies at a random anchor (teacher forcing equals greedy verification there); held-out replies
    give less once the drafter fits its training data. Replies sampled from the target also lower
    it: their tokens are not always the ones greedy verification accepts. E.g. accepted
    [0.9, 0.72, 0.36] -> 1 + 0.9 + 0.72 + 0.36 = 2.98.

    Args:
        accepted: [B-1] float from `dflash_loss` (a window's mean), NaN where a position had no
            label (treated as 0).
    """
    return 1.0 + torch.nan_to_num(accepted.float(), nan=0.0).sum().item()
