"""What a drafter rank of split mode holds for a Qwen3-32B-shaped target, measured on one GPU.

Writes a Qwen3-32B-shaped checkpoint (hidden 5120, 64 layers, vocab 151,936, untied head) whose
`model.safetensors.index.json` lists every tensor of the model but whose decoder-layer shard does
not exist: only the embedding shard and the LM-head shard are written, at real size (random bf16).
Then does what a drafter rank does: `load_target_embeddings` (which must not open the missing
shard), the 5-layer drafter, and --steps training steps on random context features (AdamW on fp32
master weights, DeepSpeed's bf16 scheme on one drafter rank; compiled flex attention on a GPU).
Prints one JSON line and a markdown row for BENCHMARKS.md: bytes loaded, memory after loading,
peak memory while training, ms per step.

    python experiments/gpu/drafter_rank_memory.py --out /tmp/q32                      # one H200, ~3 min with compiles
    python experiments/gpu/drafter_rank_memory.py --out /tmp/q32tiny --device cpu --tiny   # CPU smoke, seconds
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's flat modules

from dflash_bench_training import MasterWeightAdamW, make_batch
from dflash_loss import loss_weights, weighted_block_loss
from dflash_masks import block_labels, sample_anchors
from dflash_model import DFlashDraftModel
from dflash_target import SAFETENSORS_INDEX, drafter_config_for_target, load_target_embeddings, parameter_bytes

QWEN3_32B = dict(
    hidden_size=5120,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=25600,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(
    QWEN3_32B, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1000
)


def write_checkpoint_without_layers(out: Path, shape: dict) -> tuple[object, list[str]]:
    """config.json, an index naming every tensor, and only the embedding and head shards. Returns
    (config, names of the shard files the index lists but that do not exist)."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape)
    config.save_pretrained(out)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shards = {"model.embed_tokens.weight": "model-00001-of-00003.safetensors", "lm_head.weight": "model-00003-of-00003.safetensors"}
    layers_file = "model-00002-of-00003.safetensors"
    weight_map = {name: shards.get(name, layers_file) for name in skeleton.state_dict()}
    total = sum(t.numel() * 2 for t in skeleton.state_dict().values())
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    generator = torch.Generator().manual_seed(0)
    for name, filename in shards.items():
        shape_ = tuple(skeleton.state_dict()[name].shape)
        tensor = (torch.randn(shape_, generator=generator) * 0.02).to(torch.bfloat16)
        save_file({name: tensor}, str(out / filename), metadata={"format": "pt"})
    return config, [layers_file]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the checkpoint (about 3.1 GB at Qwen3-32B shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num_anchors", type=int, default=512)
    parser.add_argument("--seq_len", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--num_draft_layers", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    if args.tiny:
        args.num_anchors, args.seq_len = min(args.num_anchors, 16), min(args.seq_len, 128)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config, missing = write_checkpoint_without_layers(out, TINY if args.tiny else QWEN3_32B)
    assert all(not (out / name).exists() for name in missing)

    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    embed_tokens, lm_head = load_target_embeddings(str(out), config, dtype=dtype, device=device)
    load_s = time.perf_counter() - started
    loaded_gib = torch.cuda.memory_allocated(device) / 2**30 if on_cuda else None

    draft_config = drafter_config_for_target(config, mask_token_id=config.vocab_size - 1, num_draft_layers=args.num_draft_layers, block_size=16)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(draft_config)
    drafter.attach_target(embed_tokens, lm_head)
    for child in drafter.children():
        child.to(device=device, dtype=None if child is drafter.rotary_emb else dtype)
    drafter.compile_layers(on_cuda)
    optimizer = MasterWeightAdamW(drafter.parameters(), lr=6e-4, max_grad_norm=1.0, fused=on_cuda)
    weights = loss_weights(16, device=device)
    backend = "flex" if on_cuda else "sdpa"
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(args.steps):
        input_ids, loss_mask, features, _ = make_batch(args.batch, args.seq_len, draft_config, device, dtype)
        start = time.perf_counter()
        anchors, anchor_valid = sample_anchors(loss_mask, args.num_anchors, generator)
        hidden = drafter(features, input_ids, anchors, anchor_valid, attention_backend=backend)
        labels, label_valid = block_labels(input_ids, loss_mask, anchors, anchor_valid, 16)
        loss, _ = weighted_block_loss(hidden[:, :, 1:], lm_head.weight, labels, label_valid, weights, compiled=on_cuda)
        loss.backward()
        optimizer.step()
        if on_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = {
        "target": "tiny" if args.tiny else "Qwen3-32B shapes",
        "missing_layer_shards": missing,
        "embedding_and_head_bytes": parameter_bytes(embed_tokens, lm_head),
        "drafter_bytes": parameter_bytes(drafter),
        "load_s": round(load_s, 2),
        "memory_after_load_gib": loaded_gib,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_cuda else None,
        "ms_per_step_after_first_3": 1000 * sum(times[3:]) / max(1, len(times[3:])),
        "last_loss": loss.item(),
        "shapes": {"num_anchors": args.num_anchors, "seq_len": args.seq_len, "batch": args.batch},
        "device": str(device),
    }
    print(json.dumps(result))
    print(
        f"| drafter rank, {result['target']} | {result['embedding_and_head_bytes'] / 2**30:.2f} GiB embedding + head, "
        f"{result['drafter_bytes'] / 2**30:.2f} GiB drafter | after load {loaded_gib or 0:.2f} GiB | "
        f"peak {result['peak_memory_gib'] or 0:.2f} GiB | {result['ms_per_step_after_first_3']:.0f} ms/step |"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
