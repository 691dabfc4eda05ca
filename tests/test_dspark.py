"""DSpark drafters against golden tensors from DeepSeek's DeepSpec (tests/fixtures/dspark: its README.md
says how they were made, make_fixture.py what each tensor is): the same weights loaded by name, then
the training forward (hidden states, logits with and without the Markov term, confidence logits),
labels and validity, the loss's three terms and total, and greedy drafting through the Markov head,
all in fp32 on CPU through SDPA with a dense mask (no compile: the README notes compiled flex on CPU
gave wrong values). Plus the config's refusals, the gradient paths, sampling, and the export.

Only slots of kept blocks are compared: DeepSpec's padded dummy block attends to nothing, ours sees
its own block (both carry zero weight).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, safe_open

from dflash_loss import block_target_hidden, dspark_loss
from dflash_model import sample_index, sampling_probs
from dspark_model import DSparkConfig, DSparkDraftModel, dspark_block_labels, markov_predecessor_ids, save_dspark_export

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "dspark"
ATOL = 1e-5  # fp32 on CPU; the observed differences are below 2e-6
TARGET_TABLES = ("embed_tokens.weight", "lm_head.weight")


def load_drafter(directory: Path = FIXTURE) -> DSparkDraftModel:
    """A DSpark drafter from a DeepSpec-native checkpoint: its own weights with load_state_dict (strict), the
    embedding and LM head in it attached as the target's."""
    config = DSparkConfig.from_pretrained(directory)
    drafter = DSparkDraftModel(config).float().eval()
    weights = load_file(directory / "model.safetensors")
    embed = nn.Embedding.from_pretrained(weights.pop("embed_tokens.weight"))
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm_head.weight = nn.Parameter(weights.pop("lm_head.weight"), requires_grad=False)
    drafter.load_state_dict(weights, strict=True)
    drafter.attach_target(embed, lm_head)
    return drafter


@pytest.fixture(scope="module")
def drafter():
    return load_drafter()


@pytest.fixture(scope="module")
def inputs():
    return load_file(FIXTURE / "inputs.safetensors")


@pytest.fixture(scope="module")
def golden():
    return load_file(FIXTURE / "outputs.safetensors")


def training_pass(drafter, inputs):
    """(hidden [2, 3, 4, 32], teacher-forced predecessors [2, 3, 4]) of the fixture's batch."""
    with torch.no_grad():
        hidden = drafter(inputs["context_features"], inputs["input_ids"], inputs["anchors"], inputs["block_keep_mask"], attention_backend="sdpa")
    return hidden, markov_predecessor_ids(inputs["input_ids"], inputs["anchors"], drafter.config.block_size)


def close(actual, expected, keep, atol=ATOL):
    torch.testing.assert_close(actual[keep], expected[keep], atol=atol, rtol=0)


# ---- config and weights ------------------------------------------------------------------------


def test_config_reads_deepspec_layout(drafter):
    config = drafter.config
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (4, 63, [1, 3, 4])
    assert (config.markov_rank, config.markov_head_type, config.enable_confidence_head, config.confidence_head_with_markov) == (
        8,
        "vanilla",
        True,
        True,
    )
    names = set(load_file(FIXTURE / "model.safetensors")) - set(TARGET_TABLES)
    assert set(drafter.state_dict()) == names  # every DeepSpec tensor name, nothing more


@pytest.mark.parametrize(
    "change, message",
    [
        ({"markov_head_type": "rnn"}, "vanilla"),
        ({"markov_rank": 0}, "markov_rank is 0"),
        ({"sample_from_anchor": False}, "sample_from_anchor"),
        ({"markov_rank": -1}, "markov_rank must be >= 0"),
    ],
)
def test_config_refuses(change, message):
    config = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**{**config, **change})


