"""Training a DSpark drafter through train_dflash.py (`--drafter dspark`, colocated, CPU): a run on a
repeated tiny batch whose loss falls, whose held-out tau (gamma + 1 tokens verified) is eval_dflash.py's
on its export, and whose export `DSparkDraftModel` reloads in DeepSpec's layout, the trainer's
micro-batch loss against `dspark_loss` computed by hand, and the one-line refusals of what DSpark does
not train with yet."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from conftest import write_qwen3_tokenizer
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import eval_dflash
from dflash_loss import dspark_loss
from dspark_model import DSparkConfig, DSparkDraftModel
from train_dflash import Compute, MicroBatchLoss, TrainSettings, parse_settings

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "data" / "demo_conversations.jsonl"


def dspark_args(target_dir, output_dir, **overrides) -> list[str]:
    """A tiny DSpark run: 2 samples in one micro-batch, the same batch every step (one step per epoch),
    gamma 4, a Markov head of rank 8 (rank 256 at Qwen3's vocabulary would be 78M parameters)."""
    settings = dict(
        target_model=str(target_dir),
        train_data=str(DEMO_DATA),
        output_dir=str(output_dir),
        drafter="dspark",
        max_samples=2,
        per_device_batch_size=2,
        max_steps=15,
        num_anchors=8,
        block_size=4,
        markov_rank=8,
        num_draft_layers=1,
        target_layer_ids="1 3",
        max_seq_length=64,
        learning_rate=3e-2,
        warmup_ratio=0,
        logging_steps=5,
        save_steps=0,
        report_to="none",
        num_proc=1,
    )
    settings.update(overrides)
    args = []
    for key, value in settings.items():
        args += [f"--{key}", *str(value).split()]
    return args


def test_a_dspark_run_lowers_its_loss_and_exports_a_drafter_that_reloads(trainable_qwen3_target, train_runs, tmp_path):
    """15 steps on one repeated batch of 2: the logged DSpark loss (0.1 CE + 0.9 L1 + 1.0 BCE) falls at
    every log line (measured 3.30, 3.11, 3.04 at steps 5, 10, 15; the L1 to a peaked target through
    one drafter layer falls slowly), held-out tau is measured at step 10 (--eval_steps) and at the end
    with verify blocks of gamma + 1 = 5 (1.0 both times: 15 steps teach the drafter no draft the target
    accepts; the next test checks the value), and final/ is DeepSpec's layout (Qwen3DSparkModel, the
    heads' tensors, copies of the target's embedding and LM head) that `DSparkDraftModel` loads strictly,
    with the settings saved beside it."""
    out = tmp_path / "run"
    held_out = dict(eval_data=REPO / "data" / "demo_heldout_prompts.jsonl", eval_num_prompts=2, eval_max_new_tokens=24, eval_steps=10)
    result = train_runs.run("train_dflash.py", dspark_args(trainable_qwen3_target, out, **held_out), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "DSpark: block size 4 = drafts per block" in result.stderr
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    log = [row for row in rows if "loss" in row]
    assert [row["step"] for row in log] == [5, 10, 15]
    evaluated = [row for row in rows if "eval_tau" in row]
    print("held-out", [(row["step"], row["eval_tau"]) for row in evaluated])
    assert [(row["step"], row["eval_block_size"]) for row in evaluated] == [(10, 5), (15, 5)]
    assert all(1.0 <= row["eval_tau"] <= 5.0 for row in evaluated)
    assert "Held-out tau at step 15: " in result.stderr
    losses = [row["loss"] for row in log]
    print("losses", losses)
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > losses[1] > losses[2] and losses[-1] < 0.95 * losses[0], losses
    assert 1.0 <= log[-1]["tau_estimate"] <= 5.0  # 1 + the accepted share at each of the 4 slots

    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["block_size"], config["markov_rank"], config["target_layer_ids"]) == (4, 8, [1, 3])
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["mask_token_id"] == 151669 and config["sample_from_anchor"] is True
    settings = json.loads((final / "training_settings.json").read_text())
    assert (settings["drafter"], settings["loss"], settings["dspark_ce_weight"], settings["dspark_l1_weight"]) == ("dspark", "dspark", 0.1, 0.9)
    assert (settings["dspark_bce_weight"], settings["markov_rank"], settings["enable_confidence_head"]) == (1.0, 8, True)
    assert "DSpark drafter" in (final / "README.md").read_text()

    weights = load_file(final / "model.safetensors")
    assert weights["markov_head.markov_w1.weight"].shape == (151936, 8)
    assert weights["markov_head.markov_w2.weight"].shape == (151936, 8)
    assert weights["confidence_head.proj.weight"].shape == (1, 64 + 8)
    target = load_file(Path(trainable_qwen3_target) / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], target["lm_head.weight"])
    assert torch.equal(weights["embed_tokens.weight"], target["model.embed_tokens.weight"])
    drafter = DSparkDraftModel(DSparkConfig.from_pretrained(final))
    drafter.load_state_dict({k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}, strict=True)
    assert drafter.config.block_size == 4 and drafter.markov_head.markov_w1.weight.abs().sum() > 0


