"""Data for DFlash training and evaluation: conversations -> (input_ids, loss_mask).

Used by train_dflash.py (`build_train_dataset`, `collate_batch`, `length_grouped_batches`, `shuffled_batches`)
and by eval_dflash.py / regenerate_data.py (`load_prompts`).

Input formats, one record per JSONL line (or a JSON file holding a list of records, or a
HF dataset: a `save_to_disk` folder, a folder of json/jsonl/parquet files, or a Hub id):

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}
    {"question": "...", "answer": "..."}

All three are normalised to OpenAI `messages`, formatted with the target tokenizer's chat
template, and tokenized once with `datasets.map` (cached on disk by datasets' fingerprints).

Loss mask: 1 on tokens the assistant writes, 0 elsewhere (system, user, template headers,
padding). The assistant's end-of-turn token (`<|im_end|>` for Qwen3 and SmolLM2) IS
trained: the drafter has to propose it so that generation can stop inside a drafted
block. Two ways to compute it, see `tokenize_conversation`:
  * templates with `{% generation %}` blocks: transformers' `return_assistant_tokens_mask`;
  * every other template: character offsets (render the text once, locate each assistant
    turn in it, map characters to tokens with `return_offsets_mapping`).
"""

import collections
import hashlib
import json
import logging
import math
import os
import re
from pathlib import Path

import datasets
import torch

logger = logging.getLogger(__name__)

# Why a record is malformed; `skip_bad_samples=True` counts skipped records per reason. A well-formed
# sample with nothing left to train on after truncation is not malformed: it is dropped and counted
# (see build_train_dataset).
BAD_SAMPLE_REASONS = (
    "invalid_json",  # not JSON, not a JSON object, or not UTF-8
    "unknown_format",  # none of messages / conversations / question+answer
    "bad_message",  # a message without role or content, an unknown role, non-text content
    "missing_roles",  # no user turn or no assistant turn
    "empty_assistant_turn",  # an assistant message with empty (or whitespace) content
    "template_error",  # the chat template refused the conversation
)

# ShareGPT `from` values -> OpenAI roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "system": "system"}
MESSAGE_ROLES = ("system", "user", "assistant")

# A marker that cannot occur in template text (Unicode private-use characters); used to
# find what the template writes right after an assistant message.
_PROBE = "\ue000dflash-probe\ue001"
# datasets keys its cache on a hash of the map function, but hashes module-level functions
# by name only; mixing this file's hash into the key makes an edit here invalidate it.
_CODE_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_RAW_FEATURES = datasets.Features(
    {
        "record": datasets.Value("string"),  # one record as JSON text (raw line for JSONL)
        "error": datasets.Value("string"),  # set when the reader already knows the line is bad
        "where": datasets.Value("string"),  # "file.jsonl:17", "file.json[record 3]", "dir[row 5]"
        "source_index": datasets.Value("int64"),  # position of the file in the input list
        "line": datasets.Value("int64"),  # line (JSONL) or record/row index, for error order
    }
)


class DataFormatError(ValueError):
    """A bad data record. The message names the file and line; `reason` is one of
    BAD_SAMPLE_REASONS."""

    def __init__(self, message: str, reason: str = "unknown_format"):
        super().__init__(message)
        self.reason = reason


# ----------------------------------------------------------------------------------------
# Records -> messages


