"""Train a DFlash drafter for a frozen target LLM: the settings, the run's phases and the training loop.

Offline CPU demo (no arguments: SmolLM2-135M-Instruct target, the repo's demo conversations):
    python launch.py train_dflash.py

A real run on 8 GPUs (settings in the YAML, any flag overrides them):
    accelerate launch --config_file accelerate_configs/8gpu.yaml train_dflash.py --config configs/qwen3-8b.yaml

Two GPUs, one running the target and one training the drafter:
    accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py --config configs/qwen3-8b.yaml --target_ranks 1

One GPU, your own data:
    accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py \
        --target_model Qwen/Qwen3-8B --train_data my_chats.jsonl --output_dir outputs/qwen3-8b

A target too large for one GPU: target ranks in tensor-parallel groups of 2 (DeepSpeed AutoTP):
    accelerate launch --config_file accelerate_configs/8gpu.yaml train_dflash.py --target_model Qwen/Qwen3-32B \
        --train_data my_chats.jsonl --target_ranks 4 --target_tp_size 2

Long samples sharded over drafter ranks: sequence-parallel groups of 4 (DeepSpeed Ulysses; docs/training.md):
    accelerate launch --config_file accelerate_configs/8gpu_sp4.yaml train_dflash.py --config configs/qwen3-8b.yaml --max_seq_length 32768

Two nodes (the same command on each, with its --machine_rank; --output_dir on a shared filesystem):
    accelerate launch --config_file accelerate_configs/2x8gpu.yaml --machine_rank 0 --main_process_ip NODE0 \
        train_dflash.py --config configs/qwen3-8b.yaml --target_ranks 2 --output_dir /shared/outputs/qwen3-8b

`python launch.py` in place of `accelerate launch` takes the same arguments and runs the same ranks;
it ends a failed run with the first failing rank's error line and exit status.

Colocated mode (--target_ranks 0, the default): every rank runs the frozen target (context features,
no grad) and trains the drafter under DeepSpeed ZeRO-2. Split mode (--target_ranks N or auto;
docs/topology.md): on every node, local ranks [0, N) only run the target (alone, or --target_tp_size
of them sharing one copy) and send the features to the node's other ranks, which train the drafter
under ZeRO-2 on their own process group and never load a target layer.

Where the rest lives: the drafter in dflash_model.py, the objective (position weights, the DFlash
loss, the tau estimate) in dflash_loss.py and its chunked LM head + loss kernels in
dflash_loss_kernels.py, what each rank loads and does in dflash_topology.py (its
plumbing in dflash_split.py), the context features a drafter rank trains on in dflash_features.py,
the run's order of micro-batches in dflash_schedule.py, checkpoints, resume, the export and the Hub
in dflash_checkpoint.py, what a run reports in dflash_progress.py, the target side in
dflash_target.py, the data in dflash_data.py, compile safety in dflash_compile.py, flag parsing in
dflash_cli.py. Imports only go down: nothing below imports this file.

Order of work: settings, the target's tokenizer and config, the data (tokenized and checked), and
only then the target's weights, so a bad setting or data file fails in seconds, not after minutes
of loading an 8B target.
"""

import argparse
import contextlib
import functools
import gc
import json
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TypeVar

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import time

import deepspeed
import yaml

if not torch.cuda.is_available():
    # On CPU DeepSpeed JIT-builds a shared-memory all-reduce op with g++ (minutes on 2 cores) that
    # only its inference path uses; mark it unavailable so training never builds it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedPlugin
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from dflash2_model import DFlash2Config, DFlash2DraftModel, selector_predecessor_ids
from dflash_checkpoint import (
    CheckpointSettings,
    ModelCardSettings,
    check_checkpoint,
    check_hub_access,
    find_resume_point,
    finished_run,
    model_card,
    push_to_hub,
    resume_engine,
    save_checkpoint,
    save_export,
)
from dflash_cli import HelpFormatter, SettingsParser, check_yaml_values, did_you_mean, yaml_error_line
from dflash_compile import warm_up_flex_attention
from dflash_data import build_train_dataset, load_prompts
from dflash_decoding import evaluate_acceptance, resolve_block_size
from dflash_features import FeatureSettings, FeatureSupply, TargetFeatureExtractor, to_device
from dflash_loss import (
    DEFAULT_LOSS_GAMMA,
    LOSS_NORMALIZERS,
    LOSS_WEIGHTINGS,
    block_target_hidden,
    chunked_dspark_loss,
    default_loss_gamma,
    loss_weights,
    selector_objective,
    weighted_block_loss,
)
from dflash_loss_kernels import LOSSES, check_fused_loss, resolve_fused_loss
from dflash_masks import ANCHOR_SAMPLINGS, anchor_slots, block_label_valid, block_labels, create_anchor_block_mask, sample_anchors
from dflash_model import DFlashConfig, DFlashDraftModel, SequenceParallel
from dflash_progress import (
    DEBUG_LOG,
    Progress,
    ProgressSettings,
    check_finite_loss,
    debug_log,
    exit_after_failure,
    format_tau,
    plot_training_curves,
    profile_window,
    start_progress,
    weights_digest,
    window_scalars,
)
from dflash_schedule import (
    BATCH_ORDERS,
    ResumePoint,
    Schedule,
    ScheduleSettings,
    epoch_batches,
    is_eval_step,
    is_save_step,
    make_schedule,
    real_micro_batches,
)
from dflash_split import DrafterGroupMPU, broadcast_drafter_weights, broadcast_scalars
from dflash_target import SMOLLM2_PACKAGE, drafter_config_for_target, load_target_config, resolve_mask_token_id
from dflash_topology import (
    EVAL_RESULTS,
    TargetParts,
    TopologySettings,
    check_sequence_parallel_heads,
    load_target_parts,
    make_sequence_parallel_groups,
    plan_rank_roles,
    run_target_rank,
    settle_split,
    setup_distributed,
    time_rank_split,
)
from dspark_model import DSparkConfig, DSparkDraftModel, dspark_block_labels, markov_predecessor_ids

logger = logging.getLogger("train_dflash")
# DeepSpeed's ZeRO step gathers parameters through an all-gather that newer torch deprecates: one
# FutureWarning per rank that a user cannot act on.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning)
REPO_DIR = Path(__file__).resolve().parent
DEMO_CONFIG = REPO_DIR / "configs" / "demo.yaml"
OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULERS = ("cosine", "linear")
DSPARK_LOSS_GAMMA = 4.0  # DeepSpec's loss_decay_gamma: DSpark's slot weights exp(-k/4)

# ----------------------------------------------------------------------------------------------
# Settings: one typed block; YAML (--config) fills it, command-line flags override the YAML.


