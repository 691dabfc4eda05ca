"""The drafter against slow, hand-built references: mask, labels, loss, flex vs SDPA, export, draft pass."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen3Config

from dflash_loss import default_loss_gamma, estimate_acceptance_length, loss_weights, weighted_block_loss
from dflash_masks import (
    anchor_slots,
    block_input_ids,
    block_label_valid,
    block_labels,
    block_position_ids,
    create_anchor_block_mask,
    dense_anchor_block_mask,
    sample_anchors,
)
from dflash_model import DFlashConfig, DFlashDraftModel, default_target_layer_ids, resolve_layer_types, scale_and_cap_logits
from dflash_runners import DFlashStaticContextCache  # the static cache lives where it is used
from dflash_target import drafter_config_for_target

VOCAB = 64
MASK_ID = 63


def tiny_drafter(block_size=4, num_draft_layers=2, seed=0, **layout):
    """A drafter at hidden 16 over a tiny Qwen3 target config, with random target tables attached.
    `layout`: layer_types / sliding_window / is_causal for `drafter_config_for_target`."""
    torch.manual_seed(seed)
    target_config = Qwen3Config(
        hidden_size=16, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=VOCAB
    )
    config = drafter_config_for_target(target_config, mask_token_id=MASK_ID, num_draft_layers=num_draft_layers, block_size=block_size, **layout)
    drafter = DFlashDraftModel(config).eval()
    drafter.attach_target(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB, bias=False))
    return drafter


def reference_mask(anchors, anchor_valid, seq_len, block_size):
    """Element-by-element mask, written from the training rule (anchor_block_mask_mod's docstring) with plain loops."""
    batch, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    mask = torch.zeros(batch, 1, q_len, seq_len + q_len, dtype=torch.bool)
    for b in range(batch):
        for j in range(num_anchors):
            for q in range(j * block_size, (j + 1) * block_size):
                if anchor_valid[b, j]:
                    for kv in range(seq_len):
                        mask[b, 0, q, kv] = kv < anchors[b, j]  # strictly before the anchor
                for kv in range(seq_len + j * block_size, seq_len + (j + 1) * block_size):
                    mask[b, 0, q, kv] = True  # own block, bidirectional
    return mask


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_mask_equals_hand_built_reference(block_size):
    seq_len = 20
    # Overlapping anchors (3 and 4), an anchor at the last eligible position (18), an anchor at 0,
    # and padded slots in the second row.
    anchors = torch.tensor([[0, 3, 4, 18], [5, 9, 0, 0]])
    anchor_valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    expected = reference_mask(anchors, anchor_valid, seq_len, block_size)
    assert torch.equal(dense_anchor_block_mask(anchors, anchor_valid, seq_len, block_size), expected)
    # The flex BlockMask encodes the same rule.
    block_mask = create_anchor_block_mask(anchors, anchor_valid, seq_len, block_size)
    q_len = anchors.shape[1] * block_size
    assert block_mask.shape == (2, 1, q_len, seq_len + q_len)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(q_len), torch.arange(seq_len + q_len), indexing="ij")
    assert torch.equal(block_mask.mask_mod(b, 0, q, kv), expected[:, 0])


def test_mask_semantics_spelled_out():
    seq_len, block_size = 10, 4
    anchors, valid = torch.tensor([[3, 4]]), torch.tensor([[True, True]])
    mask = dense_anchor_block_mask(anchors, valid, seq_len, block_size)[0, 0]
    # Block 0 (anchor 3): context 0, 1, 2 visible; context 3 (the anchor itself) is not.
    assert mask[0, :3].all() and not mask[0, 3:seq_len].any()
    # Block 1 (anchor 4) overlaps block 0 in positions but never sees its keys.
    assert mask[4, :4].all() and not mask[4, 4:seq_len].any()
    assert not mask[4:8, seq_len : seq_len + 4].any() and not mask[0:4, seq_len + 4 :].any()
    # Bidirectional inside a block: the first query sees the last key of its block.
    assert mask[0, seq_len + 3] and mask[3, seq_len]


