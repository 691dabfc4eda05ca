"""The table of tools/gpu/quality_ablations.sh: held-out tau of every run (and the base run's tau at
each evaluation), from OUT_DIR/<run>/train_log.jsonl.

    python3 tools/gpu/ablation_table.py OUT_DIR
"""

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    print("| run | held-out tau (100 questions) | tau estimate from training accuracy | steps | wall time (s) |\n|---|---|---|---|---|")
    for run in sorted(p for p in out.iterdir() if (p / "train_log.jsonl").is_file()):
        rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        held_out = [(r["step"], r["eval_tau"]) for r in rows if "eval_tau" in r]
        train = [r for r in rows if "tau_estimate" in r]
        taus = " / ".join(f"{tau:.2f} (step {step})" for step, tau in held_out) or "-"
        last = train[-1] if train else {}
        print(f"| {run.name} | {taus} | {last.get('tau_estimate', float('nan')):.2f} | {last.get('step', '-')} | "
              f"{last.get('elapsed_s', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
