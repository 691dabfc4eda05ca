"""Evaluation at temperature > 0: the sampling distribution, rejection sampling, and speculative
sampling against plain sampling from the target, in distribution over many seeds."""

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash_decoding
import dflash_runners
from dflash_decoding import plain_generate, rejection_sample, speculative_generate
from dflash_model import DFlashDraftModel, sampling_probs
from dflash_runners import Decoder
from dflash_target import drafter_config_for_target

VOCAB = 16
MASK_ID = VOCAB - 1
BLOCK = 4
PROMPT = torch.tensor([[3, 1, 4, 1, 5]])
TEMPERATURE, TOP_P = 0.8, 0.9


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


@pytest.fixture(scope="module")
def models():
    """A 16-token target whose distributions are far from uniform, and a random drafter for it
    whose distributions are far from the target's (so drafts are often, not always, rejected)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        initializer_range=0.15,
    )
    target = Qwen3ForCausalLM(config).eval()
    draft_config = drafter_config_for_target(
        config, mask_token_id=MASK_ID, num_draft_layers=2, block_size=BLOCK, target_layer_ids=[0, 1], layer_types="last_full", sliding_window=3
    )
    torch.manual_seed(1)
    drafter = DFlashDraftModel(draft_config).eval()
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    return target, drafter


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total-variation distance of two distributions over the same tokens."""
    return 0.5 * (p - q).abs().sum().item()


def test_sampling_probs_is_temperature_then_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    # softmax [0.644, 0.237, 0.087, 0.032]: the two most likely tokens are the smallest set with mass >= 0.8.
    top2 = torch.softmax(logits[:2], dim=0)
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0.8), torch.cat([top2, torch.zeros(2)]))
    torch.testing.assert_close(sampling_probs(logits, 0.5, 1.0), torch.softmax(logits / 0.5, dim=0))
    assert sampling_probs(torch.randn(2, 3, 50), 0.7, 0.9).sum(-1).allclose(torch.ones(2, 3))
    with pytest.raises(ValueError, match="--temperature > 0 and --top_p"):
        sampling_probs(logits, 0.0)


def test_rejection_sample_commits_the_target_distribution():
    """One draft position, 20,000 draws: the committed token follows p, whatever q is, and a fully
    accepted block's bonus token follows the last p."""
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.0, 0.0, 0.2, 0.3, 0.5]])  # p_1, and p_2 for the bonus
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4]])  # a poor draft distribution: it even proposes a token p forbids
    generator = torch.Generator().manual_seed(0)
    first, bonus, accepted = torch.zeros(5), torch.zeros(5), 0
    draws = 20000
    for _ in range(draws):
        draft = torch.multinomial(q[0], 1, generator=generator)  # [1]
        n, token = rejection_sample(draft, q, p, generator)
        first[draft.item() if n == 1 else token] += 1
        if n == 1:
            bonus[token] += 1
            accepted += 1
    # Acceptance probability is sum_x min(p, q) = 0.1 + 0.1 + 0.1 + 0.1 = 0.4.
    assert abs(accepted / draws - 0.4) < 0.02
    assert tv(first / draws, p[0]) < 0.015 and first[4] == 0  # never the token p forbids
    assert tv(bonus / accepted, p[1]) < 0.025


