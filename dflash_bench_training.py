"""A drafter training step without DeepSpeed or data, as the benchmarks run it: random full-length
rows (`make_batch`) and AdamW on fp32 master weights (`MasterWeightAdamW`, DeepSpeed's bf16 scheme
on one rank, unsharded). bench_dflash.py times its steps with them, and
experiments/gpu/drafter_rank_memory.py measures a drafter rank's memory.

Also what bench_dflash.py times: a step's levers (`Variant`, read from a name by `parse_variant`:
compiled layers, the loss's form and chunk size, the objective, the memory levers, --fused_loss),
the step as train_dflash.py runs it (`drafter_step`, its phases marked by a `PhaseClock`), one
variant at one shape warmed up and timed (`bench_drafter_config`) and, for --profile, a few of its
steps under torch.profiler (`profile_steps`), and the target's feature forward timed (`bench_target`).
"""

import gc
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash2_model import DFlash2Config, DFlash2DraftModel, selector_predecessor_ids
from dflash_compile import get_compiled_flex_attention, warm_up_flex_attention
from dflash_flops import drafter_step_flops, target_forward_flops
from dflash_loss import block_target_hidden, chunked_dspark_loss, loss_weights, selector_objective, weighted_block_loss
from dflash_loss_kernels import LOSSES, check_fused_loss, resolve_fused_loss
from dflash_masks import block_labels, create_anchor_block_mask, sample_anchors
from dflash_model import DFlashConfig, DFlashDraftModel
from dspark_model import DSparkConfig, DSparkDraftModel, dspark_block_labels, markov_predecessor_ids


def make_batch(batch: int, seq_len: int, config: DFlashConfig, device, dtype, with_features: bool = True, with_target_hidden: bool = False):
    """Random full-length rows: input_ids [batch, S] (any id but the mask token), loss_mask [batch, S] (prompt = first
    S/8), features [batch, S, 5*hidden], and the target's last hidden state [batch, S, hidden] for the distribution
    losses (else None)."""
    input_ids = torch.randint(0, config.vocab_size - 1, (batch, seq_len), device=device)
    input_ids += input_ids >= config.mask_token_id  # [batch, S]: the ids past the mask token move up by one
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    loss_mask[:, seq_len // 8 :] = True
    features = target_hidden = None
    if with_features:
        features = torch.randn(batch, seq_len, len(config.target_layer_ids) * config.hidden_size, device=device, dtype=dtype)
    if with_target_hidden:
        target_hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=dtype)
    return input_ids, loss_mask, features, target_hidden


# ----------------------------------------------------------------------------------------------
# Optimizer: DeepSpeed's bf16 scheme without sharding


class MasterWeightAdamW:
    """AdamW on fp32 master copies of low-precision params, with grad clipping (the paper's recipe: bf16 params, fp32 master weights).

    fp32 params (CPU) are stepped directly. State per trainable param: fp32 master + fp32 grad +
    2 fp32 Adam moments = 16 bytes, which ZeRO-2 shards over the drafter ranks.
    """

    def __init__(self, params, lr: float, max_grad_norm: float, fused: bool):
        self.params = [p for p in params if p.requires_grad]
        self.has_master = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float() for p in self.params] if self.has_master else self.params
        if self.has_master:
            for m in self.master:
                m.grad = torch.zeros_like(m)
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0, fused=fused)

    @torch.no_grad()
    def step(self) -> None:
        if self.has_master:
            torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
        torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        if self.has_master:
            torch._foreach_copy_(self.params, self.master)
        self.zero_grad()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


# ----------------------------------------------------------------------------------------------
# Variants: the levers of a drafter step


def fused_dflash_loss(hidden, head_weight, labels, label_valid, weights, chunk_size=4096, compiled=False, **objective):
    """`dflash_loss.weighted_block_loss` (the fused form, gradient in the forward), optionally with the
    per-chunk elementwise work compiled (`dflash_loss_kernels.compiled_ce_grad_chunk`, as in training).
    objective: weighted_block_loss's loss / target_hidden / loss_weighting keywords."""
    return weighted_block_loss(hidden, head_weight, labels, label_valid, weights, chunk_size, compiled=compiled, **objective)


