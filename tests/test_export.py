"""What the engines read from our export (final/): each layer's causality as vLLM reads it, old and
new, and the model card's word on what each engine runs where they differ."""

import json

import pytest
from test_convert import vllm_layer_causal
from transformers import Qwen3Config

from dflash_checkpoint import attention_note
from dflash_model import DFlashConfig
from dflash_target import drafter_config_for_target

TARGET = Qwen3Config(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def export_config(tmp_path, layer_types="all_full", is_causal=None, drafter="dflash", num_draft_layers=3) -> dict:
    """config.json of our export for a drafter of this layout, as save_pretrained writes it."""
    config = drafter_config_for_target(
        TARGET,
        mask_token_id=5,
        num_draft_layers=num_draft_layers,
        layer_types=layer_types,
        sliding_window=None if layer_types == "all_full" else 16,
        is_causal=is_causal,
        drafter=drafter,
    )
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("reads_is_causal", [True, False], ids=["vllm-is_causal", "vllm-0.26"])
@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize(
    "layer_types,drafter", [("all_full", "dflash"), ("last_full", "dflash"), ("all_sliding", "dflash"), ("last_full", "dflash2")]
)
def test_vllm_runs_each_layer_of_our_export_as_it_was_trained(tmp_path, layer_types, drafter, is_causal, reads_is_causal):
    """vLLM's per-layer rule (tests/test_convert.py, `vllm_layer_causal`), with is_causal read first
    or, as vLLM 0.26 and older, not at all, gives every layer the causality it trained with."""
    saved = export_config(tmp_path, layer_types, is_causal, drafter)
    config = DFlashConfig.from_pretrained(tmp_path)
    trained = [config.attention_rule(i)[0] for i in range(config.num_hidden_layers)]
    assert vllm_layer_causal(saved, reads_is_causal) == trained
    assert saved["dflash_config"].get("causal") == saved.get("is_causal")


def test_a_config_with_only_dflash_config_causal_reads_it_as_vllm_does(tmp_path):
    saved = export_config(tmp_path, "last_full")
    assert saved["is_causal"] is None and "causal" not in saved["dflash_config"]
    (tmp_path / "config.json").write_text(json.dumps({**saved, "dflash_config": {**saved["dflash_config"], "causal": True}}))
    config = DFlashConfig.from_pretrained(tmp_path)
    assert config.is_causal is True and [config.attention_rule(i)[0] for i in range(3)] == [True] * 3


def test_the_card_says_what_each_engine_runs_for_causal_sliding_layers(tmp_path):
    """Sliding + full layers with is_causal unset: the engines part (llama.cpp runs one causality for
    every layer; vLLM, after conversion to speculators' layout, runs the full layer causal), and the
    card says so. Every other layout is run as trained everywhere, and the card says nothing."""
    note = attention_note(DFlashConfig.from_dict(export_config(tmp_path, "last_full")))
    assert note.startswith(
        "\n\nAttention in each engine: layers 0, 1 slide causally and layers 2 are bidirectional "
        "full layers (`is_causal` unset), as trained. z-lab's code, SGLang and vLLM run them so. llama.cpp"
    )
    assert "runs the sliding layers bidirectional" in note and "--to speculators" in note
    only_sliding = attention_note(DFlashConfig.from_dict(export_config(tmp_path, "all_sliding")))
    assert "layers 0, 1, 2 slide causally (`is_causal` unset)" in only_sliding and "speculators" not in only_sliding
    for layer_types, is_causal in (("all_full", None), ("last_full", False), ("all_sliding", True)):
        assert attention_note(DFlashConfig.from_dict(export_config(tmp_path, layer_types, is_causal))) == ""
