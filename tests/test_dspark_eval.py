"""DSpark drafters in evaluation (dflash_decoding.py, eval_dflash.py): gamma drafts per verify (gamma + 1
tokens verified, every draft of the walk verifiable), the proposals are the greedy Markov walk at
temperature 0 and under --proposal argmax, greedy speculative decoding equals the target's greedy
decoding, sampling through the Markov walk is exact in distribution (tests/test_sampling.py's check),
the confidence gate, and eval_dflash.py on a saved DSpark export.

The drafter's Markov head holds the target's own bigram logits (its next-token logits after a single
token), so the walk agrees with the target often, not always: drafts are both accepted and rejected,
and each draft's q depends strongly on the draft before it.
"""

import json

import pytest
import torch
from conftest import write_qwen3_tokenizer
from test_eval import tiny_drafter, tiny_target
from test_sampling import PROMPT, SEEDS, TEMPERATURE, TOKENS, TOP_P, TV_BOUND, VOCAB, exact_marginals, tv
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import dflash_runners
import eval_dflash
from dflash_decoding import greedy_generate, load_drafter, resolve_block_size, speculative_generate, summarize_speculative
from dflash_runners import Decoder, LayerOutputCapture
from dflash_target import drafter_config_for_target
from dspark_model import DSparkDraftModel, save_dspark_export

