"""DFlash2 drafters against slow references written out here: the convolution's dependence built by
perturbing one input at a time, the draft pass and the selector's walk re-derived in float64 from
the reference implementation's arithmetic (z-lab dflash/model.py, `DFlash2DraftModel`, read for these
tests, not copied), the selector's objective against a plain computation, the export against z-lab's
fixture files, decoding (greedy lossless; sampling exact in distribution), and each engine's
sliding-window rule.

Fixtures: tests/fixtures/zlab_dflash2_config.json is z-lab/dflash's tests/fixtures/dflash2-config.json
(commit 0a7587c04af47b56024ef80f44c0926e795a540b) as it is; tests/fixtures/zlab_dflash2_tensor_shapes.json
holds the tensor names, dtypes and shapes of its tests/fixtures/dflash2-safetensors-header.json
(commit 0698f537b270b11fa19f7a2690cb3a6d632e9588), without the byte offsets.

DFLASH2_REFERENCE=/path/to/a/z-lab-dflash/checkout also runs the draft pass of z-lab's own code on our
export (test_zlab_reference_parity); without it that test is skipped.
"""

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash_decoding
import dflash_runners
from dflash2_model import DFlash2Config, DFlash2DraftModel, GroupedDynamicCausalConv, selector_predecessor_ids
from dflash_decoding import greedy_generate, speculative_generate
from dflash_loss import dpace_weights, loss_weights, selector_loss, selector_objective, selector_training_candidates, weighted_block_loss
from dflash_masks import block_labels, dense_anchor_block_mask, position_rule, sample_anchors
from dflash_model import DFlashDraftModel, sample_index, sampling_probs
from dflash_runners import Decoder
from dflash_target import drafter_config_for_target

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB = 64
MASK_ID = VOCAB - 1
HIDDEN = 32
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


def tiny_dflash2(block_size=4, num_draft_layers=2, seed=0, scale=0.3, target_config=TARGET, **settings) -> DFlash2DraftModel:
    """A DFlash2 drafter at hidden 32 (4 conv groups of 8, selector rank 8, top-5) with random target
    tables attached. Every weight is redrawn at `scale` (None keeps the identity-conv init), so the
    convolutions and the selector change the result. `settings`: drafter_config_for_target's."""
    settings = {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 5, **settings}
    config = drafter_config_for_target(
        target_config,
        mask_token_id=target_config.vocab_size - 1,
        num_draft_layers=num_draft_layers,
        block_size=block_size,
        drafter="dflash2",
        **settings,
    )
    torch.manual_seed(seed)
    drafter = DFlash2DraftModel(config).eval()
    if scale is not None:
        for name, param in drafter.named_parameters():
            param.data.normal_(1.0 if "norm" in name else 0.0, scale)
    hidden, vocab = config.hidden_size, config.vocab_size
    drafter.attach_target(nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False))
    return drafter


def _batch(seq_len=24, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, MASK_ID, (batch, seq_len), generator=g)
    loss_mask = torch.ones(batch, seq_len, dtype=torch.bool)
    loss_mask[:, :4] = False
    loss_mask[-1, seq_len - 6 :] = False  # a right-padded row
    return input_ids, loss_mask


# ----------------------------------------------------------------------------------------------
# The convolution: causal inside each block, nothing across blocks


