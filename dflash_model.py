"""The DFlash drafter: a small block-diffusion model that drafts a whole block of tokens in one
forward pass, conditioned on the target's hidden states. Here are its config, the layers every
drafter of the family shares (attention over the context's and the block's keys, MLP, decoder
layer, the context fusion) and the drafter: its training forward and its draft pass.

Reference: "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv 2602.06036), and the
checkpoint format its released drafters, SGLang and vLLM load (docs/training.md, "The export").

Reading order: config -> pure helpers (each layer's training mask, the logits, sampling) ->
attention dispatch, sequence parallelism, RoPE -> RMSNorm, attention, MLP, decoder layer -> the
context cache -> the drafter. Elsewhere: anchors, blocks, labels and the anchor-block mask in
dflash_masks.py; DFlash2 (convolutions along the block, a candidate selector), built on these
layers, in dflash2_model.py; the training objective (position weights, the loss through the
target's LM head, the tau estimate, DFlash2's selector loss) in dflash_loss.py.

Notation used in every shape comment:
    batch   batch dimension            S       context (sequence) length
    N       anchors (blocks) per row   B       block size
    hidden  hidden size                heads / kv_heads / head_dim   attention sizes
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, Qwen3Config
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_compile import call_compiled_module, get_compiled_flex_attention
from dflash_masks import block_input_ids, block_position_ids, create_anchor_block_mask, dense_anchor_block_mask, position_rule

# ----------------------------------------------------------------------------------------------
# Config


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter, one per drafter layer (the reference recipe).

    Spread evenly from layer 1 to layer L-3: `round(1 + i * (L - 4) / (n - 1))`, i = 0..n-1.
    Worked example: L = 36 target layers, n = 5 drafter layers -> [1, 9, 17, 25, 33].
    Small targets can map two drafter layers to one target layer; duplicates are dropped.

    Args:
        num_target_layers: decoder layers of the target (untruncated), L.
        num_draft_layers: decoder layers of the drafter, n.
    Returns:
        Sorted, unique 0-based decoder-layer indices.
    Raises:
        ValueError: if the target has fewer than 2 layers or n < 1.
    """
    if num_target_layers < 2 or num_draft_layers < 1:
        raise ValueError(
            f"cannot pick target_layer_ids for a target with {num_target_layers} layers and "
            f"{num_draft_layers} drafter layers; pass --target_layer_ids explicitly"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = max(num_target_layers - 4, 0)
    ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return sorted({min(i, num_target_layers - 1) for i in ids})


LAYER_TYPES = ("full_attention", "sliding_attention")

# Shorthands for --layer_types, expanded by `resolve_layer_types`. "last_full" is the layout of the
# drafters engines serve for long-context targets (e.g. 4 sliding + 1 full, window 2048).
LAYER_TYPE_PRESETS = ("all_full", "all_sliding", "last_full")


def resolve_layer_types(layer_types: str | list[str] | None, num_layers: int) -> list[str]:
    """The per-layer attention types of `--layer_types`.

    Args:
        layer_types: None or "all_full" (every layer full attention, the default), "all_sliding",
            "last_full" (every layer sliding but the last, which is full), or an explicit list (or
            comma-separated string) with one of "full_attention" / "sliding_attention" per layer.
        num_layers: drafter layers.
    Returns:
        num_layers strings, each "full_attention" or "sliding_attention".
    Raises:
        ValueError: on an unknown name or a list whose length is not num_layers.
    """
    if layer_types is None or layer_types == "all_full":
        return ["full_attention"] * num_layers
    if layer_types == "all_sliding":
        return ["sliding_attention"] * num_layers
    if layer_types == "last_full":
        return ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    names = [t.strip() for t in layer_types.split(",")] if isinstance(layer_types, str) else [str(t).strip() for t in layer_types]
    bad = sorted({t for t in names if t not in LAYER_TYPES})
    if bad:
        raise ValueError(
            f"--layer_types has unknown entries {bad}: give one of {', '.join(LAYER_TYPE_PRESETS)}, or a comma list of "
            f"{' / '.join(LAYER_TYPES)} with one entry per drafter layer"
        )
    if len(names) != num_layers:
        raise ValueError(
            f"--layer_types lists {len(names)} layers but the drafter has {num_layers} (--num_draft_layers); give one "
            f"entry per layer, or a preset ({', '.join(LAYER_TYPE_PRESETS)})"
        )
    return names


@strict
class DFlashConfig(Qwen3Config):
    """Drafter config: a Qwen3 config plus the DFlash fields that serving engines read (docs/training.md, "The export").

    It stays `model_type = "qwen3"` (a second class registering "qwen3" would collide in
    AutoConfig); the DFlash fields are `block_size`, `num_target_layers` and
    `dflash_config = {"mask_token_id": int, "target_layer_ids": [int, ...]}`, plus, when the target
    needs them, `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` inside
    `dflash_config` (the reference implementation reads all three there, SGLang the last two, the
    DFlash2 drafters' vLLM plugin the first).
    `rope_theta` is written at the top level too, because older loaders read it there, and a scaled
    RoPE (llama3, yarn, dynamic, ...) is also written as the transformers-4 `rope_scaling` field,
    which those loaders read instead of `rope_parameters` (without it they would silently use
    plain RoPE).

    Sliding-window layers: `layer_types` names each layer "full_attention" or "sliding_attention";
    any sliding layer needs `sliding_window` (a query at position q sees keys k with q - k < window)
    and makes `use_sliding_window` true, and `max_window_layers` is always written as the layer
    count, as released drafters do: `Qwen3Config` drops the window unless `use_sliding_window` is
    set, and the layers would then load as full attention. `is_causal` (None by default) overrides
    the engines' default of causal sliding layers and bidirectional full layers (`attention_rule`);
    it is written as `dflash_config.causal` too, and a config with only that key reads it as vLLM does.

    Raises:
        ValueError: on a block size < 2, target layer ids out of range, a mask token id outside the
            target's embedding rows, unknown layer types, sliding layers without a window, or
            non-positive scale fields.
    """

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None
    rope_theta: float | None = None
    # Qwen3Config's default is a 4096-token window; a drafter's window must be given explicitly.
    sliding_window: int | None = None
    is_causal: bool | None = None

    def __post_init__(self, **kwargs):
        # Checkpoints written by transformers 4 carry only the top-level rope_theta.
        if self.rope_parameters is None and self.rope_theta is not None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if "sliding_attention" in self.layer_types:
                self.use_sliding_window = True  # else Qwen3Config sets sliding_window to None
        super().__post_init__(**kwargs)
        self.rope_theta = self.rope_parameters["rope_theta"]
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus at least one drafted token), got {self.block_size}")
        resolve_layer_types(self.layer_types, self.num_hidden_layers)  # validates names and length
        if "sliding_attention" in self.layer_types:
            if self.sliding_window is None or self.sliding_window < 1:
                raise ValueError(
                    f"layer_types has sliding_attention layers but sliding_window is {self.sliding_window}: pass "
                    f"--sliding_window N (tokens a query sees, itself included), e.g. 2048"
                )
        else:
            self.use_sliding_window, self.sliding_window = False, None
        # Only read when layer_types is absent; the layer count makes it say "no layer derived as sliding".
        self.max_window_layers = self.num_hidden_layers
        if self.dflash_config is not None:
            ids = self.dflash_config.get("target_layer_ids")
            if ids is None or "mask_token_id" not in self.dflash_config:
                raise ValueError("dflash_config needs both 'target_layer_ids' and 'mask_token_id'")
            if self.num_target_layers is not None and any(not 0 <= i < self.num_target_layers for i in ids):
                raise ValueError(
                    f"target_layer_ids {ids} out of range for a target with {self.num_target_layers} layers (0-based decoder-layer indices)"
                )
            if not 0 <= self.dflash_config["mask_token_id"] < self.vocab_size:
                raise ValueError(
                    f"mask_token_id {self.dflash_config['mask_token_id']} is not a row of the target's "
                    f"embedding ({self.vocab_size} rows); pass --mask_token_id with an existing token id"
                )
            for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
                value = self.dflash_config.get(name)
                if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                    raise ValueError(f"dflash_config.{name} must be a positive number, got {value!r}")
            if self.is_causal is None and self.dflash_config.get("causal") is not None:
                self.is_causal = bool(self.dflash_config["causal"])  # vLLM reads it when is_causal is unset

    def to_dict(self) -> dict:
        """The config as saved to config.json, with `rope_scaling` beside `rope_parameters` for a
        scaled RoPE, `logit_scale` beside `dflash_config.output_multiplier` (vLLM's DFlash model
        reads the former, the reference and SGLang the latter), and `dflash_config.causal` equal to
        `is_causal` when that is set."""
        output = super().to_dict()
        rope = output.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            # The transformers-4 layout: scaling fields in rope_scaling, rope_theta at the top level.
            output["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if self.dflash_config is not None and self.output_multiplier != 1.0:
            output["logit_scale"] = self.output_multiplier
        if self.dflash_config is not None:
            # vLLM 0.26 and older read causality from dflash_config.causal only, for every layer.
            output["dflash_config"] = {k: v for k, v in output["dflash_config"].items() if k != "causal"}
            if self.is_causal is not None:
                output["dflash_config"]["causal"] = bool(self.is_causal)
        return output

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def mask_token_id(self) -> int:
        return int(self.dflash_config["mask_token_id"])

    @property
    def input_embedding_scale(self) -> float:
        """Factor on the target's embedding rows of the block tokens (Gemma: sqrt(hidden); 1.0 for most targets)."""
        return float((self.dflash_config or {}).get("input_embedding_scale") or 1.0)

    @property
    def output_multiplier(self) -> float:
        """Factor on the drafter's logits before any soft-capping (Granite: 1 / logits_scaling; 1.0 for most targets)."""
        return float((self.dflash_config or {}).get("output_multiplier") or 1.0)

    @property
    def final_logit_softcapping(self) -> float | None:
        """c of the logit cap c * tanh(logits / c) (Gemma-2: 30.0), or None."""
        return (self.dflash_config or {}).get("final_logit_softcapping") or None

    def attention_rule(self, layer_idx: int) -> tuple[bool, int | None]:
        """(causal, window) of decoder layer `layer_idx`, as the engines read the config.

        A sliding layer is causal unless `is_causal` says otherwise, and sees keys at positions
        k with q - k < window (and k - q < window when not causal); a full layer is bidirectional
        unless `is_causal` is true, with no window. Worked example, window 3: a query at position 10
        of a causal sliding layer sees keys 8, 9, 10.
        """
        sliding = self.layer_types[layer_idx] == "sliding_attention"
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return causal, (self.sliding_window if sliding else None)


# ----------------------------------------------------------------------------------------------
# Pure helpers: each layer's training mask (dflash_masks.py builds it), the logits, sampling


def training_masks(config: "DFlashConfig", anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, backend: str) -> list:
    """One training mask per drafter layer, built once per distinct `attention_rule` (a 4 sliding +
    1 full drafter builds two) and shared by the layers with that rule.

    Args:
        backend: "flex" (`create_anchor_block_mask`) or "sdpa" (`dense_anchor_block_mask`).
    Returns:
        [num_hidden_layers] masks, BlockMask or [batch, 1, N*B, S + N*B] bool.
    Raises:
        ValueError: on another backend.
    """
    if backend == "flex":
        build = create_anchor_block_mask
    elif backend == "sdpa":
        build = dense_anchor_block_mask
    else:
        raise ValueError(f"attention_backend must be 'flex' or 'sdpa', got {backend!r}")
    rules = [config.attention_rule(i) for i in range(config.num_hidden_layers)]
    built = {rule: build(anchors, anchor_valid, context_len, config.block_size, *rule) for rule in dict.fromkeys(rules)}
    return [built[rule] for rule in rules]


def scale_and_cap_logits(logits: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """What the engines do to a drafter's logits: `logits * multiplier`, then `c * tanh(logits / c)`
    when `softcap` is c (the reference implementation's order). Identity for (1.0, None).

    Args:
        logits: [..., vocab], any float dtype (kept).
    """
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution tokens are sampled from at temperature T with nucleus top_p: softmax of
    logits / T, restricted to the smallest set of most likely tokens whose mass reaches top_p and
    renormalised. transformers' own warpers do the filtering, so a draft, its verification and
    plain `generate(do_sample=True)` share one definition. Runs without host syncs (CUDA-graph safe).

    Args:
        logits: [..., vocab], any float dtype.
        temperature: > 0.
        top_p: in (0, 1]; 1 keeps every token.
    Returns:
        [..., vocab] float32 probabilities, each row summing to 1.
    Raises:
        ValueError: on temperature <= 0 or top_p outside (0, 1].
    """
    if not temperature > 0 or not 0 < top_p <= 1:
        raise ValueError(f"sampling needs --temperature > 0 and --top_p in (0, 1]; got {temperature} and {top_p}")
    scores = logits.float().reshape(-1, logits.shape[-1])  # [rows, vocab]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).view(logits.shape)


def sample_index(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with given uniform draws, so a sampler runs without random state of its
    own (a CUDA graph can hold it): probs [..., K] float (rows summing to 1), uniform [...] in [0, 1)
    -> [...] int64 indices, index j with probability probs[..., j]. Scaling the draw by the row's
    total keeps rounding from ever picking a zero-probability index."""
    cdf = probs.cumsum(dim=-1)  # [..., K]
    threshold = uniform[..., None] * cdf[..., -1:]
    return (cdf <= threshold).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


# ----------------------------------------------------------------------------------------------
# Attention dispatch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    Args:
        q: [batch, heads, Q, head_dim]; k, v: [batch, kv_heads, KV, head_dim].
        mask: a `BlockMask` (flex_attention, compiled; the first call at a new shape compiles under
            the compile locks), a [batch, 1, Q, KV] bool tensor (SDPA), None (every query sees
            every key, as in a draft pass at inference), or a `SequenceParallelMask` (one rank's
            shard under sequence parallelism: `ulysses_attention`).
    Returns:
        [batch, heads, Q, head_dim].
    """
    if isinstance(mask, SequenceParallelMask):
        return ulysses_attention(q, k, v, mask)
    if isinstance(mask, BlockMask):
        if torch.compiler.is_dynamo_compiling():  # inside a compiled drafter layer: traced into its graph
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        return get_compiled_flex_attention(q.device)(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# ----------------------------------------------------------------------------------------------
# Sequence parallelism (DeepSpeed Ulysses): one sample's step sharded over a group of drafter ranks


@dataclass(frozen=True)
class SequenceParallel:
    """A drafter rank's sequence-parallel group: `size` ranks that train one sample together, each on
    its shard (`shard`) of the context positions and of the anchors' blocks (contiguous, in rank
    order). Made by `dflash_topology.make_sequence_parallel_groups`."""

    group: object  # torch.distributed.ProcessGroup of the `size` ranks
    rank: int  # this rank's place in the group: which shard it holds
    size: int

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous 1/size of `x` along `dim` (a view).
        Raises ValueError when the length is not a multiple of the group size."""
        length = x.shape[dim]
        if length % self.size:
            raise ValueError(
                f"sequence parallelism over {self.size} ranks needs lengths divisible by {self.size}; "
                f"got {length} along dim {dim} of a {list(x.shape)} tensor"
            )
        return x.narrow(dim, self.rank * (length // self.size), length // self.size)


@dataclass(frozen=True)
class SequenceParallelMask:
    """The whole sample's training mask (`training_masks`) with the DeepSpeed Ulysses attention
    (`deepspeed.sequence.layer.DistributedAttention`) of the group; `attention` dispatches on it."""

    mask: BlockMask | torch.Tensor  # over every query and key of the sample: [batch, 1, N*B, S + N*B] or a BlockMask
    ulysses: nn.Module  # DistributedAttention over the group, whose local attention is `_whole_sample_attention`
    size: int  # ranks in the group


def sequence_parallel_masks(masks: list, sequence_parallel: SequenceParallel) -> list:
    """`training_masks`' masks wrapped for Ulysses attention over `sequence_parallel.group`."""
    # Imported here: deepspeed picks its accelerator at import, and the trainer sets it up first.
    # DistributedAttention, not ALST's UlyssesSPAttentionHF: that one asserts queries and keys of one
    # length (a causal LM's), and here the queries are the blocks, the keys the context and the blocks.
    from deepspeed.sequence.layer import DistributedAttention

    # Inputs [batch, T, heads, head_dim]: scatter the heads (dim 2), gather the sequence (dim 1).
    ulysses = DistributedAttention(_whole_sample_attention, sequence_parallel.group, scatter_idx=2, gather_idx=1)
    return [SequenceParallelMask(mask, ulysses, sequence_parallel.size) for mask in masks]


def _whole_sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, context_len: int, size: int) -> torch.Tensor:
    """The local attention of Ulysses, after its all-to-all: every position of the sample, heads/P of
    the heads. q: [batch, N*B, heads/P, head_dim], blocks in rank order = the anchors' order; k, v:
    [batch, P * (S/P + N*B/P), kv_heads/P, head_dim], rank by rank its context shard (context_len =
    S/P positions) then its blocks. The keys are put back in the unsharded layout
    [context 0..S-1 | block 0..N-1], so the whole sample's mask applies as it is.
    Returns [batch, N*B, heads/P, head_dim]."""
    batch, _, kv_heads, head_dim = k.shape
    k, v = (t.view(batch, size, -1, kv_heads, head_dim) for t in (k, v))  # [batch, P, S/P + N*B/P, kv_heads/P, head_dim]
    k, v = (torch.cat([t[:, :, :context_len].flatten(1, 2), t[:, :, context_len:].flatten(1, 2)], dim=1) for t in (k, v))  # [batch, S + N*B, ...]
    # Contiguous [batch, kv_heads/P, S + N*B, head_dim], as the unsharded forward's (a warmed flex graph fits).
    k, v = (t.transpose(1, 2).contiguous() for t in (k, v))
    out = attention(q.transpose(1, 2), k, v, mask)  # [batch, heads/P, N*B, head_dim]
    return out.transpose(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SequenceParallelMask) -> torch.Tensor:
    """`attention` of one rank's shard under sequence parallelism (DeepSpeed Ulysses): all-to-all to
    every position for heads/P of the heads, the whole sample's mask, all-to-all back.

    Args:
        q: [batch, heads, N*B/P, head_dim], this rank's blocks' queries.
        k, v: [batch, kv_heads, S/P + N*B/P, head_dim], this rank's context shard, then its blocks.
    Returns:
        [batch, heads, N*B/P, head_dim].
    """
    context_len = k.shape[2] - q.shape[2]  # S/P: the keys are this rank's context shard, then its blocks (as many as q)
    out = mask.ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, mask.mask, context_len, mask.size)
    return out.transpose(1, 2)  # [batch, heads, N*B/P, head_dim]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE. x: [batch, heads, T, head_dim]; cos, sin: [batch, T, head_dim]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


# ----------------------------------------------------------------------------------------------
# Modules (attribute names copy transformers' Qwen3, so state_dict keys load in vLLM and SGLang)


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DFlashAttention(nn.Module):
    """Attention whose keys/values come from the fused context AND the block (KV injection).

    `K = k_norm(k_proj([ctx; block]))`, `V = v_proj([ctx; block])`, queries from block tokens only.
    The context enters k_proj/v_proj without input_layernorm (it was normalised once by
    `hidden_norm`), which is what the serving engines do.
    """

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of `x`: [batch, T, hidden] -> 2 x [batch, kv_heads, T, head_dim]."""
        batch, t, _ = x.shape
        k = self.k_proj(x).view(batch, t, self.num_kv_heads, self.head_dim)  # [batch, T, kv_heads, head_dim]
        v = self.v_proj(x).view(batch, t, self.num_kv_heads, self.head_dim)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)  # [batch, kv_heads, T, head_dim]
        return k, v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: BlockMask | torch.Tensor | None,
    ) -> torch.Tensor:
        """x: [batch, Q, hidden] block stream (after input_layernorm); cos, sin: [batch, Q, head_dim]
        at block positions; context_k/v: [batch, kv_heads, S, head_dim] -> [batch, Q, hidden]."""
        batch, q_len, _ = x.shape
        q = self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim)  # [batch, Q, heads, head_dim]
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)  # [batch, heads, Q, head_dim]
        block_k, block_v = self.project_kv(x, cos, sin)
        k = torch.cat([context_k, block_k], dim=2)  # [batch, kv_heads, S + Q, head_dim]
        v = torch.cat([context_v, block_v], dim=2)
        out = attention(q, k, v, mask)  # [batch, heads, Q, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))  # [batch, Q, hidden]


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        """x: [batch, Q, hidden] -> [batch, Q, hidden]; see `DFlashAttention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _run_compiled_layer(compiled: nn.Module, index: int, x, cos, sin, context_k, context_v, mask, checkpointed: bool = False) -> torch.Tensor:
    """One call of compiled decoder layer `index` (DFlashDraftModel.compile_layers); its first call at a new
    shape compiles forward and backward under the compile lock (`dflash_compile.call_compiled_module`).
    `checkpointed`: under activation checkpointing (`DFlashDraftModel.checkpoint_layers`)."""
    tensors = (x, cos, sin, context_k, context_v)
    grad = torch.is_grad_enabled()
    key = (
        "drafter_layer",
        index,
        str(x.device),
        x.dtype,
        grad,
        tuple(x.shape),
        tuple(context_k.shape),
        tuple(t.requires_grad for t in tensors),
        type(mask).__name__,
    )
    what = f"drafter layer {index} {'forward+backward' if grad else 'forward'} on {x.device}, {x.dtype}, x {list(x.shape)}, context kv {list(context_k.shape)}"
    return call_compiled_module(compiled, key, what, tensors, mask, checkpointed=checkpointed)


@dataclass
class DFlashContextCache:
    """The drafter's K/V of the context it has seen, per layer, for drafting at inference.

    keys[i], values[i]: [batch, kv_heads, S, head_dim]. Draft passes never write into it, so after
    each draft the cache holds the context only; `crop` cuts it back when the context shrinks.
    A cache is any object with `length`, `keys`, `values`, `extend` and `key_layout` (dflash_decoding.py's
    static cache for CUDA graphs is another).
    """

    keys: list
    values: list

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def crop(self, length: int) -> None:
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

    def extend(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> "DFlashContextCache":
        """A cache grown by the new positions' (k, v) of every layer, each [batch, kv_heads, s_new, head_dim]."""
        if not self.keys:
            return DFlashContextCache(keys=[k for k, _ in kv], values=[v for _, v in kv])
        return DFlashContextCache(
            keys=[torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, kv)],
            values=[torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, kv)],
        )

    def key_layout(self, block_size: int, device) -> tuple[int, torch.Tensor, None]:
        """(the block's first position S, key positions [S + B] of cache then block, None: every key is valid)."""
        return self.length, torch.arange(self.length + block_size, device=device), None


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (arXiv 2602.06036): Qwen3-style layers conditioned on the target's hidden states.

    Trainable: `layers`, `fc` (context fusion), `hidden_norm`, `norm`. The block embedding and the
    LM head are the target's, attached by `attach_target` and held by reference: they are never
    registered as submodules, so they stay out of the drafter's state_dict, optimizer and
    DeepSpeed partitioning, and out of the exported checkpoint (engines borrow the target's).
    """

    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]
    decoder_layer_class = DFlashDecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        hidden = config.hidden_size
        num_features = len(config.target_layer_ids)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # inv_freq is a non-persistent buffer
        self._target_modules = ()  # (embed_tokens, lm_head); a tuple, so nn.Module does not register them
        self._compiled_layers = ()  # torch.compile wrappers of `layers` (compile_layers); a tuple for the same reason
        self._checkpoint_layers = False  # checkpoint_layers
        self._context_chunk_size = 0  # chunk_context
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        else:
            # transformers' own init: it recomputes the RoPE table (rotary_emb.inv_freq, a
            # non-persistent buffer that from_pretrained does not load), in fp32 as in training.
            super()._init_weights(module)

    def attach_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Borrow the target's (frozen) input embedding and LM head by reference."""
        self._target_modules = (embed_tokens, lm_head)

    # Named target_* so that transformers' own embed_tokens / lm_head handling never finds them.
    @property
    def target_embed_tokens(self) -> nn.Module:
        if not self._target_modules:
            raise RuntimeError("call drafter.attach_target(embed_tokens, lm_head) with the target's modules first")
        return self._target_modules[0]

    @property
    def target_lm_head(self) -> nn.Module:
        if not self._target_modules:
            raise RuntimeError("call drafter.attach_target(embed_tokens, lm_head) with the target's modules first")
        return self._target_modules[1]

    def compile_layers(self, enabled: bool = True) -> None:
        """Run the decoder layers of the training forward through torch.compile (or not).

        dynamic=False: one static graph per shape, like flex's; flex_attention is traced into the
        layer's graph. The first forward at each new shape (per layer, grad or not) compiles and runs
        forward and backward on clones under the compile lock (`_run_compiled_layer`), so no
        compile ever happens outside the lock, including AOTAutograd's lazy backward compile in
        autograd's thread. Inference passes (`extend_context`, `draft_block`) stay eager.
        Measured at Qwen3-8B shapes on an H200 (bench_dflash.py): 83.8 -> 70.2 ms/sample.
        """
        if enabled and not self._compiled_layers:
            self._compiled_layers = tuple(torch.compile(layer, dynamic=False) for layer in self.layers)
        elif not enabled:
            self._compiled_layers = ()

    def checkpoint_layers(self, enabled: bool = True) -> None:
        """Activation checkpointing of the decoder layers in the training forward (or not): each layer
        keeps only its input for backward and runs its forward again there. A layer's activations
        are its block stream's, N*B tokens wide (at 512 anchors x 16, Qwen3-8B shapes: 1-2 GB per
        layer in bf16, the MLP's [N*B, intermediate] ones most of it), whatever the context length;
        checkpointing trades that memory for one more forward of every layer (~+25% of the drafter's
        step). Compiled layers stay compiled (`_run_compiled_layer`)."""
        self._checkpoint_layers = enabled

    def chunk_context(self, chunk_size: int) -> None:
        """Compute the context path of the training forward (`context_kv`: fc, hidden_norm and every
        layer's K/V projection) over chunks of `chunk_size` positions under activation checkpointing
        (0: whole, and its intermediates kept for backward). Only the fused context's K/V
        ([batch, kv_heads, S, head_dim] per layer) stay; the fp32 norm and RoPE intermediates of a
        chunk exist during its forward and again in backward. The result is the same function.
        What it saves grows with S: hidden_norm's and every layer's k_norm / RoPE intermediates, which
        at Qwen3-8B shapes in bf16 are ~66 of the ~146 KB per context token backward keeps (the rest:
        the features, 40 KB, and the K/V): 4.1 GB at 64k tokens (counted with saved-tensor hooks on a
        CPU at 1/8 of Qwen3-8B's widths, times 8). Costs one more forward of the context path."""
        if chunk_size < 0:
            raise ValueError(f"context chunk size must be >= 0 (0 = whole), got {chunk_size}")
        self._context_chunk_size = chunk_size

    def context_kv(self, context_features: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context's keys and values of every layer: fc and hidden_norm once (`fuse_context`),
        then each layer's `project_kv` at the context positions.

        Args:
            context_features: [batch, T, len(target_layer_ids) * hidden] (any float dtype).
            position_ids: [batch, T] int64, their absolute positions.
        Returns:
            [num_hidden_layers] x (k, v), each [batch, kv_heads, T, head_dim].
        """
        context = self.fuse_context(context_features)  # [batch, T, hidden]
        cos, sin = self._rope(context, position_ids)  # [batch, T, head_dim]
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def fuse_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """[batch, S, len(target_layer_ids) * hidden] -> [batch, S, hidden]: fc, then hidden_norm."""
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(x, position_ids)  # 2 x [batch, T, head_dim]

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Block token ids [batch, T] int64 -> [batch, T, hidden] in the drafter's dtype: rows of the
        target's embedding table times `config.input_embedding_scale`.

        The table is read directly (`F.embedding`), never through the target's embedding module,
        because that is what the engines do: a module that scales inside its forward (Gemma's)
        would otherwise be scaled twice, or once in training and not at all when served.
        """
        x = F.embedding(block_ids, self.target_embed_tokens.weight)  # [batch, T, hidden], the table's dtype
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        return x.to(self.fc.weight.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states [..., hidden] (after `norm`) -> logits [..., vocab] in the head's dtype:
        the target's LM head, times `config.output_multiplier`, then capped with
        c * tanh(logits / c) when `config.final_logit_softcapping` is c. The training loss applies the
        same two steps to its logits (`weighted_block_loss`).
        """
        logits = self.target_lm_head(hidden)
        return scale_and_cap_logits(logits, self.config.output_multiplier, self.config.final_logit_softcapping)

    def forward(
        self,
        context_features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        attention_backend: str = "sdpa",
        sequence_parallel: SequenceParallel | None = None,
    ) -> torch.Tensor:
        """Training forward: every anchor's block in one pass, under the training mask (`anchor_block_mask_mod`,
        with each layer's `attention_rule`; `training_masks` builds one mask per distinct rule).

        With `sequence_parallel`, every rank of the group passes the same whole sample and anchors;
        each computes its shard (`SequenceParallel.shard`) of the context positions (their fc,
        K/V) and of the anchors' blocks, and attention runs through DeepSpeed Ulysses
        (`ulysses_attention`) under the whole sample's mask. Decoder layers then run eagerly
        (flex_attention stays compiled): the all-to-alls are not traced into a compiled layer.

        Args:
            context_features: [batch, S, len(target_layer_ids) * hidden], the target's layer
                outputs at every position (any float dtype; cast to the drafter's).
            input_ids: [batch, S] int64, the tokens the features belong to.
            anchors, anchor_valid: [batch, N] from `sample_anchors`.
            attention_backend: "flex" (compiled flex_attention with a BlockMask; GPU) or "sdpa"
                (a dense bool mask; CPU and small sizes). Both compute the same function.
            sequence_parallel: the rank's group (`SequenceParallel`), or None for the whole sample here.
        Returns:
            [batch, N, B, hidden]: final hidden states (after `norm`) at every block position;
            position 0 holds the anchor, positions 1..B-1 are the drafted tokens. With
            sequence_parallel: [batch, N/P, B, hidden], this rank's shard of the anchors.
        Memory levers for long samples (the same function): `chunk_context`, `checkpoint_layers`.
        """
        block_size = self.config.block_size
        batch, seq_len = input_ids.shape
        # The masks first: their build's transient memory (create_anchor_block_mask) then adds to nothing of this forward's.
        masks = training_masks(self.config, anchors, anchor_valid, seq_len, attention_backend)  # one per layer, whole sample
        context_positions = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
        if sequence_parallel is not None:  # this rank's shard: S/P context positions, N/P anchors
            context_features, context_positions, anchors = (sequence_parallel.shard(t) for t in (context_features, context_positions, anchors))
            masks = sequence_parallel_masks(masks, sequence_parallel)
        num_anchors = anchors.shape[1]
        context_len = context_features.shape[1]  # S, or this rank's S/P
        chunk = self._context_chunk_size
        if chunk and chunk < context_len and torch.is_grad_enabled():
            parts = [
                checkpoint(
                    self.context_kv, context_features[:, start : start + chunk], context_positions[:, start : start + chunk], use_reentrant=False
                )
                for start in range(0, context_len, chunk)
            ]
            context_kv = [
                (
                    torch.cat([part[i][0] for part in parts], dim=2),  # [batch, kv_heads, S, head_dim]
                    torch.cat([part[i][1] for part in parts], dim=2),
                )
                for i in range(len(self.layers))
            ]
            del parts
        else:
            context_kv = self.context_kv(context_features, context_positions)
        x = self.embed_block(block_input_ids(input_ids, anchors, self.config.mask_token_id, block_size))  # [batch, N*B, hidden]
        cos, sin = self._rope(x, block_position_ids(anchors, block_size))  # [batch, N*B, head_dim]
        checkpointed = self._checkpoint_layers and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            context_k, context_v = context_kv[i]
            if self._compiled_layers and sequence_parallel is None:
                x = _run_compiled_layer(self._compiled_layers[i], i, x, cos, sin, context_k, context_v, masks[i], checkpointed)
            elif checkpointed:
                x = checkpoint(layer, x, cos, sin, context_k, context_v, masks[i], use_reentrant=False)
            else:
                x = layer(x, cos, sin, context_k, context_v, masks[i])
        return self.norm(x).view(batch, num_anchors, block_size, -1)  # [batch, N, B, hidden]

    # ---- inference ---------------------------------------------------------------------------

    @torch.no_grad()
    def extend_context(self, cache, context_features: torch.Tensor):
        """Append new context positions to the drafter's cache.

        Args:
            cache: a `DFlashContextCache` (grown by concatenation), dflash_runners.py's static cache
                (written in place), or None to start a `DFlashContextCache`.
            context_features: [batch, s_new, len(target_layer_ids) * hidden], the target's layer
                outputs for the next s_new positions (cache.length .. cache.length + s_new - 1).
        Returns:
            The extended cache (the same object for a static cache).
        """
        cache = cache if cache is not None else DFlashContextCache(keys=[], values=[])
        start = cache.length
        context = self.fuse_context(context_features)  # [batch, s_new, hidden]
        batch, s_new, _ = context.shape
        positions = torch.arange(start, start + s_new, device=context.device).expand(batch, s_new)
        cos, sin = self._rope(context, positions)
        return cache.extend([layer.self_attn.project_kv(context, cos, sin) for layer in self.layers])

    @torch.no_grad()
    def draft_hidden(self, cache, anchor_token: torch.Tensor, first_slot: int = 1) -> torch.Tensor:
        """One draft pass: the drafter's final hidden states (after `norm`) at block positions 1..B-1
        (`first_slot` 0: every position, the anchor's included, as DSpark reads them).

        The anchor is the last committed token, at position `cache.length` (the context holds the
        target features of every token before it, exactly as in training where a block sees
        `kv < anchor`). A full layer sees all cached context and is bidirectional inside the block;
        a layer with a causal or windowed `attention_rule` applies it at the absolute positions
        (context keys 0..S-1, block S..S+B-1), as in training. The cache is not written, so it
        stays cut back to the context.

        With dflash_runners.py's static cache the pass attends over all `max_length` cached positions
        with the stale ones masked out, and takes the context length from a device tensor, so it
        can be captured once as a CUDA graph and replayed at every length (no host sync).

        Args:
            cache: the drafter's context cache, length S.
            anchor_token: [batch] int64.
            first_slot: the first block position returned.
        Returns:
            [batch, B - first_slot, hidden] in the drafter's dtype.
        """
        block_size = self.config.block_size
        batch = anchor_token.shape[0]
        block = torch.full((batch, block_size), self.config.mask_token_id, dtype=torch.long, device=anchor_token.device)
        block[:, 0] = anchor_token
        x = self.embed_block(block)  # [batch, B, hidden]
        device = x.device
        offsets = torch.arange(block_size, device=device)
        start, key_positions, key_valid = cache.key_layout(block_size, device)  # [KV] each; key_valid None: all
        query_positions = start + offsets  # [B]
        masks = {}
        for rule in dict.fromkeys(self.config.attention_rule(i) for i in range(self.config.num_hidden_layers)):
            mask = key_valid
            if rule != (False, None):
                visible = position_rule(query_positions[:, None], key_positions[None, :], *rule)  # [B, KV]
                mask = visible if mask is None else visible & mask
            masks[rule] = None if mask is None else mask.expand(batch, 1, block_size, -1)  # [batch, 1, B, KV]
        cos, sin = self._rope(x, query_positions.expand(batch, block_size))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.keys[i], cache.values[i], masks[self.config.attention_rule(i)])
        return self.norm(x[:, first_slot:])  # [batch, B - first_slot, hidden]

    @torch.no_grad()
    def draft_logits(self, cache, anchor_token: torch.Tensor) -> torch.Tensor:
        """One draft pass (`draft_hidden`): anchor_token [batch] int64 -> [batch, B-1, vocab] logits in
        the LM head's dtype, scaled and capped as the engines do (`compute_logits`)."""
        return self.compute_logits(self.draft_hidden(cache, anchor_token))

    @torch.no_grad()
    def draft_block(self, cache, anchor_token: torch.Tensor) -> torch.Tensor:
        """One greedy draft pass (`draft_logits`): anchor_token [batch] int64 -> [batch, B-1] int64 argmax tokens."""
        return self.draft_logits(cache, anchor_token).argmax(dim=-1)

    @torch.no_grad()
    def draft_probs(self, cache, anchor_token: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
        """One draft pass for sampling (`draft_logits`): the drafter's distribution q at block positions 1..B-1.

        Args:
            anchor_token: [batch] int64.
            temperature: > 0; top_p: nucleus mass in (0, 1] (`sampling_probs`).
        Returns:
            [batch, B-1, vocab] float32, each row summing to 1; no host sync (CUDA-graph safe).
        """
        return sampling_probs(self.draft_logits(cache, anchor_token), temperature, top_p)
