"""The DFlash training objective: per-position loss weights, the weighted cross-entropy through the
target's frozen LM head, and the tau estimate from the per-position accuracy (arXiv 2602.06036).

`weighted_block_loss` defines the DFlash loss (which rows, which weights, the normalisation, the
accuracy) and runs the head and the loss through the chunked kernels of dflash_loss_kernels.py
(`fused_linear_weighted_ce`: the head matmul fused with the loss's input gradient, chunk by chunk;
with --fused_loss, a library's kernel).

Beyond the paper's objective (docs/training.md, "The objective"): D-PACE position weights
(`dpace_weights`, the default of speculators for DFlash), and losses against the target's whole
distribution p instead of its argmax (`LOSSES`: kl, tv, nla, lk). Both need a per-row quantity before
the weighted sum, so they run through `fused_linear_row_loss`, which returns each row's loss and keeps
each row's unweighted input gradient; the weights are applied afterwards (`weighted_block_loss` explains why
that is exact and cheap). DFlash2 adds its candidate selector's objective (`selector_objective`): a
hard K-way cross-entropy over the drafter's top-K candidates with teacher-forced predecessors, added
to the DFlash loss; the candidates come from the loss's own logits chunks (`weighted_block_loss`'s
top_k), not from a second pass through the head. DSpark's objective (`dspark_loss`, the plain reference;
`chunked_dspark_loss`, what training runs) goes through the same head in chunks, with the Markov term
(`fused_linear_dspark_loss`).

Notation: rows = positions in a chunk, T = valid positions in the micro-batch, vocab = LM head rows,
B = block size, N = anchors per row, p = the target's distribution, q = the drafter's.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_loss_kernels import (
    DEFAULT_LK_ETA,
    LOSSES,
    check_fused_loss,
    compiled_ce_grad_chunk,
    compiled_dspark_chunk,
    compiled_row_loss_chunk,
    dspark_terms_and_grad_chunk,
    fused_linear_dspark_loss,
    fused_linear_row_loss,
    fused_linear_weighted_ce,
    library_linear_ce,
    row_loss_and_grad_chunk,
    top_k_candidates,
    weighted_ce_and_grad_chunk,
)

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


LOSS_WEIGHTINGS = ("exp", "dpace")  # `loss_weights`' fixed decay, or `dpace_weights`
LOSS_NORMALIZERS = ("weights", "count")  # divide the weighted sum by the sum of weights, or by the count of valid positions
DEFAULT_DPACE_ALPHA = 0.5  # speculators' default smoothing of the D-PACE confidence


def dpace_weights(confidence: torch.Tensor, label_valid: torch.Tensor, alpha: float = DEFAULT_DPACE_ALPHA) -> torch.Tensor:
    """D-PACE position weights: the expected number of accepted draft tokens that each position carries
    (speculators' default weighting for DFlash, docs/training.md, "The objective").

    Per block, the smoothed confidence is s_k = (1 - alpha) * c_k + alpha at valid positions and 1 at
    masked ones (a masked position neither stops nor shrinks the run). The weight of a valid position k
    is W_k = sum_{j >= k, j valid} prod_{i <= j} s_i, and 0 where masked.

    Why: if s_k is the chance that position k is accepted once 1..k-1 were, the expected accepted length
    of the block is E = sum_j prod_{i <= j} s_i, and dE / d log s_k = sum_{j >= k} prod_{i <= j} s_i = W_k:
    position k's log-confidence moves every term from k on. With alpha = 0 and c_k = exp(-CE_k), the
    loss sum_k W_k * CE_k (W detached) has exactly the gradient of -E, so the loss targets tau instead
    of a fixed decay. alpha > 0 keeps later positions' weights from vanishing while the drafter is still
    poor (every s_k >= alpha); it drops the exact factor (1 - alpha) c_k / s_k of d log s_k / d log c_k.

    Args:
        confidence: [batch, N, B-1] float, c_k in [0, 1] (any value where masked): exp(-CE_k) for the CE
            loss, the acceptance probability sum_v min(p_v, q_v) for the distribution losses
            (`weighted_block_loss`). Detached here: the weights carry no gradient.
        label_valid: [batch, N, B-1] bool from `block_labels`.
        alpha: smoothing in [0, 1]; alpha = 1 gives each valid position the count of valid positions at
            or after it in its block.
    Returns:
        [batch, N, B-1] float32, 0 where masked.
    Raises:
        ValueError: if alpha is outside [0, 1].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--dpace_alpha must be in [0, 1] (the weight of the constant in the smoothed confidence), got {alpha}")
    # Worked example, B - 1 = 3, alpha = 0.5, c = [0.8, 0.4, 0.6]: s = [0.9, 0.7, 0.8], prefix products
    # [0.9, 0.63, 0.504], W = [0.9 + 0.63 + 0.504, 0.63 + 0.504, 0.504] = [2.034, 1.134, 0.504].
    # With position 2 masked: s = [0.9, 1, 0.8], prefix [0.9, 0.9, 0.72], W = [0.9 + 0.72, 0, 0.72] = [1.62, 0, 0.72].
    valid = label_valid.to(torch.float32)
    smoothed = torch.where(label_valid, (1.0 - alpha) * confidence.detach().float() + alpha, 1.0)  # [batch, N, B-1]
    prefix = torch.cumprod(smoothed, dim=-1) * valid  # prod_{i <= j} s_i at valid j, 0 at masked j
    return prefix.flip(-1).cumsum(-1).flip(-1) * valid  # suffix sums over j >= k


# ----------------------------------------------------------------------------------------------
# The DFlash loss and its metrics


def block_target_hidden(target_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's last hidden state (the final-norm output, the LM head's input) at the position
    before each label: label k = 1..B-1 of the block at anchor a is token[a + k], and the target's
    distribution over it comes from its logits at a + k - 1. Laid out like `block_labels`' labels.

    Sending this instead of the target's logits is what makes the distribution losses affordable in
    split mode: the drafter rank already holds the frozen LM head and applies it inside the fused
    kernel, chunk by chunk. Bytes per sample at Qwen3-8B shapes (vocab 151,936, hidden 4096, bf16):
      per label position, 512 anchors x 15 = 7,680 rows: logits 7,680 x 151,936 x 2 = 2,333,736,960 B
        (2.33 GB) against hidden 7,680 x 4,096 x 2 = 62,914,560 B (62.9 MB), 37x less;
      per sequence position, seq 3072 (what a target rank sends: anchors are drawn on the drafter rank):
        logits 3,072 x 151,936 x 2 = 933,494,784 B (933 MB) against 3,072 x 4,096 x 2 = 25,165,824 B
        (25.2 MB), 20% on top of the 5 context-feature layers it already sends (125.8 MB).

    Args:
        target_hidden: [batch, S, hidden], any dtype (kept).
        anchors: [batch, N] int64 from `sample_anchors`.
        block_size: B.
    Returns:
        [batch, N, B-1, hidden]; rows past the sequence end repeat position S-1 (their labels are invalid).
    """
    seq_len = target_hidden.shape[1]
    positions = anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)  # [batch, N, B-1]: a + k - 1
    batch_index = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]  # [batch, 1, 1]
    return target_hidden[batch_index, positions.clamp(max=seq_len - 1)]  # [batch, N, B-1, hidden]


def weighted_block_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    weights: torch.Tensor | None,
    chunk_size: int = 4096,
    compiled: bool = False,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    valid_index: torch.Tensor | None = None,
    *,
    loss: str = "ce",
    target_hidden: torch.Tensor | None = None,
    loss_weighting: str = "exp",
    dpace_alpha: float = DEFAULT_DPACE_ALPHA,
    normalize: str = "weights",
    lk_eta: float = DEFAULT_LK_ETA,
    return_row_weights: bool = False,
    fused_loss: str = "none",
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Position-weighted loss through the target's LM head, in chunks (arXiv 2602.06036): by default
    the paper's cross-entropy with exp(-(k-1)/gamma) weights.

    loss = sum_i w_i * l_i / sum_i w_i over valid positions i of the micro-batch (normalize="weights",
    the default), or sum_i w_i * l_i / T (normalize="count", speculators' reduction), never a plain
    mean over padded positions. The default keeps the loss a weighted mean, whose scale (and so the
    learning rate that suits it) does not depend on how large the weights are: D-PACE weights grow
    with the drafter's confidence (up to B-1 at position 1), so under "count" its loss and gradient
    grow as training succeeds, a learning-rate ramp tied to tau. It is also the paper's normalisation
    (arXiv 2602.06036).

    l_i is the per-position `loss` (`LOSSES`; `row_loss_and_grad_chunk` gives the formulas); w_i is
    `weights[k]` (loss_weighting="exp") or the D-PACE weight of the position (`dpace_weights`, from the
    detached confidence: exp(-CE) for ce, the acceptance probability sum_v min(p_v, q_v) for the others).

    Only valid label positions go through the head (padding and block position 0 never cost a
    vocab-sized matmul), and at most `chunk_size x vocab` logits exist at once instead of
    `N*(B-1) x vocab`. The input gradient is computed in the forward, so there is no activation
    checkpointing, no recompute of the head, and nothing compiled runs in autograd's backward threads.
    CE with fixed weights runs through `fused_linear_weighted_ce`, whose chunks apply the weights to
    dlogits directly. Measured on an H200 at Qwen3-8B shapes (BENCHMARKS.md, bench_dflash.py): 92.4 vs
    98.9 ms/sample and 37.3 vs 38.2 GB against the earlier checkpointed form (non-reentrant
    checkpointing, itself chosen over reentrant: 67.4 vs 68.0 ms for the loss alone at 8192 rows,
    equal memory, and no recompute in autograd's threads).

    D-PACE, and the distribution losses, run through `fused_linear_row_loss`. A D-PACE weight depends
    on the confidence of every position of its block, and a block's rows may straddle two chunks, so
    no chunk knows its rows' weights while its logits exist. It does not need to: the loss is linear
    in the weights, d(sum_i w_i l_i)/d rows_i = w_i * d l_i / d rows_i, so each chunk keeps its rows'
    unweighted gradient [rows, hidden] (the buffer the CE path keeps anyway) and its rows' confidence;
    once all chunks are done the weights are found on [batch, N, B-1] and the backward scales each
    row's gradient by w_i / normaliser. One head pass, no second vocab-sized pass, and T floats extra.
    The distribution losses add the target's head matmul per chunk (its logits from `target_hidden`),
    one more fp32 [chunk_size, vocab] buffer for p, and nothing vocab-sized beyond the chunk.

    Args:
        hidden: [batch, N, B-1, hidden], drafter output at block positions 1..B-1.
        head_weight: [vocab, hidden], the target's LM head weight (frozen).
        labels, label_valid: [batch, N, B-1] from `block_labels`.
        weights: [B-1] float32 from `loss_weights`; unused (may be None) with loss_weighting="dpace".
        chunk_size: rows per chunk.
        compiled: run the per-chunk elementwise work through `compiled_ce_grad_chunk` /
            `compiled_row_loss_chunk` (GPU training) instead of the eager functions.
        output_multiplier, final_logit_softcapping: the drafter config's logit scaling and cap
            (`scale_and_cap_logits`), applied to the head's logits before the loss, as the engines
            apply them before sampling; the target's logits get the same (the head is the target's).
        valid_index: [T, 3] int64 on hidden's device, `label_valid.nonzero()` found ahead (the trainer
            finds it on the host); None: found here, which waits for the device once.
        loss: "ce" (labels), or "kl", "tv", "nla", "lk" (the target's distribution; need target_hidden).
        target_hidden: [batch, N, B-1, hidden], the target's last hidden state (final-norm output) at the
            position before each label (`block_target_hidden`); detached here. Unused for ce.
        loss_weighting: "exp" (`weights`) or "dpace" (`dpace_weights`).
        dpace_alpha: D-PACE's confidence smoothing, in [0, 1].
        normalize: "weights" or "count", see above.
        lk_eta: eta of the LK hybrid, >= 0 (0 gives plain KL).
        return_row_weights: also return w_i, so that DFlash2's selector (`selector_objective`) is
            weighted exactly as the drafter's loss is.
        fused_loss: "none" (the chunked kernels here), or "liger" / "cce": the head and the per-row CE
            through that library (`library_linear_ce`; --loss ce only, weights applied afterwards). No
            device check here: the trainer resolves the flag first (`resolve_fused_loss`).
        top_k: K > 0 also returns each valid row's top-K ids (DFlash2's candidates), taken from the loss's
            own logits chunks (`fused_linear_weighted_ce`), equal to `top_k_candidates`' second pass; with a
            library, that second pass.
    Returns:
        loss: scalar float32 (0 with a graph, if nothing is valid). Backpropagate it once.
        accepted: [B-1] float32; at block position k = 1..B-1, the share of blocks with a label at k
            whose argmax is right at every position 1..k (NaN where no block has a label at k). Entry
            0 is the first position's accuracy; `estimate_acceptance_length` turns it into tau. Labels
            and argmax only, whatever the loss.
        row_weights (only with return_row_weights): [T] float32, w_i of each valid position in
            `label_valid.nonzero()` order, detached.
        top_ids (only with top_k > 0): [T, K] int64 in the same order, most likely first.
    Raises:
        ValueError: on an unknown loss, weighting or normaliser, a distribution loss without
            target_hidden (or with the wrong shape), exp weighting without weights, lk_eta < 0,
            (with D-PACE, when a label is valid) dpace_alpha outside [0, 1], or a fused_loss that
            `check_fused_loss` refuses.
    """
    if loss not in LOSSES:
        raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    check_fused_loss(fused_loss, loss)
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"--loss_weighting must be one of {', '.join(LOSS_WEIGHTINGS)}, got {loss_weighting!r}")
    if normalize not in LOSS_NORMALIZERS:
        raise ValueError(f"--loss_normalize must be one of {', '.join(LOSS_NORMALIZERS)}, got {normalize!r}")
    if loss_weighting == "exp" and weights is None:
        raise ValueError("--loss_weighting exp needs the per-position weights (loss_weights); pass them, or use --loss_weighting dpace")
    if loss != "ce" and target_hidden is None:
        raise ValueError(
            f"--loss {loss} compares the drafter with the target's distribution and needs the target's last "
            "hidden state at each label's previous position (target_hidden, from block_target_hidden); pass it, or use --loss ce"
        )
    if loss != "ce" and target_hidden.shape != hidden.shape:
        raise ValueError(
            f"target_hidden must be laid out like hidden, {list(hidden.shape)}, got {list(target_hidden.shape)} (gather it with block_target_hidden)"
        )
    if lk_eta < 0:
        raise ValueError(f"--lk_eta must be >= 0 (0 gives plain KL), got {lk_eta}")
    positions = label_valid.shape[-1]
    # One nonzero (one wait for the device, unless found ahead) gives the valid rows; gathering by these
    # indices costs no further wait, where each boolean-mask index would wait once more, and again in its backward.
    b_index, n_index, k_index = (label_valid.nonzero() if valid_index is None else valid_index).unbind(1)  # each [T] int64
    rows = hidden[b_index, n_index, k_index]  # [T, hidden]
    targets = labels[b_index, n_index, k_index]  # [T]
    if rows.shape[0] == 0:
        nothing = (hidden.sum() * 0.0, torch.full((positions,), float("nan"), device=hidden.device))
        nothing += (rows.new_zeros(0, dtype=torch.float32),) if return_row_weights else ()
        return nothing + ((torch.zeros(0, top_k, dtype=torch.long, device=rows.device),) if top_k else ())
    if loss == "ce" and loss_weighting == "exp" and fused_loss == "none":
        row_weights = weights.to(rows.device)[k_index]  # [T]
        ce_grad_chunk = compiled_ce_grad_chunk if compiled else weighted_ce_and_grad_chunk
        weighted_ce, hit, *found = fused_linear_weighted_ce(
            rows, head_weight.detach(), targets, row_weights, chunk_size, ce_grad_chunk, output_multiplier, final_logit_softcapping, top_k
        )
        top_ids = found[0] if top_k else None
        mean_loss = weighted_ce / (row_weights.sum() if normalize == "weights" else rows.shape[0])
    else:
        if fused_loss != "none":
            row_loss, hit, top_ids = library_linear_ce(
                rows, head_weight.detach(), targets, fused_loss, chunk_size, output_multiplier, final_logit_softcapping, top_k
            )
            confidence = torch.exp(-row_loss.detach())  # the label's probability, as the ce row kernel's
        else:
            target_rows = None if loss == "ce" else target_hidden.detach()[b_index, n_index, k_index]  # [T, hidden]
            row_grad_chunk = compiled_row_loss_chunk if compiled else row_loss_and_grad_chunk
            row_loss, confidence, hit, *found = fused_linear_row_loss(
                rows,
                head_weight.detach(),
                targets,
                target_rows,
                chunk_size,
                loss,
                row_grad_chunk,
                output_multiplier,
                final_logit_softcapping,
                lk_eta,
                top_k,
            )
            top_ids = found[0] if top_k else None
        if loss_weighting == "dpace":
            block_confidence = torch.zeros(label_valid.shape, dtype=torch.float32, device=rows.device)  # [batch, N, B-1]
            block_confidence[b_index, n_index, k_index] = confidence
            row_weights = dpace_weights(block_confidence, label_valid, dpace_alpha)[b_index, n_index, k_index]  # [T]
        else:
            row_weights = weights.to(rows.device)[k_index]  # [T]
        mean_loss = (row_weights * row_loss).sum() / (row_weights.sum() if normalize == "weights" else rows.shape[0])
    # A block's draft is accepted up to its first wrong (or unlabelled) position, as verification
    # stops there; counting runs, not per-position accuracies, keeps the errors' correlation.
    correct = torch.zeros_like(label_valid)  # [batch, N, B-1] bool
    correct[b_index, n_index, k_index] = hit
    accepted = (correct.to(torch.int32).cumprod(dim=-1).bool() & label_valid).sum(dim=(0, 1)).float()  # [B-1]
    accepted = accepted / label_valid.sum(dim=(0, 1)).float()
    returned = (mean_loss, accepted) + ((row_weights.detach().float(),) if return_row_weights else ())
    return returned + ((top_ids,) if top_k else ())