def test_padded_anchor_slot_sees_only_its_own_block():
    anchors, valid = torch.tensor([[5, 0]]), torch.tensor([[True, False]])
    mask = dense_anchor_block_mask(anchors, valid, 8, 2)[0, 0]
    assert not mask[2:4, :8].any() and mask[2:4, 8 + 2 : 8 + 4].all()
    assert mask.any(dim=-1).all(), "no fully masked query row (softmax would be NaN)"


def test_blocks_labels_and_positions():
    block_size, seq_len = 4, 12
    input_ids = torch.arange(100, 100 + seq_len)[None]
    loss_mask = torch.ones(1, seq_len, dtype=torch.bool)
    loss_mask[0, 7] = False  # one untrained token inside a block
    anchors, valid = torch.tensor([[2, 5, 10, 0]]), torch.tensor([[True, True, True, False]])
    ids = block_input_ids(input_ids, anchors, MASK_ID, block_size).view(4, block_size)
    assert ids[:, 0].tolist() == [102, 105, 110, 100] and (ids[:, 1:] == MASK_ID).all()
    positions = block_position_ids(anchors, block_size).view(4, block_size)
    assert positions[0].tolist() == [2, 3, 4, 5] and positions[2].tolist() == [10, 11, 12, 13]
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, block_size)
    # The block at anchor a predicts tokens a+1 .. a+B-1, sitting at positions a+1 .. a+B-1.
    assert labels[0, 0].tolist() == [103, 104, 105]
    assert labels[0, 0].tolist() == (100 + positions[0, 1:]).tolist()
    assert label_valid[0, 0].tolist() == [True, True, True]
    assert label_valid[0, 1].tolist() == [True, False, True]  # token 7 is outside the loss mask
    assert label_valid[0, 2].tolist() == [True, False, False]  # past the sequence end
    assert not label_valid[0, 3].any()  # padded slot


def test_sample_anchors_eligibility_and_determinism():
    loss_mask = torch.zeros(3, 30, dtype=torch.bool)
    loss_mask[0, 5:25] = True
    loss_mask[1, 10:13] = True  # only 10 and 11 are eligible
    draw = lambda: sample_anchors(loss_mask, 8, torch.Generator().manual_seed(7))
    anchors, valid = draw()
    assert anchors.shape == (3, 8) and valid.shape == (3, 8)
    row0 = anchors[0][valid[0]]
    assert len(row0) == 8 and len(set(row0.tolist())) == 8  # without replacement
    assert ((row0 >= 5) & (row0 <= 23)).all() and torch.equal(row0, row0.sort().values)
    assert anchors[1][valid[1]].tolist() == [10, 11] and valid[1].tolist() == [True] * 2 + [False] * 6
    assert not valid[2].any()
    again, _ = draw()
    assert torch.equal(anchors, again)
    other, _ = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(8))
    assert not torch.equal(anchors[0], other[0])
    # More slots than positions: padded to a static shape.
    short, short_valid = sample_anchors(torch.ones(1, 5, dtype=torch.bool), 16)
    assert short.shape == (1, 16) and short_valid.sum() == 4


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's drafters
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(6, 2) == [1, 3]


def test_loss_weights_worked_example():
    w = loss_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[7], torch.tensor(math.exp(-1.0)), rtol=0, atol=1e-7)
    torch.testing.assert_close(loss_weights(8)[4], torch.tensor(math.exp(-1.0)), rtol=0, atol=1e-7)


