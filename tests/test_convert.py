"""convert_dflash.py: our export <-> speculators' layout.

In CI (no speculators installed): a round trip gives back the same bytes, the config we write for
speculators equals what `speculators convert` writes (fixture), the sliding-window bound is where the
two window rules start to differ, and every drafter one side cannot express is refused in one line.

With speculators 0.9.0 importable (a benchmark tool, not a requirement: it pins transformers <= 5.19),
its model classes also load what we write and compute the same draft logits and selector scores;
beyond the window bound they differ, which is why the converter refuses there. Without it those
tests are skipped.

Fixtures: tests/fixtures/speculators_dflash_config.json is what `speculators convert <export>
--algorithm dflash --verifier <target>` (speculators 0.9.0, transformers 5.19) wrote for the export
`tiny_export("dflash", "all_full")` below; tests/fixtures/speculators_tensor_layout.json holds the
tensor names and shapes of speculators 0.9.0's own DFlash and DFlash2 draft models at the sizes of
`tiny_export`, recorded by tests/fixtures/make_speculators_tensor_layout.py.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_dflash2 import speculators_rule
from transformers import Qwen3Config

import convert_dflash
from convert_dflash import ConversionError, window_bound
from dflash2_model import DFlash2DraftModel
from dflash_masks import position_rule
from dflash_model import DFlashDraftModel
from dflash_target import drafter_config_for_target

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
VOCAB, HIDDEN, BLOCK, WINDOW = 1000, 64, 8, 16
TARGET = Qwen3Config(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    architectures=["Qwen3ForCausalLM"],
)
HAS_SPECULATORS = importlib.util.find_spec("speculators") is not None
needs_speculators = pytest.mark.skipif(not HAS_SPECULATORS, reason="speculators is not installed (a benchmark tool, not a requirement)")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A target folder with config.json only: the converter reads the target's config, never its weights."""
    path = tmp_path_factory.mktemp("target")
    TARGET.save_pretrained(path)
    return path


def tiny_export(path: Path, drafter: str, layer_types: str, seed: int = 0, **settings) -> Path:
    """Our export of a 2-layer drafter (block 8, target layers 0 and 2, mask token 5) with every weight
    drawn at random, so that no identity-initialised convolution hides a mismatch."""
    extra = {"selector_rank": 8, "selector_top_k": 4} if drafter == "dflash2" else {}
    config = drafter_config_for_target(
        TARGET,
        mask_token_id=5,
        num_draft_layers=2,
        block_size=BLOCK,
        target_layer_ids=settings.pop("target_layer_ids", [0, 2]),
        layer_types=layer_types,
        sliding_window=WINDOW if layer_types != "all_full" else None,
        drafter=drafter,
        **extra,
        **settings,
    )
    model = (DFlash2DraftModel if drafter == "dflash2" else DFlashDraftModel)(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return path


def convert(source, output, to, target, *extra):
    return convert_dflash.main([str(source), str(output), "--to", to, "--target", str(target), *extra])


@pytest.mark.parametrize(
    "drafter,layer_types,extra",
    [("dflash", "all_full", []), ("dflash", "last_full", ["--max_seq_len", "9"]), ("dflash2", "all_sliding", ["--max_seq_len", "9"])],
)
def test_a_round_trip_through_speculators_layout_gives_back_the_same_bytes(tmp_path, target_dir, drafter, layer_types, extra):
    ours = tiny_export(tmp_path / "ours", drafter, layer_types)
    convert(ours, tmp_path / "speculators", "speculators", target_dir, *extra)
    convert(tmp_path / "speculators", tmp_path / "back", "zlab", target_dir, *extra)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "back" / name).read_bytes() == (ours / name).read_bytes(), name
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert written["aux_hidden_state_layer_ids"] == [1, 3]  # HF hidden_states indices: our ids + 1
    assert written["speculators_model_type"] == drafter
    # A DFlash sliding layer is causal (the engines' default), a DFlash2 one bidirectional (z-lab's
    # fixture); with no sliding layer every layer is bidirectional.
    assert written["sliding_window_non_causal"] is (drafter == "dflash2" or layer_types == "all_full")
    if drafter == "dflash2":
        assert (written["conv_kernel_size"], written["conv_group_size"], written["selector_rank"], written["selector_top_k"]) == (2, 16, 8, 4)


