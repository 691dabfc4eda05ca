"""Speculative decoding with a DFlash drafter, batch size 1: what eval_dflash.py measures, what
training's held-out tau runs (`evaluate_acceptance`). The target's and the drafter's runners it
drives (KV caches cut back after a verify forward, static caches, CUDA graphs, the `Decoder` that
holds both) are dflash_runners.py.

In reading order:
  - checks and helpers: the drafter against its target (`check_drafter_matches_target`), loading a
    drafter checkpoint (`load_drafter`), the verified block size, EOS ids, prompt encoding;
  - the generate functions: plain decoding, the lossless reference (`plain_generate`,
    `greedy_generate`), DFlash speculative decoding (`speculative_generate`), and transformers'
    prompt lookup as a baseline (`prompt_lookup_generate`);
  - speculative sampling of one block at temperature > 0 (`rejection_sample`);
  - acceptance: tau and acceptance by position over prompts (`summarize_speculative`,
    `prompt_lookup_tau`), held-out tau (`evaluate_acceptance`), and where a speculative output first
    leaves greedy decoding and whether that is a near-tie (`first_divergence`, `logit_margin`,
    `near_tie_bound`).

One speculative step: the drafter drafts B-1 tokens from the target's context features, the target
verifies `[anchor, d_1..d_{B-1}]` in one forward, the longest prefix where d_i == the target's
argmax is committed plus the target's bonus token, and both caches are cut back to the committed
tokens (`speculative_generate` says it in full).

On a GPU, plain and speculative decoding run with static KV caches whose fixed-shape forwards are
replayed as CUDA graphs; on a CPU with growing (dynamic) caches (dflash_runners.py says why).

How tau is counted (as in the DFlash reference implementation):
  tau = tokens committed by verify forwards / number of verify forwards, bonus token included.
  The prefill forward and the first token it produces are not counted. So for a prompt that
  generated N tokens with F verify forwards, N - 1 = tau * F exactly (truncation at EOS or at
  max_new_tokens counts only the tokens actually committed).
Prompt lookup's tau (transformers' assisted decoding) is counted the same way: a forward hook
counts the target's forwards F inside `generate`, and a streamer records the tokens committed at
each step (never the stopping criteria, which some transformers versions call twice per forward).
transformers' FIRST forward is the prefill and already verifies prompt-lookup candidates, so it
and every token it committed are excluded: tau = (generated - committed by the first) / (F - 1).

Per-position acceptance rate k (k = 1..B-1) = fraction of verify forwards whose longest matching
draft prefix had at least k tokens. It describes the drafter, so it is measured before the
block is truncated at EOS or at max_new_tokens.

Greedy decoding (temperature 0, the default) makes the output equal plain greedy decoding's. With
temperature T > 0 (and top_p P) both sides sample, as DFlash's reference does: the drafter's B-1
drafts are sampled from its own distribution q (one parallel pass, so each q_i is independent of the
other drafts), the target accepts draft i with probability min(1, p_i / q_i) and replaces the first
rejected one with a sample from the normalised residual max(0, p_i - q_i), or adds a bonus token
sampled from p after a fully accepted block (`rejection_sample`). A DFlash2 drafter samples its
drafts left to right along its candidate selector's walk, each q_i over the selector's K candidates
given d_{i-1}, and verification takes q_i in that candidate-index form. A DSpark drafter
(dspark_model.py) drafts gamma tokens per pass, its anchor's slot included, so gamma + 1 tokens are
verified; it walks its block left to right through its Markov head (greedy at temperature 0, and
under --proposal argmax), and at T > 0 samples d_i from q_i = the slot's distribution with the
Markov term of d_{i-1}, the q that verification then takes. Its confidence head can cut a proposal
short (`confidence_threshold`, off by default). The output is then
distributed exactly as plain sampling from the target, which tests/test_sampling.py checks
statistically. tau and acceptance by position are counted as above. Targets with linear-attention
layers (Qwen3.5, Qwen3-Next) decode with a dynamic cache whose recurrent state is restored and re-run
after a partly rejected block (dflash_runners.py's `TargetRunner`).
"""

import json
import math
import os
import time
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from dflash2_model import DFlash2DraftModel
from dflash_model import DFlashDraftModel, sampling_probs
from dflash_runners import Decoder, resolve_kv_cache
from dspark_model import TARGET_TABLES, DSparkConfig, DSparkDraftModel

PROPOSALS = ("sample", "argmax")  # what a drafter proposes at temperature > 0 (speculative_generate)


# ----------------------------------------------------------------------------------------------
# Checks and helpers: the drafter against its target, loading a drafter, prompts, EOS ids