def estimate_acceptance_length(accepted: torch.Tensor) -> float:
    """Acceptance length tau from the training blocks: `1 + sum_k P(draft right at positions 1..k)`.

    The 1 is the target's bonus token. A block is drafted in one pass from its context, as at
    inference, so on the target's own greedy replies this is the tau the drafter reaches on those
    replies at a random anchor (teacher forcing equals greedy verification there); held-out replies
    give less once the drafter fits its training data. Replies sampled from the target also lower
    it: their tokens are not always the ones greedy verification accepts. E.g. accepted
    [0.9, 0.72, 0.36] -> 1 + 0.9 + 0.72 + 0.36 = 2.98.

    Args:
        accepted: [B-1] float from `weighted_block_loss` (a window's mean), NaN where a position had no
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


def selector_loss(scores: torch.Tensor, target_index: torch.Tensor, row_weights: torch.Tensor, normalize: str = "weights") -> torch.Tensor:
    """Position-weighted K-way cross-entropy of the selector: sum_i w_i * CE(scores_i, index_i) / Z,
    with Z = sum_i w_i (normalize="weights") or T (normalize="count"), as `weighted_block_loss` normalises.

    Args:
        scores: [T, K] float, the `CandidateSelector`'s scores of the training candidates.
        target_index: [T] int64 (`selector_training_candidates`).
        row_weights: [T] float32, each row's position weight (the drafter loss's, `weighted_block_loss`).
        normalize: "weights" or "count".
    Returns:
        scalar float32.
    """
    ce = F.cross_entropy(scores.float(), target_index, reduction="none")  # [T]
    return (ce * row_weights).sum() / (row_weights.sum() if normalize == "weights" else ce.shape[0])


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


def selector_objective(
    candidate_scores: Callable,
    top_k: int,
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    predecessor_ids: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_size: int = 4096,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    valid_index: torch.Tensor | None = None,
    normalize: str = "weights",
    candidate_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's selector loss, to be added with weight 1.0 to the drafter's own loss (`weighted_block_loss`).

    At each valid label position: take the drafter's top-K logits, put the label
    in slot K when it is missing (`selector_training_candidates`), score the K candidates with the
    selector given the true previous token (teacher forcing: `predecessor_ids`, the anchor at k = 1),
    and take the hard K-way cross-entropy against the label, with the drafter loss's own position
    weights (`weighted_block_loss(..., return_row_weights=True)`: the fixed decay, or D-PACE from the
    drafter's confidences) and its normaliser. Gradients reach the selector and, through the unary logits and the hidden
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
            predecessor ids [T], candidate ids [T, K], unary logits [T, K] -> scores [T, K]; its
            `parameters()` join the graph even when nothing is valid).
        top_k: K, the drafter's `config.selector_top_k`.
        hidden: [batch, N, B-1, hidden], drafter output at block positions 1..B-1 (after `norm`).
        head_weight: [vocab, hidden], the target's LM head (frozen).
        labels, label_valid: [batch, N, B-1] from `block_labels`.
        predecessor_ids: [batch, N, B-1] int64 from `dflash2_model.selector_predecessor_ids`.
        row_weights: [T] float32, the weight of each valid position in `label_valid.nonzero()` order:
            `weighted_block_loss`'s third output with return_row_weights=True (speculators, too, weights the
            selector as the drafter), or `loss_weights(B)[k]` of each row.
        chunk_size: rows per chunk of the top-K head matmul (one extra matmul of the head, no backward,
            unless candidate_ids come with the call).
        output_multiplier, final_logit_softcapping: the drafter's logit scaling and cap, applied to
            the unary logits as the draft pass applies them (`dflash_model.scale_and_cap_logits`).
        valid_index: [T, 3] int64, `label_valid.nonzero()` found ahead, or None.
        normalize: "weights" or "count", as the drafter's loss (`selector_loss`).
        candidate_ids: [T, K] int64, each valid row's top-K found ahead by the drafter's loss pass
            (`weighted_block_loss(..., top_k=K)`, from the same logits); None: `top_k_candidates` runs
            the head once more here.
    Returns:
        loss: scalar float32 (0 with a graph if nothing is valid).
        accepted: [B-1] float32, as `weighted_block_loss`'s, for the selector's path (a hit needs the label
            among the unary top-K and the selector's argmax on it); `estimate_acceptance_length`
            turns it into the path's tau.
    """
    positions = label_valid.shape[-1]
    b_index, n_index, k_index = (label_valid.nonzero() if valid_index is None else valid_index).unbind(1)  # each [T]
    rows = hidden[b_index, n_index, k_index]  # [T, hidden]
    if rows.shape[0] == 0:
        # Zero, with the selector's parameters in the graph too: every drafter rank must give every
        # parameter a gradient, or ZeRO's reductions differ between ranks (a filler micro-batch).
        zero = hidden.sum() * 0.0 + sum(p.sum() for p in candidate_scores.parameters()) * 0.0
        return zero, torch.full((positions,), float("nan"), device=hidden.device)
    targets = labels[b_index, n_index, k_index]  # [T]
    head_weight = head_weight.detach()
    if candidate_ids is None:
        candidate_ids = top_k_candidates(rows.detach(), head_weight, top_k, chunk_size)  # [T, K]
    candidate_ids, target_index, contains = selector_training_candidates(candidate_ids, targets)
    unary = _CandidateLogits.apply(rows, head_weight, candidate_ids, chunk_size).float() * output_multiplier  # [T, K]
    if final_logit_softcapping:
        unary = torch.tanh(unary / final_logit_softcapping) * final_logit_softcapping
    scores = candidate_scores(rows, predecessor_ids[b_index, n_index, k_index], candidate_ids, unary)
    loss = selector_loss(scores, target_index, row_weights.to(rows.device), normalize)
    hit = contains & (scores.detach().argmax(dim=1) == target_index)
    correct = torch.zeros_like(label_valid)  # [batch, N, B-1] bool
    correct[b_index, n_index, k_index] = hit
    accepted = (correct.to(torch.int32).cumprod(dim=-1).bool() & label_valid).sum(dim=(0, 1)).float()  # [B-1]
    return loss, accepted / label_valid.sum(dim=(0, 1)).float()


