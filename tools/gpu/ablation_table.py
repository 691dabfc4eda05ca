"""The table of tools/gpu/quality_ablations.sh: per run, held-out tau (OUT_DIR/eval_<run>.json) and the
tau estimate from training accuracy at the end (OUT_DIR/<run>/train_log.jsonl).

    python3 tools/gpu/ablation_table.py OUT_DIR
"""

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    print("| run | held-out tau | prompts | tau estimate from training accuracy | steps | training wall time (s) |\n"
          "|---|---|---|---|---|---|")
    for run in sorted(p for p in out.iterdir() if (p / "train_log.jsonl").is_file()):
        rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        last = next((r for r in reversed(rows) if "tau_estimate" in r), {})
        result = out / f"eval_{run.name}.json"
        evaluation = json.loads(result.read_text()) if result.is_file() else {}
        tau = evaluation.get("acceptance_length")
        print(f"| {run.name} | {'-' if tau is None else f'{tau:.2f}'} | {evaluation.get('num_prompts', '-')} | "
              f"{last.get('tau_estimate', float('nan')):.2f} | {last.get('step', '-')} | {last.get('elapsed_s', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
