"""The table of `tools/gpu/speed_ab.sh loop`: reads OUT_DIR (steps.tsv, the regeneration logs, the training
logs, the evaluation results) and prints a BENCHMARKS.md section (date, GPU, versions, command).

    python3 tools/gpu/bench_table.py OUT_DIR
"""

import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers


def last_json(path: Path) -> dict:
    """The summary regenerate_data.py prints last (a JSON line), or {}."""
    if not path.is_file():
        return {}
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return {}
    return {}


def train_rates(run: Path) -> tuple[float | None, float | None]:
    """(median samples/s of the logged windows after the first, samples/s of the last window)."""
    log = run / "train_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    rates = [row["samples_per_s"] for row in rows if "samples_per_s" in row]
    return (statistics.median(rates[1:]) if len(rates) > 1 else None), (rates[-1] if rates else None)


def fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def main() -> None:
    out = Path(sys.argv[1])
    steps = {}
    for line in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").is_file() else []:
        name, seconds, rc = line.split("\t")
        steps[name] = (float(seconds), int(rc))
    rows = []

    def row(what, before, after, unit, note=""):
        ratio = after / before if before and after else None
        rows.append(f"| {what} | {fmt(before)} | {fmt(after)} | {fmt(ratio, '.2f')}x | {unit} | {note} |")

    before, after, serve = (last_json(out / f"regen_{k}.log") for k in ("before", "after", "serve"))
    row(
        "regeneration, greedy, <= 320 new tokens, batch 512",
        before.get("new_tokens_per_s"),
        after.get("new_tokens_per_s"),
        "new tokens/s",
        f"before: {before.get('written', '-')} replies; after: {after.get('written', '-')} replies in "
        f"{after.get('seconds', '-')} s (compile included)",
    )
    row(
        "regeneration through `transformers serve` (continuous batching) vs this script",
        serve.get("new_tokens_per_s"),
        after.get("new_tokens_per_s"),
        "new tokens/s",
        f"serve: {serve.get('written', '-')} replies, {serve.get('failed', '-')} failed, step rc {steps.get('regen_serve', ('-', '-'))[1]}",
    )
    train_before, train_after = train_rates(out / "train_before"), train_rates(out / "train_after")
    row("training, 256 anchors x 16 samples, median of 25-step windows after the first", train_before[0], train_after[0], "samples/s")
    row(
        "training, 150 steps end to end (load, tokenize, compile, train)",
        steps.get("train_before", (None,))[0],
        steps.get("train_after", (None,))[0],
        "s (lower is better)",
    )
    evals = {}
    for k in ("before", "after"):
        path = out / f"eval_{k}.json"
        evals[k] = json.loads(path.read_text()) if path.is_file() else {}
    per_prompt = {k: (sum(v["seconds"][p] for p in ("target", "speculative")) / v["num_prompts"]) if v else None for k, v in evals.items()}
    row(
        "evaluation, seconds per prompt (target-only + speculative, 256 new tokens)", per_prompt["before"], per_prompt["after"], "s (lower is better)"
    )
    for key, what in (("target_tokens_per_s", "target-only decoding"), ("speculative_tokens_per_s", "speculative decoding")):
        row(f"evaluation, {what}", evals["before"].get(key), evals["after"].get(key), "tokens/s")
    after_eval = evals["after"]
    note = ""
    if after_eval:
        note = (
            f"tau {fmt(after_eval.get('acceptance_length'), '.2f')} (before {fmt(evals['before'].get('acceptance_length'), '.2f')}), "
            f"lossless {after_eval.get('lossless')}, prompt lookup tau "
            f"{fmt(after_eval.get('baseline', {}).get('acceptance_length'), '.2f')}"
        )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"### The tools of the quality loop on one GPU: regeneration, training, evaluation ({datetime.date.today()})\n")
    print(
        f"{gpu}, torch {torch.__version__}, transformers {transformers.__version__}, SmolLM2-135M-Instruct (Q4_1 GGUF, bf16). "
        f"Command: `bash tools/gpu/speed_ab.sh loop OUT BEFORE_DIR`. {note}\n"
    )
    print("| measurement | before | after | after/before | unit | note |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nSteps (seconds, exit code): " + ", ".join(f"{k} {v[0]:.0f} s ({v[1]})" for k, v in steps.items()))


if __name__ == "__main__":
    main()
