"""dflash_flops.py's analytic FLOP count against torch's FlopCounterMode, and bench_dflash.py's fused loss against weighted_block_loss.

FlopCounterMode counts the matmuls that actually run. SDPA is forced onto the math backend, whose
matmuls it counts densely over the whole [Q, KV] score matrix (it has no formula for the CPU flash
kernel), so the comparison uses `drafter_step_flops(..., dense_attention=True)`; the visible-keys
count (what the benchmark reports as useful) is checked against the dense mask's True entries.
Forward FLOPs are compared part by part (per module); forward + backward as totals, because
FlopCounterMode attributes backward matmuls to modules loosely.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config

from dflash_bench_training import fused_dflash_loss
from dflash_features import TargetFeatureExtractor
from dflash_flops import drafter_step_flops, target_forward_flops, visible_pairs
from dflash_loss import loss_weights, weighted_block_loss
from dflash_loss_kernels import weighted_ce_and_grad_chunk, weighted_ce_and_grad_chunk_functional
from dflash_masks import block_labels, dense_anchor_block_mask, sample_anchors
from dflash_model import DFlashDraftModel
from dflash_target import drafter_config_for_target

VOCAB = 128
HIDDEN = 32
BLOCK = 4


def tiny_target_config(num_layers=6):
    return Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )


def tiny_drafter(num_draft_layers=2):
    """A 2-layer drafter reading 2 target layers ([1, 3] of 6), with frozen random target tables."""
    config = drafter_config_for_target(tiny_target_config(), mask_token_id=VOCAB - 1, num_draft_layers=num_draft_layers, block_size=BLOCK)
    drafter = DFlashDraftModel(config)
    drafter.attach_target(nn.Embedding(VOCAB, HIDDEN).requires_grad_(False), nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False))
    return drafter


def tiny_batch(config, batch=2, seq_len=24, num_anchors=5, prompt=(3, 20)):
    """Random rows; row i's loss mask starts at prompt[i], so row 1 has fewer eligible anchors than slots (padding)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (batch, seq_len), generator=generator)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row, start in enumerate(prompt[:batch]):
        loss_mask[row, start:] = True
    features = torch.randn(batch, seq_len, len(config.target_layer_ids) * HIDDEN, generator=generator)
    anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, generator)
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, anchor_valid, BLOCK)
    return input_ids, features, anchors, anchor_valid, labels, label_valid