def test_every_block_size_has_a_default_gamma():
    assert [default_loss_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]  # the paper's values, exactly
    # Elsewhere the least-squares line through the paper's points: (19 B + 62) / 52.
    assert default_loss_gamma(12) == pytest.approx(5.5769, abs=1e-4) and default_loss_gamma(4) == pytest.approx(2.6538, abs=1e-4)
    for b, paper in ((16, 7.0), (10, 5.0), (8, 4.0)):
        assert abs((19 * b + 62) / 52 - paper) < 0.16  # the line stays close to the points it was fitted to
    gammas = [default_loss_gamma(b) for b in range(2, 65)]
    assert all(g > 1.9 for g in gammas) and gammas == sorted(gammas)  # positive and growing with B
    w = loss_weights(12)
    assert w.shape == (11,)
    torch.testing.assert_close(w[5], torch.tensor(math.exp(-5 / default_loss_gamma(12))), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        loss_weights(1)
    with pytest.raises(ValueError, match="--loss_decay_gamma must be > 0"):
        loss_weights(8, gamma=0.0)


def test_weighted_loss_equals_hand_computed_value():
    # One row, two anchors, B = 3: four label positions, one of them invalid.
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # vocab 3, hidden 2
    hidden = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [5.0, 5.0]]]])  # [1, 2, 2, 2]
    labels = torch.tensor([[[0, 1], [2, 0]]])
    valid = torch.tensor([[[True, True], [True, False]]])
    weights = torch.tensor([1.0, 0.5])
    loss, acc = weighted_block_loss(hidden, head, labels, valid, weights, chunk_size=2)

    def ce(h, y):
        logits = [h[0] * head[v, 0] + h[1] * head[v, 1] for v in range(3)]
        return math.log(sum(math.exp(z) for z in logits)) - logits[y]

    expected = (1.0 * ce([2, 0], 0) + 0.5 * ce([0, 1], 1) + 1.0 * ce([1, 1], 2)) / (1.0 + 0.5 + 1.0)
    assert abs(loss.item() - expected) < 1e-6
    # argmax: [2,0] -> logits [2,0,2] picks 0 (first max) = label 0; [0,1] -> [0,1,1] picks 1 = label 1;
    # [1,1] -> [1,1,2] picks 2 = label 2. The invalid position never counts.
    assert acc.tolist() == [1.0, 1.0]
    # The valid rows found ahead (the trainer finds them on the host) give the same loss.
    ahead, acc_ahead = weighted_block_loss(hidden, head, labels, valid, weights, chunk_size=2, valid_index=valid.nonzero())
    assert torch.equal(ahead, loss) and torch.equal(acc_ahead, acc)


def test_label_validity_from_the_loss_mask_alone_equals_block_labels():
    """block_label_valid, which the trainer runs on the host, is block_labels' label_valid: anchor
    slots padded, labels past the end, and positions outside the loss mask excluded."""
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 3:9] = True  # the last position is padding
    loss_mask[1, 6:] = True
    anchors, anchor_valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    input_ids = torch.arange(20).view(2, 10)
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, anchor_valid, 4)
    assert torch.equal(block_label_valid(loss_mask, anchors, anchor_valid, 4), label_valid)
    # Row 1: eligible anchors 6, 7, 8 (then 3 padded slots); anchor 8 has one label in range (9).
    assert anchors[1].tolist() == [6, 7, 8, 0, 0, 0]
    assert label_valid[1].tolist() == [[True, True, True], [True, True, False], [True, False, False]] + [[False] * 3] * 3
    assert labels[1, 0].tolist() == [17, 18, 19]


