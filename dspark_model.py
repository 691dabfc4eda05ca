"""The DSpark drafter: a DFlash drafter (dflash_model.py) whose anchor is the first prediction slot,
with a Markov head that adds a bigram term to each slot's logits and a confidence head that
predicts each slot's acceptance.

Reference: "DSpark" (arXiv 2607.05147) and DeepSeek's DeepSpec, the reference implementation
(`deepspec/modeling/dspark/{common,markov_head}.py`, `qwen3/modeling.py`, `deepspec/eval/dspark/
draft_ops.py`); the checkpoint layout is DeepSpec's own `save_pretrained`, which vLLM
(`qwen3_dspark.py`), SGLang (`qwen3_dspark.py`) and llama.cpp (`DSparkModel`, `--spec-type
draft-dspark`) load. The training objective is `dflash_loss.dspark_loss` (training runs its chunked
form, `dflash_loss.chunked_dspark_loss`).

Block semantics (the one difference from DFlash): a block of size gamma is the anchor and gamma-1
mask tokens at positions a..a+gamma-1, and EVERY slot is a prediction: slot k predicts
token[a+k+1]. So gamma inputs give gamma drafts (gamma + 1 tokens verified), where a DFlash block
of B gives B-1; at equal drafts per verify, DSpark gamma matches DFlash B = gamma + 1. The backbone
(layers, context fusion, training mask, KV cache) is DFlash's unchanged; only which output is read
for which token differs.

Reading order: config -> pure helpers (labels and Markov predecessors of the blocks) -> the two
heads -> the drafter.

Notation used in every shape comment (dflash_model.py's, and):
    gamma   DSpark block size = drafts per block (`config.block_size`)
    V       vocabulary size            r       Markov rank
"""

import os
import re
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from huggingface_hub.dataclasses import strict
from safetensors.torch import save_file
from transformers import initialization as hf_init

from dflash_masks import block_labels
from dflash_model import DFlashConfig, DFlashDraftModel, sample_index, sampling_probs

# ----------------------------------------------------------------------------------------------
# Config

MARKOV_HEAD_TYPES = ("vanilla",)  # the only head the engines serve (llama.cpp's converter rejects others)

# Keys DeepSpec's layout has at the top level; this config keeps the first two in dflash_config as DFlash's does.
TOP_LEVEL_KEYS = ("mask_token_id", "target_layer_ids", "sample_from_anchor")
# The heads' keys, top-level in DeepSpec's layout and in speculators' `dspark` one alike.
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

# Copies of the target's tables in the export (`export_weights`); a loaded drafter attaches the target's own instead.
TARGET_TABLES = ("embed_tokens.weight", "lm_head.weight")


@strict
class DSparkConfig(DFlashConfig):
    """DSpark drafter config: a `DFlashConfig` plus the Markov and confidence heads.

    `block_size` is gamma, the number of drafts per block: the block is the anchor and gamma-1
    mask tokens, and the anchor's slot is the first prediction slot (slot k predicts
    token[a+k+1]). A DFlash block of B drafts B-1 tokens; DSpark gamma drafts gamma.

    The saved config.json is DeepSpec's layout plus every key an engine reads with a risky default
    (`to_dict`): `architectures ["Qwen3DSparkModel"]`, top-level `mask_token_id`,
    `target_layer_ids` (0-based, also kept in `dflash_config`), `num_target_layers`, `block_size`,
    `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
    `num_anchors` (DeepSpec's own class requires it), `sample_from_anchor: true` (llama.cpp reads
    a missing key as false in some layouts) and an explicit `head_dim`. A DeepSpec config.json
    (top-level `mask_token_id` / `target_layer_ids`, no `dflash_config`) loads as it is.

    Raises:
        ValueError: as `DFlashConfig`, or on a Markov head type other than "vanilla", a negative
            rank, a confidence head on the Markov features without a Markov head, or
            `sample_from_anchor` false (a DSpark block always starts predicting at the anchor).
    """

    markov_rank: int = 256  # r of W1 (V x r) and W2 (r -> V); 0: no Markov head. DeepSpec's recipe: 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # its input is [h_k; W1[prev_k]] (H + r); SGLang rejects false
    num_anchors: int = 512  # anchors per sample in training; DeepSpec's loader requires the key

    def __post_init__(self, **kwargs):
        # DeepSpec's layout keeps these at the top level; DFlashConfig reads them from dflash_config.
        top = {name: kwargs.pop(name) for name in TOP_LEVEL_KEYS if name in kwargs}
        if top.pop("sample_from_anchor", True) is False:
            raise ValueError(
                "sample_from_anchor is false in this DSpark config: a DSpark block predicts from the anchor's "
                "slot on; a config with false is a DFlash drafter, load it as one"
            )
        if top:
            self.dflash_config = {**top, **(self.dflash_config or {})}
        super().__post_init__(**kwargs)
        self.architectures = ["Qwen3DSparkModel"]
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {self.markov_head_type!r} is not served by the engines; use 'vanilla'")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0: no Markov head), got {self.markov_rank}; pass --markov_rank 256")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "the confidence head reads the Markov features [h; W1[prev]], but markov_rank is 0: pass "
                "--markov_rank > 0, or turn the confidence head off"
            )

    def to_dict(self) -> dict:
        """The config as saved: DFlash's keys plus DeepSpec's top-level ones (see the class docstring)."""
        output = super().to_dict()
        if self.dflash_config is not None:
            output["mask_token_id"] = self.mask_token_id
            output["target_layer_ids"] = self.target_layer_ids
        output["sample_from_anchor"] = True
        output["head_dim"] = self.head_dim
        return output