def test_no_confidence_head_without_markov_rank():
    config = json.loads((FIXTURE / "config.json").read_text())
    drafter = DSparkDraftModel(DSparkConfig(**{**config, "markov_rank": 0, "enable_confidence_head": False}))
    assert drafter.markov_head is None and drafter.confidence_head is None
    assert not any(name.startswith(("markov_head", "confidence_head")) for name in drafter.state_dict())


# ---- training forward ------------------------------------------------------------------------


def test_training_forward_parity(drafter, inputs, golden):
    """Hidden states, logits without and with the Markov term, and confidence logits equal DeepSpec's."""
    keep = inputs["block_keep_mask"]
    hidden, prev = training_pass(drafter, inputs)
    with torch.no_grad():
        close(hidden, golden["hidden"], keep)
        close(drafter.compute_logits(hidden), golden["base_logits"], keep)
        close(drafter.block_logits(hidden, prev), golden["logits"], keep)
        close(drafter.confidence_logits(hidden, prev), golden["confidence_logits"], keep)


def test_markov_term_and_predecessor_alignment_matter(drafter, inputs, golden):
    """The fixture can tell a dropped Markov term or predecessors shifted by one slot (either way)
    from the right ones: each variant misses DeepSpec's logits by far more than the tolerance."""
    keep = inputs["block_keep_mask"]
    hidden, prev = training_pass(drafter, inputs)
    assert torch.equal(prev[:, :, 0], inputs["input_ids"].gather(1, inputs["anchors"]))  # slot 0: the anchor itself
    ids, anchors = inputs["input_ids"], inputs["anchors"]
    shifted_back = ids.gather(1, (anchors[:, :, None] + torch.arange(4) - 1).clamp(0, 11).flatten(1)).view_as(prev)
    shifted_on = ids.gather(1, (anchors[:, :, None] + torch.arange(4) + 1).clamp(0, 11).flatten(1)).view_as(prev)
    with torch.no_grad():
        for variant in (drafter.compute_logits(hidden), drafter.block_logits(hidden, shifted_back), drafter.block_logits(hidden, shifted_on)):
            assert (variant - golden["logits"])[keep].abs().max() > 0.1
        for variant_prev in (shifted_back, shifted_on):
            assert (drafter.confidence_logits(hidden, variant_prev) - golden["confidence_logits"])[keep].abs().max() > 0.01


def test_labels_validity_and_target_alignment(inputs, golden):
    """Slot k's label is token[a+k+1]; validity is a prefix (DeepSpec's eval_mask); p's logits come from
    position a+k."""
    labels, valid = dspark_block_labels(inputs["input_ids"], inputs["loss_mask"], inputs["anchors"], inputs["block_keep_mask"], 4)
    assert torch.equal(valid, golden["eval_mask"])
    assert torch.equal(labels[valid], golden["target_ids"][valid])
    aligned = block_target_hidden(inputs["target_logits"], inputs["anchors"], 4 + 1)
    torch.testing.assert_close(aligned[valid], golden["aligned_target_logits"][valid], atol=0, rtol=0)
    # A hole in the loss mask cuts the rest of the block: row 1, anchor 7 has labels 8..11 with 11 off.
    assert valid[1, 1].tolist() == [True, True, True, False]


# ---- loss --------------------------------------------------------------------------------------


def fixture_loss(drafter, inputs, logits, confidence):
    labels, valid = dspark_block_labels(inputs["input_ids"], inputs["loss_mask"], inputs["anchors"], inputs["block_keep_mask"], 4)
    target_logits = block_target_hidden(inputs["target_logits"], inputs["anchors"], 4 + 1)
    return dspark_loss(logits, confidence, labels, valid, target_logits)


