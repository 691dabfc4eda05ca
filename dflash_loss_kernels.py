"""The LM head and the loss, chunk by chunk: the kernels under the DFlash objective (dflash_loss.py).

The fused kernel: the gradient of CE with respect to the logits is known in closed form (softmax -
onehot), so each chunk's logits serve the loss and the input gradient at once and are then dropped:
at most `chunk_size x vocab` logits exist at a time, the head matmul runs twice per chunk instead of
three times (logits, checkpoint recompute, dlogits @ W), and nothing vocab-sized is kept for backward
(the idea of Liger-Kernel's fused linear cross-entropy). `fused_linear_weighted_ce` runs the CE with
fixed per-row weights; `fused_linear_row_loss` returns each row's loss (`LOSSES`: the CE, or a loss
against the target's whole distribution p) and keeps each row's unweighted input gradient, for
weights known only after every row (D-PACE; `dflash_loss.weighted_block_loss` applies them). The
per-chunk elementwise work compiles for GPU training (`compiled_ce_grad_chunk`, `compiled_row_loss_chunk`).
`fused_linear_dspark_loss` does the same for DSpark's CE and L1, whose logits add the Markov head's term
(`dflash_loss.chunked_dspark_loss`; compiled: `compiled_dspark_chunk`).

--fused_loss (`FUSED_LOSSES`) runs the head and the CE through Liger Kernel or Cut Cross-Entropy
instead (`library_linear_ce`, CUDA only); the kernels here stay the reference they are checked against
(tools/gpu/fused_loss_check.py).

Notation: rows = positions in a chunk, T = valid positions in the micro-batch, vocab = LM head rows,
p = the target's distribution, q = the drafter's.
"""

import functools
import importlib
from collections.abc import Callable

import torch

from dflash_compile import compile_once_locked, running_compiled

# ----------------------------------------------------------------------------------------------
# The fused LM head + weighted cross-entropy, chunk by chunk


