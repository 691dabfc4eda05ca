"""bench_dflash.py's --shapes and --profile, and the tied head of dflash_bench_training.drafter_context.

The benchmark's tiny CPU runs of (a)-(c) are in test_scripts.py, of --long in test_long_samples.py and of
--drafter dspark in test_dspark_eval.py.
"""

import argparse
import gzip
import json
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config

import bench_dflash
from dflash_bench_training import PhaseClock, drafter_context, drafter_step, make_batch, parse_variant
from dflash_flops import drafter_step_flops
from dflash_target import drafter_config_for_target

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the markdown table after `heading` in `text` (header and separator left out)."""
    assert heading in text, f"no {heading!r} in:\n{text}"
    lines = text.split(heading, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_profile_writes_a_trace_and_the_ops_and_phase_tables(tmp_path, capsys):
    """--profile: the first variant at the first headline shape, once, under torch.profiler: a gzipped chrome
    trace with the phases as ranges, ops.md with the time per phase and the top ops (a matmul among them),
    and the same tables in the report under a heading that names the variant and shape."""
    out = tmp_path / "prof"
    argv = ["--device", "cpu", "--tiny", "--quick", "--drafter_only", "--variant", "baseline", "--variant", "fused_ce"]
    threads = torch.get_num_threads()  # bench_dflash.main sets 1 on a CPU
    bench_dflash.main(argv + ["--steps", "1", "--warmup", "0", "--no_append", "--profile", str(out)])
    torch.set_num_threads(threads)
    report = capsys.readouterr().out

    ops_md = (out / "ops.md").read_text()
    assert ops_md.startswith("# Profile: baseline at 8 anchors, seq 64, batch 2 (2 drafter layers, hidden 64, vocab 256, sdpa attention)")
    phases = table_rows(ops_md, "## Time per phase")
    assert [row[0] for row in phases] == ["forward", "loss", "backward", "optimizer"]
    assert all(float(row[1]) > 0 for row in phases)  # ms/step
    assert 80 < sum(float(row[2].rstrip("%")) for row in phases) <= 100.5  # the phases cover the step
    ops = table_rows(ops_md, "## Top 30 ops by self CPU time")
    assert 10 <= len(ops) <= 30
    names = [row[0].strip("`") for row in ops]
    assert MATMULS & set(names), names
    assert not {"forward", "loss", "backward", "optimizer"} & set(names)  # the phase ranges are not ops
    self_ms = [float(row[2]) for row in ops]
    assert self_ms == sorted(self_ms, reverse=True) and self_ms[0] > 0
    assert "Input Shapes" in ops_md  # torch.profiler's own table by input shapes

    with gzip.open(out / "trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert {"forward", "loss", "backward", "optimizer"} <= {e.get("name") for e in events}

    assert re.search(r"^## [\d-]+ [\d:]+ bench_dflash.py: DFlash training speed, tiny config$", report, re.M), (
        report
    )  # the drafter and shapes in the heading
    assert report.count("### Profile:") == 1, report  # one variant, one shape
    assert "(b) target supply" not in report and "(c) colocated" not in report  # --drafter_only: no empty tables
    section = report.split("### Profile: baseline at 8 anchors, seq 64, batch 2 (tiny config)", 1)[1]
    assert [row[0] for row in table_rows(section, "Time per phase:")] == ["forward", "loss", "backward", "optimizer"]
    assert [row[0] for row in table_rows(section, "Top 30 ops:")] == [row[0] for row in ops]
    assert re.search(r"\| fused_ce \| 16 \| 128 \| 1 \| \d", report)  # the other rows are timed as without --profile


def test_profile_is_refused_with_long():
    with pytest.raises(ValueError, match="--profile profiles a step of \\(a\\), which --long does not run"):
        bench_dflash.parse_args(["--long", "--device", "cpu", "--tiny", "--profile", "prof"])


def test_smollm2_shapes_are_the_recipes():
    """--shapes smollm2: SmolLM2-135M-Instruct as a Qwen3Config and configs/smollm2-gsm8k-gpu.yaml's drafter;
    --tiny wins over it; the default stays Qwen3-8B."""
    s = bench_dflash.shapes(argparse.Namespace(tiny=False, shapes="smollm2", quick=False))
    target = s["target"]
    assert (target.vocab_size, target.tie_word_embeddings, target.hidden_size, target.num_hidden_layers) == (49152, True, 576, 30)
    assert (target.num_attention_heads, target.num_key_value_heads, target.head_dim, target.intermediate_size) == (9, 3, 64, 1536)
    assert (target.rope_parameters["rope_theta"], target.rms_norm_eps, target.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (s["draft_layers"], s["target_layer_ids"], s["mask_token_id"]) == (8, [1, 8, 14, 20, 27], 16)
    assert s["headline"] == s["grid"] == [(128, 512, 64), (128, 512, 16)]
    assert s["target_shapes"] == [(64, 512), (16, 512)] and s["name"] == "SmolLM2-135M shapes"
    config = drafter_config_for_target(
        target, mask_token_id=s["mask_token_id"], num_draft_layers=s["draft_layers"], target_layer_ids=s["target_layer_ids"]
    )
    assert (config.num_hidden_layers, config.target_layer_ids, config.mask_token_id, config.vocab_size) == (8, [1, 8, 14, 20, 27], 16, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size) == (9, 3, 64, 1536)

    tiny = bench_dflash.shapes(argparse.Namespace(tiny=True, shapes="smollm2", quick=False))
    assert (tiny["name"], tiny["target"].vocab_size, tiny["headline"][0]) == ("tiny config", 256, (8, 64, 2))
    qwen3 = bench_dflash.shapes(argparse.Namespace(tiny=False, shapes="qwen3-8b", quick=True))
    assert (qwen3["target"].vocab_size, qwen3["target"].tie_word_embeddings, qwen3["draft_layers"]) == (151936, False, 5)
    assert qwen3["headline"] == [(256, 768, 2), (512, 3072, 1)] and qwen3["target_layer_ids"] is None


def test_tied_head_step_counts_the_same_useful_flops():
    """A tied target (SmolLM2's kind): the head is the frozen embedding table itself, the trainable params are
    the drafter's alone, and a whole step (forward, loss, backward, optimizer) runs the matmuls that
    drafter_step_flops counts (dense attention: math SDPA counts every pair). The batch's tokens cover the
    vocabulary but never the mask token, here a low id as SmolLM2's."""
    target = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=96,
        tie_word_embeddings=True,
    )
    config = drafter_config_for_target(target, mask_token_id=3, num_draft_layers=2, block_size=4, target_layer_ids=[1, 2])
    device = torch.device("cpu")
    contexts = {tied: drafter_context(config, device, torch.float32, lambda line: None, "sdpa", 1, 0, tied_head=tied) for tied in (False, True)}
    ctx = contexts[True]
    assert ctx["head_weight"] is ctx["drafter"].target_embed_tokens.weight and not ctx["head_weight"].requires_grad
    assert contexts[False]["head_weight"] is not contexts[False]["drafter"].target_embed_tokens.weight
    assert ctx["trainable"] == contexts[False]["trainable"]

    batch_tensors = make_batch(2, 40, config, device, torch.float32)
    input_ids = batch_tensors[0]
    assert (input_ids != 3).all() and input_ids.max() > 3
    generator = torch.Generator().manual_seed(0)
    args = (ctx["drafter"], ctx["optimizer"], ctx["head_weight"], ctx["weights"], parse_variant("baseline"), batch_tensors, 6, "sdpa", generator)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
        anchors, anchor_valid, label_valid = drafter_step(*args, PhaseClock(device))
    parts = drafter_step_flops(config, 40, anchors, anchor_valid, label_valid, dense_attention=True)
    assert mode.get_total_flops() == pytest.approx(sum(f + b for f, b in parts.values()), rel=0.02)
    assert ctx["head_weight"].grad is None  # frozen: the head's backward is its input gradient only