def random_loss_inputs():
    """Seeded loss inputs: hidden [2, 3, 5, 8] (batch, anchors, B - 1, hidden; requires grad), LM head
    [40, 8], labels [2, 3, 5], valid [2, 3, 5] (about 70% True), weights of block size 6, gamma 2."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 5, 8, requires_grad=True)
    head = torch.randn(40, 8)
    labels = torch.randint(0, 40, (2, 3, 5))
    valid = torch.rand(2, 3, 5) > 0.3
    return hidden, head, labels, valid, loss_weights(6, gamma=2.0)


def test_padding_never_counts_and_chunking_is_exact():
    hidden, head, labels, valid, weights = random_loss_inputs()
    loss_a, acc_a = weighted_block_loss(hidden, head, labels, valid, weights, chunk_size=4)
    (grad_a,) = torch.autograd.grad(loss_a, hidden)
    # Reference: full logits, plain loops.
    num, den = 0.0, 0.0
    for idx in valid.nonzero().tolist():
        b, n, k = idx
        num += weights[k] * F.cross_entropy(hidden[b, n, k] @ head.t(), labels[b, n, k])
        den += weights[k]
    torch.testing.assert_close(loss_a, num / den, rtol=1e-6, atol=1e-6)
    (grad_ref,) = torch.autograd.grad(num / den, hidden)
    torch.testing.assert_close(grad_a, grad_ref, rtol=1e-5, atol=1e-7)
    assert (grad_a[~valid] == 0).all()
    # Changing labels and hidden at invalid positions changes nothing.
    hidden2 = hidden.detach().clone()
    hidden2[~valid] = 1e3
    labels2 = labels.masked_fill(~valid, 0)
    loss_b, acc_b = weighted_block_loss(hidden2, head, labels2, valid, weights, chunk_size=1000)
    torch.testing.assert_close(loss_b, loss_a.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_b, acc_a, equal_nan=True)


def test_loss_with_no_valid_label_is_zero_with_a_graph():
    hidden = torch.randn(1, 2, 3, 4, requires_grad=True)
    loss, acc = weighted_block_loss(
        hidden, torch.randn(10, 4), torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3, dtype=torch.bool), loss_weights(4, 2.0)
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.isnan(acc).all() and (hidden.grad == 0).all()


def test_accepted_counts_runs_of_right_draft_tokens_per_block():
    """Three blocks of B - 1 = 3 label positions, argmax = the hidden state's hot index: right, right,
    wrong / right, wrong, right / right, right, no label. Verification stops at a block's first wrong
    position, so the block that is right again after a miss accepts 1, not 2."""
    head = torch.eye(3)  # vocab 3, hidden 3: logits = hidden
    drafted = torch.tensor([[[0, 1, 2], [0, 1, 2], [0, 1, 2]]])  # [1, 3, 3], argmax per position
    hidden = F.one_hot(drafted, 3).float()
    labels = torch.tensor([[[0, 1, 0], [0, 2, 2], [0, 1, 0]]])
    valid = torch.tensor([[[True, True, True], [True, True, True], [True, True, False]]])
    _, accepted = weighted_block_loss(hidden, head, labels, valid, loss_weights(4, 2.0))
    # k=1: 3 of 3 blocks right; k=2: blocks 0 and 2 of 3 right through 2; k=3: none of the 2 labelled.
    torch.testing.assert_close(accepted, torch.tensor([1.0, 2 / 3, 0.0]))
    assert abs(estimate_acceptance_length(accepted) - (1 + 1 + 2 / 3)) < 1e-6  # per-position accuracies would give 3.0


def test_estimate_acceptance_length():
    assert abs(estimate_acceptance_length(torch.tensor([0.9, 0.72, 0.36])) - 2.98) < 1e-6
    assert estimate_acceptance_length(torch.tensor([1.0] * 15)) == 16.0
    assert estimate_acceptance_length(torch.tensor([float("nan"), 1.0])) == 2.0


def _batch(seq_len=24, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, MASK_ID, (batch, seq_len), generator=g)
    loss_mask = torch.ones(batch, seq_len, dtype=torch.bool)
    loss_mask[:, :4] = False
    loss_mask[-1, seq_len - 6 :] = False  # a right-padded row
    return input_ids, loss_mask


def test_compiled_flex_forward_equals_sdpa_on_cpu():
    drafter = tiny_drafter(block_size=4)
    input_ids, loss_mask = _batch()
    features = torch.randn(2, input_ids.shape[1], 2 * 16)
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1))
    valid[0, -1] = False  # a padded slot too
    with torch.no_grad():
        sdpa = drafter(features, input_ids, anchors, valid, attention_backend="sdpa")
        flex = drafter(features, input_ids, anchors, valid, attention_backend="flex")
    assert sdpa.shape == (2, 6, 4, 16)
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-5)


def test_draft_pass_matches_training_forward():
    """Inference (cached context, one block, no mask) computes what training computes for that anchor."""
    drafter = tiny_drafter(block_size=4)
    input_ids, _ = _batch(batch=1)
    features = torch.randn(1, input_ids.shape[1], 2 * 16)
    anchor = 13
    with torch.no_grad():
        hidden = drafter(features, input_ids, torch.tensor([[anchor]]), torch.tensor([[True]]))
        expected = drafter.target_lm_head(hidden[0, 0, 1:]).argmax(-1)
        # Context arrives in two pieces, as it does during speculative decoding.
        cache = drafter.extend_context(None, features[:, :9])
        cache = drafter.extend_context(cache, features[:, 9:anchor])
        assert cache.length == anchor
        draft = drafter.draft_block(cache, input_ids[:, anchor])
    assert cache.length == anchor, "a draft pass leaves the cache at the context"
    assert torch.equal(draft[0], expected)
    cache.crop(5)
    assert cache.length == 5 and cache.keys[0].shape[2] == 5


def test_trimmed_anchor_slots_give_the_same_loss_and_gradients():
    loss_mask = torch.zeros(3, 40, dtype=torch.bool)
    loss_mask[0, 20:31] = True  # 10 eligible positions (20..29)
    loss_mask[1, 30:] = True  # 9
    loss_mask[2, 36:] = True  # 3
    assert anchor_slots(loss_mask, 32, 4) == 12 and anchor_slots(loss_mask, 32, 16) == 16
    assert anchor_slots(loss_mask, 8, 4) == 8  # never more than --num_anchors
    assert anchor_slots(torch.zeros(2, 40, dtype=torch.bool), 32, 4) == 4  # nothing eligible: one bucket
    drafter = tiny_drafter(block_size=4).train()
    input_ids = torch.randint(0, VOCAB - 1, (3, 40), generator=torch.Generator().manual_seed(1))
    features = torch.randn(3, 40, 2 * 16, generator=torch.Generator().manual_seed(2))
    weights = loss_weights(4, gamma=2.0)

    def loss_and_grads(num_anchors):
        anchors, valid = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(3))
        hidden = drafter(features, input_ids, anchors, valid)
        labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
        loss, accuracy = weighted_block_loss(hidden[:, :, 1:], drafter.target_lm_head.weight, labels, label_valid, weights)
        drafter.zero_grad()
        loss.backward()
        return anchors, loss, accuracy, [p.grad.clone() for p in drafter.parameters() if p.requires_grad]

    full = loss_and_grads(32)
    trimmed = loss_and_grads(anchor_slots(loss_mask, 32, 4))
    assert full[0].shape == (3, 32) and trimmed[0].shape == (3, 12)
    assert torch.equal(full[0][:, :12], trimmed[0]) and not full[0][:, 12:].any()  # the same anchors, fewer padded slots
    torch.testing.assert_close(trimmed[1], full[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trimmed[2], full[2], rtol=1e-5, atol=1e-6)
    for a, b in zip(trimmed[3], full[3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_falls_on_a_fixed_batch():
    drafter = tiny_drafter(block_size=4).train()
    input_ids, loss_mask = _batch(seq_len=32)
    features = torch.randn(2, 32, 2 * 16)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    weights = loss_weights(4, gamma=2.0)
    losses = []
    for step in range(40):
        anchors, valid = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(step))
        hidden = drafter(features, input_ids, anchors, valid)
        labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
        loss, _ = weighted_block_loss(hidden[:, :, 1:], drafter.target_lm_head.weight, labels, label_valid, weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses


def test_export_round_trip_is_bit_identical(tmp_path):
    drafter = tiny_drafter(block_size=16, num_draft_layers=3)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 16 and config["num_target_layers"] == 6 and config["num_hidden_layers"] == 3
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3]}
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == VOCAB
    assert len(config["layer_types"]) == 3
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert config[key] is not None, key
    weights = load_file(tmp_path / "model.safetensors")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(weights)
    assert all(k.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for k in weights), sorted(weights)
    assert not any("embed_tokens" in k or "lm_head" in k for k in weights)
    assert "layers.2.self_attn.q_norm.weight" in weights and "layers.0.mlp.gate_proj.weight" in weights
    reloaded = DFlashDraftModel.from_pretrained(tmp_path)
    original = drafter.state_dict()
    assert set(reloaded.state_dict()) == set(original)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert reloaded.config.target_layer_ids == [1, 2, 3] and reloaded.config.mask_token_id == MASK_ID
    # The reloaded drafter computes what the original does: the RoPE table (a non-persistent buffer,
    # not in the checkpoint) is rebuilt, not left uninitialised by loading.
    torch.testing.assert_close(reloaded.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq, rtol=0, atol=0)
    reloaded.attach_target(drafter.target_embed_tokens, drafter.target_lm_head)
    input_ids, loss_mask = _batch()
    features = torch.randn(2, input_ids.shape[1], 3 * 16)
    anchors, valid = sample_anchors(loss_mask, 2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(features, input_ids, anchors, valid), drafter.eval()(features, input_ids, anchors, valid))


def test_config_from_llama_target_and_errors():
    llama = LlamaConfig(
        hidden_size=32, num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=100, rope_theta=1e5
    )
    config = drafter_config_for_target(llama, mask_token_id=7)
    assert config.head_dim == 8 and config.num_hidden_layers == 5 and config.num_target_layers == 30
    assert config.target_layer_ids == default_target_layer_ids(30, 5) and config.rope_theta == 1e5
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter_config_for_target(llama, mask_token_id=100)
    with pytest.raises(ValueError, match="target_layer_ids"):
        drafter_config_for_target(llama, mask_token_id=7, target_layer_ids=[1, 30])


def test_scaled_rope_is_exported_for_older_loaders_too(tmp_path):
    """A Llama-3.1-style target: config.json carries rope_scaling (what transformers 4 and the engines'
    parsers read) beside rope_parameters, and both load back to the same scaled RoPE."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    llama31 = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),  # a copy: the config adds rope_theta to it
        max_position_embeddings=131072,
    )
    config = drafter_config_for_target(llama31, mask_token_id=7, num_draft_layers=2)
    DFlashDraftModel(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_scaling"] == scaling and saved["rope_theta"] == 500000.0
    assert saved["rope_parameters"] == {**scaling, "rope_theta": 500000.0}
    # A transformers-4 style reader sees only rope_scaling + rope_theta; the drafter reloads the same table.
    old_style = {k: v for k, v in saved.items() if k != "rope_parameters"}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old_style))
    assert DFlashConfig.from_pretrained(tmp_path / "old").rope_parameters == saved["rope_parameters"]
    reloaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert reloaded.rotary_emb.rope_type == "llama3"
    torch.testing.assert_close(reloaded.rotary_emb.inv_freq, DFlashDraftModel(config).rotary_emb.inv_freq, rtol=0, atol=0)
    # Plain RoPE writes no rope_scaling.
    assert "rope_scaling" not in drafter_config_for_target(LlamaConfig(num_hidden_layers=4), mask_token_id=7).to_dict()


