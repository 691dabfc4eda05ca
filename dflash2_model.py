"""The DFlash2 drafter: a DFlash drafter (dflash_model.py) whose layers also convolve along the
block and whose drafts come from a candidate selector.

Reference: the definitions of z-lab/dflash's `DFlash2DraftModel` and the checkpoints it loads. The
selector's training objective is in dflash_loss.py (`selector_objective`).

Reading order: config -> pure helpers (the selector's teacher-forced predecessors, the convolution)
-> modules (the convolution pair, the decoder layer, the candidate selector) -> the drafter.

Notation used in every shape comment (dflash_model.py's, and):
    T       block positions in a row (N * B in training, B at inference)
    K       convolution taps, or the selector's candidates per position
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from transformers import initialization as hf_init

from dflash_model import DFlashConfig, DFlashDecoderLayer, DFlashDraftModel, sample_index, sampling_probs

# ----------------------------------------------------------------------------------------------
# Config


# DFlash2's sizes, written inside `dflash_config` (as z-lab's checkpoints have them).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@strict
class DFlash2Config(DFlashConfig):
    """DFlash2 drafter config: a `DFlashConfig` plus the convolution and candidate-selector sizes.

    DFlash2 wraps each layer's attention and MLP in grouped dynamic causal convolutions
    (`GroupedDynamicCausalConv`) and rescores the top-k draft tokens with a candidate selector
    (`CandidateSelector`). Its checkpoint is the layout z-lab's `DFlash2DraftModel` loads:
    `"architectures": ["DFlash2DraftModel"]`, and the four sizes below plus `block_size` inside
    `dflash_config`, where that loader reads them first (it falls back to the top level). So this
    config reads them from `dflash_config` when they are there (a z-lab checkpoint has `block_size`
    only there), and writes them there; `block_size` stays at the top level too, where the DFlash
    loaders read it.

    `is_causal` is read as `DFlashConfig` reads it: a config.json without the key has causal
    sliding layers, as z-lab's loader reads it. The drafters we train write `"is_causal": false`
    (`dflash_target.drafter_config_for_target`): bidirectional inside the window, as z-lab's
    released DFlash2 config says and as speculators defaults (`sliding_window_non_causal` True for
    DFlash2). It changes nothing for full layers.

    Raises:
        ValueError: as `DFlashConfig`, or on a kernel longer than the block, a group size that does
            not divide hidden_size, a rank < 1, or selector_top_k outside 1..vocab_size.
    """

    # Each default is both what z-lab ships (z-lab/dflash tests/fixtures/dflash2-config.json, the
    # config of a released DFlash2 drafter) and speculators' default (DFlash2SpeculatorConfig in
    # speculators/models/dflash2/config.py); block_size keeps DFlashConfig's 16, z-lab's value too.
    conv_kernel_size: int = 2  # taps of each convolution: a position mixes itself and its predecessor
    conv_group_size: int = 16  # channels that share one per-token kernel weight
    selector_rank: int = 256  # width of the selector's codebooks
    selector_top_k: int = 16  # draft-logit candidates the selector rescores per position

    def __post_init__(self, **kwargs):
        if self.dflash_config is not None:
            # Where z-lab's loader looks first; a checkpoint of ours has equal values in both places.
            for name in (*DFLASH2_FIELDS, "block_size"):
                if name in self.dflash_config:
                    setattr(self, name, int(self.dflash_config[name]))
        super().__post_init__(**kwargs)
        self.architectures = ["DFlash2DraftModel"]
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} must be in 1..block_size ({self.block_size}): the "
                f"convolution runs inside one block; pass --conv_kernel_size 2 (the released drafters' value)"
            )
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}; pass a --conv_group_size that does, e.g. 16"
            )
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}; pass --selector_rank 256")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} must be in 1..vocab_size ({self.vocab_size}); pass --selector_top_k 16")
        if self.dflash_config is not None:
            self.dflash_config = {**self.dflash_config, "block_size": self.block_size, **{name: getattr(self, name) for name in DFLASH2_FIELDS}}

    def to_dict(self) -> dict:
        """The config as saved: the DFlash2 sizes inside `dflash_config` only (one place to read them)."""
        output = super().to_dict()
        if self.dflash_config is not None:
            for name in DFLASH2_FIELDS:
                output.pop(name, None)
        return output


# ----------------------------------------------------------------------------------------------
# Pure helpers: the selector's teacher-forced predecessors, the convolution along the block


def selector_predecessor_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Teacher-forced predecessors of block positions k = 1..B-1 for DFlash2's candidate selector:
    `token[a + k - 1]`, so the anchor itself for k = 1 (where drafting starts from it too).

    Args:
        input_ids: [batch, S] int64.
        anchors: [batch, N] int64.
    Returns:
        [batch, N, B-1] int64 (positions past the sequence end repeat its last token; their labels
        are invalid).
    """
    seq_len = input_ids.shape[1]
    positions = anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)  # [batch, N, B-1]
    return input_ids.gather(1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions)