def _text_content(content, where: str) -> str:
    """Message content as a string: plain strings pass, OpenAI content parts
    ([{"type": "text", "text": ...}]) are joined, None becomes ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text") or "") for p in content)
    raise DataFormatError(f"{where}: only text content is supported, got {type(content).__name__}", "bad_message")


def _parse_messages(record, where: str) -> list[dict]:
    """Any of the three formats -> messages, checking each message but not the roles' mix."""
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}", "invalid_json")
    if "messages" in record:
        key, role_key, content_key, role_map = "messages", "role", "content", None
        raw_messages = record[key]
    elif "conversations" in record:
        key, role_key, content_key, role_map = "conversations", "from", "value", SHAREGPT_ROLES
        raw_messages = record[key]
    elif "question" in record and "answer" in record:
        key, role_key, content_key, role_map = "question", "role", "content", None
        raw_messages = [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": record["answer"]}]
    else:
        raise DataFormatError(
            f"{where}: unknown format, keys {sorted(record)}; expected 'messages' (role/content), "
            "'conversations' (from/value) or 'question' + 'answer'",
            "unknown_format",
        )
    if not isinstance(raw_messages, list) or not raw_messages:
        raise DataFormatError(f"{where}: '{key}' must be a non-empty list of messages", "bad_message")

    messages = []
    for i, message in enumerate(raw_messages):
        if not isinstance(message, dict) or message.get(role_key) is None or content_key not in message:
            raise DataFormatError(f"{where}: message {i} needs '{role_key}' and '{content_key}'", "bad_message")
        role = role_map.get(str(message[role_key]).lower()) if role_map else message[role_key]
        if role not in MESSAGE_ROLES:
            supported = sorted(role_map) if role_map else list(MESSAGE_ROLES)
            raise DataFormatError(f"{where}: message {i} has unsupported role {message[role_key]!r} (supported: {supported})", "bad_message")
        normalized = {"role": role, "content": _text_content(message[content_key], f"{where}: message {i}")}
        # Qwen3-style templates render a separate reasoning field of the last assistant turn.
        if role == "assistant" and isinstance(message.get("reasoning_content"), str) and message["reasoning_content"]:
            normalized["reasoning_content"] = message["reasoning_content"]
        messages.append(normalized)
    return messages


def normalize_record(record: dict, where: str = "record") -> list[dict]:
    """One data record -> OpenAI messages [{"role", "content"}, ...].

    Accepts `messages` (role/content), ShareGPT `conversations` (from/value; from in
    human/user, gpt/assistant/chatgpt, system) and GSM8K-style `question`/`answer`.
    Raises DataFormatError (message starts with `where`) for an unknown format, a malformed
    message, no user or no assistant turn, or an empty assistant turn.
    """
    messages = _parse_messages(record, where)
    roles = [m["role"] for m in messages]
    if "user" not in roles or "assistant" not in roles:
        raise DataFormatError(f"{where}: needs at least one user and one assistant turn, got roles {roles}", "missing_roles")
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and not message["content"].strip():
            raise DataFormatError(f"{where}: message {i} is an empty assistant turn", "empty_assistant_turn")
    return messages


# ----------------------------------------------------------------------------------------
# Chat template -> input_ids and loss mask


def require_chat_template(tokenizer) -> None:
    """Raise ValueError when `tokenizer` has no chat template (a base model's tokenizer)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no chat template, so "
            "conversations cannot be formatted the way the target sees them. Pass a target model (or tokenizer) "
            "that has one, e.g. an instruct/chat checkpoint whose tokenizer_config.json or chat_template.jinja "
            "defines `chat_template`."
        )


def _apply_template(tokenizer, messages, **kwargs):
    """apply_chat_template, with the template's own errors (jinja2 errors, its
    raise_exception() calls, type errors on odd content) turned into DataFormatError."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as error:
        raise DataFormatError(f"chat template error: {type(error).__name__}: {error}", "template_error") from error


def _render(tokenizer, messages, add_generation_prompt, chat_template_kwargs) -> str:
    if not messages:
        return ""
    return _apply_template(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))


def find_end_of_turn(tokenizer, chat_template_kwargs: dict | None = None) -> tuple[str, str]:
    """What the template writes right after an assistant message's content.

    Returns (text_before, end_of_turn): `end_of_turn` is the first added/special token in
    that footer (`<|im_end|>` for Qwen3 and SmolLM2, `<|eot_id|>` for Llama 3) and
    `text_before` whatever precedes it (usually ""). ("", "") when the footer holds no
    special token; the mask then ends with the content.
    """
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = _render(tokenizer, probe, False, chat_template_kwargs)
    except DataFormatError:  # a template that refuses the probe: fall back to content-only spans
        return "", ""
    if _PROBE not in text:
        return "", ""
    footer = text[text.index(_PROBE) + len(_PROBE) :]
    candidates = [
        (footer.find(token.content), -len(token.content), token.content)
        for token in tokenizer.added_tokens_decoder.values()
        if token.content.strip() and token.content in footer
    ]
    if not candidates:
        return "", ""
    position, _, end_of_turn = min(candidates)  # earliest, then longest
    return footer[:position], end_of_turn


