"""Plot held-out acceptance length tau against training steps for several runs (one line each).

    python plot_tau.py outputs/run_992 outputs/run_248 --output tau_vs_steps.png

Each argument is a train_dflash.py --output_dir trained with --eval_data: its train_log.jsonl
holds the held-out tau of every --eval_steps. A line is labelled with the run's training
samples (from the log's setup line, training_settings.json of its last checkpoint, or the
directory name) so runs on different amounts of data compare at equal steps. An optional
--baseline NAME=TAU (repeatable) draws a horizontal reference, e.g. prompt lookup's tau.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def held_out_tau(run_dir: Path) -> list[tuple[int, float]]:
    """(step, eval_tau) pairs from {run_dir}/train_log.jsonl, in step order."""
    log = run_dir / "train_log.jsonl"
    if not log.is_file():
        raise SystemExit(f"error: {log} not found: pass train_dflash.py --output_dir folders")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    points = sorted((r["step"], r["eval_tau"]) for r in rows if "eval_tau" in r)
    if not points:
        raise SystemExit(f"error: {log} has no eval_tau: train with --eval_data (and --eval_steps N for a curve)")
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="train_dflash.py output dirs")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per run (default: the dir name)")
    parser.add_argument("--baseline", action="append", default=[], help="NAME=TAU horizontal reference line")
    parser.add_argument("--output", default="tau_vs_steps.png")
    args = parser.parse_args()
    if args.labels and len(args.labels) != len(args.runs):
        raise SystemExit(f"error: {len(args.labels)} --labels for {len(args.runs)} runs")

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, run in enumerate(args.runs):
        steps, taus = zip(*held_out_tau(run))
        ax.plot(steps, taus, "o-", label=args.labels[i] if args.labels else run.name)
    for item in args.baseline:
        name, _, value = item.partition("=")
        try:
            ax.axhline(float(value), linestyle="--", color="gray")
        except ValueError:
            raise SystemExit(f"error: --baseline {item!r} is not NAME=TAU") from None
        ax.annotate(f"{name} {float(value):.2f}", (ax.get_xlim()[0], float(value)), textcoords="offset points", xytext=(4, 4))
    ax.set(xlabel="optimizer step", ylabel="held-out acceptance length tau", title="tau vs training steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
