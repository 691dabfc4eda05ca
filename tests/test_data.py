"""dflash_data: formats, chat-template loss masks, bad lines, truncation, batching, prompts.

Uses the session fixtures of conftest.py (qwen3_tokenizer, smollm2_tokenizer, gsm8k_path);
never mutates them (copies before changing a template).
"""

import copy
import json
import logging
import os

import datasets
import pytest
import torch

from dflash_data import (
    DataFormatError,
    build_train_dataset,
    collate_batch,
    length_grouped_batches,
    load_prompts,
    normalize_record,
    shuffled_batches,
    tokenize_conversation,
)

IM_END = "<|im_end|>"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep datasets' cache files of these tests in tmp_path, not ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def masked_runs(tokenizer, input_ids, loss_mask) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    runs, current = [], []
    for token, masked in zip(input_ids, loss_mask):
        if masked:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def unmasked_text(tokenizer, input_ids, loss_mask) -> str:
    return tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if not m])


MULTI_TURN = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42."},
    {"role": "user", "content": "Now double it."},
    {"role": "assistant", "content": "Doubling 42 gives 84.\n\nDone."},
]


# ----------------------------------------------------------------------------------------
# Formats


def test_three_formats_normalize_to_the_same_messages():
    expected = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert normalize_record({"messages": expected}) == expected
    assert normalize_record({"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]}) == expected
    assert normalize_record({"question": "Q?", "answer": "A."}) == expected
    # ShareGPT role aliases and OpenAI content parts
    sharegpt = {"conversations": [{"from": "system", "value": "S"}, {"from": "user", "value": "Q?"}, {"from": "chatgpt", "value": "A."}]}
    assert normalize_record(sharegpt) == [{"role": "system", "content": "S"}] + expected
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q?"}]}, {"role": "assistant", "content": "A."}]}
    assert normalize_record(parts) == expected


def test_files_and_hf_datasets_give_identical_samples(tmp_path, qwen3_tokenizer):
    messages = [{"role": "user", "content": f"Add {i} and {i}."} for i in range(6)]
    records = [{"messages": [m, {"role": "assistant", "content": f"The sum is {2 * i}."}]} for i, m in enumerate(messages)]
    sharegpt = [
        {"conversations": [{"from": "human", "value": r["messages"][0]["content"]}, {"from": "gpt", "value": r["messages"][1]["content"]}]}
        for r in records
    ]
    gsm8k = [{"question": r["messages"][0]["content"], "answer": r["messages"][1]["content"]} for r in records]

    jsonl = write_jsonl(tmp_path / "openai.jsonl", records)
    json_file = tmp_path / "sharegpt.json"
    json_file.write_text(json.dumps(sharegpt))
    saved = tmp_path / "saved_dataset"
    datasets.Dataset.from_list(gsm8k).save_to_disk(str(saved))
    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    datasets.Dataset.from_list(records).to_parquet(str(parquet_dir / "part-0.parquet"))

    def samples(path):
        dataset = build_train_dataset([path], qwen3_tokenizer, max_seq_length=128, seed=3)
        assert dataset.column_names == ["input_ids", "loss_mask", "num_tokens", "num_loss_tokens"]
        assert all(s["num_loss_tokens"] == sum(s["loss_mask"]) for s in dataset)
        return sorted((tuple(s["input_ids"]), tuple(s["loss_mask"]), s["num_tokens"]) for s in dataset)

    reference = samples(jsonl)
    assert len(reference) == 6
    for path in (str(json_file), str(saved), str(parquet_dir)):
        assert samples(path) == reference, path
    # Several inputs concatenate.
    both = build_train_dataset([jsonl, str(saved)], qwen3_tokenizer, max_seq_length=128)
    assert len(both) == 12


# ----------------------------------------------------------------------------------------
# Loss masks on real chat templates


def test_loss_mask_qwen3_multi_turn(qwen3_tokenizer):
    input_ids, loss_mask = tokenize_conversation(MULTI_TURN, qwen3_tokenizer, max_seq_length=4096)
    assert len(input_ids) == len(loss_mask)
    # Hand-checked: Qwen3 writes an empty think block into the LAST assistant turn; the
    # target would write it itself (thinking on), so it is trained. End-of-turn is trained.
    assert masked_runs(qwen3_tokenizer, input_ids, loss_mask) == [
        "12 + 30 = 42." + IM_END,
        "<think>\n\n</think>\n\nDoubling 42 gives 84.\n\nDone." + IM_END,
    ]
    assert unmasked_text(qwen3_tokenizer, input_ids, loss_mask) == (
        "<|im_start|>system\nYou answer in one line.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nNow double it.<|im_end|>\n<|im_start|>assistant\n\n"
    )
    # Every trained token is an assistant token: the last masked token of each run is <|im_end|>.
    im_end = qwen3_tokenizer.convert_tokens_to_ids(IM_END)
    ends = [t for t in range(len(input_ids)) if loss_mask[t] and (t + 1 == len(input_ids) or not loss_mask[t + 1])]
    assert [input_ids[t] for t in ends] == [im_end, im_end]


def test_loss_mask_qwen3_thinking_off_and_reasoning(qwen3_tokenizer):
    # enable_thinking=False: the empty think block is part of the generation prompt, not trained.
    input_ids, loss_mask = tokenize_conversation(MULTI_TURN, qwen3_tokenizer, max_seq_length=4096, chat_template_kwargs={"enable_thinking": False})
    assert masked_runs(qwen3_tokenizer, input_ids, loss_mask) == ["12 + 30 = 42." + IM_END, "Doubling 42 gives 84.\n\nDone." + IM_END]
    # Reasoning: an earlier turn's <think> is dropped by the template; the last turn's is
    # trained. The answer "42" also occurs inside the reasoning; the span must still be right.
    messages = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>\n6 * 7 is 42\n</think>\n\n42"},
        {"role": "user", "content": "And 40 + 2?"},
        {"role": "assistant", "content": "<think>\n40 + 2 = 42\n</think>\n\n42"},
    ]
    input_ids, loss_mask = tokenize_conversation(messages, qwen3_tokenizer, max_seq_length=4096)
    assert masked_runs(qwen3_tokenizer, input_ids, loss_mask) == ["42" + IM_END, "<think>\n40 + 2 = 42\n</think>\n\n42" + IM_END]


def test_loss_mask_smollm2_multi_turn(smollm2_tokenizer):
    input_ids, loss_mask = tokenize_conversation(MULTI_TURN, smollm2_tokenizer, max_seq_length=4096)
    assert masked_runs(smollm2_tokenizer, input_ids, loss_mask) == ["12 + 30 = 42." + IM_END, "Doubling 42 gives 84.\n\nDone." + IM_END]
    assert unmasked_text(smollm2_tokenizer, input_ids, loss_mask) == (
        "<|im_start|>system\nYou answer in one line.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nNow double it.<|im_end|>\n<|im_start|>assistant\n\n"
    )
    # Without a system message SmolLM2's template inserts its default one: never trained.
    input_ids, loss_mask = tokenize_conversation(MULTI_TURN[1:3], smollm2_tokenizer, max_seq_length=4096)
    assert masked_runs(smollm2_tokenizer, input_ids, loss_mask) == ["12 + 30 = 42." + IM_END]
    assert "You are a helpful AI assistant named SmolLM" in unmasked_text(smollm2_tokenizer, input_ids, loss_mask)


def test_generation_tag_template_matches_offset_method(smollm2_tokenizer):
    """A template with {% generation %} goes through transformers' assistant mask; the end-of-turn
    token (left outside the tag here) is added, so both methods agree token for token."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
        "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tagged = tokenize_conversation(MULTI_TURN, tokenizer, max_seq_length=4096)
    offsets = tokenize_conversation(MULTI_TURN, plain, max_seq_length=4096)
    assert tagged == offsets
    assert masked_runs(tokenizer, *tagged) == ["12 + 30 = 42." + IM_END, "Doubling 42 gives 84.\n\nDone." + IM_END]


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path, smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Q", "answer": "A"}])
    with pytest.raises(ValueError, match="has no chat template.*Pass a target model"):
        build_train_dataset([path], tokenizer, max_seq_length=64)
    with pytest.raises(ValueError, match="has no chat template"):
        load_prompts(path, tokenizer)


# ----------------------------------------------------------------------------------------
# Bad lines

GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, nice to meet you!"}]}
BAD_LINES = {
    "invalid_json": '{"messages": [',
    "unknown_format": {"text": "just text"},
    "bad_message": {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
    "missing_roles": {"messages": [{"role": "user", "content": "only a question"}]},
    "empty_assistant_turn": {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "  "}]},
}


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(tmp_path, qwen3_tokenizer, reason):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, BAD_LINES[reason], GOOD])
    with pytest.raises(DataFormatError) as error:
        build_train_dataset([path], qwen3_tokenizer, max_seq_length=128)
    assert error.value.reason == reason
    assert f"{path}:3: " in str(error.value)
    assert "skip_bad_samples" in str(error.value)


def test_invalid_json_names_the_file_line_and_the_column_in_it(tmp_path, qwen3_tokenizer):
    # A line cut short: the parser runs into the line break, which it used to report as "line 2 column 1".
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 5 + ['{"messages": [', GOOD])
    with pytest.raises(DataFormatError) as error:
        build_train_dataset([path], qwen3_tokenizer, max_seq_length=128)
    assert f"{path}:6: invalid JSON at column 15: Expecting value" in str(error.value)
    assert "line 2" not in str(error.value)
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hi"}, '{"prompt": "Hi",, "x": 1}'])
    with pytest.raises(DataFormatError, match=rf"{path}:2: invalid JSON at column 17: Expecting property name"):
        load_prompts(path)


def _long_prompt(words: int) -> dict:
    return {"messages": [{"role": "user", "content": "word " * words}, {"role": "assistant", "content": "ok fine"}]}


def test_samples_with_nothing_left_after_truncation_are_dropped_and_counted(tmp_path, qwen3_tokenizer, caplog):
    long_reply = {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two " * 30}]}
    records = [GOOD, _long_prompt(100), GOOD, long_reply, GOOD]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="dflash_data"):
        dataset = build_train_dataset([path], qwen3_tokenizer, max_seq_length=40)
    assert len(dataset) == 4 and max(dataset["num_tokens"]) == 40  # the long prompt is dropped, the long reply cut
    full = [tokenize_conversation(normalize_record(r), qwen3_tokenizer, max_seq_length=None)[1] for r in records]
    lost = sum(full[1]) + sum(full[3][40:])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "max_seq_length=40: dropped 1 of 5 samples (20.0%) with fewer than 2 assistant tokens left after truncation, "
        f"and cut the assistant reply of 1 more; {lost / sum(map(sum, full)):.1%} of all assistant tokens are not trained."
    ), warnings[0]
    assert "Raise --max_seq_length" in warnings[0]


def test_truncation_hint_names_a_length_above_the_setting(caplog):
    """The hint names a longer --max_seq_length: the 95th percentile's when it is above the setting,
    else the longest sample's (20 samples, one of them cut: 95% are whole already)."""
    from dflash_data import report_truncation

    def columns(full_tokens):
        cut = [n > 100 for n in full_tokens]
        return {
            "dropped": [False] * len(full_tokens),
            "full_tokens": full_tokens,
            "full_loss_tokens": [50] * len(full_tokens),
            "num_loss_tokens": [40 if c else 50 for c in cut],
        }

    with caplog.at_level(logging.WARNING, logger="dflash_data"):
        report_truncation(columns([80] * 19 + [130]), max_seq_length=100, max_dropped_fraction=0.5)
        report_truncation(columns([80] * 10 + [120] * 10), max_seq_length=100, max_dropped_fraction=0.5)
    first, second = [r.getMessage() for r in caplog.records]
    assert first.endswith("(--max_seq_length 130 would keep every sample whole)."), first
    assert second.endswith("(--max_seq_length 120 would keep 95% of the samples whole)."), second


def test_too_many_samples_dropped_is_an_error(tmp_path, qwen3_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, _long_prompt(100), _long_prompt(120)])
    with pytest.raises(
        ValueError,
        match=r"dropped 2 of 3 samples \(66.7%\).*more than --max_dropped_fraction 0.5.*"
        r"Raise --max_seq_length \(--max_seq_length \d+ would keep 95%",
    ):
        build_train_dataset([path], qwen3_tokenizer, max_seq_length=40)
    assert len(build_train_dataset([path], qwen3_tokenizer, max_seq_length=40, max_dropped_fraction=0.7)) == 1


