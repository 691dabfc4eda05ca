"""Targets larger than one device and runs over several nodes, on CPU over gloo.

- A drafter rank holds the target's embedding and LM head and nothing else of it: read from the
  safetensors shards through the index, it starts and trains from a hub cache whose decoder-layer
  shards are missing (the index lists them).
- A tensor-parallel target group (DeepSpeed AutoTP over 2 ranks) feeds a drafter rank the same
  features, and the drafter sees the same losses, as a colocated run; the group also runs the
  lead's held-out evaluation on the weights it received.
- Two simulated nodes (two `accelerate launch --machine_rank 0/1` on this machine, each with its
  own compile-cache root) train, checkpoint into one --output_dir and resume bit for bit; features
  never leave their node, and every sample is trained once per epoch.
"""

import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, TINY_QWEN3, free_port, launch_ranks, stop_ranks, write_qwen3_tokenizer
from conftest import run_args as tiny_run_args
from safetensors.torch import load_file

TOL = dict(rtol=1e-5, atol=1e-5)
EMBEDDING_BYTES = TINY_QWEN3["vocab_size"] * TINY_QWEN3["hidden_size"] * 4  # [vocab, hidden] fp32


def run_args(target, data, output_dir, **overrides):
    """conftest's tiny multi-rank run, one epoch, a log row every step."""
    return tiny_run_args(target, data, output_dir, **{"num_train_epochs": 1, "logging_steps": 1, **overrides})


