"""FLOP counts of DFlash training, analytic: the useful FLOPs of one drafter training step, by part
(`drafter_step_flops`, with `visible_pairs` for the attention), and a target's forward
(`target_forward_flops`). bench_dflash.py reports useful TFLOP/s and MFU from them, and
tools/anchor_flops.py the share of a step that padded anchor slots take.

Useful FLOPs: matmul work that the math needs, nothing recomputed.
fwd = 2 x multiply-accumulates; bwd = 2 x fwd where both the weight and the input gradient are
needed, 1 x fwd where only one is. Per micro-batch (L drafter layers, T = valid label positions):
  fc            [ctx tokens, 5*hidden] x [5*hidden, hidden]         bwd 1x (weight grad only: the features need no grad)
  context_kv    k/v projections of every context token, L layers     bwd 2x (the KV injection)
  block_qkvo    q/k/v/o projections of the B tokens of every valid anchor's block, L layers   bwd 2x
  mlp           gate/up/down of the same block tokens, L layers      bwd 2x
  attention     QK^T and PV over the mask's VISIBLE keys only: a query of block j sees a_j
                context keys (kv < a_j) plus the B keys of its own block; padded anchor slots
                count nothing                                       bwd 2x (no score recompute)
  lm_head       T x hidden x vocab, label positions 1..B-1 only      bwd 1x (frozen head: input grad only)
  target_head   T x hidden x vocab, the target's logits for the distribution losses (loss_kl, ...)   bwd 0x
Not counted: norms, RoPE, softmax, the loss's elementwise work, the optimizer. Block position 0 of
the LAST layer goes through q/o/MLP without feeding any label (about 1% of the layer work); it is
counted, as the model computes it. The checkpointed loss of weighted_block_loss recomputes the head forward
in backward (one extra head fwd, ~14% of the useful work at 256 anchors): that is executed but
not useful, so it is not counted (bench_dflash.py's fused_ce removes it). tests/test_flops.py checks
this count against torch's FlopCounterMode.
"""

import torch
from transformers import Qwen3Config

from dflash_model import DFlashConfig


def drafter_step_flops(
    config: DFlashConfig,
    seq_len: int,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    label_valid: torch.Tensor,
    *,
    dense_attention: bool = False,
    distribution_loss: bool = False,
) -> dict[str, tuple[int, int]]:
    """Useful FLOPs of one drafter training step (forward + backward), by part.

    Args:
        config: the drafter config (sizes, L layers, B, len(target_layer_ids) context features).
        seq_len: S, context length of every row.
        anchors, anchor_valid: [batch, N] from `sample_anchors`.
        label_valid: [batch, N, B-1] from `block_labels`.
        dense_attention: count every block slot (padded ones too) and every (query, key) pair of
            the [N*B, S + N*B] score matrix, as dense SDPA executes it, instead of the useful
            work (valid blocks, visible keys only). Used to compare with FlopCounterMode.
        distribution_loss: the loss compares with the target's distribution (kl, tv, nla, lk), whose
            logits the same head computes from the target's hidden states: adds target_head.
    Returns:
        {part: (forward FLOPs, backward FLOPs)} for fc, context_kv, block_qkvo, mlp, attention, lm_head
        (and target_head).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers, block_size, vocab = config.num_hidden_layers, config.block_size, config.vocab_size
    features = len(config.target_layer_ids)
    batch, num_anchors = anchors.shape
    valid = anchor_valid.bool()
    if dense_attention:
        blocks = batch * num_anchors
        pairs = layers * batch * num_anchors * block_size * (seq_len + num_anchors * block_size)
    else:
        blocks = int(valid.sum())
        pairs = sum(visible_pairs(anchors, valid, block_size, *config.attention_rule(i)) for i in range(layers))
    block_tokens = blocks * block_size
    context_tokens = batch * seq_len
    labels = int(label_valid.sum())
    fwd = {
        "fc": 2 * context_tokens * features * hidden * hidden,
        "context_kv": 2 * layers * context_tokens * hidden * 2 * kv_heads * head_dim,
        "block_qkvo": 2 * layers * block_tokens * hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim),
        "mlp": 2 * layers * block_tokens * 3 * hidden * inter,
        "attention": 2 * pairs * heads * 2 * head_dim,  # QK^T and PV, 2*head_dim MACs per (query, key, head), all layers
        "lm_head": 2 * labels * hidden * vocab,
    }
    if distribution_loss:
        fwd["target_head"] = fwd["lm_head"]
    bwd_factor = {"fc": 1, "lm_head": 1, "target_head": 0}  # one of the two gradients only (none for the target); the rest need both
    return {part: (f, bwd_factor.get(part, 2) * f) for part, f in fwd.items()}


def visible_pairs(anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs one layer's training mask lets through, over the valid anchors' blocks.

    Query i of the block at anchor a sits at q = a + i. Context: keys k < a, and k > q - window
    with a window. Own block: keys at a .. a+B-1, those <= q when causal, within the window.
    Worked example, full rule, a = 7, B = 4: 4 queries x (7 + 4) keys = 44; causal window 3:
    context keys 5, 6 / 6 / none / none and block keys 7 / 7, 8 / 7..9 / 8..10 -> 3 + 9 = 12.
    """
    offsets = torch.arange(block_size, device=anchors.device)
    a = anchors[..., None].long()  # [batch, N, 1]
    q = a + offsets  # [batch, N, B]
    lowest = a if window is None else torch.maximum(a, q - window + 1)  # lowest visible block key
    highest = q if causal else (a + block_size - 1 if window is None else torch.minimum(a + block_size - 1, q + window - 1))
    context = a if window is None else (a - (q - window + 1).clamp(min=0)).clamp(min=0)
    per_query = (context + (highest - lowest + 1)).expand_as(q)  # [batch, N, B]
    return int((per_query * anchor_valid[..., None]).sum())


def target_forward_flops(config: Qwen3Config, num_layers: int, batch: int, seq_len: int) -> int:
    """Forward FLOPs of `num_layers` decoder layers of a Qwen3 target over [batch, seq_len] tokens, causal attention."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    tokens = batch * seq_len
    linear = 2 * tokens * (hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim) + 3 * hidden * inter)
    attention = 2 * batch * (seq_len * (seq_len + 1) // 2) * heads * 2 * head_dim
    return num_layers * (linear + attention)
