"""Long samples: the memory levers of the training forward compute the same function as the plain one.

The chunked, checkpointed context path and checkpointed decoder layers give the plain forward's loss
and gradients (float tolerance).
"""

import pytest
import torch
from test_model import VOCAB, _batch, tiny_drafter

from dflash_loss import loss_weights, weighted_block_loss
from dflash_masks import block_labels, sample_anchors

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_target")  # eval's and regenerate's main() on the same folders


def loss_and_grads(drafter, chunk_size=0, checkpointed=False, seq_len=70):
    """One training step's loss and the drafter's gradients on a fixed batch with two rows of unequal length."""
    drafter.chunk_context(chunk_size)
    drafter.checkpoint_layers(checkpointed)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB - 1, (2, seq_len), generator=g)
    loss_mask = torch.ones(2, seq_len, dtype=torch.bool)
    loss_mask[:, :9] = False
    loss_mask[1, seq_len - 13 :] = False
    features = torch.randn(2, seq_len, len(drafter.config.target_layer_ids) * 16, generator=g)
    anchors, valid = sample_anchors(loss_mask, 12, torch.Generator().manual_seed(2))
    hidden = drafter(features, input_ids, anchors, valid)
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
    loss, _ = weighted_block_loss(hidden[:, :, 1:], drafter.target_lm_head.weight, labels, label_valid, loss_weights(4, gamma=2.0))
    drafter.zero_grad()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in drafter.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", [{}, {"layer_types": "last_full", "sliding_window": 8}])
def test_chunked_context_and_checkpointed_layers_give_the_same_loss_and_gradients(layout):
    drafter = tiny_drafter(block_size=4, num_draft_layers=3, **layout).train()
    plain_loss, plain = loss_and_grads(drafter)
    assert plain_loss > 0 and plain["fc.weight"].abs().sum() > 0 and plain["layers.0.self_attn.k_proj.weight"].abs().sum() > 0
    for chunk_size, checkpointed in [(16, False), (29, False), (0, True), (16, True), (70, True)]:  # 29: a ragged last chunk
        loss, grads = loss_and_grads(drafter, chunk_size, checkpointed)
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == plain.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain[name], rtol=1e-4, atol=1e-6, msg=f"{name}, chunk {chunk_size}, checkpointed {checkpointed}")


def test_chunked_context_saves_the_context_intermediates():
    """What backward keeps, counted with saved-tensor hooks: chunking keeps less, by an amount that
    grows with the context length (the point of the lever), and checkpointed layers keep less again."""
    drafter = tiny_drafter(block_size=4, num_draft_layers=3).train()

    def saved_bytes(seq_len, chunk_size=0, checkpointed=False):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_and_grads(drafter, chunk_size, checkpointed, seq_len=seq_len)
        return sum(storages.values())

    for seq_len in (200, 800):
        plain, chunked = saved_bytes(seq_len), saved_bytes(seq_len, chunk_size=64)
        assert chunked < plain, (seq_len, chunked, plain)
        assert saved_bytes(seq_len, 64, checkpointed=True) < chunked
    saving = lambda seq_len: saved_bytes(seq_len) - saved_bytes(seq_len, 64)  # noqa: E731
    assert saving(800) > 3 * saving(200)  # grows with the length


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpoint_drafter_layers_reruns_every_layer_in_backward(compiled, monkeypatch, tmp_path):
    """--checkpoint_drafter_layers, through the trainer's drafter build: backward runs each decoder
    layer's forward again (counted with forward pre-hooks: a non-reentrant checkpoint stops its
    recompute as soon as it has what backward needs, so a hook after the forward would not see it),
    on eager layers and on compiled ones (the GPU default; on CPU through SDPA, which has a
    backward there; test_compile's shapes, so its compiled graphs serve). Without the flag backward
    runs none."""
    from dflash_compile import COMPILE_LOCK_DIR_ENV
    from dflash_topology import TargetParts
    from train_dflash import Compute, TrainSettings, build_drafter

    monkeypatch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path))
    config = tiny_drafter(block_size=4).config  # 2 layers
    embed, head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB, bias=False)
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=compiled, compile_target=False, dtype=torch.float32, on_cuda=False)
    rerun = {}
    for checkpointed in (False, True):
        settings = TrainSettings(target_model="x", train_data=["x"], checkpoint_drafter_layers=checkpointed)
        drafter = build_drafter(settings, config, TargetParts(None, None, embed, head), compute).train()
        layers = drafter._compiled_layers if compiled else drafter.layers
        assert len(layers) == 2
        in_backward, calls = [False], [0, 0]
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + in_backward[0]))
        input_ids, loss_mask = _batch()
        features = torch.randn(2, input_ids.shape[1], len(config.target_layer_ids) * 16)
        anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1))
        hidden = drafter(features, input_ids, anchors, valid, attention_backend="sdpa")
        labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, 4)
        loss, _ = weighted_block_loss(hidden[:, :, 1:], head.weight, labels, label_valid, loss_weights(4, gamma=2.0))
        in_backward[0] = True
        loss.backward()
        assert drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
        rerun[checkpointed] = calls
    assert rerun == {False: [0, 0], True: [1, 1]}