GAMMA = TOKENS - 1  # 3 drafts per verify: tokens 2..4 of the exactness check come from one verify forward at most
LAYER_IDS = [0, 1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


def tiny_dspark(target, gamma=GAMMA, **settings) -> DSparkDraftModel:
    """A one-layer DSpark drafter for `target` (vocab 16) whose rank-16 Markov head is the target's
    bigram: W2(W1[v]) = the target's logits after the single token v. Confidence weights at 0.3, so
    the predicted acceptance varies from slot to slot."""
    config = drafter_config_for_target(
        target.config,
        mask_token_id=VOCAB - 1,
        num_draft_layers=1,
        block_size=gamma,
        target_layer_ids=LAYER_IDS,
        drafter="dspark",
        markov_rank=VOCAB,
        **settings,
    )
    torch.manual_seed(1)
    drafter = DSparkDraftModel(config).eval()
    with torch.no_grad():
        bigram = target(torch.arange(VOCAB)[:, None]).logits[:, -1]  # [V, V]: row v, the logits after token v
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        drafter.markov_head.markov_w2.weight.copy_(bigram.T)  # W2 @ e_v = bigram[v]
        if drafter.confidence_head is not None:
            drafter.confidence_head.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    return drafter


@pytest.fixture(scope="module")
def models():
    """tests/test_sampling.py's 16-token target, and a DSpark drafter of gamma 3 for it."""
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
    return target, tiny_dspark(target)


def record_verify_blocks(monkeypatch) -> list:
    """Every verify forward's (cache length L before it, block tokens), in order, from now on (make the
    `Decoder` first: its start-up check runs a verify forward of its own)."""
    blocks = []
    original = dflash_runners.TargetRunner.verify

    def verify(self, block):
        blocks.append((self.length, block[0].tolist()))
        return original(self, block)

    monkeypatch.setattr(dflash_runners.TargetRunner, "verify", verify)
    return blocks


# ----------------------------------------------------------------------------------------------
# Drafts per verify, and what is proposed


def test_gamma_drafts_per_verify(models, monkeypatch):
    """A drafter of gamma 3 verifies blocks of 4 (the anchor and 3 drafts); --block_size 2 verifies the
    first draft only; 5 is refused. An oracle walk (the target's own continuation) has every one of its
    gamma drafts accepted: tau = gamma + 1."""
    target, drafter = models
    assert resolve_block_size(drafter, None) == GAMMA + 1 and resolve_block_size(drafter.config, 2) == 2
    with pytest.raises(ValueError, match="--block_size 5 must be between 2 and 4"):
        resolve_block_size(drafter, GAMMA + 2)
    decoder = Decoder(target, drafter)
    blocks = record_verify_blocks(monkeypatch)
    tokens, stats = speculative_generate(target, drafter, PROMPT, 20, decoder=decoder)
    assert {len(block) for _, block in blocks} == {GAMMA + 1} and stats["block_size"] == GAMMA + 1
    assert stats["proposed_drafts"] == [GAMMA] * stats["verify_forwards"]
    summary = summarize_speculative([stats], stats["block_size"])
    assert len(summary["accepted_drafts_histogram"]) == GAMMA + 1 and summary["mean_proposed_drafts"] == GAMMA
    blocks.clear()
    speculative_generate(target, drafter, PROMPT, 20, block_size=2, decoder=decoder)
    decoder.close()
    assert {len(block) for _, block in blocks} == {2}

    blocks_of_four = 3
    max_new_tokens = 1 + blocks_of_four * (GAMMA + 1)
    sequence = PROMPT[0].tolist() + greedy_generate(target, PROMPT, max_new_tokens + GAMMA)

    def oracle_walk(self, anchor, temperature, top_p, uniform, confidence):
        start = self.cache.length + 1  # the anchor sits at cache.length
        drafts = torch.tensor([sequence[start : start + GAMMA]])  # [1, gamma]
        return drafts, torch.nn.functional.one_hot(drafts, VOCAB).float(), None

    monkeypatch.setattr(dflash_runners.Drafting, "markov_walk", oracle_walk)
    tokens, stats = speculative_generate(target, drafter, PROMPT, max_new_tokens)
    assert tokens == sequence[PROMPT.shape[1] : PROMPT.shape[1] + max_new_tokens]
    assert stats["committed"] == [GAMMA + 1] * blocks_of_four and stats["accepted_drafts"] == [GAMMA] * blocks_of_four


@pytest.mark.parametrize(
    "temperature, proposal, confidence_threshold", [(0.0, "sample", 0.0), (TEMPERATURE, "argmax", 0.0), (TEMPERATURE, "argmax", 0.4)]
)
def test_proposals_are_the_greedy_markov_walk(models, monkeypatch, temperature, proposal, confidence_threshold):
    """At temperature 0, and under --proposal argmax at T > 0, each verified draft is the argmax of its
    slot's logits with the Markov term of the draft before it (the anchor for the first), recomputed
    here from the committed tokens without any cache (up to 1e-4: cached and uncached forwards round
    apart, and the walk has near-ties); without the Markov term some argmax differs. With the
    confidence gate, each proposal ends before its first slot whose sigmoid(confidence) on
    [h_k; W1[d_{k-1}]] is below the threshold (per slot, not cumulative)."""
    target, drafter = models
    decoder = Decoder(target, drafter)
    blocks = record_verify_blocks(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    tokens, stats = speculative_generate(
        target, drafter, PROMPT, 30, None, (), decoder, temperature, TOP_P, generator, proposal, confidence_threshold=confidence_threshold
    )
    decoder.close()
    sequence = PROMPT[0].tolist() + tokens
    without_markov_differs = 0
    with torch.no_grad():
        for (length, block), count in zip(blocks, stats["proposed_drafts"], strict=True):
            assert block[0] == sequence[length] and len(block) == count + 1
            with LayerOutputCapture(target, LAYER_IDS) as capture:  # the outputs of layers 0 and 1 (the last)
                target(torch.tensor([sequence[:length]]))
            cache = drafter.extend_context(None, capture.features())
            hidden = drafter.draft_hidden(cache, torch.tensor([block[0]]))  # [1, gamma, hidden]
            previous = torch.tensor([block[:GAMMA]])  # [1, <= gamma]: the anchor, then each draft for the slot after it
            logits = drafter.block_logits(hidden[:, : previous.shape[1]], previous)[0]  # [<= gamma, V]
            drafts = torch.tensor(block[1:], dtype=torch.long)
            assert (logits[range(count), drafts] >= logits[:count].max(dim=-1).values - 1e-4).all(), block
            without_markov_differs += drafter.compute_logits(hidden)[0, :count].argmax(-1).tolist() != block[1:]
            accept = torch.sigmoid(drafter.confidence_logits(hidden[:, : previous.shape[1]], previous))[0].tolist()
            if confidence_threshold == 0:
                assert count == GAMMA
            else:
                assert all(a >= confidence_threshold for a in accept[:count]) and (count == GAMMA or accept[count] < confidence_threshold)
    assert len(blocks) > 3 and without_markov_differs > 0, (len(blocks), without_markov_differs)
    if confidence_threshold > 0:
        assert 0 < max(stats["proposed_drafts"]) and min(stats["proposed_drafts"]) < GAMMA, stats["proposed_drafts"]  # cut, not always


# ----------------------------------------------------------------------------------------------
# Greedy: lossless


def test_greedy_speculative_decoding_is_lossless(models, tmp_path):
    """Speculative output equals plain greedy decoding with the dynamic and the static cache, a smaller
    verified block, the confidence gate, and the drafter reloaded from its DSpark export."""
    target, drafter = models
    save_dspark_export(drafter, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    reloaded = load_drafter(str(tmp_path / "export"), torch.float32, torch.device("cpu"))
    assert type(reloaded) is DSparkDraftModel
    reloaded.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    static = Decoder(target, drafter, "static", max_length=64)
    accepted = []
    for seed in range(3):
        prompt = torch.randint(0, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(seed))
        reference = greedy_generate(target, prompt, 20)
        tokens, stats = speculative_generate(target, drafter, prompt, 20)
        assert tokens == reference, seed
        accepted += stats["accepted_drafts"]
        assert speculative_generate(target, drafter, prompt, 20, decoder=static) == (tokens, stats)
        assert speculative_generate(target, drafter, prompt, 20, confidence_threshold=0.5)[0] == reference
    static.close()
    assert 0 in accepted and 1 in accepted, accepted  # drafts were both accepted and rejected
    assert speculative_generate(target, reloaded, prompt, 20) == (tokens, stats)
    assert speculative_generate(target, drafter, prompt, 20, block_size=2)[0] == reference
    none, none_stats = speculative_generate(target, drafter, prompt, 20, confidence_threshold=1.0)  # every draft cut
    assert none == reference and none_stats["proposed_drafts"] == [0] * 19 and none_stats["committed"] == [1] * 19


def test_confidence_threshold_needs_a_confidence_head(models):
    target, _ = models
    without = tiny_dspark(target, enable_confidence_head=False)
    with pytest.raises(ValueError, match="--confidence_threshold needs a DSpark drafter with a confidence head"):
        speculative_generate(target, without, PROMPT, 8, confidence_threshold=0.5)
    with pytest.raises(ValueError, match=r"--confidence_threshold must be in \[0, 1\]"):
        speculative_generate(target, without, PROMPT, 8, confidence_threshold=1.5)


# ----------------------------------------------------------------------------------------------
# Sampling: exact in distribution


def test_speculative_sampling_through_the_markov_walk_matches_plain_sampling(models):
    """tests/test_sampling.py's check for DSpark: 1,000 runs of tokens 1..4 against the exact marginals,
    with each draft sampled from q_i, its slot's distribution with the Markov term of the draft before
    it, and verified against that q. Verifying against the q without the Markov term gives a TV of
    0.138 at token 2 here (measured), above the bound. (The confidence gate keeps this exact: it cuts
    before d_k on what precedes d_k only; measured with the gate at 0.4, the check passes too, at 14 s
    more.)"""
    target, drafter = models
    exact = exact_marginals(target, PROMPT, TOKENS)
    decoder = Decoder(target, drafter)
    outputs, stats = [], []
    for seed in range(SEEDS):
        out, s = speculative_generate(target, drafter, PROMPT, TOKENS, None, (), decoder, TEMPERATURE, TOP_P, torch.Generator().manual_seed(seed))
        outputs.append(out)
        stats.append(s)
    decoder.close()
    outputs = torch.tensor(outputs)
    accepted = [n for s in stats for n in s["accepted_drafts"]]
    counts = [accepted.count(n) for n in range(GAMMA + 1)]
    assert all(c > len(accepted) // 20 for c in counts), counts  # a rejection at each slot, and full acceptance, happen often
    distances = [tv(torch.bincount(outputs[:, j], minlength=VOCAB).float() / SEEDS, exact[j]) for j in range(TOKENS)]
    assert max(distances) < TV_BOUND, distances


# ----------------------------------------------------------------------------------------------
# eval_dflash.py on a DSpark export


@pytest.fixture(scope="module")
def dspark_dirs(tmp_path_factory):
    """(target dir, DSpark export dir, DFlash drafter dir, prompts file): tests/test_eval.py's tiny Qwen3
    target with the Qwen3 tokenizer, a random DSpark drafter of gamma 3 (Markov rank 4, confidence head)
    saved as `save_dspark_export` writes it, and a DFlash drafter beside it."""
    from dflash_target import find_qwen3_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(find_qwen3_tokenizer_dir())
    root = tmp_path_factory.mktemp("dspark_eval_cli")
    target = tiny_target(
        vocab_size=151936,
        seed=7,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    target.save_pretrained(root / "target")
    write_qwen3_tokenizer(root / "target")  # the hub's files: they load faster than what save_pretrained writes
    config = drafter_config_for_target(
        target.config, mask_token_id=151669, num_draft_layers=1, block_size=GAMMA, target_layer_ids=[0, 2], drafter="dspark", markov_rank=4
    )
    torch.manual_seed(3)
    drafter = DSparkDraftModel(config).eval()
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    save_dspark_export(drafter, root / "dspark")
    tiny_drafter(target, mask_token_id=151669, block_size=4).save_pretrained(root / "dflash")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 17 + 26?"}) + "\n" + json.dumps({"turns": ["Write a haiku about rain."]}) + "\n")
    return root / "target", root / "dspark", root / "dflash", prompts


def test_cli_evaluates_a_dspark_export(dspark_dirs, tmp_path):
    """eval_dflash.py --draft_model on a DSpark export folder: gamma + 1 tokens verified, lossless at
    temperature 0, and at T > 0 with the confidence gate fewer drafts proposed."""
    target_dir, dspark_dir, _, prompts = dspark_dirs
    base = ["--target_model", str(target_dir), "--draft_model", str(dspark_dir), "--data", str(prompts), "--max_new_tokens", "14"]
    base += ["--device", "cpu", "--baseline", "none"]
    results = eval_dflash.main(base + ["--output", str(tmp_path / "greedy.json")])
    assert json.loads((tmp_path / "greedy.json").read_text()) == json.loads(json.dumps(results))
    assert results["lossless"] is True and results["identical_prompts"] == 2
    settings = results["settings"]
    assert (settings["drafter"], settings["drafter_block_size"], settings["block_size"], settings["drafts_per_verify"]) == (
        "DSparkDraftModel",
        GAMMA,
        GAMMA + 1,
        GAMMA,
    )
    assert len(results["acceptance_rate_by_position"]) == GAMMA and len(results["accepted_drafts_histogram"]) == GAMMA + 1
    assert results["mean_proposed_drafts"] == GAMMA and sum(results["accepted_drafts_histogram"]) == results["verify_forwards"]
    assert results["acceptance_length"] == pytest.approx((results["generated_tokens"] - 2) / results["verify_forwards"])

    gated = eval_dflash.main(base + ["--output", str(tmp_path / "gated.json"), "--temperature", "0.8", "--confidence_threshold", "0.5"])
    assert gated["lossless"] is None and gated["settings"]["confidence_threshold"] == 0.5
    assert gated["mean_proposed_drafts"] < GAMMA  # a fresh confidence head predicts about 0.5: many proposals are cut


def test_cli_refuses_the_confidence_gate_without_a_dspark_confidence_head(dspark_dirs, tmp_path, monkeypatch):
    target_dir, _, dflash_dir, prompts = dspark_dirs
    import dflash_target

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the settings were checked")

    monkeypatch.setattr(dflash_target, "load_target_model", no_weights)
    base = ["--target_model", str(target_dir), "--data", str(prompts), "--max_new_tokens", "8", "--output", str(tmp_path / "r.json")]
    with pytest.raises(ValueError, match="--confidence_threshold 0.5 needs a DSpark drafter with a confidence head"):
        eval_dflash.main(base + ["--draft_model", str(dflash_dir), "--confidence_threshold", "0.5"])
    with pytest.raises(ValueError, match=r"--confidence_threshold must be in \[0, 1\]"):
        eval_dflash.main(base + ["--draft_model", str(dflash_dir), "--confidence_threshold", "-1"])


# ----------------------------------------------------------------------------------------------
# bench_dflash.py --drafter dspark


def test_bench_times_a_dspark_training_step(monkeypatch, capsys):
    """bench_dflash.py --drafter dspark in its tiny CPU mode: a DSpark drafter of gamma 15 (DFlash's B = 16
    drafts per verify) trained through chunked_dspark_loss at both headline shapes; fused_ce_compiled compiles its
    chunks (compiled=True, run eagerly here); a DFlash loss lever is refused."""
    import bench_dflash
    import dflash_bench_training

    calls = []
    original = dflash_bench_training.chunked_dspark_loss

    def recorded(*args, **kwargs):
        calls.append((args[0].shape, kwargs["chunk_size"], kwargs["compiled"]))
        return original(*args, **{**kwargs, "compiled": False})  # no inductor compile on a 2-core CPU

    monkeypatch.setattr(dflash_bench_training, "chunked_dspark_loss", recorded)
    argv = ["--device", "cpu", "--tiny", "--quick", "--drafter_only", "--drafter", "dspark", "--steps", "1", "--warmup", "0", "--no_append"]
    threads = torch.get_num_threads()  # bench_dflash.main sets 1 on a CPU
    bench_dflash.main(argv)
    torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| baseline |")]
    assert [row.split(" | ")[1:4] for row in rows] == [["8", "64", "2"], ["16", "128", "1"]], out
    assert all(float(row.split(" | ")[4]) > 0 for row in rows)  # ms/step: the step ran
    assert "(2 layers, block 15)" in out and {shape[2] for shape, _, _ in calls} == {15}  # [batch, N, gamma, hidden], gamma 15
    assert {(chunk_size, compiled) for _, chunk_size, compiled in calls} == {(4096, False)}
    with pytest.raises(ValueError, match="--drafter dspark trains with chunked_dspark_loss only"):
        bench_dflash.main(argv + ["--variant", "fused_ce"])
    calls.clear()
    bench_dflash.main(argv + ["--variant", "loss_chunk_64"])  # the chunk size is DSpark's loss lever
    torch.set_num_threads(threads)
    assert calls and {(chunk_size, compiled) for _, chunk_size, compiled in calls} == {(64, False)}
    calls.clear()
    bench_dflash.main(argv + ["--variant", "fused_ce_compiled"])  # the loss's chunks compiled, as DFlash's lever
    torch.set_num_threads(threads)
    assert calls and {compiled for _, _, compiled in calls} == {True}