def test_template_error_names_file_and_line(tmp_path, smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + smollm2_tokenizer.chat_template
    )
    with_system = {"messages": [{"role": "system", "content": "S"}] + GOOD["messages"]}
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, with_system])
    with pytest.raises(DataFormatError, match=rf"{path}:2: chat template error: .*System role not supported") as error:
        build_train_dataset([path], tokenizer, max_seq_length=128)
    assert error.value.reason == "template_error"


def test_conversation_may_open_with_the_assistant(smollm2_tokenizer):
    messages = [
        {"role": "assistant", "content": "Hello! Ask me anything."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "How can I help?"},
    ]
    input_ids, loss_mask = tokenize_conversation(messages, smollm2_tokenizer, max_seq_length=4096)
    assert masked_runs(smollm2_tokenizer, input_ids, loss_mask) == ["Hello! Ask me anything." + IM_END, "How can I help?" + IM_END]


def test_json_file_errors_name_the_record(tmp_path, qwen3_tokenizer):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD, {"question": "no answer"}]))
    with pytest.raises(DataFormatError, match=rf"{path}\[record 1\]: unknown format"):
        build_train_dataset([str(path)], qwen3_tokenizer, max_seq_length=128)
    path.write_text('[{"question": "Q",\n "answer": }]')
    with pytest.raises(DataFormatError, match=rf"{path}:2: invalid JSON file"):
        build_train_dataset([str(path)], qwen3_tokenizer, max_seq_length=128)


