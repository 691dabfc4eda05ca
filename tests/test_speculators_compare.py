"""tools/speculators_compare.py writes the hidden-state files speculators' DFlash trainer reads, and keeps
the books of a speculators run resumed over capped calls: checked here without speculators installed (CI
never installs it). The last test needs speculators and Triton (skipped without them)."""

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import tools.speculators_compare as compare
from tools.speculators_compare import (
    CallTimeSpent,
    capture_layer_ids,
    features_main,
    keep_records_before,
    resumed_step,
    stop_before_deadline,
    warm_median,
    write_hidden_states,
)


def test_capture_layer_ids_puts_the_last_layer_last():
    assert capture_layer_ids([1, 8], 30) == ([1, 8, 29], [0, 1, 2])
    # the last layer already among the features: captured once, in two slots
    assert capture_layer_ids([29, 1], 30) == ([29, 1], [0, 1, 0])


def _conversations(path, n=5):
    with open(path, "w") as f:
        for i in range(n):
            reply = " ".join(["step"] * (3 + 4 * i)) + f" so the answer is {i}."
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": reply}]}) + "\n")


def test_hidden_state_files_match_the_target(tiny_qwen3_target, tmp_path):
    """Slots 0..n-1 are HF hidden_states[id + 1]; slot n is the last decoder layer's output before the
    final norm (speculators applies the target's norm and head to it); token_ids are the row's tokens."""
    from dflash_features import TargetFeatureExtractor
    from dflash_target import load_target

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
    args = argparse.Namespace(
        target_model=str(tiny_qwen3_target),
        train_data=[str(data)],
        target_layer_ids=[1, 2],
        output=str(out),
        max_seq_length=64,
        max_samples=None,
        batch_size=2,
        seed=0,
        val_rows=2,
        chat_template_kwargs=None,
        target_dtype=None,
    )
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
        "".join(json.dumps({"step": s, "samples_per_s": r, "peak_memory_gb": 3.0}) + "\n" for s, r in ((1, 5.0), (2, 20.0), (3, 30.0)))
    )
    (tmp_path / "spec_default" / "progress.json").write_text(json.dumps({"steps": 3, "steps_done": 3, "attempts": 2, "state": "done"}))
    (tmp_path / "spec_paper").mkdir()  # cut short: trained 75 of 654 steps, not evaluated
    (tmp_path / "spec_paper" / "progress.json").write_text(json.dumps({"steps": 654, "steps_done": 75, "attempts": 1, "state": "stopped"}))
    (tmp_path / "timings.tsv").write_text(
        "features\t60.000\t0\ntrain_spec_default\t100.000\t3\ntrain_spec_default\t20.000\t0\ntrain_ours_recipe\t90.000\t0\n"
    )
    for row, tau in (("spec_default", 2.5), ("ours_recipe", 3.25)):
        (tmp_path / f"eval_{row}_t0.json").write_text(json.dumps({"acceptance_length": tau, "num_prompts": 4, "speedup": 1.5}))
    main(["table", str(tmp_path), "--rows", "spec_default", "spec_paper", "ours_recipe", "--temperatures", "0", "0.8"])
    results = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["row"] for r in results] == ["spec_default", "ours_recipe"]  # the table: rows with results
    assert results[0]["tau_t0"] == 2.5 and results[0]["tau_t0.8"] is None and results[0]["minutes"] == 3.0  # both calls' training
    assert results[1]["samples_per_s"] == 25.0 and results[1]["steps"] == 3 and results[1]["minutes"] == 1.5
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["spec_default"]["trained"] and state["spec_default"]["evaluated"] == ["0"] and not state["spec_default"]["done"]
    assert state["spec_paper"] == {
        "trained": False,
        "steps_done": 75,
        "steps": 654,
        "attempts": 1,
        "last_attempt": "stopped",
        "evaluated": [],
        "done": False,
    }
    assert state["ours_recipe"]["trained"] is False  # a train_log without final/model.safetensors: cut short


