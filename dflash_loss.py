"""The DFlash training objective: per-position loss weights, the weighted cross-entropy through the
target's frozen LM head (fused with its input gradient, in chunks), and the tau estimate from the
per-position accuracy (arXiv 2602.06036).

The fused kernel: the gradient of CE with respect to the logits is known in closed form (softmax -
onehot), so each chunk's logits serve the loss and the input gradient at once and are then dropped:
at most `chunk_size x vocab` logits exist at a time, the head matmul runs twice per chunk instead of
three times (logits, checkpoint recompute, dlogits @ W), and nothing vocab-sized is kept for backward
(the idea of Liger-Kernel's fused linear cross-entropy). `dflash_loss` defines the DFlash loss (which
rows, which weights, the normalisation, the accuracy) and calls `fused_linear_weighted_ce`.

DFlash2 adds its candidate selector's objective (`selector_objective`): a hard K-way cross-entropy
over the drafter's top-K candidates with teacher-forced predecessors, added to the DFlash loss.

Notation: rows = positions in a chunk, T = valid positions in the micro-batch, vocab = LM head rows,
B = block size, N = anchors per row.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

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


# ----------------------------------------------------------------------------------------------
# DFlash2: the candidate selector's objective


def selector_training_candidates(candidate_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's training candidates: the drafter's top-K, with the target token put in the
    last (least likely) slot when it is not among them, so every position has a label among K.

    Worked example, K = 3: candidates [7, 2, 9], target 2 -> unchanged, index 1; target 5 ->
    [7, 2, 5], index 2.

    Args:
        candidate_ids: [T, K] int64, the top-K of the drafter's logits (distinct ids).
        targets: [T] int64.
    Returns:
        candidate_ids [T, K] int64, target_index [T] int64, and contains [T] bool: whether the
        top-K already held the target (the selector can draft it at serving time only then).
    """
    matches = candidate_ids == targets[:, None]  # [T, K]
    contains = matches.any(dim=1)
    last = candidate_ids.shape[1] - 1
    target_index = torch.where(contains, matches.int().argmax(dim=1), last)
    injected = candidate_ids.clone()
    injected[:, last] = torch.where(contains, candidate_ids[:, last], targets)
    return injected, target_index, contains


