"""The BlockMask built from per-row key intervals against torch's create_block_mask over the element rule.

`create_anchor_block_mask` classifies 128 x 128 tiles from each query row's two key intervals;
`reference_block_mask` below evaluates `anchor_block_mask_mod` on every (query, key) pair and lets
torch reduce that to tiles. Both must give the same BlockMask, field by field, for every layer rule.
"""

import random

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import dflash_masks
from dflash_compile import get_compiled_flex_attention
from dflash_masks import anchor_block_mask_mod, create_anchor_block_mask, dense_anchor_block_mask

BLOCK_MASK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)
RULES = [(False, None), (True, None), (True, 3), (True, 16), (True, 200), (False, 3), (False, 16), (False, 200)]


def reference_block_mask(anchors, anchor_valid, context_len, block_size, causal=False, window=None, tile=None) -> BlockMask:
    """torch's create_block_mask over the element rule: materialises [batch, Q, KV] (small sizes only).
    tile: its tile size, default create_block_mask's."""
    batch, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    mask_mod = anchor_block_mask_mod(anchors, anchor_valid, context_len, block_size, causal, window)
    tile = {} if tile is None else {"BLOCK_SIZE": tile}
    return create_block_mask(mask_mod, batch, None, q_len, context_len + q_len, device=anchors.device, **tile)