@dataclass(frozen=True)
class Variant:
    """The levers one benchmarked drafter step runs with; `parse_variant` reads them from a name."""

    name: str
    compile_layers: bool = False
    loss: str = "chunked"  # chunked (weighted_block_loss) | fused | fused_compiled
    chunk_size: int = 4096
    objective: str = "ce"  # weighted_block_loss's loss: ce | kl | tv | nla | lk
    weighting: str = "exp"  # weighted_block_loss's loss_weighting: exp | dpace
    context_chunk: int = 0  # DFlashDraftModel.chunk_context (0: the context path in one piece)
    checkpoint_layers: bool = False  # DFlashDraftModel.checkpoint_layers
    fused_loss: str = "none"  # weighted_block_loss's fused_loss: none | liger | cce


def parse_variant(name: str) -> Variant:
    """'compile_layers+fused_ce_compiled' -> Variant(...). Levers: baseline, compile_layers, loss_chunk_N, fused_ce,
    fused_ce_compiled, loss_<one of dflash_loss_kernels.LOSSES>, dpace."""
    fields = {
        "compile_layers": False,
        "loss": "chunked",
        "chunk_size": 4096,
        "objective": "ce",
        "weighting": "exp",
        "context_chunk": 0,
        "checkpoint_layers": False,
        "fused_loss": "none",
    }
    for lever in name.split("+"):
        if lever == "baseline":
            continue
        elif lever.startswith("loss_") and lever[len("loss_") :] in LOSSES:
            fields["objective"] = lever[len("loss_") :]
        elif lever == "dpace":
            fields["weighting"] = "dpace"
        elif lever.startswith("fused_loss_"):  # the name is checked below
            fields["fused_loss"] = lever[len("fused_loss_") :]
        elif lever == "compile_layers":
            fields["compile_layers"] = True
        elif lever.startswith("loss_chunk_") and lever[len("loss_chunk_") :].isdigit():
            fields["chunk_size"] = int(lever[len("loss_chunk_") :])
        elif lever.startswith("context_chunk_") and lever[len("context_chunk_") :].isdigit():
            fields["context_chunk"] = int(lever[len("context_chunk_") :])
        elif lever == "checkpoint_layers":
            fields["checkpoint_layers"] = True
        elif lever == "fused_ce":
            fields["loss"] = "fused"
        elif lever == "fused_ce_compiled":
            fields["loss"] = "fused_compiled"
        else:
            raise ValueError(
                f"--variant {name!r}: unknown lever {lever!r}; use baseline, compile_layers, loss_chunk_N, fused_ce, "
                f"fused_ce_compiled, {', '.join('loss_' + loss for loss in LOSSES)}, dpace, context_chunk_N, checkpoint_layers, "
                f"fused_loss_liger, fused_loss_cce, joined by '+'"
            )
    check_fused_loss(fields["fused_loss"], fields["objective"])
    return Variant(name=name, **fields)


def loss_fn(variant: Variant):
    """The variant's loss: (hidden, head_weight, labels, label_valid, weights, chunk_size=, **objective) -> (loss, accepted)."""
    if variant.loss == "chunked":
        return weighted_block_loss
    return lambda *a, chunk_size, **objective: fused_dflash_loss(*a, chunk_size=chunk_size, compiled=variant.loss == "fused_compiled", **objective)


# ----------------------------------------------------------------------------------------------
# Timing helpers


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseClock:
    """Marks phase boundaries inside a step: CUDA events on GPU (no sync), perf_counter on CPU. With
    `ranges`, each phase is also a torch.profiler.record_function range named after it (for `profile_steps`)."""

    def __init__(self, device: torch.device, ranges: bool = False):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.names = []  # the phases begun, in order
        self.ranges = ranges
        self.open_range = None

    def mark(self, phase: str | None = None) -> None:
        """End the running phase and begin `phase` (None: the step ends here)."""
        if self.open_range is not None:
            self.open_range.__exit__(None, None, None)
            self.open_range = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        if phase is not None:
            self.names.append(phase)
            if self.ranges:
                self.open_range = torch.profiler.record_function(phase)
                self.open_range.__enter__()

    def phase_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (call after a sync)."""
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, reps: int) -> float:
    """Median TFLOP/s of [size, size] @ [size, size] matmuls in `dtype`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = []
    for i in range(reps + 3):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:  # warm-up: cuBLAS heuristics, clocks
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