def _common_prefix_length(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _assistant_char_spans(tokenizer, messages, text, chat_template_kwargs, footer) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns in `text` (the rendered chat).

    start: where the text stops matching the conversation-so-far rendered with
    `add_generation_prompt=True`, i.e. right after the header the target sees before it
    starts writing (with Qwen3 and enable_thinking=False that header includes the empty
    `<think></think>` block, which is then not trained).
    end: after the content and the end-of-turn token. The content is searched together
    with the footer, so a copy of the answer inside a reasoning block cannot match.
    Templates may rewrite content (strip it, drop earlier turns' `<think>` sections), so the
    search tries the content as is, stripped, and the part after `</think>`.
    """
    text_before_eot, end_of_turn = footer
    tail = text_before_eot + end_of_turn
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # A chat that opens with the assistant has no conversation-so-far to render: its
        # span then starts at the content.
        prompt_end = _common_prefix_length(_render(tokenizer, messages[:i], True, chat_template_kwargs), text) if i else None
        search_from = max(prompt_end or 0, cursor)
        content = message["content"]
        needles = dict.fromkeys(n for n in (content, content.strip(), content.split("</think>")[-1].strip()) if n)
        for needle in needles:
            position = text.find(needle + tail, search_from)
            if position >= 0:
                end = position + len(needle) + len(tail)
                break
        else:
            raise DataFormatError(f"assistant message {i} not found in the text rendered by the chat template", "template_error")
        spans.append((search_from if prompt_end is not None else position, end))
        cursor = end
    return spans


def tokenize_conversation(
    messages: list[dict], tokenizer, *, max_seq_length: int | None, chat_template_kwargs: dict | None = None, footer: tuple[str, str] | None = None
) -> tuple[list[int], list[int]]:
    """Messages -> (input_ids, loss_mask), both lists of length <= max_seq_length (None: no cut).

    loss_mask[t] = 1 for tokens of assistant turns (content and the end-of-turn token),
    0 for everything else. A token that straddles a span edge counts as assistant (the
    same rule as transformers' assistant mask).
    `footer` is `find_end_of_turn(tokenizer, chat_template_kwargs)` (pass it to avoid
    recomputing it per sample). Raises DataFormatError("template_error") when the template
    rejects the conversation, ValueError for a tokenizer without offsets support.
    """
    kwargs = chat_template_kwargs or {}
    footer = footer if footer is not None else find_end_of_turn(tokenizer, kwargs)
    if _GENERATION_TAG.search(tokenizer.get_chat_template()):
        encoded = _apply_template(tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs)
        input_ids, loss_mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
        # Templates differ on whether {% generation %} covers the end-of-turn token; we
        # always train it (the drafter must propose it), so extend each span by it.
        end_of_turn_ids = tokenizer.encode(footer[1], add_special_tokens=False) if footer[1] else []
        if len(end_of_turn_ids) == 1:
            for t in range(len(input_ids) - 1):
                if loss_mask[t] and not loss_mask[t + 1] and input_ids[t + 1] == end_of_turn_ids[0]:
                    loss_mask[t + 1] = 1
        return input_ids[:max_seq_length], loss_mask[:max_seq_length]  # [:None] keeps all

    if not getattr(tokenizer, "is_fast", True):
        raise ValueError("the loss mask needs a fast tokenizer (character offsets); load it with use_fast=True")
    text = _render(tokenizer, messages, False, kwargs)
    spans = _assistant_char_spans(tokenizer, messages, text, kwargs, footer)
    # The template already wrote BOS and other special tokens: add none.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    loss_mask = [0] * len(input_ids)
    span_index = 0
    for t, (token_start, token_end) in enumerate(offsets):  # tokens and spans are both in order
        while span_index < len(spans) and token_start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if token_end > spans[span_index][0]:  # overlaps the span
            loss_mask[t] = 1
    return input_ids[:max_seq_length], loss_mask[:max_seq_length]  # [:None] keeps all


def _tokenizer_fingerprint(tokenizer) -> str | None:
    """A stable hash of everything in `tokenizer` that changes the tokens: the fast
    tokenizer's JSON (vocab, merges, normalizer, added tokens), the chat template and the
    special tokens. datasets would otherwise pickle the tokenizer in pure Python to key its
    cache (~5 s for Qwen3's, every call). None for tokenizers without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    digest = hashlib.sha256(backend.to_str().encode())
    extra = [tokenizer.chat_template, tokenizer.special_tokens_map, type(tokenizer).__name__]
    digest.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _has_anchor(loss_mask: list[int]) -> bool:
    """DFlash anchors need two consecutive trainable tokens (the anchor and its first label)."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:]))


def _json_error_text(error: json.JSONDecodeError) -> str:
    """'invalid JSON at column 15: Expecting value': the column within the line that `where` names."""
    return f"invalid JSON at column {error.colno}: {error.msg}"


def _tokenize_rows(rows, tokenizer, max_seq_length, chat_template_kwargs, footer, code_version=None):
    """datasets.map function (batched): raw records -> input_ids, loss_mask, num_tokens (cut to
    max_seq_length), plus what truncation did (`full_tokens`, `full_loss_tokens`: before the cut;
    `dropped`: no anchor left, nothing to train on) and `reason`/`error` ("" for well-formed rows)
    so malformed rows can be reported or counted."""
    out = {
        "input_ids": [],
        "loss_mask": [],
        "num_tokens": [],
        "num_loss_tokens": [],
        "full_tokens": [],
        "full_loss_tokens": [],
        "dropped": [],
        "reason": [],
        "error": [],
    }
    for record_text, read_error, where in zip(rows["record"], rows["error"], rows["where"]):
        input_ids, loss_mask, full_tokens, full_loss_tokens, reason, error = [], [], 0, 0, "", ""
        try:
            if read_error:
                raise DataFormatError(f"{where}: {read_error}", "invalid_json")
            try:
                # Without the line break, an error position is a column of this one line.
                record = json.loads(record_text.rstrip("\r\n"))
            except json.JSONDecodeError as json_error:
                raise DataFormatError(f"{where}: {_json_error_text(json_error)}", "invalid_json") from json_error
            messages = normalize_record(record, where)
            try:
                input_ids, loss_mask = tokenize_conversation(
                    messages, tokenizer, max_seq_length=None, chat_template_kwargs=chat_template_kwargs, footer=footer
                )
            except DataFormatError as template_error:
                raise DataFormatError(f"{where}: {template_error}", template_error.reason) from template_error
            if record.get("finished") is False and footer[1]:
                # regenerate_data.py marks a reply cut at --max_new_tokens: the template still closes
                # it with end-of-turn, but the target would have gone on writing, so that is no label.
                end_of_turn_ids = tokenizer.encode(footer[1], add_special_tokens=False)
                last = max((t for t, m in enumerate(loss_mask) if m), default=None)
                if last is not None and end_of_turn_ids and input_ids[last] == end_of_turn_ids[-1]:
                    loss_mask[last] = 0
            full_tokens, full_loss_tokens = len(input_ids), sum(loss_mask)
            input_ids, loss_mask = input_ids[:max_seq_length], loss_mask[:max_seq_length]
        except DataFormatError as bad:
            input_ids, loss_mask, reason, error = [], [], bad.reason, str(bad)
        dropped = not reason and not _has_anchor(loss_mask)
        if dropped:
            input_ids, loss_mask = [], []  # nothing to train on; only the counts are kept
        out["input_ids"].append(input_ids)
        out["loss_mask"].append(loss_mask)
        out["num_tokens"].append(len(input_ids))
        out["num_loss_tokens"].append(sum(loss_mask))
        out["full_tokens"].append(full_tokens)
        out["full_loss_tokens"].append(full_loss_tokens)
        out["dropped"].append(dropped)
        out["reason"].append(reason)
        out["error"].append(error)
    return out


def report_truncation(columns: dict[str, list], max_seq_length: int, max_dropped_fraction: float) -> None:
    """One warning about what max_seq_length cost (samples dropped, replies cut, share of assistant
    tokens lost); a ValueError when more than `max_dropped_fraction` of the samples were dropped.

    columns: `dropped`, `full_tokens`, `full_loss_tokens`, `num_loss_tokens`, one entry per
    well-formed sample (`_tokenize_rows`' output).
    """
    stats = [dict(zip(columns, row)) for row in zip(*columns.values())]
    total = len(stats)
    dropped = [row for row in stats if row["dropped"]]
    cut = [row for row in stats if not row["dropped"] and row["num_loss_tokens"] < row["full_loss_tokens"]]
    if not dropped and not cut:
        return
    too_long = sum(row["full_tokens"] > max_seq_length for row in dropped)
    all_loss = sum(row["full_loss_tokens"] for row in stats)
    lost = all_loss - sum(row["num_loss_tokens"] for row in stats if not row["dropped"])
    lengths = sorted(row["full_tokens"] for row in stats)
    keeps_95 = lengths[math.ceil(0.95 * len(lengths)) - 1]  # the shortest length that keeps 95% whole
    parts = []
    if dropped:
        parts.append(
            f"dropped {len(dropped)} of {total} samples ({len(dropped) / total:.1%}) with fewer than 2 assistant tokens "
            "left after truncation" + (f" ({len(dropped) - too_long} of them have fewer than 2 at any length)" if too_long < len(dropped) else "")
        )
    if cut:
        parts.append(f"cut the assistant reply of {len(cut)} {'more' if dropped else f'of {total} samples'}")
    summary = f"max_seq_length={max_seq_length}: {', and '.join(parts)}; {lost / max(all_loss, 1):.1%} of all assistant tokens are not trained."
    if keeps_95 > max_seq_length:
        hint = f"--max_seq_length {keeps_95} would keep 95% of the samples whole"
    else:  # 95% already whole: name the length that keeps all of them
        hint = f"--max_seq_length {lengths[-1]} would keep every sample whole"
    if len(dropped) > max_dropped_fraction * total:
        raise ValueError(
            f"{summary} That is more than --max_dropped_fraction {max_dropped_fraction}: the length setting is likely "
            f"wrong for this data. Raise --max_seq_length ({hint}), or raise --max_dropped_fraction to train anyway."
        )
    logger.warning("%s Raise --max_seq_length to keep them (%s).", summary, hint)


# ----------------------------------------------------------------------------------------
# Files and datasets -> raw records


def _file_stamp(path: str) -> tuple[str, int, int]:
    stat = os.stat(path)
    return (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def _read_json_files(files: list[tuple[int, str]], stamps=None, code_version=None):
    """datasets generator over JSON/JSONL files -> _RAW_FEATURES rows. JSON is parsed later
    (in the map) so every bad line is reported the same way. `stamps` (size, mtime) and
    `code_version` only feed datasets' cache key, so an edited file is read again."""
    for source_index, path in files:
        if path.endswith(".json"):
            with open(path, "rb") as f:
                raw = f.read()
            try:
                records = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                where = f"{path}:{getattr(error, 'lineno', 1)}"
                text = f"at column {error.colno}: {error.msg}" if isinstance(error, json.JSONDecodeError) else f"(not UTF-8: {error})"
                yield {"record": "", "error": f"invalid JSON file {text}", "where": where, "source_index": source_index, "line": 0}
                continue
            if not isinstance(records, list):
                records = [records]  # a single record; normalize_record rejects non-objects
            for i, record in enumerate(records):
                where = f"{path}[record {i}]"
                yield {"record": json.dumps(record, ensure_ascii=False), "error": "", "where": where, "source_index": source_index, "line": i}
            continue
        # JSONL: read bytes and split on b"\n" only (str.splitlines would also split on
        # U+2028 inside JSON strings and shift the line numbers).
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, start=1):
                where = f"{path}:{line_number}"
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield {"record": "", "error": f"not UTF-8 ({error})", "where": where, "source_index": source_index, "line": line_number}
                    continue
                if text.strip():  # blank lines (e.g. a trailing one) are not records
                    yield {"record": text, "error": "", "where": where, "source_index": source_index, "line": line_number}


def _hf_rows_to_raw(rows, indices, name, source_index, code_version=None):
    """datasets.map function: rows of a HF dataset -> _RAW_FEATURES rows."""
    columns = list(rows)
    out = {"record": [], "error": [], "where": [], "source_index": [], "line": []}
    for j, index in enumerate(indices):
        record = {column: rows[column][j] for column in columns}
        out["record"].append(json.dumps(record, ensure_ascii=False, default=str))
        out["error"].append("")
        out["where"].append(f"{name}[row {index}]")
        out["source_index"].append(source_index)
        out["line"].append(index)
    return out


def _load_hf_dataset(path: str) -> datasets.Dataset:
    """A `save_to_disk` folder, a parquet file or folder, or a Hub id -> the train split."""
    try:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(path)
        elif os.path.isdir(path) or path.endswith(".parquet"):
            files = sorted(str(p) for p in Path(path).rglob("*.parquet")) if os.path.isdir(path) else [path]
            loaded = datasets.load_dataset("parquet", data_files=files, split="train")
        else:
            loaded = datasets.load_dataset(path, split="train")
    except Exception as error:
        raise ValueError(
            f"{path}: not a data file, and loading it as a HF dataset (save_to_disk folder, parquet folder or "
            f"Hub id; Hub ids need network access) failed: {type(error).__name__}: {error}"
        ) from error
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"{path}: dataset has splits {list(loaded)} but no 'train' split")
        loaded = loaded["train"]
    return loaded


def _is_hf_dataset_dir(path: str) -> bool:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    return any(os.path.exists(os.path.join(path, m)) for m in markers) or any(Path(path).rglob("*.parquet"))


def _is_blank(path: str) -> bool:
    """Whether the file holds nothing but whitespace (reads only up to its first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _json_has_no_records(path: str) -> bool:
    """Whether a .json file is an empty list (an invalid file is reported later, per record). Only
    small files can be one, so large ones are not parsed twice."""
    if os.path.getsize(path) > 256:
        return False
    try:
        with open(path, "rb") as f:
            return json.load(f) == []
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _expand_paths(paths: list[str]) -> tuple[list[str], list[str]]:
    """Input paths -> (JSON/JSONL files, HF dataset paths). A folder of json/jsonl files
    contributes its files (sorted); a parquet file, a folder with parquet files, a saved
    dataset, and anything that is not a local path (a Hub id) are HF datasets."""
    json_files, hf_paths = [], []
    for path in paths:
        if os.path.isfile(path) and path.endswith((".json", ".jsonl")):
            if _is_blank(path):
                raise ValueError(f"{path}: the file is empty (no records); fill it, or leave it out of --train_data")
            json_files.append(path)
        elif os.path.isfile(path) and not path.endswith(".parquet"):
            raise ValueError(f"{path}: unsupported data file type; use .jsonl, .json, .parquet or a dataset folder")
        elif os.path.isdir(path) and not _is_hf_dataset_dir(path):
            found = sorted(str(p) for p in Path(path).rglob("*") if p.suffix in (".json", ".jsonl"))
            if not found:
                raise ValueError(f"{path}: folder has no .jsonl/.json/.parquet files and is not a saved dataset")
            json_files.extend(found)
        else:
            hf_paths.append(path)
    return json_files, hf_paths


def _load_raw_records(paths: list[str], num_proc: int) -> datasets.Dataset:
    """All inputs as one dataset of raw records (_RAW_FEATURES), in input order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [str(paths)]
    if not paths:
        raise ValueError("no training data given; pass one or more files or datasets (--train_data)")
    json_files, hf_paths = _expand_paths([str(p) for p in paths])
    parts = []
    for path in json_files:
        if path.endswith(".json") and _json_has_no_records(path):
            raise ValueError(f"{path}: the file holds an empty JSON list (no records); fill it, or leave it out of --train_data")
    if json_files:
        files = list(enumerate(json_files))
        parts.append(
            datasets.Dataset.from_generator(
                _read_json_files,
                features=_RAW_FEATURES,
                gen_kwargs={"files": files, "stamps": [_file_stamp(p) for p in json_files], "code_version": _CODE_VERSION},
            )
        )
    for k, path in enumerate(hf_paths):
        dataset = _load_hf_dataset(path)
        parts.append(
            dataset.map(
                _hf_rows_to_raw,
                batched=True,
                with_indices=True,
                remove_columns=dataset.column_names,
                features=_RAW_FEATURES,
                fn_kwargs={"name": path, "source_index": len(json_files) + k, "code_version": _CODE_VERSION},
                num_proc=num_proc if len(dataset) >= 1000 * num_proc else None,
                desc=f"Reading {path}",
            )
        )
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


# ----------------------------------------------------------------------------------------
# Public API


def build_train_dataset(
    paths: list[str],
    tokenizer,
    *,
    max_seq_length: int,
    chat_template_kwargs: dict | None = None,
    num_proc: int = 1,
    seed: int = 0,
    skip_bad_samples: bool = False,
    max_samples: int | None = None,
    max_dropped_fraction: float = 0.5,
) -> datasets.Dataset:
    """Conversations from `paths` -> tokenized training samples, shuffled by `seed`.

    Columns: `input_ids` (list[int], length <= max_seq_length), `loss_mask` (list[int] of
    0/1, same length; 1 on assistant tokens incl. the end-of-turn token), `num_tokens`
    (int, = len(input_ids)) and `num_loss_tokens` (int, = sum(loss_mask)). Every sample has at
    least one DFlash anchor (two consecutive assistant tokens).

    Truncation to `max_seq_length` keeps the first tokens. A sample left with no anchor (a
    prompt that fills max_seq_length) is dropped, not an error; samples dropped and replies cut
    are counted in one warning with the share of assistant tokens lost. More than
    `max_dropped_fraction` of the samples dropped is an error: the length is likely wrong.

    `chat_template_kwargs` are passed to the template (e.g. {"enable_thinking": False} for
    Qwen3). `max_samples` keeps the first `max_samples` records of the shuffled order,
    before tokenization (cheap demos and tests; bad records among them are then dropped
    or reported, records outside are never looked at). Tokenization runs once per
    (data, tokenizer, settings): datasets caches the result on disk. In multi-process
    training call this on the main process first (accelerator.main_process_first()).

    Raises:
        ValueError: the tokenizer has no chat template; a path is neither a data file nor a
            dataset; more than `max_dropped_fraction` dropped; nothing usable is left.
        DataFormatError: a bad record (message names file and line and the reason), unless
            `skip_bad_samples`, which drops bad records and logs the count per reason.
    """
    require_chat_template(tokenizer)
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length={max_seq_length} is too short; DFlash needs at least 2 tokens per sample")
    raw = _load_raw_records(paths, num_proc).shuffle(seed=seed)
    if max_samples is not None:
        raw = raw.select(range(min(max_samples, len(raw))))
    footer = find_end_of_turn(tokenizer, chat_template_kwargs)
    settings = [max_seq_length, chat_template_kwargs or {}, footer, _CODE_VERSION]
    tokenizer_fingerprint = _tokenizer_fingerprint(tokenizer)
    fingerprint = None  # None: datasets hashes the function and its arguments itself (slow, but exact)
    if tokenizer_fingerprint is not None:
        key = json.dumps([raw._fingerprint, tokenizer_fingerprint, settings], sort_keys=True, default=str)
        fingerprint = hashlib.sha256(key.encode()).hexdigest()[:32]
    tokenized = raw.map(
        _tokenize_rows,
        batched=True,
        batch_size=256,
        remove_columns=["record", "error"],
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_seq_length": max_seq_length,
            "chat_template_kwargs": chat_template_kwargs or {},
            "footer": footer,
            "code_version": _CODE_VERSION,
        },
        num_proc=num_proc if num_proc > 1 and len(raw) >= 64 * num_proc else None,
        desc="Tokenizing",
        new_fingerprint=fingerprint,
    )

    reasons = tokenized["reason"]
    bad = [i for i, reason in enumerate(reasons) if reason]
    if bad:
        bad_rows = tokenized.select(bad).select_columns(["reason", "error", "source_index", "line"]).to_list()
        bad_rows.sort(key=lambda row: (row["source_index"], row["line"]))  # report in file order
        if not skip_bad_samples:
            more = f" ({len(bad) - 1} more bad samples)" if len(bad) > 1 else ""
            raise DataFormatError(
                f"{bad_rows[0]['error']}{more}. Fix or remove the record, or pass --skip_bad_samples to skip bad records.", bad_rows[0]["reason"]
            )
        counts = collections.Counter(row["reason"] for row in bad_rows)
        summary = ", ".join(f"{reason}: {counts[reason]}" for reason in BAD_SAMPLE_REASONS if counts[reason])
        logger.warning("Skipped %d of %d samples (%s). First: %s", len(bad), len(reasons), summary, bad_rows[0]["error"])
        tokenized = tokenized.filter(lambda reason: not reason, input_columns="reason", desc="Dropping bad samples")
    if len(tokenized):
        columns = tokenized.select_columns(["dropped", "full_tokens", "full_loss_tokens", "num_loss_tokens"]).to_dict()
        report_truncation(columns, max_seq_length, max_dropped_fraction)
        if any(columns["dropped"]):
            tokenized = tokenized.filter(lambda dropped: not dropped, input_columns="dropped", desc="Dropping samples with nothing to train on")
    if len(tokenized) == 0:
        raise ValueError(f"no usable training samples in {paths}")
    logger.info(
        "Training data: %d samples, %d tokens, %d of them assistant (trained) tokens",
        len(tokenized),
        sum(tokenized["num_tokens"]),
        sum(tokenized["num_loss_tokens"]),
    )
    return tokenized.select_columns(["input_ids", "loss_mask", "num_tokens", "num_loss_tokens"])


def collate_batch(samples: list[dict], pad_token_id: int, pad_to_multiple_of: int = 1, rows: int | None = None) -> dict:
    """Right-pad samples to one batch.

    samples: dicts with `input_ids` and `loss_mask` (lists of equal length; other keys ignored).
    rows: fill the batch up to this many rows with copies of the last sample whose loss_mask is
        all False (they train nothing: the loss is normalised over valid label positions), so that
        a short last batch has the shape of the others and compiles nothing new.
    Returns `input_ids` LongTensor [batch, S], `loss_mask` BoolTensor [batch, S] (False on
    padding and filler rows) and `attention_mask` LongTensor [batch, S] (1 = real token), where S
    is the longest sample rounded up to a multiple of `pad_to_multiple_of`.
    """
    samples = list(samples)
    real = len(samples)
    if rows is not None and rows > real:
        samples += [samples[-1]] * (rows - real)
    longest = max(len(sample["input_ids"]) for sample in samples)
    seq_len = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(samples), seq_len), pad_token_id, dtype=torch.long)  # [batch, S]
    loss_mask = torch.zeros((len(samples), seq_len), dtype=torch.bool)  # [batch, S]
    attention_mask = torch.zeros((len(samples), seq_len), dtype=torch.long)  # [batch, S]
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        assert len(sample["loss_mask"]) == n, f"sample {row}: input_ids and loss_mask lengths differ"
        input_ids[row, :n] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        if row < real:
            loss_mask[row, :n] = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}