def reference_conv(x, base, dynamic, block_size):
    """x [T, hidden], base [K, hidden], dynamic [T, K, groups] -> [T, hidden], one position at a time."""
    length, hidden = x.shape
    taps, groups = dynamic.shape[1:]
    out = torch.zeros_like(x)
    for t in range(length):
        for i in range(taps):
            if t - i >= (t // block_size) * block_size:  # same block only
                out[t] += (base[i] + dynamic[t, i].repeat_interleave(hidden // groups)) * x[t - i]
    return out


def test_conv_equals_the_formula_and_moves_only_its_block_and_successors():
    """Perturb one input position at a time (both convolutions of a pair, kernel 3, three blocks of
    4 end to end): an output moves iff it is in the same block and 0..K-1 positions later."""
    block_size, taps, blocks = 4, 3, 3
    config = DFlash2Config(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        block_size=block_size,
        conv_kernel_size=taps,
        conv_group_size=8,
    )
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(config)
    for param in conv.parameters():
        param.data.normal_(0, 0.5)
    length = blocks * block_size
    h, y = torch.randn(1, length, HIDDEN), torch.randn(1, length, HIDDEN)
    mixed, kernel = conv.mix_input(h)
    out = conv.mix_output(y, kernel)
    dynamic = conv.kernel_projection(h[0]).view(length, 2, taps, HIDDEN // 8)
    torch.testing.assert_close(mixed[0], reference_conv(h[0], conv.base_kernel[0], dynamic[:, 0], block_size), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], reference_conv(y[0], conv.base_kernel[1], dynamic[:, 1], block_size), rtol=1e-5, atol=1e-5)

    moved_in, moved_out = torch.zeros(length, length, dtype=torch.bool), torch.zeros(length, length, dtype=torch.bool)
    for s in range(length):  # perturb input position s
        h2, y2 = h.clone(), y.clone()
        h2[0, s] += 1.0
        y2[0, s] += 1.0
        mixed2, kernel2 = conv.mix_input(h2)
        moved_in[:, s] = (mixed2 - mixed)[0].abs().amax(-1) > 0
        moved_out[:, s] = (conv.mix_output(y2, kernel) - out)[0].abs().amax(-1) > 0
        # The output side's kernel at t comes from the input at t alone.
        assert torch.equal((kernel2 - kernel)[0].abs().flatten(1).amax(-1) > 0, torch.arange(length) == s)
    t, s = torch.arange(length)[:, None], torch.arange(length)[None, :]
    expected = (t // block_size == s // block_size) & (t - s >= 0) & (t - s < taps)
    assert torch.equal(moved_in, expected) and torch.equal(moved_out, expected)


@pytest.mark.parametrize("is_causal", [True, False])
def test_training_forward_moves_only_the_perturbed_block(is_causal, monkeypatch):
    """Overlapping anchor blocks in one row (anchors 3, 5, 6, 10 with B = 4): a perturbed block input
    moves only its own block (only its later positions when every layer is causal, whose attention
    then agrees with the convolutions' direction), and a perturbed context feature at p moves
    exactly the blocks anchored after p."""
    drafter = tiny_dflash2(block_size=4, num_draft_layers=2, is_causal=is_causal)
    block_size, seq_len = 4, 16
    input_ids, _ = _batch(seq_len=seq_len, batch=1)
    features = torch.randn(1, seq_len, 2 * HIDDEN)
    anchors = torch.tensor([[3, 5, 6, 10]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        base = drafter(features, input_ids, anchors, valid)  # [1, N, B, hidden]
        embed_block = drafter.embed_block
        for column in range(anchors.shape[1] * block_size):
            block, position = divmod(column, block_size)
            delta = torch.zeros(1, anchors.shape[1] * block_size, HIDDEN)
            delta[0, column] = 1.0
            monkeypatch.setattr(drafter, "embed_block", lambda ids, delta=delta: embed_block(ids) + delta)
            moved = (drafter(features, input_ids, anchors, valid) - base)[0].abs().amax(-1) > 1e-6  # [N, B]
            expected = torch.zeros_like(moved)
            expected[block, position if is_causal else 0 :] = True
            assert torch.equal(moved, expected), (column, moved)
        monkeypatch.setattr(drafter, "embed_block", embed_block)
        for p in (2, 5, 9):
            perturbed = features.clone()
            perturbed[0, p] += 1.0
            moved = (drafter(perturbed, input_ids, anchors, valid) - base)[0].abs().flatten(1).amax(-1) > 1e-6  # [N]
            assert torch.equal(moved, anchors[0] > p), (p, moved)


def test_training_forward_equals_draft_pass_at_every_anchor():
    """sliding (window 3 < B, two-sided: DFlash2's default is_causal False), full: the training
    forward's hidden states and the selector's path at every anchor equal the draft pass over a
    growing cache and over a static one with stale entries past its length."""
    block_size, seq_len = 4, 20
    drafter = tiny_dflash2(block_size=block_size, num_draft_layers=2, layer_types="last_full", sliding_window=3)
    assert [drafter.config.attention_rule(i) for i in range(2)] == [(False, 3), (False, None)]
    input_ids, _ = _batch(seq_len=seq_len, batch=1)
    features = torch.randn(1, seq_len, 2 * HIDDEN)
    anchors = torch.arange(1, seq_len)[None]  # every anchor with some context: overlapping blocks throughout
    static = dflash_runners.DFlashStaticContextCache(drafter.config, 1, seq_len + 4, torch.float32, "cpu")
    with torch.no_grad():
        hidden = drafter(features, input_ids, anchors, torch.ones_like(anchors, dtype=torch.bool))  # [1, N, B, hidden]
        drafter.extend_context(static, torch.randn(1, seq_len + 4, 2 * HIDDEN))  # stale values everywhere
        for j, anchor in enumerate(anchors[0].tolist()):
            growing = drafter.extend_context(None, features[:, :anchor])
            static.crop(0)
            drafter.extend_context(static, features[:, :anchor])
            token = input_ids[:, anchor]
            torch.testing.assert_close(drafter.draft_hidden(growing, token)[0], hidden[0, j, 1:], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(drafter.draft_hidden(static, token)[0], hidden[0, j, 1:], rtol=1e-4, atol=1e-5)
            expected = drafter.candidate_selector.walk(hidden[:, j, 1:], drafter.compute_logits(hidden[:, j, 1:]), token)[0]
            assert torch.equal(drafter.draft_block(growing, token), expected)


def test_compiled_flex_forward_equals_sdpa_on_cpu():
    """At test_model's flex shapes (hidden 16, 2 heads of 8, B = 4, 6 anchors, 24 positions), so one
    pytest session compiles flex_attention once for both."""
    target = Qwen3Config(
        hidden_size=16, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=VOCAB
    )
    drafter = tiny_dflash2(block_size=4, target_config=target)
    input_ids, loss_mask = _batch()
    features = torch.randn(2, input_ids.shape[1], 2 * 16)
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1))
    valid[0, -1] = False  # a padded slot too
    with torch.no_grad():
        sdpa = drafter(features, input_ids, anchors, valid, attention_backend="sdpa")
        flex = drafter(features, input_ids, anchors, valid, attention_backend="flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-5)


def test_a_fresh_dflash2_drafter_computes_what_its_dflash_drafter_computes():
    """Identity convolutions at init: DFlash2 with DFlash's weights gives DFlash's hidden states."""
    dflash2 = tiny_dflash2(scale=None)
    dflash = DFlashDraftModel(drafter_config_for_target(TARGET, mask_token_id=MASK_ID, num_draft_layers=2, block_size=4)).eval()
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing), missing
    dflash.attach_target(dflash2.target_embed_tokens, dflash2.target_lm_head)
    input_ids, loss_mask = _batch()
    features = torch.randn(2, input_ids.shape[1], 2 * HIDDEN)
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(dflash2(features, input_ids, anchors, valid), dflash(features, input_ids, anchors, valid), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# The draft pass and the selector against the reference arithmetic


def reference_draft(drafter, features, anchor, embed, head):
    """The DFlash2 draft pass written out (float64) from the reference's arithmetic: one block after S
    context positions. features [S, F] -> (hidden [B-1, hidden], logits [B-1, vocab]).

    As DFlash's (tests/test_families.py `reference_draft_logits`), plus in every layer: from the
    normed input h, kernels = kernel_projection(h) viewed [B, side, tap, group]; the input side
    convolves h (queries and the block's keys and values come from the result; the context's keys
    and values do not), the output side convolves the sublayer's output; same around the MLP.
    """
    config = drafter.config
    p = {k: v.double() for k, v in drafter.state_dict().items()}
    eps, d, heads, kv_heads = config.rms_norm_eps, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    block_size, seq, taps = config.block_size, features.shape[0], config.conv_kernel_size
    groups = config.hidden_size // config.conv_group_size

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def conv(v, base, dynamic):  # v [B, hidden], base [K, hidden], dynamic [B, K, groups]
        return reference_conv(v, base, dynamic, block_size)

    context = rms(features.double() @ p["fc.weight"].T, p["hidden_norm.weight"])  # [S, hidden]
    block = torch.tensor([anchor] + [config.mask_token_id] * (block_size - 1))
    x = embed.double()[block] * config.input_embedding_scale  # [B, hidden]
    positions = torch.arange(seq + block_size, dtype=torch.float64)
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.cat([positions[:, None] * inv_freq, positions[:, None] * inv_freq], dim=-1)  # [S+B, d]

    def rope(v, at):
        half = v.shape[-1] // 2
        rotated = torch.cat([-v[..., half:], v[..., :half]], dim=-1)
        return v * angles[at].cos()[:, None] + rotated * angles[at].sin()[:, None]

    for i in range(config.num_hidden_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        kernels = (h @ w["attention_conv.kernel_projection.weight"].T).view(block_size, 2, taps, groups)
        h = conv(h, w["attention_conv.base_kernel"][0], kernels[:, 0])
        kv_input = torch.cat([context, h])  # [S+B, hidden]
        q = rms((h @ w["self_attn.q_proj.weight"].T).view(block_size, heads, d), w["self_attn.q_norm.weight"])
        k = rms((kv_input @ w["self_attn.k_proj.weight"].T).view(-1, kv_heads, d), w["self_attn.k_norm.weight"])
        v = (kv_input @ w["self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        q, k = rope(q, torch.arange(seq, seq + block_size)), rope(k, torch.arange(seq + block_size))
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [heads, B, S+B]
        causal, window = config.attention_rule(i)
        q_pos, k_pos = torch.arange(seq, seq + block_size)[:, None], torch.arange(seq + block_size)[None, :]
        visible = torch.ones(block_size, seq + block_size, dtype=torch.bool)
        if causal:
            visible &= k_pos <= q_pos
        if window is not None:
            visible &= (q_pos - k_pos < window) & (causal | (k_pos - q_pos < window))
        attention = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", attention, v).reshape(block_size, heads * d) @ w["self_attn.o_proj.weight"].T
        x = x + conv(out, w["attention_conv.base_kernel"][1], kernels[:, 1])
        h = rms(x, w["post_attention_layernorm.weight"])
        kernels = (h @ w["mlp_conv.kernel_projection.weight"].T).view(block_size, 2, taps, groups)
        h = conv(h, w["mlp_conv.base_kernel"][0], kernels[:, 0])
        out = (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        x = x + conv(out, w["mlp_conv.base_kernel"][1], kernels[:, 1])
    hidden = rms(x[1:], p["norm.weight"])
    logits = hidden @ head.double().T * config.output_multiplier
    cap = config.final_logit_softcapping
    return hidden, (torch.tanh(logits / cap) * cap if cap else logits)


def reference_selector_scores(drafter, hidden, logits, predecessors):
    """The selector's scores along a given path, float64: at position t the top-k candidates of
    logits[t] and unary + <pred_codebook[predecessors[t]] * hidden_projection(hidden[t]), succ_codebook[c]>.
    Returns (candidates [T, K], scores [T, K])."""
    p = {k: v.double() for k, v in drafter.candidate_selector.state_dict().items()}
    candidates = logits.argsort(dim=-1, descending=True)[:, : drafter.config.selector_top_k]
    context = p["predecessor_codebook"][predecessors] * (hidden @ p["hidden_projection.weight"].T)  # [T, rank]
    scores = logits.gather(1, candidates) + torch.einsum("tkr,tr->tk", p["successor_codebook"][candidates], context)
    return candidates, scores


def scattered(rows, candidates, vocab):
    """q rows over candidate ids [T, K] -> [T, vocab], so two orders of the same candidates compare."""
    return torch.zeros(rows.shape[0], vocab, dtype=torch.float64).scatter(1, candidates, rows.double())


@pytest.mark.parametrize("is_causal", [False, None])
def test_draft_pass_and_selector_equal_the_reference_arithmetic(is_causal):
    """1 sliding (window 3 < B) + 1 full layer, kernel 3, embedding and logit scale and cap set:
    hidden states, logits and the greedy path at T=0, and the q rows at T=0.7 along our sampled path,
    equal the float64 reference at several context lengths. is_causal None: a config without the key
    (causal sliding layer)."""
    drafter = tiny_dflash2(block_size=5, layer_types="last_full", sliding_window=3, conv_kernel_size=3)
    drafter.config.is_causal = is_causal
    drafter.config.dflash_config.update(input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=4.0)
    embed, head = drafter.target_embed_tokens.weight, drafter.target_lm_head.weight
    features = torch.randn(12, 2 * HIDDEN)
    for seq, anchor in ((1, 7), (6, 40), (12, 3)):
        cache = drafter.extend_context(None, features[None, :seq])
        token = torch.tensor([anchor])
        hidden, logits = reference_draft(drafter, features[:seq], anchor, embed, head)
        torch.testing.assert_close(drafter.draft_hidden(cache, token)[0].double(), hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(drafter.draft_logits(cache, token)[0].double(), logits, rtol=1e-5, atol=1e-5)
        greedy = drafter.draft_block(cache, token)[0]
        path = [anchor]  # the reference's greedy walk
        for t in range(logits.shape[0]):
            candidates, scores = reference_selector_scores(drafter, hidden[t : t + 1], logits[t : t + 1], torch.tensor(path[-1:]))
            path.append(int(candidates[0, scores[0].argmax()]))
        assert greedy.tolist() == path[1:]
        tokens, candidate_ids, q = drafter.draft_sample(cache, token, 0.7, 1.0, torch.rand(1, 4))
        candidates, scores = reference_selector_scores(drafter, hidden, logits, torch.cat([token, tokens[0, :-1]]))
        assert torch.equal(candidate_ids[0].sort(-1).values, candidates.sort(-1).values)  # the same top-k sets
        torch.testing.assert_close(
            scattered(q[0], candidate_ids[0], VOCAB), scattered(torch.softmax(scores / 0.7, -1), candidates, VOCAB), rtol=1e-5, atol=1e-6
        )
        assert (q[0].gather(1, (candidate_ids[0] == tokens[0, :, None]).int().argmax(1, keepdim=True)) > 0).all()


def test_sample_index_draws_from_the_row():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    u = torch.linspace(0, 0.999, 1000)
    picks = sample_index(probs[:, None].expand(2, 1000, 4), u.expand(2, 1000))  # [2, 1000]
    assert torch.equal(torch.bincount(picks[0], minlength=4), torch.tensor([0, 500, 0, 500]))
    assert torch.equal(torch.bincount(picks[1], minlength=4), torch.tensor([250, 250, 250, 250]))
    assert sample_index(torch.tensor([[0.3, 0.7, 0.0]]), torch.tensor([0.9999999])).item() == 1  # never a zero-mass index


# ----------------------------------------------------------------------------------------------
# The selector's objective


def test_selector_training_candidates_worked_example():
    candidates = torch.tensor([[7, 2, 9], [7, 2, 9]])
    injected, index, contains = selector_training_candidates(candidates, torch.tensor([2, 5]))
    assert injected.tolist() == [[7, 2, 9], [7, 2, 5]] and index.tolist() == [1, 2] and contains.tolist() == [True, False]


def test_selector_objective_equals_a_plain_reference():
    """Loss and gradients (hidden states, codebooks, projection) against full logits + top-K +
    injection + teacher-forced scores + weighted CE written plainly; chunking changes nothing."""
    drafter = tiny_dflash2(block_size=4, scale=0.5)
    drafter.config.dflash_config.update(output_multiplier=0.7, final_logit_softcapping=3.0)
    selector, head = drafter.candidate_selector, drafter.target_lm_head.weight
    input_ids, loss_mask = _batch(seq_len=16)
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(3))
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
    predecessors = selector_predecessor_ids(input_ids, anchors, 4)
    assert torch.equal(predecessors[:, :, 0], input_ids.gather(1, anchors)) and torch.equal(predecessors[:, :, 1:], labels[:, :, :-1])
    weights = loss_weights(4, 2.0)
    hidden = torch.randn(2, 4, 3, HIDDEN, requires_grad=True)

    def run(objective):
        drafter.zero_grad()
        hidden.grad = None
        loss = objective()
        loss.backward()
        return loss.detach(), hidden.grad.clone(), {n: p.grad.clone() for n, p in selector.named_parameters()}

    def reference():
        total, norm = 0.0, 0.0
        for b, n, k in label_valid.nonzero().tolist():
            h, target = hidden[b, n, k], int(labels[b, n, k])
            logits = torch.tanh(h @ head.T * 0.7 / 3.0) * 3.0
            candidates = logits.topk(selector.top_k).indices.tolist()
            if target not in candidates:
                candidates[-1] = target
            context = selector.predecessor_codebook[predecessors[b, n, k]] * (selector.hidden_projection.weight @ h)
            scores = logits[candidates] + selector.successor_codebook[candidates] @ context
            total = total + weights[k] * F.cross_entropy(scores[None], torch.tensor([candidates.index(target)]))
            norm += float(weights[k])
        return total / norm

    def ours(chunk_size):
        return selector_objective(
            selector,
            selector.top_k,
            hidden,
            head,
            labels,
            label_valid,
            predecessors,
            weights[label_valid.nonzero()[:, 2]],
            chunk_size=chunk_size,
            output_multiplier=0.7,
            final_logit_softcapping=3.0,
        )[0]

    expected = run(reference)
    for chunk_size in (4096, 3):
        got = run(lambda: ours(chunk_size))
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-6)
        for name in expected[2]:
            torch.testing.assert_close(got[2][name], expected[2][name], rtol=1e-4, atol=1e-6)
    # selector_loss alone is the weighted mean CE.
    scores, index, w = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0]), torch.tensor([1.0, 0.5, 0.5, 0.25, 1.0])
    torch.testing.assert_close(selector_loss(scores, index, w), (F.cross_entropy(scores, index, reduction="none") * w).sum() / w.sum())
    # A micro-batch with nothing valid (a filler step): zero, and still a gradient (zeros) for every
    # selector parameter, as every drafter rank's ZeRO reduction needs.
    loss, accepted = selector_objective(selector, selector.top_k, hidden, head, labels, torch.zeros_like(label_valid), predecessors, weights[:0])
    drafter.zero_grad(set_to_none=True)
    loss.backward()
    assert loss.item() == 0.0 and torch.isnan(accepted).all()
    assert all(p.grad is not None and not p.grad.any() for p in selector.parameters())


def test_selector_codebook_gradients_equal_indexing_without_index_put():
    """The selector's scores and every gradient equal those of plain indexing (`codebook[ids]`) bit for
    bit in fp32, with ids repeated as the top-K repeats frequent tokens; and its backward runs no
    index_put_ (the serial per-id accumulation indexing's backward is) and reaches both codebooks
    through embedding's backward."""
    selector = tiny_dflash2(scale=0.5).candidate_selector
    g = torch.Generator().manual_seed(5)
    rows, top_k = 40, selector.top_k
    hidden = torch.randn(rows, HIDDEN, generator=g, requires_grad=True)
    predecessors = torch.randint(0, 4, (rows,), generator=g)  # 4 ids for 40 rows
    candidates = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(rows)])  # [rows, K], 8 ids for 200 slots
    unary = torch.randn(rows, top_k, generator=g, requires_grad=True)
    grad_scores = torch.randn(rows, top_k, generator=g)

    def run(scores_of):
        selector.zero_grad(set_to_none=True)
        hidden.grad = unary.grad = None
        scores = scores_of()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            scores.backward(grad_scores)
        ops = {event.key for event in profile.key_averages()}
        grads = {name: p.grad.clone() for name, p in selector.named_parameters()}
        return scores.detach(), hidden.grad.clone(), unary.grad.clone(), grads, ops, scores.grad_fn

    def indexed():
        context = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
        return unary.float() + (selector.successor_codebook[candidates] @ context[..., None])[..., 0].float()

    ours, plain = run(lambda: selector(hidden, predecessors, candidates, unary)), run(indexed)
    for got, expected in zip(ours[:3], plain[:3]):
        assert torch.equal(got, expected)
    assert ours[3].keys() == plain[3].keys() and all(torch.equal(ours[3][name], plain[3][name]) for name in plain[3])
    assert ours[3]["successor_codebook"][8:].abs().sum() == 0 and ours[3]["successor_codebook"][:8].abs().sum() > 0
    assert "aten::_index_put_impl_" in plain[4]  # the check sees indexing's backward
    assert not {"aten::index_put_", "aten::_index_put_impl_"} & ours[4], sorted(ours[4])
    # Which node hands each codebook its gradient.
    feeding, stack, seen = {}, [ours[5]], set()
    while stack:
        node = stack.pop()
        for parent, _ in node.next_functions:
            if parent is None or id(parent) in seen:
                continue
            seen.add(id(parent))
            variable = getattr(parent, "variable", None)
            if variable is not None:
                feeding[id(variable)] = node.name()
            stack.append(parent)
    assert feeding[id(selector.successor_codebook)] == "EmbeddingBackward0"
    assert feeding[id(selector.predecessor_codebook)] == "EmbeddingBackward0"


@pytest.mark.parametrize("normalize", ["weights", "count"])
def test_selector_is_weighted_and_normalised_as_the_drafter_loss(normalize):
    """Under D-PACE the selector's rows carry the drafter's D-PACE weights, from the drafter's own
    confidences exp(-CE) (as speculators weights its selector), and the drafter's normaliser."""
    drafter = tiny_dflash2(block_size=4, scale=0.5)
    selector, head = drafter.candidate_selector, drafter.target_lm_head.weight
    input_ids, loss_mask = _batch(seq_len=16)
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(3))
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
    predecessors = selector_predecessor_ids(input_ids, anchors, 4)
    hidden = torch.randn(2, 4, 3, HIDDEN)
    _, _, row_weights = weighted_block_loss(
        hidden, head, labels, label_valid, None, loss_weighting="dpace", normalize=normalize, return_row_weights=True
    )
    confidence = torch.exp(-F.cross_entropy(drafter.compute_logits(hidden).flatten(0, 2), labels.flatten(), reduction="none"))
    expected_weights = dpace_weights(confidence.view_as(labels), label_valid)[label_valid]
    torch.testing.assert_close(row_weights, expected_weights)
    assert not torch.allclose(row_weights, loss_weights(4)[label_valid.nonzero()[:, 2]])  # not the fixed decay
    loss, _ = selector_objective(selector, selector.top_k, hidden, head, labels, label_valid, predecessors, row_weights, normalize=normalize)
    # The same rows' K-way CE, weighted by hand.
    plain, _ = selector_objective(
        selector, selector.top_k, hidden, head, labels, label_valid, predecessors, torch.ones_like(row_weights), normalize="count"
    )
    count = int(label_valid.sum())
    ce = torch.stack(
        [
            selector_objective(
                selector,
                selector.top_k,
                hidden,
                head,
                labels,
                label_valid & (torch.arange(label_valid.numel()).view_as(label_valid) == i),
                predecessors,
                torch.ones(1),
            )[0]
            for i in label_valid.flatten().nonzero()[:, 0].tolist()
        ]
    )  # [T], one row at a time
    torch.testing.assert_close(plain, ce.mean())
    torch.testing.assert_close(loss, (ce * expected_weights).sum() / (expected_weights.sum() if normalize == "weights" else count))


def test_selector_accepted_is_the_walk_along_the_true_tokens():
    """`accepted` counts, per block, the run of positions where the label is among the top-K and the
    selector's argmax given the true predecessor: exactly where the greedy walk reproduces the labels."""
    drafter = tiny_dflash2(block_size=4, scale=0.5)
    selector, head = drafter.candidate_selector, drafter.target_lm_head.weight
    input_ids, loss_mask = _batch(seq_len=16)
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(3))
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
    hidden = torch.randn(2, 4, 3, HIDDEN)
    # Make the walk right for a while: labels = the greedy walk's tokens where valid.
    with torch.no_grad():
        walk = selector.walk(hidden.flatten(0, 1), drafter.compute_logits(hidden.flatten(0, 1)), input_ids.gather(1, anchors).flatten())[0]
    labels = torch.where(torch.rand(labels.shape, generator=torch.Generator().manual_seed(4)) < 0.8, walk.view_as(labels), labels)
    input_ids = input_ids.clone()
    for b in range(2):  # the labels are the sequence's tokens, so the teacher-forced predecessors see them
        for n in range(4):
            for k in range(3):
                if label_valid[b, n, k]:
                    input_ids[b, anchors[b, n] + k + 1] = labels[b, n, k]
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
    _, accepted = selector_objective(
        selector,
        selector.top_k,
        hidden,
        head,
        labels,
        label_valid,
        selector_predecessor_ids(input_ids, anchors, 4),
        loss_weights(4, 2.0)[label_valid.nonzero()[:, 2]],
    )
    with torch.no_grad():
        walk = selector.walk(hidden.flatten(0, 1), drafter.compute_logits(hidden.flatten(0, 1)), input_ids.gather(1, anchors).flatten())[0]
    runs = ((walk.view_as(labels) == labels) & label_valid).int().cumprod(-1).bool()  # [batch, N, B-1]
    torch.testing.assert_close(accepted, runs.sum((0, 1)).float() / label_valid.sum((0, 1)).float())


# ----------------------------------------------------------------------------------------------
# Export: the layout z-lab's DFlash2DraftModel loads


def zlab_sized_config() -> DFlash2Config:
    """Our config for the drafter of z-lab's fixture, derived from a target of its sizes."""
    target = Qwen3Config(
        hidden_size=6656,
        num_hidden_layers=52,
        num_attention_heads=52,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=19968,
        vocab_size=202048,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    config = drafter_config_for_target(
        target,
        mask_token_id=201818,
        num_draft_layers=5,
        target_layer_ids=[1, 13, 25, 37, 49],
        layer_types="all_sliding",
        sliding_window=2048,
        num_attention_heads=32,
        drafter="dflash2",
    )
    config.dflash_config.update(output_multiplier=0.19611613513818404, final_logit_softcapping=20.0)
    return config


def test_export_config_and_tensor_names_match_zlab_fixture(tmp_path):
    """Our export's config.json has every key of z-lab's fixture (the same values for the layout and
    DFlash2 fields), its tensors are the fixture's names, dtypes and shapes (codebooks without
    `.weight`), and the fixture's config loads into ours with the same rules."""
    fixture = json.loads((FIXTURES / "zlab_dflash2_config.json").read_text())
    config = zlab_sized_config()
    config.dtype = torch.bfloat16  # what save_pretrained records for a bf16 export
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert set(fixture) <= set(saved), set(fixture) - set(saved)
    # is_causal again, for vLLM 0.26 and older, which read only dflash_config.causal.
    assert saved["dflash_config"].pop("causal") is saved["is_causal"] is False
    assert set(saved["dflash_config"]) == set(fixture["dflash_config"])
    # Tokenizer ids and the transformers version are the target's and the writer's, not the layout's.
    for key in set(fixture) - {"bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "use_cache"}:
        assert saved[key] == fixture[key], (key, saved[key], fixture[key])

    shapes = json.loads((FIXTURES / "zlab_dflash2_tensor_shapes.json").read_text())
    with torch.device("meta"):
        drafter = DFlash2DraftModel(config).to(torch.bfloat16)
    ours = {name: ["BF16" if t.dtype == torch.bfloat16 else str(t.dtype), list(t.shape)] for name, t in drafter.state_dict().items()}
    assert ours == shapes

    loaded = DFlash2Config.from_dict(fixture)
    assert (loaded.block_size, loaded.conv_kernel_size, loaded.conv_group_size, loaded.selector_rank, loaded.selector_top_k) == (16, 2, 16, 256, 16)
    assert [loaded.attention_rule(i) for i in range(5)] == [(False, 2048)] * 5
    assert loaded.output_multiplier == fixture["dflash_config"]["output_multiplier"] and loaded.final_logit_softcapping == 20.0


def test_export_round_trip(tmp_path):
    """save_pretrained writes the safetensors names of the state_dict (no target tables, codebooks
    without `.weight`); eval's loader picks DFlash2 from `architectures`; the reload is bit-identical."""
    drafter = tiny_dflash2(block_size=4, layer_types="last_full", sliding_window=3)
    drafter.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == set(drafter.state_dict())
    assert {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.1.mlp_conv.base_kernel",
    } <= names
    assert not any("embed_tokens" in k or "lm_head" in k for k in names)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["block_size"] == saved["dflash_config"]["block_size"] == 4
    assert not set(saved) & {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
    reloaded = dflash_decoding.load_drafter(str(tmp_path), torch.float32, torch.device("cpu"))
    assert type(reloaded) is DFlash2DraftModel and reloaded.config.selector_top_k == 5 and reloaded.config.is_causal is False
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_a_config_without_is_causal_reads_sliding_layers_as_causal(tmp_path):
    """A DFlash2 config.json with sliding layers and no is_causal key (as another trainer may write
    it) drafts as z-lab's loader reads it, sliding layers causal and full layers bidirectional; the
    drafters we train write is_causal false, so their windows stay two-sided."""
    drafter = tiny_dflash2(block_size=4, layer_types="last_full", sliding_window=3)
    drafter.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    assert saved["is_causal"] is saved["dflash_config"]["causal"] is False
    del saved["is_causal"], saved["dflash_config"]["causal"]
    config_file.write_text(json.dumps(saved))
    reloaded = dflash_decoding.load_drafter(str(tmp_path), torch.float32, torch.device("cpu"))
    assert reloaded.config.is_causal is None
    assert [reloaded.config.attention_rule(i) for i in range(2)] == [(True, 3), (False, None)]
    reloaded.attach_target(drafter.target_embed_tokens, drafter.target_lm_head)
    features, token = torch.randn(1, 9, 2 * HIDDEN), torch.tensor([3])
    causal = drafter.draft_logits(drafter.extend_context(None, features), token)
    drafter.config.is_causal = None
    expected = drafter.draft_logits(drafter.extend_context(None, features), token)
    assert not torch.allclose(causal, expected)  # the window's direction matters at this anchor
    torch.testing.assert_close(reloaded.draft_logits(reloaded.extend_context(None, features), token), expected)


def test_config_errors():
    with pytest.raises(ValueError, match="conv_kernel_size 5 must be in 1..block_size"):
        tiny_dflash2(block_size=4, conv_kernel_size=5)
    with pytest.raises(ValueError, match="conv_group_size 5 must divide hidden_size 32"):
        tiny_dflash2(conv_group_size=5)
    with pytest.raises(ValueError, match="selector_top_k 65 must be in 1..vocab_size"):
        tiny_dflash2(selector_top_k=65)
    with pytest.raises(ValueError, match="--selector_rank belong to DFlash2 drafters"):
        drafter_config_for_target(TARGET, mask_token_id=MASK_ID, selector_rank=8)
    with pytest.raises(ValueError, match="call draft_sample"):
        tiny_dflash2().draft_probs(None, torch.tensor([1]), 0.8)


# ----------------------------------------------------------------------------------------------
# The reference implementation itself, when a checkout of it is given


def test_zlab_reference_parity(tmp_path):
    """z-lab's DFlash2DraftModel (from DFLASH2_REFERENCE, a z-lab/dflash checkout) loads our export and
    drafts what we draft: hidden states and logits, the greedy path, and at T > 0 the q rows along
    the path it sampled (the sampled tokens themselves depend on the order of random draws)."""
    root = os.environ.get("DFLASH2_REFERENCE")
    if not root:
        pytest.skip("set DFLASH2_REFERENCE=/path/to/z-lab-dflash (a checkout with DFlash2DraftModel) to compare with it")
    path = Path(root) / "dflash" / "model.py"
    if not path.is_file():
        pytest.skip(f"DFLASH2_REFERENCE={root!r} has no dflash/model.py")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    zlab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab)
    if not hasattr(zlab, "DFlash2DraftModel"):
        pytest.skip(f"{path} has no DFlash2DraftModel (an older z-lab/dflash)")

    drafter = tiny_dflash2(block_size=5, layer_types="last_full", sliding_window=3, conv_kernel_size=3)
    drafter.config.dflash_config.update(output_multiplier=0.6, final_logit_softcapping=4.0)
    drafter.save_pretrained(tmp_path)
    reference = zlab.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for name in ("predecessor_codebook", "successor_codebook"):  # loaded through its key mapping, not left at init
        assert torch.equal(getattr(reference.candidate_selector, name).weight, getattr(drafter.candidate_selector, name))
    embed, head = drafter.target_embed_tokens, drafter.target_lm_head
    features = torch.randn(1, 9, 2 * HIDDEN)
    for seq, anchor in ((3, 7), (9, 40)):
        cache = drafter.extend_context(None, features[:, :seq])
        token = torch.tensor([anchor])
        block = torch.tensor([[anchor] + [MASK_ID] * 4])
        with torch.no_grad():
            theirs = reference(position_ids=torch.arange(seq + 5)[None], noise_embedding=embed(block), target_hidden=features[:, :seq])[:, 1:]
            torch.testing.assert_close(drafter.draft_hidden(cache, token), theirs, rtol=1e-5, atol=1e-5)
            path, _, _ = reference.propose(theirs, token, head, 0.0)
            assert torch.equal(drafter.draft_block(cache, token), path)
            path, candidates, q = reference.propose(theirs, token, head, 0.8)
            ours_hidden = drafter.draft_hidden(cache, token)
            logits = drafter.compute_logits(ours_hidden)
            unary, our_candidates = logits.topk(drafter.config.selector_top_k, dim=-1)
            scores = drafter.candidate_selector(ours_hidden, torch.cat([token[:, None], path[:, :-1]], 1), our_candidates, unary)
        torch.testing.assert_close(
            scattered(sampling_probs(scores, 0.8)[0], our_candidates[0], VOCAB), scattered(q[0], candidates[0], VOCAB), rtol=1e-5, atol=1e-6
        )


# ----------------------------------------------------------------------------------------------
# Decoding


def test_greedy_speculative_decoding_is_lossless_fp32(tmp_path):
    """A DFlash2 drafter (random, so its drafts are often wrong, sometimes right) over a tiny target:
    speculative decoding returns plain greedy decoding's tokens, with the dynamic and the static
    cache and with the reloaded export."""
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=128,
            initializer_range=0.15,
        )
    ).eval()
    drafter = tiny_dflash2(block_size=4, scale=0.2, target_config=target.config, layer_types="last_full", sliding_window=3)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    drafter.save_pretrained(tmp_path)
    reloaded = dflash_decoding.load_drafter(str(tmp_path), torch.float32, torch.device("cpu"))
    reloaded.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    static = Decoder(target, drafter, "static", max_length=64)
    accepted = []
    for seed in range(3):
        prompt = torch.randint(0, MASK_ID, (1, 7), generator=torch.Generator().manual_seed(seed))
        reference = greedy_generate(target, prompt, 24)
        tokens, stats = speculative_generate(target, drafter, prompt, 24)
        assert tokens == reference, seed
        assert speculative_generate(target, drafter, prompt, 24, decoder=static)[0] == reference
        assert speculative_generate(target, reloaded, prompt, 24, block_size=3)[0] == reference
        accepted += stats["accepted_drafts"]
    static.close()
    assert len(set(accepted)) > 1, accepted  # drafts were both accepted and rejected


def test_speculative_sampling_matches_plain_sampling_in_distribution(monkeypatch):
    """tests/test_sampling.py's check, now for a DFlash2 drafter: 1,000 runs of tokens 1..4 against
    the exact marginals, with q rows over the selector's 12 candidates (4 of the target's 16 tokens
    are never among them, so the residual of the candidate-index form is exercised) and each draft's
    q depending on the one before it (selector weights at 0.3; the rest at their init, which keeps
    enough drafts accepted that every outcome of a verify step happens often)."""
    from test_sampling import BLOCK, PROMPT, SEEDS, TEMPERATURE, TOKENS, TOP_P, TV_BOUND, exact_marginals, tv
    from test_sampling import VOCAB as SMALL_VOCAB

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=SMALL_VOCAB,
        max_position_embeddings=64,
        initializer_range=0.15,
    )
    target = Qwen3ForCausalLM(config).eval()
    drafter = tiny_dflash2(block_size=BLOCK, num_draft_layers=1, scale=None, target_config=config, selector_top_k=12)
    for param in drafter.candidate_selector.parameters():
        param.data.normal_(0, 0.3)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())

    def samples(seeds):
        decoder = Decoder(target, drafter)
        outputs, stats = [], []
        for seed in range(seeds):
            out, s = speculative_generate(
                target, drafter, PROMPT, TOKENS, BLOCK, (), decoder, TEMPERATURE, TOP_P, torch.Generator().manual_seed(seed)
            )
            outputs.append(out)
            stats.append(s)
        decoder.close()
        return torch.tensor(outputs), stats

    exact = exact_marginals(target, PROMPT, TOKENS)
    outputs, stats = samples(SEEDS)
    accepted = [n for s in stats for n in s["accepted_drafts"]]
    assert all(accepted.count(n) > len(accepted) // 20 for n in range(BLOCK)), [accepted.count(n) for n in range(BLOCK)]
    distances = [tv(torch.bincount(outputs[:, j], minlength=SMALL_VOCAB).float() / SEEDS, exact[j]) for j in range(TOKENS)]
    assert max(distances) < TV_BOUND, distances

    # The check has power: a verifier that reads q as if it were over token ids 0..K-1 (ignoring the
    # candidate ids) fails it.
    original = dflash_decoding.rejection_sample
    monkeypatch.setattr(
        dflash_decoding,
        "rejection_sample",
        lambda drafts, q, p, generator, draft_indices=None: original(drafts, F.pad(q, (0, SMALL_VOCAB - q.shape[1])), p, generator),
    )
    wrong, _ = samples(150)
    wrong_tv = [tv(torch.bincount(wrong[:, j], minlength=SMALL_VOCAB).float() / len(wrong), exact[j]) for j in range(1, TOKENS)]
    assert max(wrong_tv) > 2 * TV_BOUND, wrong_tv


# ----------------------------------------------------------------------------------------------
# Sliding windows: each engine's rule (dflash_masks.py, the table above `position_rule`)


def zlab_rule(q, k, causal, window):
    """z-lab `_attention_mask`: q - k < window, k - q < window unless causal, k <= q if causal."""
    visible = q - k < window
    return visible & (k <= q) if causal else visible & (k - q < window)


def flash_window_rule(q, k, causal, window):
    """SGLang and vLLM: flash-attention's window (left, right) = (window - 1, 0 if causal else
    window - 1) over absolute positions: q - left <= k <= q + right."""
    left, right = window - 1, (0 if causal else window - 1)
    return (q - left <= k) & (k <= q + right)


def speculators_rule(q, k, anchor, causal, window):
    """speculators `create_anchor_block_mask_mod`: context keys anchor - window <= k < anchor for every
    query of the block; its whole own block (k <= q when causal), no window inside it."""
    context = (k < anchor) & (k >= anchor - window)
    own_block = (k >= anchor) & ((k <= q) if causal else torch.ones_like(k, dtype=torch.bool))
    return context | own_block


@pytest.mark.parametrize("context", [40, 100, 0])
@pytest.mark.parametrize("causal", [True, False])
def test_engine_window_rules_with_contexts_longer_than_the_window(context, causal):
    """Window 16, B = 16, a block after `context` positions: ours (training mask and draft pass) is
    z-lab's, SGLang's and vLLM's rule; speculators' query at block position i sees exactly the i + 1
    context keys anchor - 16 .. anchor - 16 + i more, once the window binds (not at context 0)."""
    window, block_size = 16, 16
    q = torch.arange(context, context + block_size)[:, None]  # [B, 1] absolute query positions
    k = torch.arange(context + block_size)[None, :]  # [1, S + B]: context keys, then the block's
    ours_draft = position_rule(q, k, causal, window)
    # The training mask for an anchor at `context` in a longer row: its context keys, then its block's.
    seq_len = context + block_size + 1
    dense = dense_anchor_block_mask(torch.tensor([[context]]), torch.tensor([[True]]), seq_len, block_size, causal, window)[0, 0]
    ours_training = torch.cat([dense[:, :context], dense[:, seq_len:]], dim=1)  # [B, S + B]
    expected = zlab_rule(q, k, causal, window)
    assert torch.equal(ours_draft, expected) and torch.equal(ours_training, expected)
    assert torch.equal(flash_window_rule(q, k, causal, window), expected)
    extra = speculators_rule(q, k, context, causal, window) & ~expected
    assert not (expected & ~speculators_rule(q, k, context, causal, window)).any()  # speculators sees a superset
    if context >= window:
        i = torch.arange(block_size)[:, None]
        assert torch.equal(extra, (k >= context - window) & (k <= context - window + i))
        assert extra.sum() == block_size * (block_size + 1) // 2
    else:
        assert not extra.any()  # a + B - 1 < window: the window cannot bind, the rules agree


def test_trainer_loss_of_dflash2_with_dpace_and_count_equals_a_plain_reference():
    """The trainer's loss of one micro-batch (`MicroBatchLoss`) for DFlash2 + D-PACE + the count
    normaliser, against a plain computation row by row from the drafter's hidden states: the drafter's
    CE plus the selector's K-way CE, both weighted by D-PACE from the drafter's own confidences
    exp(-CE) (alpha 0.5, written out here) and both divided by the number of valid positions.
    Measured: 3.6321 here; the selector given the fixed exp weights gives 4.8104, and the selector
    normalised by the sum of its weights instead of the count 5.4239."""
    from train_dflash import Compute, MicroBatchLoss, TrainSettings

    block = 4
    drafter = tiny_dflash2(block_size=block, scale=0.5).train()
    config, selector = drafter.config, drafter.candidate_selector
    settings = TrainSettings(
        target_model="x", train_data=["x"], drafter="dflash2", num_anchors=6, block_size=block, loss_weighting="dpace", loss_normalize="count"
    )
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
    loss_fn = MicroBatchLoss(settings, config, compute, None, drafter.target_lm_head)
    input_ids, loss_mask = _batch(seq_len=20)
    features = torch.randn(2, 20, 2 * HIDDEN, generator=torch.Generator().manual_seed(5))

    class Engine:  # what the trainer passes: the DeepSpeed engine, its drafter as .module; keeps the forward's inputs and output
        module = drafter

        def __call__(self, *args, **kwargs):
            self.anchors, self.anchor_valid = args[2], args[3]
            self.hidden = drafter(*args, **kwargs)
            return self.hidden

    engine = Engine()
    loss, _ = loss_fn(engine, features, input_ids, loss_mask, input_ids, (0, 0, 0, 0))

    with torch.no_grad():
        hidden, anchors, anchor_valid = engine.hidden, engine.anchors, engine.anchor_valid
        total, rows = 0.0, 0
        for b, n in anchor_valid.nonzero().tolist():
            anchor = int(anchors[b, n])
            ce, selector_ce, smoothed, valid = [], [], [], []
            for k in range(1, block):  # block position k predicts token[anchor + k] from hidden[b, n, k]
                position = anchor + k
                valid.append(position < input_ids.shape[1] and bool(loss_mask[b, position]))
                if not valid[-1]:  # a masked position neither stops nor shrinks the run
                    ce.append(0.0)
                    selector_ce.append(0.0)
                    smoothed.append(1.0)
                    continue
                h, label = hidden[b, n, k], int(input_ids[b, position])
                logits = drafter.compute_logits(h)
                ce.append(F.cross_entropy(logits[None], torch.tensor([label])).item())
                smoothed.append(0.5 * math.exp(-ce[-1]) + 0.5)
                candidates = logits.topk(selector.top_k).indices.tolist()
                if label not in candidates:
                    candidates[-1] = label
                context = selector.predecessor_codebook[input_ids[b, position - 1]] * (selector.hidden_projection.weight @ h)
                scores = logits[candidates] + selector.successor_codebook[candidates] @ context
                selector_ce.append(F.cross_entropy(scores[None], torch.tensor([candidates.index(label)])).item())
            prefix = [math.prod(smoothed[: j + 1]) for j in range(block - 1)]
            for k in range(block - 1):
                if valid[k]:
                    weight = sum(prefix[j] for j in range(k, block - 1) if valid[j])  # D-PACE: W_k = sum_{j >= k, valid} prod_{i <= j} s_i
                    total += weight * (ce[k] + selector_ce[k])
                    rows += 1
    assert rows > 10
    print(f"loss {loss.item():.6f}, reference {total / rows:.6f} over {rows} positions")
    assert loss.item() == pytest.approx(total / rows, rel=1e-5)
