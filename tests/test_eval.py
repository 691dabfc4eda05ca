"""eval_dflash.py against plain greedy decoding: lossless output, exact tau for oracle and always-wrong
drafts, the drafter's context equals the target's layer outputs, and the results.json / plot of the CLI."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import write_qwen3_tokenizer
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import eval_dflash
from dflash_decoding import (
    check_drafter_matches_target,
    evaluate_acceptance,
    greedy_generate,
    prompt_lookup_generate,
    speculative_generate,
    summarize_speculative,
)
from dflash_model import DFlashDraftModel
from dflash_runners import DFlashStaticContextCache
from dflash_target import drafter_config_for_target

VOCAB = 256
MASK_ID = 255
TRAINED_BLOCK = 8
LAYER_IDS = [0, 2]  # two features, so concatenation order is checked too


def tiny_target(vocab_size=VOCAB, hidden=64, seed=0, **extra):
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        **extra,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_drafter(target, mask_token_id=MASK_ID, block_size=TRAINED_BLOCK, seed=1):
    torch.manual_seed(seed)
    config = drafter_config_for_target(
        target.config, mask_token_id=mask_token_id, num_draft_layers=2, block_size=block_size, target_layer_ids=LAYER_IDS
    )
    drafter = DFlashDraftModel(config).eval()
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    return drafter


pytestmark = pytest.mark.usefixtures(
    "one_torch_thread", "one_tokenizer_per_target"
)  # tiny models, few shared CI cores; eval_dflash.main() on the same folders


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target)


def random_prompts(count, seed=0):
    rng = random.Random(seed)
    return [torch.tensor([[rng.randrange(VOCAB - 1) for _ in range(rng.randrange(3, 30))]]) for _ in range(count)]


class ScriptedDrafter:
    """Stands in for the drafter with drafts derived from the target's own greedy continuation.

    mode "oracle": the true continuation, each token replaced by a wrong one with probability
    `corrupt`; mode "wrong": always a wrong token. It also checks the protocol: every anchor must
    be the token at position cache.length of the reference, and it records the context features
    it is given, in order.
    """

    def __init__(self, config, sequence, mode="oracle", corrupt=0.0, seed=0):
        self.config = config
        self.sequence = sequence  # prompt + greedy continuation, long enough for every draft
        self.mode, self.corrupt, self.rng = mode, corrupt, random.Random(seed)
        self.features = []

    def extend_context(self, cache, context_features):
        self.features.append(context_features)
        return SimpleNamespace(length=(cache.length if cache else 0) + context_features.shape[1])

    def draft_block(self, cache, anchor_token):
        position = cache.length
        assert self.sequence[position] == anchor_token.item(), f"anchor at position {position} is not the committed token"
        drafts = []
        for p in range(position + 1, position + self.config.block_size):
            truth = self.sequence[p]
            wrong = self.mode == "wrong" or self.rng.random() < self.corrupt
            drafts.append((truth + 1) % VOCAB if wrong else truth)
        return torch.tensor([drafts])  # [1, B-1]


def scripted(drafter, target, input_ids, max_new_tokens, **kwargs):
    """A ScriptedDrafter over the reference greedy continuation (no EOS), long enough for any block."""
    reference = greedy_generate(target, input_ids, max_new_tokens + TRAINED_BLOCK)
    return ScriptedDrafter(drafter.config, input_ids[0].tolist() + reference, **kwargs)


def first_new_token_index(tokens, start):
    """Index >= start of a token that does not occur earlier: as EOS, greedy stops exactly there."""
    return next((i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i]), None)


def test_greedy_reference_matches_transformers_generate(target):
    for input_ids in random_prompts(3, seed=5):
        reference = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=25, do_sample=False, pad_token_id=0)[
            0, input_ids.shape[1] :
        ].tolist()
        assert greedy_generate(target, input_ids, 25) == reference
    ours = greedy_generate(target, input_ids, 25)
    eos = ours[first_new_token_index(ours, 4)]
    assert greedy_generate(target, input_ids, 25, [eos]) == ours[: ours.index(eos) + 1]


@pytest.mark.parametrize("kind", ["dflash", "noisy_oracle"])
def test_lossless_on_many_prompts(target, drafter, kind):
    """Speculative output == greedy output, with EOS inside blocks and limits that end inside blocks."""
    eos_inside_block = truncated_at_limit = 0
    for i, input_ids in enumerate(random_prompts(12, seed=1)):
        max_new_tokens = [13, 21, 30, 27][i % 4]  # none is 1 + a multiple of the block size
        eos = []
        if i % 2 == 0:  # half the prompts stop at an EOS the greedy target actually produces
            free = greedy_generate(target, input_ids, max_new_tokens)
            index = first_new_token_index(free, 3 + i % 5)
            eos = [free[index]] if index is not None else []
        reference = greedy_generate(target, input_ids, max_new_tokens, eos)
        block_size = [TRAINED_BLOCK, 5][i % 2]
        draft_model = drafter if kind == "dflash" else scripted(drafter, target, input_ids, max_new_tokens, corrupt=0.25, seed=i)
        tokens, stats = speculative_generate(target, draft_model, input_ids, max_new_tokens, block_size, eos)
        assert tokens == reference, f"prompt {i}"
        assert sum(stats["committed"]) == len(tokens) - 1, "every token but the prefill one is committed by a verify forward"
        assert all(1 <= c <= block_size for c in stats["committed"])
        last_committed, last_accepted = stats["committed"][-1], stats["accepted_drafts"][-1]
        if eos and tokens[-1] == eos[0] and last_committed < last_accepted + 1:
            eos_inside_block += 1  # accepted drafts after the EOS were dropped
        if len(tokens) == max_new_tokens and last_committed < last_accepted + 1:
            truncated_at_limit += 1
    if kind == "noisy_oracle":
        assert eos_inside_block >= 1 and truncated_at_limit >= 1, (eos_inside_block, truncated_at_limit)


@pytest.mark.parametrize("block_size", [TRAINED_BLOCK, 4, 2])
def test_oracle_draft_gives_tau_equal_block_size(target, drafter, block_size):
    blocks = 3
    max_new_tokens = 1 + blocks * block_size  # the prefill token, then full blocks only
    stats_list = []
    for input_ids in random_prompts(3, seed=2):
        oracle = scripted(drafter, target, input_ids, max_new_tokens)
        tokens, stats = speculative_generate(target, oracle, input_ids, max_new_tokens, block_size, eos_token_ids=[])
        assert tokens == greedy_generate(target, input_ids, max_new_tokens)
        assert stats["verify_forwards"] == blocks and stats["committed"] == [block_size] * blocks
        stats_list.append(stats)
    summary = summarize_speculative(stats_list, block_size)
    assert summary["acceptance_length"] == block_size
    assert summary["acceptance_rate_by_position"] == [1.0] * (block_size - 1)
    assert summary["accepted_drafts_histogram"] == [0] * (block_size - 1) + [3 * blocks]


def test_always_wrong_draft_gives_tau_one(target, drafter):
    stats_list = []
    for input_ids in random_prompts(3, seed=3):
        wrong = scripted(drafter, target, input_ids, 17, mode="wrong")
        tokens, stats = speculative_generate(target, wrong, input_ids, 17, eos_token_ids=[])
        assert tokens == greedy_generate(target, input_ids, 17)
        assert stats["verify_forwards"] == 16 and stats["accepted_drafts"] == [0] * 16
        stats_list.append(stats)
    summary = summarize_speculative(stats_list, TRAINED_BLOCK)
    assert summary["acceptance_length"] == 1.0
    assert summary["acceptance_rate_by_position"] == [0.0] * (TRAINED_BLOCK - 1)


def test_drafter_context_is_the_targets_layer_outputs(target, drafter):
    """The drafter is fed hidden_states[i + 1] (i in target_layer_ids, list order) of exactly the tokens
    before the current anchor, whatever the number of tokens each step accepted."""
    input_ids = random_prompts(1, seed=4)[0]
    spy = scripted(drafter, target, input_ids, 40, corrupt=0.3, seed=4)
    tokens, stats = speculative_generate(target, spy, input_ids, 40, eos_token_ids=[])
    assert len(set(stats["committed"])) > 2, "want steps that committed different numbers of tokens"
    fed = torch.cat(spy.features, dim=1)  # [1, P + N - 1, 2 * hidden]
    # Everything but the last token: it is the next anchor, whose features come with the next verify.
    sequence = torch.cat([input_ids, torch.tensor([tokens[:-1]])], dim=1)
    with torch.no_grad():
        hidden_states = target(sequence, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden_states[i + 1] for i in LAYER_IDS], dim=-1)
    assert fed.shape == expected.shape
    torch.testing.assert_close(fed, expected, atol=1e-5, rtol=1e-4)


def test_prompt_lookup_counts_forwards(target):
    # A prompt that repeats itself, so prompt lookup has n-grams to copy.
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4])
    reference = greedy_generate(target, input_ids, 30)
    tokens, stats = prompt_lookup_generate(target, input_ids, 30, eos_token_ids=[VOCAB - 2], pad_token_id=0, num_tokens=6)
    assert tokens == reference
    assert stats["generated_tokens"] == 30 and stats["verify_forwards"] == stats["target_forwards"] - 1
    assert 1 <= stats["committed_after_first"] / stats["verify_forwards"] <= 7
    assert stats["committed_after_first"] <= 29


def test_mismatched_drafter_is_refused(target):
    other = tiny_drafter(tiny_target(hidden=32, seed=2))
    with pytest.raises(ValueError, match="hidden_size 32.*has 64"):
        check_drafter_matches_target(target, other)
    other_vocab = tiny_drafter(tiny_target(vocab_size=300, seed=2))
    with pytest.raises(ValueError, match="vocab_size 300.*256 rows"):
        check_drafter_matches_target(target, other_vocab)
    # A target truncated for training (TargetFeatureExtractor(truncate=True)) has no usable logits.
    truncated = tiny_target()
    truncated.model.layers = truncated.model.layers[:3]
    with pytest.raises(ValueError, match="4 decoder layers, this target has 3.*truncate=True"):
        check_drafter_matches_target(truncated, tiny_drafter(truncated))
    with pytest.raises(ValueError, match="dtype mismatch"):
        check_drafter_matches_target(target, tiny_drafter(target).to(torch.bfloat16))
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="block_size 9"):
        speculative_generate(target, drafter, random_prompts(1)[0], 5, block_size=9)


# ----------------------------------------------------------------------------------------------
# The CLI and evaluate_acceptance, with a tiny target that has the real Qwen3 tokenizer


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    """(target dir, drafter dir, prompts file, tokenizer): a tiny random Qwen3 target with the Qwen3
    tokenizer (151,936 rows), and a random drafter for it with block size 6."""
    from dflash_target import find_qwen3_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(find_qwen3_tokenizer_dir())
    root = tmp_path_factory.mktemp("eval_cli")
    target = tiny_target(
        vocab_size=151936,
        seed=7,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    target.save_pretrained(root / "target")
    write_qwen3_tokenizer(root / "target")  # the hub's files: they load faster than what save_pretrained writes
    drafter = tiny_drafter(target, mask_token_id=151669, block_size=6)
    drafter.save_pretrained(root / "drafter")
    records = [
        {"prompt": "What is 17 + 26?"},
        {"question": "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count to five."}]},
        {"turns": ["Write a haiku about rain.", "Now one about snow."]},
    ]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "target", root / "drafter", prompts, tokenizer


def test_cli_writes_consistent_results_and_plot(qwen3_dirs, tmp_path):
    target_dir, drafter_dir, prompts, _ = qwen3_dirs
    output = tmp_path / "out" / "results.json"
    eval_dflash.main(
        [
            "--target_model",
            str(target_dir),
            "--draft_model",
            str(drafter_dir),
            "--data",
            str(prompts),
            "--max_new_tokens",
            "19",
            "--block_size",
            "4",
            "--output",
            str(output),
            "--baseline",
            "prompt_lookup",
            "--prompt_lookup_num_tokens",
            "5",
            "--device",
            "cpu",
        ]
    )
    results = json.loads(output.read_text())
    assert (tmp_path / "out" / "results_acceptance.png").stat().st_size > 1000
    assert results["lossless"] is True and results["mismatches"] == []
    assert results["num_prompts"] == 4 and len(results["per_prompt"]) == 4
    assert all(row["lossless"] and row["prompt_lookup_lossless"] for row in results["per_prompt"])
    tau, forwards = results["acceptance_length"], results["verify_forwards"]
    assert tau == pytest.approx((results["generated_tokens"] - results["num_prompts"]) / forwards)
    assert 1.0 <= tau <= 4.0 and forwards > 0
    rates = results["acceptance_rate_by_position"]
    assert len(rates) == 3 and all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True)
    assert sum(results["accepted_drafts_histogram"]) == forwards
    assert results["generated_tokens"] == results["target_only_tokens"] == sum(r["generated_tokens"] for r in results["per_prompt"])
    assert results["speedup"] == pytest.approx(results["speculative_tokens_per_s"] / results["target_tokens_per_s"])
    baseline = results["baseline"]
    assert baseline["method"] == "prompt_lookup" and baseline["lossless"] is True
    assert baseline["generated_tokens"] == results["generated_tokens"]
    assert baseline["acceptance_length"] == pytest.approx(baseline["verify_committed_tokens"] / baseline["verify_forwards"])
    assert baseline["tokens_per_s"] > 0 and baseline["prompt_lookup_num_tokens"] == 5
    settings = results["settings"]
    assert settings["block_size"] == 4 and settings["drafter_block_size"] == 6 and settings["max_new_tokens"] == 19
    assert settings["target_layer_ids"] == LAYER_IDS and settings["mask_token_id"] == 151669 and settings["dtype"] == "float32"
    assert set(results["versions"]) >= {"torch", "transformers"} and results["device"].startswith("cpu")


def test_cli_samples_at_temperature(qwen3_dirs, tmp_path):
    """--temperature > 0: tau and acceptance by position are counted as at temperature 0, there is no
    per-prompt lossless check, and a seed makes the run reproducible."""
    target_dir, drafter_dir, prompts, _ = qwen3_dirs
    args = [
        "--target_model",
        str(target_dir),
        "--draft_model",
        str(drafter_dir),
        "--data",
        str(prompts),
        "--max_new_tokens",
        "13",
        "--temperature",
        "0.9",
        "--top_p",
        "0.95",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--prompt_lookup_num_tokens",
        "4",
        "--num_prompts",
        "1",
    ]
    first = eval_dflash.main(args + ["--output", str(tmp_path / "a.json")])
    again = eval_dflash.main(args + ["--output", str(tmp_path / "b.json"), "--baseline", "none"])
    assert first["lossless"] is None and first["mismatches"] == [] and first["baseline"]["lossless"] is None
    assert all(row["lossless"] is None for row in first["per_prompt"])
    assert first["acceptance_length"] == pytest.approx((first["generated_tokens"] - first["num_prompts"]) / first["verify_forwards"])
    rates = first["acceptance_rate_by_position"]
    assert len(rates) == 5 and rates == sorted(rates, reverse=True)
    assert first["settings"]["temperature"] == 0.9 and first["settings"]["top_p"] == 0.95
    # The same seed draws the same tokens, with or without the target-only reference decoding beside them.
    alone = eval_dflash.main(args + ["--output", str(tmp_path / "c.json"), "--baseline", "none", "--target_reference", "false"])
    keys = ("generated_tokens", "verify_forwards", "acceptance_length")
    assert (
        {k: first["per_prompt"][0][k] for k in keys} == {k: again["per_prompt"][0][k] for k in keys} == {k: alone["per_prompt"][0][k] for k in keys}
    )
    assert again["speedup"] > 0 and alone["speedup"] is None and alone["target_tokens_per_s"] is None
    assert alone["seconds"]["target"] == 0 and alone["target_only_tokens"] == 0 and again["target_only_tokens"] > 0


def test_evaluate_acceptance_restores_training_mode(qwen3_dirs):
    from dflash_data import load_prompts
    from dflash_target import load_target

    target_dir, drafter_dir, prompts_path, _ = qwen3_dirs
    target, tokenizer = load_target(str(target_dir), device="cpu")
    drafter = DFlashDraftModel.from_pretrained(drafter_dir)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    prompts = load_prompts(str(prompts_path), tokenizer)
    drafter.train()
    summary = evaluate_acceptance(target, drafter, tokenizer, prompts, max_new_tokens=12)
    assert drafter.training, "evaluate_acceptance must give the drafter back in training mode"
    assert summary["num_prompts"] == 4
    assert summary["acceptance_length"] * summary["verify_forwards"] == pytest.approx(summary["generated_tokens"] - 4)
    assert summary["speculative_tokens_per_s"] > 0
    drafter.eval()
    assert evaluate_acceptance(target, drafter, tokenizer, prompts, max_new_tokens=12, block_size=3)["acceptance_rate_by_position"].__len__() == 2
    assert not drafter.training
    # prompt_lookup: transformers' prompt lookup on the same prompts beside it, counted as the CLI counts it.
    from dflash_decoding import encode_prompt, eos_token_ids_of, prompt_lookup_generate, prompt_lookup_tau

    with_baseline = evaluate_acceptance(target, drafter, tokenizer, prompts, max_new_tokens=12, prompt_lookup=True)
    assert "prompt_lookup_acceptance_length" not in summary
    eos = eos_token_ids_of(tokenizer, target)
    lookup = [
        prompt_lookup_generate(target, encode_prompt(tokenizer, messages, None, "cpu"), 12, eos, tokenizer.pad_token_id)[1] for messages in prompts
    ]
    assert with_baseline["prompt_lookup_acceptance_length"] == prompt_lookup_tau(lookup) is not None
    assert with_baseline["acceptance_length"] == evaluate_acceptance(target, drafter, tokenizer, prompts, max_new_tokens=12)["acceptance_length"]


def test_cli_rejects_bad_inputs(qwen3_dirs, tmp_path, monkeypatch):
    target_dir, drafter_dir, prompts, _ = qwen3_dirs
    base = [
        "--target_model",
        str(target_dir),
        "--data",
        str(prompts),
        "--max_new_tokens",
        "8",
        "--output",
        str(tmp_path / "r.json"),
        "--device",
        "cpu",
    ]
    not_dflash = tmp_path / "plain_qwen3"
    tiny_target(seed=3).config.save_pretrained(not_dflash)
    with pytest.raises(ValueError, match="dflash_config"):
        eval_dflash.main(base + ["--draft_model", str(not_dflash)])
    with pytest.raises(ValueError, match="--temperature must be >= 0 and --top_p in \\(0, 1\\]"):
        eval_dflash.main(base + ["--draft_model", str(drafter_dir), "--temperature", "-0.5"])
    with pytest.raises(ValueError, match="--top_p"):
        eval_dflash.main(base + ["--draft_model", str(drafter_dir), "--temperature", "0.7", "--top_p", "0"])
    for draft_settings in (
        ["--draft_temperature", "0.5"],
        ["--temperature", "0.7", "--draft_temperature", "0"],
        ["--temperature", "0.7", "--proposal", "argmax", "--draft_temperature", "0.5"],
    ):
        with pytest.raises(ValueError, match=r"^--draft_temperature .*: needs --temperature > 0, --proposal sample and a value > 0"):
            eval_dflash.main(base + ["--draft_model", str(drafter_dir)] + draft_settings)
    for reference_settings in (["--target_reference", "false"], ["--temperature", "0.7", "--target_reference", "false"]):
        with pytest.raises(ValueError, match=r"^--target_reference false: needs --temperature > 0 and --baseline none"):
            eval_dflash.main(base + ["--draft_model", str(drafter_dir)] + reference_settings)
    # A block size the drafter cannot draft and a missing prompt file fail before the target loads.
    import dflash_target

    def no_target_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the settings were checked")

    for loader in ("load_target", "load_target_model"):  # eval's main loads through load_target_model
        monkeypatch.setattr(dflash_target, loader, no_target_load)
    with pytest.raises(ValueError, match="block_size 7"):
        eval_dflash.main(base + ["--draft_model", str(drafter_dir), "--block_size", "7", "--baseline", "none"])
    missing = base[:2] + ["--data", str(tmp_path / "missing.jsonl")] + base[4:]
    with pytest.raises(ValueError, match=f"--data {tmp_path}/missing.jsonl: no such file"):
        eval_dflash.main(missing + ["--draft_model", str(drafter_dir)])


# ----------------------------------------------------------------------------------------------
# Static caches (the GPU path, without CUDA graphs on CPU) against the growing caches


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_static_cache_decodes_like_the_dynamic_one(attention):
    """One static `Decoder` reused over many prompts gives the dynamic path's tokens and tau exactly:
    the stale positions past each crop are masked, in the target's and the drafter's cache."""
    from dflash_runners import Decoder

    target = tiny_target(seed=11, attn_implementation=attention)
    drafter = tiny_drafter(target, seed=12)
    prompts = random_prompts(6, seed=13)
    max_new_tokens = 40
    static = Decoder(target, drafter, "static", max_length=30 + max_new_tokens + TRAINED_BLOCK)
    assert static.target.additive_mask == (attention == "eager")
    dynamic_stats, static_stats = [], []
    for i, input_ids in enumerate(prompts):
        block_size = [TRAINED_BLOCK, 5][i % 2]
        reference = greedy_generate(target, input_ids, max_new_tokens)
        assert greedy_generate(target, input_ids, max_new_tokens, decoder=static) == reference
        tokens, stats = speculative_generate(target, drafter, input_ids, max_new_tokens, block_size)
        static_tokens, s_stats = speculative_generate(target, drafter, input_ids, max_new_tokens, block_size, decoder=static)
        assert tokens == reference and static_tokens == reference, f"prompt {i}"
        assert s_stats == stats, f"prompt {i}: the static path verified differently"
        dynamic_stats.append(stats)
        static_stats.append(s_stats)
    summary = summarize_speculative(static_stats, TRAINED_BLOCK)
    assert summary == summarize_speculative(dynamic_stats, TRAINED_BLOCK)
    assert summary["verify_forwards"] > len(prompts)
    static.close()


def test_static_drafter_cache_drafts_like_the_growing_one(target, drafter):
    """The draft pass over a preallocated cache with stale entries past its length equals the one over
    a cache that holds exactly the context."""
    from dflash_model import DFlashContextCache

    features = torch.randn(1, 23, len(LAYER_IDS) * 64)
    static = DFlashStaticContextCache(drafter.config, 1, 40, torch.float32, "cpu")
    drafter.extend_context(static, torch.randn(1, 40, len(LAYER_IDS) * 64))  # stale garbage everywhere
    static.crop(0)
    drafter.extend_context(static, features[:, :15])
    drafter.extend_context(static, features[:, 15:])
    growing = drafter.extend_context(None, features)
    assert isinstance(growing, DFlashContextCache) and static.length == growing.length == 23
    for i in range(len(growing.keys)):
        torch.testing.assert_close(static.keys[i][:, :, :23], growing.keys[i])
    anchor = torch.tensor([7])
    assert torch.equal(drafter.draft_block(static, anchor), drafter.draft_block(growing, anchor))
    with pytest.raises(ValueError, match="does not fit the static cache"):
        drafter.extend_context(static, torch.randn(1, 20, len(LAYER_IDS) * 64))


def test_kv_cache_settings():
    from dflash_runners import resolve_kv_cache

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_kv_cache("auto", "auto", cpu) == ("dynamic", False)
    assert resolve_kv_cache("auto", "auto", gpu) == ("static", True)
    assert resolve_kv_cache("static", "off", gpu) == ("static", False)
    assert resolve_kv_cache("static", "auto", cpu) == ("static", False)
    with pytest.raises(ValueError, match="cuda_graphs on needs a CUDA device"):
        resolve_kv_cache("static", "on", cpu)
    with pytest.raises(ValueError, match="kv_cache must be"):
        resolve_kv_cache("paged", "auto", cpu)


def test_prompt_lookup_counts_commits_when_stopping_criteria_run_twice(target, monkeypatch):
    """Some transformers versions check the stopping criteria twice per forward: the counts come from a
    forward hook and the committed tokens, so they do not change. The reference count here reads the
    KV-cache length at the start of every target forward (it holds all but the last committed token)."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4])
    cache_lengths = []

    def record_cache_length(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache_lengths.append(int(cache.get_seq_length()) if cache is not None else 0)

    handle = target.register_forward_pre_hook(record_cache_length, with_kwargs=True)
    try:
        tokens, stats = prompt_lookup_generate(target, input_ids, 30, eos_token_ids=[VOCAB - 2], pad_token_id=0, num_tokens=6)
    finally:
        handle.remove()
    assert len(cache_lengths) == stats["target_forwards"] >= 3
    after_first = cache_lengths[1] + 1 - input_ids.shape[1]  # tokens committed by the first forward
    assert stats["committed_after_first"] == len(tokens) - after_first

    original = StoppingCriteriaList.__call__

    def twice(self, input_ids, scores, **kwargs):
        original(self, input_ids, scores, **kwargs)
        return original(self, input_ids, scores, **kwargs)

    monkeypatch.setattr(StoppingCriteriaList, "__call__", twice)
    tokens_twice, stats_twice = prompt_lookup_generate(target, input_ids, 30, eos_token_ids=[VOCAB - 2], pad_token_id=0, num_tokens=6)
    assert tokens_twice == tokens and stats_twice == stats


def test_cli_refuses_a_drafter_whose_weights_do_not_fit_its_config_before_any_weight_loads(qwen3_dirs, tmp_path, monkeypatch):
    """A drafter folder whose config.json describes other shapes than its model.safetensors holds (a
    config copied from another export), and --num_prompts 0: one ValueError line each, before the
    drafter's or the target's weights load."""
    import shutil

    import dflash_target

    target_dir, drafter_dir, prompts, _ = qwen3_dirs
    base = [
        "--target_model",
        str(target_dir),
        "--data",
        str(prompts),
        "--max_new_tokens",
        "8",
        "--output",
        str(tmp_path / "r.json"),
        "--device",
        "cpu",
    ]

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the drafter's files were checked")

    for loader in ("load_target", "load_target_model"):
        monkeypatch.setattr(dflash_target, loader, no_weights)
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", no_weights)
    mixed = tmp_path / "mixed"
    shutil.copytree(drafter_dir, mixed)
    config = json.loads((mixed / "config.json").read_text())
    assert config["intermediate_size"] == 128
    (mixed / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError) as error:
        eval_dflash.main(base + ["--draft_model", str(mixed)])
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"--draft_model '{mixed}': its weights do not fit its config.json: ")
    assert "layers.0.mlp.gate_proj.weight is [128, 64] in the file, [96, 64] by config.json" in message, message
    assert "(and 3 more)" in message  # up_proj and down_proj of 2 layers: 6 in all, 3 named
    with pytest.raises(ValueError, match=r"^--num_prompts must be >= 1 \(or left out: every prompt of --data\), got 0$"):
        eval_dflash.main(base + ["--draft_model", str(drafter_dir), "--num_prompts", "0"])