@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "[]\n")])
def test_an_empty_data_file_is_named(tmp_path, qwen3_tokenizer, name, text):
    """An empty file, even beside a good one, is an error naming it (not datasets' 'corresponds to no data')."""
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}: the file (is empty|holds an empty JSON list) \(no records\)"):
        build_train_dataset([good, str(path)], qwen3_tokenizer, max_seq_length=128)


def test_skip_bad_samples_counts_per_reason(tmp_path, qwen3_tokenizer, caplog):
    lines = [GOOD, BAD_LINES["invalid_json"], GOOD, BAD_LINES["invalid_json"], BAD_LINES["empty_assistant_turn"], "", GOOD]
    path = write_jsonl(tmp_path / "data.jsonl", lines + [BAD_LINES["unknown_format"]])
    with caplog.at_level(logging.WARNING, logger="dflash_data"):
        dataset = build_train_dataset([path], qwen3_tokenizer, max_seq_length=128, skip_bad_samples=True)
    assert len(dataset) == 3  # the blank line is not a record
    summary = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(summary) == 1
    assert summary[0].startswith("Skipped 4 of 7 samples (invalid_json: 2, unknown_format: 1, empty_assistant_turn: 1)")
    assert f"First: {path}:2: invalid JSON" in summary[0]


# ----------------------------------------------------------------------------------------
# Truncation, shuffling, collate, batching


