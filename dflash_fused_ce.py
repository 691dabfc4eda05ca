"""Fused linear + weighted cross-entropy: sum_i w_i * CE(rows_i @ W^T, t_i) through a frozen LM head, in
chunks, with the input gradient computed in the forward.

The gradient of CE with respect to the logits is known in closed form (softmax - onehot), so each
chunk's logits serve the loss and the input gradient at once and are then dropped: at most
`chunk_size x vocab` logits exist at a time, the head matmul runs twice per chunk instead of three
times (logits, checkpoint recompute, dlogits @ W), and nothing vocab-sized is kept for backward (the
idea of Liger-Kernel's fused linear cross-entropy). `dflash_model.dflash_loss` defines the DFlash
loss (which rows, which weights, the normalisation, the accuracy) and calls `fused_linear_weighted_ce`.

Notation: rows = positions in a chunk, T = valid positions in the micro-batch, vocab = LM head rows.
"""

import functools
from collections.abc import Callable

import torch

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
            `dflash_model.compiled_ce_grad_chunk`).
        multiplier, softcap: the logit scaling and cap applied before the CE (as the engines apply
            them before sampling).
    Returns:
        (weighted CE sum, scalar float32; backpropagate it once), hits [T] bool.
    """
    if multiplier != 1.0 or softcap:
        ce_grad_chunk = functools.partial(ce_grad_chunk, multiplier=multiplier, softcap=softcap)
    return _FusedLinearWeightedCE.apply(rows, head_weight, targets, row_weights, chunk_size, ce_grad_chunk)