def check_drafter_matches_target(target, drafter) -> None:
    """Raise ValueError when the drafter was not built for this target.

    Checks hidden size, embedding rows (vocab), decoder-layer count and `target_layer_ids`, the
    embedding and logit scaling (`check_target_scaling`), and that the drafter's dtype equals the
    target's: `draft_block` runs the target's LM head on the drafter's hidden states, so the two
    must agree (cast with `drafter.to(target.dtype)`).
    """
    target_layers = len(target.get_decoder().layers)
    check_shapes(
        drafter.config, target.config.get_text_config().hidden_size, target.get_input_embeddings().weight.shape[0], target_layers, truncated_hint=True
    )
    from dflash_target import check_target_scaling

    check_target_scaling(target, drafter.config)
    drafter_dtype = next(drafter.parameters()).dtype
    target_dtype = target.get_input_embeddings().weight.dtype
    if drafter_dtype != target_dtype:
        raise ValueError(
            f"dtype mismatch: the drafter is {drafter_dtype}, the target is {target_dtype}; the drafter uses the target's "
            f"LM head on its own hidden states. Cast it with drafter.to({target_dtype})."
        )


def check_config_matches_target(config, target_config) -> None:
    """`check_drafter_matches_target`'s shape checks from the two configs alone, so that a drafter
    built for another target is refused before any weights load.

    Args:
        config: the drafter's `DFlashConfig`.
        target_config: the target's `PretrainedConfig` (its text config is read).
    Raises:
        ValueError: on another hidden size, embedding rows (vocab_size) or decoder-layer count, or
            target_layer_ids outside the target's layers.
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    check_shapes(config, text.hidden_size, text.vocab_size, text.num_hidden_layers)


def check_shapes(config, target_hidden: int, target_rows: int, target_layers: int, truncated_hint: bool = False) -> None:
    """Raise ValueError when the drafter `config` was sized for a target of another hidden size,
    embedding rows or layer count (one line each, naming the fix)."""
    if config.hidden_size != target_hidden:
        raise ValueError(
            f"hidden size mismatch: the drafter has hidden_size {config.hidden_size}, the target has {target_hidden}. "
            f"Pass the target the drafter was trained for (--target_model) or a drafter trained for this target (--draft_model)."
        )
    if config.vocab_size != target_rows:
        raise ValueError(
            f"vocab mismatch: the drafter has vocab_size {config.vocab_size}, the target's embedding has {target_rows} rows. "
            f"Pass the target the drafter was trained for (--target_model) or a drafter trained for this target (--draft_model)."
        )
    if config.num_target_layers is not None and config.num_target_layers != target_layers:
        raise ValueError(
            f"layer count mismatch: the drafter was trained on a target with {config.num_target_layers} decoder layers, "
            f"this target has {target_layers}. Pass the matching --target_model"
            + (
                "; a target truncated by TargetFeatureExtractor(truncate=True) cannot verify drafts (no logits): pass the full target."
                if truncated_hint
                else " or a drafter trained for this target (--draft_model)."
            )
        )
    if any(not 0 <= i < target_layers for i in config.target_layer_ids):
        raise ValueError(f"drafter target_layer_ids {config.target_layer_ids} are outside the target's {target_layers} layers")


def target_fingerprint_warning(target, config) -> str | None:
    """One line when the target's fingerprint differs from the one the drafter's export recorded
    (`dflash_target.target_fingerprint`: same shapes, other weights); None when they agree or the
    drafter has none (written before fingerprints, by another trainer, or converted)."""
    recorded = (config.dflash_config or {}).get("target_fingerprint")
    if not recorded:
        return None
    from dflash_target import target_fingerprint

    found = target_fingerprint(target.get_input_embeddings().weight, len(target.get_decoder().layers))
    if found == recorded:
        return None
    differ = ", ".join(f"{key} {found.get(key)} here, {value} at export" for key, value in recorded.items() if found.get(key) != value)
    return (
        f"the target differs from the one this drafter was trained for ({differ}): other weights give the drafter "
        f"other context features, so expect tau near 1; pass the target it was trained for (the drafter folder's "
        f"training_settings.json names it)"
    )


def drafts_per_pass(drafter) -> int:
    """Tokens one draft pass drafts: B - 1 for a DFlash or DFlash2 block of B (its anchor's slot
    predicts nothing), gamma = `block_size` for DSpark (its anchor's slot is the first prediction).
    `drafter` may be the drafter or its config."""
    config = getattr(drafter, "config", drafter)
    return config.block_size if isinstance(config, DSparkConfig) else config.block_size - 1


def resolve_block_size(drafter, block_size: int | None) -> int:
    """The verified block size, tokens per verify forward with the anchor: default every draft of a
    pass plus the anchor (DFlash: the drafter's B; DSpark: gamma + 1); smaller verifies the first
    block_size - 1 drafts, larger is refused. `drafter` may be the drafter or its config."""
    largest = drafts_per_pass(drafter) + 1
    if block_size is None:
        return largest
    if not 2 <= block_size <= largest:
        raise ValueError(
            f"--block_size {block_size} must be between 2 and {largest}: the drafter drafts {largest - 1} tokens per "
            f"pass, verified with the anchor (smaller blocks use the first block_size - 1 of them)."
        )
    return block_size


def eos_token_ids_of(tokenizer, target) -> list[int]:
    """EOS ids: the tokenizer's eos plus the target's generation_config eos (e.g. <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(target.generation_config, "eos_token_id", None)
    ids |= set(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


def encode_prompt(tokenizer, messages: list[dict], chat_template_kwargs: dict | None, device) -> torch.Tensor:
    """Chat template with the generation prompt -> input_ids [1, P] int64 on `device`."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
    # The template already wrote BOS/special tokens; don't let the tokenizer add more.
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids.to(device)  # [1, P]


def load_drafter(path: str, dtype: torch.dtype, device: torch.device) -> DFlashDraftModel:
    """Load a DFlash, DFlash2 or DSpark drafter checkpoint (by its config's `architectures`), refusing
    folders that are not one (`drafter_class`)."""
    return drafter_class(path).from_pretrained(path, dtype=dtype).to(device).eval()


def drafter_class(path: str) -> type:
    """DFlashDraftModel, DFlash2DraftModel or DSparkDraftModel (`architectures` Qwen3DSparkModel) for
    the checkpoint folder `path`, by its config's `architectures`; nothing but config.json and the
    weights' header is read.

    Raises:
        ValueError: for a folder without config.json, a speculators checkpoint, a config without
            dflash_config (a DSpark config may have its two keys at the top level instead, as
            DeepSpec writes it), or weights that do not fit the config (`check_weights_fit_config`).
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--draft_model {path!r} has no config.json; pass the folder of a DFlash drafter checkpoint")
    with open(config_path) as f:
        config = json.load(f)
    if "speculators_model_type" in config:
        raise ValueError(
            f"--draft_model {path!r} is a speculators checkpoint; convert it to our export first: "
            f"python convert_dflash.py {path} {path.rstrip('/')}-zlab --to zlab"
        )
    architectures = config.get("architectures") or []
    dspark = "Qwen3DSparkModel" in architectures
    if "dflash_config" not in config and not (dspark and {"mask_token_id", "target_layer_ids"} <= config.keys()):
        raise ValueError(
            f"--draft_model {path!r} is not a DFlash drafter: its config.json has no 'dflash_config' "
            f"(mask_token_id, target_layer_ids). Pass a checkpoint written by train_dflash.py or a released DFlash drafter."
        )
    model_class = DSparkDraftModel if dspark else DFlash2DraftModel if "DFlash2DraftModel" in architectures else DFlashDraftModel
    check_weights_fit_config(path, model_class)
    return model_class


def check_weights_fit_config(path: str, model_class) -> None:
    """Raise ValueError, before any weight loads, when the tensors of `path`/model.safetensors (or its
    shards) are not those its config.json describes (names and shapes, from the file's header and a drafter built on
    the meta device): transformers would print its load report and fail with a traceback, or start
    from random weights where names are missing."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):  # a sharded checkpoint
        with open(index) as f:
            weights_files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    else:
        weights_files = [os.path.join(path, "model.safetensors")]
    in_file = {}
    for weights_file in weights_files:
        if not os.path.isfile(weights_file):
            raise ValueError(f"--draft_model {path!r} has no {os.path.basename(weights_file)}; pass the folder of a DFlash drafter checkpoint")
        try:
            with safe_open(weights_file, framework="pt") as f:
                in_file.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as error:  # a damaged header, named in one line
            raise ValueError(f"--draft_model {path!r}: {weights_file} does not open ({type(error).__name__}: {error})") from None
    config = model_class.config_class.from_pretrained(path)
    with torch.device("meta"):
        expected = {name: list(t.shape) for name, t in model_class(config).state_dict().items()}
    optional = {}
    if model_class is DSparkDraftModel:  # copies of the target's tables: DeepSpec's layout has them, speculators' not
        optional = {name: [config.vocab_size, config.hidden_size] for name in TARGET_TABLES}
    problems = [
        f"{name} is {in_file[name]} in the file, {shape} by config.json"
        for name, shape in {**expected, **optional}.items()
        if name in in_file and in_file[name] != shape
    ]
    problems += [f"{name} is missing from the file" for name in expected if name not in in_file]
    problems += [f"{name} is in the file but not in a drafter of this config" for name in in_file if name not in expected and name not in optional]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            f"--draft_model {path!r}: its weights do not fit its config.json: {'; '.join(problems[:3])}{more}; "
            f"the two files come from different drafters: copy the pair from one export"
        )


@contextmanager
def eval_mode(*modules):
    """Put modules in eval mode (dropout off) and restore each one's mode afterwards."""
    modes = [getattr(m, "training", None) for m in modules]
    for m in modules:
        if hasattr(m, "eval"):
            m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            if mode is not None:
                m.train(mode)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA kernels run asynchronously: without a sync a clock
    stops before the work is done); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# Decoding: greedy reference, DFlash speculative, prompt lookup


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits [vocab] -> the argmax (temperature 0) or a token sampled from `sampling_probs`."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator))


@torch.no_grad()
def plain_generate(
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids=(),
    decoder: Decoder | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Plain decoding with the KV cache, one target forward per token: the reference speculative
    decoding must reproduce (exactly when greedy, in distribution when sampling).

    Args:
        input_ids: [1, P] int64 prompt.
        eos_token_ids: generation stops after the first of these (it is included in the output).
        decoder: a `Decoder` to reuse (static cache, CUDA graphs); default a dynamic cache.
        temperature: 0 for greedy (argmax); > 0 samples from `sampling_probs(logits, temperature, top_p)`.
        generator: the random stream when sampling.
    Returns:
        The generated token ids (at most max_new_tokens), EOS included when reached.
    """
    eos = set(eos_token_ids)
    own = decoder is None
    decoder = decoder or Decoder(target)
    try:
        with eval_mode(target):
            logits, _ = decoder.target.prefill(input_ids)  # [1, 1, vocab]
            tokens = []
            while True:
                tokens.append(_next_token(logits[0, -1], temperature, top_p, generator))
                if tokens[-1] in eos or len(tokens) >= max_new_tokens:
                    return tokens
                step = torch.tensor([[tokens[-1]]], device=input_ids.device)  # [1, 1]
                logits, _ = decoder.target.forward(step)  # [1, 1, vocab]
    finally:
        if own:
            decoder.close()


def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids=(), decoder: Decoder | None = None) -> list[int]:
    """`plain_generate` at temperature 0: plain greedy decoding, the lossless reference."""
    return plain_generate(target, input_ids, max_new_tokens, eos_token_ids, decoder)


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int | None = None,
    eos_token_ids=(),
    decoder: Decoder | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    proposal: str = "sample",
    confidence_threshold: float = 0.0,
    draft_temperature: float | None = None,
) -> tuple[list[int], dict]:
    """DFlash speculative decoding, batch size 1. Lossless: greedy returns plain greedy decoding's
    tokens; sampling returns tokens distributed as plain sampling from the target.

    Invariant at the top of every step: the target's KV cache and the drafter's context cache
    both hold positions 0..L-1 (prompt + committed tokens except the last); the last committed
    token is the anchor, at position L. One step:
      1. the drafter drafts d_1..d_{b-1} for positions L+1..L+b-1 (b = block_size; a drafter
         trained with a larger block drafts its full block and we keep the first b-1, since the
         drafts of one pass are made together and it was trained on full blocks): the argmax at
         temperature 0, else (proposal "sample") samples from its distribution q, or (proposal
         "argmax") proposes the argmax with a one-hot q. A DFlash2 drafter drafts along its
         selector's walk: its argmax path (one-hot q under "argmax"), or a sampled path with q rows
         over its candidates. A DSpark drafter's pass drafts gamma tokens (its anchor's slot
         predicts too, so b = gamma + 1 by default) along its Markov walk: the greedy walk at
         temperature 0 and under "argmax" (one-hot q), else each d_i sampled from q_i given d_{i-1};
         with `confidence_threshold` the proposal ends before its first slot whose predicted
         acceptance is below the threshold (d_1..d_{b-1} then stand for the drafts kept);
      2. the target runs `[anchor, d_1..d_{b-1}]` at positions L..L+b-1 in one cached forward;
      3. greedy: n = longest prefix with d_i == the target's argmax after block[:i], and the
         target's argmax after the n accepted drafts is the bonus token. Sampling:
         `rejection_sample` gives n and the token after them. Commit the n drafts and that token,
         truncated after the first EOS and at max_new_tokens;
      4. c tokens were committed: positions L..L+c-1 (anchor + c-1 accepted drafts, whose inputs
         were right) stay in the target's KV cache, the rest is dropped (`TargetRunner.keep`); their
         layer features go into the drafter's cache. The new anchor (last committed token) sits at L+c.

    Args:
        target: HF causal LM (full, not truncated: verification needs its logits).
        drafter: `DFlashDraftModel`, `DFlash2DraftModel` or `DSparkDraftModel` in the target's dtype
            with `attach_target` done (or any object with `config.block_size`, `config.target_layer_ids`,
            `extend_context`, `draft_block`, and for sampling `draft_probs`, or `draft_sample` for a
            selector walk).
        input_ids: [1, P] int64 prompt on the target's device.
        max_new_tokens: most tokens generated, the prefill token included.
        block_size: tokens per verify forward, anchor included (2..`drafts_per_pass` + 1); default
            all of a pass's drafts (`resolve_block_size`).
        eos_token_ids: stop after the first of these (included in the output, nothing after it).
        decoder: a `Decoder(target, drafter, ...)` to reuse across prompts (static caches, CUDA
            graphs); default a dynamic cache made for this call.
        temperature: 0 (greedy) or > 0 (sampling, with nucleus `top_p`; `sampling_probs`).
        generator: the random stream when sampling, on the target's device.
        proposal: at temperature > 0, "sample" (each draft drawn from q_i) or "argmax" (the draft
            pass's argmax, i.e. q_i one-hot: accepted with probability p_i(d_i), else the token comes
            from p_i without d_i). Both are exact. A DFlash drafter samples its positions
            independently given the context, so sampled drafts stop agreeing with one another
            down the block; the argmax path keeps them one consistent continuation.
        confidence_threshold: DSpark drafters with a confidence head only: > 0 cuts each proposal
            before its first slot k whose predicted acceptance sigmoid(c_k) is below it (DeepSpec's
            gate); 0 (the default) verifies every draft. Exact at T > 0 too: c_k reads h_k and
            d_{k-1}, never d_k, so whether d_k is verified is settled before d_k is drawn.
        draft_temperature: at temperature > 0 under proposal "sample", the temperature of the
            drafter's q (default `temperature`). Rejection sampling is exact for any q, so this only
            moves acceptance: a drafter trained on the target's argmax need not be calibrated at
            the target's temperature.
    Returns:
        tokens: the generated ids.
        stats: {"prompt_tokens", "generated_tokens", "verify_forwards", "committed" (tokens per
            verify forward, list), "accepted_drafts" (accepted drafts n per verify forward, before
            EOS / length truncation, list), "proposed_drafts" (drafts verified per verify forward,
            block_size - 1 unless the confidence gate cut them, list), "block_size"}.
    Raises:
        ValueError: on a batch of several prompts, max_new_tokens < 1, an unknown proposal, a block
            size the drafter cannot fill, a draft temperature <= 0, or a confidence threshold outside
            [0, 1] or without a DSpark confidence head.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one prompt at a time; got a batch of {input_ids.shape[0]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {', '.join(PROPOSALS)}, got {proposal!r}")
    draft_temperature = temperature if draft_temperature is None else draft_temperature
    if temperature > 0 and not draft_temperature > 0:
        raise ValueError(f"draft_temperature must be > 0 (or None: the target's temperature), got {draft_temperature}")
    block_size = resolve_block_size(drafter, block_size)
    dspark = isinstance(drafter, DSparkDraftModel)  # drafts and q come from the Markov walk
    selector_walk = not dspark and hasattr(drafter, "draft_sample")  # DFlash2: drafts and q come from the selector's walk
    if not 0 <= confidence_threshold <= 1:
        raise ValueError(f"--confidence_threshold must be in [0, 1] (0: off), got {confidence_threshold}")
    if confidence_threshold > 0 and getattr(drafter, "confidence_head", None) is None:
        raise ValueError("--confidence_threshold needs a DSpark drafter with a confidence head (enable_confidence_head); leave it at 0")
    eos = set(eos_token_ids)
    device = input_ids.device
    committed, accepted_drafts, proposed_drafts = [], [], []
    own = decoder is None
    decoder = decoder or Decoder(target, drafter)
    runner, drafting = decoder.target, decoder.drafting
    try:
        with eval_mode(drafter, target):
            # Prefill: not a verify forward. Its features cover every prompt position, i.e. every
            # token before the first anchor.
            logits, features = runner.prefill(input_ids)  # [1, 1, vocab], [1, P, F]
            tokens = [_next_token(logits[0, -1], temperature, top_p, generator)]
            drafting.start(features)  # context 0..P-1
            length = input_ids.shape[1]  # L: positions in both caches; the anchor tokens[-1] sits at L

            while tokens[-1] not in eos and len(tokens) < max_new_tokens:
                anchor = torch.tensor([tokens[-1]], device=device)  # [1]
                candidates = None
                if dspark:  # q_i given d_{i-1}: the Markov term of the draft before; one-hot on the greedy walk
                    walk_temperature = draft_temperature if proposal == "sample" and temperature > 0 else 0.0
                    uniform = torch.rand(1, drafter.config.block_size, generator=generator, device=device) if walk_temperature > 0 else None
                    drafts, q, confidence = drafting.markov_walk(anchor, walk_temperature, top_p, uniform, confidence_threshold > 0)
                    count = block_size - 1
                    if confidence is not None:  # keep the slots before the first one predicted below the threshold
                        count = int((torch.sigmoid(confidence[0, :count]) >= confidence_threshold).long().cumprod(dim=0).sum())
                    drafts, q = drafts[:, :count], q[0, :count]  # [1, c], [c, vocab]
                elif temperature == 0 or proposal == "argmax":
                    drafts = drafting.draft(anchor)[:, : block_size - 1].to(device)  # [1, b-1]
                    if temperature > 0:  # one-hot q_i on d_i: the candidate form with one candidate each
                        candidates, q = drafts[0, :, None], torch.ones(block_size - 1, 1, device=device)  # [b-1, 1]
                elif selector_walk:
                    uniform = torch.rand(1, drafter.config.block_size - 1, generator=generator, device=device)  # [1, B-1]
                    drafts, candidates, q = drafting.draft_sample(anchor, draft_temperature, top_p, uniform)
                    drafts, candidates, q = drafts[:, : block_size - 1], candidates[0, : block_size - 1], q[0, : block_size - 1]
                else:
                    q = drafting.draft_probs(anchor, draft_temperature, top_p)[0, : block_size - 1].to(device)  # [b-1, vocab]
                    drafts = torch.multinomial(q, 1, generator=generator).T  # [1, b-1], d_i ~ q_i
                proposed_drafts.append(drafts.shape[1])
                block = torch.cat([anchor[:, None], drafts], dim=1)  # [1, b] at positions L..L+b-1
                logits, _ = runner.verify(block)  # [1, b, vocab]
                if temperature == 0:
                    predicted = logits[0].argmax(dim=-1)  # [b]
                    n = int((drafts[0] == predicted[:-1]).long().cumprod(dim=0).sum())  # longest matching draft prefix
                    new = predicted[: n + 1].tolist()  # accepted drafts (== predicted there) + the bonus token
                elif candidates is not None:  # q rows over candidates: DFlash2's selector, or the one-hot argmax
                    n, token = rejection_sample(drafts[0], q, sampling_probs(logits[0], temperature, top_p), generator, candidates)
                    new = drafts[0, :n].tolist() + [token]
                else:
                    n, token = rejection_sample(drafts[0], q, sampling_probs(logits[0], temperature, top_p), generator)
                    new = drafts[0, :n].tolist() + [token]
                stop = next((j for j, t in enumerate(new) if t in eos), None)
                if stop is not None:
                    new = new[: stop + 1]  # EOS inside the block: commit through it, nothing after
                new = new[: max_new_tokens - len(tokens)]  # a block crossing the limit is truncated
                tokens += new
                committed.append(len(new))
                accepted_drafts.append(n)

                # Keep the anchor and the len(new) - 1 accepted drafts: both caches end at the new anchor.
                drafting.extend(runner.keep(len(new)))
                length += len(new)
                assert runner.length == length == drafting.length, "target and drafter caches out of step"
    finally:
        if own:
            decoder.close()

    stats = {
        "prompt_tokens": int(input_ids.shape[1]),
        "generated_tokens": len(tokens),
        "verify_forwards": len(committed),
        "committed": committed,
        "accepted_drafts": accepted_drafts,
        "proposed_drafts": proposed_drafts,
        "block_size": block_size,
    }
    return tokens, stats


class _CommitCounter(BaseStreamer):
    """Records how many tokens `generate` commits at each step (a streamer gets them as they are
    committed: in assisted decoding, the accepted candidates plus one, once per target forward).
    The prompt, which `generate` puts first, is not counted."""

    def __init__(self):
        self.committed: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.committed.append(int(value.numel()))
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.no_grad()
def prompt_lookup_generate(
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids,
    pad_token_id: int,
    num_tokens: int = 10,
    max_ngram_size: int = 2,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[list[int], dict]:
    """transformers' prompt-lookup decoding (greedy, or sampling at temperature > 0 from torch's
    global random stream), with its target forwards and commits counted here.

    A forward hook counts the target's forwards F, and a streamer records the tokens committed
    after each of them; nothing relies on how often `generate` calls its stopping criteria, which
    differs between transformers versions.

    Args:
        input_ids: [1, P] int64 prompt.
        num_tokens: candidates per step (`prompt_lookup_num_tokens`).
        max_ngram_size: longest n-gram matched in the context (`max_matching_ngram_size`).
    Returns:
        tokens: generated ids (EOS included when reached).
        stats: {"generated_tokens", "target_forwards" (prefill included), "verify_forwards"
            (forwards after the first), "committed_after_first" (tokens committed by them)}.
            See the module docstring for why the first forward is excluded.
    """
    forwards = []
    handle = target.register_forward_hook(lambda module, args, output: forwards.append(1))
    counter = _CommitCounter()
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=top_p if temperature > 0 else None,
        top_k=None,
        prompt_lookup_num_tokens=num_tokens,
        max_matching_ngram_size=max_ngram_size,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id,
    )
    try:
        output = target.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, streamer=counter
        )  # [1, P + generated]
    finally:
        handle.remove()
    tokens = output[0, input_ids.shape[1] :].tolist()
    first = counter.committed[0] if counter.committed else len(tokens)  # committed by the prefill forward
    stats = {
        "generated_tokens": len(tokens),
        "target_forwards": len(forwards),
        "verify_forwards": len(forwards) - 1,
        "committed_after_first": len(tokens) - first,
    }
    return tokens, stats


# ----------------------------------------------------------------------------------------------
# Rejection sampling: verifying sampled drafts


def rejection_sample(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    draft_indices: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Speculative sampling of one block (Leviathan et al. 2023; DFlash's reference verifies the same way).

    Draft i (sampled from q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order,
    until the first rejection; the token there is sampled from the residual max(0, p_i - q_i),
    renormalised (from p_i itself if p_i == q_i leaves no residual). If every draft is accepted,
    the bonus token is sampled from the target's distribution after the last one. The tokens this
    commits are distributed exactly as plain sampling from the target: the verification is lossless.
    q_i must be the distribution d_i was drawn from given d_1..d_{i-1}: DFlash's drafts are
    independent given the context (one parallel pass), a DFlash2 draft depends on the one before it
    (the selector's walk), and either way d_i is judged only once d_1..d_{i-1} are accepted, i.e.
    are the tokens p_i is conditioned on.

    Args:
        drafts: [k] int64, d_1..d_k.
        draft_probs: [k, vocab] float, q_1..q_k (rows sum to 1); with draft_indices, [k, K]: q_i
            over the K candidate ids draft_indices[i] (DFlash2's selector), zero elsewhere.
        target_probs: [k + 1, vocab] float, p_1..p_{k+1}: the target's distribution after
            [anchor, d_1..d_{i-1}], i.e. its verify logits at block positions 0..k.
        generator: for reproducible draws (on the tensors' device).
        draft_indices: [k, K] int64 distinct candidate ids per position, or None (q over the vocab).
    Returns:
        (n, token): n accepted drafts (0..k) and the token committed after them (host ints; one sync).
    """
    k = drafts.shape[0]
    if draft_indices is not None:  # the candidate-index form: q over the vocab is q_i scattered onto its ids
        draft_probs = torch.zeros_like(target_probs[:k]).scatter(1, draft_indices, draft_probs.to(target_probs.dtype))
    p = target_probs[:k].gather(1, drafts[:, None])[:, 0]  # [k]
    q = draft_probs.gather(1, drafts[:, None])[:, 0]  # [k], > 0: each draft was sampled from its q
    u = torch.rand(k, generator=generator, device=drafts.device)
    n = int((u * q < p).long().cumprod(0).sum())  # accept while u < p / q
    if n == k:
        return n, int(torch.multinomial(target_probs[k], 1, generator=generator))
    residual = (target_probs[n] - draft_probs[n]).clamp(min=0)  # [vocab]
    total = residual.sum()
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), target_probs[n])
    return n, int(torch.multinomial(residual, 1, generator=generator))


# ----------------------------------------------------------------------------------------------
# Acceptance: tau and acceptance by position, held-out tau, the lossless check's near-ties


def prompt_lookup_tau(stats_list: list[dict]) -> float | None:
    """Prompt lookup's tau over `prompt_lookup_generate` stats: tokens committed by the forwards after
    the first, per such forward (module docstring); None if no prompt needed one."""
    forwards = sum(s["verify_forwards"] for s in stats_list)
    return sum(s["committed_after_first"] for s in stats_list) / forwards if forwards else None


def summarize_speculative(stats_list: list[dict], block_size: int) -> dict:
    """Aggregate `speculative_generate` stats over prompts.

    tau = all verify-committed tokens / all verify forwards (a mean over steps, not over prompts).
    acceptance_rate_by_position[k-1] = fraction of verify forwards with >= k accepted drafts.
    mean_proposed_drafts = drafts verified per verify forward (block_size - 1 unless a confidence
    gate cut proposals short).
    """
    forwards = sum(s["verify_forwards"] for s in stats_list)
    committed = sum(sum(s["committed"]) for s in stats_list)
    accepted = [n for s in stats_list for n in s["accepted_drafts"]]
    histogram = [0] * block_size
    for n in accepted:
        histogram[n] += 1
    rates = [sum(n >= k for n in accepted) / forwards if forwards else None for k in range(1, block_size)]
    return {
        "acceptance_length": committed / forwards if forwards else None,
        "acceptance_rate_by_position": rates,
        "accepted_drafts_histogram": histogram,  # verify forwards that accepted 0, 1, ..., B-1 drafts
        "mean_accepted_drafts": sum(accepted) / forwards if forwards else None,
        "mean_proposed_drafts": sum(sum(s["proposed_drafts"]) for s in stats_list) / forwards if forwards else None,
        "num_prompts": len(stats_list),
        "generated_tokens": sum(s["generated_tokens"] for s in stats_list),
        "verify_forwards": forwards,
        "verify_committed_tokens": committed,
    }


@torch.no_grad()
def evaluate_acceptance(
    target,
    drafter,
    tokenizer,
    prompts: list[list[dict]],
    max_new_tokens: int,
    block_size: int | None = None,
    eos_token_ids=None,
    chat_template_kwargs: dict | None = None,
    progress: bool = False,
    kv_cache: str = "auto",
    cuda_graphs: str = "auto",
    prompt_lookup: bool = False,
) -> dict:
    """tau of `drafter` on `prompts` by real speculative decoding (for held-out evaluation in training).

    Args:
        target: the FULL target (not truncated by `TargetFeatureExtractor(truncate=True)`: verification
            needs its logits), on the device where it should run.
        drafter: the drafter module (unwrapped from DeepSpeed / DDP) on the same device, in the target's
            dtype, with `attach_target(embed_tokens, lm_head)` done. Put in eval mode for the call;
            its previous mode is restored.
        prompts: message lists, e.g. from `dflash_data.load_prompts`.
        eos_token_ids: default the tokenizer's and target generation_config's EOS ids.
        kv_cache, cuda_graphs: as `--kv_cache` / `--cuda_graphs` of the CLI (`resolve_kv_cache`):
            by default static caches replayed from CUDA graphs on a GPU, dynamic on a CPU.
        prompt_lookup: also decode every prompt with transformers' prompt lookup (the CLI's
            defaults: 10 candidates, 2-grams) and return its tau, the baseline a drafter must beat.
    Returns:
        `summarize_speculative`'s dict plus "speculative_tokens_per_s", "seconds" (the drafter's
        decoding) and, with `prompt_lookup`, "prompt_lookup_acceptance_length".
    """
    check_drafter_matches_target(target, drafter)
    block_size = resolve_block_size(drafter, block_size)
    if eos_token_ids is None:
        eos_token_ids = eos_token_ids_of(tokenizer, target)
    device = target.get_input_embeddings().weight.device
    encoded = [encode_prompt(tokenizer, messages, chat_template_kwargs, device) for messages in prompts]
    kv_cache, graphs = resolve_kv_cache(kv_cache, cuda_graphs, device, target)
    max_length = max(ids.shape[1] for ids in encoded) + max_new_tokens + drafter.config.block_size
    decoder = Decoder(target, drafter, kv_cache, max_length, graphs)
    stats_list = []
    synchronize(device)
    start = time.perf_counter()
    try:
        with eval_mode(drafter):
            for input_ids in tqdm(encoded, desc="tau eval", disable=not progress, leave=False):
                _, stats = speculative_generate(target, drafter, input_ids, max_new_tokens, block_size, eos_token_ids, decoder)
                stats_list.append(stats)
    finally:
        decoder.close()
    synchronize(device)
    seconds = time.perf_counter() - start
    summary = summarize_speculative(stats_list, block_size)
    summary["seconds"] = seconds
    summary["speculative_tokens_per_s"] = summary["generated_tokens"] / seconds if seconds > 0 else None
    if prompt_lookup:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        lookup = [prompt_lookup_generate(target, input_ids, max_new_tokens, eos_token_ids, pad_token_id)[1] for input_ids in encoded]
        summary["prompt_lookup_acceptance_length"] = prompt_lookup_tau(lookup)
    return summary


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix); None if equal."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


@torch.no_grad()
def logit_margin(target, input_ids: torch.Tensor, prefix: list[int]) -> tuple[float, float]:
    """Top-1 minus top-2 of the target's logits for the token after prompt + prefix (one uncached
    forward), and the top-1 logit itself. Returns (margin, top-1 logit).

    A margin near 0 at a divergence is a numerical near-tie (e.g. bf16 batched vs one-token
    matmuls), not a verification bug (`near_tie_bound`)."""
    ids = torch.cat([input_ids, torch.tensor([prefix], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()  # [vocab]
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]), float(top2[0])


NEAR_TIE_ULPS = 4
NEAR_TIE_RULE = (
    f"a divergence is a near-tie when the target's top-1 minus top-2 logit after the common prefix is at most "
    f"{NEAR_TIE_ULPS} units in the last place of the top-1 logit in the evaluation dtype (bf16 at a logit of 20: "
    f"{NEAR_TIE_ULPS} x 0.125 = 0.5): the 16-token verify forward and a one-token decode step may then round to "
    f"different argmaxes. Any other divergence is a decoding bug"
)


def near_tie_bound(top_logit: float, dtype: torch.dtype) -> float:
    """The largest logit margin that `NEAR_TIE_RULE` counts as a near-tie: NEAR_TIE_ULPS spacings of
    `dtype`'s floating-point grid at |top_logit| (bf16: 2^-7 of the power of two below it; fp32: 2^-23)."""
    magnitude = max(abs(top_logit), torch.finfo(dtype).tiny)
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))