def _scaled_and_capped(logits: torch.Tensor, multiplier: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z = `dflash_model.scale_and_cap_logits(logits, multiplier, softcap)` on one fp32 copy of the
    chunk, in place: (z [rows, vocab] float32, tanh(logits * multiplier / softcap), kept for the
    chain rule, or None without a cap)."""
    x = logits.float()
    if multiplier != 1.0:
        x.mul_(multiplier)
    if not softcap:
        return x, None
    capped = x.div_(softcap).tanh_()
    return capped * softcap, capped


def weighted_ce_and_grad_chunk(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None
):
    """One chunk of the loss: logits [rows, vocab] -> (sum w*CE fp32, dlogits in the logits dtype,
    hit [rows] bool). Works in place on one fp32 copy of the chunk, so eager mode makes few
    vocab-sized passes.

    The CE is taken on z = `dflash_model.scale_and_cap_logits(logits, multiplier, softcap)`, what the
    engines sample from. dCE/dz = w * (softmax(z) - onehot), and the chain rule back to the raw logits
    multiplies by dz/dlogits = multiplier * (1 - tanh^2) (the tanh factor only with a cap).
    """
    x, capped = _scaled_and_capped(logits, multiplier, softcap)  # z [rows, vocab] fp32, tanh(z / c) or None
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


def weighted_ce_and_grad_chunk_functional(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None
):
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
    def forward(ctx, rows, weight, targets, row_weights, chunk_size, ce_grad_chunk, top_k):
        needs_grad = rows.requires_grad
        grad_rows = torch.empty_like(rows) if needs_grad else None  # [T, hidden]
        hits = torch.empty(targets.shape, dtype=torch.bool, device=rows.device)  # [T]
        top_ids = torch.empty(rows.shape[0], top_k, dtype=torch.long, device=rows.device)  # [T, K]
        total = rows.new_zeros((), dtype=torch.float32)
        for start in range(0, rows.shape[0], chunk_size):
            end = min(start + chunk_size, rows.shape[0])
            logits = rows[start:end] @ weight.t()  # [rows, vocab], bf16 on GPU
            if top_k:  # before the chunk function, which may overwrite fp32 logits in place
                top_ids[start:end] = logits.topk(top_k, dim=-1).indices
            ce_sum, dlogits, hit = ce_grad_chunk(logits, targets[start:end], row_weights[start:end])
            del logits
            if needs_grad:
                grad_rows[start:end] = dlogits @ weight  # [rows, hidden]
            total = total + ce_sum
            hits[start:end] = hit
        ctx.save_for_backward(grad_rows if needs_grad else rows.new_empty(0))
        ctx.mark_non_differentiable(hits, top_ids)
        return total, hits, top_ids

    @staticmethod
    def backward(ctx, grad_total, grad_hits, grad_top_ids):
        (grad_rows,) = ctx.saved_tensors
        return grad_rows * grad_total.to(grad_rows.dtype), None, None, None, None, None, None


def fused_linear_weighted_ce(
    rows: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_size: int,
    ce_grad_chunk: Callable = weighted_ce_and_grad_chunk,
    multiplier: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """sum_i w_i * CE_i over the rows, and each row's argmax hit (and its top-K ids, from the same logits).

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
        top_k: K > 0 also returns the ids of each row's K largest raw logits (`top_k_candidates`'
            result, taken from the chunk's logits instead of a second pass through the head).
    Returns:
        (weighted CE sum, scalar float32; backpropagate it once), hits [T] bool, and with top_k > 0
        top_ids [T, K] int64, most likely first.
    """
    if multiplier != 1.0 or softcap:
        ce_grad_chunk = functools.partial(ce_grad_chunk, multiplier=multiplier, softcap=softcap)
    total, hits, top_ids = _FusedLinearWeightedCE.apply(rows, head_weight, targets, row_weights, chunk_size, ce_grad_chunk, top_k)
    return (total, hits, top_ids) if top_k else (total, hits)


# ----------------------------------------------------------------------------------------------
# Per-row losses through the same head, against the labels (ce) or the target's distribution


# ce: cross-entropy with the label (the paper's loss). The others compare the drafter's q with the
# target's p over the whole vocabulary (docs/training.md, "The objective"): kl = forward KL(p || q); tv = total
# variation 1 - sum_v min(p_v, q_v) (equal to 1/2 sum_v |p_v - q_v| for two distributions), i.e. one
# minus the probability that verification at T = 1 accepts a token sampled from q; nla = the negative
# log of that acceptance probability; lk = the LK hybrid lam * kl + (1 - lam) * tv with
# lam = exp(-eta * sg[acceptance]): KL's strong gradient while the overlap is small, TV's direct
# target once it grows (Samarin et al., "LK Losses", arXiv 2602.23881).
LOSSES = ("ce", "kl", "tv", "nla", "lk")
# eta of the LK hybrid: speculators' default, which it gives as the LK paper's best hybrid setting.
# lam = exp(-3 A) is 1 at acceptance A = 0, 0.22 at A = 0.5 and 0.067 at A = 0.9.
DEFAULT_LK_ETA = 3.0
# nla = -log(A + NLA_EPS): finite where the supports of p and q do not overlap in fp32, and far below
# the overlap of a uniform drafter with a one-hot target (1 / vocab = 6.6e-6 for Qwen3), so the
# cold-start gradient q * (...) / (A + eps) is nearly that of -log A. A clamp would zero it instead.
NLA_EPS = 1e-8


def row_loss_and_grad_chunk(
    logits: torch.Tensor,
    targets: torch.Tensor,
    target_logits: torch.Tensor | None,
    loss: str = "ce",
    multiplier: float = 1.0,
    softcap: float | None = None,
    lk_eta: float = DEFAULT_LK_ETA,
):
    """One chunk of a per-row loss with its closed-form gradient with respect to the logits, unweighted
    (the caller weights the rows once every row's confidence is known). Works in place on fp32 copies.

    z = the scaled, capped logits (`dflash_model.scale_and_cap_logits`), q = softmax(z); for the
    distribution losses p = softmax of the target's logits under the same multiplier and cap. With the
    acceptance probability A = sum_v min(p_v, q_v), below_v = [q_v < p_v] (where min takes q) and
    A_below = sum_v below_v q_v, so that dA/dz_v = q_v (below_v - A_below):
        loss  per row                              d loss / dz                          confidence
        ce    -log q_t                             q - onehot(t)                        q_t = exp(-CE)
        kl    sum_v p_v (log p_v - log q_v)        q - p                                A
        tv    1 - A                                q * (A_below - below)                A
        nla   -log(A + NLA_EPS)                    q * (A_below - below) / (A + eps)    A
        lk    lam kl + (1 - lam) tv, lam = exp(-eta sg[A])   lam (q - p) + (1 - lam) dtv/dz   A
    At an exact tie q_v = p_v, min takes p_v (below_v = 0) where autograd's torch.minimum would split
    the gradient; ties occur in practice only where both underflow to 0 in fp32, and there q_v = 0.
    The chain rule back to the raw logits multiplies by multiplier * (1 - tanh^2) (tanh with a cap).

    The confidence is what D-PACE smooths (`dpace_weights`): for CE the probability of the label, for
    the distribution losses the probability that the target accepts the drafted token at T = 1. The two
    agree when p is one-hot at the label (A = min(1, q_t) = q_t), and A = exp(-nla) (up to NLA_EPS).

    Args:
        logits: [rows, vocab], the drafter's logits (bf16 on GPU).
        targets: [rows] int64 labels (CE, and the argmax hit for every loss).
        target_logits: [rows, vocab], the target's logits at the position before each label; None for ce.
        loss: one of `LOSSES`.
    Returns:
        (loss [rows] float32, confidence [rows] float32, dlogits [rows, vocab] in the logits dtype, hit [rows] bool).
    """
    x, capped = _scaled_and_capped(logits, multiplier, softcap)  # z [rows, vocab] fp32, tanh(z / c) or None
    hit = x.argmax(dim=-1) == targets
    x.sub_(torch.logsumexp(x, dim=-1, keepdim=True))  # log q
    if loss == "ce":
        row_loss = -x.gather(1, targets[:, None]).squeeze(1)
        confidence = torch.exp(-row_loss)
        x.exp_().scatter_add_(1, targets[:, None], torch.full_like(row_loss[:, None], -1.0))  # q - onehot
    else:
        y = target_logits.float()  # [rows, vocab]
        if multiplier != 1.0:
            y.mul_(multiplier)
        if softcap:
            y.div_(softcap).tanh_().mul_(softcap)
        y.sub_(torch.logsumexp(y, dim=-1, keepdim=True))  # log p
        kl = None
        if loss in ("kl", "lk"):
            log_ratio = y - x  # log p - log q
            kl = log_ratio.mul_(y.exp_()).sum(dim=-1)  # y is p from here on
            del log_ratio
        else:
            y.exp_()
        x.exp_()  # q
        overlap = torch.minimum(x, y).sum(dim=-1)  # A [rows]
        below = x < y  # [rows, vocab] bool
        overlap_below = torch.where(below, x, 0.0).sum(dim=-1, keepdim=True)  # A_below [rows, 1]
        confidence = overlap
        if loss == "kl":
            row_loss = kl
            x.sub_(y)
        elif loss == "tv":
            row_loss = 1.0 - overlap
            x.mul_(torch.where(below, overlap_below - 1.0, overlap_below))
        elif loss == "nla":
            row_loss = -torch.log(overlap + NLA_EPS)
            x.mul_(torch.where(below, overlap_below - 1.0, overlap_below)).div_((overlap + NLA_EPS)[:, None])
        elif loss == "lk":
            lam = torch.exp(-lk_eta * overlap)[:, None]  # [rows, 1], a constant for autograd (sg)
            row_loss = lam[:, 0] * kl + (1.0 - lam[:, 0]) * (1.0 - overlap)
            # lam (q - p) + (1 - lam) q (A_below - below) = q (lam + (1 - lam)(A_below - below)) - lam p
            x.mul_(torch.where(below, overlap_below - 1.0, overlap_below).mul_(1.0 - lam).add_(lam))
            x.sub_(y.mul_(lam))
        else:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if capped is not None:
        x.mul_(1 - capped.square_())
    if multiplier != 1.0:
        x.mul_(multiplier)
    return row_loss, confidence, x.to(logits.dtype), hit


def row_loss_and_grad_chunk_functional(
    logits: torch.Tensor,
    targets: torch.Tensor,
    target_logits: torch.Tensor | None,
    loss: str = "ce",
    multiplier: float = 1.0,
    softcap: float | None = None,
    lk_eta: float = DEFAULT_LK_ETA,
):
    """`row_loss_and_grad_chunk` without in-place ops, for torch.compile to fuse into a few kernels."""
    z = logits.float() * multiplier  # [rows, vocab]
    capped = None
    if softcap:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    log_q = torch.log_softmax(z, dim=-1)
    q = torch.exp(log_q)
    hit = z.argmax(dim=-1) == targets
    if loss == "ce":
        onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]  # fused, never stored
        row_loss = -log_q.gather(1, targets[:, None]).squeeze(1)
        confidence = torch.exp(-row_loss)
        dz = q - onehot.float()
    else:
        u = target_logits.float() * multiplier
        if softcap:
            u = torch.tanh(u / softcap) * softcap
        log_p = torch.log_softmax(u, dim=-1)
        p = torch.exp(log_p)
        overlap = torch.minimum(p, q).sum(dim=-1)  # [rows]
        below = q < p
        dtv = q * (torch.where(below, q, 0.0).sum(dim=-1, keepdim=True) - below.float())
        confidence = overlap
        if loss == "tv":
            row_loss, dz = 1.0 - overlap, dtv
        elif loss == "nla":
            row_loss, dz = -torch.log(overlap + NLA_EPS), dtv / (overlap + NLA_EPS)[:, None]
        elif loss in ("kl", "lk"):
            kl = (p * (log_p - log_q)).sum(dim=-1)
            row_loss, dz = kl, q - p
            if loss == "lk":
                lam = torch.exp(-lk_eta * overlap)
                row_loss = lam * kl + (1.0 - lam) * (1.0 - overlap)
                dz = lam[:, None] * dz + (1.0 - lam[:, None]) * dtv
        else:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if capped is not None:
        dz = dz * (1 - capped * capped)
    return row_loss, confidence, (dz * multiplier).to(logits.dtype), hit


class _FusedLinearRowLoss(torch.autograd.Function):
    """Per-row losses l_i of rows_i @ W^T (against labels, or the target rows' logits under the same W),
    with each row's gradient d l_i / d rows_i computed in the forward, chunk by chunk, and kept.

    Backward scales row i's kept gradient by the incoming d total / d l_i: whatever weights the caller
    puts on the rows afterwards (fixed, or D-PACE weights found from every row's confidence), the input
    gradient is exact, and no vocab-sized pass runs twice. W is the target's frozen head: no weight gradient.
    """

    @staticmethod
    def forward(ctx, rows, weight, targets, target_rows, chunk_size, row_grad_chunk, top_k):
        needs_grad = rows.requires_grad
        grad_rows = torch.empty_like(rows) if needs_grad else None  # [T, hidden], unweighted
        row_loss = torch.empty(targets.shape, dtype=torch.float32, device=rows.device)  # [T]
        confidence = torch.empty_like(row_loss)  # [T]
        hits = torch.empty(targets.shape, dtype=torch.bool, device=rows.device)  # [T]
        top_ids = torch.empty(rows.shape[0], top_k, dtype=torch.long, device=rows.device)  # [T, K]
        for start in range(0, rows.shape[0], chunk_size):
            end = min(start + chunk_size, rows.shape[0])
            logits = rows[start:end] @ weight.t()  # [rows, vocab]
            if top_k:  # before the chunk function, which may overwrite fp32 logits in place
                top_ids[start:end] = logits.topk(top_k, dim=-1).indices
            target_logits = None if target_rows is None else target_rows[start:end] @ weight.t()  # [rows, vocab]
            loss_c, confidence_c, dlogits, hit = row_grad_chunk(logits, targets[start:end], target_logits)
            del logits, target_logits
            if needs_grad:
                grad_rows[start:end] = dlogits @ weight  # [rows, hidden]
            row_loss[start:end], confidence[start:end], hits[start:end] = loss_c, confidence_c, hit
        ctx.save_for_backward(grad_rows if needs_grad else rows.new_empty(0))
        ctx.mark_non_differentiable(confidence, hits, top_ids)
        return row_loss, confidence, hits, top_ids

    @staticmethod
    def backward(ctx, grad_row_loss, grad_confidence, grad_hits, grad_top_ids):
        (grad_rows,) = ctx.saved_tensors
        # The per-row scale in fp32: a bf16 weight would be off by up to 0.4%, row by row.
        return (grad_rows.float() * grad_row_loss[:, None]).to(grad_rows.dtype), None, None, None, None, None, None


def fused_linear_row_loss(
    rows: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    target_rows: torch.Tensor | None,
    chunk_size: int,
    loss: str = "ce",
    row_grad_chunk: Callable = row_loss_and_grad_chunk,
    multiplier: float = 1.0,
    softcap: float | None = None,
    lk_eta: float = DEFAULT_LK_ETA,
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Each row's loss through the frozen head, its confidence and its argmax hit, in chunks: at most
    `chunk_size x vocab` logits of the drafter (and as many of the target) exist at a time.

    Args:
        rows: [T, hidden], the drafter's hidden states at the valid label positions.
        head_weight: [vocab, hidden], the frozen LM head (no gradient reaches it).
        targets: [T] int64 labels.
        target_rows: [T, hidden], the target's last hidden state at the position before each label
            (`block_target_hidden`), detached; None for ce.
        chunk_size: rows per chunk.
        loss: one of `LOSSES`.
        row_grad_chunk: `row_loss_and_grad_chunk`, or a compiled `row_loss_and_grad_chunk_functional`
            (`compiled_row_loss_chunk`).
        multiplier, softcap: the logit scaling and cap, applied to both the drafter's and the target's logits.
        lk_eta: eta of the LK hybrid.
        top_k: K > 0 also returns each row's top-K ids from the same logits (as `fused_linear_weighted_ce`).
    Returns:
        loss [T] float32 (differentiable: weight it, sum it, backpropagate once), confidence [T] float32,
        hits [T] bool, and with top_k > 0 top_ids [T, K] int64, most likely first.
    """
    row_grad_chunk = functools.partial(row_grad_chunk, loss=loss, multiplier=multiplier, softcap=softcap, lk_eta=lk_eta)
    row_loss, confidence, hits, top_ids = _FusedLinearRowLoss.apply(rows, head_weight, targets, target_rows, chunk_size, row_grad_chunk, top_k)
    return (row_loss, confidence, hits, top_ids) if top_k else (row_loss, confidence, hits)


# ----------------------------------------------------------------------------------------------
# DSpark's CE and L1 through the same head, with the Markov term


def dspark_terms_and_grad_chunk(
    logits: torch.Tensor,
    markov_logits: torch.Tensor | None,
    target_logits: torch.Tensor | None,
    targets: torch.Tensor,
    ce_coef: torch.Tensor,
    l1_coef: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
):
    """One chunk of DSpark's CE and L1 (`dflash_loss.dspark_loss`) with their closed-form gradients with
    respect to the head's logits and the Markov term: the elementwise work between the chunk's matmuls.
    Works in place on fp32 copies, so eager mode makes few vocab-sized passes.

    z = cap(logits) + markov_logits (cap = `dflash_model.scale_and_cap_logits`), q = softmax(z),
    p = softmax(cap(target_logits)), t = the label; per row CE = -log q_t, L1 = sum_v |q_v - p_v|,
        d(a CE + b L1) / dz = a (q - onehot(t)) + b q (s - sum_v s_v q_v),   s = sign(q - p),
    the second term the softmax's Jacobian applied to dL1/dq = s, with sign(0) = 0 as autograd's abs takes it.
    The Markov term enters z as it is, so its gradient is dz; the head's logits get dz times
    dcap/dlogits = multiplier * (1 - tanh^2) (the tanh factor only with a cap).

    Args:
        logits: [rows, V], the head's raw logits (bf16 on GPU).
        markov_logits: [rows, V], the Markov term W2(W1[prev]) (the head's dtype); None without a Markov head.
        target_logits: [rows, V], the target's raw logits through the same head; None: no L1.
        targets: [rows] int64.
        ce_coef, l1_coef: [rows] float32, a and b: each row's weight on its CE and its L1 in the loss.
        multiplier, softcap: the logit scaling and cap, on the head's logits, the drafter's and the target's.
    Returns:
        ce [rows] float32, l1 [rows] float32 (None without target_logits), hit [rows] bool (argmax == label),
        dmarkov [rows, V] in markov_logits' dtype (None without them), dlogits [rows, V] in the logits' dtype.
    """
    z, capped = _scaled_and_capped(logits, multiplier, softcap)  # [rows, V] fp32, tanh(logits * m / c) or None
    if markov_logits is not None:
        z.add_(markov_logits)
    hit = z.argmax(dim=-1) == targets
    log_q = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # [rows, V]
    ce = -log_q.gather(1, targets[:, None]).squeeze(1)
    q = log_q.exp_()
    dz = q * ce_coef[:, None]
    dz.scatter_add_(1, targets[:, None], -ce_coef[:, None])  # a (q - onehot)
    l1 = None
    if target_logits is not None:
        p = _scaled_and_capped(target_logits, multiplier, softcap)[0]  # [rows, V] fp32
        sign = p.sub_(torch.logsumexp(p, dim=-1, keepdim=True)).exp_().neg_().add_(q)  # q - p [rows, V]
        l1 = sign.abs().sum(dim=-1)
        sign.sign_()
        sign.sub_((sign * q).sum(dim=-1, keepdim=True)).mul_(q).mul_(l1_coef[:, None])  # b q (s - sum_v s_v q_v)
        dz.add_(sign)
        del p, sign
    del q
    chained = capped is not None or multiplier != 1.0
    # A copy when the chain rule below would write into it (.to(float32) of fp32 dz is dz itself).
    dmarkov = None if markov_logits is None else dz.to(markov_logits.dtype, copy=chained)
    if not chained and dmarkov is not None and dmarkov.dtype == logits.dtype:
        return ce, l1, hit, dmarkov, dmarkov  # the head's logits enter z as they are: one gradient, stored once
    if capped is not None:
        dz.mul_(1 - capped.square_())
    if multiplier != 1.0:
        dz.mul_(multiplier)
    return ce, l1, hit, dmarkov, dz.to(logits.dtype)


def dspark_terms_and_grad_chunk_functional(
    logits: torch.Tensor,
    markov_logits: torch.Tensor | None,
    target_logits: torch.Tensor | None,
    targets: torch.Tensor,
    ce_coef: torch.Tensor,
    l1_coef: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
):
    """`dspark_terms_and_grad_chunk` without in-place ops, for torch.compile to fuse into a few kernels."""
    z = logits.float() * multiplier  # [rows, V]
    capped = None
    if softcap:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    if markov_logits is not None:
        z = z + markov_logits.float()
    log_q = torch.log_softmax(z, dim=-1)
    q = torch.exp(log_q)
    ce = -log_q.gather(1, targets[:, None]).squeeze(1)
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]  # fused, never stored
    dz = ce_coef[:, None] * (q - onehot.float())
    l1 = None
    if target_logits is not None:
        u = target_logits.float() * multiplier
        if softcap:
            u = torch.tanh(u / softcap) * softcap
        diff = q - torch.softmax(u, dim=-1)  # q - p
        l1 = diff.abs().sum(dim=-1)
        sign = torch.sign(diff)
        dz = dz + l1_coef[:, None] * q * (sign - (sign * q).sum(dim=-1, keepdim=True))
    hit = z.argmax(dim=-1) == targets
    dmarkov = None if markov_logits is None else dz.to(markov_logits.dtype)
    if not softcap and multiplier == 1.0 and dmarkov is not None and dmarkov.dtype == logits.dtype:
        return ce, l1, hit, dmarkov, dmarkov  # one [rows, V] write instead of two
    if capped is not None:
        dz = dz * (1 - capped * capped)
    return ce, l1, hit, dmarkov, (dz * multiplier).to(logits.dtype)


class _FusedLinearDSparkLoss(torch.autograd.Function):
    """sum_i a_i CE_i + b_i L1_i over DSpark's logits z_i = cap(rows_i @ W^T) + markov_rows_i @ W2^T, with the
    gradients with respect to rows, markov_rows and W2 computed in the forward, chunk by chunk, and kept: no
    vocab-sized tensor outlives its chunk (as in `_FusedLinearWeightedCE`). W is the target's frozen head: no
    weight gradient. The coefficients a, b are fixed ahead (DSpark's slot weights depend only on validity),
    so W2's gradient, a sum over rows, is accumulated chunk by chunk."""

    @staticmethod
    def forward(ctx, rows, markov_rows, markov_w2, weight, target_rows, targets, ce_coef, l1_coef, chunk_size, terms_grad_chunk, needs_grad):
        ctx.markov = markov = markov_rows is not None
        grad_rows = torch.empty_like(rows) if needs_grad else None  # [T, hidden]
        grad_markov = torch.empty_like(markov_rows) if needs_grad and markov else None  # [T, r]
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=rows.device) if needs_grad and markov else None  # [V, r]
        ce = torch.empty(targets.shape, dtype=torch.float32, device=rows.device)  # [T]
        l1 = torch.zeros_like(ce)  # [T], 0 without target rows
        hits = torch.empty(targets.shape, dtype=torch.bool, device=rows.device)  # [T]
        for start in range(0, rows.shape[0], chunk_size):
            end = min(start + chunk_size, rows.shape[0])
            logits = rows[start:end] @ weight.t()  # [rows, V], bf16 on GPU
            markov_logits = markov_rows[start:end] @ markov_w2.t() if markov else None  # the Markov term W2(W1[prev]) [rows, V]
            target_logits = None if target_rows is None else target_rows[start:end] @ weight.t()  # [rows, V]
            ce[start:end], l1_chunk, hits[start:end], dmarkov, dlogits = terms_grad_chunk(
                logits, markov_logits, target_logits, targets[start:end], ce_coef[start:end], l1_coef[start:end]
            )
            del logits, markov_logits, target_logits
            if l1_chunk is not None:
                l1[start:end] = l1_chunk
            if not needs_grad:
                continue
            if markov:  # the matmuls in the head's dtype (bf16 on GPU), as autograd's would run
                grad_markov[start:end] = dmarkov @ markov_w2  # [rows, r]
                grad_w2 += dmarkov.t() @ markov_rows[start:end]  # [V, r], summed over the chunks in fp32
            del dmarkov
            grad_rows[start:end] = dlogits @ weight  # [rows, hidden]
        if needs_grad:
            ctx.save_for_backward(grad_rows, *((grad_markov, grad_w2.to(markov_w2.dtype)) if markov else ()))
        ctx.mark_non_differentiable(ce, l1, hits)
        return (ce_coef * ce).sum() + (l1_coef * l1).sum(), ce, l1, hits

    @staticmethod
    def backward(ctx, grad_total, grad_ce, grad_l1, grad_hits):
        grad_rows, *markov_grads = ctx.saved_tensors
        grad_rows = grad_rows * grad_total.to(grad_rows.dtype)
        grad_markov, grad_w2 = (grad * grad_total.to(grad.dtype) for grad in markov_grads) if ctx.markov else (None, None)
        return grad_rows, grad_markov, grad_w2, None, None, None, None, None, None, None, None


def fused_linear_dspark_loss(
    rows: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    ce_coef: torch.Tensor,
    l1_coef: torch.Tensor,
    chunk_size: int,
    target_rows: torch.Tensor | None = None,
    markov_rows: torch.Tensor | None = None,
    markov_w2: torch.Tensor | None = None,
    multiplier: float = 1.0,
    softcap: float | None = None,
    terms_grad_chunk: Callable = dspark_terms_and_grad_chunk,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSpark's weighted CE and L1 over the rows through the frozen head and the Markov term, in chunks: at
    most `chunk_size x vocab` logits of the drafter (and as many of the target) exist at a time, and none
    are kept for backward (`terms_grad_chunk` gives the gradient). Per chunk the head, Markov and target
    matmuls and the gradient's matmuls back to rows, markov_rows and W2 run eagerly; the elementwise work
    between them (softmaxes, CE, L1, argmax, the logits' gradient) is `terms_grad_chunk`.

    The drafter's logits of row i are z_i = cap(rows_i @ W^T) + markov_rows_i @ W2^T
    (`DSparkDraftModel.block_logits`; cap = `dflash_model.scale_and_cap_logits`), the target's
    cap(target_rows_i @ W^T); both softmaxed in fp32.

    Args:
        rows: [T, hidden], the drafter's hidden states at the valid slots.
        head_weight: [V, hidden], the target's LM head (frozen: no gradient reaches it).
        targets: [T] int64 labels.
        ce_coef, l1_coef: [T] float32, each row's weight on its CE and its L1 (0: the term is dropped).
        chunk_size: rows per chunk.
        target_rows: [T, hidden], the target's last hidden state at each slot's position (detached); None:
            no L1 (l1 comes back 0).
        markov_rows: [T, r], W1[prev] of each row (`MarkovHead.markov_w1`), and markov_w2: [V, r], the
            weight of `MarkovHead.markov_w2`; both None without a Markov head. Both get exact gradients.
        multiplier, softcap: the drafter config's logit scaling and cap, on the head's logits (not the Markov term).
        terms_grad_chunk: the per-chunk elementwise work: the eager `dspark_terms_and_grad_chunk`, or a compiled
            `dspark_terms_and_grad_chunk_functional` (GPU training, `compiled_dspark_chunk`).
    Returns:
        total: scalar float32, sum_i ce_coef_i CE_i + l1_coef_i L1_i (differentiable: backpropagate it once);
        ce, l1: [T] float32, each row's CE and L1 = sum_v |p - q|, detached; hits: [T] bool, argmax == label.
    """
    # Under no_grad (an evaluation) no gradient is computed: needs_input_grad inside the forward would still say yes.
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, markov_rows, markov_w2))
    terms_grad_chunk = functools.partial(terms_grad_chunk, multiplier=multiplier, softcap=softcap)
    return _FusedLinearDSparkLoss.apply(
        rows, markov_rows, markov_w2, head_weight, target_rows, targets, ce_coef, l1_coef, chunk_size, terms_grad_chunk, needs_grad
    )


# ----------------------------------------------------------------------------------------------
# The LM head and CE through a library's fused kernel (--fused_loss)


# none: the chunked head + loss above (the reference). liger: Liger Kernel's fused linear cross-entropy
# (`LigerFusedLinearCrossEntropyLoss`), which chunks the rows as we do (T / ceil(vocab / hidden) rows a
# chunk: 128 of 7,680 at SmolLM2's shapes) and runs the softmax in a Triton kernel; with reduction="none"
# it defers the gradient to its backward and recomputes the logits there (3 head matmuls to our 2). cce: Apple's Cut Cross-Entropy (`cut_cross_entropy.linear_cross_entropy`), which never
# materialises a logits chunk: its forward keeps a running logsumexp in SRAM, and its backward skips
# vocabulary blocks whose softmax is below 2^-12 in bf16 (its default gradient filter). Both give the
# per-row CE (reduction="none"), so the position weights (exp, D-PACE) and the normaliser apply
# afterwards as in `fused_linear_row_loss`; only valid rows reach them, so no ignore_index is needed.
FUSED_LOSSES = ("none", "liger", "cce")
# --fused_loss -> (module imported, pip package). GPU only (Triton kernels), so not in requirements.txt.
FUSED_LOSS_PACKAGES = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}


def check_fused_loss(fused_loss: str, loss: str = "ce", dtype: str = "auto") -> None:
    """Refuse, in one line, a --fused_loss that does not exist or cannot compute this objective.

    Both libraries compute only the cross-entropy with the labels. Liger's fused linear JSD / KL
    return one batch mean (no per-row losses, so no per-position weights) and neither library has
    tv, nla, lk or DSpark's objective: those keep the reference path.

    Args:
        fused_loss: one of `FUSED_LOSSES`.
        loss: the --loss (`LOSSES`, or "dspark").
        dtype: the --dtype: "auto", "bfloat16" or "float32".
    Raises:
        ValueError: on an unknown value, a loss other than ce with a library, or cce with --dtype float32.
    """
    if fused_loss not in FUSED_LOSSES:
        raise ValueError(f"--fused_loss must be one of {', '.join(FUSED_LOSSES)}, got {fused_loss!r}")
    if fused_loss != "none" and loss != "ce":
        raise ValueError(
            f"--fused_loss {fused_loss} computes only --loss ce, got --loss {loss}: Liger's fused KL/JSD give no per-position "
            "losses and neither library has tv, nla, lk or DSpark's objective; use --fused_loss none"
        )
    if fused_loss == "cce" and dtype == "float32":
        raise ValueError(
            "--fused_loss cce needs bf16 hidden states (its backward kernel takes no float32); use --dtype bfloat16, or --fused_loss liger"
        )


def resolve_fused_loss(fused_loss: str, device: torch.device) -> str:
    """The --fused_loss that runs on `device`: the library's name on CUDA, "none" elsewhere (the libraries
    are Triton kernels: on a CPU the reference path computes the same loss; the caller says so in its log).

    Raises:
        ValueError: on CUDA, when the library cannot be imported (names the pip command).
    """
    if fused_loss == "none" or device.type != "cuda":
        return "none"
    module, package = FUSED_LOSS_PACKAGES[fused_loss]
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"--fused_loss {fused_loss} needs the {package} package ({error}): pip install {package} "
            "(GPU only, not in requirements.txt), or use --fused_loss none"
        ) from None
    return fused_loss


@torch.no_grad()
def top_k_candidates(rows: torch.Tensor, head_weight: torch.Tensor, top_k: int, chunk_size: int) -> torch.Tensor:
    """rows [T, hidden] -> [T, K] int64, the ids of the K largest logits of each row, most likely
    first, with at most chunk_size x vocab logits at a time. The engines' logit multiplier (> 0) and
    cap are monotone, so the raw logits rank the candidates as the served ones do."""
    ids = torch.empty(rows.shape[0], top_k, dtype=torch.long, device=rows.device)
    for start in range(0, rows.shape[0], chunk_size):
        ids[start : start + chunk_size] = (rows[start : start + chunk_size] @ head_weight.t()).topk(top_k, dim=-1).indices
    return ids


def library_linear_ce(
    rows: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    fused_loss: str,
    chunk_size: int,
    multiplier: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's CE through the frozen head by Liger or CCE (unweighted, reduction="none"), its argmax hit,
    and with top_k > 0 its top-K ids.

    The multiplier is folded into the rows (z = (m * rows) @ W^T); the cap is the libraries' own softcap.
    Liger returns its argmax (`return_predicted_tokens`); CCE returns none, so its hits, and either
    library's top-K, take one more chunked pass of the head without gradient (`top_k_candidates`).

    Args:
        rows: [T, hidden], the drafter's hidden states at the valid label positions (bf16 or fp16 for cce).
        head_weight: [vocab, hidden], the frozen LM head, detached.
        targets: [T] int64.
        fused_loss: "liger" or "cce".
        chunk_size: rows per chunk of the extra pass.
        multiplier, softcap: the logit scaling and cap, as `weighted_block_loss`'s.
        top_k: K, or 0 for no top-K.
    Returns:
        loss [T] float32 (differentiable: weight it, sum it, backpropagate once), hits [T] bool, and
        top_ids [T, K] int64 or None.
    Raises:
        ValueError: cce with float32 rows.
    """
    if fused_loss == "cce" and rows.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            "--fused_loss cce needs bf16 hidden states (its backward kernel takes no float32); use --dtype bfloat16, or --fused_loss liger"
        )
    scaled = rows * multiplier if multiplier != 1.0 else rows
    softcap = softcap or None  # 0 means no cap here; the libraries take None
    predicted = None
    if fused_loss == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        output = LigerFusedLinearCrossEntropyLoss(reduction="none", softcap=softcap, return_predicted_tokens=True)(head_weight, scaled, targets)
        row_loss, predicted = output.loss, output.predicted_tokens
    else:
        from cut_cross_entropy import linear_cross_entropy

        row_loss = linear_cross_entropy(scaled, head_weight, targets, softcap=softcap, reduction="none")
    top_ids = None
    if top_k or predicted is None:  # CCE returns no argmax: its hits come from the top-1 of the extra pass
        top_ids = top_k_candidates(rows.detach(), head_weight, max(top_k, 1), chunk_size)  # [T, max(K, 1)]
    if predicted is None:
        predicted = top_ids[:, 0]
    return row_loss.float(), predicted == targets, top_ids if top_k else None


# ----------------------------------------------------------------------------------------------
# The chunk functions, compiled (GPU training)


_compiled_ce = None


def compiled_ce_grad_chunk(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None):
    """`weighted_ce_and_grad_chunk`, torch.compile'd (dynamic shapes: the rows vary per step);
    `weighted_block_loss(..., compiled=True)` uses it. Compiles under the compile lock
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


_compiled_row_loss = None


def compiled_row_loss_chunk(
    logits: torch.Tensor,
    targets: torch.Tensor,
    target_logits: torch.Tensor | None,
    loss: str = "ce",
    multiplier: float = 1.0,
    softcap: float | None = None,
    lk_eta: float = DEFAULT_LK_ETA,
):
    """`row_loss_and_grad_chunk`, torch.compile'd (dynamic shapes), under the compile lock as
    `compiled_ce_grad_chunk`; one graph per loss. `weighted_block_loss(..., compiled=True)` uses it for every
    loss or weighting that needs per-row values."""
    global _compiled_row_loss
    if _compiled_row_loss is None:
        _compiled_row_loss = torch.compile(row_loss_and_grad_chunk_functional, dynamic=True)
    key = ("row_loss_chunk", loss, str(logits.device), logits.dtype, logits.shape[0] > 1, logits.shape[1], multiplier, softcap, lk_eta)
    what = f"loss chunk ({loss} per row, dlogits, argmax) on {logits.device}, {logits.dtype}, vocab {logits.shape[1]}"
    compile_once_locked(key, what, lambda: _compiled_row_loss(logits, targets, target_logits, loss, multiplier, softcap, lk_eta), logits.device)
    with running_compiled():
        return _compiled_row_loss(logits, targets, target_logits, loss, multiplier, softcap, lk_eta)


_compiled_dspark = None


def compiled_dspark_chunk(
    logits: torch.Tensor,
    markov_logits: torch.Tensor | None,
    target_logits: torch.Tensor | None,
    targets: torch.Tensor,
    ce_coef: torch.Tensor,
    l1_coef: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
):
    """`dspark_terms_and_grad_chunk`, torch.compile'd (dynamic shapes), under the compile lock as
    `compiled_ce_grad_chunk`; one graph per set of terms (with or without the Markov term and the L1).
    `chunked_dspark_loss(..., compiled=True)` uses it. Runs inside the fused loss's forward, outside autograd."""
    global _compiled_dspark
    if _compiled_dspark is None:
        _compiled_dspark = torch.compile(dspark_terms_and_grad_chunk_functional, dynamic=True)
    markov_dtype, l1 = None if markov_logits is None else markov_logits.dtype, target_logits is not None
    key = ("dspark_chunk", str(logits.device), logits.dtype, logits.shape[0] > 1, logits.shape[1], markov_dtype, l1, multiplier, softcap)
    what = f"DSpark loss chunk (softmaxes, CE, L1, dlogits, argmax) on {logits.device}, {logits.dtype}, vocab {logits.shape[1]}"
    args = (logits, markov_logits, target_logits, targets, ce_coef, l1_coef, multiplier, softcap)
    compile_once_locked(key, what, lambda: _compiled_dspark(*args), logits.device)
    with running_compiled():
        return _compiled_dspark(*args)