# ----------------------------------------------------------------------------------------------
# A drafter evaluated on a target other than its own


def qwen3_target_dir(root, tokenizer, seed, **sizes):
    """A tiny Qwen3 target folder with the Qwen3 tokenizer: the weights of `tiny_target(seed)`, or
    with `sizes` only a config.json of those sizes (for checks that must not load weights)."""
    extra = dict(tie_word_embeddings=True, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    if sizes:
        Qwen3Config(
            **{
                **dict(
                    hidden_size=64,
                    num_hidden_layers=4,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=16,
                    intermediate_size=128,
                    vocab_size=151936,
                    max_position_embeddings=1024,
                ),
                **extra,
                **sizes,
            }
        ).save_pretrained(root)
    else:
        tiny_target(vocab_size=151936, seed=seed, **extra).save_pretrained(root)
    write_qwen3_tokenizer(root)  # the hub's files: they load faster than what save_pretrained writes
    return root


def test_the_target_fingerprint_survives_a_cast_and_tells_other_weights_apart():
    from dflash_target import target_fingerprint

    target, other = tiny_target(), tiny_target(seed=5)
    weight = target.get_input_embeddings().weight
    fingerprint = target_fingerprint(weight, 4)
    assert fingerprint["embedding_shape"] == [VOCAB, 64] and fingerprint["num_layers"] == 4
    assert len(fingerprint["embedding_signs_sha256"]) == 16
    for dtype in (torch.bfloat16, torch.float16):
        assert target_fingerprint(weight.to(dtype), 4) == fingerprint
    assert target_fingerprint(other.get_input_embeddings().weight, 4)["embedding_signs_sha256"] != fingerprint["embedding_signs_sha256"]
    assert target_fingerprint(weight, 5) != fingerprint


def test_eval_warns_in_one_line_when_the_target_is_not_the_one_the_export_was_trained_for(qwen3_dirs, tmp_path, caplog):
    """The export records the target's fingerprint; eval on a target of the same shapes with other
    weights warns once, in one line, and still runs. The same target gives no warning, and neither
    does a drafter saved without a fingerprint (older exports, other trainers, conversions)."""
    from dataclasses import dataclass

    from dflash_checkpoint import save_export
    from dflash_target import load_target

    target_dir, drafter_dir, prompts, tokenizer = qwen3_dirs
    target, _ = load_target(str(target_dir), device="cpu")
    drafter = DFlashDraftModel.from_pretrained(drafter_dir)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())

    @dataclass
    class Settings:
        target_model: str = str(target_dir)

    save_export(drafter, tmp_path / "final", Settings(), card="# card\n")
    recorded = json.loads((tmp_path / "final" / "config.json").read_text())["dflash_config"]["target_fingerprint"]
    assert recorded["embedding_shape"] == [151936, 64] and recorded["num_layers"] == 4
    other_dir = qwen3_target_dir(tmp_path / "other", tokenizer, seed=8)

    def warnings(target_path, drafter_path):
        caplog.clear()
        with caplog.at_level("WARNING", logger="eval_dflash"):
            eval_dflash.main(
                [
                    "--target_model",
                    str(target_path),
                    "--draft_model",
                    str(drafter_path),
                    "--data",
                    str(prompts),
                    "--num_prompts",
                    "1",
                    "--max_new_tokens",
                    "3",
                    "--baseline",
                    "none",
                    "--device",
                    "cpu",
                    "--output",
                    str(tmp_path / "r.json"),
                ]
            )
        return [record.getMessage() for record in caplog.records if record.name == "eval_dflash"]

    [warning] = warnings(other_dir, tmp_path / "final")
    assert "\n" not in warning and warning.startswith("the target differs from the one this drafter was trained for (embedding_signs_sha256 ")
    assert f"{recorded['embedding_signs_sha256']} at export" in warning and "expect tau near 1" in warning
    assert warnings(target_dir, tmp_path / "final") == []
    assert warnings(other_dir, drafter_dir) == []  # no fingerprint: no word