@pytest.mark.parametrize("drafter,layer_types,extra", [("dflash", "all_full", []), ("dflash2", "all_sliding", ["--max_seq_len", "9"])])
def test_the_speculators_checkpoint_holds_speculators_own_tensor_names_and_shapes(tmp_path, target_dir, drafter, layer_types, extra):
    """--to speculators writes exactly the tensors speculators' loader reads from a checkpoint (its
    model's state_dict, less what it takes from the verifier when missing), each with speculators'
    shape, and each the tensor of that name in our export: the layouts share their names, and every
    weight of tiny_export is random, so two names swapped between tensors of one shape show too.
    The fixture comes from speculators' own model classes; a symmetric mistake in both directions
    of the converter keeps the round trip exact but fails here."""
    from safetensors.torch import load_file

    layout = json.loads((FIXTURES / "speculators_tensor_layout.json").read_text())
    assert layout["speculators_version"] == convert_dflash.SPECULATORS_VERSION
    theirs = layout[drafter]
    expected = {name: shape for name, shape in theirs["tensors"].items() if name not in theirs["taken_from_the_verifier_when_missing"]}
    ours = tiny_export(tmp_path / "ours", drafter, layer_types)
    convert(ours, tmp_path / "speculators", "speculators", target_dir, *extra)
    written = load_file(tmp_path / "speculators" / "model.safetensors")
    assert {name: list(tensor.shape) for name, tensor in written.items()} == expected
    source = load_file(ours / "model.safetensors")
    assert [name for name, tensor in written.items() if not torch.equal(tensor, source[name])] == []


def test_the_speculators_config_is_what_speculators_convert_writes(tmp_path, target_dir):
    ours = tiny_export(tmp_path / "ours", "dflash", "all_full")
    convert(ours, tmp_path / "speculators", "speculators", target_dir)
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    reference = json.loads((FIXTURES / "speculators_dflash_config.json").read_text())
    # Not compared: where the verifier lives, the transformers version, and speculators' pointer to the
    # config.py it copies beside its output (its model classes load the config without it, tested below).
    for config in (written, reference):
        config["speculators_config"]["verifier"].pop("name_or_path")
        config.pop("transformers_version")
        config.pop("auto_map", None)
    # speculators copies our is_causal into the layers' config, where nothing reads it; we leave it out.
    assert reference["transformer_layer_config"].pop("is_causal") is None
    # speculators writes false for every DFlash drafter, which vLLM serves causal on every layer
    # (test_vllm_serves_the_converted_drafter_as_it_was_trained); this drafter has no causal layer.
    assert reference.pop("sliding_window_non_causal") is False and written.pop("sliding_window_non_causal") is True
    assert written == reference


# vLLM's reading of DFlash causality, in our words (no vLLM import):
# - `update_dflash` in vllm/transformers_utils/configs/speculators/algos.py (vllm#47745) builds the
#   drafter's config from a speculators checkpoint: its transformer_layer_config, plus
#   dflash_config.causal = not sliding_window_non_causal (true when the key is absent);
# - `_dflash_layer_causal` in vllm/model_executor/models/qwen3_dflash.py decides each layer: an
#   is_causal that is set, for every layer (vLLM 0.26 and older skip this step); else a
#   dflash_config.causal that is set, for every layer; else causal exactly for sliding_attention layers.


def vllm_update_dflash(speculators_config: dict) -> dict:
    """The config vLLM builds from a speculators checkpoint's config.json (the causality fields only)."""
    return {
        **speculators_config["transformer_layer_config"],
        "dflash_config": {"causal": not speculators_config.get("sliding_window_non_causal", True)},
    }


def vllm_layer_causal(config: dict, reads_is_causal: bool = True) -> list[bool]:
    """Per drafter layer, whether vLLM runs it causal, from a config in z-lab's layout."""
    override = config.get("is_causal") if reads_is_causal else None
    if override is None:
        override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return [bool(override)] * config["num_hidden_layers"]
    return [kind == "sliding_attention" for kind in config["layer_types"]]


@pytest.mark.parametrize(
    "drafter,layer_types,is_causal",
    [
        ("dflash", "all_full", None),
        ("dflash", "all_sliding", None),
        ("dflash", "all_sliding", False),
        ("dflash", "all_sliding", True),
        ("dflash", "last_full", False),
        ("dflash2", "all_full", None),
        ("dflash2", "all_sliding", None),
        ("dflash2", "last_full", None),
    ],
)
def test_vllm_serves_the_converted_drafter_as_it_was_trained(tmp_path, target_dir, caplog, drafter, layer_types, is_causal):
    """vLLM's two rules (above) on what --to speculators writes give each layer the causality it was
    trained with (`attention_rule`), and so do speculators' (its full layers are bidirectional, its
    sliding ones causal unless sliding_window_non_causal); no warning."""
    ours = tiny_export(tmp_path / "ours", drafter, layer_types, is_causal=is_causal)
    convert(ours, tmp_path / "speculators", "speculators", target_dir, "--max_seq_len", "9")
    trained_config = DFlashDraftModel.config_class.from_pretrained(ours)
    trained = [trained_config.attention_rule(i)[0] for i in range(trained_config.num_hidden_layers)]
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert vllm_layer_causal(vllm_update_dflash(written)) == trained
    speculators = [
        kind == "sliding_attention" and not written["sliding_window_non_causal"] for kind in written["transformer_layer_config"]["layer_types"]
    ]
    assert speculators == trained
    assert "vllm" not in caplog.text.lower()