def selector_loss(scores: torch.Tensor, target_index: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted K-way cross-entropy of the selector: sum_i w_i * CE(scores_i, index_i) / sum_i w_i.

    Args:
        scores: [T, K] float, the `CandidateSelector`'s scores of the training candidates.
        target_index: [T] int64 (`selector_training_candidates`).
        row_weights: [T] float32, each row's position weight (as in `dflash_loss`).
    Returns:
        scalar float32.
    """
    ce = F.cross_entropy(scores.float(), target_index, reduction="none")  # [T]
    return (ce * row_weights).sum() / row_weights.sum()


class _CandidateLogits(torch.autograd.Function):
    """rows [T, hidden] x head rows of the candidates -> [T, K] logits, chunk by chunk, keeping only
    the candidate ids for backward: the gathered head rows (T x K x hidden, 1 GB in bf16 at 8192 rows,
    K = 16 and hidden 4096) are gathered again in backward instead of being stored. The head is frozen."""

    @staticmethod
    def forward(ctx, rows, weight, candidate_ids, chunk_size):
        out = rows.new_empty(candidate_ids.shape)  # [T, K]
        for start in range(0, rows.shape[0], chunk_size):
            end = start + chunk_size
            out[start:end] = (weight[candidate_ids[start:end]] @ rows[start:end, :, None])[..., 0]
        ctx.save_for_backward(candidate_ids)
        ctx.weight, ctx.chunk_size = weight, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (candidate_ids,) = ctx.saved_tensors
        grad_rows = grad_out.new_empty(candidate_ids.shape[0], ctx.weight.shape[1])  # [T, hidden]
        for start in range(0, candidate_ids.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            grad_rows[start:end] = (grad_out[start:end, None, :] @ ctx.weight[candidate_ids[start:end]])[:, 0]
        return grad_rows, None, None, None


@torch.no_grad()
def top_k_candidates(rows: torch.Tensor, head_weight: torch.Tensor, top_k: int, chunk_size: int) -> torch.Tensor:
    """rows [T, hidden] -> [T, K] int64, the ids of the K largest logits of each row, most likely
    first, with at most chunk_size x vocab logits at a time. The engines' logit multiplier (> 0) and
    cap are monotone, so the raw logits rank the candidates as the served ones do."""
    ids = torch.empty(rows.shape[0], top_k, dtype=torch.long, device=rows.device)
    for start in range(0, rows.shape[0], chunk_size):
        ids[start : start + chunk_size] = (rows[start : start + chunk_size] @ head_weight.t()).topk(top_k, dim=-1).indices
    return ids


def selector_objective(
    candidate_scores: Callable,
    top_k: int,
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    predecessor_ids: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 4096,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    valid_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's selector loss, to be added with weight 1.0 to the drafter's own loss (`dflash_loss`).

    At each valid label position: take the drafter's top-K logits, put the label
    in slot K when it is missing (`selector_training_candidates`), score the K candidates with the
    selector given the true previous token (teacher forcing: `predecessor_ids`, the anchor at k = 1),
    and take the hard K-way cross-entropy against the label, position-weighted and normalised as
    `dflash_loss` is. Gradients reach the selector and, through the unary logits and the hidden
    projection, the drafter's hidden states (as in speculators).

    Why this objective (speculators' DFlash2 objective, speculators/models/dflash2/metrics.py
    `compute_selector_loss`, weight `selector_loss_alpha` = 1.0):
    - K-way over the unary top-K is the decision the selector makes when serving; the full vocab
      would spend the selector's capacity on tokens it never sees. Injecting a missing label at the
      least likely slot gives every position a label while keeping K = the serving K.
    - Teacher forcing is exact where it matters: under verification a draft counts only while every
      earlier draft was right, and then the walk's predecessor IS the true previous token. So the
      run of teacher-forced hits per block (`accepted` below) is the selector path's accepted length,
      and all B-1 positions train in one parallel pass instead of a B-1-step walk.
    - Hard labels (the data tokens) rather than speculators' argmax of the target's logits: our data
      are the target's own replies and our DFlash loss is hard-label CE too; a soft objective
      needs the target's logits, which this trainer does not carry.

    Args:
        candidate_scores: the drafter's `candidate_selector` module (called as hidden [T, hidden],
            predecessor ids [T], candidate ids [T, K], unary logits [T, K] -> scores [T, K]).
        top_k: K, the drafter's `config.selector_top_k`.
        hidden: [batch, N, B-1, hidden], drafter output at block positions 1..B-1 (after `norm`).
        head_weight: [vocab, hidden], the target's LM head (frozen).
        labels, label_valid: [batch, N, B-1] from `block_labels`.
        predecessor_ids: [batch, N, B-1] int64 from `dflash_model.selector_predecessor_ids`.
        weights: [B-1] float32 from `loss_weights`.
        chunk_size: rows per chunk of the top-K head matmul (one extra matmul of the head, no backward).
        output_multiplier, final_logit_softcapping: the drafter's logit scaling and cap, applied to
            the unary logits as the draft pass applies them (`dflash_model.scale_and_cap_logits`).
        valid_index: [T, 3] int64, `label_valid.nonzero()` found ahead, or None.
    Returns:
        loss: scalar float32 (0 with a graph if nothing is valid).
        accepted: [B-1] float32, as `dflash_loss`'s, for the selector's path (a hit needs the label
            among the unary top-K and the selector's argmax on it); `estimate_acceptance_length`
            turns it into the path's tau.
    """
    positions = label_valid.shape[-1]
    b_index, n_index, k_index = (label_valid.nonzero() if valid_index is None else valid_index).unbind(1)  # each [T]
    rows = hidden[b_index, n_index, k_index]  # [T, hidden]
    if rows.shape[0] == 0:
        return hidden.sum() * 0.0, torch.full((positions,), float("nan"), device=hidden.device)
    targets = labels[b_index, n_index, k_index]  # [T]
    head_weight = head_weight.detach()
    candidate_ids, target_index, contains = selector_training_candidates(
        top_k_candidates(rows.detach(), head_weight, top_k, chunk_size), targets)
    unary = _CandidateLogits.apply(rows, head_weight, candidate_ids, chunk_size).float() * output_multiplier  # [T, K]
    if final_logit_softcapping:
        unary = torch.tanh(unary / final_logit_softcapping) * final_logit_softcapping
    scores = candidate_scores(rows, predecessor_ids[b_index, n_index, k_index], candidate_ids, unary)
    loss = selector_loss(scores, target_index, weights.to(rows.device)[k_index])
    hit = contains & (scores.detach().argmax(dim=1) == target_index)
    correct = torch.zeros_like(label_valid)  # [batch, N, B-1] bool
    correct[b_index, n_index, k_index] = hit
    accepted = (correct.to(torch.int32).cumprod(dim=-1).bool() & label_valid).sum(dim=(0, 1)).float()  # [B-1]
    return loss, accepted / label_valid.sum(dim=(0, 1)).float()