# ----------------------------------------------------------------------------------------------
# Sliding-window layers


def reference_sliding_mask(anchors, anchor_valid, seq_len, block_size, causal, window):
    """Element by element, in plain loops: the full training rule, then for a sliding layer the
    absolute positions (query a_j + i, context key kv, own-block key a_j + i') with
    k <= q when causal and q - k < window (both ways when not causal)."""
    full = reference_mask(anchors, anchor_valid, seq_len, block_size)
    batch, num_anchors = anchors.shape
    for b in range(batch):
        for j in range(num_anchors):
            a = int(anchors[b, j])
            for i in range(block_size):
                q, q_pos = j * block_size + i, a + i
                for kv in range(full.shape[-1]):
                    if not full[b, 0, q, kv]:
                        continue
                    k_pos = kv if kv < seq_len else a + (kv - seq_len - j * block_size)
                    ok = True
                    if causal and k_pos > q_pos:
                        ok = False
                    if window is not None and (q_pos - k_pos >= window or (not causal and k_pos - q_pos >= window)):
                        ok = False
                    full[b, 0, q, kv] = ok
    return full


# Windows shorter than a block (3 < 4), anchors near the window's edge (window 6: anchor 9's first
# query still sees context key 4, its last query no longer), a two-sided window, a causal full layer.
@pytest.mark.parametrize("causal, window", [(True, 3), (True, 6), (False, 3), (True, None)])
def test_sliding_mask_equals_hand_built_reference(causal, window):
    seq_len, block_size = 20, 4
    anchors = torch.tensor([[0, 3, 4, 9, 18], [5, 9, 10, 0, 0]])  # overlapping anchors, padded slots in row 2
    anchor_valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    expected = reference_sliding_mask(anchors, anchor_valid, seq_len, block_size, causal, window)
    dense = dense_anchor_block_mask(anchors, anchor_valid, seq_len, block_size, causal, window)
    assert torch.equal(dense, expected)
    assert not torch.equal(dense, dense_anchor_block_mask(anchors, anchor_valid, seq_len, block_size))  # the rule binds
    assert dense.any(dim=-1).all(), "no fully masked query row"
    block_mask = create_anchor_block_mask(anchors, anchor_valid, seq_len, block_size, causal, window)
    q_len = anchors.shape[1] * block_size
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(q_len), torch.arange(seq_len + q_len), indexing="ij")
    assert torch.equal(block_mask.mask_mod(b, 0, q, kv), expected[:, 0])


