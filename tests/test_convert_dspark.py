"""convert_dflash.py on DSpark drafters: our export (DeepSpec's layout) <-> speculators' `dspark` layout.

In CI (no speculators installed): a round trip gives back the same bytes (config and tensors, the
target's embedding and LM head included, which speculators' layout leaves out and the way back reads
from the target), the speculators checkpoint holds exactly the tensors speculators' own DSpark model
reads (tests/fixtures/speculators_tensor_layout.json, made from its classes), its config says what
the engines read (`sample_from_anchor` written, gamma drafts), DeepSpec's own checkpoint converts, and
what one side cannot express is refused in one line.

With speculators 0.9.0 importable (a benchmark tool, not a requirement), its `dspark` classes also
load what we write and compute our teacher-forced logits (Markov term included) and confidence logits.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import convert_dflash
from convert_dflash import ConversionError
from dflash_target import drafter_config_for_target
from dspark_model import DSparkConfig, DSparkDraftModel, markov_predecessor_ids, save_dspark_export

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB, HIDDEN, GAMMA, RANK = 1000, 64, 5, 8
TARGET = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    architectures=["Qwen3ForCausalLM"],
)
TABLES = ("embed_tokens.weight", "lm_head.weight")
HAS_SPECULATORS = importlib.util.find_spec("speculators") is not None

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_target(path: Path, seed: int = 0, tied: bool = False) -> Path:
    """A tiny random Qwen3 target saved with its weights (the converter reads its embedding and LM head)."""
    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**TARGET, tie_word_embeddings=tied)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("target"))


def load_target(path: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(path).eval()


def tiny_export(path: Path, target_dir: Path, markov_rank: int = RANK, enable_confidence_head: bool = True) -> Path:
    """save_dspark_export of a 2-layer DSpark drafter (gamma 5, target layers 0 and 2, mask token 5,
    16 anchors) with every weight drawn at random, attached to the target in `target_dir`."""
    config = drafter_config_for_target(
        Qwen3Config(**TARGET),
        mask_token_id=5,
        num_draft_layers=2,
        block_size=GAMMA,
        target_layer_ids=[0, 2],
        drafter="dspark",
        markov_rank=markov_rank,
        enable_confidence_head=enable_confidence_head,
        num_anchors=16,
    )
    drafter = DSparkDraftModel(config)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    target = load_target(target_dir)
    drafter.attach_target(target.model.embed_tokens, target.lm_head)
    save_dspark_export(drafter, path)
    return path


def convert(source, output, to, target, *extra):
    return convert_dflash.main([str(source), str(output), "--to", to, "--target", str(target), *extra])


@pytest.mark.parametrize("heads,tied", [("markov+confidence", False), ("none", False), ("markov+confidence", True)])
def test_a_round_trip_through_speculators_layout_gives_back_the_same_bytes(tmp_path, target_dir, heads, tied):
    """native -> speculators -> native: the same config.json and model.safetensors bytes; the
    speculators checkpoint holds the drafter's own tensors unchanged and no embedding or LM head, and
    its config says what speculators, vLLM and llama.cpp read: gamma drafts from a block of gamma."""
    if tied:  # the head is the embedding: the export and the way back must each write a separate copy
        target_dir = make_target(tmp_path / "tied-target", tied=True)
    rank, confidence = (RANK, True) if heads != "none" else (0, False)
    ours = tiny_export(tmp_path / "ours", target_dir, markov_rank=rank, enable_confidence_head=confidence)
    convert(ours, tmp_path / "speculators", "speculators", target_dir)
    convert(tmp_path / "speculators", tmp_path / "back", "zlab", target_dir)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "back" / name).read_bytes() == (ours / name).read_bytes(), name

    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert (written["speculators_model_type"], written["architectures"], written["speculators_config"]["algorithm"]) == (
        "dspark",
        ["DSparkSpeculator"],
        "dspark",
    )
    assert written["sample_from_anchor"] is True  # written, not left to a default (llama.cpp reads a missing key as false here)
    assert written["block_size"] == GAMMA and written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == GAMMA
    assert (written["aux_hidden_state_layer_ids"], written["mask_token_id"], written["draft_vocab_size"]) == ([1, 3], 5, VOCAB)
    heads_config = {k: written[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")}
    assert heads_config == {
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": True,
    }
    layers = written["transformer_layer_config"]
    assert layers["num_anchors"] == 16 and layers["num_hidden_layers"] == 2
    assert not set(layers) & {"markov_rank", "mask_token_id", "target_layer_ids", "sample_from_anchor", "dflash_config", "block_size"}

    source, spec = load_file(ours / "model.safetensors"), load_file(tmp_path / "speculators" / "model.safetensors")
    assert set(spec) == set(source) - set(TABLES)
    assert all(torch.equal(spec[name], source[name]) for name in spec)
    target = load_target(target_dir)
    assert torch.equal(source["embed_tokens.weight"], target.model.embed_tokens.weight)
    assert torch.equal(source["lm_head.weight"], target.lm_head.weight)


def test_the_speculators_checkpoint_holds_speculators_own_dspark_tensor_names_and_shapes(tmp_path, target_dir):
    """--to speculators writes exactly what speculators' DSpark model loads from a checkpoint (its
    state_dict less what it takes from the verifier), with its shapes: the fixture comes from its classes."""
    layout = json.loads((FIXTURES / "speculators_tensor_layout.json").read_text())["dspark"]
    expected = {name: shape for name, shape in layout["tensors"].items() if name not in layout["taken_from_the_verifier_when_missing"]}
    convert(tiny_export(tmp_path / "ours", target_dir), tmp_path / "speculators", "speculators", target_dir)
    written = load_file(tmp_path / "speculators" / "model.safetensors")
    assert {name: list(tensor.shape) for name, tensor in written.items()} == expected


def test_deepspec_own_checkpoint_converts_both_ways(tmp_path):
    """The DeepSpec fixture (its save_pretrained: top-level mask_token_id / target_layer_ids, no
    dflash_config) converts to speculators' layout and back to our export with every tensor equal,
    given a target whose embedding and LM head are the fixture's."""
    deepspec = FIXTURES / "dspark"
    raw = json.loads((deepspec / "config.json").read_text())
    tensors = load_file(deepspec / "model.safetensors")
    sizes = {k: raw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    target = Qwen3ForCausalLM(Qwen3Config(**sizes, num_hidden_layers=raw["num_target_layers"], architectures=["Qwen3ForCausalLM"]))
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(tensors["embed_tokens.weight"])
        target.lm_head.weight.copy_(tensors["lm_head.weight"])
    target.save_pretrained(tmp_path / "target")
    convert(deepspec, tmp_path / "speculators", "speculators", tmp_path / "target")
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert (written["aux_hidden_state_layer_ids"], written["block_size"], written["markov_rank"]) == ([2, 4, 5], 4, 8)
    convert(tmp_path / "speculators", tmp_path / "back", "zlab", tmp_path / "target")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(tensors) and all(torch.equal(back[name], tensors[name]) for name in tensors)
    config = DSparkConfig.from_pretrained(tmp_path / "back")
    assert (config.block_size, config.mask_token_id, config.target_layer_ids, config.num_anchors) == (4, 63, [1, 3, 4], 3)


def speculators_variant(folder: Path, out: Path, **changes) -> Path:
    """A copy of a speculators checkpoint with config.json keys changed (None: removed)."""
    out.mkdir()
    (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_what_the_other_layout_cannot_express_is_refused_in_one_line(tmp_path, target_dir):
    ours = tiny_export(tmp_path / "ours", target_dir)
    other_target = make_target(tmp_path / "other-target", seed=7)  # same sizes, other weights
    with pytest.raises(ConversionError, match=r"its embed_tokens.weight \[1000, 64\] is not the target's .*pass --target with the target"):
        convert(ours, tmp_path / "out", "speculators", other_target)
    assert not (tmp_path / "out").exists()  # a refusal writes nothing
    no_tables = tmp_path / "no-tables"
    no_tables.mkdir()
    (no_tables / "config.json").write_text((ours / "config.json").read_text())
    weights = load_file(ours / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(no_tables / "model.safetensors"))
    with pytest.raises(ConversionError, match="has no lm_head.weight"):
        convert(no_tables, tmp_path / "out", "speculators", target_dir)

    spec = tmp_path / "spec"
    convert(ours, spec, "speculators", target_dir)
    for changes, message in (
        ({"sample_from_anchor": False}, "sample_from_anchor is false"),
        ({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not served"),
        ({"draft_vocab_size": 500}, "reduced draft vocabulary"),
    ):
        variant = speculators_variant(spec, tmp_path / f"spec-{next(iter(changes))}", **changes)
        with pytest.raises(ConversionError, match=message):
            convert(variant, tmp_path / "out", "zlab", target_dir)
    with pytest.raises(ConversionError, match="already our export"):
        convert(ours, tmp_path / "out", "zlab", target_dir)
    # speculators' DSpark default is sample_from_anchor true: a config without the key converts as such.
    convert(speculators_variant(spec, tmp_path / "spec-default", sample_from_anchor=None), tmp_path / "default", "zlab", target_dir)
    assert (tmp_path / "default" / "config.json").read_bytes() == (ours / "config.json").read_bytes()


# ---- with speculators installed: its `dspark` classes on what we write ----------------------------------


@pytest.mark.skipif(not HAS_SPECULATORS, reason="speculators is not installed (a benchmark tool, not a requirement)")
def test_speculators_computes_our_logits_and_confidence_from_what_we_write(tmp_path, target_dir):
    """speculators' DSparkDraftModel loads the converted folder (its verifier's embedding and head from
    the target) and, at the same anchors, gives our teacher-forced logits with the Markov term
    (predecessors token[a + k]) and our confidence logits on [h; W1[prev]]."""
    from speculators.models.dspark import DSparkDraftModel as SpeculatorsDSpark
    from speculators.models.dspark import DSparkSpeculatorConfig

    ours = tiny_export(tmp_path / "ours", target_dir)
    convert(ours, tmp_path / "speculators", "speculators", target_dir)
    config = DSparkSpeculatorConfig.from_pretrained(tmp_path / "speculators")
    config.transformer_layer_config._attn_implementation = "sdpa"  # its flex path needs compile; sdpa is the same mask
    theirs = SpeculatorsDSpark.from_pretrained(tmp_path / "speculators", config=config).eval()

    target = load_target(target_dir)
    drafter = DSparkDraftModel(DSparkConfig.from_pretrained(ours)).eval()
    weights = load_file(ours / "model.safetensors")
    drafter.load_state_dict({k: v for k, v in weights.items() if k not in TABLES}, strict=True)
    drafter.attach_target(target.model.embed_tokens, target.lm_head)

    seq_len = 40
    input_ids = torch.randint(0, VOCAB, (1, seq_len))
    features = torch.randn(1, seq_len, 2 * HIDDEN)
    anchors = torch.tensor([[3, 7, 20]])
    loss_mask = torch.zeros(1, seq_len)
    loss_mask[0, anchors[0]] = 1  # its anchors are drawn from the loss mask: one valid position per anchor makes them these
    with torch.no_grad():
        hidden, logits, _, _, indices = theirs._backbone_forward(
            features, input_ids, loss_mask, torch.zeros(1, seq_len, HIDDEN), torch.zeros(1, seq_len, dtype=torch.long), max_anchors=3
        )
        assert torch.equal(indices.view(-1, GAMMA)[:, 0], anchors[0])
        prev = input_ids[0, indices].view(3, GAMMA)  # its teacher forcing with sample_from_anchor: token[a + k]
        their_logits = logits.view(3, GAMMA, VOCAB) + theirs.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden.view(3, GAMMA, -1))
        their_confidence = theirs.confidence_head(torch.cat([hidden.view(3, GAMMA, -1), theirs.markov_head.prev_embeddings(prev)], dim=-1))

        keep = torch.ones_like(anchors, dtype=torch.bool)
        mine_hidden = drafter(features, input_ids, anchors, keep, attention_backend="sdpa")[0]  # [3, gamma, hidden]
        mine_prev = markov_predecessor_ids(input_ids, anchors, GAMMA)[0]
        assert torch.equal(mine_prev, prev)
        mine_logits = drafter.block_logits(mine_hidden, mine_prev)
        mine_confidence = drafter.confidence_logits(mine_hidden, mine_prev)
    assert (their_logits - mine_logits).abs().max().item() < 1e-5
    assert (their_confidence - mine_confidence).abs().max().item() < 1e-5