# ----------------------------------------------------------------------------------------------
# Pure helpers: labels, validity and Markov predecessors of the blocks (training)


def dspark_block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of DSpark block slots k = 0..gamma-1: the block at anchor a predicts `token[a + k + 1]`.

    They are DFlash's labels of a block of gamma + 1 (`dflash_masks.block_labels`), whose positions
    1..gamma are these slots. Validity is DeepSpec's: a contiguous prefix, cut at the first label
    that is past the sequence end or outside the loss mask (and all false for a padded anchor
    slot), because a draft after a rejected one is never verified. Worked example: loss mask
    labels [1, 1, 0, 1] -> valid [1, 1, 0, 0].

    Args:
        input_ids: [batch, S] int64; loss_mask: [batch, S] bool (or 0/1).
        anchors, anchor_valid: [batch, N] from `dflash_masks.sample_anchors`.
        block_size: gamma.
    Returns:
        labels: [batch, N, gamma] int64 (arbitrary where invalid).
        label_valid: [batch, N, gamma] bool, a prefix along the last dim.
    """
    labels, valid = block_labels(input_ids, loss_mask.bool(), anchors, anchor_valid, block_size + 1)
    return labels, valid.to(torch.int32).cumprod(dim=-1).bool()


def markov_predecessor_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Teacher-forced Markov predecessors of block slots k = 0..gamma-1: `token[a + k]`, so the
    anchor itself for slot 0 (where drafting starts from it too) and the previous slot's label after.

    Args:
        input_ids: [batch, S] int64; anchors: [batch, N] int64.
    Returns:
        [batch, N, gamma] int64 (positions past the sequence end repeat its last token; their labels
        are invalid).
    """
    seq_len = input_ids.shape[1]
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [batch, N, gamma]: a + k
    return input_ids.gather(1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions)


# ----------------------------------------------------------------------------------------------
# Heads (state_dict names as DeepSpec's Qwen3DSparkModel saves them and the engines load them)


