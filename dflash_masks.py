"""Anchors, blocks, labels and the training attention mask of a DFlash drafter: pure functions of
the loss mask, the anchors and the block size (the training objective, arXiv 2602.06036).
`training_masks` in dflash_model.py builds each drafter layer's mask from these, once per batch and
layer rule, outside the attention modules.

Reading order: anchors (which positions start a block) -> blocks (their token ids and positions) ->
labels -> the per-layer position rule -> the anchor-block mask as a flex_attention mask_mod, its
dense SDPA twin and its BlockMask.

Notation used in every shape comment:
    batch   batch dimension            S       context (sequence) length
    N       anchors (blocks) per row   B       block size
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

# ----------------------------------------------------------------------------------------------
# Anchors, blocks, labels


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [batch, S] (bool or 0/1) -> [batch, S-1] bool: position p can anchor a block when
    `loss_mask[p]` and `loss_mask[p + 1]` are both set (the anchor token is known and at least its
    first label trains)."""
    loss_mask = loss_mask.bool()
    return loss_mask[:, :-1] & loss_mask[:, 1:]


ANCHOR_SAMPLINGS = ("per_sequence", "pooled")  # --anchor_sampling: sample_anchors per row, or pooled over the micro-batch


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None, pooled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample anchor positions without replacement.

    Eligible positions are those of `eligible_anchors`.
    - Per row (the default): N of each row's eligible positions, uniformly; a row with fewer gets all of
      them, so a short reply trains every block every epoch and a long one a share of its blocks.
    - `pooled`: batch x N of the micro-batch's eligible positions, uniformly over all rows at once, so every
      position has the same chance and a row's count follows its length, as a trainer that packs replies
      into one row and draws anchors over the pack does (speculators). The counts vary: each row gets 2N
      slots, and a row that draws more keeps 2N of them (on average only a row with more than twice the
      micro-batch's mean count of eligible positions draws that many).
    Padded slots (anchor 0, valid False) come last, so the shape is static.

    Args:
        loss_mask: [batch, S] bool.
        num_anchors: N, slots per row (pooled: the mean valid anchors per row; 2N slots).
        generator: a CPU `torch.Generator` for reproducible draws.
        pooled: draw over the whole micro-batch (above).
    Returns:
        anchors: [batch, N] (pooled: [batch, 2N]) int64, valid anchors sorted ascending first (sorted
            anchors give flex_attention denser mask blocks), padded slots after them.
        anchor_valid: the same shape, bool.
    """
    batch, seq_len = loss_mask.shape
    eligible = eligible_anchors(loss_mask)  # [batch, S-1]
    scores = torch.rand(eligible.shape, generator=generator)  # [batch, S-1], drawn on the CPU: reproducible
    if pooled:  # the batch*N highest scores of the micro-batch are its anchors; the others become ineligible
        flat = scores.masked_fill(~eligible.cpu(), -1.0).flatten()
        drawn = min(batch * num_anchors, int((flat >= 0).sum()))
        chosen = torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, flat.topk(drawn).indices, True)
        eligible = eligible & chosen.view(eligible.shape).to(eligible.device)
        num_anchors = 2 * num_anchors
    if loss_mask.is_cuda:
        # From pinned memory without blocking: a plain copy from pageable memory would make the host
        # wait for the GPU to finish the target's forward before it can launch the drafter.
        scores = scores.pin_memory().to(loss_mask.device, non_blocking=True)
    scores = scores.masked_fill(~eligible, -1.0)
    k = min(num_anchors, seq_len - 1)
    top_scores, positions = scores.topk(k, dim=1)  # random subset of the eligible positions
    sort_key = torch.where(top_scores >= 0, positions, seq_len)  # padded slots sort last
    sort_key, _ = sort_key.sort(dim=1)
    anchor_valid = sort_key < seq_len
    anchors = torch.where(anchor_valid, sort_key, 0)
    if k < num_anchors:
        pad = num_anchors - k
        anchors = F.pad(anchors, (0, pad), value=0)
        anchor_valid = F.pad(anchor_valid, (0, pad), value=False)
    return anchors, anchor_valid


def anchor_slots(loss_mask: torch.Tensor, num_anchors: int, multiple: int) -> int:
    """Anchor slots a micro-batch needs: the most eligible positions (`eligible_anchors`) of any
    row, rounded up to a multiple of `multiple`, at most `num_anchors`.

    `sample_anchors(loss_mask, anchor_slots(...))` keeps every row's valid anchors (a row with more
    eligible positions than `num_anchors` draws the same subset either way: the top scores of one
    draw) and drops only padded slots, which train nothing but cost a full drafter forward and
    backward each. Short replies leave most of the slots padded. Each distinct count is a new shape
    for the compiled drafter, hence the rounding.

    Args:
        loss_mask: [batch, S] bool (any device; the count is read on the host: one sync on a GPU).
        num_anchors: the most slots per row. multiple: > 0.
    Returns:
        int in [min(multiple, num_anchors), num_anchors].
    """
    eligible = int(eligible_anchors(loss_mask).sum(dim=1).max())
    return min(num_anchors, multiple * max(1, -(-eligible // multiple)))


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, mask_token_id: int, block_size: int) -> torch.Tensor:
    """Token ids of every block: `[token[a_j], MASK x (B - 1)]`.

    Args:
        input_ids: [batch, S] int64.
        anchors: [batch, N] int64.
    Returns:
        [batch, N * B] int64, block j at columns j*B .. j*B + B - 1.
    """
    batch, num_anchors = anchors.shape
    block = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block[:, :, 0] = input_ids.gather(1, anchors)
    return block.view(batch, num_anchors * block_size)  # [batch, N*B]


def block_position_ids(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute positions of block tokens: block j sits at `a_j .. a_j + B - 1`.

    Args:
        anchors: [batch, N] int64.
    Returns:
        [batch, N * B] int64.
    """
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)  # [batch, N*B]


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of block positions k = 1..B-1: the block at anchor a predicts `token[a + k]`.

    A label is valid when its anchor slot is valid, `a + k < S`, and `loss_mask[a + k]` is set.

    Args:
        input_ids: [batch, S] int64.
        loss_mask: [batch, S] bool.
        anchors, anchor_valid: [batch, N] from `sample_anchors`.
    Returns:
        labels: [batch, N, B-1] int64 (arbitrary where invalid).
        label_valid: [batch, N, B-1] bool.
    """
    seq_len = input_ids.shape[1]
    positions = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # [batch, N, B-1]
    labels = input_ids.gather(1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions)
    return labels, block_label_valid(loss_mask, anchors, anchor_valid, block_size)


def block_label_valid(loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """`block_labels`' label_valid [batch, N, B-1] bool from the loss mask [batch, S] and the anchors
    alone, on their device: the trainer computes it on the host, where the loss mask is before it
    moves to the GPU, and finds the valid rows there without waiting for the GPU."""
    seq_len = loss_mask.shape[1]
    positions = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # [batch, N, B-1]
    trainable = loss_mask.bool().gather(1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions)
    return (positions < seq_len) & trainable & anchor_valid[:, :, None]


# ----------------------------------------------------------------------------------------------
# The training attention mask


# The sliding-window rule of each engine that trains or serves DFlash drafters, for a sliding layer
# of window w and a block at anchor a (queries at a..a+B-1) after the context 0..a-1:
#
#   engine       a query at q sees keys at k with                  source
#   z-lab        q - k < w, and k - q < w when not causal;         dflash/model.py: Qwen3DFlashAttention.__init__,
#                context and block alike; sliding layers causal      _attention_mask
#                unless is_causal says otherwise
#   SGLang       the same: flash-attention window_left = w - 1,    srt/speculative/dflash_utils.py:
#                window_right 0 (causal) or w - 1; causality as      get_dflash_attention_sliding_window_size;
#                z-lab's                                             srt/models/dflash.py: _get_dflash_layer_attention_params,
#                                                                    _get_dflash_attention_type
#   vLLM         the same: window (w - 1, 0), widened to           v1/attention/backends/flash_attn.py: FlashAttentionImpl.__init__,
#                (w - 1, w - 1) for a non-causal layer; causal       _maybe_symmetrize_window;
#                from is_causal, else dflash_config.causal, else     model_executor/models/qwen3_dflash.py:
#                sliding layers                                      _resolve_layer_attention, _dflash_layer_causal
#   speculators  every query of the block: context keys with       speculators/models/dflash/attention.py:
#                a - w <= k < a, and its whole own block (no         create_anchor_block_mask_mod (base_prefix_mod,
#                window; causal only if sliding_window_non_causal    same_block_mod)
#                is False; is_causal is not read)
#   ours         z-lab's rule: `position_rule` with `DFlashConfig.attention_rule`, in training and drafting
#
# So all but speculators agree. speculators' query at a + i sees i + 1 more context keys than the
# others (a - w .. a - w + i), and inside a block longer than the window it also sees keys older than
# w. The rules agree whenever the window cannot bind, a + B - 1 < w (every key fits in every window).
# tests/test_dflash2.py builds each engine's mask from this table at contexts 40 and 100, window 16.


def position_rule(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """The per-layer position rule (`DFlashConfig.attention_rule`): may a query at absolute position
    q_pos see a key at absolute position k_pos?

    causal: k <= q. window: q - k < window, and also k - q < window when not causal (a two-sided
    window, as the reference implementation has it). Neither: always True. Worked example, causal,
    window 3, q = 10: keys 8, 9, 10 visible; 7 (too old) and 11 (the future) not.

    Args:
        q_pos, k_pos: int64 tensors that broadcast against each other (scalars inside a flex mask_mod).
    Returns:
        bool, the broadcast shape.
    """
    visible = torch.ones_like(q_pos - k_pos, dtype=torch.bool)
    if causal:
        visible = visible & (k_pos <= q_pos)
    if window is not None:
        visible = visible & (q_pos - k_pos < window)
        if not causal:
            visible = visible & (k_pos - q_pos < window)
    return visible


def anchor_block_mask_mod(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, block_size: int, causal: bool = False, window: int | None = None
):
    """The training attention rule as a flex_attention `mask_mod`.

    KV layout: `[context 0..S-1 | block 0 | block 1 | ... | block N-1]`, KV_LEN = S + N*B.
    Query side: `[block 0 | ... | block N-1]`, Q_LEN = N*B; query q is in block j = q // B.
    A query in block j sees context keys `kv < a_j` (strictly before its anchor: the target's
    features at a_j and later would leak the labels) and every key of its own block
    (bidirectional inside the block); nothing of other blocks. A padded anchor slot sees only its
    own block, so no row is fully masked (that would make softmax NaN).

    A layer with `causal` or a `window` (sliding_attention) also applies `position_rule` at the
    absolute positions: query at a_j + (q % B), context key kv at kv, own-block key i at a_j + i.
    Every query still sees itself, so no row is ever empty.

    Args:
        anchors, anchor_valid: [batch, N] from `sample_anchors`.
        context_len: S.
        causal, window: the layer's `DFlashConfig.attention_rule`; default the full rule.
    Returns:
        `mask_mod(b, h, q_idx, kv_idx) -> bool`, valid for scalar or broadcast index tensors.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[b, block]
        sees_context = (kv_idx < anchor) & anchor_valid[b, block]  # a_j < S, so kv is context
        sees_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        visible = sees_context | sees_own_block
        if not causal and window is None:
            return visible
        q_pos = anchor + q_idx % block_size
        # Keys of other blocks are masked above, so own-block positions are all that matter here.
        k_pos = torch.where(kv_idx < context_len, kv_idx, anchor + (kv_idx - context_len) % block_size)
        return visible & position_rule(q_pos, k_pos, causal, window)

    return mask_mod