# ----------------------------------------------------------------------------------------------
# DSpark's objective


def dspark_loss(
    logits: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    target_logits: torch.Tensor,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    confidence_weight: float = 1.0,
    gamma: float = 4.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DSpark's training objective: `ce_weight * CE + l1_weight * L1 + confidence_weight * BCE`, in its
    plain form: on every slot's logits at once, the drafter's and the target's ([batch, N, G, V] each,
    whose fp32 softmaxes autograd keeps). The reference that `chunked_dspark_loss`, what training runs
    (the same objective from the hidden states, in chunks of rows), is checked against.

    Source: "DSpark" (arXiv 2607.05147) and DeepSeek's DeepSpec, `deepspec/modeling/dspark/loss.py`
    (the Qwen3-8B recipe's weights 0.1, 0.9, 1.0 and loss_decay_gamma 4 are the defaults here).
    Per block slot k (k = 0 at the anchor's slot, which predicts token[a+1]):
    - CE: cross-entropy of the drafter's logits against the data's token (`labels`);
    - L1: sum_v |p - q|, the full L1 distance (= 2 TV, in [0, 2]) between the target's
      distribution p and the drafter's q, both plain softmax at T = 1 in fp32;
    - BCE: binary cross-entropy of the confidence logit against the acceptance
      c* = clamp(1 - 0.5 * sum_v |p - q|, 0, 1), detached (the head learns it, q does not chase it).
    Each term is a weighted mean with w[k] = label_valid * exp(-k / gamma), divided by its own sum
    of weights + 1e-6 (the three sums are equal; DeepSpec keeps them apart). Worked example,
    gamma 4: slot weights 1, 0.78, 0.61, 0.47, ... Invalid slots are selected out, not multiplied by
    0, so a non-finite value there cannot poison the sums.

    Args:
        logits: [batch, N, G, V], the drafter's teacher-forced logits with the Markov term
            (`DSparkDraftModel.block_logits`), any float dtype (computed in fp32).
        confidence_logits: [batch, N, G] (`DSparkDraftModel.confidence_logits`), or None for no BCE term.
        labels, label_valid: [batch, N, G] int64 / bool (a prefix) from `dspark_model.dspark_block_labels`.
        target_logits: [batch, N, G, V], the target's logits at position a + k (its prediction of
            token[a+k+1]), e.g. `lm_head(block_target_hidden(target_last_hidden, anchors, G + 1))`.
        ce_weight, l1_weight, confidence_weight: the terms' weights; a weight <= 0 drops its term.
        gamma: position decay, w = exp(-k / gamma).
    Returns:
        loss: scalar float32 (0 with a graph when nothing is valid).
        terms: {"ce", "l1", "bce"}: each unweighted term, detached float32 (0 when dropped).
    """
    slots = torch.arange(logits.shape[-2], device=logits.device, dtype=torch.float32)
    weights = torch.exp(-slots / gamma) * label_valid.float()  # [batch, N, G]
    index = label_valid.nonzero(as_tuple=True)
    w = weights[index]  # [T]
    denominator = w.sum() + 1e-6
    rows = logits[index].float()  # [T, V]
    zero = rows.sum() * 0.0  # a graph even when nothing is valid
    terms = {"ce": zero, "l1": zero, "bce": zero}
    if ce_weight > 0:
        ce = F.cross_entropy(rows, labels[index], reduction="none")  # [T]
        terms["ce"] = (w * ce).sum() / denominator
    if l1_weight > 0 or (confidence_weight > 0 and confidence_logits is not None):
        l1 = (torch.softmax(target_logits[index].float(), dim=-1) - torch.softmax(rows, dim=-1)).abs().sum(dim=-1)  # [T]
        if l1_weight > 0:
            terms["l1"] = (w * l1).sum() / denominator
        if confidence_weight > 0 and confidence_logits is not None:
            accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # [T]
            bce = F.binary_cross_entropy_with_logits(confidence_logits[index].float(), accept, reduction="none")
            terms["bce"] = (w * bce).sum() / denominator
    loss = ce_weight * terms["ce"] + l1_weight * terms["l1"] + confidence_weight * terms["bce"]
    if confidence_logits is not None:
        loss = loss + confidence_logits[index].sum() * 0.0  # every parameter gets a gradient (ZeRO needs it on every rank)
    return loss, {name: value.detach().float() for name, value in terms.items()}


def chunked_dspark_loss(
    hidden: torch.Tensor,
    predecessors: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    target_hidden: torch.Tensor | None,
    confidence_logits: torch.Tensor | None = None,
    markov_w1: torch.Tensor | None = None,
    markov_w2: torch.Tensor | None = None,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    confidence_weight: float = 1.0,
    gamma: float = 4.0,
    chunk_size: int = 4096,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    valid_index: torch.Tensor | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """DSpark's training objective, `dspark_loss`'s (same source, terms, weights and normalisation), from the
    drafter's hidden states in chunks of valid rows: what training runs.

    The valid slots' rows are gathered first (hidden, predecessors, the target's hidden state, labels,
    slot weights: T rows); then each chunk of `chunk_size` rows makes the drafter's logits (the LM head,
    scaled and capped, plus the Markov term W2(W1[prev]), as `DSparkDraftModel.block_logits`), the target's
    (no gradient), both softmaxes in fp32, each row's CE and L1 = sum_v |p - q|, its argmax hit, and the
    gradient with respect to the chunk's hidden rows, W1[prev] and W2 (`fused_linear_dspark_loss`), and
    drops them. So at most chunk_size x V logits of each exist at a time, in the forward and the backward,
    where `dspark_loss` takes [batch, N, gamma, V] of each and autograd keeps their fp32 softmaxes.
    The gradient is computed in the forward, in closed form, rather than by recomputing each chunk in
    backward (torch.utils.checkpoint): the drafter's head, the Markov term and the target's head run once
    per chunk instead of twice, nothing vocab-sized runs in autograd's backward, and it is the way DFlash's
    loss works (`weighted_block_loss`). It is exact because the row weights (exp(-k / gamma) over their
    sum) are known before any logits are, so W2's gradient can be summed chunk by chunk. The confidence logits are [batch, N, gamma], small, so
    the BCE runs on them as in `dspark_loss`, against the detached acceptance clamp(1 - L1 / 2, 0, 1).
    Equal to `dspark_loss` on `block_logits` in fp32 (tests/test_dspark_chunked.py).

    Args:
        hidden: [batch, N, G, hidden], the drafter's final hidden states (after `norm`), any float dtype.
        predecessors: [batch, N, G] int64, the Markov predecessors (`dspark_model.markov_predecessor_ids`).
        head_weight: [V, hidden], the target's LM head (frozen: no gradient reaches it).
        labels, label_valid: [batch, N, G] int64 / bool (a prefix) from `dspark_model.dspark_block_labels`.
        target_hidden: [batch, N, G, hidden], the target's last hidden state at position a + k
            (`block_target_hidden(target_hidden, anchors, G + 1)`), detached here; may be None when
            neither the L1 nor the BCE term is on.
        confidence_logits: [batch, N, G] float (`DSparkDraftModel.confidence_logits`), or None for no BCE term.
        markov_w1, markov_w2: the Markov head's weights, [V, r] each (`markov_w1.weight`,
            `markov_w2.weight`), or None without a Markov head.
        ce_weight, l1_weight, confidence_weight: the terms' weights; a weight <= 0 drops its term.
        gamma: position decay, w = exp(-k / gamma).
        chunk_size: valid rows per chunk, >= 1.
        output_multiplier, final_logit_softcapping: the drafter config's logit scaling and cap, on the head's
            logits, the drafter's and the target's (`DSparkDraftModel.compute_logits`).
        valid_index: [T, 3] int64, `label_valid.nonzero()` found ahead (on the host, no wait for the device);
            None: found here.
        compiled: run each chunk's elementwise work (softmaxes, CE, L1, argmax, the logits' gradient) through
            `compiled_dspark_chunk` (GPU training, as `weighted_block_loss(..., compiled=True)`) instead of the
            eager `dspark_terms_and_grad_chunk`; the matmuls run eagerly either way.
    Returns:
        loss: scalar float32 (0 with a graph when nothing is valid). Backpropagate it once.
        terms: {"ce", "l1", "bce"}: each unweighted term, detached float32 (0 when dropped).
        accepted: [G] float32; at slot k, the share of blocks with a label at k whose argmax is right at
            every slot 0..k (NaN where no block has a label at k), as `weighted_block_loss`'s.
    Raises:
        ValueError: when the L1 or BCE term is on and target_hidden is None, or only one Markov weight is given.
    """
    with_l1 = l1_weight > 0 or (confidence_weight > 0 and confidence_logits is not None)
    if with_l1 and target_hidden is None:
        raise ValueError("DSpark's L1 and BCE terms compare with the target's distribution: pass target_hidden (block_target_hidden)")
    if (markov_w1 is None) != (markov_w2 is None):
        raise ValueError("pass both Markov weights (markov_w1 and markov_w2), or neither")
    b_index, n_index, k_index = (label_valid.nonzero() if valid_index is None else valid_index).unbind(1)  # each [T] int64
    slots = torch.arange(label_valid.shape[-1], device=hidden.device, dtype=torch.float32)
    w = torch.exp(-slots / gamma)[k_index]  # [T]
    denominator = w.sum() + 1e-6
    rows = hidden[b_index, n_index, k_index]  # [T, hidden]
    markov_rows = None if markov_w1 is None else F.embedding(predecessors[b_index, n_index, k_index], markov_w1)  # [T, r]
    target_rows = target_hidden.detach()[b_index, n_index, k_index] if with_l1 else None  # [T, hidden]
    ce_coef = w * (ce_weight / denominator) if ce_weight > 0 else torch.zeros_like(w)  # [T]
    l1_coef = w * (l1_weight / denominator) if l1_weight > 0 else torch.zeros_like(w)  # [T]
    total, ce, l1, hit = fused_linear_dspark_loss(
        rows,
        head_weight.detach(),
        labels[b_index, n_index, k_index],
        ce_coef,
        l1_coef,
        chunk_size,
        target_rows,
        markov_rows,
        markov_w2,
        output_multiplier,
        final_logit_softcapping,
        compiled_dspark_chunk if compiled else dspark_terms_and_grad_chunk,
    )
    zero = total.detach() * 0.0
    terms = {
        "ce": (w * ce).sum() / denominator if ce_weight > 0 else zero,
        "l1": (w * l1).sum() / denominator if l1_weight > 0 else zero,
        "bce": zero,
    }
    loss = total
    if confidence_logits is not None:
        confidence = confidence_logits[b_index, n_index, k_index].float()  # [T]
        if confidence_weight > 0:
            accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)  # [T], detached (l1 is)
            bce = (w * F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")).sum() / denominator
            loss, terms["bce"] = loss + confidence_weight * bce, bce
        loss = loss + confidence.sum() * 0.0  # every parameter gets a gradient (ZeRO needs it on every rank)
    correct = torch.zeros_like(label_valid)  # [batch, N, G] bool
    correct[b_index, n_index, k_index] = hit
    accepted = (correct.to(torch.int32).cumprod(dim=-1).bool() & label_valid).sum(dim=(0, 1)).float()  # [G]
    return loss, {name: value.detach().float() for name, value in terms.items()}, accepted / label_valid.sum(dim=(0, 1)).float()
