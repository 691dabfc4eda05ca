"""The table of tools/gpu/quality_ablations.sh and experiments/gpu/sliding_window.sh: per run, held-out tau
(OUT_DIR/eval_<run>.json, or else the last held-out evaluation in the run's own train_log.jsonl, whose
prompt count is the run's --eval_num_prompts), held-out tau at temperature 0.8 where
OUT_DIR/eval_<run>_t0.8.json exists, and the tau estimate from training (`tau_estimate`), the mean of
the last 5 logged steps (OUT_DIR/<run>/train_log.jsonl; runs with one seed log the same batches,
so their estimates compare on the same samples).

    python3 tools/gpu/ablation_table.py OUT_DIR

With --runs, the table of tools/gpu/optimizer_ablation.sh: per run folder OUT_DIR/RUN (a
speculators_compare.sh output with one row), held-out tau at T=0 and T=0.8 (sampled drafts, and the
argmax proposal where OUT_DIR/RUN/eval_argmax_t0.8.json exists), acceptance by position at T=0, how the
T=0 outputs compare with plain greedy decoding (identical / diverging at near-ties / otherwise; and in
float32 where OUT_DIR/RUN/eval_fp32_t0.json exists), training minutes and peak GB (its results.json); then each
later run paired by question against the first (the mean of the per-question tau differences, its standard error,
and on how many questions the later run is ahead), at T=0 and T=0.8. A RUN may be a path to another run's folder
(an earlier machine's output):

    python3 tools/gpu/ablation_table.py --runs OUT_DIR RUN [RUN ...]
"""

import json
import math
import statistics
import sys
from pathlib import Path


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def tau(evaluation: dict) -> str:
    value = evaluation.get("acceptance_length")
    return "-" if value is None else f"{value:.2f}"


def compared(evaluation: dict) -> str:
    """'identical / near-tie / other' divergences from plain greedy decoding at T=0."""
    if evaluation.get("identical_prompts") is None:
        return "-"
    return f"{evaluation['identical_prompts']} / {evaluation['near_tie_divergences']} / {evaluation['other_divergences']}"


def run_folder(out: Path, run: str) -> Path:
    """OUT_DIR/RUN, or RUN itself where that is a folder and OUT_DIR/RUN is not (a path from the working directory)."""
    return Path(run) if Path(run).is_dir() and not (out / run).is_dir() else out / run


def evaluation_of(out: Path, run: str, temperature: str) -> dict:
    """A run's evaluation at T=temperature ("0" or "0.8"): speculators' rows name it after the row, ours after ours_best."""
    folder = run_folder(out, run)
    row = folder.name if folder.name.startswith("spec_") else "ours_best"
    return read(folder / f"eval_{row}_t{temperature}.json")


def paired(first: dict, other: dict) -> str:
    """'+d +- se (ahead on k of n)': per-question tau differences other - first on the questions both evaluated."""
    taus = [{r["prompt_index"]: r["acceptance_length"] for r in e.get("per_prompt", [])} for e in (first, other)]
    shared = sorted(set(taus[0]) & set(taus[1]))
    if len(shared) < 2:
        return "-"
    diffs = [taus[1][q] - taus[0][q] for q in shared]
    error = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return f"{statistics.mean(diffs):+.2f} +- {error:.2f} (ahead on {sum(d > 0 for d in diffs)} of {len(diffs)})"


def runs_table(out: Path, runs: list[str]) -> None:
    print(
        "| run | tau T=0 | tau T=0.8 | T=0.8 argmax | acceptance by position, T=0 (1-8) | vs greedy: identical / near-tie / other "
        "(bf16; fp32) | training min | peak GB |\n|---|---|---|---|---|---|---|---|"
    )
    for run in runs:
        folder = run_folder(out, run)
        if not folder.is_dir():
            print(f"ablation_table.py: no run folder {folder} (nor {run} from here): its row stays empty", file=sys.stderr)
        greedy, sampled = evaluation_of(out, run, "0"), evaluation_of(out, run, "0.8")
        fp32 = read(folder / "eval_fp32_t0.json")
        rates = greedy.get("acceptance_rate_by_position") or []
        numbers = next(iter(read(folder / "results.json").get("rows", [])), {})
        minutes, peak = numbers.get("train_minutes"), numbers.get("peak_memory_gb")
        print(
            f"| {Path(run).name} | {tau(greedy)} | {tau(sampled)} | {tau(read(folder / 'eval_argmax_t0.8.json'))} | "
            f"{' '.join(f'{r:.2f}'.lstrip('0') for r in rates[:8]) or '-'} | {compared(greedy)}; {compared(fp32)} | "
            f"{'-' if minutes is None else f'{minutes:.1f}'} | {'-' if peak is None else f'{peak:.1f}'} |"
        )
    if len(runs) > 1:
        print(f"\n| paired by question against {Path(runs[0]).name} | T=0 | T=0.8 |\n|---|---|---|")
        for run in runs[1:]:
            cells = [paired(evaluation_of(out, runs[0], t), evaluation_of(out, run, t)) for t in ("0", "0.8")]
            print(f"| {Path(run).name} | {cells[0]} | {cells[1]} |")


def main() -> None:
    if sys.argv[1] == "--runs":
        return runs_table(Path(sys.argv[2]), sys.argv[3:])
    out = Path(sys.argv[1])
    print(
        "| run | held-out tau | prompts | held-out tau, T=0.8 | tau estimate from training (last 5 logs) | steps | training wall time (s) |\n"
        "|---|---|---|---|---|---|---|"
    )
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
        print(
            f"| {run.name} | {'-' if tau is None else f'{tau:.2f}'} | {prompts} | {'-' if tau_sampled is None else f'{tau_sampled:.2f}'} | "
            f"{estimate:.2f} | {last.get('step', '-')} | {last.get('elapsed_s', float('nan')):.0f} |"
        )


if __name__ == "__main__":
    main()