def test_loss_parity_on_golden_logits(drafter, inputs, golden):
    """Each term and the total equal DeepSpec's on DeepSpec's own logits (the loss alone)."""
    loss, terms = fixture_loss(drafter, inputs, golden["logits"], golden["confidence_logits"])
    for name, key in (("ce", "loss.ce"), ("l1", "loss.l1"), ("bce", "loss.bce")):
        torch.testing.assert_close(terms[name], golden[key], atol=ATOL, rtol=0)
    torch.testing.assert_close(loss, golden["loss.total"], atol=ATOL, rtol=0)
    torch.testing.assert_close(loss, 0.1 * terms["ce"] + 0.9 * terms["l1"] + terms["bce"], atol=1e-6, rtol=0)


def test_loss_parity_end_to_end(drafter, inputs, golden):
    """The loss on our drafter's own forward of the fixture batch equals DeepSpec's."""
    hidden, prev = training_pass(drafter, inputs)
    with torch.no_grad():
        loss, terms = fixture_loss(drafter, inputs, drafter.block_logits(hidden, prev), drafter.confidence_logits(hidden, prev))
    torch.testing.assert_close(loss, golden["loss.total"], atol=ATOL, rtol=0)
    torch.testing.assert_close(terms["l1"], golden["loss.l1"], atol=ATOL, rtol=0)


def test_loss_gradients(drafter, inputs, golden):
    """BCE's target is detached: with CE and L1 off the drafter's logits get no gradient, the confidence
    logits do. A NaN in an invalid slot (a fully masked SDPA row) does not reach the loss."""
    logits = golden["logits"].clone().requires_grad_(True)
    confidence = golden["confidence_logits"].clone().requires_grad_(True)
    labels, valid = dspark_block_labels(inputs["input_ids"], inputs["loss_mask"], inputs["anchors"], inputs["block_keep_mask"], 4)
    target_logits = block_target_hidden(inputs["target_logits"], inputs["anchors"], 4 + 1)
    loss, _ = dspark_loss(logits, confidence, labels, valid, target_logits, ce_weight=0.0, l1_weight=0.0)
    loss.backward()
    assert logits.grad is None or logits.grad.abs().max() == 0
    assert confidence.grad[valid].abs().min() > 0 and confidence.grad[~valid].abs().max() == 0
    poisoned = golden["logits"].clone()
    poisoned[1, 2] = float("nan")  # the padded dummy block
    total, _ = dspark_loss(poisoned, golden["confidence_logits"], labels, valid, target_logits)
    torch.testing.assert_close(total, golden["loss.total"], atol=ATOL, rtol=0)


# ---- drafting --------------------------------------------------------------------------------


def draft_pass(drafter, inputs, golden, case):
    row, anchor = inputs["draft_cases"][case].tolist()
    cache = drafter.extend_context(None, inputs["context_features"][row : row + 1, :anchor])  # the context before the anchor
    anchor_token = golden[f"draft{case}.block_ids"][:, 0]
    return cache, anchor_token, drafter.draft_hidden(cache, anchor_token)


@pytest.mark.parametrize("case", [0, 1])
def test_greedy_draft_parity(drafter, inputs, golden, case):
    """DeepSpec's evaluator path (KV cache, greedy through the Markov head): hidden states, logits with
    and without the Markov term of the drafted predecessors, the drafts, and the confidence logits."""
    cache, anchor_token, hidden = draft_pass(drafter, inputs, golden, case)
    everything = torch.ones(hidden.shape[:2], dtype=torch.bool)
    close(hidden, golden[f"draft{case}.hidden"], everything)
    close(drafter.compute_logits(hidden), golden[f"draft{case}.base_logits"], everything)
    tokens, logits, q = drafter.markov_walk(hidden, anchor_token)
    close(logits, golden[f"draft{case}.markov_logits"], everything)
    assert torch.equal(tokens, golden[f"draft{case}.greedy_tokens"])
    assert torch.equal(drafter.draft_block(cache, anchor_token), tokens)
    assert torch.equal(q.argmax(-1), tokens) and torch.equal(q.sum(-1), torch.ones(1, 4))
    close(drafter.draft_confidence(hidden, anchor_token, tokens), golden[f"draft{case}.confidence_logits"], everything)