def test_resume_bookkeeping(tmp_path):
    """speculators resumes from its highest numbered checkpoint folder; the steps a cut-short run logged
    after it are dropped (logged again when resumed); rates leave out each attempt's compile steps."""
    checkpoints = tmp_path / "checkpoints"
    assert resumed_step(checkpoints) == 0
    for epoch, step in ((0, 109), (1, 134)):
        (checkpoints / str(epoch)).mkdir(parents=True)
        (checkpoints / str(epoch) / "training_state.json").write_text(json.dumps({"epoch": epoch, "local_step": 25, "global_step": step}))
    (checkpoints / "epoch1_step25").symlink_to("1")
    (checkpoints / "interrupted").mkdir()  # speculators never resumes from it by itself
    assert resumed_step(checkpoints) == 134
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"global_step": s, "attempt": 1, "profile": {"tokens_per_s": 10.0 * s}}) + "\n" for s in range(140)))
    kept = keep_records_before(log, 134)
    assert [r["global_step"] for r in kept] == list(range(134)) and len(log.read_text().splitlines()) == 134
    # attempt 1: rates 0, 10, ..., 90 (its first fifth, 0 and 10, left out); attempt 2: 1, 2, 3, 4, 1000 (first fifth: 1)
    rows = [{"global_step": s, "attempt": 1, "profile": {"tokens_per_s": float(s)}} for s in range(0, 100, 10)]
    rows += [{"global_step": 100 + i, "attempt": 2, "profile": {"tokens_per_s": r}} for i, r in enumerate((1.0, 2.0, 3.0, 4.0, 1000.0))]
    assert warm_median(rows) == 45.0  # median of 2, 3, 4, 20, ..., 90, 1000
    assert warm_median([]) is None


def test_stop_before_deadline(monkeypatch):
    """After each checkpoint: stop when the last interval, repeated, would end past the deadline; never
    after the last step, nor after speculators' own interrupt checkpoint."""
    clock = [1000.0]
    monkeypatch.setattr(compare.time, "time", lambda: clock[0])

    class Trainer:  # the two things of speculators' Trainer the wrapper reads
        def __init__(self):
            self.global_step, self.saved, self.config = 0, [], SimpleNamespace(max_steps=654)

        def maybe_save_checkpoint(self, epoch, local_step=0):
            self.saved.append((epoch, local_step))

    stop_before_deadline(Trainer, deadline=1100.0)
    trainer = Trainer()
    for now, step in ((1030.0, 25), (1060.0, 50), (1075.0, 75)):  # intervals 30, 30, 15: each next one ends by 1100
        clock[0], trainer.global_step = now, step
        trainer.maybe_save_checkpoint(0, local_step=step)
    clock[0], trainer.global_step = 1095.0, 654
    trainer.maybe_save_checkpoint(5)  # the last step's checkpoint: training is complete, nothing to stop
    clock[0], trainer.global_step = 1096.0, 100
    trainer.maybe_save_checkpoint("interrupted")  # speculators' interrupt checkpoint, not one it resumes from
    clock[0] = 1099.0
    with pytest.raises(CallTimeSpent, match="after step 100"):
        trainer.maybe_save_checkpoint(0, local_step=100)  # the next interval (3 s) would end at 1102
    assert trainer.saved[-1] == (0, 100)  # saved first, then stopped


def test_fused_loss_traces_with_the_prune_hook_detached(monkeypatch):
    """speculators' fused CE loss, forward and backward, in one Dynamo graph (as speculators compiles its
    drafter's forward with the loss). On torch 2.11 it fails without the fix, with the assertion the
    GPU run met; with the prune hook detached it traces. The kernels never run (a CPU has no Triton
    driver): Dynamo treats them as on a GPU and a recording backend takes the graph."""
    pytest.importorskip("triton")
    fused = pytest.importorskip("speculators.losses.fused")
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    for kernel in (fused.loss_forward_kernel, fused.loss_backward_kernel):
        monkeypatch.setattr(kernel, "early_config_prune", kernel.early_config_prune)  # restored after the test
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def trace():
        torch._dynamo.reset()
        compiled = torch.compile(lambda logits, targets: fused.fused_ce_loss(logits, targets).sum(), backend=record, fullgraph=True)
        try:
            compiled(torch.randn(1, 8, 64, requires_grad=True), torch.randn(1, 8, 64))
        except RuntimeError as error:  # running the traced graph launches the kernel: no driver here
            assert "active drivers" in str(error)

    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12):
        with pytest.raises(Exception, match="ListVariable\\(length=21\\) is already tracked for mutation"):
            trace()
    assert compare.detach_fused_loss_prune_hook()
    trace()
    assert len(graphs) == 1
