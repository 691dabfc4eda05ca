"""Check train_dflash.py's --fused_loss libraries (Liger Kernel, Cut Cross-Entropy) against the reference
kernels of dflash_loss_kernels.py: the DFlash loss and its gradient with respect to the drafter's hidden states (the
LM head is the target's, frozen: no weight gradient), at SmolLM2-135M and Qwen3-8B shapes, in bf16.

    python tools/gpu/fused_loss_check.py                  # GPU: both shapes, every path (~1 min on an H100)
    python tools/gpu/fused_loss_check.py --shapes smollm2
    python tools/gpu/fused_loss_check.py --tiny           # CPU (or GPU): tiny shapes, seconds; off CUDA the library rows are skipped

The libraries are not in requirements.txt (GPU only, Triton): `pip install liger-kernel cut-cross-entropy`;
a machine without internet takes them as wheels (.whl/, tools/gpu/setup.sh).

For each shape and case (exp weights; D-PACE weights; exp weights under a logit cap of 5, which binds), every
path (reference: `weighted_block_loss` with fused_loss="none"; liger; cce) computes the loss, its gradient
and the per-position acceptance in --dtype, with DFlash2's top-K (K = 16) asked for as in training.
The loss and gradient are compared with the truth: the reference computed in float32 from the same
(rounded) inputs. The acceptance (argmax hits) is compared with the reference in --dtype: in bf16 the
logits tie often enough that an argmax against float32 logits would flip a few per cent of them.
Columns: the loss; |loss - truth| / |truth|; ||grad - truth|| / ||truth|| over all hidden states; the
largest difference of the per-position acceptance (a share of blocks); whether the top-K ids equal a
second pass through the head (`top_k_candidates`) in --dtype; fwd+bwd ms (median of 3, after a warm-up
call that also autotunes the libraries) and peak memory above the inputs (CUDA).

Tolerances (TOLERANCES): bf16: loss 5e-3 relative, gradient 2e-2 relative (norm), acceptance 0.01 (5
blocks of 512); float32: 1e-5, 1e-4, 0. The reference in bf16 must meet the first two too, which shows
what bf16 itself costs. Cut Cross-Entropy's gradient filter (blocks of softmax below 2^-12 skipped, its
default, which train_dflash.py keeps) is what its gradient error measures. The top-K ids must be equal.
Exits 1 when any row misses a tolerance (its row says which), 0 otherwise; a skipped row says why.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_loss import loss_weights, weighted_block_loss  # noqa: E402  (the repository root, on the path above)
from dflash_loss_kernels import FUSED_LOSSES, resolve_fused_loss, top_k_candidates  # noqa: E402

# name -> (hidden, vocab, anchors, block size, rows per loss chunk). 512 anchors x 15 positions = 7,680 label rows.
SHAPES = {
    "smollm2": (576, 49152, 512, 16, 4096),
    "qwen3-8b": (4096, 151936, 512, 16, 4096),
    "tiny": (32, 300, 128, 6, 64),  # chunks of 64 rows: some blocks straddle two
}
TOLERANCES = {torch.bfloat16: {"loss": 5e-3, "grad": 2e-2, "accepted": 0.01}, torch.float32: {"loss": 1e-5, "grad": 1e-4, "accepted": 0.0}}
CASES = (
    ("exp", None),
    ("dpace", None),
    ("exp", 5.0),
)  # (loss weighting, final logit softcap): 5 binds on logits of std 2, 30 (Gemma 2's) barely would
TOP_K = 16  # DFlash2's selector_top_k


def make_inputs(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random hidden states [1, N, B-1, hidden] and head [vocab, hidden] in `dtype`, logits of std ~2; labels
    the argmax at half the positions (a drafter that is often right) and random elsewhere; ~10% invalid."""
    hidden_size, vocab, anchors, block_size, chunk_size = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(1, anchors, block_size - 1, hidden_size, generator=g, device=device).to(dtype)
    head = (torch.randn(vocab, hidden_size, generator=g, device=device) * (2.0 / hidden_size**0.5)).to(dtype)
    argmax = top_k_candidates(hidden.flatten(0, 2), head, 1, chunk_size)[:, 0].view(hidden.shape[:-1])  # [1, N, B-1]
    random_ids = torch.randint(0, vocab, argmax.shape, generator=g, device=device)
    labels = torch.where(torch.rand(argmax.shape, generator=g, device=device) < 0.5, argmax, random_ids)
    valid = torch.rand(argmax.shape, generator=g, device=device) > 0.1
    top_k = min(TOP_K, vocab)
    return dict(
        hidden=hidden, head=head, labels=labels, valid=valid, weights=loss_weights(block_size, device=device), chunk_size=chunk_size, top_k=top_k
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_path(inputs: dict, path: str, weighting: str, softcap: float | None, dtype: torch.dtype, top_k: int) -> dict:
    """One fwd+bwd of `weighted_block_loss` through `path` with the inputs in `dtype`: loss, grad, accepted, top-K ids."""
    hidden = inputs["hidden"].to(dtype).detach().requires_grad_(True)
    loss, accepted, *top_ids = weighted_block_loss(
        hidden,
        inputs["head"].to(dtype),
        inputs["labels"],
        inputs["valid"],
        inputs["weights"],
        inputs["chunk_size"],
        final_logit_softcapping=softcap,
        loss_weighting=weighting,
        fused_loss=path,
        top_k=top_k,
    )
    loss.backward()
    return dict(loss=loss.detach().float(), grad=hidden.grad.float(), accepted=accepted, top_ids=top_ids[0] if top_k else None)


def timed(inputs: dict, path: str, weighting: str, softcap: float | None, dtype: torch.dtype, reps: int) -> tuple[float, float | None]:
    """(median fwd+bwd ms of `reps` calls, peak GB above what was allocated before them, CUDA only)."""
    device = inputs["hidden"].device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        run_path(inputs, path, weighting, softcap, dtype, inputs["top_k"])
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - before) / 1e9 if device.type == "cuda" else None
    return statistics.median(times), peak