def random_anchors(rng: random.Random, batch: int, num_anchors: int, context_len: int):
    """Sorted distinct anchors per row, valid first, padded slots (anchor 0, invalid) after them in
    some rows; spread over the context or clustered; often the ends of the range: 0, and S-2 (the
    last `sample_anchors` draws) or S-1."""
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    valid = torch.zeros(batch, num_anchors, dtype=torch.bool)
    for b in range(batch):
        count = min(num_anchors, context_len - 1)
        count = rng.choice([count, rng.randint(1, count)])
        span = rng.choice([context_len - 1, max(count, context_len // 8)])  # clustered anchors make full tiles under a window
        start = rng.randint(0, context_len - 1 - span)
        picks = rng.sample(range(start, start + span), count)
        if rng.random() < 0.5:
            picks[0] = 0
        if rng.random() < 0.5:
            picks[-1] = rng.choice([context_len - 2, context_len - 1])
        picks = sorted(set(picks))
        anchors[b, : len(picks)] = torch.tensor(picks)
        valid[b, : len(picks)] = True
    return anchors, valid


def assert_same_block_mask(built: BlockMask, reference: BlockMask):
    assert built.seq_lengths == reference.seq_lengths and built.BLOCK_SIZE == reference.BLOCK_SIZE
    for name in BLOCK_MASK_FIELDS:
        got, want = getattr(built, name), getattr(reference, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(built.to_dense(), reference.to_dense())


def case_ids(case):
    return "b{}_n{}_B{}_S{}_{}".format(*case[:4], "causal" if case[4] else "two-sided") + ("" if case[5] is None else f"_w{case[5]}")


def random_cases(count: int, seed: int = 0):
    """(batch, N, B, S, causal, window): Q = N*B a multiple of 128 or not, S shorter than 128 or not a multiple of it."""
    rng = random.Random(seed)
    cases = []
    for k in range(count):
        block_size = [16, 8, 7, 4][k % 4]
        num_anchors = rng.choice([1, 5, 16, 23, 37, 64, 100]) if block_size != 4 else rng.choice([32, 71, 200])
        context_len = rng.choice([3, 40, 127, 128, 129, 200, 385, 700, 1000])
        cases.append((rng.randint(1, 3), num_anchors, block_size, context_len, *rng.choice(RULES)))
    return cases


@pytest.mark.parametrize("case", random_cases(64), ids=case_ids)
def test_block_mask_equals_create_block_mask(case):
    batch, num_anchors, block_size, context_len, causal, window = case
    anchors, valid = random_anchors(random.Random(str(case)), batch, num_anchors, context_len)
    built = create_anchor_block_mask(anchors, valid, context_len, block_size, causal, window)
    assert_same_block_mask(built, reference_block_mask(anchors, valid, context_len, block_size, causal, window))


@pytest.mark.parametrize("tile", [4, 5, 8, 16])
@pytest.mark.parametrize("case", random_cases(16, seed=1), ids=case_ids)
def test_block_mask_equals_create_block_mask_at_small_tiles(monkeypatch, tile, case):
    """Tiles of a few keys put every interval's ends (window edges, anchors, block edges) on or beside a
    tile edge, where an off-by-one in an interval changes which tiles are visible or full."""
    batch, num_anchors, block_size, context_len, causal, window = case
    anchors, valid = random_anchors(random.Random(str(case)), batch, num_anchors, context_len)
    monkeypatch.setattr(dflash_masks, "SPARSE_BLOCK_SIZE", tile)
    built = create_anchor_block_mask(anchors, valid, context_len, block_size, causal, window)
    assert built.BLOCK_SIZE == (tile, tile)
    assert_same_block_mask(built, reference_block_mask(anchors, valid, context_len, block_size, causal, window, tile))


@pytest.mark.parametrize("tile", [4, 5, 8])
def test_block_mask_equals_create_block_mask_at_every_alignment(monkeypatch, tile):
    """Context lengths of every residue modulo the tile, so the anchors, block edges and window
    edges of each rule (windows 1, 2, 3, 5: below and above the block size) fall at every offset
    from the tile edges; blocks of 4 and 7 rows straddle query tiles. Any interval end off by one
    (context or own block, either side) fails here."""
    monkeypatch.setattr(dflash_masks, "SPARSE_BLOCK_SIZE", tile)
    rules = [(False, None), (True, None)] + [(causal, window) for causal in (True, False) for window in (1, 2, 3, 5)]
    rng = random.Random(tile)
    for block_size in (4, 7):
        for context_len in range(tile, 2 * tile + 1):  # every residue modulo the tile
            anchors, valid = random_anchors(rng, 2, 3, context_len)
            for causal, window in rules:
                built = create_anchor_block_mask(anchors, valid, context_len, block_size, causal, window)
                reference = reference_block_mask(anchors, valid, context_len, block_size, causal, window, tile)
                assert_same_block_mask(built, reference)


@pytest.mark.parametrize("causal, window", RULES)
def test_block_mask_tiles_of_every_kind(causal, window):
    """Full, partial and empty tiles, a ragged last query tile (Q = 511: 127 rows, all seeing the first
    context tiles, which it pads to partial) and KV tile (KV = 1011), a fully padded row, every anchor
    at 0 or the last eligible position: the same tiles as torch's."""
    context_len, block_size, num_anchors = 500, 7, 73
    anchors = torch.zeros(3, num_anchors, dtype=torch.long)
    valid = torch.ones(3, num_anchors, dtype=torch.bool)
    anchors[0] = torch.linspace(0, context_len - 2, num_anchors).long()  # spread: full context tiles
    anchors[1, :36], anchors[1, 36:] = 0, context_len - 2  # the two ends of the eligible range
    valid[2] = False  # padded slots only: own blocks alone
    built = create_anchor_block_mask(anchors, valid, context_len, block_size, causal, window)
    reference = reference_block_mask(anchors, valid, context_len, block_size, causal, window)
    assert_same_block_mask(built, reference)
    assert int(built.kv_num_blocks.sum()) > 0
    if window is None:
        assert int(built.full_kv_num_blocks.sum()) > 0  # the full-tile path is exercised


def test_expanded_anchors():
    """A broadcast (stride-0) anchors tensor, as tests/test_compile.py passes."""
    anchors, valid = torch.zeros(1, 40, dtype=torch.long).expand(2, 40), torch.ones(2, 40, dtype=torch.bool)
    assert_same_block_mask(create_anchor_block_mask(anchors, valid, 200, 4), reference_block_mask(anchors, valid, 200, 4))


def test_flex_attention_output_equals_reference_block_mask_and_sdpa():
    """Compiled flex on the CPU (one compile, ~10 s): the built BlockMask gives the reference one's output and
    the dense mask's SDPA output. Q 160 x KV 460: two query tiles (the second ragged), four KV tiles,
    full ones among them (flex skips mask_mod there: a partial tile taken for full would show)."""
    g = torch.Generator().manual_seed(0)
    batch, heads, head_dim, context_len, num_anchors, block_size = 2, 2, 8, 300, 40, 4
    q_len, kv_len = num_anchors * block_size, context_len + num_anchors * block_size
    spread = torch.randperm(context_len - 1, generator=g)[:num_anchors].sort().values
    late = 150 + torch.randperm(context_len - 151, generator=g)[:num_anchors].sort().values  # KV tile 0 full for query tile 0
    anchors = torch.stack([late, spread])
    valid = torch.ones(batch, num_anchors, dtype=torch.bool)
    valid[1, -3:] = False  # padded slots
    q = torch.randn(batch, heads, q_len, head_dim, generator=g)
    k = torch.randn(batch, heads, kv_len, head_dim, generator=g)
    v = torch.randn(batch, heads, kv_len, head_dim, generator=g)
    built = create_anchor_block_mask(anchors, valid, context_len, block_size)
    reference = reference_block_mask(anchors, valid, context_len, block_size)
    assert int(built.kv_num_blocks.sum()) > 0 and int(built.full_kv_num_blocks.sum()) > 0
    flex = get_compiled_flex_attention("cpu")
    with torch.no_grad():
        out = flex(q, k, v, built)
        expected = flex(q, k, v, reference)
        dense = dense_anchor_block_mask(anchors, valid, context_len, block_size)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_pooled_anchors_give_every_eligible_position_of_the_micro_batch_the_same_chance():
    """sample_anchors(pooled=True): batch x N anchors drawn over the whole micro-batch, each eligible position
    with the same chance (a row's count follows its length), 2N slots a row, valid anchors sorted first; per row
    (the default) a short row gives all of its positions and a long one N."""
    from dflash_masks import eligible_anchors, sample_anchors

    batch, seq_len, n = 4, 200, 16
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row, (start, length) in enumerate([(10, 11), (50, 51), (40, 61), (0, 57)]):  # 10, 50, 60, 56 eligible
        loss_mask[row, start : start + length] = True
    eligible = eligible_anchors(loss_mask)  # [batch, S-1]
    counts = eligible.sum(dim=1)
    assert counts.tolist() == [10, 50, 60, 56]
    p = batch * n / counts.sum().item()  # 64 of 176
    generator = torch.Generator().manual_seed(0)
    hits = {True: torch.zeros(batch, seq_len - 1), False: torch.zeros(batch, seq_len - 1)}
    draws = 400
    for pooled in (True, False):
        for _ in range(draws):
            anchors, valid = sample_anchors(loss_mask, n, generator, pooled=pooled)
            assert anchors.shape == valid.shape == (batch, 2 * n if pooled else n)
            for row in range(batch):
                a = anchors[row, valid[row]]
                assert torch.equal(valid[row], torch.arange(valid.shape[1]) < len(a))  # valid first
                assert torch.equal(a, a.sort().values) and len(a.unique()) == len(a) and eligible[row, a].all()
                hits[pooled][row, a] += 1
            if pooled:  # batch x N, unless a row drew more than its 2N slots (~3 standard deviations here)
                assert valid.sum().item() == batch * n or (valid.sum(dim=1) == 2 * n).any()
            else:
                assert valid.sum().item() == sum(min(n, c) for c in counts.tolist())
    rate = hits[True].sum(dim=1) / counts / draws  # each row's mean inclusion rate
    assert torch.allclose(rate, torch.full((batch,), p), atol=0.02), (rate, p)
    rate = hits[False].sum(dim=1) / counts / draws
    assert torch.allclose(rate, torch.tensor([1.0, n / 50, n / 60, n / 56]), atol=0.02), rate
    # Fewer eligible positions than batch x N: all of them. A row drawing more than 2N keeps 2N.
    anchors, valid = sample_anchors(loss_mask, 100, generator, pooled=True)
    assert valid.sum(dim=1).tolist() == [10, 50, 60, 56]
    short = torch.zeros(3, 120, dtype=torch.bool)
    short[0, :101] = True  # 100 eligible
    short[1:, :2] = True  # 1 each
    anchors, valid = sample_anchors(short, 4, generator, pooled=True)  # 12 drawn, >= 10 of them in row 0
    assert valid[0].all() and anchors.shape == (3, 8) and valid.sum().item() <= 10
