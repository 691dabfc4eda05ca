"""tau against the prompt's length, from eval_dflash.py results over tools/long_prompts.py's eval.jsonl:

    python3 tools/gpu/tau_by_length.py PROMPTS RESULTS_DIR
    python3 tools/gpu/tau_by_length.py PROMPTS RESULTS_DIR --plot results/smollm2-gsm8k-gpu/tau_by_length.png

PROMPTS: the eval.jsonl the results were measured on (each line's "length" groups its prompt).
RESULTS_DIR: eval_<run>.json (temperature 0) and eval_<run>_t0.8.json files. Prints a markdown table:
one line per run and temperature, tau at each length (tokens committed per target forward, over that
length's prompts) with the prompts' mean tokens in the header, and the longest length's tau minus the
shortest's. Draws the same numbers as RESULTS_DIR/tau_by_length.png (or --plot PATH): tau against the
prompt's mean tokens, one colour per run, solid at temperature 0, dashed at 0.8.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path


def taus_by_length(prompts: Path, results_dir: Path) -> tuple[dict[tuple[str, str], dict[int, float]], dict[int, int]]:
    """tau of every result in results_dir at every length of prompts.

    Returns ({(run, temperature): {length: tau}}, {length: the prompts' mean tokens}): temperature is
    "0" or "0.8", a length with no drafted forward in a result is left out of its dict, and a length
    no result measured has its nominal length as its mean tokens.
    """
    lengths = [json.loads(line)["length"] for line in prompts.read_text().splitlines() if line.strip()]
    groups = sorted(set(lengths))
    curves, tokens = {}, defaultdict(list)
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
        curves[run, temperature] = {g: committed[g] / forwards[g] for g in groups if forwards[g]}
    mean = {g: round(sum(tokens[g]) / len(tokens[g])) if tokens[g] else g for g in groups}
    return curves, mean


def table(curves: dict[tuple[str, str], dict[int, float]], mean: dict[int, int]) -> str:
    """The markdown table of taus_by_length's results: a row per (run, temperature), sorted."""
    groups = sorted(mean)
    lines = ["| run | temperature | " + " | ".join(f"tau at ~{mean[g]:,} tokens" for g in groups) + " | longest - shortest |"]
    lines.append("|---|---|" + "---|" * len(groups) + "---|")
    for (run, temperature), taus in sorted(curves.items()):
        drop = f"{taus[groups[-1]] - taus[groups[0]]:+.2f}" if groups[0] in taus and groups[-1] in taus else "-"
        lines.append(f"| {run} | {temperature} | " + " | ".join(f"{taus[g]:.2f}" if g in taus else "-" for g in groups) + f" | {drop} |")
    return "\n".join(lines)


def plot(curves: dict[tuple[str, str], dict[int, float]], mean: dict[int, int], path: Path):
    """Draw taus_by_length's results into the PNG at path and return the matplotlib Figure: one Line2D
    per (run, temperature) with at least one tau, in table order, x the lengths' mean prompt tokens, y
    tau; a run's lines share a colour, solid ("-") at temperature 0 and dashed ("--") at 0.8."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU machine
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    colours = {run: f"C{i}" for i, run in enumerate(sorted({run for run, _ in curves}))}
    for (run, temperature), taus in sorted(curves.items()):
        if taus:
            points = sorted((mean[g], tau) for g, tau in taus.items())
            ax.plot(*zip(*points), "-" if temperature == "0" else "--", marker="o", color=colours[run], label=f"{run}, T={temperature}")
    ax.set(xlabel="prompt tokens (mean of each length's prompts)", ylabel="held-out acceptance length tau", title="tau against prompt length")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def main(prompts: Path, results_dir: Path, plot_path: Path | None = None):
    """Print the table of results_dir's results over prompts, write the plot to plot_path (default
    results_dir/tau_by_length.png) and return its Figure (plot's)."""
    curves, mean = taus_by_length(prompts, results_dir)
    print(table(curves, mean), flush=True)  # the table first: it stands even if the plot fails
    return plot(curves, mean, plot_path or results_dir / "tau_by_length.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", type=Path, help="the eval.jsonl of tools/long_prompts.py the results were measured on")
    parser.add_argument("results_dir", type=Path, help="folder of eval_<run>.json and eval_<run>_t0.8.json")
    parser.add_argument("--plot", type=Path, default=None, help="where to write the PNG (default RESULTS_DIR/tau_by_length.png)")
    args = parser.parse_args()
    if not args.prompts.is_file():
        raise SystemExit(f"error: PROMPTS {args.prompts} is not a file: pass the eval.jsonl of tools/long_prompts.py")
    if not args.results_dir.is_dir():
        raise SystemExit(f"error: RESULTS_DIR {args.results_dir} is not a folder: pass the folder of the eval_<run>.json files")
    main(args.prompts, args.results_dir, args.plot)