def grouped_dynamic_causal_conv(x: torch.Tensor, base_kernel: torch.Tensor, dynamic_kernel: torch.Tensor, block_size: int) -> torch.Tensor:
    """DFlash2's convolution: causal along each block, one kernel per token and channel group.

    out[t, c] = sum_{i < K} (base_kernel[i, c] + dynamic_kernel[t, i, c // group_size]) * x[t - i, c],
    with x[t - i] = 0 when t - i lies before the first position of t's block. The blocks are cut
    out before shifting, so a position never sees another block nor a later position: in training
    the N anchor blocks lie end to end in one row (and overlap in absolute positions), at inference
    the row is the one drafted block. The anchor (block position 0) sees only itself, as in the
    reference implementation, whose convolution runs over the block's hidden states alone (the
    context features never enter it). Worked example, K = 2: block position 3 mixes positions 3 and
    2; position 0 mixes only itself; position 0 of the next block does not see this block's last.

    Args:
        x: [batch, T, hidden], T = N * B (blocks end to end), any float dtype.
        base_kernel: [K, hidden], learned per channel.
        dynamic_kernel: [batch, T, K, groups], projected from the hidden state at each t;
            groups = hidden / group_size.
        block_size: B.
    Returns:
        [batch, T, hidden] in x's dtype.
    """
    batch, length, hidden = x.shape
    taps, groups = dynamic_kernel.shape[-2:]
    assert length % block_size == 0, f"{length} positions are not whole blocks of {block_size}"
    num_blocks, group_size = length // block_size, hidden // groups
    blocks = x.view(batch, num_blocks, block_size, groups, group_size)  # [batch, N, B, groups, group_size]
    base = base_kernel.to(x.dtype).view(taps, groups, group_size)  # [K, groups, group_size]
    dynamic = dynamic_kernel.view(batch, num_blocks, block_size, taps, groups, 1)  # [batch, N, B, K, groups, 1]
    out = torch.zeros_like(blocks)
    for i in range(taps):
        shifted = F.pad(blocks[:, :, : block_size - i], (0, 0, 0, 0, i, 0))  # x[t - i] inside the block, else 0
        out = out + (base[i] + dynamic[:, :, :, i]) * shifted
    return out.view(batch, length, hidden)  # [batch, T, hidden]