def launch(args, env, nproc, *, machines=None, cwd=REPO_ROOT, timeout=300):
    """accelerate launch of train_dflash.py; machines=(machine_rank, num_machines, port) starts one
    node of a multi-node run (its processes are nproc / num_machines of the nproc)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO_ROOT / "accelerate_configs" / "cpu.yaml"),
        "--num_processes",
        str(nproc),
    ]
    if machines:
        machine_rank, num_machines, port = machines
        command += [
            "--num_machines",
            str(num_machines),
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
        ]
    command += [str(REPO_ROOT / "train_dflash.py"), *args]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=300):
    """Wait for all processes; returns their (returncode, output)."""
    deadline = time.time() + timeout
    results = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1, deadline - time.time()))
            results.append((proc.returncode, output))
    finally:
        stop_ranks(procs)
    return results


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def trained_rows(debug, rank):
    return [row for row in read_jsonl(f"{debug}.rank{rank}.jsonl") if "ids" in row]


# ----------------------------------------------------------------------------------------------
# Drafter ranks: the embedding and the LM head, nothing else


def save_target(path, tokenizer, **config):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(
        Qwen3Config(**{**TINY_QWEN3, "initializer_range": 0.25, **config}, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    )
    model.save_pretrained(path, max_shard_size="20MB")  # embedding, head and layers in shards of their own
    write_qwen3_tokenizer(path)
    return model


def hub_cache(root: Path, repo_id: str, files: list[Path]) -> Path:
    """A Hugging Face hub cache holding `files` as the main revision of `repo_id` (read offline)."""
    commit = "0" * 40
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in files:
        shutil.copy(file, snapshot / file.name)
    return root


@pytest.fixture(scope="module")
def deep_target_caches(tmp_path_factory, qwen3_tokenizer):
    """A 12-layer tiny Qwen3 as hub id `dflash-test/deep-qwen3` in two hub caches: the whole
    checkpoint, and one without the shards of the decoder layers (its index still lists them). Returns (repo id, whole cache, cache without layer shards, the missing shard names)."""
    root = tmp_path_factory.mktemp("deep_target")
    save_target(root / "model", qwen3_tokenizer, num_hidden_layers=12)
    weight_map = json.loads((root / "model" / "model.safetensors.index.json").read_text())["weight_map"]
    # Every shard but those of the embedding and the head: the decoder layers (and the final norm).
    layer_only = sorted(set(weight_map.values()) - {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]})
    assert layer_only and all(any("layers." in k for k, v in weight_map.items() if v == f) for f in layer_only)
    files = sorted((root / "model").iterdir())
    whole = hub_cache(root / "whole", "dflash-test/deep-qwen3", files)
    without_layers = hub_cache(root / "without_layers", "dflash-test/deep-qwen3", [f for f in files if f.name not in layer_only])
    return "dflash-test/deep-qwen3", whole, without_layers, layer_only


def test_a_drafter_rank_reads_no_layer_and_trains_without_the_layer_shards(deep_target_caches, gsm8k_path, train_env, tmp_path):
    """1 target + 1 drafter rank, started as plain processes so that each reads its own hub cache:
    the target rank the whole checkpoint, the drafter rank one whose decoder-layer shards are absent.
    The drafter rank starts, trains and exports; its parameters are exactly the target's embedding,
    the target's (untied) head and the drafter, on a target of 12 layers."""
    repo_id, whole, without_layers, missing = deep_target_caches
    out = tmp_path / "out"
    env = dict(train_env, HF_HUB_OFFLINE="1")
    args = run_args(repo_id, gsm8k_path, out, target_ranks=1, max_samples=12, target_layer_ids="1 10")
    store, procs = launch_ranks(args, env, 2, tmp_path, rank_env={0: {"HF_HUB_CACHE": str(whole)}, 1: {"HF_HUB_CACHE": str(without_layers)}})
    try:
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        stop_ranks(procs)
        del store
    logs = {rank: (tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1)}
    assert codes == [0, 0], logs[1][-3000:] + logs[0][-3000:]
    snapshot = next((without_layers / "models--dflash-test--deep-qwen3" / "snapshots").iterdir())
    assert not any((snapshot / name).exists() for name in missing), "the drafter rank's cache has no layer shard"

    held = re.search(
        r"Rank 1 holds [\d.]+ MiB \((\d+) bytes\) of parameters: the target's embedding (\d+) bytes, "
        r"its LM head (\d+) bytes, the drafter (\d+) bytes; no target decoder layer",
        logs[1],
    )
    assert held, logs[1][-3000:]
    total, embedding, head, drafter = map(int, held.groups())
    exported = load_file(out / "final" / "model.safetensors")
    assert embedding == head == EMBEDDING_BYTES
    assert drafter == sum(t.numel() * t.element_size() for t in exported.values())
    assert total == embedding + head + drafter
    rows = read_jsonl(out / "train_log.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)


def test_load_target_embeddings_tied_untied_sharded_and_one_file(tmp_path, qwen3_tokenizer):
    from transformers import AutoConfig

    from dflash_target import load_target_embeddings, target_weight_map

    untied = save_target(tmp_path / "untied", qwen3_tokenizer)  # sharded: an index and 3 files
    assert (tmp_path / "untied" / "model.safetensors.index.json").is_file()
    embed, head = load_target_embeddings(str(tmp_path / "untied"), AutoConfig.from_pretrained(tmp_path / "untied"), device="cpu")
    assert torch.equal(embed.weight, untied.model.embed_tokens.weight) and torch.equal(head.weight, untied.lm_head.weight)
    assert not embed.weight.requires_grad and head.weight is not embed.weight

    tied = save_target(tmp_path / "tied", qwen3_tokenizer, tie_word_embeddings=True)
    assert "lm_head.weight" not in target_weight_map(str(tmp_path / "tied"))
    embed, head = load_target_embeddings(str(tmp_path / "tied"), AutoConfig.from_pretrained(tmp_path / "tied"), device="cpu", dtype=torch.bfloat16)
    assert head.weight is embed.weight and embed.weight.dtype == torch.bfloat16
    assert torch.equal(embed.weight, tied.model.embed_tokens.weight.to(torch.bfloat16))

    one_file = tmp_path / "one_file"
    untied.save_pretrained(one_file)  # default shard size: one model.safetensors, no index
    assert not (one_file / "model.safetensors.index.json").exists()
    embed, head = load_target_embeddings(str(one_file), untied.config, device="cpu")
    assert torch.equal(head.weight, untied.lm_head.weight)

    # An untied head the checkpoint lacks: a clear error naming the tensor.
    (tmp_path / "headless").mkdir()
    index = json.loads((tmp_path / "untied" / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    for file in (tmp_path / "untied").iterdir():
        shutil.copy(file, tmp_path / "headless" / file.name)
    (tmp_path / "headless" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"no tensor lm_head.weight.*not tied"):
        load_target_embeddings(str(tmp_path / "headless"), untied.config, device="cpu")


def test_a_target_that_does_not_fit_names_the_flags(monkeypatch):
    from transformers import Qwen3Config

    from dflash_target import check_target_fits, estimate_target_bytes

    config = Qwen3Config(**{**TINY_QWEN3, "num_hidden_layers": 8})
    whole, per_rank = estimate_target_bytes(config, torch.bfloat16, 2)
    linear = 8 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128) * 2 + EMBEDDING_BYTES // 2  # projections + head, bf16
    assert whole - per_rank == linear // 2
    assert "per rank with --target_tp_size 1" in check_target_fits(
        config, torch.bfloat16, torch.device("cpu"), tp_size=1, ranks_per_node=8, colocated=True
    )
    # A GPU with as much free memory as the whole target (a rank may use 85% of it): two ranks per copy fit.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (whole, 2 * whole))
    with pytest.raises(ValueError, match=r"colocated mode \(--target_ranks 0\).*--target_tp_size 2 with --target_ranks 2"):
        check_target_fits(config, torch.bfloat16, torch.device("cuda", 0), tp_size=1, ranks_per_node=8, colocated=True)
    check_target_fits(config, torch.bfloat16, torch.device("cuda", 0), tp_size=2, ranks_per_node=8, colocated=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (whole // 100, 2 * whole))
    with pytest.raises(ValueError, match=r"--target_tp_size 2\).*Even 7 ranks"):
        check_target_fits(config, torch.bfloat16, torch.device("cuda", 0), tp_size=2, ranks_per_node=8, colocated=False)


def test_an_untruncated_target_stops_after_the_deepest_captured_layer(tiny_qwen3_target):
    from dflash_features import TargetFeatureExtractor
    from dflash_target import load_target

    target, _ = load_target(str(tiny_qwen3_target), device="cpu")
    calls = []
    target.model.layers[3].register_forward_hook(lambda *_: calls.append(1))
    extractor = TargetFeatureExtractor(target, [0, 2], truncate=False)
    input_ids = torch.randint(0, 1000, (2, 9))
    features = extractor(input_ids, torch.ones_like(input_ids))
    assert not calls and len(target.model.layers) == 4, "layer 3 is kept (for evaluation) but not run"
    with torch.no_grad():
        hidden = target(input_ids=input_ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hidden[1], hidden[3]], dim=-1), **TOL)
    assert calls, "the full forward still runs every layer"


# ----------------------------------------------------------------------------------------------
# Rank layout: per node, tensor-parallel groups


def layout(nodes, num_target_ranks, tp_size=1):
    """A RankLayout without process groups (those need a distributed run)."""
    from dflash_split import RankLayout

    groups = [members[i : i + tp_size] for members in nodes for i in range(0, num_target_ranks, tp_size)]
    targets = {r for g in groups for r in g}
    return RankLayout(0, sum(map(len, nodes)), nodes, groups, [r for m in nodes for r in m if r not in targets], None, None, None, None, None)


@pytest.mark.parametrize(
    "nodes, num_target_ranks, tp_size",
    [
        ([list(range(8))], 3, 1),
        ([list(range(8))], 4, 2),
        ([list(range(4)), list(range(4, 8))], 1, 1),
        ([list(range(8)), list(range(8, 16))], 4, 2),
        ([[0, 1, 2], [3, 4, 5]], 2, 2),
    ],
)
def test_features_stay_inside_their_node_and_every_target_copy_works(nodes, num_target_ranks, tp_size):
    rank_layout = layout(nodes, num_target_ranks, tp_size)
    senders = [g[0] for g in rank_layout.target_groups]
    made = {s: 0 for s in senders}
    for index in range(240):
        source = rank_layout.source_of(index)
        drafter = rank_layout.drafter_ranks[index % rank_layout.dp_world]
        assert rank_layout.node_of(source) == rank_layout.node_of(drafter), (index, source, drafter)
        assert source in rank_layout.senders_of(drafter) and drafter in rank_layout.drafters_of(source)
        made[source] += 1
    assert max(made.values()) - min(made.values()) <= 240 // len(senders) // 10 + 1, made  # an even share each
    if len(nodes) == 1 and tp_size == 1:
        assert [rank_layout.source_of(i) for i in range(50)] == [i % num_target_ranks for i in range(50)]
    assert rank_layout.target_ranks_per_node == num_target_ranks


def test_sigterm_stops_a_rank_through_its_failure_report_and_kills_its_forked_workers():
    """The launcher's SIGTERM raises StoppedByLauncher in the rank (which then reports the failure
    that came first, instead of dying silently); a process forked from the rank, such as a
    data-loading worker, still ends by SIGTERM as by default."""
    from dflash_liveness import StoppedByLauncher, stop_on_sigterm

    previous = signal.signal(signal.SIGTERM, functools.partial(stop_on_sigterm, os.getpid()))
    try:
        child = os.fork()
        if child == 0:  # the worker: inherits the handler
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(0)  # not reached when SIGTERM ends the worker
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        with pytest.raises(StoppedByLauncher, match=r"stopped by the launcher \(SIGTERM\)"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode, well before this ends
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_split_errors_name_the_flags():
    from dflash_split import check_split

    with pytest.raises(ValueError, match=r"--target_ranks 3 is not a multiple of --target_tp_size 2.*--target_ranks 2"):
        check_split(3, 2, 8)
    with pytest.raises(ValueError, match=r"--target_tp_size 2 needs target ranks.*--target_ranks 2"):
        check_split(0, 2, 8)
    with pytest.raises(ValueError, match=r"--target_ranks 4 leaves no drafter rank in each of the 2 nodes \(4 processes per node"):
        check_split(4, 1, 4, 2)
    check_split(4, 2, 8, 2)


def test_auto_counts_target_copies_of_a_tensor_parallel_group():
    from dflash_topology import choose_target_ranks

    # One 2-rank copy supplies 10 samples/s, a drafter rank takes 7: 2 copies (4 ranks) feed 4 drafter ranks best.
    n, lines = choose_target_ranks(10.0, 7.0, 8, tp_size=2)
    assert n == 4 and "N=4: 4 target (2 groups of 2) + 4 drafter ranks -> 20.00 samples/s" in "\n".join(lines)
    assert any("colocated is not an option" in line for line in lines) and not any("N=3" in line for line in lines)
    assert choose_target_ranks(50.0, 7.0, 8, tp_size=2)[0] == 2  # one copy is plenty, but N >= 2
    with pytest.raises(ValueError, match="--target_tp_size 4 leaves no drafter rank"):
        choose_target_ranks(10.0, 7.0, 4, tp_size=4)


# ----------------------------------------------------------------------------------------------
# Tensor-parallel target group vs colocated


@pytest.fixture(scope="module")
def tensor_parallel_runs(trainable_qwen3_target, gsm8k_path, train_env, train_runs, tmp_path_factory):
    """The same 9 optimizer steps (1 drafter rank) twice, at the same time: 3 ranks, --target_ranks
    auto with --target_tp_size 2 (one group of ranks 0 and 1, which is all auto can pick here), and
    one colocated process, the reference. All are forked runs of conftest's train_runs (the 3 ranks
    around a store of their own, `launch_ranks`): what is checked is the trainer's split, not the
    launcher. Held-out evaluation every 3 steps. {name: (output dir, debug log, output of every rank)}."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    common = dict(eval_data=gsm8k_path, eval_steps=3, eval_num_prompts=2, eval_max_new_tokens=8)
    started = time.time()
    tp_args = run_args(trainable_qwen3_target, gsm8k_path, root / "tp", **common, target_ranks="auto", target_tp_size=2)
    (root / "tp_logs").mkdir()
    store, tp = launch_ranks(tp_args, dict(train_env, DFLASH_DEBUG_LOG=str(root / "tp_debug")), 3, root / "tp_logs", runs=train_runs)
    colocated = train_runs.popen(
        "train_dflash.py",
        run_args(trainable_qwen3_target, gsm8k_path, root / "colocated", **common),
        env=dict(train_env, DFLASH_DEBUG_LOG=str(root / "colocated_debug")),
        merge_stderr=True,
    )
    *tp_results, colocated_result = finish([*tp, colocated])
    del store
    print(f"both runs: {time.time() - started:.0f} s")
    results = {"tp": (next((code for code, _ in tp_results if code), 0), "".join(output for _, output in tp_results)), "colocated": colocated_result}
    runs = {}
    for name, (code, output) in results.items():
        assert code == 0, output[-4000:]
        runs[name] = (root / name, root / f"{name}_debug", output)
    return runs


def test_a_tensor_parallel_group_feeds_the_same_features_and_losses_as_colocated(tensor_parallel_runs):
    (tp_out, tp_debug, tp_log), (co_out, co_debug, _) = tensor_parallel_runs["tp"], tensor_parallel_runs["colocated"]
    assert "--target_ranks auto over 3 ranks, tensor-parallel groups of 2" in tp_log
    assert "N=2: 2 target (1 groups of 2) + 1 drafter ranks" in tp_log and "=> --target_ranks 2" in tp_log
    assert "Split mode: target ranks [0, 1] (tensor-parallel groups [[0, 1]]) feed drafter ranks [2]; rank 2 leads" in tp_log
    # Rank 0 holds its slices: half of every projection of the 4 decoder layers, all of the rest.
    # (AutoTP splits the head's hidden dimension in grains of 64, its tp_grain_size: at hidden 64
    # the whole head falls to rank 0; at real sizes each rank gets its share.)
    share = re.search(r"Rank 0 holds (\d+) bytes of the target's parameters \((\d+) in all", tp_log)
    projections = 4 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128) * 4  # fp32
    assert share and int(share.group(2)) - int(share.group(1)) == projections // 2, share.group(0)
    assert "Rank 2 holds" in tp_log and "no target decoder layer" in tp_log  # the rank outside the group loaded no target

    tp_rows, co_rows = trained_rows(tp_debug, 2), trained_rows(co_debug, 0)
    assert len(tp_rows) == len(co_rows) == 9
    for tp_row, co_row in zip(tp_rows, co_rows):
        assert tp_row["ids"] == co_row["ids"] and tp_row["source"] == 0
        torch.testing.assert_close(
            torch.tensor(tp_row["features"], dtype=torch.float64), torch.tensor(co_row["features"], dtype=torch.float64), rtol=1e-6, atol=1e-2
        )
        assert tp_row["loss"] == pytest.approx(co_row["loss"], rel=1e-5)
    tp_weights, co_weights = load_file(tp_out / "final" / "model.safetensors"), load_file(co_out / "final" / "model.safetensors")
    for name in co_weights:
        torch.testing.assert_close(tp_weights[name], co_weights[name], rtol=1e-4, atol=1e-5)


def test_split_evaluation_runs_on_the_target_group_with_the_leads_weights(tensor_parallel_runs):
    tp_out, tp_debug, _ = tensor_parallel_runs["tp"]
    final = [row["weights_sha256"] for row in read_jsonl(f"{tp_debug}.rank2.jsonl") if "weights_sha256" in row]
    for rank in (0, 1):  # both ranks of the group received the weights and evaluated in lockstep
        received = [row["eval_weights_sha256"] for row in read_jsonl(f"{tp_debug}.rank{rank}.jsonl")]
        assert len(received) == 3 and received[-1] == final[0] and len(set(received)) == 3
    evaluated = [row for row in read_jsonl(tp_out / "train_log.jsonl") if "eval_tau" in row]
    colocated = [row for row in read_jsonl(tensor_parallel_runs["colocated"][0] / "train_log.jsonl") if "eval_tau" in row]
    assert [row["step"] for row in evaluated] == [row["step"] for row in colocated] == [3, 6, 9]
    assert all(1.0 <= row["eval_tau"] <= 8 and row["eval_tokens_per_s"] > 0 for row in evaluated)


# ----------------------------------------------------------------------------------------------
# Two nodes


def two_nodes(args, env, root, name, cwd=(REPO_ROOT, REPO_ROOT)):
    """Both nodes of a 4-process run (2 per node), each with its own compile cache and dataset
    cache (node-local disks). Returns [(returncode, output)] of nodes 0 and 1."""
    port = free_port()
    procs = []
    for node in (0, 1):
        node_env = dict(
            env, TORCHINDUCTOR_CACHE_DIR=str(root / f"{name}_node{node}_compile"), HF_DATASETS_CACHE=str(root / f"{name}_node{node}_datasets")
        )
        procs.append(launch(args, node_env, 4, machines=(node, 2, port), cwd=cwd[node]))
    return finish(procs)


@pytest.fixture(scope="module")
def two_node_run(trainable_qwen3_target, gsm8k_path, train_env, tmp_path_factory):
    """Per node 1 target rank + 1 drafter rank; 2 epochs of 5 optimizer steps, a checkpoint every 3."""
    root = tmp_path_factory.mktemp("two_nodes")
    env = dict(train_env, DFLASH_DEBUG_LOG=str(root / "debug"))
    started = time.time()
    args = run_args(trainable_qwen3_target, gsm8k_path, root / "out", target_ranks=1, num_train_epochs=2, save_steps=3)
    results = two_nodes(args, env, root, "straight")
    print(f"two-node run: {time.time() - started:.0f} s")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    return root, results


def test_two_nodes_keep_features_local_and_train_every_sample_once(two_node_run):
    root, [(_, node0), (_, node1)] = two_node_run
    assert ("Split mode: node 0: target ranks [0] feed drafter ranks [1]; node 1: target ranks [2] feed drafter ranks [3]; rank 1 leads") in node0
    for node, output in ((0, node0), (1, node1)):  # each node compiles into its own cache root
        roots = set(re.findall(r"compile cache \(shared\): inductor (\S+),", output))
        assert roots == {str((root / f"straight_node{node}_compile").resolve())}, roots
    rows = {rank: trained_rows(root / "debug", rank) for rank in (1, 3)}
    assert {row["source"] for row in rows[1]} == {0} and {row["source"] for row in rows[3]} == {2}
    for epoch in (0, 1):
        trained = sorted(i for rank in (1, 3) for row in rows[rank] if row["epoch"] == epoch for i in row["ids"])
        assert trained == list(range(18)), f"epoch {epoch}: each sample exactly once across the nodes"
    digests = {rank: [r["weights_sha256"] for r in read_jsonl(f"{root / 'debug'}.rank{rank}.jsonl") if "weights_sha256" in r] for rank in (1, 3)}
    assert digests[1] == digests[3] and len(digests[1]) == 1
    checkpoint = root / "out" / "checkpoint-3"
    shards = sorted(p.name for p in (checkpoint / "deepspeed").glob("*optim_states.pt"))
    assert len(shards) == 2, shards  # ZeRO-2 optimizer shards from the drafter ranks of both nodes
    assert sorted(p.name for p in checkpoint.glob("rng_state_*")) == ["rng_state_0.pt", "rng_state_1.pt"]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["target_ranks"] == 1


def test_two_nodes_resume_bit_identical(two_node_run, trainable_qwen3_target, gsm8k_path, train_env):
    root, _ = two_node_run
    env = dict(train_env, DFLASH_DEBUG_LOG=str(root / "resumed_debug"))
    args = run_args(
        trainable_qwen3_target,
        gsm8k_path,
        root / "resumed",
        target_ranks=1,
        num_train_epochs=2,
        save_steps=3,
        resume_from_checkpoint=root / "out" / "checkpoint-3",
    )
    results = two_nodes(args, env, root, "resumed")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    straight, resumed = load_file(root / "out" / "final" / "model.safetensors"), load_file(root / "resumed" / "final" / "model.safetensors")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    for rank in (1, 3):
        assert trained_rows(root / "resumed_debug", rank) == trained_rows(root / "debug", rank)[3:]


def test_two_nodes_refuse_an_output_dir_they_do_not_share(trainable_qwen3_target, gsm8k_path, train_env, tmp_path):
    """A relative --output_dir, with the nodes started in different directories, is two directories."""
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    args = run_args(trainable_qwen3_target, gsm8k_path, "out", target_ranks=1)
    results = two_nodes(args, train_env, tmp_path, "unshared", cwd=(tmp_path / "node0", tmp_path / "node1"))
    for code, output in results:
        assert code != 0
        assert "--output_dir out is not shared between the nodes: node(s) [1] cannot see a file that node 0 wrote" in output, output[-3000:]