def test_chunk_context_rejects_a_negative_size():
    with pytest.raises(ValueError, match="context chunk size must be >= 0"):
        tiny_drafter().chunk_context(-1)


def test_bench_long_grid_runs_on_cpu_and_resumes(tmp_path, capsys):
    """bench_dflash.py --long in its tiny CPU mode: a row per layout and length plus the target's forward,
    written to --rows as each ends; a second call with the same file runs nothing again."""
    import json

    import bench_dflash

    rows = tmp_path / "rows.jsonl"
    argv = [
        "--long",
        "--device",
        "cpu",
        "--tiny",
        "--long_lengths",
        "96,256",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--variant",
        "baseline+context_chunk_64+checkpoint_layers",
        "--rows",
        str(rows),
        "--record-to",
        str(tmp_path / "B.md"),
    ]
    threads = torch.get_num_threads()  # bench_dflash.main sets 1 on a CPU
    bench_dflash.main(argv)
    first = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r["kind"], r.get("layout"), r["seq"], r["status"]) for r in first] == [
        ("target", None, 96, "ok"),
        ("target", None, 256, "ok"),
        ("drafter", "all_full", 96, "ok"),
        ("drafter", "all_full", 256, "ok"),
        ("drafter", "last_full", 96, "ok"),
        ("drafter", "last_full", 256, "ok"),
    ]
    assert first[3]["flops_sample"] > first[2]["flops_sample"] > 0  # the context work grows with the length
    table = (tmp_path / "B.md").read_text()
    assert "| last_full (32) | baseline+context_chunk_64+checkpoint_layers | 256 | 16 |" in table and "every row measured" in table
    capsys.readouterr()
    bench_dflash.main(argv)
    torch.set_num_threads(threads)
    assert rows.read_text().count("\n") == 6  # resumed: nothing ran again
    assert "(long) all_full" not in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# Long prompts: evaluation and regeneration check the target's context before its weights load

from test_eval import qwen3_dirs  # noqa: E402,F401 - a fixture: a tiny Qwen3 target (context 1,024) and drafter (block 6)
from test_regenerate import tiny_target  # noqa: E402,F401 - a fixture: a tiny Qwen3 target folder (context 512)