def test_sliding_mask_semantics_spelled_out():
    seq_len, block_size, window = 12, 4, 3
    anchors, valid = torch.tensor([[6]]), torch.tensor([[True]])
    mask = dense_anchor_block_mask(anchors, valid, seq_len, block_size, True, window)[0, 0]  # [4, 16]
    own = slice(seq_len, seq_len + block_size)
    # The anchor query (position 6) sees context 4, 5 (6 - 3 < k) and itself; not context 3, nor the block's future.
    assert mask[0, :seq_len].nonzero().flatten().tolist() == [4, 5]
    assert mask[0, own].tolist() == [True, False, False, False]
    # The last query (position 9) sees positions 7, 8, 9: only its own block, no context at all.
    assert not mask[3, :seq_len].any() and mask[3, own].tolist() == [False, True, True, True]
    # Two-sided (is_causal false): position 7 sees 5 .. 9, the block's future included.
    two_sided = dense_anchor_block_mask(anchors, valid, seq_len, block_size, False, window)[0, 0]
    assert two_sided[1, :seq_len].nonzero().flatten().tolist() == [5] and two_sided[1, own].all()


def test_layer_types_settings_and_config_errors():
    assert resolve_layer_types(None, 3) == ["full_attention"] * 3
    assert resolve_layer_types("last_full", 5) == ["sliding_attention"] * 4 + ["full_attention"]
    assert resolve_layer_types("sliding_attention, full_attention", 2) == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="--layer_types has unknown entries \\['sliding'\\]"):
        resolve_layer_types("sliding,full_attention", 2)
    with pytest.raises(ValueError, match="lists 1 layers but the drafter has 2"):
        resolve_layer_types(["full_attention"], 2)
    with pytest.raises(ValueError, match="--sliding_window"):
        tiny_drafter(layer_types="last_full")  # a sliding layer needs a window
    config = tiny_drafter(num_draft_layers=3, layer_types="last_full", sliding_window=5).config
    assert [config.attention_rule(i) for i in range(3)] == [(True, 5), (True, 5), (False, None)]
    config = tiny_drafter(num_draft_layers=2, layer_types="last_full", sliding_window=5, is_causal=False).config
    assert [config.attention_rule(i) for i in range(2)] == [(False, 5), (False, None)]