def length_grouped_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of dataset indices with similar lengths, so padding wastes little.

    transformers' megabatch scheme (LengthGroupedSampler): a random permutation, cut into
    megabatches of ~50 batches, each sorted by length; we cut it into batches and then
    shuffle the batch order, keeping the batch with the longest sample first (an OOM shows
    up at step 1, not hours in). Deterministic in (seed, epoch); every index appears
    exactly once; only the last batch may be smaller than `batch_size`.
    """
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    indices = get_length_grouped_indices(list(lengths), batch_size, generator=generator)
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    order = torch.randperm(len(batches) - 1, generator=generator).tolist() if len(batches) > 1 else []
    return batches[:1] + [batches[1 + k] for k in order]


def shuffled_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of dataset indices in a fresh random order, lengths mixed (`--batch_order random`).

    A random permutation cut into batches, with the batch holding the longest sample moved first
    (an OOM shows up at step 1, as in `length_grouped_batches`). Padding costs more than with
    length grouping; every batch is a random mix of the data, as a packed trainer's would be.
    Deterministic in (seed, epoch); every index appears exactly once; only the last batch may be
    smaller than `batch_size`.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    indices = torch.randperm(len(lengths), generator=generator).tolist()
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    if not batches:
        return batches
    longest = max(range(len(batches)), key=lambda b: max(lengths[i] for i in batches[b]))
    return [batches[longest]] + batches[:longest] + batches[longest + 1 :]


def prompt_hash(messages: list[dict]) -> str:
    """Short stable hash of a prompt (regenerate_data.py checks resumed output with it)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def _prompt_messages(record, where: str) -> list[dict]:
    """One prompt record -> messages up to and including the last user turn."""
    if isinstance(record, dict) and any(key in record for key in ("prompt", "question", "turns")):
        key = next(key for key in ("prompt", "question", "turns") if key in record)
        value = record[key]
        if key == "turns":  # MT-Bench: a list of user turns; the first one opens the chat
            value = value[0] if isinstance(value, list) and value else None
        if not isinstance(value, str) or not value.strip():
            raise DataFormatError(f"{where}: '{key}' must be a non-empty string", "bad_message")
        return [{"role": "user", "content": value}]
    if isinstance(record, dict) and not any(key in record for key in ("messages", "conversations")):
        raise DataFormatError(
            f"{where}: unknown prompt format, keys {sorted(record)}; expected 'prompt', 'question', "
            "'turns' (MT-Bench), 'messages' or 'conversations'",
            "unknown_format",
        )
    messages = _parse_messages(record, where)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise DataFormatError(f"{where}: no user turn to use as a prompt", "missing_roles")
    return messages[: users[-1] + 1]


