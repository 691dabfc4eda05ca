"""tau against the prompt's length, from eval_dflash.py results over tools/long_prompts.py's eval.jsonl:

    python3 tools/gpu/tau_by_length.py PROMPTS RESULTS_DIR

PROMPTS: the eval.jsonl the results were measured on (each line's "length" groups its prompt).
RESULTS_DIR: eval_<run>.json (temperature 0) and eval_<run>_t0.8.json files. Prints a markdown table:
one line per run and temperature, tau at each length (tokens committed per target forward, over that
length's prompts) with the prompts' mean tokens in the header, and the longest length's tau minus the
shortest's.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(prompts: Path, results_dir: Path) -> None:
    lengths = [json.loads(line)["length"] for line in prompts.read_text().splitlines() if line.strip()]
    groups = sorted(set(lengths))
    rows, tokens = [], defaultdict(list)
    for path in sorted(results_dir.glob("eval_*.json")):
        result = json.loads(path.read_text())
        name = path.stem[len("eval_") :]
        run, temperature = (name[: -len("_t0.8")], "0.8") if name.endswith("_t0.8") else (name, "0")
        committed, forwards = defaultdict(float), defaultdict(int)
        for row in result["per_prompt"]:
            length = lengths[row["prompt_index"]]
            if row["acceptance_length"] is not None:
                committed[length] += row["acceptance_length"] * row["verify_forwards"]
                forwards[length] += row["verify_forwards"]
            tokens[length].append(row["prompt_tokens"])
        taus = {g: committed[g] / forwards[g] for g in groups if forwards[g]}
        drop = f"{taus[groups[-1]] - taus[groups[0]]:+.2f}" if groups[0] in taus and groups[-1] in taus else "-"
        rows.append(
            (run, temperature, f"| {run} | {temperature} | " + " | ".join(f"{taus[g]:.2f}" if g in taus else "-" for g in groups) + f" | {drop} |")
        )
    mean = {g: round(sum(tokens[g]) / len(tokens[g])) if tokens[g] else g for g in groups}
    print("| run | temperature | " + " | ".join(f"tau at ~{mean[g]:,} tokens" for g in groups) + " | longest - shortest |")
    print("|---|---|" + "---|" * len(groups) + "---|")
    print("\n".join(line for *_, line in sorted(rows)))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python3 tools/gpu/tau_by_length.py PROMPTS RESULTS_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