def test_causal_sliding_layers_beside_full_ones_convert_with_a_warning_that_vllm_runs_them_causal(tmp_path, target_dir, caplog):
    """[sliding, full] with is_causal unset trains [causal, bidirectional]: speculators' layout can say
    so (sliding_window_non_causal false), but vLLM then runs [causal, causal]; one warning line names
    what each runs."""
    ours = tiny_export(tmp_path / "ours", "dflash", "last_full")
    with caplog.at_level("WARNING", logger="convert_dflash"):
        convert(ours, tmp_path / "speculators", "speculators", target_dir, "--max_seq_len", "9")
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert written["sliding_window_non_causal"] is False
    assert vllm_layer_causal(vllm_update_dflash(written)) == [True, True]
    [record] = [r for r in caplog.records if r.name == "convert_dflash"]
    message = record.getMessage()
    assert "\n" not in message
    assert (
        "layers 0 slide causally and layers 1 are bidirectional full layers: speculators runs them as trained; vLLM "
        "reads sliding_window_non_causal false as dflash_config.causal true and runs layers 1 causal too"
    ) in message, message


def test_the_window_bound_is_where_the_two_window_rules_start_to_differ():
    """Every anchor of a sequence of window - B + 1 tokens sees the same keys under our rule and
    speculators' (causal and not); one token more, and the last anchor does not."""
    bound = window_bound(WINDOW, BLOCK)
    assert bound == 9

    def rules_agree(seq_len, causal):
        for anchor in range(seq_len):
            q = torch.arange(anchor, anchor + BLOCK)[:, None]
            k = torch.arange(anchor + BLOCK)[None, :]
            ours = position_rule(q, k, causal, WINDOW)  # keys: the context, then the anchor's block
            if not torch.equal(ours, speculators_rule(q, k, anchor, causal, WINDOW).expand_as(ours)):
                return False
        return True

    for causal in (True, False):
        assert rules_agree(bound, causal) and not rules_agree(bound + 1, causal)