class MarkovHead(nn.Module):
    """The "vanilla" Markov head: a rank-r bigram term `W2(W1[prev])` added to a slot's logits.

    `markov_w1`: nn.Embedding(V, r); `markov_w2`: nn.Linear(r, V, bias=False). 2 V r parameters:
    at Qwen3's vocabulary and r = 256, 78M.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [...] int64 -> the logit term [..., V] in the head's dtype."""
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    """Predicted acceptance of each slot: `proj([h_k; W1[prev_k]])`, a logit (sigmoid gives the
    probability), with `proj` = nn.Linear(H + r, 1) with bias (H + 0 without the Markov features)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        extra = config.markov_rank if config.confidence_head_with_markov else 0
        self.proj = nn.Linear(config.hidden_size + extra, 1)

    def forward(self, hidden: torch.Tensor, markov_features: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., H] (after `norm`), markov_features [..., r] or None -> [...] float32 logits."""
        x = hidden if markov_features is None else torch.cat([hidden, markov_features.to(hidden.dtype)], dim=-1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


# ----------------------------------------------------------------------------------------------
# The drafter


class DSparkDraftModel(DFlashDraftModel):
    """The DSpark drafter: DFlash's backbone with the anchor as the first prediction slot, a
    `MarkovHead` and a `ConfidenceHead`.

    The training forward is DFlash's (same masks, flex and SDPA paths), returning the final hidden
    states of all gamma slots, [batch, N, gamma, hidden]; `block_logits` and `confidence_logits`
    turn them into the teacher-forced logits and confidence logits of DSpark's objective
    (`dflash_loss.dspark_loss`; training runs `dflash_loss.chunked_dspark_loss`, which makes the same
    logits from the hidden states in chunks of rows). Drafting walks the block left to right through the Markov head (`markov_walk`).
    Trainable beyond DFlash's: `markov_head`, `confidence_head`. The embedding and LM head are the
    target's, attached with `attach_target` (the export writes copies: `export_weights`).
    """

    config_class = DSparkConfig
    _keys_to_ignore_on_load_unexpected = [f"^{re.escape(name)}$" for name in TARGET_TABLES]  # from_pretrained: no load report for them

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, MarkovHead):  # DeepSpec: N(0, initializer_range) for both factors
            hf_init.normal_(module.markov_w1.weight, mean=0.0, std=self.config.initializer_range)
            hf_init.normal_(module.markov_w2.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, ConfidenceHead):  # its weight is an nn.Linear's, done above
            hf_init.zeros_(module.proj.bias)
        else:
            super()._init_weights(module)

    # ---- the heads on the backbone's hidden states ------------------------------------------

    def markov_features(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """W1[prev] [..., r] for prev_ids [...] int64, or None without a Markov head."""
        return None if self.markov_head is None else self.markov_head.markov_w1(prev_ids)

    def block_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Logits of slots given their predecessors: `lm_head(h_k)` (scaled and capped as the engines
        do, `compute_logits`) plus the Markov term `W2(W1[prev_k])`.

        Args:
            hidden: [..., hidden] after `norm` (the training forward's [batch, N, gamma, hidden]).
            prev_ids: [...] int64: teacher-forced in training (`markov_predecessor_ids`), the
                drafted tokens at inference.
        Returns:
            [..., V] in the LM head's dtype: all rows' logits at once, the reference `dflash_loss.dspark_loss`
            takes. Training makes the same logits in chunks of valid rows from the hidden states instead
            (`dflash_loss.chunked_dspark_loss`), never [batch, N, gamma, V] at once.
        """
        logits = self.compute_logits(hidden)
        return logits if self.markov_head is None else logits + self.markov_head(prev_ids).to(logits.dtype)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The confidence head on [h_k; W1[prev_k]]: hidden [..., hidden], prev_ids [...] int64 ->
        [...] float32 logits. Raises ValueError when the config has no confidence head."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head is false)")
        features = self.markov_features(prev_ids) if self.config.confidence_head_with_markov else None
        return self.confidence_head(hidden, features)

    # ---- inference ---------------------------------------------------------------------------

    @torch.no_grad()
    def draft_hidden(self, cache, anchor_token: torch.Tensor) -> torch.Tensor:
        """One draft pass (`DFlashDraftModel.draft_hidden`): the final hidden states of ALL gamma block
        slots, the anchor's slot included (it predicts the first draft). [batch] int64 -> [batch, gamma, hidden]."""
        return super().draft_hidden(cache, anchor_token, first_slot=0)

    @torch.no_grad()
    def markov_walk(
        self, hidden: torch.Tensor, anchor_token: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, uniform: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a block left to right through the Markov head: `prev_0` = the anchor,
        `logits_k = lm_head(h_k) + W2(W1[prev_k])`, `x_k` = argmax (temperature 0) or a sample from
        `sampling_probs(logits_k, temperature, top_p)`, `prev_{k+1} = x_k`. No host syncs.

        Args:
            hidden: [batch, gamma, hidden], `draft_hidden`'s output.
            anchor_token: [batch] int64.
            temperature: 0 for greedy, else > 0; top_p: nucleus mass in (0, 1].
            uniform: [batch, gamma] in [0, 1), one draw per slot (`sample_index`); needed when temperature > 0.
        Returns:
            tokens [batch, gamma] int64; logits [batch, gamma, V] (with the Markov term of the drafted
            predecessors); q [batch, gamma, V] float32, the distribution each token was drawn from
            given the tokens before it (one-hot at temperature 0): verification's q.
        """
        base = self.compute_logits(hidden)  # [batch, gamma, V]
        prev = anchor_token
        tokens, logits, rows = [], [], []
        for k in range(hidden.shape[1]):
            step = base[:, k] if self.markov_head is None else base[:, k] + self.markov_head(prev).to(base.dtype)  # [batch, V]
            if temperature == 0:
                prev = step.argmax(dim=-1)
                rows.append(nn.functional.one_hot(prev, step.shape[-1]).float())
            else:
                q = sampling_probs(step, temperature, top_p)  # [batch, V]
                prev = sample_index(q, uniform[:, k])
                rows.append(q)
            tokens.append(prev)
            logits.append(step)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), torch.stack(rows, dim=1)

    @torch.no_grad()
    def draft_block(self, cache, anchor_token: torch.Tensor) -> torch.Tensor:
        """One greedy draft pass: anchor_token [batch] int64 -> [batch, gamma] int64 (`markov_walk` at temperature 0)."""
        return self.markov_walk(self.draft_hidden(cache, anchor_token), anchor_token)[0]

    @torch.no_grad()
    def draft_sample(
        self, cache, anchor_token: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sampled draft pass (`markov_walk`); no random state of its own.

        Args:
            anchor_token: [batch] int64; temperature > 0; top_p in (0, 1]; uniform: [batch, gamma] in [0, 1).
        Returns:
            tokens [batch, gamma] int64 and q [batch, gamma, V] float32 (verification's q).
        Raises:
            ValueError: on temperature <= 0 (use `draft_block`).
        """
        if not temperature > 0:
            raise ValueError(f"draft_sample needs --temperature > 0, got {temperature}; use draft_block for greedy drafts")
        tokens, _, q = self.markov_walk(self.draft_hidden(cache, anchor_token), anchor_token, temperature, top_p, uniform)
        return tokens, q

    def draft_probs(self, cache, anchor_token: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
        """Not defined for DSpark: each slot's distribution depends on the draft before it, so q comes
        with the sampled path (`draft_sample`)."""
        raise ValueError("a DSpark drafter samples its block through the Markov head: call draft_sample, which returns the tokens with their q rows")

    @torch.no_grad()
    def draft_confidence(self, hidden: torch.Tensor, anchor_token: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Confidence logits of a drafted block, predecessors `[anchor, tokens[:-1]]`: hidden [batch,
        gamma, hidden], anchor_token [batch], tokens [batch, gamma] -> [batch, gamma] float32."""
        prev = torch.cat([anchor_token[:, None], tokens[:, :-1]], dim=1)  # [batch, gamma]
        return self.confidence_logits(hidden, prev)

    # ---- export ------------------------------------------------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The tensors of the DeepSpec-native checkpoint: the drafter's state_dict plus copies of the
        target's `embed_tokens.weight` and `lm_head.weight` (SGLang refuses a DSpark checkpoint
        without them; DeepSpec loads them; vLLM and llama.cpp accept them). CPU, contiguous, no two
        sharing memory (a tied target's head is a copy of its embedding: safetensors refuses shared tensors)."""
        weights = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        embed = weights["embed_tokens.weight"] = self.target_embed_tokens.weight.detach().cpu().contiguous()
        lm_head = self.target_lm_head.weight.detach().cpu().contiguous()
        shared = lm_head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
        weights["lm_head.weight"] = lm_head.clone() if shared else lm_head
        return weights


def save_dspark_export(drafter: DSparkDraftModel, directory: str | Path) -> None:
    """Write the DeepSpec-native checkpoint the engines load: config.json (`DSparkConfig.to_dict`) and
    model.safetensors (`export_weights`: the drafter's tensors plus copies of the target's
    `embed_tokens` / `lm_head`). Written to a temp directory beside it and renamed into place, so
    a crash never leaves a half-written export.

    Serve: vLLM `--speculative-config '{"method": "dspark", "model": DIR, "num_speculative_tokens": gamma}'`;
    SGLang `--speculative-algorithm DSPARK`; llama.cpp `convert_hf_to_gguf.py DIR --target-model-dir
    TARGET`, then `--spec-type draft-dspark --spec-draft-n-max gamma`. llama.cpp b11434 drafts with the
    `embed_tokens` copy as the LM head: for a target with untied embeddings, convert
    `convert_dflash.py --to speculators` of DIR instead (docs/drafters.md, serving).
    """
    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.config.save_pretrained(tmp)  # every key written, defaults included (DFlash's export does the same)
    save_file(drafter.export_weights(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