def load_prompts(path: str, tokenizer=None, *, num_prompts: int | None = None, return_locations: bool = False):
    """Prompts as message lists (each ends with a user turn), in file order.

    Reads JSONL (or a JSON list) with one of: `{"prompt": str}`, GSM8K `{"question": str}`,
    MT-Bench `{"turns": [str, ...]}` (first turn), `{"messages": [...]}` /
    `{"conversations": [...]}` (everything up to and including the last user turn).
    Blank lines are skipped; the i-th returned prompt is the i-th record. With a
    `tokenizer`, checks that it has a chat template and that each prompt renders.
    `num_prompts` keeps the first N.

    Returns the list of message lists; with `return_locations`, (that list, each prompt's
    "file.jsonl:LINE" for error messages).
    Raises ValueError (no chat template, missing file) and DataFormatError naming file and
    line for a bad record.
    """
    if tokenizer is not None:
        require_chat_template(tokenizer)
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path} does not exist")
    prompts, locations = [], []
    for row in _read_json_files([(0, str(path))], None):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        where = row["where"]
        if row["error"]:
            raise DataFormatError(f"{where}: {row['error']}", "invalid_json")
        try:
            record = json.loads(row["record"].rstrip("\r\n"))
        except json.JSONDecodeError as error:
            raise DataFormatError(f"{where}: {_json_error_text(error)}", "invalid_json") from error
        messages = _prompt_messages(record, where)
        if tokenizer is not None:
            try:
                _render(tokenizer, messages, True, None)
            except DataFormatError as error:
                raise DataFormatError(f"{where}: {error}", error.reason) from error
        prompts.append(messages)
        locations.append(where)
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts")
    return (prompts, locations) if return_locations else prompts