def test_what_the_other_layout_cannot_express_is_refused_in_one_line(tmp_path, target_dir):
    sliding = tiny_export(tmp_path / "sliding", "dflash", "last_full")
    with pytest.raises(ConversionError, match=r"layers 0 are sliding-window layers \(window 16\).*longer than 9 tokens.*served at 512"):
        convert(sliding, tmp_path / "out", "speculators", target_dir)
    with pytest.raises(ConversionError, match=r"include the target's last layer \(3\)"):
        convert(tiny_export(tmp_path / "last", "dflash", "all_full", target_layer_ids=[0, 3]), tmp_path / "out", "speculators", target_dir)
    scaled = tiny_export(tmp_path / "scaled", "dflash", "all_full")
    config = json.loads((scaled / "config.json").read_text())
    config["dflash_config"]["final_logit_softcapping"] = 30.0
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="final_logit_softcapping"):
        convert(scaled, tmp_path / "out", "speculators", target_dir)
    with pytest.raises(ConversionError, match="hidden size 64 and 4 layers"):
        other = tmp_path / "other-target"
        Qwen3Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(other)
        convert(tiny_export(tmp_path / "full", "dflash", "all_full"), tmp_path / "out", "speculators", other)
    assert not (tmp_path / "out").exists()  # a refusal writes nothing

    convert(tmp_path / "full", tmp_path / "spec", "speculators", target_dir)
    for field, value, message in (("sample_from_anchor", True, "sample_from_anchor"), ("draft_vocab_size", 500, "reduced draft vocabulary")):
        changed = tmp_path / f"spec-{field}"
        changed.mkdir()
        (changed / "model.safetensors").write_bytes((tmp_path / "spec" / "model.safetensors").read_bytes())
        config = json.loads((tmp_path / "spec" / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ConversionError, match=message):
            convert(changed, tmp_path / "out", "zlab", target_dir)
    import dflash_decoding  # evaluation names the conversion when handed a speculators checkpoint

    with pytest.raises(ValueError, match=r"is a speculators checkpoint; convert it .*convert_dflash.py .* --to zlab"):
        dflash_decoding.load_drafter(str(tmp_path / "spec"), torch.float32, torch.device("cpu"))
    with pytest.raises(ConversionError, match="already our export"):
        convert(tmp_path / "full", tmp_path / "out", "zlab", target_dir)
    with pytest.raises(ConversionError, match="exists; pass --overwrite"):
        convert(tmp_path / "full", tmp_path / "spec", "speculators", target_dir)

    # The command line: one `error:` line, exit status 2, as train_dflash.py and eval_dflash.py.
    result = subprocess.run(
        [sys.executable, "convert_dflash.py", str(sliding), str(tmp_path / "cli"), "--to", "speculators", "--target", str(target_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in result.stderr


# ---- with speculators installed: its model classes on what we write ------------------------------------


def speculators_draft_logits(folder: Path, target, context_features, input_ids, anchors):
    """speculators' draft logits [1, N * B, vocab] at the given anchors (its anchors are sampled from the
    loss mask: one valid position per anchor makes them exactly these)."""
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel as SpeculatorsDFlash
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel as SpeculatorsDFlash2

    is_dflash2 = json.loads((folder / "config.json").read_text())["speculators_model_type"] == "dflash2"
    config = (DFlash2SpeculatorConfig if is_dflash2 else DFlashSpeculatorConfig).from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"  # its flex path has no backward on CPU; sdpa is the same mask
    model = (SpeculatorsDFlash2 if is_dflash2 else SpeculatorsDFlash).from_pretrained(folder, config=config).eval()
    model.lm_head.weight.data.copy_(target.lm_head.weight)  # its verifier weights, as ours attaches them
    model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    seq_len = input_ids.shape[1]
    loss_mask = torch.zeros(1, seq_len)
    loss_mask[0, anchors[0]] = 1
    with torch.no_grad():
        _, logits, _, _, indices = model._backbone_forward(
            context_features,
            input_ids,
            loss_mask,
            torch.zeros(1, seq_len, HIDDEN),
            torch.zeros(1, seq_len, dtype=torch.long),
            max_anchors=anchors.shape[1],
        )
    assert torch.equal(indices.view(-1, BLOCK)[:, 0], anchors[0])
    return logits, model


@needs_speculators
@pytest.mark.parametrize("drafter,layer_types", [("dflash", "all_full"), ("dflash", "all_sliding"), ("dflash2", "all_sliding")])
def test_speculators_computes_our_draft_logits_from_what_we_write(tmp_path, drafter, layer_types):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(**{**TARGET.to_dict(), "initializer_range": 0.2})).eval()
    target.save_pretrained(tmp_path / "target")  # speculators reads the verifier's embedding and head from it
    ours = tiny_export(tmp_path / "ours", drafter, layer_types)
    convert(ours, tmp_path / "speculators", "speculators", tmp_path / "target", "--max_seq_len", "9")
    drafter_model = (DFlash2DraftModel if drafter == "dflash2" else DFlashDraftModel).from_pretrained(ours).eval()
    drafter_model.attach_target(target.model.embed_tokens, target.lm_head)
    seq_len = 40
    input_ids = torch.randint(0, VOCAB, (1, seq_len))
    features = torch.randn(1, seq_len, 2 * HIDDEN)
    within, beyond = torch.tensor([[3, 7, 8]]), torch.tensor([[3, 8, 20]])  # 8 + B - 1 < 16 <= 20 + B - 1
    for anchors, sliding_binds in ((within, False), (beyond, layer_types != "all_full")):
        theirs, model = speculators_draft_logits(tmp_path / "speculators", target, features, input_ids, anchors)
        with torch.no_grad():
            mine = drafter_model.compute_logits(drafter_model(features, input_ids, anchors, torch.ones_like(anchors, dtype=torch.bool)))
        difference = (theirs - mine.view(1, -1, VOCAB)).abs().max().item()
        if sliding_binds:
            assert difference > 1e-2  # the other window rule: why the converter refuses past the bound
        else:
            assert difference < 1e-5
    if drafter == "dflash2":
        hidden = torch.randn(3, 5, HIDDEN)
        predecessors, candidates = torch.randint(0, VOCAB, (3, 5)), torch.randint(0, VOCAB, (3, 5, 4))
        unary = torch.randn(3, 5, VOCAB)
        with torch.no_grad():
            theirs = model.candidate_selector.score_candidates(unary, hidden, predecessors, candidates)
            mine = drafter_model.candidate_selector(hidden, predecessors, candidates, unary.gather(-1, candidates))
        assert (theirs - mine).abs().max() < 1e-5
