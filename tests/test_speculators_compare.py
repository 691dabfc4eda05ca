"""tools/speculators_compare.py writes the hidden-state files speculators' DFlash trainer reads: the layout
checked here without speculators installed (CI never installs it)."""

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from tools.speculators_compare import capture_layer_ids, features_main, write_hidden_states


def test_capture_layer_ids_puts_the_last_layer_last():
    assert capture_layer_ids([1, 8], 30) == ([1, 8, 29], [0, 1, 2])
    # the last layer already among the features: captured once, in two slots
    assert capture_layer_ids([29, 1], 30) == ([29, 1], [0, 1, 0])


def _conversations(path, n=5):
    with open(path, "w") as f:
        for i in range(n):
            reply = " ".join(["step"] * (3 + 4 * i)) + f" so the answer is {i}."
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                             {"role": "assistant", "content": reply}]}) + "\n")


def test_hidden_state_files_match_the_target(tiny_qwen3_target, tmp_path):
    """Slots 0..n-1 are HF hidden_states[id + 1]; slot n is the last decoder layer's output before the
    final norm (speculators applies the target's norm and head to it); token_ids are the row's tokens."""
    from dflash_target import TargetFeatureExtractor, load_target

    target, _ = load_target(str(tiny_qwen3_target), device="cpu")
    layer_ids = [0, 2]
    num_layers = target.config.num_hidden_layers
    samples = [{"input_ids": torch.randint(0, 1000, (n,)).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (7, 12, 5)]
    with torch.no_grad():  # the reference, before the extractor truncates the target
        references = []
        for sample in samples:
            ids = torch.tensor([sample["input_ids"]])
            pre_norm = {}
            hook = target.model.layers[-1].register_forward_hook(lambda m, a, out: pre_norm.update(h=out[0] if isinstance(out, tuple) else out))
            hidden = target(ids, output_hidden_states=True).hidden_states
            hook.remove()
            references.append((hidden, pre_norm["h"][0]))
    capture, slots = capture_layer_ids(layer_ids, num_layers)
    extractor = TargetFeatureExtractor(target, capture, truncate=True)
    write_hidden_states(extractor, slots, samples, tmp_path, pad_token_id=0, batch_size=2, first_file=10)
    for index, (sample, (hidden, pre_norm)) in enumerate(zip(samples, references)):
        data = load_file(tmp_path / f"hs_{10 + index}.safetensors")
        n = len(sample["input_ids"])
        assert set(data) == {"token_ids", "hidden_states"}
        assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == sample["input_ids"]
        states = data["hidden_states"]  # [T, n + 1, hidden]
        assert states.shape == (n, len(layer_ids) + 1, target.config.hidden_size) and states.dtype == torch.bfloat16
        # batched with right padding against one sample alone: equal up to bf16 rounding of the matmuls
        for slot, layer in enumerate(layer_ids):
            torch.testing.assert_close(states[:, slot].float(), hidden[layer + 1][0], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(states[:, -1].float(), pre_norm, rtol=1e-2, atol=1e-2)
        # and not the final-norm output transformers puts last in hidden_states
        assert not torch.allclose(states[:, -1].float(), hidden[-1][0], rtol=1e-2, atol=1e-2)


def test_features_folder_layout(tiny_qwen3_target, tmp_path):
    """The datasets folder speculators loads: input_ids / loss_mask / seq_len rows equal to the files'
    token ids, validation copies after the replies, and a train_data_ratio that keeps the replies."""
    datasets = pytest.importorskip("datasets")
    data = tmp_path / "replies.jsonl"
    _conversations(data)
    out = tmp_path / "features"
    args = argparse.Namespace(target_model=str(tiny_qwen3_target), train_data=[str(data)], target_layer_ids=[1, 2], output=str(out),
                              max_seq_length=64, max_samples=None, batch_size=2, seed=0, val_rows=2, chat_template_kwargs=None,
                              target_dtype=None)
    features_main(args)
    meta = json.loads((out / "meta.json").read_text())
    table = datasets.load_from_disk(str(out))
    assert meta["rows"] == 5 and meta["val_rows"] == 2 and len(table) == 7
    assert int(len(table) * meta["train_data_ratio"]) == meta["rows"]  # speculators' split index
    assert meta["speculators_target_layer_ids"] == [2, 3]
    assert set(table.column_names) == {"input_ids", "loss_mask", "seq_len"}
    for index in range(len(table)):
        row = table[index]
        tokens = load_file(out / "hidden_states" / f"hs_{index}.safetensors")
        assert torch.equal(tokens["token_ids"], row["input_ids"])  # what speculators checks before using a row
        assert tokens["hidden_states"].shape == (int(row["seq_len"]), 3, 64)
        assert row["loss_mask"].sum() > 0 and row["loss_mask"][0] == 0  # the prompt is not trained on
    assert torch.equal(table[5]["input_ids"], table[0]["input_ids"])  # validation rows: copies of the first


def test_table_reads_both_trainers_outputs(tmp_path):
    """table: speculators' summary.json and our train_log.jsonl, the eval JSONs, the step times."""
    from tools.speculators_compare import main

    (tmp_path / "spec_default").mkdir()
    (tmp_path / "spec_default" / "summary.json").write_text(json.dumps({"steps": 3, "samples_per_s": 12.5, "peak_memory_gb": 7.25}))
    (tmp_path / "ours_recipe").mkdir()
    (tmp_path / "ours_recipe" / "train_log.jsonl").write_text(
        "".join(json.dumps({"step": s, "samples_per_s": r, "peak_memory_gb": 3.0}) + "\n" for s, r in ((1, 5.0), (2, 20.0), (3, 30.0))))
    (tmp_path / "timings.tsv").write_text("features\t60.000\t0\ntrain_spec_default\t120.000\t0\ntrain_ours_recipe\t90.000\t0\n")
    for row, tau in (("spec_default", 2.5), ("ours_recipe", 3.25)):
        (tmp_path / f"eval_{row}_t0.json").write_text(json.dumps({"acceptance_length": tau, "num_prompts": 4, "speedup": 1.5}))
    main(["table", str(tmp_path), "--rows", "spec_default", "ours_recipe", "--temperatures", "0", "0.8"])
    results = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert results[0]["tau_t0"] == 2.5 and results[0]["tau_t0.8"] is None and results[0]["minutes"] == 3.0
    assert results[1]["samples_per_s"] == 25.0 and results[1]["steps"] == 3 and results[1]["minutes"] == 1.5