def matmul_rate(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The measured matmul rate (the MFU denominator) in TFLOP/s, and a line that says how it was measured."""
    if device.type == "cuda":
        tflops = measured_matmul_tflops(device, torch.bfloat16, 8192, reps=10)
        return tflops, f"bf16 8192^3 matmul, median of 10: {tflops:.1f} TFLOP/s"
    tflops = measured_matmul_tflops(device, dtype, 256, reps=5)
    return tflops, f"fp32 256^3 matmul on CPU, median of 5: {tflops:.3f} TFLOP/s"


def peak_memory_gb(device: torch.device) -> float | None:
    """The device's peak allocated memory in GB since its last reset; None on a CPU."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def free_memory(device: torch.device, params=()) -> None:
    """Drop the gradients of `params` and give the freed memory back (garbage collection, CUDA's cache)."""
    for p in params:
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median_ms(fn, device: torch.device, reps: int = 3) -> float:
    """Median milliseconds of `reps` calls of `fn`, each between two device syncs."""
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# The drafter's train step, timed


def drafter_context(
    config: DFlashConfig, device: torch.device, dtype: torch.dtype, progress, backend: str, steps: int, warmup: int, tied_head: bool = False
) -> dict:
    """The drafter and its optimizer, with standalone (frozen) embedding and head at the target's shapes:
    everything `bench_drafter_config` reads, as one dict. progress: a callable taking a log line;
    backend: flex or sdpa; steps, warmup: timed and warm-up steps per (variant, shape); tied_head: the
    head's weight is the embedding's [vocab, hidden] (a target with tie_word_embeddings, e.g. SmolLM2)."""
    with device:
        drafter = (
            DSparkDraftModel if isinstance(config, DSparkConfig) else DFlash2DraftModel if isinstance(config, DFlash2Config) else DFlashDraftModel
        )(config)
        for param in drafter.parameters():  # params only, like DeepSpeed's bf16 cast: RoPE's inv_freq buffer stays fp32
            param.data = param.data.to(dtype)
        embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype).requires_grad_(False)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype).requires_grad_(False)
        if tied_head:
            head.weight = embed.weight  # frozen either way: the step's work is the same, its memory one table less
    drafter.train()
    drafter.attach_target(embed, head)
    optimizer = MasterWeightAdamW(drafter.parameters(), lr=1e-5, max_grad_norm=1.0, fused=device.type == "cuda")
    trainable = sum(p.numel() for p in optimizer.params)
    progress(f"drafter: {trainable / 1e6:.1f} M trainable params ({config.num_hidden_layers} layers, block {config.block_size})")
    return dict(
        device=device,
        config=config,
        dtype=dtype,
        drafter=drafter,
        optimizer=optimizer,
        trainable=trainable,
        head_weight=head.weight,
        weights=loss_weights(config.block_size, device=device),
        backend=backend,
        steps=steps,
        warmup=warmup,
    )