def test_truncation_and_shuffle(tmp_path, smollm2_tokenizer):
    records = [{"question": f"Count to {n}.", "answer": " ".join(str(i) for i in range(1, n + 1))} for n in range(1, 40)]
    path = write_jsonl(tmp_path / "count.jsonl", records)
    full = build_train_dataset([path], smollm2_tokenizer, max_seq_length=4096, seed=0)
    cut = build_train_dataset([path], smollm2_tokenizer, max_seq_length=48, seed=0)
    assert max(full["num_tokens"]) > 48
    assert max(cut["num_tokens"]) == 48
    for a, b in zip(full, cut):  # same seed, same order: each cut sample is a prefix
        assert b["num_tokens"] == len(b["input_ids"]) == len(b["loss_mask"]) == min(a["num_tokens"], 48)
        assert b["input_ids"] == a["input_ids"][:48] and b["loss_mask"] == a["loss_mask"][:48]
    # Deterministic shuffle by seed; max_samples caps the count.
    assert build_train_dataset([path], smollm2_tokenizer, max_seq_length=4096, seed=0)["input_ids"] == full["input_ids"]
    other = build_train_dataset([path], smollm2_tokenizer, max_seq_length=4096, seed=1)
    assert other["input_ids"] != full["input_ids"] and sorted(other["input_ids"]) == sorted(full["input_ids"])
    assert len(build_train_dataset([path], smollm2_tokenizer, max_seq_length=4096, max_samples=5)) == 5