@pytest.mark.parametrize("is_causal", [None, False])
def test_training_forward_equals_draft_pass_at_every_anchor_mixed_layers(is_causal):
    """sliding (window 3 < B), sliding, full: the training forward's logits at every anchor equal the
    draft pass over a growing cache and over a static one with stale entries past its length."""
    block_size, seq_len = 4, 20
    drafter = tiny_drafter(block_size=block_size, num_draft_layers=3, layer_types="last_full", sliding_window=3, is_causal=is_causal)
    input_ids, _ = _batch(seq_len=seq_len, batch=1)
    width = len(drafter.config.target_layer_ids) * 16
    features = torch.randn(1, seq_len, width)
    anchors = torch.arange(1, seq_len)[None]  # every anchor with some context: overlapping blocks throughout
    with torch.no_grad():
        hidden = drafter(features, input_ids, anchors, torch.ones_like(anchors, dtype=torch.bool))  # [1, N, B, hidden]
        expected = drafter.compute_logits(hidden[0, :, 1:])  # [N, B-1, vocab]
        full_only = tiny_drafter(block_size=block_size, num_draft_layers=3)  # same weights, all layers full
        assert not torch.allclose(full_only(features, input_ids, anchors, torch.ones_like(anchors, dtype=torch.bool)), hidden)
        static = DFlashStaticContextCache(drafter.config, 1, seq_len + 4, torch.float32, "cpu")
        drafter.extend_context(static, torch.randn(1, seq_len + 4, width))  # stale values everywhere
        for j, anchor in enumerate(anchors[0].tolist()):
            growing = drafter.extend_context(None, features[:, :anchor])
            static.crop(0)
            drafter.extend_context(static, features[:, :anchor])
            token = input_ids[:, anchor]
            torch.testing.assert_close(drafter.draft_logits(growing, token)[0], expected[j], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(drafter.draft_logits(static, token)[0], expected[j], rtol=1e-4, atol=1e-5)


def test_export_round_trip_keeps_the_window(tmp_path):
    drafter = tiny_drafter(block_size=8, num_draft_layers=5, layer_types="last_full", sliding_window=2048)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert saved["use_sliding_window"] is True and saved["sliding_window"] == 2048 and saved["max_window_layers"] == 5
    # What an engine's transformers parses: plain Qwen3Config keeps every field.
    plain = Qwen3Config.from_pretrained(tmp_path)
    assert plain.layer_types == saved["layer_types"] and plain.sliding_window == 2048
    reloaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert [reloaded.config.attention_rule(i) for i in range(5)] == [(True, 2048)] * 4 + [(False, None)]
    # All-full drafters write no window.
    tiny_drafter(num_draft_layers=2).save_pretrained(tmp_path / "full")
    full = json.loads((tmp_path / "full" / "config.json").read_text())
    assert full["use_sliding_window"] is False and full["sliding_window"] is None and full["max_window_layers"] == 2
    # A released-style config that leaves the window out is refused, not loaded as full attention.
    del saved["sliding_window"]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="sliding_window is None"):
        DFlashConfig.from_pretrained(tmp_path / "partial")


