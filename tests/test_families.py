"""Target families on tiny random configs, one row each: context features, truncation, the drafter's
sizing and scaling fields against what the target really does, a few training steps, the export,
and speculative decoding with the reloaded drafter (greedy, lossless). Plus the draft pass against
a re-derivation of the reference implementation's arithmetic for a released-style drafter config."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dflash_decoding import greedy_generate, speculative_generate
from dflash_features import TargetFeatureExtractor
from dflash_loss import loss_weights, weighted_block_loss
from dflash_masks import block_labels, sample_anchors
from dflash_model import DFlashDraftModel
from dflash_runners import TargetRunner, resolve_kv_cache, static_cache_problem
from dflash_target import check_target_scaling, drafter_config_for_target

VOCAB = 96
MASK_ID = VOCAB - 1
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.2,
)
LINEAR = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2)
WINDOW = 8  # the targets' sliding window: prompts plus generations run past it

# family -> (model_type, config beyond COMMON, the dflash_config scaling fields the drafter must carry)
FAMILIES = {
    "qwen3": ("qwen3", {}, {}),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), {}),
    "qwen3_next": (
        "qwen3_next",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **LINEAR),
        {},
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe_text",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **LINEAR),
        {},
    ),
    "llama3.1": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
        {},
    ),
    "mistral": ("mistral", dict(sliding_window=WINDOW), {}),
    "gemma2": (
        "gemma2",
        dict(final_logit_softcapping=30.0, query_pre_attn_scalar=8, sliding_window=WINDOW),
        {"input_embedding_scale": math.sqrt(32), "final_logit_softcapping": 30.0},
    ),
    "gemma3": (
        "gemma3_text",
        dict(query_pre_attn_scalar=8, sliding_window=WINDOW, sliding_window_pattern=2),
        {"input_embedding_scale": math.sqrt(32)},
    ),
    "granite": (
        "granite",
        dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.125),
        {"input_embedding_scale": 12.0, "output_multiplier": 0.125},
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),
        {},
    ),
}
HYBRID = {"qwen3_next", "qwen3_5_moe"}  # linear-attention layers: verification restores and re-runs
MOE = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss"}
PARTIAL_ROTARY = {"qwen3_next", "qwen3_5_moe"}
STATIC_CACHE = {"qwen3", "qwen3_moe", "llama3.1", "granite"}  # no sliding-window or linear-attention layers


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


_targets: dict[str, torch.nn.Module] = {}


def tiny_target(family: str):
    """The family's tiny random target (fp32, eval mode, frozen), built once per module; skipped
    when the installed transformers lacks the family."""
    model_type, extra, _ = FAMILIES[family]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    if family not in _targets:
        torch.manual_seed(0)
        config = CONFIG_MAPPING[model_type](**{**COMMON, **extra})
        target = AutoModelForCausalLM.from_config(config).eval()
        target.requires_grad_(False)
        _targets[family] = target
    return _targets[family]


def padded_batch(lengths=(14, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, MASK_ID, (len(lengths), max(lengths)), generator=g)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def drafter_for(target, **layout) -> DFlashDraftModel:
    config = drafter_config_for_target(target.config, mask_token_id=MASK_ID, num_draft_layers=2, block_size=4, target_layer_ids=[0, 2], **layout)
    torch.manual_seed(1)
    drafter = DFlashDraftModel(config).eval()
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    return drafter


@pytest.mark.parametrize("family", FAMILIES)
def test_features_and_truncation(family):
    """Captured features == output_hidden_states[id + 1] (right-padded batch), and a target
    truncated after the deepest layer gives the same features."""
    target = tiny_target(family)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        hidden_states = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False).hidden_states
    expected = torch.cat([hidden_states[1], hidden_states[3]], dim=-1)  # layers 0 and 2
    full = TargetFeatureExtractor(target, [0, 2], truncate=False)
    torch.testing.assert_close(full(input_ids, attention_mask), expected, rtol=1e-5, atol=1e-5)
    full.remove_hooks()
    truncated = TargetFeatureExtractor(copy.deepcopy(target), [0, 2], truncate=True)
    assert len(truncated.layers) == 3 and truncated.num_target_layers == 4
    torch.testing.assert_close(truncated(input_ids, attention_mask), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_sizing_and_scaling_match_the_target(family):
    """The drafter config's scaling fields are what the target does to its embeddings and logits
    (measured on the target itself), and its sizes follow the released drafters' rules."""
    target = tiny_target(family)
    drafter = drafter_for(target)
    config = drafter.config
    expected_fields = FAMILIES[family][2]
    assert {k: v for k, v in config.dflash_config.items() if k not in ("mask_token_id", "target_layer_ids")} == pytest.approx(expected_fields)
    input_ids, _ = padded_batch(lengths=(10,))
    layer_inputs = []
    hook = (
        target.get_decoder()
        .layers[0]
        .register_forward_pre_hook(lambda module, args, kwargs: layer_inputs.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    )
    with torch.no_grad():
        out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hook.remove()
    # What enters the target's first layer is the table row times the scale, as the drafter embeds its block.
    torch.testing.assert_close(drafter.embed_block(input_ids), layer_inputs[0], rtol=1e-6, atol=1e-6)
    # The target's logits are its head on the final-norm output, scaled and capped as the drafter's are.
    torch.testing.assert_close(drafter.compute_logits(out.hidden_states[-1]), out.logits, rtol=1e-5, atol=1e-5)
    check_target_scaling(target, config)
    wrong = copy.deepcopy(config)
    wrong.dflash_config = {**wrong.dflash_config, "input_embedding_scale": 3.0}
    with pytest.raises(ValueError, match="input_embedding_scale"):
        check_target_scaling(target, wrong)
    # Sizes: hidden, RoPE type and theta are the target's; MoE targets get 3 x hidden of MLP;
    # partial-rotary targets get Qwen3's 32 heads of 128 with full rotary.
    text = target.config.get_text_config()
    assert config.hidden_size == text.hidden_size and config.rms_norm_eps == text.rms_norm_eps
    assert config.intermediate_size == (3 * text.hidden_size if family in MOE else text.intermediate_size)
    if family in PARTIAL_ROTARY:
        assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (32, 128, 1)
        assert "partial_rotary_factor" not in config.rope_parameters
    else:
        assert (config.num_attention_heads, config.head_dim) == (text.num_attention_heads, getattr(text, "head_dim", 8))
    target_rope = text.rope_parameters.get("full_attention", text.rope_parameters)
    assert config.rope_parameters["rope_type"] == target_rope["rope_type"]
    assert config.rope_theta == target_rope["rope_theta"]


def test_the_drafter_of_a_qwen3_5_target_keeps_no_multimodal_rope(tmp_path):
    """A Qwen3.5/3.6 target's text config carries multimodal RoPE (mrope_section, mrope_interleaved,
    as its released config.json has them) beside partial rotary. The drafter is text-only with full
    rotary over head_dim 128: the saved config has only rope_type and rope_theta, as z-lab's released
    Qwen3.5 drafters write them. (vLLM builds an MRotaryEmbedding from an mrope_section and asserts
    sum(section) == rotary_dim / 2: 32 against 64 here, and the drafter would not load.)"""
    if "qwen3_5" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no 'qwen3_5' configs")
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    target_config = CONFIG_MAPPING["qwen3_5"](
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=256,
            rope_parameters=rope,
            **LINEAR,
        )
    )
    assert "mrope_section" in target_config.get_text_config().rope_parameters  # the target really carries them
    config = drafter_config_for_target(target_config, mask_token_id=MASK_ID, num_draft_layers=2)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000000.0}
    assert config.head_dim == 128
    config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "mrope" not in text and "rope_scaling" not in json.loads(text)
    assert json.loads(text)["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000000.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_train_export_reload_and_decode(family, tmp_path):
    """A few training steps (the loss falls), the export (scaling fields, window), and the reloaded
    drafter in speculative decoding: the same tokens as the trained one, those of plain greedy
    decoding, which itself matches transformers' generate (caches of sliding and linear layers)."""
    target = tiny_target(family)
    drafter = drafter_for(target, layer_types="last_full", sliding_window=6).train()
    extractor = TargetFeatureExtractor(copy.deepcopy(target), [0, 2], truncate=True)
    input_ids, attention_mask = padded_batch(lengths=(24, 19), seed=1)
    loss_mask = attention_mask.bool()
    loss_mask[:, :3] = False
    features = extractor(input_ids, attention_mask)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for step in range(8):
        anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(step % 2))
        hidden = drafter(features, input_ids, anchors, valid)
        labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
        loss, _ = weighted_block_loss(
            hidden[:, :, 1:],
            drafter.target_lm_head.weight,
            labels,
            label_valid,
            loss_weights(4, 2.0),
            output_multiplier=drafter.config.output_multiplier,
            final_logit_softcapping=drafter.config.final_logit_softcapping,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    drafter.eval().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for name, value in FAMILIES[family][2].items():
        assert saved["dflash_config"][name] == pytest.approx(value)
    assert ("logit_scale" in saved) == ("output_multiplier" in FAMILIES[family][2])
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] and saved["sliding_window"] == 6
    reloaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    reloaded.attach_target(target.get_input_embeddings(), target.get_output_embeddings())

    assert TargetRunner(target, []).rollback == (family in HYBRID)
    # A static cache (the GPU default) serves only targets without sliding or linear layers; auto falls back.
    problem = static_cache_problem(target)
    assert (problem is None) == (family in STATIC_CACHE), problem
    assert resolve_kv_cache("auto", "auto", torch.device("cuda", 0), target) == (("static", True) if problem is None else ("dynamic", False))
    prompt = torch.randint(0, MASK_ID, (1, 11), generator=torch.Generator().manual_seed(2))
    eos = target.generation_config.eos_token_id
    eos = [t for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
    reference = greedy_generate(target, prompt, 20, eos)
    generated = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()
    assert reference == generated
    tokens, stats = speculative_generate(target, drafter, prompt, 20, eos_token_ids=eos)
    again, stats_again = speculative_generate(target, reloaded, prompt, 20, eos_token_ids=eos)
    assert tokens == reference and again == tokens and stats_again == stats


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_verify_keep_check_catches_a_cache_that_is_not_cut_back(family, monkeypatch):
    """The start-up check passes on the installed transformers, and fails in one error naming its
    version when the rollback leaves state behind: a restore that restores nothing (linear-attention
    targets) or a crop that crops nothing (attention-only targets)."""
    import dflash_runners

    target = tiny_target(family)
    dflash_runners.check_verify_keep(target)
    if family in HYBRID:
        monkeypatch.setattr(dflash_runners, "_cache_restore", lambda cache, snapshot: None)
    else:
        monkeypatch.setattr(dflash_runners.DynamicCache, "crop", lambda self, n: None)
    with pytest.raises(ValueError, match=f"transformers {transformers.__version__}.*not be lossless"):
        dflash_runners.check_verify_keep(target)
    drafter = drafter_for(target)
    with pytest.raises(ValueError, match="verify-then-keep"):  # decoding refuses to start
        speculative_generate(target, drafter, torch.randint(0, MASK_ID, (1, 9)), 8)


def test_hybrid_detection_never_falls_back_silently(monkeypatch):
    """Without transformers' linear-attention cache layers, a target whose config names
    linear-attention layers is refused (naming the transformers version); an attention-only one
    still decodes with cropping."""
    import dflash_runners

    hybrid, attention_only = tiny_target("qwen3_next"), tiny_target("qwen3")
    assert dflash_runners._needs_rollback_cache(hybrid) and not dflash_runners._needs_rollback_cache(attention_only)
    monkeypatch.delattr(transformers.cache_utils, "LinearAttentionCacheLayerMixin")
    with pytest.raises(ValueError, match=f"linear_attention layers, but transformers {transformers.__version__}"):
        dflash_runners._needs_rollback_cache(hybrid)
    assert not dflash_runners._needs_rollback_cache(attention_only)


def reference_draft_logits(drafter: DFlashDraftModel, features: torch.Tensor, anchor: int, embed: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The draft pass written out from the reference implementation's arithmetic (z-lab
    dflash/model.py, read for this test, not copied): one block after a context of S positions.

    features [S, F] -> logits [B-1, vocab]. Context = hidden_norm(fc(features)); the block is the
    embedding rows of [anchor, MASK x (B-1)] times input_embedding_scale; in every layer the keys
    and values come from [context; block] through the layer's own k_proj / v_proj (k_norm on the
    keys), queries from the block only, RoPE at positions 0..S+B-1, and the layer's mask over those
    positions (causal and q - k < window for sliding layers; nothing for full ones); the logits are
    the head on norm(h) times output_multiplier, soft-capped.
    """
    config = drafter.config
    p = {k: v.double() for k, v in drafter.state_dict().items()}
    eps, d, heads, kv_heads = config.rms_norm_eps, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    block_size, seq = config.block_size, features.shape[0]

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    context = rms(features.double() @ p["fc.weight"].T, p["hidden_norm.weight"])  # [S, hidden]
    block = torch.tensor([anchor] + [config.mask_token_id] * (block_size - 1))
    x = embed.double()[block] * config.input_embedding_scale  # [B, hidden]
    positions = torch.arange(seq + block_size, dtype=torch.float64)
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.cat([positions[:, None] * inv_freq, positions[:, None] * inv_freq], dim=-1)  # [S+B, d]

    def rope(v, at):  # v [T, n, d] at positions `at`
        half = v.shape[-1] // 2
        rotated = torch.cat([-v[..., half:], v[..., :half]], dim=-1)
        return v * angles[at].cos()[:, None] + rotated * angles[at].sin()[:, None]

    for i in range(config.num_hidden_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
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
        out = torch.einsum("hqk,khd->qhd", attention, v).reshape(block_size, heads * d)
        x = x + out @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    logits = rms(x[1:], p["norm.weight"]) @ head.double().T * config.output_multiplier
    cap = config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("is_causal", [None, False])
def test_draft_pass_equals_the_reference_arithmetic(is_causal):
    """A drafter sized like z-lab's Qwen3.5/3.6-35B-A3B ones (a hybrid, partial-rotary MoE target:
    32 heads of 128, full rotary at the target's theta, 3 x hidden MLP), laid out 2 sliding + 1 full
    with a window shorter than the block, with embedding, logit scale and cap fields set: our draft
    pass (growing cache) equals the reference arithmetic at several context lengths."""
    target = tiny_target("qwen3_5_moe")
    text = target.config.get_text_config()
    config = drafter_config_for_target(
        target.config,
        mask_token_id=MASK_ID,
        num_draft_layers=3,
        block_size=5,
        target_layer_ids=[0, 2, 3],
        layer_types="last_full",
        sliding_window=3,
        is_causal=is_causal,
    )
    assert (config.num_attention_heads, config.head_dim, config.intermediate_size) == (32, 128, 3 * text.hidden_size)
    config.dflash_config.update(input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=4.0)
    torch.manual_seed(3)
    drafter = DFlashDraftModel(config).eval()
    for param in drafter.parameters():  # weights large enough that every term matters
        param.data.normal_(0, 0.3)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    features = torch.randn(12, 3 * text.hidden_size)
    for seq, anchor in ((1, 7), (6, 40), (12, 3)):
        cache = drafter.extend_context(None, features[None, :seq])
        ours = drafter.draft_logits(cache, torch.tensor([anchor]))[0]
        expected = reference_draft_logits(drafter, features[:seq], anchor, embed, head)
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)
