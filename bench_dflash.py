"""Benchmark DFlash training at Qwen3-8B (or SmolLM2-135M) shapes on one GPU, with random weights.

    python bench_dflash.py --quick                     # headline shapes, main variants (< 6 min on an H200, cold compile)
    python bench_dflash.py                             # + the whole (anchors x seq x batch) grid for baseline (< 10 min)
    python bench_dflash.py --variant baseline --variant compile_layers+fused_ce_compiled
    python bench_dflash.py --device cpu --tiny         # CPU smoke test: tiny config, SDPA, 2 timed steps (< 60 s)
    python bench_dflash.py --quick --compile_target    # (b) also with the target's layers compiled
    python bench_dflash.py --quick --drafter_only --layer_types last_full --sliding_window 2048   # (a) only
    python bench_dflash.py --quick --drafter_only --objectives --budget_s 540   # every loss objective vs CE (< 10 min)
    python bench_dflash.py --quick --drafter_only --drafter dflash2              # a DFlash2 drafter's step (its selector's loss included)
    python bench_dflash.py --quick --drafter_only --drafter dspark               # a DSpark drafter's step (gamma 15, chunked_dspark_loss)
    python bench_dflash.py --quick --drafter_only --drafter dspark --variant compile_layers --variant compile_layers+fused_ce_compiled
    python bench_dflash.py --quick --drafter_only --shapes smollm2              # at SmolLM2-135M's shapes (the GSM8K recipe's drafter)
    python bench_dflash.py --quick --drafter_only --profile prof/               # + prof/ops.md and prof/trace.json.gz of the first variant
    python bench_dflash.py --long --rows long_rows.jsonl   # long samples: 3,072 .. 64k tokens, 5 full and 4 sliding + 1 full (tools/gpu/long_samples.sh)
    python bench_dflash.py --long --device cpu --tiny --no_append   # its CPU smoke test (< 60 s)

On a machine whose working tree does not come back (the device tool), append to a copy:
    cp BENCHMARKS.md $OUT/ && python bench_dflash.py --quick --record-to $OUT/BENCHMARKS.md 2>&1 | tee $OUT/bench.log

Shapes (--shapes): qwen3-8b (the default): target Qwen3-8B (hidden 4096, 36 layers, 32 heads / 8 KV heads,
head_dim 128, intermediate 12288, vocab 151,936, untied head); drafter 5 layers reading target layers
[1, 9, 17, 25, 33], block B = 16, mask token 151669. smollm2: target SmolLM2-135M-Instruct (hidden 576,
30 layers, 9 heads / 3 KV heads, head_dim 64, intermediate 1536, vocab 49,152, head tied to the embedding,
RoPE theta 100,000), as a Qwen3Config; the drafter of configs/smollm2-gsm8k-gpu.yaml: 8 layers reading target
layers [1, 8, 14, 20, 27], block B = 16, mask token 16, at 128 anchors, seq 512 (its pad_to_multiple_of) and
batch 64 (its per_device_batch_size), and at batch 16. There the LM head is 49,152 x 576, 85 vocabulary rows per
hidden unit: 35% of the step's useful FLOPs against the 8 layers' MLPs' 43% (Qwen3-8B: 28% and 55%), and its loss
reads 49,152 logits per label row for a hidden state of 576. Every sequence is full length (no padding); its first
seq/8 tokens are prompt (loss mask off), the rest response. Weights, tokens (any id but the mask token) and context
features are random: speed does not depend on them.

What it measures, in one run:
  (a) drafter train step, exactly as train_dflash.py does it (sample_anchors -> drafter forward
      with flex -> block_labels -> weighted_block_loss on hidden[:, :, 1:] -> backward -> optimizer),
      with plain torch AdamW (fused) on fp32 master copies of the bf16 weights plus grad clipping
      (DeepSpeed's bf16 mode without sharding): ms/step, ms/sample, samples/s, useful FLOPs per
      sample, useful TFLOP/s, MFU against a bf16 matmul rate measured in the same run
      (8192^3 matmuls, median) and against the 989 TFLOP/s H200 datasheet peak, peak memory, and
      per-phase medians (forward incl. mask build, loss, backward, optimizer), plus the eager
      BlockMask build and compiled flex forward+backward timed alone. Every variant runs at the
      headline shapes (256 anchors, seq 768, batch 2) and (512, 3072, 1); without --quick the first
      variant also runs the whole grid num_anchors {256, 512} x seq {768, 3072} x batch {1, 2, 4}
      (SmolLM2: (128, 512, 64) and (128, 512, 16), its whole grid).
      An OOM is reported as such. Medians of timed steps after warm_up_flex_attention and 3 warm-up steps.
      With --profile DIR, the first variant at the first headline shape then runs 1 + 3 more steps
      under torch.profiler, each phase a record_function range: DIR/trace.json.gz (chrome trace),
      DIR/ops.md (ms per step of each phase, the top 30 ops by self device time with calls and share
      of the step, torch.profiler's table by input shapes); the report gets the phase and ops tables.
  (b) target supply: tokens/s of the truncated (34-layer; SmolLM2: 28-layer) target forward with hook capture
      (TargetFeatureExtractor), at batch 16 x 1024 (Qwen3-8B) and at the training shapes; with
      --compile_target also with the target's decoder layers compiled (as train_dflash.py's
      --compile_target). Prediction: +10-15% tokens/s (the eager forward runs at ~452 of ~740
      TFLOP/s; its fp32 RMSNorms, RoPE, SwiGLU and residual adds are separate memory-bound passes).
  (c) colocated on 1 GPU: target forward + drafter step per sample, against
      1 / (drafter time + target time) with each measured alone in (a) and (b).
Prints markdown tables and appends them, with date, GPU, versions and the command, to BENCHMARKS.md.
The step, its levers and their timing are in dflash_bench_training.py; this script runs the grids and
writes the report.

Useful FLOPs (analytic, `dflash_flops.drafter_step_flops`, whose module docstring lists what is counted,
part by part): matmul work that the math needs, nothing recomputed. The checkpointed loss of weighted_block_loss
recomputes the head forward in backward (one extra head fwd, ~14% of the useful work at 256 anchors): that is
executed but not useful, so it is not counted; fused_ce below removes it.

Variants (--variant, repeatable; join levers with '+'), each with its prediction at
256 anchors / seq 768 / batch 2 (baseline was 105 ms/sample in the public SpecForge anchor):
  baseline            eager layers, compiled flex, dflash_loss.weighted_block_loss with the eager chunk function (since
                      2026-11-30 the fused form, gradient in the forward; the tables of 2026-11-30 12:10 measured the
                      earlier checkpointed fp32-logit CE in 4096-row chunks as baseline). train_dflash.py now
                      trains as compile_layers+fused_ce_compiled (--compile_drafter auto, on with flex).
                      Prediction: ~105 ms/sample (~50 block GEMMs, ~15 eager elementwise, ~32 head + CE, ~7 the
                      unsharded optimizer, ~8 flex + mask), ~325 useful TFLOP/s (the first colocated run in BENCHMARKS.md:
                      ~140 ms/sample colocated, ~22 of them target forward; tools/gpu/bench_compile_race.py checkpoint:
                      67.4 ms for the checkpointed loss fwd+bwd over 8192 rows, 49.7 ms without checkpointing).
  loss_chunk_2048     same, 2048-row chunks. Prediction: time within +-3%, peak memory about -3 GB.
  loss_chunk_8192     same, 8192-row chunks. Prediction: time within +-3%, peak memory about +6 GB.
  fused_ce            LM head + CE with the row gradient computed in the forward, chunk by chunk (Liger's
                      scheme in plain torch): bf16 logits, fp32 only inside a chunk, no head recompute.
                      Prediction: -9% ms/sample (like the 49.7 ms uncheckpointed loss: one head matmul of three gone), lower peak memory.
  fused_ce_compiled   fused_ce with the softmax / gradient / argmax elementwise part in one torch.compile'd function.
                      Prediction: -15% vs baseline (loss ~33 ms per 8192 rows, near its two head matmuls' ~29 ms).
  compile_layers      torch.compile of each drafter decoder layer (flex is traced into the layer graph).
                      Prediction: -8% (RMSNorm, q/k norms, RoPE, SwiGLU and residual adds fused).
  compile_layers+fused_ce_compiled   both. Prediction: -23%, about 81 ms/sample, ~420 useful TFLOP/s
                      (~75 ms/sample with the optimizer sharded 7 ways, the public anchor's setting).
liger-kernel's fused linear CE is not installed on the GPU machine and cannot take per-row weights
directly, so fused_ce implements the same scheme in plain torch instead.

Loss objectives (dflash_loss.py; levers that join the ones above, e.g. compile_layers+fused_ce_compiled+loss_kl;
--objectives runs the first variant with each of them, so one run compares them with CE at both headline shapes).
The distribution losses read the target's last hidden state at the position before each label (random here,
[batch, S, hidden]) and put it through the same head in each chunk. Predictions against the CE variant at
256 / 768 / 2, 7,680 label rows a step (the compiled CE loss takes ~30 ms of a ~140 ms step there):
  dpace               D-PACE position weights with CE (per-row kernel, weights applied after all rows).
                      Prediction: within +-2% time and memory (T floats and one [T, hidden] scale extra).
  loss_kl             forward KL(p || q). Prediction: +12-18% ms/sample (one more head matmul, 9.6 TFLOP = ~14 ms per
                      step at ~700 TFLOP/s, plus ~5 ms of elementwise passes over [T, vocab]); +3-5 GB peak (the
                      target's bf16 logits and fp32 p of one 4096-row chunk, 1.2 + 2.5 GB).
  loss_tv, loss_nla   1 - sum min(p, q), -log sum min(p, q). Prediction: as loss_kl, within +-3% of it.
  loss_lk             the LK hybrid of KL and TV. Prediction: +1-3% over loss_kl (both terms' elementwise work).
  loss_ce             CE, explicitly (the default).
  fused_loss_liger, fused_loss_cce   the head + CE through Liger Kernel or Cut Cross-Entropy (train_dflash.py's
                      --fused_loss; CE only; off CUDA the reference runs), to time beside the same variant without it.
At 512 / 3072 / 1 the same 7,680 rows come per sample instead of per 2 samples: about twice the added ms/sample.

Memory levers for long samples (levers too, e.g. compile_layers+fused_ce_compiled+context_chunk_8192+checkpoint_layers):
  context_chunk_N     the context path (fc, hidden_norm, every layer's K/V) in chunks of N positions under activation
                      checkpointing (train_dflash.py's --context_chunk_size N).
  checkpoint_layers   activation checkpointing of the drafter's decoder layers (--checkpoint_drafter_layers).

--long: the long-sample grid, one row per sample (batch 1) at --long_anchors anchors (default 512, the paper's; a
fixed count per sample, as train_dflash.py's --num_anchors) and --long_lengths tokens per sample (default
3072,4096,8192,16384,32768,65536), for each layout of --long_layouts (default all_full, and last_full: 4 sliding
layers of --sliding_window (default 2048) + 1 full) and each --variant (default compile_layers+fused_ce_compiled, as
train_dflash.py trains), after the target's forward at batch 1 at every length. Columns: drafter ms/sample and its
ratio to the 3,072-token row of the same run, peak GB, useful TFLOP/s, the target's forward per sample (ms, TFLOP/s,
peak GB with the target alone on the device) and the two together. With --rows FILE every finished row is appended
to FILE as it ends and rows already in FILE are not run again, so a run cut short by a time limit resumes where it
stopped; the tables cover every row in FILE. Predictions (by formula, before any GPU run): tools/gpu/long_samples.sh.
"""

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config