def count(fn) -> dict[str, int]:
    """Run fn under FlopCounterMode with math SDPA; {module name: FLOPs} ('Global' = everything)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
        fn()
    return {name: sum(ops.values()) for name, ops in mode.get_flop_counts().items()}


def linear_flops(counts, num_layers, names) -> int:
    return sum(counts.get(f"DFlashDraftModel.layers.{i}.{name}", 0) for i in range(num_layers) for name in names)


def test_forward_parts_match_flop_counter():
    drafter = tiny_drafter()
    config = drafter.config
    input_ids, features, anchors, anchor_valid, labels, label_valid = tiny_batch(config)
    assert not anchor_valid.all(), "the batch should have padded anchor slots"
    head_weight = drafter.target_lm_head.weight
    weights = loss_weights(BLOCK, 4.0)

    @torch.no_grad()  # the forward alone: with grad enabled weighted_block_loss also computes its input gradient
    def forward():
        hidden = drafter(features, input_ids, anchors, anchor_valid, attention_backend="sdpa")
        weighted_block_loss(hidden[:, :, 1:], head_weight, labels, label_valid, weights)

    counts = count(forward)
    seq_len = input_ids.shape[1]
    dense = {k: f for k, (f, _) in drafter_step_flops(config, seq_len, anchors, anchor_valid, label_valid, dense_attention=True).items()}
    layers = config.num_hidden_layers
    projections = linear_flops(counts, layers, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"])
    mlp = linear_flops(counts, layers, ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    attention = counts["DFlashDraftModel"] - counts["DFlashDraftModel.fc"] - projections - mlp
    head = counts["Global"] - counts["DFlashDraftModel"]

    assert counts["DFlashDraftModel.fc"] == pytest.approx(dense["fc"], rel=0.02)
    assert projections == pytest.approx(dense["context_kv"] + dense["block_qkvo"], rel=0.02)
    assert mlp == pytest.approx(dense["mlp"], rel=0.02)
    assert head == pytest.approx(dense["lm_head"], rel=0.02)
    assert attention == pytest.approx(dense["attention"], rel=0.02)  # SDPA counted dense: every (query, key) pair


def test_visible_keys_equal_the_dense_masks_true_entries():
    config = tiny_drafter().config
    input_ids, _, anchors, anchor_valid, _, label_valid = tiny_batch(config)
    seq_len = input_ids.shape[1]
    per_pair = 2 * config.num_hidden_layers * config.num_attention_heads * 2 * config.head_dim
    useful = drafter_step_flops(config, seq_len, anchors, anchor_valid, label_valid)["attention"][0]
    dense = drafter_step_flops(config, seq_len, anchors, anchor_valid, label_valid, dense_attention=True)["attention"][0]
    mask = dense_anchor_block_mask(anchors, anchor_valid, seq_len, BLOCK)  # [batch, 1, Q, KV]
    padded_slots = int((~anchor_valid).sum())
    # A padded slot's queries see only their own block (B x B pairs): executed, not useful.
    assert useful // per_pair + padded_slots * BLOCK * BLOCK == int(mask.sum())
    assert dense // per_pair == mask.numel()
    # By hand for one valid anchor: B queries x (a context keys + B block keys).
    one = drafter_step_flops(config, seq_len, torch.tensor([[7]]), torch.tensor([[True]]), torch.ones(1, 1, BLOCK - 1, dtype=torch.bool))
    assert one["attention"][0] == per_pair * BLOCK * (7 + BLOCK)


@pytest.mark.parametrize("causal, window", [(True, 3), (False, 3), (True, None), (True, 30)])
def test_visible_pairs_of_every_layer_rule_equal_the_masks_true_entries(causal, window):
    config = tiny_drafter().config
    input_ids, _, anchors, anchor_valid, _, _ = tiny_batch(config)
    mask = dense_anchor_block_mask(anchors, anchor_valid, input_ids.shape[1], BLOCK, causal, window)
    # Padded slots (anchor 0) see only their own block, under the same rule.
    assert visible_pairs(anchors, anchor_valid, BLOCK, causal, window) + visible_pairs(anchors, ~anchor_valid, BLOCK, causal, window) == int(
        mask.sum()
    )
    assert visible_pairs(torch.tensor([[7]]), torch.tensor([[True]]), BLOCK, True, 3) == 12  # the docstring's worked example


@pytest.mark.parametrize("fused", [False, True])
def test_step_total_matches_flop_counter(fused):
    """fwd + bwd: every part 3x its forward except fc and the frozen head (2x); neither
    weighted_block_loss (which computes its input gradient in the forward) nor the benchmark's fused
    variant recomputes the head."""
    drafter = tiny_drafter()
    config = drafter.config
    input_ids, features, anchors, anchor_valid, labels, label_valid = tiny_batch(config)
    head_weight = drafter.target_lm_head.weight
    weights = loss_weights(BLOCK, 4.0)
    loss_fn = fused_dflash_loss if fused else weighted_block_loss

    def step():
        hidden = drafter(features, input_ids, anchors, anchor_valid, attention_backend="sdpa")
        loss, _ = loss_fn(hidden[:, :, 1:], head_weight, labels, label_valid, weights, chunk_size=16)
        loss.backward()

    measured = count(step)["Global"]
    parts = drafter_step_flops(config, input_ids.shape[1], anchors, anchor_valid, label_valid, dense_attention=True)
    expected = sum(f + b for f, b in parts.values())
    assert parts["fc"][1] == parts["fc"][0] and parts["lm_head"][1] == parts["lm_head"][0]
    assert parts["mlp"][1] == 2 * parts["mlp"][0]
    assert measured == pytest.approx(expected, rel=0.02)


def test_distribution_loss_step_counts_the_target_head():
    """With a loss against the target's distribution the same head also computes the target's logits
    (forward only): the step's total grows by exactly drafter_step_flops' target_head part."""
    from dflash_loss import block_target_hidden

    drafter = tiny_drafter()
    config = drafter.config
    input_ids, features, anchors, anchor_valid, labels, label_valid = tiny_batch(config)
    target_hidden = block_target_hidden(torch.randn(*input_ids.shape, HIDDEN), anchors, BLOCK)  # [batch, N, B-1, hidden]

    def step(**objective):
        hidden = drafter(features, input_ids, anchors, anchor_valid, attention_backend="sdpa")
        loss, _ = fused_dflash_loss(
            hidden[:, :, 1:], drafter.target_lm_head.weight, labels, label_valid, loss_weights(BLOCK, 4.0), chunk_size=16, **objective
        )
        loss.backward()

    parts = drafter_step_flops(config, input_ids.shape[1], anchors, anchor_valid, label_valid, dense_attention=True, distribution_loss=True)
    assert parts["target_head"] == (parts["lm_head"][0], 0)
    # The head's matmuls are counted exactly, so the difference is exact (the part is ~2% of the total here).
    added = count(lambda: step(loss="lk", target_hidden=target_hidden, loss_weighting="dpace"))["Global"] - count(step)["Global"]
    assert added == parts["target_head"][0]


def test_target_forward_flops_match_flop_counter():
    target_config = tiny_target_config()
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM(target_config).eval()
    extractor = TargetFeatureExtractor(target, [1, 3], truncate=True)
    batch, seq_len = 2, 16
    input_ids = torch.randint(0, VOCAB, (batch, seq_len))
    measured = count(lambda: extractor(input_ids, torch.ones_like(input_ids)))["Global"]
    # Math SDPA computes the whole causal score matrix; target_forward_flops counts the lower triangle.
    layers, heads, head_dim = 4, target_config.num_attention_heads, target_config.head_dim
    causal = 2 * batch * (seq_len * (seq_len + 1) // 2) * heads * 2 * head_dim * layers
    dense = 2 * batch * seq_len * seq_len * heads * 2 * head_dim * layers
    assert measured == pytest.approx(target_forward_flops(target_config, layers, batch, seq_len) - causal + dense, rel=0.02)


@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_fused_loss_matches_dflash_loss(chunk_size):
    """Same loss, accuracy and gradients as weighted_block_loss (the benchmark's variants compute the same thing)."""
    torch.manual_seed(0)
    config = tiny_drafter().config
    _, _, anchors, anchor_valid, labels, label_valid = tiny_batch(config)
    hidden = torch.randn(*labels.shape, HIDDEN, requires_grad=True)  # [batch, N, B-1, hidden]
    head_weight = torch.randn(VOCAB, HIDDEN)
    weights = loss_weights(BLOCK, 4.0)
    results = []
    for loss_fn in (weighted_block_loss, fused_dflash_loss):
        loss, accuracy = loss_fn(hidden, head_weight, labels, label_valid, weights, chunk_size=chunk_size)
        (grad,) = torch.autograd.grad(3.0 * loss, hidden)
        results.append((loss, accuracy, grad))
    (loss_a, acc_a, grad_a), (loss_b, acc_b, grad_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc_b, acc_a, equal_nan=True)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-4, atol=1e-6)


def test_compiled_ce_chunk_equals_eager_chunk():
    """The function fused_ce_compiled compiles computes what the eager chunk does (checked eagerly here)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(9, VOCAB, generator=generator).bfloat16()
    targets = torch.randint(0, VOCAB, (9,), generator=generator)
    weights = torch.rand(9, generator=generator)
    for a, b in zip(weighted_ce_and_grad_chunk(logits, targets, weights), weighted_ce_and_grad_chunk_functional(logits, targets, weights)):
        torch.testing.assert_close(a, b)
