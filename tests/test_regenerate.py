"""regenerate_data.py: resume without duplicates or losses, same text as an uninterrupted run,
failures retried one by one and counted, a prompt/output mismatch refused.

A tiny random Qwen3 (hidden 32, 2 layers) with the real Qwen3 tokenizer stands in for the
target; generations are short (max_new_tokens 6).
"""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_qwen3_tokenizer
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import dflash_batch_decoding
import regenerate_data
from dflash_data import build_train_dataset, prompt_hash

NUM_PROMPTS = 10

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_target")  # ~30 runs of main() on two target folders


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
    write_qwen3_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def peaked_target(tmp_path_factory, tiny_target, qwen3_tokenizer) -> str:
    """The tiny target with its LM head scaled so that logits spread with a standard deviation of ~5,
    as a trained model's do. A random head's logits are nearly flat: the top-p nucleus then holds
    ~140k tokens ~7e-6 apart in probability, and the last-bit differences between batch layouts
    (which transformers does not promise to avoid) move a draw across a boundary every few dozen
    draws. With peaked logits a draw depends on the sampler alone, which is what the tests check."""
    model = Qwen3ForCausalLM.from_pretrained(tiny_target)
    with torch.no_grad():
        ids = qwen3_tokenizer("Question 0: why is the sky blue?", return_tensors="pt").input_ids
        model.lm_head.weight.mul_(5.0 / model(ids).logits[0, -1].std())
    path = tmp_path_factory.mktemp("peaked_qwen3")
    model.save_pretrained(path)
    write_qwen3_tokenizer(path)
    return str(path)