from dflash_bench_training import bench_drafter_config, bench_target, build_target, drafter_context, free_memory, matmul_rate, parse_variant
from dflash_compile import setup_compile_cache
from dflash_features import TargetFeatureExtractor
from dflash_flops import drafter_step_flops
from dflash_model import DFlashConfig
from dflash_target import drafter_config_for_target

REPO_DIR = Path(__file__).resolve().parent
H200_BF16_PEAK_TFLOPS = 989.0  # dense bf16 datasheet figure (H100/H200 SXM)
QWEN3_MASK_TOKEN_ID = 151669  # Qwen3's first spare embedding row (<|MASK|>)
SMOLLM2_MASK_TOKEN_ID = 16  # <empty_output>: SmolLM2 has no spare row (configs/smollm2-gsm8k-gpu.yaml)
OBJECTIVE_LEVERS = ("dpace", "loss_kl", "loss_tv", "loss_nla", "loss_lk")  # what --objectives adds to the first variant

# ----------------------------------------------------------------------------------------------
# Settings


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="headline shapes only: (256 anchors, seq 768, batch 2) and (512, 3072, 1); SmolLM2's headline is its grid",
    )
    p.add_argument(
        "--shapes",
        default="qwen3-8b",
        choices=("qwen3-8b", "smollm2"),
        help="the target and drafter: qwen3-8b (5 drafter layers), or smollm2: SmolLM2-135M-Instruct (tied head, vocab 49,152) "
        "and configs/smollm2-gsm8k-gpu.yaml's drafter (8 layers), at (128 anchors, seq 512, batch 64) and (128, 512, 16)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny random config (hidden 64) for smoke tests, whatever --shapes says; implies small grids")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda | cpu")
    p.add_argument("--variant", action="append", default=None, help="variant name(s), levers joined by '+' (see the docstring); repeatable")
    p.add_argument(
        "--objectives",
        action="store_true",
        help="run the first --variant (default compile_layers+fused_ce_compiled, tiny: baseline) as is and with each "
        "loss objective: +dpace, +loss_kl, +loss_tv, +loss_nla, +loss_lk",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per config (default 6, tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per config after the flex warm-up (default 3, tiny 1)")
    p.add_argument(
        "--budget_s",
        type=float,
        default=None,
        help="stop starting new configs after this many seconds (default quick 300, full 500, tiny 50); (a) stops 75 s earlier to leave time for (b) and (c)",
    )
    p.add_argument(
        "--compile_target",
        action="store_true",
        help="(b) also with the target's layers compiled (TargetFeatureExtractor.compile_layers); (c) then uses the compiled target",
    )
    p.add_argument("--drafter_only", action="store_true", help="(a) only: skip the target supply (b) and the colocated estimate (c)")
    p.add_argument(
        "--drafter",
        default="dflash",
        choices=("dflash", "dflash2", "dspark"),
        help="the drafter: dflash, or dflash2 (its convolutions and candidate selector, and the selector's loss in each "
        "step as train_dflash.py adds it; the useful-FLOP count stays DFlash's, without them), or dspark (gamma = B - 1, "
        "the drafts per verify of DFlash's block B; Markov rank 256 and the confidence head; train_dflash.py's chunked_dspark_loss "
        "on the gamma slots' logits and the target's, loss_chunk_N rows at a time, each chunk's elementwise work compiled with fused_ce_compiled "
        "(default compile_layers+fused_ce_compiled, as train_dflash.py trains on CUDA); the useful-FLOP count is DFlash's with the target's logits, without "
        "the Markov head's W2, r / hidden of the LM head's work)",
    )
    p.add_argument("--attention_backend", default=None, help="flex | sdpa (default flex on CUDA, sdpa on CPU)")
    p.add_argument("--layer_types", default=None, help="drafter layer layout as train_dflash.py's --layer_types (all_full, last_full, ...)")
    p.add_argument("--sliding_window", type=int, default=None, help="window of the sliding layers (train_dflash.py's --sliding_window)")
    p.add_argument("--long", action="store_true", help="the long-sample grid instead of (a)-(c): see the docstring")
    p.add_argument(
        "--long_lengths",
        default=None,
        help="--long: tokens per sample, comma-separated (default 3072,4096,8192,16384,32768,65536; tiny 96,128,256,512)",
    )
    p.add_argument("--long_layouts", default="all_full,last_full", help="--long: drafter layouts (train_dflash.py's --layer_types), comma-separated")
    p.add_argument("--long_anchors", type=int, default=None, help="--long: anchors per sample (default 512; tiny 16)")
    p.add_argument(
        "--rows", default=None, help="--long: JSON-lines file of finished rows: appended as each row ends, rows already there are skipped (resume)"
    )
    p.add_argument(
        "--record-to",
        default=str(REPO_DIR / "BENCHMARKS.md"),
        help="markdown file the tables are appended to (on a machine whose tree does not come back: "
        "cp BENCHMARKS.md $OUT/ first, then --record-to $OUT/BENCHMARKS.md)",
    )
    p.add_argument("--no_append", action="store_true", help="print the tables only")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after (a)'s timed steps of the first variant at the first headline shape, profile 3 more steps (torch.profiler, "
        "after 1 warm-up) and write DIR/trace.json.gz (chrome trace) and DIR/ops.md (top ops by self device time, time per "
        "phase); the report gets the ops table too",
    )
    args = p.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no GPU; use --device cpu --tiny for a smoke run")
    if args.device == "cpu" and not args.tiny:
        raise ValueError("--device cpu runs only with --tiny (Qwen3-8B or SmolLM2 shapes on CPU take hours)")
    args.backend = args.attention_backend or ("flex" if args.device == "cuda" else "sdpa")
    if args.backend not in ("flex", "sdpa"):
        raise ValueError(f"--attention_backend must be flex or sdpa, got {args.backend!r}")
    if args.backend == "flex" and args.device == "cpu":
        raise ValueError("--attention_backend flex has no CPU backward; use sdpa on CPU")
    args.steps = args.steps or (2 if args.tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.budget_s = args.budget_s or (50.0 if args.tiny else 300.0 if args.quick else 500.0)
    default_variants = ["baseline", "fused_ce", "fused_ce_compiled", "compile_layers+fused_ce_compiled"]
    if args.tiny:
        default_variants = ["baseline", "loss_chunk_2048", "fused_ce"]  # no inductor C++ compiles on a 2-core CPU
    elif not args.quick:
        default_variants += ["compile_layers", "loss_chunk_2048", "loss_chunk_8192"]
    args.variants = args.variant or default_variants
    if args.long:
        args.variants = args.variant or ["baseline" if args.tiny else "compile_layers+fused_ce_compiled"]
        lengths = args.long_lengths or ("96,128,256,512" if args.tiny else "3072,4096,8192,16384,32768,65536")
        try:
            args.long_lengths = [int(n) for n in lengths.split(",")]
        except ValueError:
            raise ValueError(f"--long_lengths must be comma-separated token counts, got {lengths!r}") from None
        args.long_layouts = args.long_layouts.split(",")
        args.long_anchors = args.long_anchors or (16 if args.tiny else 512)
        args.sliding_window = args.sliding_window or (32 if args.tiny else 2048)
        if args.layer_types is not None:
            raise ValueError("--long runs every layout of --long_layouts; give those instead of --layer_types")
        if args.profile is not None:
            raise ValueError("--profile profiles a step of (a), which --long does not run; leave out one of them")
    if args.objectives:
        base = args.variant[0] if args.variant else ("baseline" if args.tiny else "compile_layers+fused_ce_compiled")
        args.variants = [base] + [f"{base}+{lever}" for lever in OBJECTIVE_LEVERS]
    if args.drafter == "dspark":  # its loss is chunked_dspark_loss: of the loss levers the chunk size and its compiled chunk apply
        args.variants = args.variant or ["baseline" if args.tiny else "compile_layers+fused_ce_compiled"]
        for name in args.variants:
            variant = parse_variant(name)
            dspark_loss_levers = (variant.objective, variant.weighting, variant.fused_loss) == ("ce", "exp", "none")
            if variant.loss not in ("chunked", "fused_compiled") or not dspark_loss_levers or args.objectives:
                raise ValueError(
                    f"--drafter dspark trains with chunked_dspark_loss only: --variant {name!r} or --objectives sets a loss lever; "
                    f"use baseline, compile_layers, fused_ce_compiled (its chunks compiled), checkpoint_layers or loss_chunk_N"
                )
    for name in args.variants:
        parse_variant(name)  # fail early on a typo
    return args


def shapes(args) -> dict:
    """Target config, drafter sizes and the benchmark grids of --shapes (--tiny: a tiny config whatever --shapes says).

    Returns {name: what the report calls them, target: a Qwen3Config, draft_layers, target_layer_ids (None: the
    default spread), mask_token_id, headline and grid: [(num_anchors, seq, batch)], target_shapes: [(batch, seq)]
    of (b)}; reads args.tiny, args.shapes and args.quick."""
    if args.tiny:
        target = Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        )
        headline = [(8, 64, 2), (16, 128, 1)]  # (num_anchors, seq, batch)
        grid = [(n, s, b) for n in (8, 16) for s in (64, 128) for b in (1, 2)]
        target_shapes = [(4, 128), (2, 64), (1, 128)]
        return dict(
            name="tiny config",
            target=target,
            draft_layers=2,
            target_layer_ids=None,
            mask_token_id=255,
            headline=headline,
            grid=grid,
            target_shapes=target_shapes,
        )
    if args.shapes == "smollm2":
        # SmolLM2-135M-Instruct (a Llama: no q/k norms, which only the target's forward in (b) would run) and the
        # drafter of configs/smollm2-gsm8k-gpu.yaml: 8 layers, its target layer ids, sequences padded to 512 tokens,
        # 128 anchors, batch 64 (and a quarter of it).
        target = Qwen3Config(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
        headline = [(128, 512, 64), (128, 512, 16)]
        return dict(
            name="SmolLM2-135M shapes",
            target=target,
            draft_layers=8,
            target_layer_ids=[1, 8, 14, 20, 27],
            mask_token_id=SMOLLM2_MASK_TOKEN_ID,
            headline=headline,
            grid=headline,
            target_shapes=[(b, s) for _, s, b in headline],
        )
    target = Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    headline = [(256, 768, 2), (512, 3072, 1)]  # the public anchor's shape; the paper recipe's
    grid = headline + [(n, s, b) for n in (256, 512) for s in (768, 3072) for b in (1, 2, 4) if (n, s, b) not in headline]
    target_shapes = [(16, 1024)] + sorted({(b, s) for _, s, b in (headline if args.quick else grid)})
    return dict(
        name="Qwen3-8B shapes",
        target=target,
        draft_layers=5,
        target_layer_ids=None,  # dflash_model.default_target_layer_ids: [1, 9, 17, 25, 33]
        mask_token_id=QWEN3_MASK_TOKEN_ID,
        headline=headline,
        grid=grid,
        target_shapes=target_shapes,
    )


class Progress:
    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)


DRAFTER_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark"}  # --drafter -> the report's name


def block_size_of(drafter: str) -> int:
    """The drafter's block size: B = 16 (the paper's); DSpark's gamma = 15, the same 15 drafts per verify
    (its anchor's slot predicts too)."""
    return 15 if drafter == "dspark" else 16


# ----------------------------------------------------------------------------------------------
# Tables


def fmt(value, spec=".1f", missing="-"):
    return missing if value is None else format(value, spec)


def drafter_table(rows, matmul_tflops, on_cuda, trainable_params) -> str:
    header = (
        "| variant | anchors | seq | batch | ms/step | ms/sample | ms/sample, opt. /7 | samples/s | useful TFLOP/sample | useful TFLOP/s "
        "| MFU vs measured | MFU vs 989 | peak GB | proj. GB, 7 ranks | fwd / loss / bwd / opt ms | mask ms | flex fwd+bwd ms, all layers | warm-up s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    # ZeRO-2 over 7 drafter ranks keeps 1/7 of the 16 bytes/param of fp32 master, grad and Adam state.
    sharded_saving_gb = 16 * trainable_params * 6 / 7 / 1e9
    lines = []
    for r in rows:
        shape = f"| {r['variant']} | {r['anchors']} | {r['seq']} | {r['batch']} "
        if r["status"] != "ok":
            lines.append(shape + f"| {r['status']} |" + " |" * 13)
            continue
        ms_sample = r["ms_step"] / r["batch"]
        tflops = r["flops_sample"] / (ms_sample / 1e3) / 1e12
        peak = r["peak_gb"]
        lines.append(
            shape
            + f"| {r['ms_step']:.1f} | {ms_sample:.1f} | {(r['ms_step'] - r['phases_ms'][-1] * 6 / 7) / r['batch']:.1f} | {1e3 / ms_sample:.2f} | {r['flops_sample'] / 1e12:.3g} "
            f"| {tflops:.3g} | {100 * tflops / matmul_tflops:.1f}% "
            f"| {fmt(100 * tflops / H200_BF16_PEAK_TFLOPS if on_cuda else None)}{'%' if on_cuda else ''} "
            f"| {fmt(peak)} | {fmt(peak - sharded_saving_gb if peak is not None else None)} "
            f"| {' / '.join(f'{p:.1f}' for p in r['phases_ms'])} | {fmt(r.get('mask_ms'))} | {fmt(r.get('attn_ms'))} | {r['warmup_s']:.1f} |"
        )
    return header + "\n".join(lines) + "\n"


def target_table(rows) -> str:
    header = "| target layers | batch | seq | ms/call | tokens/s | TFLOP/s (fwd) | peak GB |\n|---|---|---|---|---|---|---|\n"
    lines = []
    for r in rows:
        mode = "compiled" if r["compiled"] else "eager"
        if r["status"] != "ok":
            lines.append(f"| {mode} | {r['batch']} | {r['seq']} | {r['status']} | | | |")
        else:
            lines.append(
                f"| {mode} | {r['batch']} | {r['seq']} | {r['ms_call']:.1f} | {r['tokens_s']:,.0f} | {r['tflops']:.3g} | {fmt(r['peak_gb'])} |"
            )
    return header + "\n".join(lines) + "\n"


def colocated_table(rows) -> str:
    header = (
        "| variant | anchors | seq | batch | colocated ms/sample | samples/s | drafter alone ms/sample | target alone ms/sample "
        "| 1/(drafter+target) samples/s | ratio (goal >= 0.9) | peak GB |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        shape = f"| {r['variant']} | {r['anchors']} | {r['seq']} | {r['batch']} "
        if r["status"] != "ok" or r.get("alone_ms") is None:
            lines.append(shape + f"| {r['status'] if r['status'] != 'ok' else 'no alone measurement'} |" + " |" * 6)
            continue
        ms = r["ms_step"] / r["batch"]
        drafter_ms, target_ms = r["alone_ms"]
        ideal = 1e3 / (drafter_ms + target_ms)
        lines.append(
            shape + f"| {ms:.1f} | {1e3 / ms:.2f} | {drafter_ms:.1f} | {target_ms:.1f} | {ideal:.2f} "
            f"| {(1e3 / ms) / ideal:.3f} | {fmt(r['peak_gb'])} |"
        )
    return header + "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# --long: the long-sample grid


def context_bytes_per_token(config: DFlashConfig, chunked: bool) -> int:
    """Bytes per context token that a drafter step keeps for backward, in bf16 (the formula behind the
    predicted-peak column): the features (2 * features * hidden), then unchunked hidden_norm's fp32 and
    bf16 copies and its output (8 * hidden) and, per layer, k_norm's and RoPE's intermediates and the
    K/V (14 * kv width); chunked (`chunk_context`) the K/V alone, twice (before and after the
    concatenation with the block's). Qwen3-8B shapes: 145 KB unchunked, 82 KB chunked, as counted
    with saved-tensor hooks on a CPU at 1/8 of the widths (146 and 80 KB)."""
    kv_width = config.num_key_value_heads * config.head_dim
    features = 2 * len(config.target_layer_ids) * config.hidden_size
    if chunked:
        return features + config.num_hidden_layers * 8 * kv_width
    return features + 8 * config.hidden_size + config.num_hidden_layers * 14 * kv_width


def row_key(row: dict) -> tuple:
    return (row["kind"], row.get("layout"), row.get("variant"), row["seq"])


def load_rows(path: Path | None) -> list[dict]:
    """Rows a resumed --long run has already measured (`--rows`); none when the file is absent."""
    if path is None or not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"--rows {path}:{number}: not a JSON row (a run cut off while writing?); delete that line") from None
    return rows


def run_long(args, s: dict, device, dtype, progress) -> tuple[list, str]:
    """The target's forward at batch 1 at every length, then the drafter's step for every layout x
    variant x length (`bench_drafter_config`, batch 1). Rows in `--rows` are kept and not rerun; a
    row that would start past the budget is left for the next run. Returns (all rows, a note on what is left)."""
    rows_path = Path(args.rows) if args.rows else None
    rows = load_rows(rows_path)
    done = {row_key(r) for r in rows}
    left = []

    def record(row: dict) -> None:
        rows.append(row)
        if rows_path is not None:
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    target_config = s["target"]
    base = drafter_config_for_target(
        target_config, mask_token_id=s["mask_token_id"], num_draft_layers=s["draft_layers"], target_layer_ids=s["target_layer_ids"]
    )
    wanted = [dict(kind="target", seq=n) for n in args.long_lengths]
    if not args.drafter_only and any(row_key(w) not in done for w in wanted):
        progress("(long) building the random target")
        extractor = TargetFeatureExtractor(build_target(target_config, device, dtype), base.target_layer_ids, truncate=True)
        for want in wanted:
            if row_key(want) in done:
                continue
            if progress.over_budget():
                left.append(f"target {want['seq']}")
                continue
            row = bench_target(extractor, target_config, max(base.target_layer_ids) + 1, device, 1, want["seq"], args.steps, args.warmup)
            record(dict(want, **row))
            progress(f"(long) target forward at {want['seq']} tokens: " + (f"{row['ms_call']:.1f} ms" if row["status"] == "ok" else row["status"]))
        del extractor
        free_memory(device)

    for layout in args.long_layouts:
        window = None if layout == "all_full" else args.sliding_window
        todo = [
            (v, n) for v in args.variants for n in args.long_lengths if row_key(dict(kind="drafter", layout=layout, variant=v, seq=n)) not in done
        ]
        if not todo:
            continue
        config = drafter_config_for_target(
            target_config,
            mask_token_id=s["mask_token_id"],
            num_draft_layers=s["draft_layers"],
            target_layer_ids=s["target_layer_ids"],
            layer_types=layout,
            sliding_window=window,
            drafter=args.drafter,
            block_size=block_size_of(args.drafter),
        )
        ctx = drafter_context(config, device, dtype, progress, args.backend, args.steps, args.warmup, tied_head=target_config.tie_word_embeddings)
        for name, seq_len in todo:
            if progress.over_budget():
                left.append(f"{layout} {name} {seq_len}")
                continue
            progress(f"(long) {layout}, {name}: {args.long_anchors} anchors, {seq_len} tokens")
            row = bench_drafter_config(ctx, parse_variant(name), args.long_anchors, seq_len, 1)
            row.update(
                kind="drafter",
                layout=layout,
                window=window,
                context_bytes_per_token=context_bytes_per_token(config, parse_variant(name).context_chunk > 0),
            )
            record(row)
            if row["status"] == "ok":
                progress(
                    f"    {row['ms_step']:.1f} ms/sample, {row['flops_sample'] / (row['ms_step'] / 1e3) / 1e12:.3g} useful TFLOP/s, "
                    f"peak {fmt(row['peak_gb'])} GB"
                )
            else:
                progress(f"    {row['status']}")
        ctx["optimizer"].zero_grad()
        del ctx
        free_memory(device)
    note = f"not run (time budget; run again with the same --rows to resume): {', '.join(left)}" if left else "every row measured"
    return rows, note


def long_table(rows: list[dict]) -> str:
    """Markdown: one line per drafter row, its target forward beside it, ratios to the 3,072-token row of the
    same layout and variant (or of the variant it adds levers to; else its shortest row), and the predicted
    peak (that row's peak + the extra context tokens x `context_bytes_per_token`)."""
    header = (
        "| layout | variant | tokens | anchors | drafter ms/sample | vs shortest | peak GB | predicted peak GB | useful TFLOP/s "
        "| target fwd ms/sample | target TFLOP/s | target peak GB | drafter + target ms/sample | vs shortest |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    targets = {r["seq"]: r for r in rows if r["kind"] == "target" and r["status"] == "ok"}
    lines = []
    for r in sorted((r for r in rows if r["kind"] == "drafter"), key=lambda r: (r["layout"], r["variant"], r["seq"])):
        layout = r["layout"] if r["window"] is None else f"{r['layout']} ({r['window']})"
        shape = f"| {layout} | {r['variant']} | {r['seq']} | {r['anchors']} "
        if r["status"] != "ok":
            lines.append(shape + f"| {r['status']} |" + " |" * 9)
            continue
        # The reference: this layout's 3,072-token row of the same variant, else of the variant this one adds
        # levers to (a memory lever measured at 32k and 64k only), else this variant's shortest row.
        same = [
            b
            for b in rows
            if b["kind"] == "drafter"
            and b["status"] == "ok"
            and b["layout"] == r["layout"]
            and (b["variant"] == r["variant"] or r["variant"].startswith(b["variant"] + "+"))
        ]
        ref = min(same, key=lambda b: (b["seq"] != 3072, b["variant"] != r["variant"], b["seq"]))
        target, ref_target = targets.get(r["seq"]), targets.get(ref["seq"])
        predicted = (ref["peak_gb"] + (r["seq"] - ref["seq"]) * r["context_bytes_per_token"] / 1e9) if ref.get("peak_gb") is not None else None
        both = r["ms_step"] + target["ms_call"] if target else None
        ref_both = ref["ms_step"] + ref_target["ms_call"] if ref_target else None
        lines.append(
            shape + f"| {r['ms_step']:.1f} | {r['ms_step'] / ref['ms_step']:.2f}x ({ref['seq']}) | {fmt(r['peak_gb'])} | {fmt(predicted)} "
            f"| {r['flops_sample'] / (r['ms_step'] / 1e3) / 1e12:.3g} | {fmt(target and target['ms_call'])} | {fmt(target and target['tflops'], '.3g')} "
            f"| {fmt(target and target['peak_gb'])} | {fmt(both)} | {fmt(both / ref_both if both and ref_both else None, '.2f')}{'x' if both and ref_both else ''} |"
        )
    return header + "\n".join(lines) + "\n"


def long_report(args, argv: list[str], s: dict, gpu: str, rows: list[dict], note: str, elapsed_s: float) -> str:
    command = "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + argv)
    return (
        f"\n## {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} bench_dflash.py --long: long samples\n\n"
        f"{gpu}, torch {torch.__version__}, transformers {__import__('transformers').__version__}, command: `{command}` "
        f"({s['name']}, {args.backend} attention, batch 1, {args.steps} timed steps after "
        f"{args.warmup} warm-up steps, medians; this call {elapsed_s:.0f} s; {note}). Drafter: {s['draft_layers']} layers, block 16, the first "
        f"tokens/8 of each sample prompt, the rest reply; peak GB is the drafter step's own (with its optimizer state), the "
        f"target's with the target alone on the device; 'predicted peak' adds the context bytes per token of "
        f"`context_bytes_per_token` to the shortest row's measured peak.\n\n{long_table(rows)}"
    )


# ----------------------------------------------------------------------------------------------
# Main


def run_drafter_grid(ctx: dict, progress, variant_names, configs, rows: list, budget_s: float, profile_dir: str | None = None) -> None:
    """(a) every variant at every (anchors, seq, batch) of `configs`, appended to `rows`; configs
    that would start after `budget_s` are listed as skipped. With `profile_dir` the first variant's
    first config is also profiled there (`profile_steps`)."""
    for name in variant_names:
        variant = parse_variant(name)
        for num_anchors, seq_len, batch in configs:
            if progress.elapsed() > budget_s:
                rows.append(dict(variant=name, anchors=num_anchors, seq=seq_len, batch=batch, status="skipped (time budget)"))
                continue
            progress(f"(a) {name}: anchors {num_anchors}, seq {seq_len}, batch {batch}")
            first = name == variant_names[0] and (num_anchors, seq_len, batch) == configs[0]
            row = bench_drafter_config(ctx, variant, num_anchors, seq_len, batch, profile_dir=profile_dir if first else None)
            if "profile" in row:
                progress(f"    profiled: {profile_dir}/ops.md, {profile_dir}/trace.json.gz")
            rows.append(row)
            if row["status"] == "ok":
                progress(
                    f"    {row['ms_step'] / batch:.1f} ms/sample, {row['flops_sample'] / (row['ms_step'] / batch / 1e3) / 1e12:.3g} "
                    f"useful TFLOP/s, peak {fmt(row['peak_gb'])} GB, warm-up {row['warmup_s']:.1f} s"
                )
            else:
                progress(f"    {row['status']}")


def run_target_supply(args, s: dict, config: DFlashConfig, device, dtype, progress) -> tuple[list, TargetFeatureExtractor]:
    """(b) the truncated target with feature capture, eager (and compiled with --compile_target), at
    every target shape. Returns (rows, the extractor, for (c))."""
    progress("(b) building the random target")
    target_config = s["target"]
    target = build_target(target_config, device, dtype)
    extractor = TargetFeatureExtractor(target, config.target_layer_ids, truncate=True)
    num_layers = max(config.target_layer_ids) + 1
    rows = []
    for compiled in [False, True] if args.compile_target else [False]:
        if compiled:
            extractor.compile_layers()
        for batch, seq_len in s["target_shapes"]:
            if progress.over_budget():
                rows.append(dict(batch=batch, seq=seq_len, compiled=compiled, status="skipped (time budget)"))
                continue
            row = bench_target(extractor, target_config, num_layers, device, batch, seq_len, args.steps, args.warmup)
            row["compiled"] = compiled
            rows.append(row)
            progress(
                f"(b) target batch {batch} x {seq_len}{' compiled' if compiled else ''}: "
                + (f"{row['tokens_s']:,.0f} tokens/s" if row["status"] == "ok" else row["status"])
            )
    return rows, extractor


def run_colocated(args, s: dict, ctx: dict, extractor: TargetFeatureExtractor, drafter_rows: list, target_rows: list, progress) -> list:
    """(c) target forward + drafter step on one GPU at the headline shapes (baseline and the fastest
    CE variant: the truncated target has no last hidden state for the distribution losses), each
    against the two alone."""
    ctx["drafter"].attach_target(extractor.embed_tokens, extractor.lm_head)
    ctx["head_weight"] = extractor.lm_head.weight
    ok = [r for r in drafter_rows if r["status"] == "ok" and parse_variant(r["variant"]).objective == "ce"]
    rows = []
    for num_anchors, seq_len, batch in s["headline"]:
        at_shape = [r for r in ok if (r["anchors"], r["seq"], r["batch"]) == (num_anchors, seq_len, batch)]
        best = min(at_shape, key=lambda r: r["ms_step"], default=None)
        for name in dict.fromkeys(["baseline"] + ([best["variant"]] if best else [])):
            if name not in args.variants:
                continue
            if progress.over_budget():
                rows.append(dict(variant=name, anchors=num_anchors, seq=seq_len, batch=batch, status="skipped (time budget)"))
                continue
            progress(f"(c) colocated {name}: anchors {num_anchors}, seq {seq_len}, batch {batch}")
            row = bench_drafter_config(ctx, parse_variant(name), num_anchors, seq_len, batch, extractor=extractor)
            alone = next((r for r in at_shape if r["variant"] == name), None)
            target_alone = next(
                (r for r in target_rows if (r["batch"], r["seq"], r["compiled"]) == (batch, seq_len, args.compile_target) and r["status"] == "ok"),
                None,
            )
            if alone and target_alone:
                row["alone_ms"] = (alone["ms_step"] / batch, target_alone["ms_call"] / batch)
            rows.append(row)
            if row["status"] == "ok":
                progress(f"    {row['ms_step'] / batch:.1f} ms/sample colocated")
    return rows


def report(
    args,
    argv: list[str],
    s: dict,
    config: DFlashConfig,
    gpu: str,
    matmul: tuple[float, str],
    trainable: int,
    rows: tuple[list, list, list],
    on_cuda: bool,
    elapsed_s: float,
) -> str:
    """The markdown entry of this run: the setting, then tables (a), (b) and (c), each that has rows."""
    matmul_tflops, matmul_note = matmul
    drafter_rows, target_rows, colocated_rows = rows
    target_config = s["target"]
    command = "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + argv)
    flops_parts = drafter_step_flops(config, s["headline"][0][1], *_example_counts(config, *s["headline"][0]))
    parts = ", ".join(f"{k} {(f + b) / s['headline'][0][2] / 1e12:.3g}" for k, (f, b) in flops_parts.items())
    return (
        f"\n## {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} bench_dflash.py: {DRAFTER_NAMES[args.drafter]} training speed, {s['name']}\n\n"
        f"{gpu}, torch {torch.__version__}, transformers {__import__('transformers').__version__}, command: `{command}` ({s['name']}, {args.backend} attention, "
        f"{args.steps} timed steps after {args.warmup} warm-up steps, medians; total {elapsed_s:.0f} s)\n\n"
        f"Matmul rate: {matmul_note}. Drafter: {trainable / 1e6:.1f} M trainable params. Useful TFLOP/sample by part at "
        f"{s['headline'][0][0]} anchors / seq {s['headline'][0][1]} (all anchors valid): {parts}.\n\n"
        f"(a) drafter train step (fwd+bwd+AdamW on fp32 masters and grad clipping, one GPU; 'opt. /7' and 'proj. GB' "
        f"project ZeRO-2 over 7 drafter ranks, the public anchor's setting, without its communication: 1/7 of the "
        f"optimizer time, and peak minus 6/7 of the 16 B/param of fp32 master, grad and Adam state):\n\n{drafter_table(drafter_rows, matmul_tflops, on_cuda, trainable)}\n"
        + (  # (b) and (c) only when measured (not with --drafter_only)
            f"(b) target supply ({max(config.target_layer_ids) + 1} of {target_config.num_hidden_layers} layers, hook capture of "
            f"layers {config.target_layer_ids}):\n\n{target_table(target_rows)}\n"
            if target_rows
            else ""
        )
        + (f"(c) colocated on 1 GPU (target forward + drafter step):\n\n{colocated_table(colocated_rows)}" if colocated_rows else "")
        + "".join(profile_section(r, s) for r in drafter_rows if "profile" in r)
    )


def profile_section(row: dict, s: dict) -> str:
    """Markdown: the profiled step's time per phase and top ops (`profile_steps`), under a heading naming its variant and shape."""
    p = row["profile"]
    return (
        f"\n### Profile: {row['variant']} at {row['anchors']} anchors, seq {row['seq']}, batch {row['batch']} ({s['name']})\n\n"
        f"{p['note']}\n\nTime per phase:\n\n{p['phases']}\nTop 30 ops:\n\n{p['ops']}"
    )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    progress = Progress(args.budget_s)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        setup_compile_cache("shared")  # before anything compiles (docs/compile-safety.md)
    else:
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads, and a shared CPU loses a lot to them
    torch.manual_seed(0)
    s = shapes(args)
    config = drafter_config_for_target(
        s["target"],
        mask_token_id=s["mask_token_id"],
        num_draft_layers=s["draft_layers"],
        target_layer_ids=s["target_layer_ids"],
        layer_types=args.layer_types,
        sliding_window=args.sliding_window,
        drafter=args.drafter,
        block_size=block_size_of(args.drafter),
    )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    progress(
        f"{gpu}, torch {torch.__version__}, {args.drafter} drafter, variants {args.variants}, backend {args.backend}, budget {args.budget_s:.0f} s"
    )
    if args.long:
        s["target"].max_position_embeddings = max(s["target"].max_position_embeddings, max(args.long_lengths))
        rows, note = run_long(args, s, device, dtype, progress)
        text = long_report(args, argv, s, gpu, rows, note, progress.elapsed())
        print(text, flush=True)
        if not args.no_append:
            with Path(args.record_to).open("a") as f:
                f.write(text)
            progress(f"appended to {args.record_to}")
        return
    matmul = matmul_rate(device, dtype)
    progress(matmul[1])
    ctx = drafter_context(config, device, dtype, progress, args.backend, args.steps, args.warmup, tied_head=s["target"].tie_word_embeddings)

    # (a) every variant at the headline shapes, then the rest of the grid for the first variant; it
    # stops starting configs early enough to leave time for (b) and (c).
    budget_a = args.budget_s - (0 if args.tiny or args.drafter_only else 75)
    drafter_rows = []
    run_drafter_grid(ctx, progress, args.variants, s["headline"], drafter_rows, budget_a, profile_dir=args.profile)
    if not args.quick:
        run_drafter_grid(ctx, progress, args.variants[:1], [c for c in s["grid"] if c not in s["headline"]], drafter_rows, budget_a)

    # (b) target supply and (c) colocated, without the standalone embedding and head of (a)
    ctx["drafter"].attach_target(None, None)
    ctx["head_weight"] = None
    free_memory(device)
    target_rows, colocated_rows = [], []
    if args.drafter_only:
        progress("(b), (c) skipped: --drafter_only")
    elif progress.over_budget():
        progress("(b), (c) skipped: time budget")
    else:
        target_rows, extractor = run_target_supply(args, s, config, device, dtype, progress)
        colocated_rows = run_colocated(args, s, ctx, extractor, drafter_rows, target_rows, progress)

    text = report(
        args, argv, s, config, gpu, matmul, ctx["trainable"], (drafter_rows, target_rows, colocated_rows), device.type == "cuda", progress.elapsed()
    )
    print(text, flush=True)
    if not args.no_append:
        results = Path(args.record_to)
        if not results.exists():
            results.write_text("# Benchmarks\n\nMeasured results, newest last; scripts append here themselves.\n")
        with results.open("a") as f:
            f.write(text)
        progress(f"appended to {results}")


def _example_counts(config: DFlashConfig, num_anchors: int, seq_len: int, batch: int):
    """(anchors, anchor_valid, label_valid) with evenly spread, all-valid anchors, for the per-part FLOP line."""
    anchors = torch.linspace(seq_len // 8, seq_len - 2, num_anchors).long().expand(batch, num_anchors)
    anchor_valid = torch.ones(batch, num_anchors, dtype=torch.bool)
    positions = anchors[:, :, None] + torch.arange(1, config.block_size)
    return anchors, anchor_valid, positions < seq_len


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as error:  # bad flags: one clear line, no traceback (as train_dflash.py says it)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