def test_num_proc_gives_the_same_dataset(tmp_path, smollm2_tokenizer):
    records = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}."} for i in range(140)]
    path = write_jsonl(tmp_path / "add.jsonl", records)
    one = build_train_dataset([path], smollm2_tokenizer, max_seq_length=64, num_proc=1)
    two = build_train_dataset([path], smollm2_tokenizer, max_seq_length=64, num_proc=2)
    assert one.to_dict() == two.to_dict()


def test_collate_batch_pads_right():
    samples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "num_tokens": 3},
        {"input_ids": [8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1], "num_tokens": 5},
    ]
    batch = collate_batch(samples, pad_token_id=0, pad_to_multiple_of=4)
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 9, 10, 11, 12, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True] + [False] * 5, [False, False, True, True, True] + [False] * 3]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert collate_batch(samples, pad_token_id=99)["input_ids"].tolist()[0] == [5, 6, 7, 99, 99]


def test_length_grouped_batches():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 3000, (1000,), generator=generator).tolist()
    batches = length_grouped_batches(lengths, batch_size=8, seed=0, epoch=0)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(1000))  # every index exactly once
    assert all(len(b) == 8 for b in batches)
    assert lengths[batches[0][0]] == max(lengths)  # longest first: an OOM shows up at step 1
    assert batches == length_grouped_batches(lengths, batch_size=8, seed=0, epoch=0)
    assert batches != length_grouped_batches(lengths, batch_size=8, seed=0, epoch=1)
    assert batches != length_grouped_batches(lengths, batch_size=8, seed=1, epoch=0)

    def padding_fraction(groups):
        padded = sum(max(lengths[i] for i in g) * len(g) for g in groups)
        return 1 - sum(lengths) / padded

    random_batches = [list(range(i, i + 8)) for i in range(0, 1000, 8)]
    assert padding_fraction(random_batches) > 0.4
    assert padding_fraction(batches) < 0.05
    odd = length_grouped_batches(lengths[:13], batch_size=4, seed=0, epoch=0)
    assert sorted(i for b in odd for i in b) == list(range(13)) and sorted(len(b) for b in odd) == [1, 4, 4, 4]


def test_shuffled_batches_mix_lengths_and_put_the_longest_first():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 3000, (1000,), generator=generator).tolist()
    batches = shuffled_batches(lengths, batch_size=8, seed=0, epoch=0)
    assert sorted(i for batch in batches for i in batch) == list(range(1000))  # every index exactly once
    assert all(len(b) == 8 for b in batches)
    assert max(lengths) in [lengths[i] for i in batches[0]]  # the longest sample's batch first: an OOM shows up at step 1
    assert batches == shuffled_batches(lengths, batch_size=8, seed=0, epoch=0)
    assert batches != shuffled_batches(lengths, batch_size=8, seed=0, epoch=1)
    assert batches != shuffled_batches(lengths, batch_size=8, seed=1, epoch=0)
    # a random mix, not grouped: each batch's lengths spread as the data's do
    grouped = length_grouped_batches(lengths, batch_size=8, seed=0, epoch=0)

    def mean_spread(groups):
        return sum(max(lengths[i] for i in g) - min(lengths[i] for i in g) for g in groups) / len(groups)

    assert mean_spread(batches) > 1500 > 200 > mean_spread(grouped)
    odd = shuffled_batches(lengths[:13], batch_size=4, seed=0, epoch=0)
    assert sorted(i for b in odd for i in b) == list(range(13)) and sorted(len(b) for b in odd) == [1, 4, 4, 4]
    assert shuffled_batches([], batch_size=4, seed=0, epoch=0) == []