def target_context_length(config) -> int | None:
    """The most positions the target takes (`max_position_embeddings` of its text config), or None
    when the config does not say."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "max_position_embeddings", None)


def check_prompts_fit_context(lengths: list[int], locations: list[str], context: int | None, extra: int, extra_what: str) -> None:
    """Stop before a prompt that would run the target past its context.

    Args:
        lengths: each prompt's tokens as the target reads it (chat template and generation prompt included).
        locations: each prompt's "file.jsonl:LINE" (`load_prompts(..., return_locations=True)`).
        context: `target_context_length`; None checks nothing.
        extra: the positions every prompt needs beyond its own (new tokens, a drafted block); extra_what says
            which, for the message (e.g. "--max_new_tokens 256 + a block of 16").
    Raises:
        ValueError naming the first prompt that does not fit (file and line), its length, and how many do not.
    """
    if not context:
        return
    too_long = [(n, where) for n, where in zip(lengths, locations) if n + extra > context]
    if too_long:
        n, where = too_long[0]
        raise ValueError(
            f"{where}: the prompt is {n:,} tokens (chat template included), and with {extra_what} it needs {n + extra:,} "
            f"positions, more than the target's context of {context:,} (max_position_embeddings); {len(too_long)} of "
            f"{len(lengths)} prompts are too long: shorten them or leave them out, or lower --max_new_tokens"
        )