def exact_marginals(target, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Exact marginal distributions of the first `steps` generated tokens under plain sampling
    (`sampling_probs` at TEMPERATURE, TOP_P), by enumerating every prefix: [steps] x [vocab]."""
    marginals = []
    prefixes, weights = prompt, torch.ones(1)  # all prefixes so far and their probabilities
    with torch.no_grad():
        for _ in range(steps):
            logits = target(prefixes).logits[:, -1]  # [prefixes, vocab]
            joint = weights[:, None] * sampling_probs(logits, TEMPERATURE, TOP_P)  # [prefixes, vocab]
            marginals.append(joint.sum(0))
            weights = joint.flatten()
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(prefixes))[:, None]], 1)
    return marginals


def speculative_samples(
    target, drafter, seeds: int, tokens: int, proposal: str = "sample", draft_temperature: float | None = None
) -> tuple[torch.Tensor, list[dict]]:
    """Output tokens [seeds, tokens] of speculative sampling, one seed per run, and the runs' stats."""
    decoder = Decoder(target, drafter)
    outputs, stats = [], []
    for seed in range(seeds):
        out, s = speculative_generate(
            target,
            drafter,
            PROMPT,
            tokens,
            BLOCK,
            (),
            decoder,
            TEMPERATURE,
            TOP_P,
            torch.Generator().manual_seed(seed),
            proposal=proposal,
            draft_temperature=draft_temperature,
        )
        outputs.append(out)
        stats.append(s)
    decoder.close()
    return torch.tensor(outputs), stats


# 1,000 runs of tokens 1..4 (token 1 from the prefill, 2..4 from verify steps): per position, the total
# variation between the empirical and the exact distribution must stay below 0.08. Sampling noise alone
# gives an expected TV of at most 0.5 * sqrt(2 / (pi * 1000)) * sqrt(16) = 0.050 over 16 tokens
# (measured: 0.025-0.036 at 1,500 runs; a verifier that accepts every draft: 0.46).
SEEDS, TOKENS, TV_BOUND = 1000, BLOCK, 0.08


@pytest.mark.parametrize("proposal, draft_temperature", [("sample", None), ("argmax", None), ("sample", 1.3)])
def test_speculative_sampling_matches_plain_sampling_in_distribution(proposal, draft_temperature, models, monkeypatch):
    """Exact for either proposal, and for a q drawn at another temperature than the target's."""
    target, drafter = models
    exact = exact_marginals(target, PROMPT, TOKENS)
    draft_temperatures = []  # what the drafter's q was drawn at
    draft_probs = dflash_runners.Drafting.draft_probs
    monkeypatch.setattr(
        dflash_runners.Drafting, "draft_probs", lambda self, anchor, t, p: draft_temperatures.append(t) or draft_probs(self, anchor, t, p)
    )
    if proposal == "argmax":
        # The random drafter's argmax is almost never the target's choice, which would test rejections only. Any
        # proposal fixed by the context is exact under a one-hot q, so propose the most likely token of each
        # position instead: accepted often, rejected often.
        likely = torch.stack([x.argmax() for x in exact[1:]])[None]  # [1, BLOCK - 1]
        monkeypatch.setattr(dflash_runners.Drafting, "draft", lambda self, anchor: likely)
    samples, stats = speculative_samples(target, drafter, SEEDS, TOKENS, proposal, draft_temperature)
    if proposal == "sample":
        assert set(draft_temperatures) == {draft_temperature or TEMPERATURE}
    accepted = [n for s in stats for n in s["accepted_drafts"]]
    # Every outcome of a verify step happens often: a rejection at each position, and full acceptance.
    assert all(accepted.count(n) > len(accepted) // 20 for n in range(BLOCK)), [accepted.count(n) for n in range(BLOCK)]
    empirical = [torch.bincount(samples[:, j], minlength=VOCAB).float() / SEEDS for j in range(TOKENS)]
    distances = [tv(e, x) for e, x in zip(empirical, exact)]
    assert max(distances) < TV_BOUND, distances
    if proposal == "argmax" or draft_temperature is not None:
        return

    # The check has power: a verifier that accepts every draft (tokens 2..4 from q, not p) fails it.
    monkeypatch.setattr(
        dflash_decoding, "rejection_sample", lambda drafts, q, p, generator: (len(drafts), int(torch.multinomial(p[-1], 1, generator=generator)))
    )
    wrong, _ = speculative_samples(target, drafter, 150, TOKENS)
    wrong_tv = [tv(torch.bincount(wrong[:, j], minlength=VOCAB).float() / len(wrong), exact[j]) for j in range(1, TOKENS)]
    assert max(wrong_tv) > 2 * TV_BOUND, wrong_tv


def test_plain_sampling_follows_the_exact_distribution(models):
    """The reference side too: plain_generate's tokens 1..4 against the enumeration."""
    target, _ = models
    exact = exact_marginals(target, PROMPT, TOKENS)
    decoder = Decoder(target)
    outputs = torch.tensor(
        [plain_generate(target, PROMPT, TOKENS, (), decoder, TEMPERATURE, TOP_P, torch.Generator().manual_seed(seed)) for seed in range(SEEDS // 2)]
    )
    decoder.close()
    distances = [tv(torch.bincount(outputs[:, j], minlength=VOCAB).float() / len(outputs), exact[j]) for j in range(TOKENS)]
    assert max(distances) < TV_BOUND * math.sqrt(2), distances  # half the samples: sqrt(2) more noise


def test_static_cache_samples_the_same_tokens(models):
    """The static path (the GPU one, here without CUDA graphs) draws the same tokens as the dynamic
    one from the same seed: its draft distributions and verification are the same computation."""
    target, drafter = models
    static = Decoder(target, drafter, "static", max_length=PROMPT.shape[1] + 24 + BLOCK)
    for seed in range(8):
        dynamic_out = speculative_generate(target, drafter, PROMPT, 24, BLOCK, (), None, TEMPERATURE, TOP_P, torch.Generator().manual_seed(seed))
        static_out = speculative_generate(target, drafter, PROMPT, 24, BLOCK, (), static, TEMPERATURE, TOP_P, torch.Generator().manual_seed(seed))
        assert static_out == dynamic_out, f"seed {seed}"
    static.close()