def test_compiled_flex_forward_equals_sdpa_mixed_layers_on_cpu():
    """Same shapes as the all-full flex test (its graph is reused); the sliding rule compiles its own."""
    drafter = tiny_drafter(block_size=4, layer_types="last_full", sliding_window=5)
    input_ids, loss_mask = _batch()
    features = torch.randn(2, input_ids.shape[1], 2 * 16)
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1))
    valid[0, -1] = False
    with torch.no_grad():
        sdpa = drafter(features, input_ids, anchors, valid, attention_backend="sdpa")
        flex = drafter(features, input_ids, anchors, valid, attention_backend="flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("multiplier, cap", [(0.125, None), (1.0, 3.0), (4.0, 2.0)])
def test_loss_applies_the_logit_multiplier_and_cap(multiplier, cap):
    """Loss and gradient through the scaled, capped logits equal autograd on scale_and_cap_logits."""
    hidden, head, labels, valid, weights = random_loss_inputs()
    loss, _ = weighted_block_loss(hidden, head, labels, valid, weights, chunk_size=4, output_multiplier=multiplier, final_logit_softcapping=cap)
    (grad,) = torch.autograd.grad(loss, hidden)
    z = scale_and_cap_logits(hidden @ head.t(), multiplier, cap)  # [2, 3, 5, vocab]
    w = weights.expand_as(labels)[valid]
    expected = (F.cross_entropy(z[valid], labels[valid], reduction="none") * w).sum() / w.sum()
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    plain, _ = weighted_block_loss(hidden, head, labels, valid, weights)
    assert abs(plain.item() - loss.item()) > 1e-3  # the transform changes the loss