def long_prompt_file(path, words: int):
    """Prompts: a short one, then one of `words` words at line 2, then a short one."""
    import json

    records = [{"prompt": "What is 2 + 3?"}, {"question": "Count: " + "one " * words}, {"prompt": "Name a color."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_eval_names_a_prompt_longer_than_the_targets_context_before_the_target_loads(qwen3_dirs, tmp_path, monkeypatch):  # noqa: F811
    import dflash_target
    import eval_dflash

    target_dir, drafter_dir, _, _ = qwen3_dirs

    def no_weights(*args, **kwargs):
        raise AssertionError("the target's weights loaded before the prompts were checked")

    monkeypatch.setattr(dflash_target, "load_target_model", no_weights)
    prompts = long_prompt_file(tmp_path / "long.jsonl", 1010)
    argv = [
        "--target_model",
        str(target_dir),
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
        "--baseline",
        "none",
    ]
    with pytest.raises(ValueError) as error:
        eval_dflash.main(argv)
    message = str(error.value)
    assert message.startswith(f"{prompts}:2: the prompt is ") and "\n" not in message
    length = int(message.split("the prompt is ")[1].split(" tokens")[0].replace(",", ""))
    assert 1010 < length < 1040  # one token per word, and the template's
    assert f"needs {length + 8 + 6:,} positions, more than the target's context of 1,024" in message
    assert "1 of 3 prompts are too long" in message
    # At --num_prompts 1 only the short prompt is read: the run goes on to load the target.
    with pytest.raises(AssertionError, match="weights loaded"):
        eval_dflash.main(argv + ["--num_prompts", "1"])


def test_regenerate_names_a_prompt_longer_than_the_targets_context_before_the_target_loads(tiny_target, tmp_path, monkeypatch):  # noqa: F811
    import regenerate_data

    def no_weights(*args, **kwargs):
        raise AssertionError("the target's weights loaded before the prompts were checked")

    monkeypatch.setattr(regenerate_data, "load_target_model", no_weights)
    prompts = long_prompt_file(tmp_path / "long.jsonl", 480)  # ~490 tokens: fits 512 alone, not with 64 new ones
    argv = ["--target_model", tiny_target, "--prompts", str(prompts), "--output", str(tmp_path / "out.jsonl"), "--temperature", "0"]
    with pytest.raises(
        ValueError,
        match=rf"^{prompts}:2: the prompt is \d+ tokens \(chat template included\), and with "
        rf"--max_new_tokens 64 it needs \d+ positions, more than the target's context of 512",
    ):
        regenerate_data.main(argv + ["--max_new_tokens", "64"])
    with pytest.raises(AssertionError, match="weights loaded"):  # with 8 new tokens it fits
        regenerate_data.main(argv + ["--max_new_tokens", "8"])


# ----------------------------------------------------------------------------------------------
# tau against the context length: the k-shot prompts and the table by length


def tool(path: str):
    """A script of tools/ as a module (they are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(Path(path).stem, Path(__file__).resolve().parents[1] / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_long_prompts_fill_each_length_and_the_table_splits_tau_by_length(tiny_qwen3_target, tmp_path, capsys):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import matplotlib.image
    from transformers import AutoTokenizer

    replies = tmp_path / "greedy.jsonl"
    replies.write_text(
        "".join(
            json.dumps(
                {
                    "id": i,
                    "messages": [
                        {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
                        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 3)},
                    ],
                }
            )
            + "\n"
            for i in range(30)
        )
    )
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"question": f"Held-out {i}: what is {i} times 3?"}) + "\n" for i in range(3)))
    out = tmp_path / "long"
    long_prompts, tau_by_length = tool("tools/long_prompts.py"), tool("tools/gpu/tau_by_length.py")
    long_prompts.main(
        [
            "--target_model",
            str(tiny_qwen3_target),
            "--replies",
            str(replies),
            "--heldout",
            str(heldout),
            "--out_dir",
            str(out),
            "--lengths",
            "30,200,400",
            "--num_eval",
            "2",
            "--train_lengths",
            "150,300",
            "--num_train",
            "6",
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_target)

    def tokens(messages, generation_prompt):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompts = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [p["length"] for p in prompts] == [30, 30, 200, 200, 400, 400]
    assert prompts[0]["prompt"] == "Held-out 0: what is 0 times 3?"  # the bare question: no exemplar fits 30 tokens
    for p in prompts:
        n = tokens([{"role": "user", "content": p["prompt"]}], True)
        assert n <= p["length"] and (p["length"] == 30 or n > p["length"] - 60), (n, p["length"])  # filled to within an exemplar
        assert p["prompt"].endswith(("0 times 3?", "1 times 3?"))
    train = [json.loads(line)["messages"] for line in (out / "train_long.jsonl").read_text().splitlines()]
    assert len(train) == 6
    for n, (user, assistant) in enumerate(train):
        question = user["content"].split("\n\n")[-1]
        own = f"Question: {question}\nAnswer: {assistant['content']}"
        assert question.startswith("Question number") and own not in user["content"]  # never its own exemplar
        assert user["content"].count("Question: ") >= 1 and tokens([user, assistant], False) <= (150, 300)[n % 2]

    # tau by length: two prompts per length, tau = committed / forwards over each length's prompts
    per_prompt = [
        {"prompt_index": i, "prompt_tokens": 50 * (i + 1), "acceptance_length": a, "verify_forwards": f}
        for i, (a, f) in enumerate([(3.0, 10), (2.0, 10), (2.5, 4), (2.5, 4), (1.0, 5), (2.0, 15)])
    ]
    (tmp_path / "eval_recipe.json").write_text(json.dumps({"per_prompt": per_prompt}))
    (tmp_path / "eval_recipe_t0.8.json").write_text(json.dumps({"per_prompt": per_prompt[:2]}))
    (tmp_path / "eval_recipe_dflash2.json").write_text(json.dumps({"per_prompt": [{**row, "acceptance_length": 3.0} for row in per_prompt]}))
    capsys.readouterr()
    figure = tau_by_length.main(out / "eval.jsonl", tmp_path)
    table = capsys.readouterr().out
    assert "| run | temperature | tau at ~75 tokens | tau at ~175 tokens | tau at ~275 tokens | longest - shortest |" in table
    assert "| recipe | 0 | 2.50 | 2.50 | 1.75 | -0.75 |" in table
    assert "| recipe | 0.8 | 2.50 | - | - | - |" in table
    assert "| recipe_dflash2 | 0 | 3.00 | 3.00 | 3.00 | +0.00 |" in table

    # the plot: a line per run and temperature, tau against the lengths' mean tokens, a colour per run,
    # solid at T=0 and dashed at T=0.8
    png = (tmp_path / "tau_by_length.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and matplotlib.image.imread(tmp_path / "tau_by_length.png").shape == (400, 650, 4)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert sorted(lines) == ["recipe, T=0", "recipe, T=0.8", "recipe_dflash2, T=0"]
    assert list(lines["recipe, T=0"].get_xdata()) == [75, 175, 275] and list(lines["recipe, T=0"].get_ydata()) == [2.5, 2.5, 1.75]
    assert list(lines["recipe, T=0.8"].get_xdata()) == [75] and list(lines["recipe, T=0.8"].get_ydata()) == [2.5]
    assert [lines[k].get_linestyle() for k in sorted(lines)] == ["-", "--", "-"]
    assert lines["recipe, T=0"].get_color() == lines["recipe, T=0.8"].get_color() != lines["recipe_dflash2, T=0"].get_color()
    # --plot writes it where asked (folders made), and the command line prints the same table
    elsewhere = tmp_path / "results" / "smollm2" / "tau_by_length.png"
    script = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "tau_by_length.py"
    printed = subprocess.run([sys.executable, script, out / "eval.jsonl", tmp_path, "--plot", elsewhere], capture_output=True, text=True, check=True)
    assert printed.stdout == table and elsewhere.read_bytes().startswith(b"\x89PNG")


def test_long_sample_settings_parse_and_are_checked():
    from train_dflash import parse_settings

    settings, _ = parse_settings(["--target_model", "x", "--train_data", "README.md", "--context_chunk_size", "4096", "--checkpoint_drafter_layers"])
    assert settings.context_chunk_size == 4096 and settings.checkpoint_drafter_layers is True
    defaults, _ = parse_settings(["--target_model", "x", "--train_data", "README.md"])
    assert defaults.context_chunk_size == 0 and defaults.checkpoint_drafter_layers is False
    with pytest.raises(ValueError, match="--context_chunk_size must be >= 0"):
        parse_settings(["--target_model", "x", "--train_data", "README.md", "--context_chunk_size", "-1"])