def compare(result: dict, truth: dict, reference: dict, inputs: dict, dtype: torch.dtype) -> tuple[dict, list[str]]:
    """The row's errors (loss and gradient against the float32 truth, the acceptance against the reference in
    `dtype`) and the names of the tolerances it misses ('top-K' if its ids are not the two-pass ones)."""
    errors = {
        "loss": (abs(result["loss"] - truth["loss"]) / truth["loss"].abs().clamp(min=1e-12)).item(),
        "grad": ((result["grad"] - truth["grad"]).norm() / truth["grad"].norm().clamp(min=1e-12)).item(),
        "accepted": torch.nan_to_num(result["accepted"] - reference["accepted"]).abs().max().item(),
    }
    missed = [name for name, value in errors.items() if not value <= TOLERANCES[dtype][name]]  # NaN misses too
    b, n, k = inputs["valid"].nonzero().unbind(1)
    rows = inputs["hidden"].to(dtype)[b, n, k]  # [T, hidden]
    two_pass = top_k_candidates(rows, inputs["head"].to(dtype), inputs["top_k"], inputs["chunk_size"])
    errors["top_k_same"] = torch.equal(result["top_ids"], two_pass)
    if not errors["top_k_same"]:
        missed.append("top-K")
    return errors, missed


def check_shape(shape: str, device: torch.device, dtype: torch.dtype, paths: list[str], reps: int) -> tuple[list[str], int]:
    """The table rows of one shape and the number of rows that missed a tolerance."""
    inputs = make_inputs(shape, device, dtype)
    lines, failures = [], 0
    for weighting, softcap in CASES:
        case = weighting + (f", cap {softcap:g}" if softcap else "")
        truth = run_path(inputs, "none", weighting, softcap, torch.float32, 0)
        reference = run_path(inputs, "none", weighting, softcap, dtype, 0)
        for path in paths:
            label = "reference" if path == "none" else path
            try:
                runs_as = resolve_fused_loss(path, device)
            except ValueError as error:  # on CUDA, the library is not installed
                lines.append(f"| {shape} | {case} | {label} | skipped: {error} |" + " |" * 7)
                continue
            if runs_as != path:
                lines.append(f"| {shape} | {case} | {label} | skipped: CUDA only (Triton kernels); the trainer runs the reference here |" + " |" * 7)
                continue
            try:
                result = run_path(inputs, path, weighting, softcap, dtype, inputs["top_k"])  # the warm-up call (and autotuning)
            except ValueError as error:  # a combination the path refuses (cce in float32)
                lines.append(f"| {shape} | {case} | {label} | skipped: {error} |" + " |" * 7)
                continue
            errors, missed = compare(result, truth, reference, inputs, dtype)
            ms, peak = timed(inputs, path, weighting, softcap, dtype, reps)
            failures += bool(missed)
            lines.append(
                f"| {shape} | {case} | {label} | {result['loss'].item():.5f} | {errors['loss']:.2e} | {errors['grad']:.2e} | "
                f"{errors['accepted']:.4f} | {'same' if errors['top_k_same'] else 'DIFFERENT'} | {ms:.1f} | "
                f"{'-' if peak is None else f'{peak:.2f}'} | {'ok' if not missed else 'MISMATCH: ' + ', '.join(missed)} |"
            )
    return lines, failures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes only (hidden 32, vocab 300): the CPU smoke run")
    parser.add_argument("--shapes", default="smollm2,qwen3-8b", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--paths", default=",".join(FUSED_LOSSES), help="comma list of " + ", ".join(FUSED_LOSSES) + " (none: the reference)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    paths = args.paths.split(",")
    unknown = [name for name in shapes if name not in SHAPES] + [name for name in paths if name not in FUSED_LOSSES]
    if unknown:
        parser.error(f"unknown shape or path {', '.join(unknown)}; shapes: {', '.join(SHAPES)}; paths: {', '.join(FUSED_LOSSES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; pass --device cpu --tiny")
    if device.type == "cpu" and not args.tiny:
        parser.error("off CUDA only --tiny runs (the real shapes take minutes on a CPU and the libraries need CUDA)")
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{gpu}, torch {torch.__version__}, {args.dtype}; tolerances {TOLERANCES[dtype]}, top-K {TOP_K} (tiny: min(K, vocab))", flush=True)
    print(
        "| shape | case | path | loss | loss rel err | grad rel err | acceptance max diff vs reference | top-K vs two-pass | ms fwd+bwd | peak GB | result |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for shape in shapes:
        lines, failed = check_shape(shape, device, dtype, paths, reps=3 if device.type == "cuda" else 1)
        failures += failed
        print("\n".join(lines), flush=True)
    print(f"{failures} row(s) missed a tolerance" if failures else "every row that ran is within tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