def test_a_drafter_for_another_target_shape_and_a_missing_prompt_file_are_refused_before_any_weights_load(qwen3_dirs, tmp_path, monkeypatch):
    import dflash_target

    target_dir, drafter_dir, prompts, tokenizer = qwen3_dirs

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the drafter and the target were checked against each other")

    for loader in ("load_target", "load_target_model"):
        monkeypatch.setattr(dflash_target, loader, no_weights)
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", no_weights)
    base = [
        "--draft_model",
        str(drafter_dir),
        "--data",
        str(prompts),
        "--max_new_tokens",
        "8",
        "--output",
        str(tmp_path / "r.json"),
        "--device",
        "cpu",
    ]
    wider = qwen3_target_dir(tmp_path / "wider", tokenizer, seed=0, hidden_size=96)
    with pytest.raises(ValueError, match=r"^hidden size mismatch: the drafter has hidden_size 64, the target has 96\. ") as error:
        eval_dflash.main(["--target_model", str(wider)] + base)
    assert "\n" not in str(error.value)
    deeper = qwen3_target_dir(tmp_path / "deeper", tokenizer, seed=0, num_hidden_layers=6)
    with pytest.raises(
        ValueError,
        match=r"^layer count mismatch: the drafter was trained on a target with 4 decoder layers, "
        r"this target has 6\. Pass the matching --target_model or a drafter trained for this target",
    ):
        eval_dflash.main(["--target_model", str(deeper)] + base)
    with pytest.raises(ValueError, match=f"^--data {tmp_path}/missing.jsonl: no such file$"):
        eval_dflash.main(["--target_model", str(target_dir)] + base[:2] + ["--data", str(tmp_path / "missing.jsonl")] + base[4:])
