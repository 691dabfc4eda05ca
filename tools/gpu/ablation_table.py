"""The table of tools/gpu/quality_ablations.sh and sliding_window.sh: per run, held-out tau
(OUT_DIR/eval_<run>.json, or else the last held-out evaluation in the run's own train_log.jsonl, whose
prompt count is the run's --eval_num_prompts), held-out tau at temperature 0.8 where
OUT_DIR/eval_<run>_t0.8.json exists, and the tau estimate from training (`tau_estimate`), the mean of
the last 5 logged steps (OUT_DIR/<run>/train_log.jsonl; runs with one seed log the same batches,
so their estimates compare on the same samples).

    python3 tools/gpu/ablation_table.py OUT_DIR
"""

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    print("| run | held-out tau | prompts | held-out tau, T=0.8 | tau estimate from training (last 5 logs) | steps | training wall time (s) |\n"
          "|---|---|---|---|---|---|---|")
    for run in sorted(p for p in out.iterdir() if (p / "train_log.jsonl").is_file()):
        rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        logged = [r for r in rows if "tau_estimate" in r]
        last = logged[-1] if logged else {}
        estimate = sum(r["tau_estimate"] for r in logged[-5:]) / len(logged[-5:]) if logged else float("nan")
        result = out / f"eval_{run.name}.json"
        evaluation = json.loads(result.read_text()) if result.is_file() else {}
        tau, prompts = evaluation.get("acceptance_length"), evaluation.get("num_prompts", "-")
        if tau is None:  # the held-out evaluation the training run made itself
            tau = next((r["eval_tau"] for r in reversed(rows) if "eval_tau" in r), None)
            settings = run / "final" / "training_settings.json"
            if tau is not None and settings.is_file():
                prompts = json.loads(settings.read_text()).get("eval_num_prompts", "-")
        sampled = out / f"eval_{run.name}_t0.8.json"
        tau_sampled = json.loads(sampled.read_text()).get("acceptance_length") if sampled.is_file() else None
        print(f"| {run.name} | {'-' if tau is None else f'{tau:.2f}'} | {prompts} | {'-' if tau_sampled is None else f'{tau_sampled:.2f}'} | "
              f"{estimate:.2f} | {last.get('step', '-')} | {last.get('elapsed_s', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