def test_held_out_tau_of_a_dspark_drafter_is_eval_dflash_on_its_export(qwen3_tokenizer, tmp_path):
    """`held_out_tau`, the trainer's periodic and final evaluation, on a DSpark drafter of gamma 4:
    verify blocks of gamma + 1 = 5 and eval_dflash.py's tau on the drafter's export (the same 2
    held-out prompts, 32 new tokens, greedy, fp32). The target is a bigram model (its layers add
    nothing to the residual stream: the logits after token v are lm_head(norm(embed[v])), of rank 16),
    and the drafter's rank-16 Markov head holds 10 x those logits, so its walk is often accepted, not
    always (measured 3.44 at blocks of 5, 2.82 at blocks of gamma = 4)."""
    from dflash_data import load_prompts
    from dflash_decoding import evaluate_acceptance
    from dflash_target import drafter_config_for_target
    from dspark_model import save_dspark_export
    from train_dflash import TrainData, held_out_tau

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=151936,
        max_position_embeddings=512,
        initializer_range=0.25,
        tie_word_embeddings=False,
        eos_token_id=qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    target = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target.save_pretrained(tmp_path / "target")
    write_qwen3_tokenizer(tmp_path / "target")  # the hub's files: they load faster than what save_pretrained writes
    draft_config = drafter_config_for_target(
        target.config, mask_token_id=151669, num_draft_layers=1, block_size=4, target_layer_ids=[0, 1], drafter="dspark", markov_rank=16
    )
    torch.manual_seed(1)
    drafter = DSparkDraftModel(draft_config).eval()
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(10 * target.model.norm(target.model.embed_tokens.weight))  # [V, 16]
        drafter.markov_head.markov_w2.weight.copy_(target.lm_head.weight)  # W2(W1[v]) = 10 x the target's logits after v
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    save_dspark_export(drafter, tmp_path / "dspark")

    prompts_file = REPO / "data" / "demo_heldout_prompts.jsonl"
    prompts = load_prompts(str(prompts_file), qwen3_tokenizer, num_prompts=2)
    data = TrainData(dataset=None, lengths=[], eval_prompts=prompts, chat_kwargs=None)
    settings, _ = parse_settings(["--target_model", "x", "--train_data", "a", "--drafter", "dspark", "--eval_max_new_tokens", "32"])
    lead = SimpleNamespace(split=False, is_lead=True)
    scalars = held_out_tau(drafter, target, qwen3_tokenizer, data, settings, lead, torch.device("cpu"))

    base = ["--target_model", str(tmp_path / "target"), "--draft_model", str(tmp_path / "dspark"), "--data", str(prompts_file)]
    base += ["--num_prompts", "2", "--max_new_tokens", "32", "--device", "cpu", "--dtype", "float32", "--baseline", "none"]
    results = eval_dflash.main([*base, "--output", str(tmp_path / "eval.json")])
    gamma_blocks = evaluate_acceptance(target, drafter, qwen3_tokenizer, prompts, 32, block_size=4)["acceptance_length"]
    print(f"held-out tau {scalars['eval_tau']:.4f}, eval_dflash.py {results['acceptance_length']:.4f}, blocks of gamma {gamma_blocks:.4f}")
    assert scalars["eval_block_size"] == 5 and results["settings"]["block_size"] == 5 and results["lossless"] is True
    assert scalars["eval_tau"] == pytest.approx(results["acceptance_length"], abs=1e-9)
    assert 1.5 < scalars["eval_tau"] < 5 and abs(scalars["eval_tau"] - gamma_blocks) > 0.3  # the check can tell the block sizes apart