def dense_anchor_block_mask(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, block_size: int, causal: bool = False, window: int | None = None
) -> torch.Tensor:
    """The same rule as `anchor_block_mask_mod`, materialised for SDPA.

    Returns:
        [batch, 1, N*B, S + N*B] bool, True = may attend. Memory is batch * Q * KV bytes: use
        it on CPU and at small sizes only.
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    q_len, kv_len = num_anchors * block_size, context_len + num_anchors * block_size
    mask_mod = anchor_block_mask_mod(anchors, anchor_valid, context_len, block_size, causal, window)
    b = torch.arange(batch, device=device)[:, None, None, None]
    q_idx = torch.arange(q_len, device=device)[None, None, :, None]
    kv_idx = torch.arange(kv_len, device=device)[None, None, None, :]
    return mask_mod(b, 0, q_idx, kv_idx)  # [batch, 1, Q, KV]


SPARSE_BLOCK_SIZE = 128  # the query and key tile of a BlockMask: create_block_mask's and from_kv_blocks' default


def _rows_per_tile(first: torch.Tensor, end: torch.Tensor, batch: int, q_tiles: int, kv_tiles: int) -> torch.Tensor:
    """How many query rows of each query tile reach each KV tile, from one range of KV tiles per row.

    Args:
        first, end: [batch, rows] or [rows] (the same for every batch row) int64, rows = q_tiles *
            SPARSE_BLOCK_SIZE: row r (of query tile r // SPARSE_BLOCK_SIZE) reaches KV tiles
            first .. end - 1, none where end <= first.
    Returns:
        [batch, q_tiles, kv_tiles] int64.
    """
    end = torch.maximum(first, end)  # an empty range adds +1 and -1 at the same place: nothing
    rows = end.shape[-1]
    offset = torch.arange(rows, device=end.device) // SPARSE_BLOCK_SIZE * (kv_tiles + 1)  # [rows]: its tile's row of counts
    # A difference array per query tile: +1 where a row's range starts, -1 past its end, summed along the KV tiles.
    counts = torch.zeros(batch, q_tiles * (kv_tiles + 1), dtype=torch.int32, device=end.device)
    ones = torch.ones(batch, rows, dtype=torch.int32, device=end.device)
    counts.scatter_add_(1, (offset + first).expand(batch, rows), ones)
    counts.scatter_add_(1, (offset + end).expand(batch, rows), -ones)
    return counts.view(batch, q_tiles, kv_tiles + 1).cumsum(dim=-1)[..., :kv_tiles]


def create_anchor_block_mask(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, block_size: int, causal: bool = False, window: int | None = None
) -> BlockMask:
    """The same rule as `anchor_block_mask_mod`, as a flex_attention `BlockMask` shared by all heads.

    Built once per batch and layer rule, outside compiled code, and passed to every layer of that rule.

    Built at tile granularity (SPARSE_BLOCK_SIZE x SPARSE_BLOCK_SIZE), never element by element:
    each query row sees the union of two key intervals, and tiles are classified from those.
    - Context: [lo, a_j) for a valid anchor (empty for a padded slot); lo = 0, or with a window
      max(0, q_pos - window + 1) at q_pos = a_j + (q % B). Causality and the two-sided window's
      other side never bind there: every context key is < a_j <= q_pos.
    - Own block: S + j*B + [i_lo, i_hi), its keys at positions a_j + i: i_lo = max(0, i - window + 1)
      with a window, else 0; i_hi = i + 1 if causal, min(B, i + window) with a two-sided window, else B.
    A tile is visible if an interval of any of its rows meets it, and full if each of its rows covers
    it with one interval: the two never touch (key S - 1 lies in neither, as a_j <= S - 1), so
    their union covers no tile that neither covers alone.
    The tiles, their order and the padding of the index lists are create_block_mask's over
    `anchor_block_mask_mod` (tiles past Q or KV are never full: it pads the mask with False), as
    tests/test_masks.py checks; flex applies `anchor_block_mask_mod` inside the partial tiles.

    Valid anchors must lie in 0..S-1 (`sample_anchors` gives 0..S-2). Memory and time are
    O(batch * Q + batch * Q/128 * KV/128), where create_block_mask materialises [batch, Q, KV] and
    int64 temporaries of that size. Measured on a shared 2-core CPU, one thread, against
    create_block_mask in row chunks: 8-19 ms against 4.9-7.2 s at batch 64, 128 anchors x 16, a 512
    context (the SmolLM2 recipe); 3-7 ms against 1.7-2.0 s at one row, 512 anchors x 16, a 3072 context.
    It runs eagerly: any thread (a prefetch thread) may build masks without touching dynamo.

    Args:
        anchors, anchor_valid: [batch, N] from `sample_anchors` (any device; the mask is built there).
        context_len: S.  block_size: B.
        causal, window: the layer's `DFlashConfig.attention_rule`; default the full rule.
    Returns:
        BlockMask of shape [batch, 1, N*B, S + N*B], tiles of SPARSE_BLOCK_SIZE, mask_mod
        `anchor_block_mask_mod(anchors, anchor_valid, context_len, block_size, causal, window)`.
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    tile = SPARSE_BLOCK_SIZE
    q_len, kv_len = num_anchors * block_size, context_len + num_anchors * block_size
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    q_idx = torch.arange(q_tiles * tile, device=device)  # rows past Q pad the last query tile and see nothing
    real = q_idx < q_len  # [Q tiles * tile]
    block = torch.where(real, q_idx // block_size, 0)
    i = q_idx % block_size  # position inside the block
    anchor = anchors[:, block]  # [batch, Q tiles * tile]
    context_hi = torch.where(anchor_valid[:, block] & real, anchor, 0)
    context_lo = torch.zeros_like(anchor) if window is None else (anchor + i - window + 1).clamp(min=0)
    own_lo = torch.zeros_like(i) if window is None else (i - window + 1).clamp(min=0)
    if causal:
        own_hi = i + 1
    elif window is not None:
        own_hi = (i + window).clamp(max=block_size)
    else:
        own_hi = torch.full_like(i, block_size)
    own_start = context_len + block * block_size
    own_lo, own_hi = own_start + own_lo, torch.where(real, own_start + own_hi, 0)  # [Q tiles * tile]: the same in every batch row
    # A row's interval [lo, hi) meets KV tiles lo // tile .. (hi - 1) // tile and covers ceil(lo / tile) .. hi // tile - 1.
    met, covered = 0, 0
    for lo, hi in ((context_lo, context_hi), (own_lo, own_hi)):
        met = met + _rows_per_tile(lo // tile, torch.where(hi > lo, (hi - 1) // tile + 1, 0), batch, q_tiles, kv_tiles)
        covered = covered + _rows_per_tile(-(-lo // tile), hi // tile, batch, q_tiles, kv_tiles)
    full = covered == tile  # [batch, Q tiles, KV tiles]: every row of the query tile sees every key of the KV tile
    partial = (met > 0) & ~full  # BlockMask lists partial tiles apart from full ones

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, Q tiles, KV tiles] bool -> (count [batch, 1, Q tiles], indices [batch, 1, Q tiles, KV tiles]) int32:
        the listed tiles ascending, then the others ascending, as create_block_mask orders them."""
        tiles = tiles[:, None].to(torch.int32)
        indices = torch.argsort(tiles, dim=-1, descending=True, stable=True)
        return tiles.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=tile,
        mask_mod=anchor_block_mask_mod(anchors, anchor_valid, context_len, block_size, causal, window),
        seq_lengths=(q_len, kv_len),
    )
