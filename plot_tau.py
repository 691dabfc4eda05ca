"""Plot held-out acceptance length tau against training steps, or GPU minutes, for several runs.

    python plot_tau.py outputs/run_992 outputs/run_248 --output tau_vs_steps.png
    # against wall-clock minutes, counting 3.4 minutes of data regeneration before training
    python plot_tau.py outputs/recipe/train --x minutes --start_minutes 3.4 --output tau_vs_minutes.png

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


def held_out_tau(run_dir: Path, x: str = "step") -> list[tuple[float, float]]:
    """(x, eval_tau) pairs from {run_dir}/train_log.jsonl, in step order; x is "step" or
    "elapsed_s" (seconds of training so far)."""
    log = run_dir / "train_log.jsonl"
    if not log.is_file():
        raise SystemExit(f"error: {log} not found: pass train_dflash.py --output_dir folders")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    points = sorted((r["step"], r.get(x), r["eval_tau"]) for r in rows if "eval_tau" in r)
    if any(value is None for _, value, _ in points):
        raise SystemExit(f"error: {log} has no {x} for its evaluations (written by an older train_dflash.py): plot against steps")
    points = [(value, tau) for _, value, tau in points]
    if not points:
        raise SystemExit(f"error: {log} has no eval_tau: train with --eval_data (and --eval_steps N for a curve)")
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="train_dflash.py output dirs")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per run (default: the dir name)")
    parser.add_argument("--baseline", action="append", default=[], help="NAME=TAU horizontal reference line")
    parser.add_argument("--x", choices=["steps", "minutes"], default="steps", help="x axis: optimizer steps or wall-clock minutes")
    parser.add_argument(
        "--start_minutes",
        nargs="*",
        type=float,
        default=None,
        help="with --x minutes: minutes spent before each run's training (e.g. regenerating its data)",
    )
    parser.add_argument("--output", default="tau_vs_steps.png")
    args = parser.parse_args()
    if args.labels and len(args.labels) != len(args.runs):
        raise SystemExit(f"error: {len(args.labels)} --labels for {len(args.runs)} runs")
    if args.start_minutes and len(args.start_minutes) != len(args.runs):
        raise SystemExit(f"error: {len(args.start_minutes)} --start_minutes for {len(args.runs)} runs")

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, run in enumerate(args.runs):
        if args.x == "minutes":
            seconds, taus = zip(*held_out_tau(run, "elapsed_s"))
            xs = [(args.start_minutes[i] if args.start_minutes else 0.0) + s / 60 for s in seconds]
        else:
            xs, taus = zip(*held_out_tau(run))
        ax.plot(xs, taus, "o-", label=args.labels[i] if args.labels else run.name)
    for item in args.baseline:
        name, _, value = item.partition("=")
        try:
            ax.axhline(float(value), linestyle="--", color="gray")
        except ValueError:
            raise SystemExit(f"error: --baseline {item!r} is not NAME=TAU") from None
        ax.annotate(f"{name} {float(value):.2f}", (ax.get_xlim()[0], float(value)), textcoords="offset points", xytext=(4, 4))
    if args.x == "minutes":
        ax.set(
            xlabel="GPU wall-clock minutes" + (" (regeneration, then training)" if args.start_minutes else ""),
            ylabel="held-out acceptance length tau",
            title="tau vs GPU minutes",
        )
    else:
        ax.set(xlabel="optimizer step", ylabel="held-out acceptance length tau", title="tau vs training steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