def test_the_batch_order_sets_each_epochs_micro_batches_and_a_checkpoint_keeps_it(monkeypatch, tmp_path):
    """--batch_order random draws each epoch's micro-batches with shuffled_batches, length_grouped
    (the default) with length_grouped_batches; trainer_state.json records a non-default order and a
    resume with another order is refused in one line naming the checkpoint and both orders."""
    from dflash_schedule import ResumePoint, epoch_batches, make_schedule
    from train_dflash import ScheduleSettings, TrainData, TrainSettings, settings_for

    lengths = [(7 * i) % 23 + 1 for i in range(40)]
    data = TrainData(dataset=None, lengths=lengths, eval_prompts=None, chat_kwargs=None)

    def settings(order):
        return TrainSettings(target_model="x", train_data=["x"], output_dir=str(tmp_path), per_device_batch_size=4, batch_order=order)

    for order, make in (("random", shuffled_batches), ("length_grouped", length_grouped_batches)):
        schedule = settings_for(ScheduleSettings, settings(order))
        assert schedule.batch_order == order
        assert epoch_batches(lengths, schedule, 3, drafter_ranks=1) == make(lengths, 4, 0, 3)
    with pytest.raises(ValueError, match="--batch_order must be one of length_grouped, random, got 'sorted'"):
        settings("sorted")
    from dflash_checkpoint import save_checkpoint

    class Engine:  # DeepSpeed's part of the save, replaced
        def save_checkpoint(self, path, tag):
            os.makedirs(os.path.join(path, tag))

    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: None)
    layout = type("Layout", (), dict(is_lead=True, drafter_group=None, dp_rank=0, dp_world=1, target_ranks_per_node=0))()
    for written, resumed in (("random", "length_grouped"), ("length_grouped", "random")):
        save_checkpoint(Engine(), settings(written), layout, 2, 0, 2)
        path = str(tmp_path / "checkpoint-2")
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        assert state.get("batch_order", "length_grouped") == written and ("batch_order" in state) == (written == "random")
        assert make_schedule(settings_for(ScheduleSettings, settings(written)), data, ResumePoint(path, state), 1).micro_steps_left > 0
        with pytest.raises(ValueError) as refused:
            make_schedule(settings_for(ScheduleSettings, settings(resumed)), data, ResumePoint(path, state), 1)
        assert str(refused.value) == (
            f"--resume_from_checkpoint {path} was written with --batch_order {written}, this run has {resumed}: "
            f"the order of micro-batches depends on it; resume with --batch_order {written}"
        )


# ----------------------------------------------------------------------------------------
# Prompts


def test_load_prompts_formats_and_errors(tmp_path, qwen3_tokenizer):
    path = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "P1"},
            {"question": "Q2", "answer": "ignored"},
            {"turns": ["T3", "second turn"]},
            "",
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"},
                    {"role": "user", "content": "U2"},
                    {"role": "assistant", "content": "A2"},
                ]
            },
            {"conversations": [{"from": "human", "value": "H"}]},
        ],
    )
    prompts = load_prompts(path, qwen3_tokenizer)
    assert prompts == [
        [{"role": "user", "content": "P1"}],
        [{"role": "user", "content": "Q2"}],
        [{"role": "user", "content": "T3"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "U2"},
        ],
        [{"role": "user", "content": "H"}],
    ]
    assert load_prompts(path, num_prompts=2) == prompts[:2]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"answer": "no prompt"}])
    with pytest.raises(DataFormatError, match=rf"{bad}:2: unknown prompt format"):
        load_prompts(bad)
    bad = write_jsonl(tmp_path / "bad2.jsonl", [{"prompt": "ok"}, "{not json"])
    with pytest.raises(DataFormatError, match=rf"{bad}:2: invalid JSON"):
        load_prompts(bad)