def drafter_step(drafter, optimizer, head_weight, weights, variant, batch_tensors, num_anchors, backend, generator, clock, extractor=None):
    """One training step as train_dflash.py runs it; returns (anchors, anchor_valid, label_valid) for the FLOP count.

    With `extractor`, the target forward runs first (colocated mode) and produces the features.
    """
    input_ids, loss_mask, features, target_hidden = batch_tensors
    block_size = drafter.config.block_size
    if extractor is not None:
        clock.mark("target forward")
        features = extractor(input_ids, torch.ones_like(input_ids))  # [batch, S, 5*hidden]
    clock.mark("forward")  # the mask build included
    anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, generator)
    hidden = drafter(features, input_ids, anchors, anchor_valid, attention_backend=backend)  # [batch, N, B, hidden]
    clock.mark("loss")
    if isinstance(drafter.config, DSparkConfig):  # train_dflash.py's dspark_objective: every slot predicts, gamma = B
        labels, label_valid = dspark_block_labels(input_ids, loss_mask, anchors, anchor_valid, block_size)  # [batch, N, gamma]
        predecessors = markov_predecessor_ids(input_ids, anchors, block_size)  # [batch, N, gamma]
        confidence = drafter.confidence_logits(hidden, predecessors) if drafter.confidence_head is not None else None
        markov = drafter.markov_head
        loss, _, _ = chunked_dspark_loss(
            hidden,
            predecessors,
            drafter.target_lm_head.weight,
            labels,
            label_valid,
            block_target_hidden(target_hidden, anchors, block_size + 1),  # slot k's p: the target's logits at a + k
            confidence,
            markov_w1=None if markov is None else markov.markov_w1.weight,
            markov_w2=None if markov is None else markov.markov_w2.weight,
            chunk_size=variant.chunk_size,
            output_multiplier=drafter.config.output_multiplier,
            final_logit_softcapping=drafter.config.final_logit_softcapping,
            compiled=variant.loss == "fused_compiled",  # fused_ce_compiled: the loss's chunk compiled, as DFlash's
        )
    else:
        labels, label_valid = block_labels(input_ids, loss_mask, anchors, anchor_valid, block_size)
        objective = dict(loss=variant.objective, loss_weighting=variant.weighting, fused_loss=resolve_fused_loss(variant.fused_loss, hidden.device))
        if variant.objective != "ce":
            objective["target_hidden"] = block_target_hidden(target_hidden, anchors, block_size)  # [batch, N, B-1, hidden]
        dflash2 = isinstance(drafter.config, DFlash2Config)
        top_k = drafter.config.selector_top_k if dflash2 else 0  # the selector's candidates from the loss's logits, as in training
        loss, _, *row_weights = loss_fn(variant)(
            hidden[:, :, 1:],
            head_weight,
            labels,
            label_valid,
            weights,
            chunk_size=variant.chunk_size,
            return_row_weights=dflash2,
            top_k=top_k,
            **objective,
        )
        if dflash2:  # the selector's loss beside the drafter's, with its weights, as train_dflash.py adds it
            loss = (
                loss
                + selector_objective(
                    drafter.candidate_selector,
                    drafter.config.selector_top_k,
                    hidden[:, :, 1:],
                    head_weight,
                    labels,
                    label_valid,
                    selector_predecessor_ids(input_ids, anchors, block_size),
                    row_weights[0],
                    chunk_size=variant.chunk_size,
                    candidate_ids=row_weights[1],
                )[0]
            )
    clock.mark("backward")
    loss.backward()
    clock.mark("optimizer")
    optimizer.step()
    clock.mark()
    return anchors, anchor_valid, label_valid


def set_drafter_levers(ctx, variant: Variant) -> None:
    """Train through compiled drafter layers or eager ones (`DFlashDraftModel.compile_layers`, as in training), and
    with the variant's memory levers (`chunk_context`, `checkpoint_layers`)."""
    ctx["drafter"].compile_layers(variant.compile_layers)
    ctx["drafter"].chunk_context(variant.context_chunk)
    ctx["drafter"].checkpoint_layers(variant.checkpoint_layers)