# ----------------------------------------------------------------------------------------------
# Modules (state_dict names as z-lab's DFlash2DraftModel loads them)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's pair of convolutions around one sublayer (attention or MLP): one mixes the
    sublayer's input, the other its output, both along the block and causally
    (`grouped_dynamic_causal_conv`).

    Each has a learned base kernel per channel plus a per-token kernel per channel group; both
    per-token kernels are projected from the sublayer's (normed) input at that token, so the
    output side's kernel is computed before the sublayer runs (`mix_input` returns it).
    Initialised to the identity (`DFlash2DraftModel._init_weights`), so a fresh DFlash2 drafter
    computes what a DFlash drafter with the same weights computes.

    Weights, as z-lab's DFlash2DraftModel loads them: `base_kernel` [2, K, hidden] (input side,
    output side), `kernel_projection.weight` [2 * K * groups, hidden], its output laid out as
    [side, tap, group].
    """

    def __init__(self, config: "DFlash2Config"):
        super().__init__()
        self.block_size = config.block_size
        self.kernel_size = config.conv_kernel_size
        self.groups = config.hidden_size // config.conv_group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.kernel_size * self.groups, bias=False)

    def mix_input(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [batch, T, hidden] (T whole blocks) -> (h mixed, [batch, T, hidden]; the output side's
        per-token kernel, [batch, T, K, groups])."""
        batch, length, _ = h.shape
        kernels = self.kernel_projection(h).view(batch, length, 2, self.kernel_size, self.groups)  # [batch, T, 2, K, groups]
        mixed = grouped_dynamic_causal_conv(h, self.base_kernel[0], kernels[:, :, 0], self.block_size)
        return mixed, kernels[:, :, 1]

    def mix_output(self, y: torch.Tensor, output_kernel: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [batch, T, hidden] mixed with `mix_input`'s output-side kernel."""
        return grouped_dynamic_causal_conv(y, self.base_kernel[1], output_kernel, self.block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP are each wrapped in a `GroupedDynamicCausalConv`:
    x + conv_out(attn(conv_in(input_layernorm(x)))), then the same around the MLP. The mixed input
    feeds the queries and the block's keys and values; the context's keys and values (computed
    outside the layer from the fused context) are not convolved, as in the reference."""

    def __init__(self, config: "DFlash2Config", layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(config)
        self.mlp_conv = GroupedDynamicCausalConv(config)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        """x: [batch, Q, hidden], Q whole blocks -> [batch, Q, hidden]; see `DFlashAttention.forward`."""
        h, output_kernel = self.attention_conv.mix_input(self.input_layernorm(x))
        x = x + self.attention_conv.mix_output(self.self_attn(h, cos, sin, context_k, context_v, mask), output_kernel)
        h, output_kernel = self.mlp_conv.mix_input(self.post_attention_layernorm(x))
        return x + self.mlp_conv.mix_output(self.mlp(h), output_kernel)


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: rescore the top-k draft tokens of each block position with a
    bilinear predecessor x successor term, walking the block left to right from the anchor.

    score(candidate c at position t | predecessor p) =
        unary[t, c] + < predecessor_codebook[p] * hidden_projection(h_t), successor_codebook[c] >,
    where unary is the drafter's (scaled, capped) logit, h_t its final hidden state at t and p the
    token chosen at t - 1 (the anchor for t = 1). Codebooks are plain [vocab, rank] parameters: in
    z-lab's checkpoints they are stored without a `.weight` suffix (`candidate_selector.
    predecessor_codebook`), which is what this module's state_dict names them.
    """

    def __init__(self, config: "DFlash2Config"):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def forward(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        """Scores of given candidates given their predecessors, for all positions at once (the
        teacher-forced form of the walk; training calls it through the module, so its parameter
        hooks run).

        Args:
            hidden: [..., hidden], the drafter's final hidden states (after `norm`).
            predecessor_ids: [...] int64; candidate_ids: [..., K] int64.
            unary: [..., K], the drafter's logits at candidate_ids.
        Returns:
            [..., K] float32.
        """
        # Looked up as embeddings rather than indexed (`codebook[ids]`): indexing's backward is an
        # index_put_ whose CUDA kernel adds an id's rows one after another, rounding to the codebook's
        # dtype at each add, and the top-K candidates repeat the frequent ids across most positions (127
        # ms of an eager 768 ms DFlash2 step at SmolLM2 shapes on an H100). embedding's backward sums each
        # id's rows in fp32, in parallel segments. The forward is the same; on a CPU in fp32 the gradient
        # too, bit for bit.
        context = F.embedding(predecessor_ids, self.predecessor_codebook) * self.hidden_projection(hidden)  # [..., rank]
        pair = (F.embedding(candidate_ids, self.successor_codebook) @ context[..., None])[..., 0]  # [..., K]
        return unary.float() + pair.float()

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_token: torch.Tensor,
        temperature: float = 0.0,
        top_p: float = 1.0,
        uniform: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft path through one block: at each position take the top-k of the logits, score
        them given the token chosen before, and choose one (the argmax at temperature 0, else a
        sample from `sampling_probs(scores, temperature, top_p)`). No host syncs.

        Args:
            hidden: [batch, T, hidden] at block positions 1..T; logits: [batch, T, vocab] there.
            anchor_token: [batch] int64, the predecessor of position 1.
            temperature: 0 for greedy, else > 0; top_p: nucleus over the K candidates (1 keeps all,
                which is z-lab's q).
            uniform: [batch, T] in [0, 1), the draws for sampling (`sample_index`); needed when
                temperature > 0.
        Returns:
            tokens: [batch, T] int64, the chosen path.
            candidate_ids: [batch, T, K] int64, the top-k per position (most likely first).
            q: [batch, T, K] float32, the distribution each token was drawn from, over candidate_ids
                (one-hot at temperature 0): what verification compares with the target's p.
        """
        unary, candidate_ids = logits.topk(self.top_k, dim=-1)  # [batch, T, K] each, most likely first
        predecessor = anchor_token
        tokens, rows = [], []
        for t in range(hidden.shape[1]):
            scores = self(hidden[:, t], predecessor, candidate_ids[:, t], unary[:, t])  # [batch, K]
            if temperature == 0:
                index = scores.argmax(dim=-1)
                rows.append(F.one_hot(index, self.top_k).float())
            else:
                q = sampling_probs(scores, temperature, top_p)  # [batch, K]
                index = sample_index(q, uniform[:, t])
                rows.append(q)
            predecessor = candidate_ids[:, t].gather(1, index[:, None])[:, 0]  # [batch]
            tokens.append(predecessor)
        return torch.stack(tokens, dim=1), candidate_ids, torch.stack(rows, dim=1)


# ----------------------------------------------------------------------------------------------
# The drafter


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter: a DFlash drafter whose layers convolve along the block
    (`DFlash2DecoderLayer`) and whose drafts come from a `CandidateSelector` walk over the top-k of
    its logits instead of their argmax.

    The training forward is DFlash's (same masks, flex and SDPA paths, compiled layers), returning
    the final hidden states; the selector trains on them through `dflash_loss.selector_objective`.
    Trainable beyond DFlash's: `layers.{i}.attention_conv`, `layers.{i}.mlp_conv` and
    `candidate_selector`. The state_dict keys are the names z-lab's DFlash2DraftModel loads.
    """

    config_class = DFlash2Config
    _no_split_modules = ["DFlash2DecoderLayer"]
    decoder_layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, GroupedDynamicCausalConv):
            # The identity (tap 0 is 1, the rest and every per-token kernel 0), so training starts
            # from the DFlash drafter inside (speculators' GroupedDynamicCausalConv.reset_parameters
            # does the same). transformers' guarded init leaves loaded weights alone.
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            hf_init.copy_(module.base_kernel, identity)
            hf_init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):  # its hidden_projection is an nn.Linear, done above
            hf_init.normal_(module.predecessor_codebook, mean=0.0, std=self.config.initializer_range)
            hf_init.normal_(module.successor_codebook, mean=0.0, std=self.config.initializer_range)
        else:
            super()._init_weights(module)

    @torch.no_grad()
    def draft_block(self, cache, anchor_token: torch.Tensor) -> torch.Tensor:
        """One greedy draft pass: anchor_token [batch] int64 -> [batch, B-1] int64, the selector's
        argmax path (`CandidateSelector.walk` at temperature 0)."""
        hidden = self.draft_hidden(cache, anchor_token)
        return self.candidate_selector.walk(hidden, self.compute_logits(hidden), anchor_token)[0]

    @torch.no_grad()
    def draft_sample(
        self, cache, anchor_token: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sampled draft pass (`CandidateSelector.walk`); no host sync, no random state (CUDA-graph safe).

        Args:
            anchor_token: [batch] int64.
            temperature: > 0; top_p: nucleus over the selector's candidates.
            uniform: [batch, B-1] float32 in [0, 1), one draw per position.
        Returns:
            tokens [batch, B-1] int64, candidate_ids [batch, B-1, K] int64, and q [batch, B-1, K]
            float32: the distribution over candidate_ids each token was drawn from, given the
            tokens before it (verification's q; `dflash_decoding.rejection_sample` with draft_indices).
        """
        if not temperature > 0:
            raise ValueError(f"draft_sample needs --temperature > 0, got {temperature}; use draft_block for greedy drafts")
        hidden = self.draft_hidden(cache, anchor_token)
        return self.candidate_selector.walk(hidden, self.compute_logits(hidden), anchor_token, temperature, top_p, uniform)

    def draft_probs(self, cache, anchor_token: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
        """Not defined for DFlash2: each draft's distribution depends on the draft before it, so q
        comes with the sampled path (`draft_sample`)."""
        raise ValueError(
            "a DFlash2 drafter samples its block along the selector's path: call draft_sample, which "
            "returns the tokens with their q rows over the candidates"
        )