def test_demo_prompts_load(repo_root, smollm2_tokenizer):
    prompts = load_prompts(str(repo_root / "data" / "demo_prompts.jsonl"), smollm2_tokenizer)
    assert 150 <= len(prompts) <= 300
    assert len({p[0]["content"] for p in prompts}) == len(prompts)  # no duplicates
    # The demo measures tau on prompts that none of its training conversations contains.
    held_out = {p[0]["content"] for p in load_prompts(str(repo_root / "data" / "demo_heldout_prompts.jsonl"), smollm2_tokenizer)}
    trained = {json.loads(line)["messages"][0]["content"] for line in open(repo_root / "data" / "demo_conversations.jsonl")}
    assert len(held_out) == 10 and not held_out & trained and trained == {p[0]["content"] for p in prompts}


# ----------------------------------------------------------------------------------------
# Real data


def test_gsm8k_masks_are_the_answers(gsm8k_path, smollm2_tokenizer):
    dataset = build_train_dataset([str(gsm8k_path)], smollm2_tokenizer, max_seq_length=512, max_samples=64, seed=0)
    assert len(dataset) == 64
    answers = {json.loads(line)["answer"] for line in open(gsm8k_path)}
    for sample in dataset:
        runs = masked_runs(smollm2_tokenizer, sample["input_ids"], sample["loss_mask"])
        assert len(runs) == 1 and runs[0].endswith(IM_END)
        if sample["num_tokens"] < 512:  # untruncated: the masked text is exactly one GSM8K answer
            assert runs[0][: -len(IM_END)] in answers


def test_cache_follows_the_tokenizer_and_settings(tmp_path, smollm2_tokenizer):
    """The tokenized dataset is cached; a changed template or max_seq_length must not reuse it."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Name a colour.", "answer": "Blue is a colour."}])
    first = build_train_dataset([path], smollm2_tokenizer, max_seq_length=64)
    again = build_train_dataset([path], smollm2_tokenizer, max_seq_length=64)
    assert again.cache_files and again["input_ids"] == first["input_ids"]
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("named SmolLM", "named Bob")
    changed = build_train_dataset([path], tokenizer, max_seq_length=64)
    assert "named Bob" in tokenizer.decode(changed[0]["input_ids"])
    shorter = first[0]["num_tokens"] - 2  # cuts "<|im_end|>\n", keeps the answer
    assert build_train_dataset([path], smollm2_tokenizer, max_seq_length=shorter)[0]["num_tokens"] == shorter
    # An edited file is read again (datasets keys the raw records on size and mtime).
    write_jsonl(tmp_path / "d.jsonl", [{"question": "Name a shape.", "answer": "A circle is a shape."}])
    assert "circle" in smollm2_tokenizer.decode(build_train_dataset([path], smollm2_tokenizer, max_seq_length=64)[0]["input_ids"])


def test_reply_cut_at_max_new_tokens_has_no_end_of_turn_label(tmp_path, smollm2_tokenizer):
    """regenerate_data.py writes "finished": false for a reply cut at --max_new_tokens: the template
    still closes it with <|im_end|>, which must not be trained (the target would have continued)."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4 5 6"}]
    path = write_jsonl(tmp_path / "regen.jsonl", [{"messages": messages, "finished": True}, {"messages": messages, "finished": False}])
    done, cut = sorted(build_train_dataset([path], smollm2_tokenizer, max_seq_length=512), key=lambda r: sum(r["loss_mask"]), reverse=True)
    assert done["input_ids"] == cut["input_ids"]
    end_of_turn = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = max(t for t, m in enumerate(done["loss_mask"]) if m)
    assert done["input_ids"][last] == end_of_turn  # finished: the end-of-turn token is a label
    assert cut["loss_mask"] == done["loss_mask"][:last] + [0] + done["loss_mask"][last + 1 :]