def test_markov_term_changes_the_greedy_drafts(drafter, inputs, golden):
    """Without the Markov term the argmax drafts differ (the fixture's cases were chosen so): a walk that
    dropped it, or fed it the wrong predecessor, would fail test_greedy_draft_parity."""
    _, _, hidden = draft_pass(drafter, inputs, golden, 0)
    assert drafter.compute_logits(hidden).argmax(-1).tolist() == [[2, 59, 59, 59]]
    assert golden["draft0.greedy_tokens"].tolist() == [[2, 52, 59, 59]]


def test_sampled_draft_follows_the_markov_chain(drafter, inputs, golden):
    """At T > 0 each slot's q is softmax((lm_head(h_k) + W2(W1[x_{k-1}])) / T) of the token drawn before it,
    and the token is drawn from q with the given uniform draw."""
    cache, anchor_token, hidden = draft_pass(drafter, inputs, golden, 1)
    uniform = torch.tensor([[0.9, 0.3, 0.6, 0.1]])
    tokens, q = drafter.draft_sample(cache, anchor_token, temperature=0.8, top_p=1.0, uniform=uniform)
    base = golden["draft1.base_logits"][0]
    prev = torch.cat([anchor_token, tokens[0, :-1]])
    with torch.no_grad():
        expected = sampling_probs(base + drafter.markov_head(prev), 0.8)  # [4, V]
    torch.testing.assert_close(q[0], expected, atol=ATOL, rtol=0)
    assert torch.equal(tokens[0], sample_index(expected, uniform[0]))
    with pytest.raises(ValueError, match="draft_sample"):
        drafter.draft_probs(cache, anchor_token, 0.8)


# ---- export ------------------------------------------------------------------------------------


def test_validity_is_a_prefix():
    """A hole in the loss mask inside a block ends the block's supervision there (DeepSpec's
    eval_mask); a padded anchor slot supervises nothing. Worked example: labels at 3..6 with
    loss mask 1, 1, 0, 1 -> valid 1, 1, 0, 0."""
    input_ids = torch.arange(10)[None]
    loss_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 1, 1, 1]])
    anchors, anchor_valid = torch.tensor([[2, 6, 0]]), torch.tensor([[True, True, False]])
    labels, valid = dspark_block_labels(input_ids, loss_mask, anchors, anchor_valid, 4)
    assert labels[0, 0].tolist() == [3, 4, 5, 6]
    assert valid.int().tolist() == [[[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]]


# ---- export ------------------------------------------------------------------------------------

# What the engines read with a risky default when missing (vLLM, SGLang, llama.cpp, DeepSpec's own loader).
ENGINE_KEYS = {
    "architectures": ["Qwen3DSparkModel"],
    "block_size": 4,
    "mask_token_id": 63,
    "target_layer_ids": [1, 3, 4],
    "num_target_layers": 6,
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "head_dim": 8,
    "sample_from_anchor": True,
    "num_anchors": 3,
    "model_type": "qwen3",
    "tie_word_embeddings": False,
}


def test_export_round_trip(drafter, inputs, golden, tmp_path):
    """The export has every key the engines need, explicitly, the fixture's tensor names (DeepSpec's
    layout, embed_tokens and lm_head included) with equal values, and loads back to the same drafter."""
    save_dspark_export(drafter, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert {key: config.get(key) for key in ENGINE_KEYS} == ENGINE_KEYS
    fixture = load_file(FIXTURE / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert set(exported) == set(fixture)
    assert all(torch.equal(exported[name], fixture[name]) for name in fixture)
    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    reloaded = load_drafter(tmp_path / "export")
    hidden, prev = training_pass(reloaded, inputs)
    keep = inputs["block_keep_mask"]
    with torch.no_grad():
        close(reloaded.block_logits(hidden, prev), golden["logits"], keep)
