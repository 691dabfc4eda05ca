"""regenerate_data.py: resume without duplicates or losses, same text as an uninterrupted run,
failures retried one by one and counted, a prompt/output mismatch refused.

A tiny random Qwen3 (hidden 32, 2 layers) with the real Qwen3 tokenizer stands in for the
target; generations are short (max_new_tokens 6).
"""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import regenerate_data
from dflash_data import build_train_dataset, prompt_hash

NUM_PROMPTS = 10


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, qwen3_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen3")
    config = Qwen3Config(
        vocab_size=len(qwen3_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=qwen3_tokenizer.eos_token_id,
        pad_token_id=qwen3_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    qwen3_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture()
def prompts_file(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    # Varied lengths, so batches are left-padded.
    lines = [{"prompt": f"Question {i}: " + "why " * (i % 4) + "is the sky blue?"} for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def regenerate(target, prompts, output, *extra) -> dict:
    argv = ["--target_model", target, "--prompts", prompts, "--output", str(output), "--max_new_tokens", "6",
            "--batch_size", "3", "--temperature", "0", "--seed", "7", *extra]
    return regenerate_data.main(argv)


def read_output(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def replies(records) -> dict[int, str]:
    return {r["id"]: r["messages"][-1]["content"] for r in records}


def test_resume_after_partial_run_and_crash(tmp_path, tiny_target, prompts_file):
    full = tmp_path / "full.jsonl"
    summary = regenerate(tiny_target, prompts_file, full)
    assert summary["written"] == NUM_PROMPTS and summary["failed"] == 0
    reference = read_output(full)
    assert [r["id"] for r in reference] == list(range(NUM_PROMPTS))
    prompts = regenerate_data.load_prompts(prompts_file)
    for record in reference:  # OpenAI messages: the prompt, then the target's reply
        assert record["messages"][:-1] == prompts[record["id"]]
        assert record["messages"][-1]["role"] == "assistant" and record["messages"][-1]["content"].strip()
        assert record["prompt_hash"] == prompt_hash(prompts[record["id"]])
        assert 1 <= record["num_new_tokens"] <= 6

    # Interrupted after 6 prompts, then resumed.
    resumed = tmp_path / "resumed.jsonl"
    assert regenerate(tiny_target, prompts_file, resumed, "--num_prompts", "6")["written"] == 6
    # A crash while writing: the file ends in the middle of the line of prompt 3 (lines of 4, 5 lost).
    text = resumed.read_text(encoding="utf-8")
    cut = text.index('{"id": 3') + 20
    resumed.write_text(text[:cut], encoding="utf-8")
    summary = regenerate(tiny_target, prompts_file, resumed)
    assert summary["already_done"] == 3 and summary["written"] == NUM_PROMPTS - 3
    records = read_output(resumed)
    assert sorted(r["id"] for r in records) == list(range(NUM_PROMPTS))  # each prompt exactly once
    assert replies(records) == replies(reference)  # same text as the uninterrupted run

    # Nothing left to do: a rerun writes nothing, also with a smaller --num_prompts.
    assert regenerate(tiny_target, prompts_file, resumed)["written"] == 0
    summary = regenerate(tiny_target, prompts_file, resumed, "--num_prompts", "4")
    assert summary["already_done"] == 4 and summary["written"] == 0
    assert len(read_output(resumed)) == NUM_PROMPTS

    # The output trains directly.
    dataset = build_train_dataset([str(resumed)], regenerate_data.AutoTokenizer.from_pretrained(tiny_target), max_seq_length=64)
    assert len(dataset) == NUM_PROMPTS


def test_sampling_is_deterministic_across_resume(tmp_path, tiny_target, prompts_file):
    sampling = ("--temperature", "1.0", "--top_p", "0.95")
    full = tmp_path / "full.jsonl"
    regenerate(tiny_target, prompts_file, full, *sampling)
    resumed = tmp_path / "resumed.jsonl"
    regenerate(tiny_target, prompts_file, resumed, *sampling, "--num_prompts", "3")
    regenerate(tiny_target, prompts_file, resumed, *sampling)
    assert replies(read_output(resumed)) == replies(read_output(full))
    other_seed = tmp_path / "other.jsonl"
    regenerate(tiny_target, prompts_file, other_seed, *sampling, "--seed", "8")
    assert replies(read_output(other_seed)) != replies(read_output(full))


def test_failed_batches_are_retried_per_prompt(tmp_path, tiny_target, prompts_file, monkeypatch):
    real = regenerate_data.generate_replies

    def flaky(model, tokenizer, prompts, *args):
        if len(prompts) > 1:
            raise RuntimeError("simulated out of memory")
        if "Question 4:" in prompts[0][0]["content"]:
            raise RuntimeError("simulated bad prompt")
        return real(model, tokenizer, prompts, *args)

    monkeypatch.setattr(regenerate_data, "generate_replies", flaky)
    output = tmp_path / "out.jsonl"
    summary = regenerate(tiny_target, prompts_file, output)
    assert summary["failed"] == 1 and summary["written"] == NUM_PROMPTS - 1
    assert sorted(r["id"] for r in read_output(output)) == [i for i in range(NUM_PROMPTS) if i != 4]
    monkeypatch.setattr(regenerate_data, "generate_replies", real)
    summary = regenerate(tiny_target, prompts_file, output)  # the failed prompt is retried
    assert summary["written"] == 1 and sorted(r["id"] for r in read_output(output)) == list(range(NUM_PROMPTS))


def test_output_from_other_prompts_is_refused(tmp_path, tiny_target, prompts_file):
    output = tmp_path / "out.jsonl"
    regenerate(tiny_target, prompts_file, output, "--num_prompts", "2")
    other = tmp_path / "other_prompts.jsonl"
    other.write_text(json.dumps({"prompt": "Something else entirely"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"out.jsonl:1: prompt id 0 does not match"):
        regenerate(tiny_target, str(other), output)
    with pytest.raises(ValueError, match="--chat_template_kwargs must be a JSON dict"):
        regenerate(tiny_target, prompts_file, output, "--chat_template_kwargs", "enable_thinking=false")