@pytest.fixture()
def prompts_file(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    # Varied lengths, so batches are left-padded.
    lines = [{"prompt": f"Question {i}: " + "why " * (i % 4) + "is the sky blue?"} for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def regenerate(target, prompts, output, *extra) -> dict:
    argv = [
        "--target_model",
        target,
        "--prompts",
        prompts,
        "--output",
        str(output),
        "--max_new_tokens",
        "6",
        "--batch_size",
        "3",
        "--temperature",
        "0",
        "--seed",
        "7",
        *extra,
    ]
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
    dataset = build_train_dataset([str(resumed)], AutoTokenizer.from_pretrained(tiny_target), max_seq_length=64)
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


def test_output_from_other_settings_is_refused(tmp_path, tiny_target, prompts_file):
    """A rerun into a file written at another temperature (or seed, top_p, max_new_tokens) stops with
    the line and the differing settings instead of skipping those replies as done."""
    output = tmp_path / "out.jsonl"
    regenerate(tiny_target, prompts_file, output, "--num_prompts", "2")
    assert read_output(output)[0]["settings"] == {"temperature": 0.0, "max_new_tokens": 6}
    with pytest.raises(ValueError, match=r"out.jsonl:1: written with other settings \(--temperature 0.0 there, 0.8 now"):
        regenerate(tiny_target, prompts_file, output, "--num_prompts", "2", "--temperature", "0.8")
    assert regenerate(tiny_target, prompts_file, output, "--num_prompts", "3")["written"] == 1  # the same settings resume


def test_output_from_other_prompts_is_refused(tmp_path, tiny_target, prompts_file):
    output = tmp_path / "out.jsonl"
    regenerate(tiny_target, prompts_file, output, "--num_prompts", "2")
    other = tmp_path / "other_prompts.jsonl"
    other.write_text(json.dumps({"prompt": "Something else entirely"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"out.jsonl:1: prompt id 0 does not match"):
        regenerate(tiny_target, str(other), output)
    with pytest.raises(ValueError, match="--chat_template_kwargs must be a JSON dict"):
        regenerate(tiny_target, prompts_file, output, "--chat_template_kwargs", "enable_thinking=false")


def test_seeded_sampling_draws_from_the_nucleus():
    """Inverse-CDF draws over the top-p nucleus follow the renormalised softmax: 6,000 rows with their
    own seeds land within a small total-variation distance of it."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    temperature, top_p = 0.8, 0.9
    probs = (logits / temperature).softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p  # sorted already: the nucleus is a prefix
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()
    rows = 6000
    seeds = torch.tensor([dflash_batch_decoding.reply_seed(3, i, 0) for i in range(rows)])
    sampler = dflash_batch_decoding.SeededSampling(seeds, prompt_width=4, temperature=temperature, top_p=top_p)
    scores = sampler(torch.zeros(rows, 9, dtype=torch.long), logits.expand(rows, -1))
    draws = scores.argmax(-1)
    assert torch.equal(scores.isfinite().sum(-1), torch.ones(rows, dtype=torch.long)), "one finite score: the draw"
    observed = torch.bincount(draws, minlength=6).float() / rows
    assert observed[~keep].sum() == 0, "a token outside the nucleus was drawn"
    assert 0.5 * (observed - expected).abs().sum() < 0.02, (observed, expected)
    # A row's draw depends on its seed and step only: the same rows in another batch, same draws.
    again = dflash_batch_decoding.SeededSampling(seeds[:100], 4, temperature, top_p)(torch.zeros(100, 9, dtype=torch.long), logits.expand(100, -1))
    assert torch.equal(again.argmax(-1), draws[:100])
    next_step = sampler(torch.zeros(rows, 10, dtype=torch.long), logits.expand(rows, -1)).argmax(-1)
    assert not torch.equal(next_step, draws), "each step must draw anew"


def test_seeded_sampling_equals_a_hand_built_inverse_cdf():
    """The draw, token by token, against a plain-Python inverse CDF: tokens ranked by logit with equal
    logits in id order, the shortest prefix reaching top_p, the first token whose cumulative
    probability exceeds u times the prefix's mass; the same in bfloat16 and with per-row steps."""
    torch.manual_seed(0)
    rows, vocab, temperature, top_p = 400, 12, 0.7, 0.8
    logits = torch.randint(-4, 5, (rows, vocab)).float() / 2  # many equal logits: the tie order matters
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 13
    steps = torch.arange(rows, dtype=torch.int64) % 5
    sampler = dflash_batch_decoding.SeededSampling(seeds, 0, temperature, top_p)
    uniform = dflash_batch_decoding.counter_uniform(seeds, steps).tolist()
    expected = []
    for row, u in zip(logits.tolist(), uniform):
        ranked = sorted(range(vocab), key=lambda t: (-row[t], t))
        probs = torch.tensor([row[t] for t in ranked]).div(temperature).softmax(-1).tolist()
        nucleus, mass = [], 0.0
        for token, p in zip(ranked, probs):
            if mass >= top_p:
                break
            nucleus.append((token, p))
            mass += p
        total, chosen = 0.0, nucleus[-1][0]
        for token, p in nucleus:
            total += p
            if total > u * mass:
                chosen = token
                break
        expected.append(chosen)
    drawn = sampler.draw(logits, steps)
    assert drawn.tolist() == expected
    assert torch.equal(sampler.draw(logits.bfloat16(), steps), drawn)  # these logits are exact in bf16
    assert len(set(drawn.tolist())) > 3


def test_several_samples_per_prompt_independent_of_batching(tmp_path, peaked_target, prompts_file):
    """K sampled replies per prompt: each written once, resumable without duplicates, the same text
    whatever the batch size, the static-cache path or the point of resumption."""
    sampling = ("--temperature", "1.0", "--top_p", "0.95", "--num_samples_per_prompt", "3")
    full = tmp_path / "full.jsonl"
    summary = regenerate(peaked_target, prompts_file, full, *sampling, "--num_prompts", "5")
    assert summary["written"] == 15 and summary["samples_per_prompt"] == 3
    records = read_output(full)
    assert sorted((r["id"], r["sample"]) for r in records) == [(i, k) for i in range(5) for k in range(3)]
    texts = {(r["id"], r["sample"]): r["messages"][-1]["content"] for r in records}
    assert all(len({texts[(i, k)] for k in range(3)}) > 1 for i in range(5)), "the samples of a prompt should differ"

    other = tmp_path / "batched.jsonl"
    regenerate(peaked_target, prompts_file, other, *sampling, "--num_prompts", "2", "--batch_size", "5")
    summary = regenerate(peaked_target, prompts_file, other, *sampling, "--num_prompts", "5", "--batch_size", "4", "--kv_cache", "static")
    assert summary["already_done"] == 6 and summary["written"] == 9
    records = read_output(other)
    assert len(records) == 15 and {(r["id"], r["sample"]): r["messages"][-1]["content"] for r in records} == texts
    with pytest.raises(ValueError, match="same greedy reply"):
        regenerate(peaked_target, prompts_file, other, "--num_samples_per_prompt", "2")


# ----------------------------------------------------------------------------------------------
# A live OpenAI-compatible server: `transformers serve` with SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory, smollm2_target):
    """`transformers serve` on a free localhost port with SmolLM2 (the session's GGUF load written as
    an HF folder: serve cannot read that GGUF's config), started for this module and stopped after it."""
    import shutil
    import socket
    import subprocess
    import time
    import urllib.request

    from dflash_target import save_hf_folder

    # The environment's own entry point (a venv's bin/ need not be on PATH), else the one on PATH.
    beside = Path(sys.executable).parent / "transformers"
    executable = str(beside) if beside.is_file() else shutil.which("transformers")
    if executable is None:
        pytest.skip(f"the `transformers` command is not installed beside {sys.executable} or on PATH (pip install 'transformers[serving]')")
    folder = tmp_path_factory.mktemp("smollm2_hf")
    save_hf_folder(*smollm2_target, folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(folder / "serve.log", "w")
    server = subprocess.Popen(
        [executable, "serve", str(folder), "--port", str(port), "--host", "127.0.0.1", "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail(f"transformers serve did not start:\n{(folder / 'serve.log').read_text()[-3000:]}")
                time.sleep(1)
        yield url + "/v1", str(folder)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_server_backend_writes_and_resumes_after_a_kill(tmp_path, smollm2_server, repo_root):
    import subprocess
    import sys
    import time

    url, model = smollm2_server
    prompts = tmp_path / "prompts.jsonl"
    questions = ["What is 2 + 3?", "Name a colour.", "What is the capital of France?", "Count to three.", "Say hello.", "What is 10 - 4?"]
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        str(repo_root / "regenerate_data.py"),
        "--server_url",
        url,
        "--server_model",
        model,
        "--prompts",
        str(prompts),
        "--output",
        str(output),
        "--max_new_tokens",
        "24",
        "--temperature",
        "0",
        "--server_concurrency",
        "1",
    ]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while (not output.exists() or not output.read_text()) and run.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    run.kill()  # killed mid-run, after its first reply was written
    run.wait()
    written_before = len(read_output(output))
    assert 1 <= written_before < len(questions), "the first run should have been killed mid-way"
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    summary = json.loads(finished.stdout.strip().splitlines()[-1])
    assert summary["already_done"] == written_before and summary["failed"] == 0
    records = read_output(output)
    assert sorted(r["id"] for r in records) == list(range(len(questions)))  # each once: nothing lost or repeated
    assert all(r["messages"][-1]["content"].strip() and 1 <= r["num_new_tokens"] <= 24 for r in records)
    assert "5" in records[[r["id"] for r in records].index(0)]["messages"][-1]["content"]  # SmolLM2 knows 2 + 3


def test_server_failures_are_counted_and_retried(tmp_path, prompts_file):
    """A server that cannot be reached: every reply counts as failed, nothing is written, and the
    summary says so (a rerun against a live server retries them)."""
    output = tmp_path / "out.jsonl"
    summary = regenerate_data.main(
        [
            "--server_url",
            "http://127.0.0.1:9/v1",
            "--server_model",
            "m",
            "--prompts",
            prompts_file,
            "--output",
            str(output),
            "--num_prompts",
            "3",
            "--server_max_retries",
            "0",
            "--server_timeout_s",
            "5",
        ]
    )
    assert summary["failed"] == 3 and summary["written"] == 0
    assert not output.exists() or output.read_text() == ""


def test_resume_reads_replies_with_unicode_line_separators(tmp_path, prompts_file):
    """json.dumps(ensure_ascii=False) leaves U+2028 / U+0085 unescaped: a resumed run must not split a
    record there (str.splitlines would, and call the file corrupt)."""
    prompts = regenerate_data.load_prompts(prompts_file)
    output = tmp_path / "out.jsonl"
    records = [
        {
            "id": i,
            "sample": 0,
            "prompt_hash": prompt_hash(prompts[i]),
            "messages": prompts[i] + [{"role": "assistant", "content": f"a\u2028b\x85c {i}"}],
            "num_new_tokens": 3,
            "finished": True,
        }
        for i in range(3)
    ]
    output.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert regenerate_data.read_done(str(output), prompts) == {(0, 0), (1, 0), (2, 0)}


def test_static_decoder_writes_what_generate_writes(tmp_path, tiny_target, prompts_file):
    """The static-cache decoder (the GPU path, run here without CUDA graphs) against transformers'
    generate with a growing cache: the same greedy replies, left padding and a filled-up last batch
    included (10 prompts in batches of 4)."""
    dynamic, static = tmp_path / "dynamic.jsonl", tmp_path / "static.jsonl"
    regenerate(tiny_target, prompts_file, dynamic, "--batch_size", "4", "--kv_cache", "dynamic")
    regenerate(tiny_target, prompts_file, static, "--batch_size", "4", "--kv_cache", "static")
    assert replies(read_output(static)) == replies(read_output(dynamic))
    assert [r["num_new_tokens"] for r in read_output(static)] == [r["num_new_tokens"] for r in read_output(dynamic)]


@pytest.fixture(scope="module")
def tiny_model_and_prompts(tiny_target):
    """The tiny target in float32 and 10 chat prompts of varied lengths as token ids."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32, attn_implementation="sdpa").eval()
    messages = [[{"role": "user", "content": f"Question {i}: " + "why " * (i % 3) + "is the sky blue?"}] for i in range(NUM_PROMPTS)]
    ids = [tokenizer(regenerate_data.prompt_text(tokenizer, m, {}), add_special_tokens=False)["input_ids"] for m in messages]
    return model, tokenizer, ids


@pytest.mark.parametrize("batch_size,check_every", [(2, 1), (3, 8)])
def test_refilled_rows_decode_what_generate_decodes(tiny_model_and_prompts, monkeypatch, batch_size, check_every):
    """Rows that take the next prompt when their reply ends, in a ring of cache columns that wraps
    around: each reply equals transformers' generate alone on its prompt, and the rows stay busy.
    Replies of different lengths: the end-of-turn ids are the tokens that replies 1 and 6 write
    third, so replies end wherever they write one."""
    model, tokenizer, ids = tiny_model_and_prompts
    max_new = 16
    alone = [
        model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in ids
    ]
    eos = sorted({alone[1][2], alone[6][2]})
    expected = [reply[: next((i + 1 for i, t in enumerate(reply) if t in eos), max_new)] for reply in alone]
    lengths = [len(reply) for reply in expected]
    assert 1 < len(set(lengths)), lengths  # the test needs replies of different lengths
    monkeypatch.setattr(dflash_batch_decoding.StaticBatchDecoder, "CHECK_EVERY", check_every)
    # Small shape buckets, so that prefills pad rows (past the batch, too) and columns here.
    # Batch 3 starts 3 prompts as two chunks of 2 rows; batch 2 pads 1 prompt to 2 rows.
    buckets = (2,) if batch_size == 3 else (2, 4)
    monkeypatch.setattr(dflash_batch_decoding.StaticBatchDecoder, "PREFILL_ROW_BUCKETS", buckets)
    monkeypatch.setattr(dflash_batch_decoding.StaticBatchDecoder, "PREFILL_WIDTH_MULTIPLE", 4)
    decoder = dflash_batch_decoding.StaticBatchDecoder(model, batch_size, max(map(len, ids)), max_new, cuda_graphs=False)
    shapes = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        out = dict(decoder.stream(((i, p, 0) for i, p in enumerate(ids)), eos, pad_token_id=0))
    finally:
        hook.remove()
    assert out == dict(enumerate(expected))
    prefills = {shape for shape in shapes if shape[1] > 1}
    assert prefills and all(rows in buckets and (width % 4 == 0 or width == decoder.width) for rows, width in prefills), prefills
    if batch_size == 3:  # the first check's 3 prompts: two prefill forwards of 2 rows, the second padded
        assert shapes[0][0] == shapes[1][0] == 2 and shapes[1][1] > 1, shapes[:3]
    stats = decoder.stats
    assert stats["replies"] == NUM_PROMPTS and stats["new_tokens"] == stats["busy_row_steps"] == sum(lengths)
    assert stats["steps"] > decoder.length  # the ring of columns wrapped around
    parts = stats["wait_seconds"] + stats["prefill_seconds"] + stats["handout_seconds"]
    assert stats["prefill_seconds"] > 0 and 0 <= parts <= stats["check_seconds"] <= stats["seconds"], stats
    fixed_batches = sum(max(lengths[s : s + batch_size]) for s in range(0, NUM_PROMPTS, batch_size))
    if check_every == 1:  # a freed row starts the next prompt at once: fewer steps than batches that wait for their longest reply
        assert stats["steps"] < fixed_batches, (stats, lengths)


def test_a_repeated_prefill_shape_creates_no_tensor_from_host_data(tiny_model_and_prompts, monkeypatch):
    """The prefill at a shape it has run before is capturable as a CUDA graph: it builds no tensor from
    host data (a copy to the GPU from unpinned memory is not allowed inside a capture; transformers'
    growing cache made one on every call) and writes what the first call wrote."""
    model, _, ids = tiny_model_and_prompts
    decoder = dflash_batch_decoding.StaticBatchDecoder(model, 4, max(map(len, ids)), 8, cuda_graphs=False)
    width = max(len(p) for p in ids[:2])
    input_ids = torch.zeros(2, width, dtype=torch.long)
    real = torch.zeros(2, width, dtype=torch.bool)
    for i, p in enumerate(ids[:2]):
        input_ids[i, width - len(p) :], real[i, width - len(p) :] = torch.tensor(p), True
    rows, column = torch.tensor([1, 3]), torch.tensor([5])
    call = lambda: decoder._prefill_forward(input_ids, real, rows, column)
    first, ring = call(), decoder.cache.layers[0].keys.clone()

    def no_host_data(*args, **kwargs):
        raise AssertionError("a tensor from host data inside the prefill")

    monkeypatch.setattr(torch, "tensor", no_host_data)
    again = call()
    monkeypatch.undo()
    torch.testing.assert_close(again, first)
    assert torch.equal(decoder.cache.layers[0].keys, ring) and ring[[1, 3]].abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_the_prefill_replays_from_a_cuda_graph_as_the_eager_prefill(tiny_model_and_prompts):
    """On a GPU the prefill is captured as a CUDA graph (no warning, the graph kept) and writes the
    same logits, ring keys and valid columns as the eager prefill. A host scalar written into a
    device tensor (`valid[rows] = False`) is a host-to-GPU copy the capture refuses."""
    import copy

    model, _, ids = tiny_model_and_prompts
    model = copy.deepcopy(model).cuda()
    rows = torch.tensor([0, 2, 3], device="cuda")
    results = []
    for graphs in (True, False):
        decoder = dflash_batch_decoding.StaticBatchDecoder(model, 4, max(map(len, ids)), 8, cuda_graphs=graphs)
        for _ in range(2):  # the first call captures, the second replays
            logits = decoder._prefill(rows, ids[:3], 5, 0)
        if graphs:
            assert decoder.prefill_graphed is not None and len(decoder.prefill_graphed.graphs) == 1
        results.append((logits, decoder.cache.layers[0].keys.clone(), decoder.valid.clone()))
    (graph_logits, graph_keys, graph_valid), (eager_logits, eager_keys, eager_valid) = results
    torch.testing.assert_close(graph_logits, eager_logits)
    torch.testing.assert_close(graph_keys, eager_keys)
    assert torch.equal(graph_valid, eager_valid) and graph_valid[rows].any()


def test_failed_decoding_retries_the_replies_in_flight(tmp_path, tiny_target, prompts_file, monkeypatch, caplog):
    """The static decoder fails while starting its second group of prompts: those in flight are
    retried one by one with generate, the others go on in a new stream; every reply written once,
    the same as an uninterrupted run."""
    reference = tmp_path / "reference.jsonl"
    regenerate(tiny_target, prompts_file, reference, "--kv_cache", "static", "--batch_size", "4")
    real, calls = dflash_batch_decoding.StaticBatchDecoder._prefill, []

    def failing_once(self, rows, *args):
        calls.append(len(rows))
        if len(calls) == 2:
            raise RuntimeError("simulated out of memory")
        return real(self, rows, *args)

    monkeypatch.setattr(dflash_batch_decoding.StaticBatchDecoder, "_prefill", failing_once)
    output = tmp_path / "out.jsonl"
    with caplog.at_level(logging.WARNING, logger="regenerate_data"):
        summary = regenerate(tiny_target, prompts_file, output, "--kv_cache", "static", "--batch_size", "4")
    assert summary["written"] == NUM_PROMPTS and summary["failed"] == 0
    records = read_output(output)
    assert sorted(r["id"] for r in records) == list(range(NUM_PROMPTS))
    assert replies(records) == replies(read_output(reference))
    assert "RuntimeError: simulated out of memory" in caplog.text and "in flight one by one" in caplog.text


# ----------------------------------------------------------------------------------------------
# The compiled decode step (the GPU default; forced on here, where it runs without CUDA graphs)


@pytest.mark.parametrize("sampling", [(), ("--num_samples_per_prompt", "2", "--temperature", "0.8")], ids=["greedy", "sampled"])
def test_compiled_decode_step_writes_what_generate_writes(tmp_path, tiny_target, prompts_file, caplog, monkeypatch, sampling):
    """The static decoder with its decode step compiled (torch.compile, inductor) writes the same
    replies as the eager static step and as transformers' generate with a growing cache: left
    padding, a filled-up last batch and per-reply sampling seeds included."""
    real_compile, compiled_calls = torch.compile, []

    def counting_compile(fn, **kwargs):
        compiled = real_compile(fn, **kwargs)

        def step(tokens, *inputs):
            compiled_calls.append(tokens.shape[1])
            return compiled(tokens, *inputs)

        return step

    monkeypatch.setattr(torch, "compile", counting_compile)
    runs = {
        "dynamic": ("--kv_cache", "dynamic"),
        "eager": ("--kv_cache", "static", "--compile_decode", "off"),
        "compiled": ("--kv_cache", "static", "--compile_decode", "on"),
    }
    texts = {}
    with caplog.at_level(logging.INFO, logger="regenerate_data"):
        for name, flags in runs.items():
            output = tmp_path / f"{name}.jsonl"
            regenerate(tiny_target, prompts_file, output, "--num_prompts", "3", "--batch_size", "4", *sampling, *flags)
            texts[name] = {(r["id"], r["sample"]): (r["messages"][-1]["content"], r["num_new_tokens"]) for r in read_output(output)}
    assert len(texts["dynamic"]) == (6 if sampling else 3)
    assert texts["compiled"] == texts["eager"] == texts["dynamic"]
    assert "decode step compiled" in caplog.text and "failed in its warm-up" not in caplog.text
    assert compiled_calls and set(compiled_calls) == {1}, compiled_calls  # every decode step compiled, the prefill eager


def test_compiled_decode_step_falls_back_to_the_eager_step(tmp_path, tiny_target, prompts_file, caplog, monkeypatch):
    """A compiled step that raises in its first call: one warning naming the error, and the run
    goes on with the eager step (same replies, nothing failed)."""

    def failing_compile(fn, **kwargs):
        def compiled(*inputs):
            raise RuntimeError("simulated inductor failure")

        return compiled

    flags = ("--num_prompts", "3", "--batch_size", "2", "--kv_cache", "static")  # two batches: the fallback lasts the run
    eager = tmp_path / "eager.jsonl"
    regenerate(tiny_target, prompts_file, eager, *flags, "--compile_decode", "off")
    monkeypatch.setattr(torch, "compile", failing_compile)
    fallback = tmp_path / "fallback.jsonl"
    with caplog.at_level(logging.WARNING, logger="regenerate_data"):
        summary = regenerate(tiny_target, prompts_file, fallback, *flags, "--compile_decode", "on")
    assert summary["written"] == 3 and summary["failed"] == 0
    assert replies(read_output(fallback)) == replies(read_output(eager))
    warnings = [r.getMessage() for r in caplog.records if "failed in its warm-up" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: simulated inductor failure" in warnings[0], caplog.text


def test_compile_decode_setting_is_checked(prompts_file):
    common = ["--target_model", "t", "--prompts", prompts_file, "--output", "o.jsonl"]
    assert regenerate_data.parse_args(common)[0].compile_decode == "auto"
    with pytest.raises(ValueError, match="--compile_decode must be auto, on or off"):
        regenerate_data.parse_args(common + ["--compile_decode", "yes"])
    with pytest.raises(ValueError, match="needs --kv_cache static"):
        regenerate_data.parse_args(common + ["--compile_decode", "on", "--kv_cache", "dynamic"])


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--batch_size", "0", "--batch_size must be >= 1, got 0"),
        ("--max_new_tokens", "-2", "--max_new_tokens must be >= 1, got -2"),
        ("--num_samples_per_prompt", "0", "--num_samples_per_prompt must be >= 1, got 0"),
        ("--temperature", "-1", "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
        ("--temperature", "nan", "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
        ("--temperature", "inf", "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
        ("--num_prompts", "0", "--num_prompts must be >= 1 (leave it out for every prompt), got 0"),
        ("--num_prompts", "-1", "--num_prompts must be >= 1 (leave it out for every prompt), got -1"),
    ],
)
def test_bad_numbers_name_their_flag(prompts_file, flag, value, message):
    with pytest.raises(ValueError) as error:
        regenerate_data.parse_args(["--target_model", "t", "--prompts", prompts_file, "--output", "o.jsonl", flag, value])
    assert str(error.value) == message


def test_auto_compiles_the_decode_step_only_where_the_compile_pays_for_itself():
    decide = regenerate_data.compile_decode_step
    assert regenerate_data.COMPILE_DECODE_MIN_BATCHES == 36  # ~26 s more first batch / ~0.7 s saved per later batch, of 512 or 1024 rows
    assert [decide("auto", True, n) for n in (1, 14, 28, 35, 36, 200)] == [False, False, False, False, True, True]
    assert not decide("auto", False, 100)  # no CUDA graphs (CPU): nothing to compile into
    assert decide("on", False, 1) and not decide("off", True, 100)


def test_packed_gqa_sdpa_matches_repeated_kv_heads():
    """One query token with grouped KV heads: attending with the query heads packed as rows of their
    KV head equals transformers' sdpa attention over repeated KV heads; other shapes go to it unchanged."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    batch, kv_heads, columns, head_dim = 2, 2, 11, 8
    query = torch.randn(batch, kv_heads * 3, 1, head_dim)
    key, value = torch.randn(2, batch, kv_heads, columns, head_dim)
    mask = torch.rand(batch, 1, 1, columns) < 0.7
    mask[..., 0] = True  # no fully masked row
    packed, _ = dflash_batch_decoding.packed_gqa_sdpa(Attention(), query, key, value, mask, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.3)
    assert packed.shape == (batch, 1, kv_heads * 3, head_dim)
    torch.testing.assert_close(packed, expected.transpose(1, 2))
    queries, mask = torch.randn(batch, kv_heads * 3, 4, head_dim), torch.ones(batch, 1, 4, columns, dtype=torch.bool).tril(columns - 4)
    torch.testing.assert_close(
        dflash_batch_decoding.packed_gqa_sdpa(Attention(), queries, key, value, mask, scaling=0.3)[0],
        sdpa_attention_forward(Attention(), queries, key, value, mask, scaling=0.3)[0],
    )