@dataclass
class TrainSettings:
    # One line per setting: its name, type, default, help group and meaning.
    # fmt: off
    # target and data
    target_model: str | None = field(default=None, metadata={"group": "data", "help": f"Target: local dir or hub id; '{SMOLLM2_PACKAGE}' = the SmolLM2-135M-Instruct GGUF from that pip package (default: none; required, from here or --config)"})
    target_gguf_file: str | None = field(default=None, metadata={"group": "data", "help": "GGUF file name inside --target_model (model and tokenizer are read from it; default: none, the folder's own weights)"})
    target_random_init: bool = field(default=False, metadata={"group": "data", "help": "Random target weights from --target_model's config.json (benchmarks and smoke tests only)"})
    train_data: list[str] = field(default_factory=list, metadata={"group": "data", "help": "JSONL/JSON files or local HF dataset dirs (messages, conversations or question/answer; default: none, required)"})
    max_seq_length: int = field(default=3072, metadata={"group": "data", "help": "Truncate samples to this many tokens; samples left with fewer than 2 assistant tokens are dropped (counted in a warning)"})
    max_dropped_fraction: float = field(default=0.5, metadata={"group": "data", "help": "Stop with an error when more than this share of the samples is dropped by --max_seq_length (the length is then likely wrong)"})
    chat_template_kwargs: str | None = field(default=None, metadata={"group": "data", "help": 'JSON dict for the chat template, e.g. \'{"enable_thinking": false}\' (default: none, the template\'s own settings)'})
    skip_bad_samples: bool = field(default=False, metadata={"group": "data", "help": "Skip malformed records (counted in a summary) instead of stopping at the first; too-long samples are dropped either way"})
    max_samples: int | None = field(default=None, metadata={"group": "data", "help": "Use at most this many samples, for quick runs (default: none, all of them)"})
    num_proc: int = field(default=4, metadata={"group": "data", "help": "Tokenization processes"})
    # drafter
    drafter: str = field(default="dflash", metadata={"group": "drafter", "help": "dflash (the paper's drafter), dflash2 (its successor: grouped dynamic causal convolutions around each layer's attention and MLP, and a candidate selector that rescores the top-k draft tokens along the block) or dspark (the anchor is the first prediction slot, a Markov head adds a bigram term to each slot's logits, a confidence head predicts each slot's acceptance; colocated, one rank per sample; docs/drafters.md)"})
    num_draft_layers: int = field(default=5, metadata={"group": "drafter", "help": "Drafter decoder layers (paper: 5)"})
    target_layer_ids: list[int] | None = field(default=None, metadata={"group": "drafter", "help": "0-based target layers feeding the drafter (default: one per drafter layer, spread evenly from layer 1 to L-3)"})
    block_size: int = field(default=16, metadata={"group": "drafter", "help": "Tokens per block, anchor included (B: B-1 drafts per block); --drafter dspark: gamma, the drafts per block (the anchor's slot is the first prediction slot: gamma inputs give gamma drafts, gamma + 1 tokens verified; equal drafts per verify to DFlash B = gamma + 1; DeepSpec's recipe: 7)"})
    mask_token_id: int | None = field(default=None, metadata={"group": "drafter", "help": "Block mask token id: an existing row of the target's embedding (default: <|MASK|> or the first spare row)"})
    mask_token: str | None = field(default=None, metadata={"group": "drafter", "help": "Block mask token as a string of the target tokenizer, instead of --mask_token_id (default: none)"})
    layer_types: str | None = field(default=None, metadata={"group": "drafter", "help": "Attention of each drafter layer: all_full (default), last_full (every layer sliding but the last: the layout of released long-context drafters), all_sliding, or a comma list of full_attention / sliding_attention, one per layer"})
    sliding_window: int | None = field(default=None, metadata={"group": "drafter", "help": "Tokens a sliding layer's query sees, itself included (q - k < window), e.g. 2048 (default: none; required with sliding layers)"})
    is_causal: bool | None = field(default=None, metadata={"group": "drafter", "help": "Causality of every drafter layer (the config's is_causal; default: unset, which makes sliding layers causal and full layers bidirectional, as the engines do); false makes sliding windows two-sided. SGLang ignores the field"})
    draft_intermediate_size: int | None = field(default=None, metadata={"group": "drafter", "help": "Drafter MLP width (default: the target's intermediate_size, 3 x hidden for a mixture-of-experts target)"})
    draft_num_attention_heads: int | None = field(default=None, metadata={"group": "drafter", "help": "Drafter query heads (default: the target's; 32 for partial-rotary targets such as Qwen3.5)"})
    draft_num_key_value_heads: int | None = field(default=None, metadata={"group": "drafter", "help": "Drafter KV heads (default: the target's; its KV width / 128 for partial-rotary targets)"})
    draft_head_dim: int | None = field(default=None, metadata={"group": "drafter", "help": "Drafter head dimension (default: the target's; 128 for partial-rotary targets)"})
    conv_kernel_size: int | None = field(default=None, metadata={"group": "drafter", "help": "--drafter dflash2: taps of each convolution (default 2, as z-lab's and speculators' DFlash2)"})
    conv_group_size: int | None = field(default=None, metadata={"group": "drafter", "help": "--drafter dflash2: channels sharing one per-token kernel weight (default 16)"})
    selector_rank: int | None = field(default=None, metadata={"group": "drafter", "help": "--drafter dflash2: width of the candidate selector's codebooks (default 256)"})
    selector_top_k: int | None = field(default=None, metadata={"group": "drafter", "help": "--drafter dflash2: draft-logit candidates the selector rescores per position (default 16)"})
    markov_rank: int = field(default=256, metadata={"group": "drafter", "help": "--drafter dspark: rank r of the Markov head W2(W1[previous token]) (2 x vocab x r parameters; 0: no Markov head; DeepSpec's recipe: 256)"})
    enable_confidence_head: bool | None = field(default=None, metadata={"group": "drafter", "help": "--drafter dspark: train the confidence head (a linear on [h_k; W1[previous token]] predicting each slot's acceptance); default: true"})
    # objective
    num_anchors: int = field(default=512, metadata={"group": "objective", "help": "Anchors (blocks) sampled per sequence, re-sampled every epoch (paper 512; tuned recipe 256)"})
    anchor_sampling: str = field(default="per_sequence", metadata={"group": "objective", "help": "How a micro-batch's anchors are drawn: per_sequence (--num_anchors of each sequence's eligible positions; a short reply gives all of its own) or pooled (batch x --num_anchors drawn uniformly over every eligible position of the micro-batch, so a sequence's share follows its length, as trainers that pack replies draw; 2 x --num_anchors slots per sequence, so ~2x the drafter's work a step)"})
    label_source: str = field(default="data", metadata={"group": "objective", "help": "What each block position learns: data (the reply's next token) or target_argmax (the target's greedy next token: what temperature-0 verification accepts; runs the whole target, not with --target_tp_size > 1; docs/training.md#labels-the-datas-next-token-or-the-targets-argmax)"})
    loss: str | None = field(default=None, metadata={"group": "objective", "help": "Per-position loss: ce (the paper's), or against the target's distribution p: kl, tv (1 - sum min(p, q)), nla (-log sum min(p, q)), lk (KL and TV blended by the acceptance); dspark, DSpark's own (--dspark_*_weight) and the only one --drafter dspark trains with. All but ce send the target's last hidden state too (docs/training.md#beyond-the-paper-d-pace-weights-and-losses-against-the-targets-distribution). Default: ce, dspark with --drafter dspark"})
    loss_weighting: str = field(default="exp", metadata={"group": "objective", "help": "Position weights: exp (w_k = exp(-(k-1)/gamma), the paper's weights) or dpace (D-PACE, the weighting speculators trains with unless told otherwise: the expected accepted tokens each position carries, from the drafter's detached confidence)"})
    dpace_alpha: float = field(default=0.5, metadata={"group": "objective", "help": "D-PACE's smoothing: confidence s_k = (1 - alpha) * exp(-CE_k) + alpha (the acceptance probability instead of exp(-CE_k) with a distribution loss)"})
    loss_normalize: str = field(default="weights", metadata={"group": "objective", "help": "Divide the weighted loss sum by the sum of weights (weights, a weighted mean) or by the valid positions (count, speculators' reduction)"})
    lk_eta: float = field(default=3.0, metadata={"group": "objective", "help": "eta of --loss lk (3.0 is speculators' value too; 0 gives plain KL)"})
    loss_decay_gamma: float | None = field(default=None, metadata={"group": "objective", "help": "Loss weight decay w_k = exp(-(k-1)/gamma) of --loss_weighting exp; default: the paper's 7/5/4 for B = 16/10/8, else (19*B + 62)/52 (a line fitted to those); --drafter dspark: w_k = exp(-k/gamma), k = 0 at the anchor's slot, and 4 (DeepSpec's) when unset"})
    dspark_ce_weight: float = field(default=0.1, metadata={"group": "objective", "help": "--loss dspark: weight of the cross-entropy on the data's tokens (DeepSpec's Qwen3-8B recipe: 0.1; 0 drops the term)"})
    dspark_l1_weight: float = field(default=0.9, metadata={"group": "objective", "help": "--loss dspark: weight of the L1 distance sum |p - q| = 2 TV between the target's and the drafter's distributions (recipe: 0.9). The loss makes the logits, drafter's and target's, --loss_chunk_size valid slots at a time, gradient included (chunked_dspark_loss)"})
    dspark_bce_weight: float = field(default=1.0, metadata={"group": "objective", "help": "--loss dspark: weight of the confidence head's BCE against the detached acceptance 1 - TV(p, q) (recipe: 1.0)"})
    # optimisation
    num_train_epochs: int = field(default=6, metadata={"group": "optimisation", "help": "Epochs over the training data"})
    max_steps: int = field(default=-1, metadata={"group": "optimisation", "help": "Optimizer steps in all, overriding --num_train_epochs; -1 (the default): --num_train_epochs sets the length"})
    per_device_batch_size: int = field(default=1, metadata={"group": "optimisation", "help": "Sequences per micro-batch per rank"})
    gradient_accumulation_steps: int = field(default=1, metadata={"group": "optimisation", "help": "Micro-batches per optimizer step"})
    optimizer: str = field(default="adamw", metadata={"group": "optimisation", "help": "adamw (every parameter) or muon (DeepSpeed's Muon on the backbone's matrices, AdamW on the rest: norm gains, DFlash2's codebooks and base kernels, DSpark's heads; docs/training.md#the-optimizer)"})
    learning_rate: float = field(default=6e-4, metadata={"group": "optimisation", "help": "Peak learning rate; with --optimizer muon the AdamW-equivalent rate: the norm gains take it, each matrix takes it x 0.2 x sqrt(its input width) (torch's match_rms_adamw)"})
    weight_decay: float | None = field(default=None, metadata={"group": "optimisation", "help": "Decoupled weight decay (default: 0 with adamw; 0.1 on the matrices with muon)"})
    muon_momentum: float = field(default=0.95, metadata={"group": "optimisation", "help": "--optimizer muon: Nesterov momentum of the matrices"})
    muon_adamw_weight_decay: float = field(default=0.01, metadata={"group": "optimisation", "help": "--optimizer muon: weight decay of the parameters AdamW trains beside Muon (norm gains, DFlash2's codebooks and base kernels, DSpark's heads)"})
    lr_scheduler: str = field(default="cosine", metadata={"group": "optimisation", "help": "Decay after the warmup: cosine (to 0) or linear (to 0)"})
    warmup_ratio: float = field(default=0.04, metadata={"group": "optimisation", "help": "Fraction of steps of linear warmup before the decay"})
    max_grad_norm: float | None = field(default=None, metadata={"group": "optimisation", "help": "Gradient clipping norm; 0: no clipping, and DeepSpeed (ZeRO 1/2) skips the gradient norm and its per-step waits for the GPU. With muon the raw gradient is clipped before Muon folds it into its momentum, as speculators does (ZeRO-2, one micro-batch per step) (default: 1.0 with adamw; 0 with muon)"})
    seed: int = field(default=0, metadata={"group": "optimisation", "help": "Seed for data order, anchors and init"})
    batch_order: str = field(default="length_grouped", metadata={"group": "optimisation", "help": "How each epoch's samples form micro-batches: length_grouped (similar lengths together: little padding) or random (a fresh random mix each epoch, as packed trainers draw; more padding unless --pad_to_multiple_of already fixes the shape)"})
    deepspeed_config: str = field(default="ds_configs/zero2.json", metadata={"group": "optimisation", "help": "DeepSpeed config; 'auto' fields are filled from these settings"})
    # speed and memory
    dtype: str = field(default="auto", metadata={"group": "speed", "help": "Target and drafter compute dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32. bfloat16 trains ~1.4x faster than float32 on a CPU with AVX512-BF16"})
    attention_backend: str = field(default="auto", metadata={"group": "speed", "help": "flex | sdpa | auto (flex on CUDA, sdpa on CPU)"})
    compile_drafter: str = field(default="auto", metadata={"group": "speed", "help": "torch.compile the drafter's layers and the loss's chunks, each new shape once under the compile lock: on | off | auto (on with flex, i.e. on CUDA; 92.4 -> 70.2 ms/sample at Qwen3-8B shapes)"})
    compile_target: str = field(default="auto", metadata={"group": "speed", "help": "torch.compile the target's decoder layers for the feature forward (each new shape compiles once, under the compile lock; a target kept whole for evaluation decodes eagerly): on | off | auto (on with flex, i.e. on CUDA)"})
    target_cuda_graphs: bool = field(default=False, metadata={"group": "speed", "help": "Replay the target's feature forward from CUDA graphs, one per batch shape (GPU; sdpa or eager attention): one launch instead of one per kernel, for small targets whose step is bound by kernel launches"})
    cache_target_outputs: bool = field(default=False, metadata={"group": "speed", "help": "Keep each sample's context features (and target_argmax labels) on the device after the first epoch, so later epochs skip the target; colocated only; costs tokens x layers x hidden x 2 bytes (docs/training.md#where-the-time-goes-and-the-levers)"})
    loss_chunk_size: int = field(default=4096, metadata={"group": "speed", "help": "Rows per LM-head + loss chunk (bounds logits memory; DSpark's loss too)"})
    fused_loss: str = field(default="none", metadata={"group": "speed", "help": "LM head + CE through a library's fused kernel: none (the chunked kernels of dflash_loss_kernels.py), liger (Liger Kernel, pip install liger-kernel) or cce (Cut Cross-Entropy, pip install cut-cross-entropy; bf16 only); --loss ce only; CUDA only: elsewhere the reference runs, with one log line (docs/training.md#where-the-time-goes-and-the-levers)"})
    context_chunk_size: int = field(default=0, metadata={"group": "speed", "help": "Long samples: the context's projection and K/V in chunks of this many positions under activation checkpointing (0 = one piece); the same loss, less memory (docs/training.md#long-samples)"})
    checkpoint_drafter_layers: bool = field(default=False, metadata={"group": "speed", "help": "Long samples: activation checkpointing of the drafter's layers; the same loss, ~1-2 GB less per layer at Qwen3-8B shapes for ~17 per cent more drafter time (docs/training.md#long-samples)"})
    pad_to_multiple_of: int | None = field(default=None, metadata={"group": "speed", "help": "Pad sequence lengths to a multiple of this (default 128 with flex, so few shapes compile; 8 with sdpa)"})
    anchor_slots_multiple: int = field(default=0, metadata={"group": "speed", "help": "Trim each micro-batch's anchor slots to its rows' most eligible positions, rounded up to a multiple of this (0 = always --num_anchors slots), grouping batches by assistant length; the same loss, less padding"})
    compile_cache: str = field(default="shared", metadata={"group": "speed", "help": "shared: all ranks of the node share one inductor cache (one compiles, the others load); per_rank: a cache dir per rank under one root"})
    compile_cache_dir: str | None = field(default=None, metadata={"group": "speed", "help": "Compile cache root on a node-local disk (default $TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_$USER); the compile lock lives here"})
    compile_threads: int | None = field(default=None, metadata={"group": "speed", "help": "Inductor compile workers per rank (default: cores / ranks on the node)"})
    profile_steps: int = field(default=0, metadata={"group": "speed", "help": "Profile this many optimizer steps after the first 20 (torch.profiler, on the lead): {output_dir}/profile.txt and profile_trace.json"})
    # topology (docs/topology.md)
    target_ranks: str = field(default="0", metadata={"group": "topology", "help": "On every node, local ranks [0, N) only run the target and send context features to the node's other ranks, which train the drafter: 0 = colocated (every rank does both), N (per node), or auto (time both sides on a few batches, pick N)"})
    sequence_parallel_size: int | None = field(default=None, metadata={"group": "topology", "help": "Drafter ranks that train one sample together (DeepSpeed Ulysses); default: the accelerate config's parallelism_config_sp_size, else 1; it must divide each node's drafter ranks, the heads and --num_anchors (docs/training.md#sequence-parallelism)"})
    target_tp_size: int = field(default=1, metadata={"group": "topology", "help": "Target ranks of one node sharing one copy of the target, split by DeepSpeed AutoTP, for a target too large for one device; --target_ranks must be a multiple of it (1 = a whole copy each)"})
    prefetch_batches: int = field(default=2, metadata={"group": "topology", "help": "Micro-batches kept ready ahead of training: collated in a worker thread (colocated); made and not yet sent, or received and not yet trained (split mode)"})
    liveness_timeout_s: float = field(default=40.0, metadata={"group": "topology", "help": "Seconds without a heartbeat from a rank before the others stop the run as failed (more than one process)"})
    # held-out acceptance length (real speculative decoding with the full target)
    eval_data: str | None = field(default=None, metadata={"group": "evaluation", "help": "Prompt file for tau evaluation (question / messages / turns / prompt JSONL); never trained on (default: none, no held-out tau)"})
    eval_steps: int = field(default=0, metadata={"group": "evaluation", "help": "Measure tau on --eval_data every N optimizer steps (0 = only at the end)"})
    eval_num_prompts: int = field(default=20, metadata={"group": "evaluation", "help": "Prompts used for each tau evaluation"})
    eval_max_new_tokens: int = field(default=256, metadata={"group": "evaluation", "help": "Tokens generated per prompt in tau evaluation"})
    eval_prompt_lookup: bool = field(default=False, metadata={"group": "evaluation", "help": "Also decode the held-out prompts with transformers' prompt lookup at each evaluation: the baseline's tau beside the drafter's in the log and the model card"})
    # output, checkpoints and the Hub
    output_dir: str = field(default="outputs/dflash", metadata={"group": "output", "help": "Checkpoints, final export and logs go here"})
    overwrite_output_dir: bool = field(default=False, metadata={"group": "output", "help": "Start fresh in an --output_dir that holds an earlier run (its checkpoints, log, and eval.json and eval_acceptance.png of the evaluation its closing line suggests are deleted)"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"group": "output", "help": "'latest' (the newest checkpoint-{step} in --output_dir; where there is none, a warning and a fresh run; on a run that has finished, a note and nothing else) or a checkpoint-{step} path (default: none, a fresh run)"})
    save_steps: int = field(default=500, metadata={"group": "output", "help": "Write {output_dir}/checkpoint-{step} every N optimizer steps (0 = never)"})
    save_total_limit: int | None = field(default=3, metadata={"group": "output", "help": "Keep at most this many checkpoints (oldest deleted)"})
    logging_steps: int = field(default=10, metadata={"group": "output", "help": "Log scalars every N optimizer steps"})
    report_to: str = field(default="tensorboard", metadata={"group": "output", "help": "Tracker for scalars: tensorboard, wandb, none, ..."})
    push_to_hub: bool = field(default=False, metadata={"group": "output", "help": "Upload {output_dir}/final to the Hub at the end"})
    hub_model_id: str | None = field(default=None, metadata={"group": "output", "help": "Hub repo for --push_to_hub, e.g. me/qwen3-8b-dflash (default: none)"})
    hub_private: bool = field(default=False, metadata={"group": "output", "help": "Create the Hub repo private"})
    hub_revision: str | None = field(default=None, metadata={"group": "output", "help": "Branch of the Hub repo to push to (created if missing; default: main)"})
    # fmt: on

    def __post_init__(self):
        if self.target_model is None:
            raise ValueError(
                "--target_model is not set: pass a local dir or hub id, or --config FILE.yaml "
                "(--config configs/demo.yaml is the offline demo; no arguments at all runs it too)"
            )
        if self.chat_template_kwargs:
            try:
                if not isinstance(json.loads(self.chat_template_kwargs), dict):
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"--chat_template_kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}'; got {self.chat_template_kwargs!r}"
                ) from None
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        for name in ("compile_drafter", "compile_target"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ValueError(f"--{name} must be on, off or auto, got {getattr(self, name)!r}")
        if self.label_source not in ("data", "target_argmax"):
            raise ValueError(f"--label_source must be data or target_argmax, got {self.label_source!r}")
        if self.label_source == "target_argmax" and self.target_tp_size > 1:
            raise ValueError(
                "--label_source target_argmax needs the target's whole LM head on each target rank; "
                "tensor parallelism (--target_tp_size > 1) splits it. Use --label_source data, or --target_tp_size 1 "
                "if one rank holds the whole target"
            )
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"--attention_backend must be flex, sdpa or auto, got {self.attention_backend!r}")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (e.g. your-name/qwen3-8b-dflash)")
        if not self.train_data:
            raise ValueError("--train_data is empty: pass one or more JSONL/JSON files or dataset dirs")
        self.target_ranks = str(self.target_ranks).strip().lower()  # YAML may give an int
        if self.target_ranks != "auto" and not self.target_ranks.isdigit():
            raise ValueError(f"--target_ranks must be a number of ranks (0 = colocated) or 'auto', got {self.target_ranks!r}")
        if self.cache_target_outputs and self.target_ranks != "0":
            raise ValueError(
                f"--cache_target_outputs keeps the target's outputs on the rank that trains on them: it needs "
                f"colocated ranks (--target_ranks 0), got --target_ranks {self.target_ranks}; "
                f"use --target_ranks 0, or leave --cache_target_outputs off"
            )
        if self.sequence_parallel_size is None:  # accelerate's ParallelismConfig reads the launch config's sp size
            config = ParallelismConfig()
            if config.sp_size > 1 and config.sp_backend != "deepspeed":
                raise ValueError(
                    f"the accelerate config's parallelism_config_sp_backend is {config.sp_backend!r}: sequence "
                    "parallelism here is DeepSpeed's Ulysses; set it to deepspeed"
                )
            self.sequence_parallel_size = config.sp_size
        if self.sequence_parallel_size < 1:
            raise ValueError(
                f"--sequence_parallel_size must be >= 1 (1 = each drafter rank trains its own samples), got {self.sequence_parallel_size}"
            )
        if self.sequence_parallel_size > 1:
            sp = self.sequence_parallel_size
            if self.target_ranks == "auto":
                raise ValueError(
                    f"--target_ranks auto times a drafter rank alone; with --sequence_parallel_size {sp} "
                    "pass a number of target ranks (0 = colocated)"
                )
            for name in ("num_anchors", "anchor_slots_multiple"):
                if getattr(self, name) % sp:
                    raise ValueError(
                        f"--{name} {getattr(self, name)} must be a multiple of --sequence_parallel_size {sp}: "
                        f"each rank of a group trains 1/{sp} of a sample's anchor slots"
                    )
        if self.loss is None:
            self.loss = "dspark" if self.drafter == "dspark" else "ce"
        if self.enable_confidence_head is None:  # None in the field: a default of true would add a --no_ flag
            self.enable_confidence_head = True
        self.check_dspark()
        if self.target_tp_size < 1:
            raise ValueError(f"--target_tp_size must be >= 1 (ranks sharing one copy of the target), got {self.target_tp_size}")
        if self.liveness_timeout_s < 5:
            raise ValueError(f"--liveness_timeout_s must be >= 5 (heartbeats come every 2 s), got {self.liveness_timeout_s}")
        for name in (
            "num_anchors",
            "per_device_batch_size",
            "gradient_accumulation_steps",
            "max_seq_length",
            "prefetch_batches",
            "eval_num_prompts",
            "eval_max_new_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps != -1 and self.max_steps < 1:
            raise ValueError(f"--max_steps must be >= 1, or -1 to let --num_train_epochs set the length; got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs < 1:
            raise ValueError(
                f"--num_train_epochs must be >= 1, got {self.num_train_epochs}; or pass --max_steps for a run of so many optimizer steps"
            )
        if self.context_chunk_size < 0:
            raise ValueError(f"--context_chunk_size must be >= 0 (0 = the context in one piece), got {self.context_chunk_size}")
        if self.loss_chunk_size < 1:
            raise ValueError(f"--loss_chunk_size must be >= 1 (rows per LM-head + loss chunk; default 4096), got {self.loss_chunk_size}")
        if self.anchor_slots_multiple < 0:
            raise ValueError(f"--anchor_slots_multiple must be >= 0 (0 = always --num_anchors slots), got {self.anchor_slots_multiple}")
        if self.anchor_sampling == "pooled" and self.anchor_slots_multiple:
            raise ValueError(
                f"--anchor_sampling pooled keeps 2 x --num_anchors slots per sequence; --anchor_slots_multiple "
                f"{self.anchor_slots_multiple} trims per-sequence draws only: pass --anchor_slots_multiple 0"
            )
        if self.block_size < 2:
            raise ValueError(f"--block_size must be >= 2 (an anchor plus at least one drafted token), got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"--sliding_window must be >= 1 (a query always sees itself), got {self.sliding_window}")
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ValueError(f"--loss_decay_gamma must be > 0, got {self.loss_decay_gamma}")
        for name, choices in (
            ("loss", (*LOSSES, "dspark")),
            ("loss_weighting", LOSS_WEIGHTINGS),
            ("loss_normalize", LOSS_NORMALIZERS),
            ("batch_order", BATCH_ORDERS),
            ("anchor_sampling", ANCHOR_SAMPLINGS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"--dpace_alpha must be between 0 and 1, got {self.dpace_alpha}")
        if self.lk_eta < 0:
            raise ValueError(f"--lk_eta must be >= 0 (0 gives plain KL), got {self.lk_eta}")
        check_fused_loss(self.fused_loss, self.loss, self.dtype)
        if not 0 <= self.max_dropped_fraction <= 1:
            raise ValueError(f"--max_dropped_fraction must be between 0 and 1, got {self.max_dropped_fraction}")
        # Checked here, not by AdamW after the target loaded (its message names no flag); nan fails every comparison.
        if not (0 < self.learning_rate < math.inf):
            raise ValueError(f"--learning_rate must be a number > 0, got {self.learning_rate}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"--lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}")
        muon = self.optimizer == "muon"
        if muon and self.max_grad_norm and self.gradient_accumulation_steps > 1:
            # clip_gradient_before_muon takes the norm when ZeRO-2 flattens the step's gradient; with several
            # micro-batches a step, part of it is then still in DeepSpeed's accumulation buffers.
            raise ValueError(
                f"--max_grad_norm {self.max_grad_norm} with --optimizer muon clips the gradient of one micro-batch a step: "
                f"pass --gradient_accumulation_steps 1 (now {self.gradient_accumulation_steps}) with a larger "
                "--per_device_batch_size, or --max_grad_norm 0"
            )
        if self.weight_decay is None:
            self.weight_decay = 0.1 if muon else 0.0
        if self.max_grad_norm is None:
            self.max_grad_norm = 0.0 if muon else 1.0
        for name in ("weight_decay", "max_grad_norm", "muon_adamw_weight_decay"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"--{name} must be a number >= 0, got {getattr(self, name)}")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"--muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"--warmup_ratio must be between 0 and 1, got {self.warmup_ratio}")

    def check_dspark(self) -> None:
        """Refuse, in one line each, what --drafter dspark does not train yet (or --loss dspark without it)."""
        if self.drafter != "dspark":
            if self.loss == "dspark":
                raise ValueError("--loss dspark is DSpark's objective: pass --drafter dspark, or another --loss")
            return
        if self.loss != "dspark":
            raise ValueError(
                f"--drafter dspark trains with its own objective (--loss dspark, weighted by --dspark_ce_weight, "
                f"--dspark_l1_weight, --dspark_bce_weight), got --loss {self.loss}: leave --loss out"
            )
        refused = (
            (self.target_ranks != "0", f"split mode (--target_ranks {self.target_ranks}); use --target_ranks 0 (colocated)"),
            (self.sequence_parallel_size > 1, f"sequence parallelism (--sequence_parallel_size {self.sequence_parallel_size}); use 1"),
            (self.context_chunk_size > 0, f"--context_chunk_size {self.context_chunk_size}; use 0 (the context in one piece)"),
            (self.loss_weighting != "exp", f"--loss_weighting {self.loss_weighting}; its weights are exp(-k/gamma) (--loss_decay_gamma)"),
            (self.loss_normalize != "weights", f"--loss_normalize {self.loss_normalize}; each term is divided by its sum of weights"),
            (self.label_source != "data", f"--label_source {self.label_source}; its cross-entropy is on the data's tokens"),
        )
        for refuse, what in refused:
            if refuse:
                raise ValueError(f"--drafter dspark does not train with {what}")
        if self.markov_rank < 0:
            raise ValueError(f"--markov_rank must be >= 0 (0: no Markov head), got {self.markov_rank}; DeepSpec's recipe: 256")
        if self.enable_confidence_head and self.markov_rank == 0:
            raise ValueError(
                "--enable_confidence_head true reads the Markov features [h; W1[prev]]: pass --markov_rank > 0, or --enable_confidence_head false"
            )
        weights = (self.dspark_ce_weight, self.dspark_l1_weight, self.dspark_bce_weight if self.enable_confidence_head else 0.0)
        if not all(0 <= w < math.inf for w in weights) or not any(weights[:2]):
            raise ValueError(
                f"--dspark_ce_weight {self.dspark_ce_weight}, --dspark_l1_weight {self.dspark_l1_weight}, --dspark_bce_weight "
                f"{self.dspark_bce_weight}: each must be >= 0, and the CE or the L1 weight > 0 (recipe: 0.1, 0.9, 1.0)"
            )


def parse_settings(argv: list[str]) -> tuple[TrainSettings, str | None]:
    """Settings from `--config FILE.yaml` (or the demo config when neither --config nor
    --target_model is given) with command-line flags on top. Returns (settings, config path).

    Raises ValueError, one line, for an unknown flag or YAML key (with a "did you mean" for a
    near miss), a value of the wrong type, or a bad combination of settings.
    """
    config_path = None
    argv = [part for a in argv for part in (a.split("=", 1) if a.startswith("--config=") else [a])]
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config needs a YAML file path")
        config_path, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    elif not argv:  # no arguments at all, and only then: the offline demo
        config_path = str(DEMO_CONFIG)
    # allow_abbrev=False: a typo must not silently match a longer flag.
    parser = SettingsParser(
        TrainSettings,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
        usage="train_dflash.py [--config FILE.yaml] [--SETTING VALUE ...]",  # not 80 lines of every flag
        description="Train a DFlash drafter. Settings come from --config FILE.yaml and the flags below (flags win); "
        "with no arguments at all, the offline CPU demo (configs/demo.yaml).",
    )
    # Taken out of argv above (it fills the defaults); declared here so that --help lists it.
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=argparse.SUPPRESS,
        help="YAML file of settings (keys are the flag names below); flags given as well override it",
    )
    known = [f.name for f in fields(TrainSettings)]
    if config_path is not None:
        if not os.path.isfile(config_path):
            raise ValueError(f"--config {config_path}: no such file")
        with open(config_path) as f:
            try:
                values = yaml.safe_load(f) or {}
            except yaml.YAMLError as error:
                raise ValueError(yaml_error_line(config_path, error)) from None
        if not isinstance(values, dict):
            raise ValueError(f"{config_path}: expected settings as `name: value` lines, got a YAML {type(values).__name__}")
        unknown = sorted(set(values) - set(known))
        if unknown:
            hint = did_you_mean(unknown, known)
            raise ValueError(f"{config_path}: unknown settings {unknown}{'; ' + hint if hint else ''}; see `python train_dflash.py --help`")
        if "overwrite_output_dir" in values:
            # A config file is reused with other output dirs; deleting a finished drafter must be asked for each time.
            raise ValueError(
                f"{config_path}: overwrite_output_dir deletes the earlier run in the output dir, so it is "
                "a command-line flag only: remove it from the file and pass --overwrite_output_dir where you mean it"
            )
        parser.set_defaults(**check_yaml_values(values, TrainSettings, config_path))  # the YAML replaces the defaults; flags still win
    settings, unknown_flags = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown_flags:
        hint = did_you_mean([a for a in unknown_flags if a.startswith("-")], known, prefix="--")
        raise ValueError(f"unknown command-line arguments {unknown_flags}{': ' + hint if hint else ''}; see `python train_dflash.py --help`")
    if (
        config_path is not None
        and Path(config_path).resolve() == DEMO_CONFIG
        and os.path.normpath(settings.output_dir) == os.path.normpath(values["output_dir"])
    ):
        settings.overwrite_output_dir = True  # the demo starts over, but only in its own folder (outputs/demo)
    # Local data paths are checked here, before any model loads; Hub ids ("org/name") are checked
    # when they load.
    for flag, paths in (("--train_data", settings.train_data), ("--eval_data", [settings.eval_data] if settings.eval_data else [])):
        for path in paths:
            local = str(path).endswith((".jsonl", ".json", ".parquet")) or str(path).startswith((".", "/", "~"))
            if local and not os.path.exists(os.path.expanduser(path)) and not (REPO_DIR / path).exists():
                raise ValueError(f"{flag} {path}: no such file or folder")
    # The output folder (or the nearest part of its path that exists) must be a folder: made later, it would fail late.
    existing = next(
        p for p in [Path(settings.output_dir).expanduser().absolute(), *Path(settings.output_dir).expanduser().absolute().parents] if p.exists()
    )
    if not existing.is_dir():
        raise ValueError(f"--output_dir {settings.output_dir}: {existing} is a file, not a folder; pass a folder (it is made if missing)")
    # A file written and removed there: permission bits say nothing for root, nor about a read-only filesystem.
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(
            f"--output_dir {settings.output_dir}: cannot write in {existing} ({error.strerror}); pass a folder "
            f"you can write to, or make {existing} writable"
        ) from None
    return settings, config_path


ModuleSettings = TypeVar("ModuleSettings")


def settings_for(kind: type[ModuleSettings], settings: TrainSettings) -> ModuleSettings:
    """What a module below takes of the settings: `kind`, a dataclass of that module's
    (`dflash_schedule.ScheduleSettings`, ...), filled with the fields of `settings` of the same names.
    They are resolved by now (`__post_init__`): a field that is None here only until then (such as
    sequence_parallel_size) is declared there with its resolved type."""
    return kind(**{f.name: getattr(settings, f.name) for f in fields(kind)})


# ----------------------------------------------------------------------------------------------
# The run, phase by phase: settings -> distributed setup -> target and drafter configs -> data ->
# resume point -> topology (what each rank loads, colocated or split, auto) -> target and drafter ->
# target ranks serve features, drafter ranks: DeepSpeed -> the loop -> final evaluation, export, push.
# Each phase is a function of what the earlier ones returned; `main` at the bottom calls them in order.


@dataclass(frozen=True)
class Compute:
    """How the drafter and the target run, resolved from the settings and the device (`resolve_compute`)."""

    backend: str  # attention of the training forward: "flex" or "sdpa"
    pad_multiple: int  # sequence lengths are padded to a multiple of this (few shapes to compile)
    compile_drafter: bool
    compile_target: bool
    dtype: torch.dtype  # target and drafter parameters
    on_cuda: bool
    fused_loss: str = "none"  # --fused_loss as it runs on this device (`resolve_fused_loss`: "none" off CUDA)


@dataclass
class TrainData:
    """The tokenized training set and the held-out prompts (`load_data`)."""

    dataset: object  # datasets.Dataset with input_ids, loss_mask, num_tokens, num_loss_tokens
    lengths: list[int]  # what batches are grouped by: tokens per sample, or assistant tokens with --anchor_slots_multiple
    eval_prompts: list | None  # --eval_data, tokenized; None without it
    chat_kwargs: dict | None  # --chat_template_kwargs
    eval_prompts_in_file: int = 0  # prompts --eval_data holds in all (eval_prompts keeps --eval_num_prompts of them)


def resolve_compute(settings: TrainSettings, device: torch.device) -> Compute:
    """The attention backend, padding, what is compiled and the dtype, from the settings and the device."""
    on_cuda = torch.cuda.is_available()
    backend = settings.attention_backend
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "sdpa"
    fused_loss = resolve_fused_loss(settings.fused_loss, device)
    if fused_loss != settings.fused_loss:
        logger.info(
            "--fused_loss %s runs on CUDA only: on %s the loss runs through the reference kernels (the same loss)", settings.fused_loss, device.type
        )
    return Compute(
        backend=backend,
        # Sequence parallelism shards the padded length: a multiple of the group size.
        pad_multiple=math.lcm(settings.pad_to_multiple_of or (128 if backend == "flex" else 8), settings.sequence_parallel_size),
        compile_drafter=settings.compile_drafter == "on" or (settings.compile_drafter == "auto" and backend == "flex"),
        compile_target=settings.compile_target == "on" or (settings.compile_target == "auto" and backend == "flex"),
        dtype={"auto": torch.bfloat16 if on_cuda else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype],
        on_cuda=on_cuda,
        fused_loss=fused_loss,
    )


def build_draft_config(settings: TrainSettings, target_config, tokenizer, compute: Compute) -> DFlashConfig:
    """The drafter's config, sized after the target's (seconds: no weights loaded yet), logged."""
    vocab_rows = target_config.get_text_config().vocab_size  # rows of the target's embedding
    mask_token_id = resolve_mask_token_id(tokenizer, vocab_rows, settings.mask_token_id, settings.mask_token)
    draft_config = drafter_config_for_target(
        target_config,
        mask_token_id=mask_token_id,
        num_draft_layers=settings.num_draft_layers,
        block_size=settings.block_size,
        target_layer_ids=settings.target_layer_ids,
        vocab_size=vocab_rows,
        layer_types=settings.layer_types,
        sliding_window=settings.sliding_window,
        is_causal=settings.is_causal,
        intermediate_size=settings.draft_intermediate_size,
        num_attention_heads=settings.draft_num_attention_heads,
        num_key_value_heads=settings.draft_num_key_value_heads,
        head_dim=settings.draft_head_dim,
        drafter=settings.drafter,
        conv_kernel_size=settings.conv_kernel_size,
        conv_group_size=settings.conv_group_size,
        selector_rank=settings.selector_rank,
        selector_top_k=settings.selector_top_k,
        **(
            dict(markov_rank=settings.markov_rank, enable_confidence_head=settings.enable_confidence_head, num_anchors=settings.num_anchors)
            if settings.drafter == "dspark"
            else {}
        ),
    )
    if settings.sliding_window is not None and "sliding_attention" not in draft_config.layer_types:
        logger.warning("--sliding_window %d has no effect: every drafter layer is full attention (set --layer_types)", settings.sliding_window)
    logger.info(
        "Target %s: %d layers, hidden %d; drafter reads layers %s, mask token %d, block size %d, labels %s, backend %s, compiled drafter %s",
        settings.target_model,
        draft_config.num_target_layers,
        draft_config.hidden_size,
        draft_config.target_layer_ids,
        mask_token_id,
        draft_config.block_size,
        settings.label_source,
        compute.backend,
        compute.compile_drafter,
    )
    logger.info(
        "Drafter: %d layers %s%s; heads %d / %d KV x %d, MLP %d; target scaling %s",
        draft_config.num_hidden_layers,
        draft_config.layer_types,
        f", window {draft_config.sliding_window}" if draft_config.sliding_window else "",
        draft_config.num_attention_heads,
        draft_config.num_key_value_heads,
        draft_config.head_dim,
        draft_config.intermediate_size,
        {k: v for k, v in draft_config.dflash_config.items() if k not in ("mask_token_id", "target_layer_ids")} or "none",
    )
    if isinstance(draft_config, DSparkConfig):
        logger.info(
            "DSpark: block size %d = drafts per block (the anchor's slot is the first prediction slot; %d tokens verified), "
            "Markov head rank %d, confidence head %s",
            draft_config.block_size,
            draft_config.block_size + 1,
            draft_config.markov_rank,
            "on" if draft_config.enable_confidence_head else "off",
        )
    return draft_config


def fixed_loss_weights(settings: TrainSettings, block_size: int, device: torch.device) -> torch.Tensor | None:
    """The fixed per-position loss weights [B-1] float32 of --loss_decay_gamma (default: by the
    drafter's block size B), or None with D-PACE (its weights come from each block's confidence)
    and with DSpark (`chunked_dspark_loss` weighs its slots); logged."""
    if settings.drafter == "dspark":
        logger.info(
            "DSpark objective: %g CE + %g L1 + %g BCE, slot weights exp(-k/%g) from the anchor's slot, each term over its sum of weights",
            settings.dspark_ce_weight,
            settings.dspark_l1_weight,
            settings.dspark_bce_weight if settings.enable_confidence_head else 0.0,
            settings.loss_decay_gamma or DSPARK_LOSS_GAMMA,
        )
        return None  # chunked_dspark_loss weighs the slots itself
    objective = f"--loss {settings.loss}, normalised by the {'sum of weights' if settings.loss_normalize == 'weights' else 'valid positions'}"
    if settings.loss_weighting == "dpace":
        logger.info("Loss weights D-PACE (alpha %.2f); %s", settings.dpace_alpha, objective)
        return None
    gamma = settings.loss_decay_gamma or default_loss_gamma(block_size)
    logger.info(
        "Loss weights exp(-(k-1)/gamma), gamma %.2f (%s); %s",
        gamma,
        "--loss_decay_gamma"
        if settings.loss_decay_gamma
        else "the paper's value for this block size"
        if block_size in DEFAULT_LOSS_GAMMA
        else "(19*B + 62)/52, fitted to the paper's values",
        objective,
    )
    return loss_weights(block_size, gamma, device=device)


def sequence_parallel_share(
    loss: torch.Tensor, accepted: torch.Tensor, row_weights: torch.Tensor, label_valid: torch.Tensor, normalize: str, sp: SequenceParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (loss, accepted) of its shard of a sample turned into its share of the whole
    sample's: the loss over the sample's normaliser instead of the shard's, times the group size;
    accepted, the sample's. One all-reduce over the group (of detached figures).

    DeepSpeed averages gradients over all drafter ranks, so each rank's loss is
    P * (shard's weighted sum) / (sample's normaliser): the mean over the P ranks of a group is the
    sample's loss (what SP=1 gives), its gradient the sample's gradient, and the run's logged
    loss, a mean over drafter ranks, the mean over samples.

    Args:
        loss: scalar float32, `weighted_block_loss`'s over this rank's rows (normalised by them).
        accepted: [B-1] float32, its share of blocks accepted through each position (NaN: none).
        row_weights: [T] float32, its rows' weights (`weighted_block_loss(..., return_row_weights=True)`).
        label_valid: [batch, N/P, B-1] bool, this rank's valid labels.
        normalize: "weights" (the sum of weights) or "count" (valid rows), as `weighted_block_loss`'s.
    Returns:
        (loss: scalar, accepted: [B-1]), the same accepted on every rank of the group.
    """
    own_norm = row_weights.sum() if normalize == "weights" else torch.tensor(float(row_weights.numel()), device=loss.device)
    blocks = label_valid.sum(dim=(0, 1)).float()  # [B-1], blocks with a label at each position
    stats = torch.cat([own_norm.reshape(1).float(), torch.nan_to_num(accepted) * blocks, blocks])  # [1 + 2 (B-1)]
    torch.distributed.all_reduce(stats, group=sp.group)
    positions = accepted.shape[0]
    total_norm, hits, all_blocks = stats[0], stats[1 : 1 + positions], stats[1 + positions :]
    # A shard (or sample) without a valid row has loss 0 and norm 0: it stays 0.
    share = loss * (sp.size * own_norm / total_norm.clamp(min=torch.finfo(torch.float32).tiny))
    return share, hits / all_blocks


@dataclass(frozen=True)
class MicroBatchLoss:
    """The loss of one micro-batch: anchors, the drafter forward, labels, the weighted CE (`weighted_block_loss`).
    Used by the training loop and by the --target_ranks auto calibration."""

    settings: TrainSettings
    draft_config: DFlashConfig
    compute: Compute
    weights: torch.Tensor | None  # [B-1] float32, `fixed_loss_weights`; None with D-PACE
    lm_head: torch.nn.Module | None  # the target's (frozen); None on a rank that trains nothing
    slots_used: list[int] = field(default_factory=list)  # anchor slots per micro-batch since the last log (--anchor_slots_multiple)
    sequence_parallel: SequenceParallel | None = None  # this rank's group with --sequence_parallel_size > 1

    def __call__(self, model, context_features, input_ids, loss_mask, label_ids, anchor_key: tuple):
        """(loss, accepted [B-1]: `weighted_block_loss`'s share of blocks right through each position) of one
        micro-batch. model: the DeepSpeed engine or the bare drafter; context_features [batch, S,
        n*hidden], followed by the target's last hidden state [batch, S, hidden] for a distribution
        loss; input_ids and label_ids [batch, S] (`target_features`); loss_mask [batch, S] on the
        host or the device. Anchors are drawn afresh for every anchor_key = (seed, epoch, micro-step,
        drafter rank): re-sampled every epoch, reproducible on resume.

        With sequence parallelism every rank of the group passes the same micro-batch and anchor_key
        (the group's): the anchors are drawn for the whole sample, the drafter computes this rank's
        shard of them, and the loss is this rank's share (`sequence_parallel_share`)."""
        settings, config, device, sp = self.settings, self.draft_config, input_ids.device, self.sequence_parallel
        target_hidden = None
        if settings.loss != "ce":  # the target's last hidden state follows the context features (`target_features`)
            width = len(config.target_layer_ids) * config.hidden_size
            context_features, target_hidden = context_features[..., :width], context_features[..., width:]  # views
        generator = torch.Generator().manual_seed(hash(anchor_key) % 2**63)
        num_anchors = settings.num_anchors
        if settings.anchor_slots_multiple:
            num_anchors = anchor_slots(loss_mask, num_anchors, settings.anchor_slots_multiple)
            self.slots_used.append(num_anchors)
        # Anchors and the valid label rows are found where the loss mask is: colocated on a GPU that is
        # the host, so the step never waits for the GPU to learn how many rows its loss has.
        anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, generator, pooled=settings.anchor_sampling == "pooled")
        own = (anchors, anchor_valid) if sp is None else (sp.shard(anchors), sp.shard(anchor_valid))  # the anchors this rank trains
        dspark = isinstance(config, DSparkConfig)
        label_valid = block_label_valid(loss_mask, *own, config.block_size + dspark)  # [batch, N, B-1]; DSpark: [batch, N, gamma]
        if dspark:  # `dspark_block_labels`' validity: a prefix, cut at the first hole
            label_valid = label_valid.to(torch.int32).cumprod(dim=-1).bool()
        valid_index = label_valid.nonzero()  # [T, 3]
        loss_mask, anchors, anchor_valid, valid_index = (to_device(t, device) for t in (loss_mask, anchors, anchor_valid, valid_index))
        hidden = model(
            context_features, input_ids, anchors, anchor_valid, attention_backend=self.compute.backend, sequence_parallel=sp
        )  # [batch, N, B, hidden], or [batch, N/P, B, hidden]: this rank's anchors
        if dspark:  # colocated, one rank per sample (TrainSettings.check_dspark)
            drafter = getattr(model, "module", model)
            return self.dspark_objective(drafter, hidden, input_ids, loss_mask, anchors, anchor_valid, target_hidden, valid_index)
        if sp is not None:
            anchors, anchor_valid = sp.shard(anchors), sp.shard(anchor_valid)
        labels, label_valid = block_labels(label_ids, loss_mask, anchors, anchor_valid, config.block_size)
        dflash2 = isinstance(config, DFlash2Config)  # its selector trains on the true previous tokens (teacher forcing)
        predecessor_ids = selector_predecessor_ids(input_ids, anchors, config.block_size) if dflash2 else None
        # The target's distribution over label k of a block comes from its logits one position earlier.
        target_rows = block_target_hidden(target_hidden, anchors, config.block_size) if settings.loss != "ce" else None
        loss, accepted, *extra = weighted_block_loss(
            hidden[:, :, 1:],
            self.lm_head.weight,
            labels,
            label_valid,
            self.weights,
            chunk_size=settings.loss_chunk_size,
            compiled=self.compute.compile_drafter,
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping,
            valid_index=valid_index,
            loss=settings.loss,
            target_hidden=target_rows,
            loss_weighting=settings.loss_weighting,
            dpace_alpha=settings.dpace_alpha,
            normalize=settings.loss_normalize,
            lk_eta=settings.lk_eta,
            return_row_weights=dflash2 or sp is not None,
            fused_loss=self.compute.fused_loss,
            top_k=config.selector_top_k if dflash2 else 0,  # the selector's candidates, from the loss's own logits
        )
        row_weights, candidate_ids = (extra + [None, None])[:2]  # [T] float32 (DFlash2 or SP), [T, K] int64 (DFlash2)
        if not dflash2:
            return sequence_parallel_share(loss, accepted, row_weights, label_valid, settings.loss_normalize, sp) if sp else (loss, accepted)
        # DFlash2 drafts through its candidate selector: its K-way loss joins with weight 1.0, weighted
        # and normalised as the drafter's loss (D-PACE from the drafter's confidences, as speculators
        # does), and its path's hits are what the log's tau estimate counts.
        selector = getattr(model, "module", model).candidate_selector  # the DeepSpeed engine wraps the drafter
        selector_loss, accepted = selector_objective(
            selector,
            config.selector_top_k,
            hidden[:, :, 1:],
            self.lm_head.weight,
            labels,
            label_valid,
            predecessor_ids,
            row_weights,
            chunk_size=settings.loss_chunk_size,
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping,
            valid_index=valid_index,
            normalize=settings.loss_normalize,
            candidate_ids=candidate_ids,
        )
        if sp is not None:  # both losses have the same normaliser
            return sequence_parallel_share(loss + selector_loss, accepted, row_weights, label_valid, settings.loss_normalize, sp)
        return loss + selector_loss, accepted

    def dspark_objective(
        self, drafter, hidden, input_ids, loss_mask, anchors, anchor_valid, target_hidden, valid_index
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, accepted [gamma]) of a DSpark drafter's micro-batch: `chunked_dspark_loss` on the
        teacher-forced logits with the Markov term (predecessors: the data's tokens, `markov_predecessor_ids`),
        the confidence logits, the labels of `dspark_block_labels`, and the target's distribution at each
        slot (its last hidden state at position a + k through the LM head). accepted: at slot k, the
        share of blocks with a label there whose teacher-forced greedy drafts are right through k.

        drafter: the bare `DSparkDraftModel`; hidden [batch, N, gamma, hidden] from its forward;
        input_ids [batch, S]; loss_mask [batch, S] on the device; anchors, anchor_valid [batch, N];
        target_hidden [batch, S, hidden]; valid_index [T, 3] int64, the valid slots (found on the host).
        The logits, the drafter's and the target's, exist --loss_chunk_size valid rows at a time."""
        settings, config = self.settings, self.draft_config
        gamma = config.block_size
        labels, label_valid = dspark_block_labels(input_ids, loss_mask, anchors, anchor_valid, gamma)  # [batch, N, gamma] each
        predecessors = markov_predecessor_ids(input_ids, anchors, gamma)  # [batch, N, gamma]
        confidence = drafter.confidence_logits(hidden, predecessors) if drafter.confidence_head is not None else None
        markov = drafter.markov_head
        loss, _, accepted = chunked_dspark_loss(
            hidden,
            predecessors,
            drafter.target_lm_head.weight,
            labels,
            label_valid,
            block_target_hidden(target_hidden, anchors, gamma + 1),  # slot k's p: the target at a + k (a DFlash block of gamma + 1)
            confidence,
            markov_w1=None if markov is None else markov.markov_w1.weight,
            markov_w2=None if markov is None else markov.markov_w2.weight,
            ce_weight=settings.dspark_ce_weight,
            l1_weight=settings.dspark_l1_weight,
            confidence_weight=settings.dspark_bce_weight,
            gamma=settings.loss_decay_gamma or DSPARK_LOSS_GAMMA,
            chunk_size=settings.loss_chunk_size,
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping,
            valid_index=valid_index,
            compiled=self.compute.compile_drafter,  # as DFlash's weighted_block_loss: with the drafter's layers
        )
        return loss, accepted

    def take_mean_anchor_slots(self) -> float | None:
        """Mean anchor slots per micro-batch of this rank since the last call (which it resets); None
        when nothing was trimmed (--anchor_slots_multiple 0)."""
        if not self.slots_used:
            return None
        mean = sum(self.slots_used) / len(self.slots_used)
        self.slots_used.clear()
        return mean


def load_data(settings: TrainSettings, tokenizer, accelerator: Accelerator) -> TrainData:
    """Tokenize (and check) the training data, each node's first rank first; load the held-out prompts."""
    chat_kwargs = json.loads(settings.chat_template_kwargs) if settings.chat_template_kwargs else None
    train_files = [p if os.path.exists(p) or not (REPO_DIR / p).exists() else str(REPO_DIR / p) for p in settings.train_data]
    with accelerator.local_main_process_first():  # each node's first rank tokenizes and caches; the others load the cache
        dataset = build_train_dataset(
            train_files,
            tokenizer,
            max_seq_length=settings.max_seq_length,
            chat_template_kwargs=chat_kwargs,
            num_proc=settings.num_proc,
            seed=settings.seed,
            skip_bad_samples=settings.skip_bad_samples,
            max_samples=settings.max_samples,
            max_dropped_fraction=settings.max_dropped_fraction,
        )
    eval_prompts, eval_prompts_in_file = None, 0
    if settings.eval_data:
        eval_file = settings.eval_data if os.path.exists(settings.eval_data) else str(REPO_DIR / settings.eval_data)
        eval_prompts = load_prompts(eval_file, tokenizer, num_prompts=settings.eval_num_prompts)
        eval_prompts_in_file = len(load_prompts(eval_file))  # for the closing command: no more prompts than the file has
    # Micro-batches group samples of similar length. With --anchor_slots_multiple, of similar assistant
    # length: that decides the anchor slots a micro-batch needs (the whole length only its padding).
    # A plain list: a datasets Column reads Arrow on every index (~0.2 ms), and every epoch's batching
    # and every step's token count index it (seconds at each epoch boundary, 35k samples). Taken as one
    # slice: list(Column) would read it index by index too (40 s against 3.7 s at 800k samples).
    lengths = dataset["num_loss_tokens" if settings.anchor_slots_multiple else "num_tokens"][:]
    return TrainData(dataset, lengths, eval_prompts, chat_kwargs, eval_prompts_in_file)


def build_drafter(settings: TrainSettings, draft_config: DFlashConfig, parts: TargetParts, compute: Compute) -> DFlashDraftModel:
    """A freshly initialised drafter (seeded), borrowing the target's embedding and LM head."""
    torch.manual_seed(settings.seed)  # the drafter's init must not depend on what this rank loaded before
    drafter_class = (
        DSparkDraftModel
        if isinstance(draft_config, DSparkConfig)
        else DFlash2DraftModel
        if isinstance(draft_config, DFlash2Config)
        else DFlashDraftModel
    )
    drafter = drafter_class(draft_config)
    drafter.attach_target(parts.embed_tokens, parts.lm_head)  # by reference, not registered
    drafter.compile_layers(compute.compile_drafter)
    drafter.chunk_context(settings.context_chunk_size)  # long samples (docs/training.md#long-samples)
    drafter.checkpoint_layers(settings.checkpoint_drafter_layers)
    return drafter


def speed_up_target(extractor: TargetFeatureExtractor | None, settings: TrainSettings, compute: Compute) -> None:
    """Compiled target layers (in the feature forward) and CUDA graphs of that forward, as configured."""
    if extractor is not None and compute.compile_target:
        extractor.compile_layers()
    if settings.target_cuda_graphs and compute.on_cuda and extractor is not None:
        extractor.use_cuda_graphs()


def resolve_deepspeed_config(settings: TrainSettings, drafter_ranks: int, bf16: bool, split: bool) -> dict:
    """Fill the 'auto' fields of the DeepSpeed config from our settings (accelerate's resolver).
    Batch sizes follow the drafter ranks (DeepSpeed's data-parallel group), not the world."""
    path = settings.deepspeed_config
    if not os.path.isabs(path) and not os.path.isfile(path):
        path = str(REPO_DIR / path)
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {settings.deepspeed_config}: no such file")
    # Muon's clipping is clip_gradient_before_muon's: DeepSpeed's would scale Muon's update, not the gradient.
    deepspeed_clip = 0.0 if settings.optimizer == "muon" else settings.max_grad_norm
    plugin = DeepSpeedPlugin(hf_ds_config=path)
    plugin.deepspeed_config_process(
        must_match=False,
        train_micro_batch_size_per_gpu=settings.per_device_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        train_batch_size=settings.per_device_batch_size * settings.gradient_accumulation_steps * drafter_ranks,
        gradient_clipping=deepspeed_clip,
        **{"bf16.enabled": bf16, "fp16.enabled": False},
    )
    config = plugin.deepspeed_config
    zero = config.get("zero_optimization", {})
    if drafter_ranks == 1 and zero.get("overlap_comm"):
        # With one drafter rank there is no communication to overlap, and ZeRO's overlap path
        # synchronizes the whole device twice per optimizer step.
        config["zero_optimization"] = {**zero, "overlap_comm": False}
    if deepspeed_clip == 0 and zero.get("stage") in (1, 2):
        # Nothing for DeepSpeed to clip: without this DeepSpeed still takes the gradient norm parameter by parameter
        # and waits for the GPU to check it, every step.
        config["zero_optimization"] = {**config["zero_optimization"], "compute_grad_norm": False}
    if split:
        # The tag check all-reduces over the whole world, target ranks included (dflash_split.py,
        # "Checkpoints in split mode"); our tag is a constant anyway.
        config["checkpoint"] = {**config.get("checkpoint", {}), "tag_validation": "Ignore"}
    return config


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Whether DeepSpeed's Muon trains `param`, by speculators' rule: a matrix (2-D, both sides > 1) whose
    name holds none of "embed", "lm_head", "codebook", "markov_head", "confidence_head". That is every
    backbone matrix; the rest go to AdamW: norm gains, DFlash2's selector codebooks and its convolutions'
    3-D base kernels, DSpark's heads. DeepSpeed's own rule (`deepspeed.set_optimizer_flags`) would take
    every weight of two or more dimensions not named embed or lm_head."""
    # Codebooks and the Markov head are vocabulary-sized embedding tables and the confidence head an output
    # head: Muon orthogonalises the update of a linear map, which these are not (speculators and DeepSpec
    # train them with AdamW). A base kernel is K per-channel taps around the identity, not one matrix.
    excluded = ("embed", "lm_head", "codebook", "markov_head", "confidence_head")
    return param.ndim == 2 and min(param.shape) > 1 and not any(key in name.lower() for key in excluded)


@contextlib.contextmanager
def muon_tags_by_our_rule():
    """While `deepspeed.initialize` runs inside it, the parameters DeepSpeed tags for Muon (`use_muon`, by
    its name rule in `deepspeed.set_optimizer_flags`, which takes no exclusions) are those `uses_muon`
    picks, the rest going to AdamW (DeepSpeed splits each group by the tag)."""
    deepspeeds_rule = deepspeed.set_optimizer_flags

    def tag(config_class, model: torch.nn.Module) -> None:
        deepspeeds_rule(config_class, model)
        for name, param in model.named_parameters():
            if getattr(param, "use_muon", False):
                param.use_muon = uses_muon(name, param)

    deepspeed.set_optimizer_flags = tag  # deepspeed.initialize looks it up in its module at each call
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = deepspeeds_rule


def muon_newton_schulz_in_fp32() -> None:
    """Make DeepSpeed's Muon run its Newton-Schulz iteration in fp32, for a drafter trained on a CPU.

    DeepSpeed 0.19.8 runs the iteration in bf16 wherever the accelerator reports bf16 support, and its CPU
    accelerator does; but a CPU without bf16 matrix units multiplies bf16 ~100x slower than fp32 (5
    iterations on a 1536 x 576 gradient: 51 s against 0.4 s on 2 cores), which made a Muon step of the
    CPU demo 20x its AdamW step (7.9 s/step in fp32, against ~100). fp32 only adds precision: the step
    still agrees with torch.optim.Muon's, which iterates in bf16 (tests/test_optimizer.py). Patched before
    the first step (the iteration is compiled, reading the dtype when it is traced)."""
    from deepspeed.runtime.zero.muon import original_muon

    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32


def clip_gradient_before_muon(zero_optimizer, max_norm: float) -> None:
    """Clip the step's gradient to a global L2 norm of `max_norm` before DeepSpeed's Muon folds it into its
    momentum, as `torch.nn.utils.clip_grad_norm_` before `torch.optim.Muon` does (speculators' order).

    ZeRO-2 computes Muon's update at the end of the backward, group by group, as it flattens each group's
    reduced gradient into this rank's partition (`get_flat_partition`); DeepSpeed's own clipping runs later,
    in step(), and would scale the orthogonalized update instead. So the norm is taken, and every group's
    gradient (Muon's matrices and AdamW's rest) scaled in place, just before the first group is flattened,
    when all of them are reduced. Each rank counts the slice of each gradient its partition owns (a Muon
    matrix split between two ranks is reduced whole on both) and the squares are summed over the drafter
    ranks. Scaling is a tensor op (no wait for the GPU). The norm before clipping is kept as
    `zero_optimizer.gradient_norm_before_clipping` (a 0-dim float32 tensor).

    Needs ZeRO stage 2 with gradients accumulated in the model's dtype, and one micro-batch per step
    (TrainSettings refuses more); raises ValueError otherwise. Patches this optimizer instance only.
    """
    ds = zero_optimizer
    groups = range(len(getattr(ds, "bit16_groups", [])))
    if not getattr(ds, "partition_gradients", False) or any(ds._use_compact_grad_partition_buffer(i) for i in groups):
        raise ValueError(
            "--max_grad_norm with --optimizer muon needs ZeRO stage 2 with gradients accumulated in the model's dtype "
            "(ds_configs/zero2.json, no data_types.grad_accum_dtype): change --deepspeed_config, or pass --max_grad_norm 0"
        )
    flatten = ds.get_flat_partition

    def owned_slice(group: int, index: int, grad: torch.Tensor) -> torch.Tensor:
        partition = deepspeed.comm.get_rank(group=ds.real_dp_process_group[group])
        param_id = ds.get_param_id(ds.params_in_partition[group][index])
        start = int(ds.grad_start_offset[group][partition][param_id])
        dest = int(ds.grad_partition_insertion_offset[group][partition][param_id])
        return grad.reshape(-1).narrow(0, start, int(min(grad.numel() - start, ds.partition_size[group] - dest)))

    def clip_then_flatten(tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list=False):
        if param_group_idx == 0:  # the first group of this step: every group's gradient is reduced by now
            grads = [ds.all_grad_tensors[0]] + [ds.get_all_grad_tensors(ds.params_in_partition[i], dtype) for i in groups[1:]]
            squares = torch.zeros((), dtype=torch.float32, device=device)
            for i in groups:
                for index, grad in enumerate(grads[i]):
                    squares += owned_slice(i, index, grad).float().pow(2).sum()
            deepspeed.comm.all_reduce(squares, group=ds.real_dp_process_group[0])
            ds.gradient_norm_before_clipping = norm = squares.sqrt()
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient
            for group_grads in grads:
                for grad in group_grads:
                    grad.mul_(scale)  # in place: the tensors the flattening reads next
        return flatten(tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list)

    ds.get_flat_partition = clip_then_flatten


def last_gradient_norm(engine) -> float | None:
    """The global L2 norm of the last optimizer step's gradient, before clipping: DeepSpeed's (AdamW with
    clipping), `clip_gradient_before_muon`'s (Muon with clipping), or None where nothing clips (no norm is
    taken then). Reading it waits for the GPU: called at logging steps only."""
    norm = getattr(engine.optimizer, "gradient_norm_before_clipping", None)
    if norm is None:
        norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def muon_param_groups(drafter: torch.nn.Module, settings: TrainSettings) -> list[dict]:
    """The drafter's parameters in groups for DeepSpeed's Muon, with learning rates that give each
    matrix the update size of torch.optim.Muon(adjust_lr_fn="match_rms_adamw") at --learning_rate.

    torch scales a [rows, cols] matrix's orthogonalized update by lr x 0.2 x sqrt(max(rows, cols));
    DeepSpeed by lr x sqrt(max(1, rows / cols)). The two agree when DeepSpeed's lr is
    lr x 0.2 x sqrt(cols): e.g. at lr 1e-3, 4.8e-3 for a matrix reading SmolLM2's 576 hidden units,
    1.07e-2 for fc reading 5 x 576. Both decay a weight by (1 - lr x weight_decay) with their own lr,
    so each group's decay is weight_decay x lr / its lr. The groups' ratios stay fixed under the
    schedule (a LambdaLR scales every group alike). The rest (`uses_muon`): AdamW at lr, decay
    --muon_adamw_weight_decay. Returns a list of {"params", "lr", "weight_decay", "name"} dicts.
    """
    groups: dict[str, dict] = {}
    for name, param in drafter.named_parameters():
        if not param.requires_grad:
            continue
        if uses_muon(name, param):
            lr = settings.learning_rate * 0.2 * math.sqrt(param.shape[-1])
            key, decay = f"muon_in{param.shape[-1]}", settings.weight_decay * settings.learning_rate / lr
        else:
            key, lr, decay = "adamw", settings.learning_rate, settings.muon_adamw_weight_decay
        groups.setdefault(key, {"params": [], "lr": lr, "weight_decay": decay, "name": key})["params"].append(param)
    return list(groups.values())


def start_deepspeed(settings: TrainSettings, drafter: DFlashDraftModel, layout, schedule: Schedule, compute: Compute, resume: ResumePoint):
    """The optimizer (AdamW, or DeepSpeed's Muon with AdamW on what `uses_muon` leaves) and its schedule
    (linear warmup, then cosine or linear decay to 0) under DeepSpeed ZeRO-2 over the drafter group;
    the resumed checkpoint's state and this rank's RNG. Returns (engine, scheduler)."""
    total_steps, warmup_steps = schedule.total_steps, math.ceil(settings.warmup_ratio * schedule.total_steps)
    decay = get_cosine_schedule_with_warmup if settings.lr_scheduler == "cosine" else get_linear_schedule_with_warmup
    ds_config = resolve_deepspeed_config(settings, layout.dp_world, bf16=compute.dtype == torch.bfloat16, split=layout.split)
    if settings.optimizer == "muon":
        # DeepSpeed builds Muon from its config (torch.optim.Muon cannot step ZeRO's flat 1-D partitions),
        # so the scheduler comes as a callable that it applies to that optimizer.
        ds_config["optimizer"] = {
            "type": "Muon",
            "params": {
                "lr": settings.learning_rate,
                "momentum": settings.muon_momentum,
                "ns_method": "standard",  # torch's Newton-Schulz
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "torch_adam": True,  # torch's AdamW on the norm gains: no fused-op build
            },
        }
        if not compute.on_cuda:
            muon_newton_schulz_in_fp32()
        with muon_tags_by_our_rule():
            engine, _, _, scheduler = deepspeed.initialize(
                model=drafter,
                model_parameters=muon_param_groups(drafter, settings),
                config=ds_config,
                mpu=DrafterGroupMPU(layout),
                lr_scheduler=lambda optimizer: decay(optimizer, warmup_steps, total_steps),
            )
        if settings.max_grad_norm:
            clip_gradient_before_muon(engine.optimizer, settings.max_grad_norm)
    else:
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
        scheduler = decay(optimizer, warmup_steps, total_steps)
        engine, _, _, scheduler = deepspeed.initialize(
            model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=DrafterGroupMPU(layout)
        )
    if resume.path:
        resume_engine(engine, resume, layout.dp_rank)
    return engine, scheduler


def warm_up_flex(
    settings: TrainSettings,
    schedule_settings: ScheduleSettings,
    draft_config: DFlashConfig,
    data: TrainData,
    layout,
    resume: ResumePoint,
    compute: Compute,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Compile flex for the first batch's shape, in the main thread, under the compile lock, before
    the feature receiver thread starts (docs/compile-safety.md). Compiled drafter layers trace flex
    into their own (locked) compiles, so then nothing is done here. Under sequence parallelism the
    layers run eagerly and flex sees every position for 1/P of the heads: that shape is warmed."""
    sp = settings.sequence_parallel_size
    if compute.backend != "flex" or (compute.compile_drafter and sp == 1):
        return
    first_batch = epoch_batches(data.lengths, schedule_settings, resume.epoch, layout.dp_world)[layout.dp_rank] or [0]
    seconds = warm_up_flex_attention(
        device,
        create_anchor_block_mask,
        batch=len(first_batch),
        heads=draft_config.num_attention_heads // sp,
        kv_heads=draft_config.num_key_value_heads // sp,
        head_dim=draft_config.head_dim,
        context_len=-(-max(data.lengths[i] for i in first_batch) // compute.pad_multiple) * compute.pad_multiple,
        num_anchors=settings.num_anchors * (2 if settings.anchor_sampling == "pooled" else 1),  # sample_anchors' slots
        block_size=draft_config.block_size,
        dtype=dtype,
        rules=tuple(draft_config.attention_rule(i) for i in range(draft_config.num_hidden_layers)),
    )
    logger.info("flex_attention ready (%.1f s compiling here); later length buckets compile on first use", seconds)


def held_out_tau(drafter: DFlashDraftModel, target, tokenizer, data: TrainData, settings: TrainSettings, layout, device: torch.device) -> dict:
    """tau on the held-out prompts (and prompt lookup's, with --eval_prompt_lookup), for the lead
    (the other drafter ranks wait at the next barrier): colocated on the lead itself, with a bar over
    the prompts on a terminal (a minute or so of decoding), in split mode on the first target group,
    which receives the weights. Verify blocks are every draft of a pass plus the anchor (DFlash: the
    drafter's B; DSpark: gamma + 1), as eval_dflash.py's default; the row records that size."""
    block_size = resolve_block_size(drafter, None)
    if layout.split:
        broadcast_drafter_weights(drafter, layout.eval_group, src=layout.rank)
        values = broadcast_scalars(None, len(EVAL_RESULTS), layout.eval_group, layout.target_groups[0][0], device)
        result = {key: None if math.isnan(value) else value for key, value in zip(EVAL_RESULTS, values)}
    else:
        result = evaluate_acceptance(
            target,
            drafter,
            tokenizer,
            data.eval_prompts,
            settings.eval_max_new_tokens,
            block_size,
            chat_template_kwargs=data.chat_kwargs,
            prompt_lookup=settings.eval_prompt_lookup,
            progress=layout.is_lead and sys.stderr.isatty(),
        )
    scalars = {"eval_tau": result["acceptance_length"], "eval_tokens_per_s": result["speculative_tokens_per_s"], "eval_block_size": block_size}
    if settings.eval_prompt_lookup:
        scalars["eval_prompt_lookup_tau"] = result["prompt_lookup_acceptance_length"]
    return scalars


def log_eval(progress: Progress, evaluate, settings: TrainSettings) -> None:
    """Held-out tau now (the lead): a line before (its bar shows only on a terminal, and decoding takes a minute or
    so), then into the trackers and train_log.jsonl, and one log line."""
    logger.info(
        "Measuring held-out tau at step %d: up to %d held-out prompts, %d new tokens each",
        progress.global_step,
        settings.eval_num_prompts,
        settings.eval_max_new_tokens,
    )
    scalars = {"step": progress.global_step, **evaluate(), "elapsed_s": time.perf_counter() - progress.loop_start}
    progress.eval_tau, progress.prompt_lookup_tau = scalars["eval_tau"], scalars.get("eval_prompt_lookup_tau")
    progress.record(scalars, settings.output_dir, with_step=False)
    baseline = f" (prompt lookup on the same prompts: {format_tau(progress.prompt_lookup_tau)})" if settings.eval_prompt_lookup else ""
    # A log line: on stderr with the bar, above it (tqdm.write's default, stdout, reaches the terminal
    # by another path under a launcher and lands after the bar's last column).
    logger.info("Held-out tau at step %d: %s%s", progress.global_step, format_tau(progress.eval_tau), baseline)


def train_loop(
    engine,
    scheduler,
    loss_fn: MicroBatchLoss,
    supply: FeatureSupply,
    progress: Progress,
    evaluate,
    settings: TrainSettings,
    layout,
    schedule: Schedule,
    schedule_settings: ScheduleSettings,
    compute: Compute,
    device: torch.device,
) -> None:
    """The drafter ranks' loop: a micro-batch's features, its loss, backward; at each optimizer step
    the log line, the checkpoint and the held-out evaluation when they are due."""
    dp_rank, drafters = layout.dp_rank, layout.dp_world
    micro_batches_per_step = drafters * settings.gradient_accumulation_steps
    # A sequence-parallel group trains one micro-batch together: the same anchors on all of its ranks
    # (drawn with the group's index), and its samples and tokens counted once, by its first rank.
    sample_rank, counts = dp_rank // settings.sequence_parallel_size, dp_rank % settings.sequence_parallel_size == 0
    progress.new_window(supply, device)
    progress.loop_start, profiler = time.perf_counter(), None
    for epoch, micro_step, batches, *collated in supply.steps:
        indices, trains = batches[dp_rank]
        progress.epoch = epoch
        input_ids, loss_mask, label_ids, context_features, num_tokens = supply.next(collated, indices, trains)
        loss, accepted = loss_fn(engine, context_features, input_ids, loss_mask, label_ids, (settings.seed, epoch, micro_step, sample_rank))
        # Asked before step(), which advances DeepSpeed's micro-step counter: afterwards the answer
        # would be about the next micro-batch.
        boundary = engine.is_gradient_accumulation_boundary()
        # DeepSpeed averages the gradient over all accumulation x drafter-rank micro-batches of the
        # step, fillers (zero loss) included: scaling the real ones by (all / real) makes the step's
        # gradient the mean over its real micro-batches, as if the fillers were not there.
        real = real_micro_batches(len(supply.data.dataset), schedule_settings, micro_step, drafters)
        engine.backward(loss * (micro_batches_per_step / real) if trains and real < micro_batches_per_step else loss)
        engine.step()  # DeepSpeed steps the optimizer and scheduler at accumulation boundaries
        if trains and DEBUG_LOG:
            debug_log(
                layout.rank,
                {
                    "epoch": epoch,
                    "ids": list(indices),
                    "loss": loss.item(),
                    "features": [context_features.double().sum().item(), context_features.double().abs().sum().item()],
                    "source": layout.source_of(micro_step * drafters + dp_rank) if layout.split else layout.rank,
                },
            )
        progress.add(loss, accepted, trains, num_tokens if counts else 0, len(indices) if counts else 0)
        if not boundary:
            continue
        progress.global_step += 1
        progress.bar.update(1)
        if settings.profile_steps and layout.is_lead:
            profiler = profile_window(profiler, progress.global_step, progress.settings, compute.on_cuda)
        if progress.global_step % settings.logging_steps == 0 or progress.global_step == schedule.total_steps:
            scalars = window_scalars(progress, supply, progress.settings, layout, scheduler, compute, device)
            check_finite_loss(scalars["loss"], progress.global_step, progress.settings)
            slots = loss_fn.take_mean_anchor_slots()
            if slots is not None:
                scalars["anchor_slots"] = slots  # this rank's micro-batches, of --num_anchors
            grad_norm = last_gradient_norm(engine)
            if grad_norm is not None:
                scalars["grad_norm"] = grad_norm  # the last step's, before clipping
            progress.bar.set_postfix(
                loss=f"{scalars['loss']:.3f}",
                acc=f"{scalars['acc_first']:.3f}",
                tau=f"{scalars['tau_estimate']:.2f}",
                tok_s=f"{scalars['tokens_per_s']:.0f}",
            )
            if layout.is_lead:  # the other ranks have no trackers
                progress.record(scalars, settings.output_dir)
            progress.new_window(supply, device)
        # Save before evaluating: in split mode the target ranks wait in DeepSpeed's save barriers.
        if is_save_step(progress.global_step, settings.save_steps):
            save_checkpoint(engine, settings, layout, progress.global_step, epoch, micro_step + 1)
            if supply.receiver is not None:
                supply.receiver.resume()
        if evaluate is not None and is_eval_step(progress.global_step, settings.eval_steps):
            if layout.is_lead:
                log_eval(progress, evaluate, settings)
            torch.distributed.barrier(group=layout.drafter_group)


def finish_run(
    drafter: DFlashDraftModel,
    progress: Progress,
    evaluate,
    settings: TrainSettings,
    checkpoint_settings: CheckpointSettings,
    draft_config: DFlashConfig,
    data: TrainData,
    layout,
) -> None:
    """The lead: held-out tau at the last step (if not just measured), curves, the export with its
    model card, the Hub push; then every drafter rank closes its trackers."""
    final_dir = Path(settings.output_dir) / "final"
    card_settings = settings_for(ModelCardSettings, settings)  # what the export's model card reports
    if layout.is_lead:
        if evaluate is not None and not is_eval_step(progress.global_step, settings.eval_steps):
            log_eval(progress, evaluate, settings)
        plot_training_curves(Path(settings.output_dir))
        card = model_card(
            card_settings,
            draft_config,
            steps=progress.global_step,
            num_samples=len(data.dataset),
            eval_tau=progress.eval_tau,
            prompt_lookup_tau=progress.prompt_lookup_tau,
            location=settings.hub_model_id if settings.push_to_hub else str(final_dir.resolve()),
        )
        save_export(drafter, final_dir, settings, card)
        logger.info("Exported the drafter to %s with a model card (README.md; serve it with SGLang or vLLM)", final_dir)
        gguf = f" --target_gguf_file {settings.target_gguf_file}" if settings.target_gguf_file else ""
        logger.info(
            "Measure it on more prompts: python eval_dflash.py --target_model %s%s --draft_model %s --data %s "
            "--num_prompts %d --max_new_tokens %d --output %s",
            settings.target_model,
            gguf,
            final_dir,
            settings.eval_data or "PROMPTS.jsonl",
            min(20, data.eval_prompts_in_file or 20),
            settings.eval_max_new_tokens,
            Path(settings.output_dir) / "eval.json",
        )
        if settings.push_to_hub:
            url = push_to_hub(final_dir, checkpoint_settings, progress.global_step)
            logger.info("Pushed %s to the Hub as %s (%s)", final_dir, settings.hub_model_id, url)
    for tracker in progress.trackers:
        tracker.finish()


def finished_at_named_checkpoint(checkpoint_settings: CheckpointSettings, schedule_settings: ScheduleSettings, data: TrainData) -> str | None:
    """`finished_run` for --resume_from_checkpoint CHECKPOINT, which needs the run's length: its
    optimizer steps in all with these settings and data, on the drafter ranks that wrote the checkpoint."""
    named = checkpoint_settings.resume_from_checkpoint
    if named in (None, "latest"):
        return None
    try:
        state = json.loads((Path(named) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None  # missing or damaged: find_resume_point names it
    total_steps = make_schedule(schedule_settings, data, ResumePoint(None, state), state.get("drafter_ranks", 1)).total_steps
    finished = finished_run(checkpoint_settings, total_steps)
    if finished:
        check_checkpoint(Path(named), checkpoint_settings.output_dir)  # a damaged one is named all the same
    return finished


def end_finished_run(cluster, line: str) -> None:
    """End a run that has nothing to do (`finished_run`): `line` once, as a warning; nothing written."""
    if cluster.rank == 0:
        logger.warning(line)
    if cluster.liveness:
        cluster.liveness.finish()
    cluster.accelerator.end_training()


# ----------------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    settings, config_path = parse_settings(argv)
    # Each module below takes only the settings it reads, as a dataclass of its own (`settings_for`).
    schedule_settings = settings_for(ScheduleSettings, settings)
    feature_settings = settings_for(FeatureSettings, settings)
    topology_settings = settings_for(TopologySettings, settings)
    checkpoint_settings = settings_for(CheckpointSettings, settings)
    progress_settings = settings_for(ProgressSettings, settings)
    cluster = setup_distributed(topology_settings)
    finished = finished_run(checkpoint_settings)
    if finished:  # --resume_from_checkpoint latest on a run that ended: nothing to do, and nothing is touched
        return end_finished_run(cluster, finished)
    if config_path == str(DEMO_CONFIG):
        logger.info("No --config or --target_model given: running the offline CPU demo (%s)", DEMO_CONFIG.name)
    if settings.push_to_hub and cluster.rank == 0:
        check_hub_access(settings.hub_model_id)  # now, not after the run
    compute = resolve_compute(settings, cluster.device)
    device = cluster.device
    # The target's tokenizer and config (seconds): everything below is checked before its weights load.
    target_config, tokenizer = load_target_config(settings.target_model, gguf_file=settings.target_gguf_file)
    draft_config = build_draft_config(settings, target_config, tokenizer, compute)
    check_sequence_parallel_heads(settings.sequence_parallel_size, draft_config)
    weights = fixed_loss_weights(settings, draft_config.block_size, device)
    data = load_data(settings, tokenizer, cluster.accelerator)
    finished = finished_at_named_checkpoint(checkpoint_settings, schedule_settings, data)
    if finished:  # the same, for the checkpoint of a finished run's last step, named
        return end_finished_run(cluster, finished)
    resume = find_resume_point(checkpoint_settings, cluster.accelerator, cluster.rank)

    # Topology: what this rank loads, then (auto) the split timed on both sides, then the split settled.
    roles = plan_rank_roles(topology_settings, cluster, resume)
    parts = load_target_parts(topology_settings, target_config, draft_config, cluster, roles, compute)
    drafter = build_drafter(settings, draft_config, parts, compute) if roles.needs_drafter else None
    loss_fn = MicroBatchLoss(settings, draft_config, compute, weights, parts.lm_head)
    speed_up_target(parts.extractor, settings, compute)  # before the timing: it times the target as it will run
    layout = roles.layout or time_rank_split(topology_settings, schedule_settings, cluster, roles, data, tokenizer, parts, drafter, loss_fn, compute)
    settle_split(layout, topology_settings, draft_config, parts, drafter, compute, cluster.rank)
    sequence_parallel = make_sequence_parallel_groups(layout, settings.sequence_parallel_size, draft_config)  # collective
    loss_fn = replace(loss_fn, sequence_parallel=sequence_parallel)
    schedule = make_schedule(schedule_settings, data, resume, layout.dp_world)

    if layout.is_target:  # context features for the drafter ranks, and nothing else
        if not (layout.is_evaluator and data.eval_prompts):
            # Not needed here (a tensor-parallel group's own copies under auto): freed before serving.
            drafter = loss_fn = parts.embed_tokens = parts.lm_head = None
        run_target_rank(
            topology_settings,
            feature_settings,
            cluster,
            compute,
            data,
            tokenizer,
            layout,
            parts,
            drafter,
            schedule.plan(data, schedule_settings, resume, layout.dp_world),
            resume,
        )
    else:
        engine, scheduler = start_deepspeed(settings, drafter, layout, schedule, compute, resume)
        drafter = engine.module
        warm_up_flex(settings, schedule_settings, draft_config, data, layout, resume, compute, device, drafter.fc.weight.dtype)
        supply = FeatureSupply(
            feature_settings, layout, draft_config, data, tokenizer, parts.extractor, compute, device, schedule, schedule_settings, resume
        )
        progress = start_progress(
            progress_settings,
            asdict(settings),
            layout,
            schedule,
            resume,
            len(data.dataset),
            cluster.world,
            draft_config.block_size + isinstance(draft_config, DSparkConfig),  # a DSpark block of gamma drafts gamma tokens
        )
        evaluate = None
        if data.eval_prompts:
            evaluate = functools.partial(held_out_tau, drafter, parts.target, tokenizer, data, settings, layout, device)
        with logging_redirect_tqdm():  # log lines above the bar while it runs, not glued onto it
            train_loop(engine, scheduler, loss_fn, supply, progress, evaluate, settings, layout, schedule, schedule_settings, compute, device)
            progress.bar.close()
        if supply.receiver is not None:
            supply.receiver.finish()  # every target rank's END arrived: supply and demand agreed to the last batch
        if DEBUG_LOG:
            debug_log(cluster.rank, {"step": progress.global_step, "weights_sha256": weights_digest(drafter)})
        finish_run(drafter, progress, evaluate, settings, checkpoint_settings, draft_config, data, layout)
    if cluster.liveness:
        cluster.liveness.finish()  # every rank waits here for the others (the lead's export included), watched
    cluster.accelerator.end_training()


if __name__ == "__main__":
    gc.freeze()  # the imports' ~500k objects live until exit: no garbage collection walks them again (~2 s less at exit)
    try:
        main(sys.argv[1:])
    except BaseException as error:
        exit_after_failure(error)  # one error line (or the traceback of a bug), the other ranks told, the exit status