def test_the_trainer_loss_is_dspark_loss_on_the_blocks_of_its_anchors():
    """`MicroBatchLoss` for a DSpark drafter (`chunked_dspark_loss`) equals `dspark_loss` computed here from
    the drafter's hidden states: labels token[a+k+1] cut at the first hole in the loss mask, Markov predecessors
    token[a+k], and p from the target's last hidden state at a + k through the LM head. A trainer
    that took p one position later (DFlash's label alignment) gives another value."""
    torch.manual_seed(0)
    vocab, hidden_size, gamma = 64, 32, 4
    config = DSparkConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=gamma,
        num_target_layers=4,
        markov_rank=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [1, 3]},
    )
    drafter = DSparkDraftModel(config).float()
    embed, lm_head = nn.Embedding(vocab, hidden_size), nn.Linear(hidden_size, vocab, bias=False)
    nn.init.normal_(lm_head.weight, std=0.5)
    drafter.attach_target(embed.requires_grad_(False), lm_head.requires_grad_(False))
    settings = TrainSettings(target_model="x", train_data=["x"], drafter="dspark", num_anchors=5, block_size=gamma, markov_rank=8)
    assert settings.loss == "dspark"
    compute = Compute(backend="sdpa", pad_multiple=8, compile_drafter=False, compile_target=False, dtype=torch.float32, on_cuda=False)
    loss_fn = MicroBatchLoss(settings, config, compute, None, lm_head)
    seq = 20
    input_ids = torch.randint(0, vocab - 1, (2, seq), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros(2, seq, dtype=torch.bool)
    loss_mask[:, 4:] = True
    loss_mask[0, 12] = False  # a hole: blocks that reach it stop their supervision there
    target_hidden = torch.randn(2, seq, hidden_size, generator=torch.Generator().manual_seed(2))
    features = torch.cat([torch.randn(2, seq, 2 * hidden_size, generator=torch.Generator().manual_seed(3)), target_hidden], dim=-1)

    seen = {}

    class Engine:  # what the trainer passes: the DeepSpeed engine, its drafter as .module; keeps the forward's inputs and output
        module = drafter

        def __call__(self, *args, **kwargs):
            seen["anchors"], seen["anchor_valid"] = args[2], args[3]
            seen["hidden"] = drafter(*args, **kwargs)
            return seen["hidden"]

    loss, accepted = loss_fn(Engine(), features, input_ids, loss_mask, input_ids, (0, 0, 0, 0))

    with torch.no_grad():
        anchors, anchor_valid, hidden = seen["anchors"], seen["anchor_valid"], seen["hidden"]
        shape = (*anchors.shape, gamma)
        labels, valid = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.bool)
        prev, target_logits = torch.zeros(shape, dtype=torch.long), torch.zeros(*shape, vocab)
        for b, n in anchor_valid.nonzero().tolist():
            a, open_ = int(anchors[b, n]), True
            for k in range(gamma):
                position = a + k + 1  # slot k predicts token[a + k + 1], from the target's logits at a + k
                open_ = open_ and position < seq and bool(loss_mask[b, position])
                valid[b, n, k] = open_
                labels[b, n, k] = input_ids[b, min(position, seq - 1)]
                prev[b, n, k] = input_ids[b, min(a + k, seq - 1)]
                target_logits[b, n, k] = lm_head(target_hidden[b, min(a + k, seq - 1)])
        assert 10 < valid.sum() < valid.numel()  # the hole and the sequence end cut some blocks
        logits = drafter.block_logits(hidden, prev)
        confidence = drafter.confidence_logits(hidden, prev)
        expected, _ = dspark_loss(logits, confidence, labels, valid, target_logits)
        shifted, _ = dspark_loss(logits, confidence, labels, valid, target_logits.roll(-1, dims=2))
        runs = ((logits.argmax(dim=-1) == labels).to(torch.int32).cumprod(dim=-1).bool() & valid).sum(dim=(0, 1)).float()  # [gamma]
        expected_accepted = runs / valid.sum(dim=(0, 1)).float()
    print(f"loss {loss.item():.6f}, reference {expected.item():.6f}, p one slot later {shifted.item():.6f}")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert abs(shifted.item() - expected.item()) > 1e-3
    torch.testing.assert_close(accepted, expected_accepted, rtol=0, atol=0, equal_nan=True)  # greedy drafts right through slot k
    loss.backward()
    assert drafter.markov_head.markov_w2.weight.grad.abs().sum() > 0 and drafter.confidence_head.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--target_ranks 1", "--drafter dspark does not train with split mode (--target_ranks 1); use --target_ranks 0 (colocated)"),
        ("--sequence_parallel_size 2", "--drafter dspark does not train with sequence parallelism (--sequence_parallel_size 2); use 1"),
        ("--loss kl", "--drafter dspark trains with its own objective"),
        ("--loss ce", "--drafter dspark trains with its own objective"),
        ("--loss_weighting dpace", "--drafter dspark does not train with --loss_weighting dpace"),
        ("--loss_normalize count", "--drafter dspark does not train with --loss_normalize count"),
        ("--context_chunk_size 64", "--drafter dspark does not train with --context_chunk_size 64"),
        ("--label_source target_argmax", "--drafter dspark does not train with --label_source target_argmax"),
        ("--markov_rank -1", "--markov_rank must be >= 0"),
        ("--markov_rank 0", "--enable_confidence_head true reads the Markov features"),
        ("--dspark_ce_weight 0 --dspark_l1_weight 0", "--dspark_ce_weight 0.0, --dspark_l1_weight 0.0"),
        ("--dspark_bce_weight -1", "--dspark_ce_weight 0.1, --dspark_l1_weight 0.9, --dspark_bce_weight -1.0: each must be >= 0"),
        ("--loss_chunk_size 0", "--loss_chunk_size must be >= 1 (rows per LM-head + loss chunk; default 4096), got 0"),
    ],
)
def test_dspark_refuses_what_it_does_not_train_with_in_one_line(flags, message, tmp_path):
    """Each refusal is one line from the settings (`parse_settings`, before anything loads), which
    the trainer prints as `error: ...` with exit status 2."""
    argv = ["--target_model", "x", "--train_data", str(DEMO_DATA), "--output_dir", str(tmp_path), "--drafter", "dspark", *flags.split()]
    with pytest.raises(ValueError) as error:
        parse_settings(argv)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_loss_dspark_needs_the_dspark_drafter_and_the_others_keep_ce(tmp_path):
    base = ["--target_model", "x", "--train_data", str(DEMO_DATA), "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"^--loss dspark is DSpark's objective: pass --drafter dspark"):
        parse_settings([*base, "--loss", "dspark"])
    assert parse_settings(base)[0].loss == "ce"
    assert parse_settings([*base, "--drafter", "dflash2"])[0].loss == "ce"
    settings = parse_settings([*base, "--drafter", "dspark", "--markov_rank", "0", "--enable_confidence_head", "false"])[0]
    assert (settings.loss, settings.markov_rank, settings.enable_confidence_head) == ("dspark", 0, False)
    settings = parse_settings([*base, "--drafter", "dspark", "--optimizer", "muon"])[0]  # its heads on AdamW (test_optimizer.py)
    assert (settings.optimizer, settings.max_grad_norm) == ("muon", 0.0)