def test_collate_batch_fills_rows_that_train_nothing():
    samples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [1, 1]}]
    batch = collate_batch(samples, pad_token_id=0, pad_to_multiple_of=4, rows=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [8, 9, 0, 0], [8, 9, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True, False], [True, True, False, False]] + [[False] * 4] * 2
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert collate_batch(samples, pad_token_id=0, rows=2)["input_ids"].shape == (2, 3)  # already full


def test_prefetch_keeps_order_and_runs_ahead():
    import threading

    from dflash_features import prefetch

    pulled, on_main = [], []

    def source():
        for i in range(7):
            pulled.append(i)
            yield i, -i

    def work(item):
        on_main.append(threading.current_thread() is threading.main_thread())
        return item[0] * 10

    out = []
    for a, b, result in prefetch(source(), work, depth=2):
        out.append((a, b, result))
        assert len(pulled) == min(a + 3, 7), "items up to depth ahead are already handed to the worker"
    assert out == [(i, -i, 10 * i) for i in range(7)]
    assert on_main == [False] * 7, "the work runs in the worker thread"


def test_pooled_anchor_sampling_reaches_the_trainer_and_refuses_trimmed_slots(monkeypatch, tmp_path):
    """--anchor_sampling pooled: the trainer's micro-batch loss draws batch x N anchors over the micro-batch in 2N
    slots a sequence (a short row no longer gives all its positions), the loss trains; with --anchor_slots_multiple
    it is refused in one line; an unknown value is refused naming the choices."""
    import torch.nn as nn
    from transformers import Qwen3Config

    import train_dflash
    from dflash_model import DFlashDraftModel
    from dflash_target import drafter_config_for_target
    from train_dflash import Compute, MicroBatchLoss, TrainSettings

    vocab = 64
    target = Qwen3Config(
        hidden_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=vocab
    )
    config = drafter_config_for_target(target, mask_token_id=vocab - 1, num_draft_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(config).train()
    drafter.attach_target(nn.Embedding(vocab, 32), nn.Linear(32, vocab, bias=False))
    settings = TrainSettings(
        target_model="x", train_data=["x"], output_dir=str(tmp_path), num_anchors=6, block_size=4, anchor_sampling="pooled", loss_weighting="dpace"
    )
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
    loss_fn = MicroBatchLoss(settings, config, compute, None, drafter.target_lm_head)
    drawn = []
    real = train_dflash.sample_anchors
    monkeypatch.setattr(train_dflash, "sample_anchors", lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1])
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab - 1, (2, 40), generator=g)
    loss_mask = torch.zeros(2, 40, dtype=torch.bool)
    loss_mask[0, 2:7] = True  # 4 eligible: per sequence it would give all 4
    loss_mask[1, 4:40] = True  # 35 eligible
    features = torch.randn(2, 40, len(config.target_layer_ids) * 32, generator=g)
    loss, _ = loss_fn(drafter, features, input_ids, loss_mask, input_ids, (0, 0, 0, 0))
    loss.backward()
    anchors, valid = drawn[-1]
    assert anchors.shape == (2, 12) and valid.sum().item() == 12  # 2 x 6 drawn over 39 positions, 12 slots a row
    assert torch.isfinite(loss) and drafter.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"--anchor_sampling pooled keeps 2 x --num_anchors slots per sequence; --anchor_slots_multiple 64"):
        TrainSettings(target_model="x", train_data=["x"], output_dir=str(tmp_path), anchor_sampling="pooled", anchor_slots_multiple=64)
    with pytest.raises(ValueError, match="--anchor_sampling must be one of per_sequence, pooled, got 'packed'"):
        TrainSettings(target_model="x", train_data=["x"], output_dir=str(tmp_path), anchor_sampling="packed")