def time_mask_and_attention(ctx, loss_mask, num_anchors: int, seq_len: int, generator) -> tuple[float, float]:
    """(ms of the eager BlockMask builds, ms of compiled flex forward+backward for all L layers), alone.

    flex gets inputs laid out as in the drafter (the same shape key as warm_up_flex_attention, so
    nothing compiles here) and the real mask of sampled anchors.
    """
    device, config, dtype = ctx["device"], ctx["config"], ctx["dtype"]
    anchors, anchor_valid = sample_anchors(loss_mask, num_anchors, generator)
    rules = [config.attention_rule(i) for i in range(config.num_hidden_layers)]
    batch, q_len = anchors.shape[0], num_anchors * config.block_size
    q = torch.randn(batch, q_len, config.num_attention_heads, config.head_dim, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, config.num_key_value_heads, seq_len + q_len, config.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    for t in (q, k, v):
        t.requires_grad_(True)
    flex = get_compiled_flex_attention(device)
    mask_ms = attention_ms = 0.0
    for rule in dict.fromkeys(rules):  # one mask per distinct layer rule, as training builds them
        mask_ms += median_ms(lambda: create_anchor_block_mask(anchors, anchor_valid, seq_len, config.block_size, *rule), device)
        block_mask = create_anchor_block_mask(anchors, anchor_valid, seq_len, config.block_size, *rule)

        def forward_backward():
            out = flex(q, k, v, block_mask)  # [batch, heads, Q, head_dim]
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        attention_ms += rules.count(rule) * median_ms(forward_backward, device)
    return mask_ms, attention_ms


def profile_steps(step, device: torch.device, out_dir: Path, title: str, steps: int = 3, warmup: int = 1) -> dict:
    """`steps` calls of `step(clock)` after `warmup` ones under torch.profiler (CPU activity, and CUDA on a GPU), each
    phase of the step a record_function range (`PhaseClock(ranges=True)`).

    Writes out_dir/trace.json.gz (a chrome trace: chrome://tracing, ui.perfetto.dev) and out_dir/ops.md (`title`, then
    the time per phase, the top 30 ops by self device time (self CPU time on a CPU) and torch.profiler's own table
    by input shapes). Returns {"phases": markdown table, "ops": markdown table and its total line, "note": the
    setting in one line}; every time is a mean per profiled step.
    """
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=steps, repeat=1)
    step_ms, phases = [], []
    with torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True) as profiler:
        for i in range(warmup + steps):
            clock = PhaseClock(device, ranges=True)
            sync(device)
            start = time.perf_counter()
            step(clock)
            sync(device)
            if i >= warmup:
                step_ms.append((time.perf_counter() - start) * 1e3)
                phases.append(clock.phase_ms())
            profiler.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(out_dir / "trace.json.gz"))
    step_mean = statistics.mean(step_ms)
    # Host-side events (ops and ranges); on a GPU each carries the kernels it launched (self: not its children's).
    host = [e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    ranges = {e.key: e for e in host}
    self_ms = (lambda e: e.self_device_time_total / 1e3 / steps) if cuda else (lambda e: e.self_cpu_time_total / 1e3 / steps)
    phase_lines = []
    for name, ms in zip(clock.names, (statistics.mean(p) for p in zip(*phases))):
        host_ms = f"{ranges[name].cpu_time_total / 1e3 / steps:.2f}" if name in ranges else "-"
        phase_lines.append(f"| {name} | {ms:.2f} | {100 * ms / step_mean:.1f}% | {host_ms} |")
    phase_table = "| phase | ms/step | share of step | host CPU ms/step |\n|---|---|---|---|\n" + "\n".join(phase_lines) + "\n"
    ops = [e for e in host if e.key not in clock.names and not e.key.startswith("ProfilerStep")]
    ops.sort(key=self_ms, reverse=True)
    what = "self device" if cuda else "self CPU"
    op_lines = [
        f"| `{e.key}` | {e.count / steps:g} | {self_ms(e):.3f} | {100 * self_ms(e) / step_mean:.1f}% |"
        + (f" {e.self_cpu_time_total / 1e3 / steps:.3f} |" if cuda else "")
        for e in ops[:30]
    ]
    total = sum(self_ms(e) for e in host)
    ops_table = (
        f"| op | calls/step | {what} ms/step | share of step |{' self CPU ms/step |' if cuda else ''}\n|---|---|---|---|{'---|' if cuda else ''}\n"
        + "\n".join(op_lines)
        + f"\n\nAll ops: {total:.2f} ms/step of {what} time, {100 * total / step_mean:.1f}% of the step ({step_mean:.2f} ms).\n"
    )
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    note = (
        f"{device_name}, torch {torch.__version__}; {steps} profiled steps after {warmup} warm-up, means per step (the profiler's overhead "
        f"included: compare the timed steps' medians). Phases: ms/step between the step's phase marks (CUDA events on a GPU); host "
        f"CPU ms/step: the record_function range's span on the host, which on a GPU only queues the work (a span as long as the "
        f"phase: the GPU waited on the host). Ops: the host's ops, each with the kernels it launched itself (backward's from "
        f"autograd's thread)."
    )
    by_shapes = profiler.key_averages(group_by_input_shape=True).table(sort_by=f"self_{'device' if cuda else 'cpu'}_time_total", row_limit=30)
    (out_dir / "ops.md").write_text(
        f"# Profile: {title}\n\n{note}\n\n## Time per phase\n\n{phase_table}\n## Top 30 ops by {what} time\n\n{ops_table}\n"
        f"## torch.profiler's table by input shapes (totals over the {steps} steps)\n\n```text\n{by_shapes}\n```\n"
    )
    return dict(phases=phase_table, ops=ops_table, note=note)


def bench_drafter_config(ctx, variant: Variant, num_anchors: int, seq_len: int, batch: int, extractor=None, profile_dir=None) -> dict:
    """Warm up and time one (variant, shape); returns a result row (status 'ok', 'OOM' or 'error: ...'). With
    `profile_dir`, `profile_steps` then profiles a few more steps there and the row gets its tables as "profile"."""
    device, config, dtype = ctx["device"], ctx["config"], ctx["dtype"]
    row = dict(variant=variant.name, anchors=num_anchors, seq=seq_len, batch=batch, status="ok")
    set_drafter_levers(ctx, variant)
    free_memory(device, ctx["optimizer"].params)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        batch_tensors = make_batch(
            batch,
            seq_len,
            config,
            device,
            dtype,
            with_features=extractor is None,
            with_target_hidden=variant.objective != "ce" or isinstance(config, DSparkConfig),
        )
        generator = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        if ctx["backend"] == "flex":
            warm_up_flex_attention(
                device,
                create_anchor_block_mask,
                batch=batch,
                heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                context_len=seq_len,
                num_anchors=num_anchors,
                block_size=config.block_size,
                dtype=dtype,
                rules=tuple(config.attention_rule(i) for i in range(config.num_hidden_layers)),
            )
        step = lambda clock: drafter_step(  # noqa: E731 - one call site per phase below
            ctx["drafter"],
            ctx["optimizer"],
            ctx["head_weight"],
            ctx["weights"],
            variant,
            batch_tensors,
            num_anchors,
            ctx["backend"],
            generator,
            clock,
            extractor,
        )
        for _ in range(ctx["warmup"]):
            step(PhaseClock(device))
        sync(device)
        row["warmup_s"] = time.perf_counter() - start
        step_ms, phases, flops = [], [], []
        for _ in range(ctx["steps"]):
            clock = PhaseClock(device)
            sync(device)
            t0 = time.perf_counter()
            anchors, anchor_valid, label_valid = step(clock)
            sync(device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            phases.append(clock.phase_ms())
            distribution_loss = variant.objective != "ce" or isinstance(config, DSparkConfig)  # DSpark's L1 reads the target's logits
            parts = drafter_step_flops(config, seq_len, anchors, anchor_valid, label_valid, distribution_loss=distribution_loss)
            flops.append(sum(f + b for f, b in parts.values()))
        row["ms_step"] = statistics.median(step_ms)
        row["phases_ms"] = [statistics.median(p) for p in zip(*phases)]
        row["flops_sample"] = statistics.mean(flops) / batch
        row["peak_gb"] = peak_memory_gb(device)
        if extractor is None and ctx["backend"] == "flex":
            row["mask_ms"], row["attn_ms"] = time_mask_and_attention(ctx, batch_tensors[1], num_anchors, seq_len, generator)
        if profile_dir is not None:
            drafter_sizes = f"{config.num_hidden_layers} drafter layers, hidden {config.hidden_size}, vocab {config.vocab_size}"
            title = f"{variant.name} at {num_anchors} anchors, seq {seq_len}, batch {batch} ({drafter_sizes}, {ctx['backend']} attention)"
            try:
                row["profile"] = profile_steps(step, device, Path(profile_dir), title)
            except Exception:  # a failed profile leaves the row's timings as measured
                traceback.print_exc()
    except torch.cuda.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as e:  # a variant that fails (e.g. a compile error) is reported, the run goes on
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        traceback.print_exc()
    free_memory(device, ctx["optimizer"].params)
    return row


# ----------------------------------------------------------------------------------------------
# The target's forward, timed


def build_target(target_config: Qwen3Config, device, dtype):
    """A target of `target_config` with random weights, on `device` in `dtype`, frozen and in eval mode (SDPA)."""
    with device:  # allocate on the device directly
        target = AutoModelForCausalLM.from_config(target_config, dtype=dtype, attn_implementation="sdpa")
    target.requires_grad_(False)
    return target.eval()


def bench_target(extractor, target_config, num_layers, device, batch, seq_len, steps, warmup) -> dict:
    """Tokens/s of the truncated target forward with feature capture at [batch, seq_len]."""
    row = dict(batch=batch, seq=seq_len, status="ok")
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        input_ids = torch.randint(0, target_config.vocab_size, (batch, seq_len), device=device)
        attention_mask = torch.ones_like(input_ids)
        times = []
        for i in range(warmup + steps):
            sync(device)
            t0 = time.perf_counter()
            features = extractor(input_ids, attention_mask)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            del features
        seconds = statistics.median(times)
        row["ms_call"] = seconds * 1e3
        row["tokens_s"] = batch * seq_len / seconds
        row["tflops"] = target_forward_flops(target_config, num_layers, batch, seq_len) / seconds / 1e12
        row["peak_gb"] = peak_memory_gb(device)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "OOM"
    free_memory(device)
    return row
