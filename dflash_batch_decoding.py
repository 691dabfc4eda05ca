"""Batched decoding for regeneration: many replies at once from one static KV cache, each sampled
with its own seed, so that a reply does not depend on which others share its batch.

  - seeds and sampling: the seed of each reply (`reply_seed`), a counter-based uniform draw per row
    and step (`counter_uniform`), and top-p sampling by inverse CDF with those draws
    (`SeededSampling`, also a transformers logits processor for `generate`);
  - continuous batching (`StaticBatchDecoder`): rows refilled with the next prompt as their replies
    end, the decode step compiled and replayed as one CUDA graph, grouped KV heads attended without
    repeating them (`packed_gqa_sdpa`).

regenerate_data.py decodes with them; its docstring gives the speeds.
"""

import contextlib
import hashlib
import logging
import time

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor

from dflash_compile import CUDAGraphCall

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Seeds and sampling


def reply_seed(seed: int, prompt_id: int, sample: int) -> int:
    """The seed of reply `sample` of prompt `prompt_id`: a stable 63-bit hash of the three."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 that torch multiplies with wrap-around."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX1, _MIX2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # logical shift: torch shifts int64 arithmetically


def counter_uniform(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) that is a pure function of (row seed, step).

    A counter-based generator (SplitMix64's finaliser over the two counters), so a reply's draws never
    depend on the other rows of its batch or on what ran before it.

    Args:
        seeds: [batch] int64, one seed per row (`reply_seed`).
        step: index of the token being generated (0 = the first reply token): an int, or [batch]
            int64, one per row.
    Returns:
        [batch] float32, strictly between 0 and 1 (24 random bits each).
    """
    step = torch.as_tensor(step, dtype=torch.int64, device=seeds.device) + 1
    x = seeds * _GOLDEN + step * _MIX2  # int64 arithmetic wraps around
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).float() + 0.5) / float(1 << 24)


class SeededSampling(LogitsProcessor):
    """Sampling from softmax(logits / T), cut to the top-p nucleus, with per-row seeds (inverse CDF).

    A row's tokens are ranked by logit (equal logits: the lower token id first); the nucleus is the
    shortest prefix of that ranking whose probability reaches top_p; the draw is the first token of
    the prefix whose cumulative probability exceeds u times the nucleus mass. One uniform u per row and
    step, from `counter_uniform`(row seed, step), so every row is reproducible on its own, whatever
    else shares its batch. As a logits processor (transformers' `generate` with do_sample=False) it
    returns 0 at the drawn token and -inf elsewhere, so generate's argmax takes the draw.

    Args:
        seeds: [batch] int64 row seeds.
        prompt_width: columns of the (left-padded) prompt, so that the step index counts reply tokens.
        temperature: > 0.
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
    """

    def __init__(self, seeds: torch.Tensor, prompt_width: int, temperature: float, top_p: float):
        self.seeds, self.prompt_width = seeds, prompt_width
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = self.draw(scores, input_ids.shape[1] - self.prompt_width)
        return torch.full_like(scores, float("-inf"), dtype=torch.float32).scatter_(1, tokens[:, None], 0.0)

    def draw(self, scores: torch.Tensor, step: int | torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
        """scores [batch, vocab] (any float dtype) of reply token `step` (an int, or [batch] int64) ->
        the drawn token ids [batch] int64; `seeds` ([batch] int64) replaces the seeds given at construction."""
        seeds = (self.seeds if seeds is None else seeds).to(scores.device)
        # Ranked in the logits' own dtype (bf16 from a bf16 target): the same order as in float32, a cheaper sort.
        ranked, order = scores.sort(dim=-1, descending=True, stable=True)  # [batch, vocab]
        probs = (ranked.float() / self.temperature).softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        if self.top_p < 1.0:
            nucleus = ((cdf - probs) < self.top_p).sum(dim=-1, keepdim=True)  # [batch, 1] >= 1: the first token's mass before is 0
        else:
            nucleus = torch.full_like(order[:, :1], order.shape[-1])
        target = counter_uniform(seeds, step)[:, None] * cdf.gather(1, nucleus - 1)  # [batch, 1], inside the nucleus mass
        index = torch.minimum(torch.searchsorted(cdf, target, right=True), nucleus - 1)  # rounding can reach past the nucleus
        return order.gather(1, index)[:, 0]


# ----------------------------------------------------------------------------------------------
# Continuous batching from a static KV cache


PACKED_GQA_SDPA = "regenerate_packed_gqa_sdpa"  # the name `StaticBatchDecoder` registers `packed_gqa_sdpa` under


def packed_gqa_sdpa(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for a single query token with grouped KV heads and a mask
    shared by the heads (a decode step): the query heads of each KV head become that KV head's query
    rows, so SDPA reads every cached key and value once. transformers repeats the keys and values for
    every query head when a mask is given (`repeat_kv`: 5.17 always, 5.24 under torch.compile), which
    at batch 512 copies the whole static cache every layer and step; `enable_gqa` with a mask falls
    back to the math kernel on CUDA. Everything else goes to `sdpa_attention_forward` unchanged.

    Args:
        query: [batch, heads, Q, head_dim]; key, value: [batch, kv_heads, columns, head_dim].
        attention_mask: [batch, 1 or heads, Q, columns] (bool, or additive) or None.
    Returns:
        ([batch, Q, heads, head_dim], None), as `sdpa_attention_forward`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (
        query.shape[2] != 1
        or groups == 1
        or attention_mask is None
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, head_dim = query.shape
    rows = query.reshape(batch, heads // groups, groups, head_dim)  # query head h is row h % groups of KV head h // groups
    out = F.scaled_dot_product_attention(
        rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )  # [batch, kv_heads, groups, head_dim]
    return out.reshape(batch, 1, heads, value.shape[-1]), None


class StaticBatchDecoder:
    """Continuous batching from a static KV cache, the decode step compiled and replayed as one CUDA
    graph: the GPU path of regenerate_data.py's `regenerate_locally`.

    transformers' `generate` runs its Python loop around every forward (19 ms per step at batch 512
    for SmolLM2-135M on an H200, with its static cache and compiled forward; BENCHMARKS.md). Here a
    step copies three small inputs into the captured buffers, replays the graph (the whole target
    forward over every row) and picks the next tokens on the device. Each row holds one reply at a
    time: every `CHECK_EVERY` steps the host collects the replies that ended (an EOS token or
    max_new_tokens) and gives their rows the next prompts, so the rows stay busy until the prompts run
    out instead of a batch waiting for its longest reply (SmolLM2's GSM8K replies: 205 tokens on
    average, at most 320).

    The cache's columns are a ring. A step writes every row's new key and value at one shared column
    (the graph has one shape), which then advances by one, modulo the cache length `prompt_width +
    max_new_tokens`. A prompt that enters a row when the step is at column c is prefilled with the
    other prompts starting at that check (`_prefill`, a CUDA graph per shape) and written to the columns just before
    c, so its reply has max_new_tokens columns to grow through before the ring comes back to its
    prompt. The attention mask is a per-row table of the columns that hold that row's tokens
    (`valid`); positions are per row, so RoPE does not see where in the ring a token lies.

    With `compile_step` the decode step is `torch.compile(_forward)` (static shapes; the default
    mode, since the graph is captured here), so the captured graph replays inductor's fused kernels
    rather than one eager kernel per operation. The first decode step compiles (and captures); if
    that raises, the run goes on with the eager step, graphed the same way, after one warning.
    Without CUDA graphs (CPU) the compiled step is simply called every step. An sdpa target decodes
    with `packed_gqa_sdpa` (its grouped KV heads are not repeated); an eager one keeps its own
    attention.

    Raises:
        ValueError: for targets that cannot decode from a static cache (`dflash_runners.static_cache_problem`:
            attention without a 4D mask, sliding-window or linear-attention layers); use --kv_cache dynamic.
    """

    CHECK_EVERY = 8  # steps between host checks for ended replies (each waits for the copies made at the check before)
    PREFILL_ROW_BUCKETS, PREFILL_WIDTH_MULTIPLE = (16, 32, 64), 64  # the prefill's shapes (more rows go in chunks of the largest)

    def __init__(self, model, batch_size: int, prompt_width: int, max_new_tokens: int, cuda_graphs: bool, compile_step: bool = False):
        from transformers import AttentionInterface, StaticCache

        from dflash_runners import cache_argument_name, static_cache_problem

        problem = static_cache_problem(model)
        if problem is not None:
            raise ValueError(f"{problem}: use --kv_cache dynamic")
        self.model, self.width, self.max_new_tokens = model, prompt_width, max_new_tokens
        self.length = prompt_width + max_new_tokens  # columns of the ring
        self.cache = StaticCache(config=model.config, max_cache_len=self.length)
        self.cache_argument = cache_argument_name(model)
        implementation = model.config._attn_implementation
        self.additive_mask = implementation == "eager"
        self.attention = PACKED_GQA_SDPA if implementation == "sdpa" else implementation  # for the decoder's forwards
        if self.attention == PACKED_GQA_SDPA:
            AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
        self.dtype = model.get_input_embeddings().weight.dtype
        self.valid = torch.zeros(batch_size, self.length, dtype=torch.bool, device=model.device)  # [batch, columns]
        # transformers allocates a StaticCache on its first write: here, eagerly, never inside a compile or a capture.
        zeros = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)
        with torch.no_grad():
            self._forward(zeros, zeros, zeros[0])
        self.valid.zero_()
        self.cuda_graphs = cuda_graphs
        # dynamic=False: one shape for the run. Not mode="reduce-overhead": the CUDA graph is captured here.
        self.step = torch.compile(self._forward, dynamic=False) if compile_step else self._forward
        self.step_tried = not compile_step  # whether the compiled step's first call (compile, capture) has run
        self.graphed = CUDAGraphCall(self.step) if cuda_graphs else None
        self.prefill_graphed = CUDAGraphCall(self._prefill_forward) if cuda_graphs else None
        self.prefill_caches: dict[tuple, object] = {}  # a StaticCache per prefill shape (`_prefill_forward`)
        # Of the last `stream` that ended: replies, new_tokens (end-of-turn tokens included), seconds, steps,
        # busy_row_steps, check_seconds (host time at checks) and, of it, wait_seconds (waiting for the GPU),
        # prefill_seconds (starting new prompts) and handout_seconds (the caller's work on each reply).
        self.stats: dict = {}

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A bool attention mask as the target's attention wants it: bool, or additive for eager attention."""
        if not self.additive_mask:
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(self.dtype).min)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The decode step: tokens, positions [batch, 1] written at cache column `column` ([1] int64),
        which becomes valid for every row -> logits [batch, vocab]. No host sync (it is replayed as a graph)."""
        for layer in self.cache.layers:  # StaticCache writes at, then advances, each layer's cumulative_length
            layer.cumulative_length.copy_(column[0])
        self.valid.index_fill_(1, column, True)
        mask = self._mask(self.valid[:, None, None, :])  # [batch, 1, 1, columns]
        logits = self.model(
            input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=1, **{self.cache_argument: self.cache}
        ).logits
        return logits[:, -1]  # [batch, vocab]

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """`_forward` by `step` (compiled or eager), replayed from its CUDA graph when there is one."""
        run = self.graphed if self.graphed is not None else self.step
        if self.step_tried:
            return run(tokens, positions, column)
        self.step_tried = True
        try:  # the first call compiles (and captures the graph); a step that repeats writes the same cache column
            return run(tokens, positions, column)
        except Exception as error:
            logger.warning(
                "the compiled decode step failed in its warm-up (%s: %s); decoding with the eager step instead", type(error).__name__, error
            )
            self.step = self._forward
            if self.cuda_graphs:
                torch.cuda.synchronize()  # what the failed call queued ends before the eager step rewrites the column
                self.graphed = CUDAGraphCall(self._forward)
            return self._decode_step(tokens, positions, column)

    def _prefill(self, rows: torch.Tensor, prompts: list[list[int]], column: int, pad_token_id: int) -> torch.Tensor:
        """Start prompts in `rows`: their keys and values go to those rows' columns just before `column`
        (the column the next decode step writes), the rest of each row's columns become invalid.

        The prompts go through `_prefill_forward` in chunks at a few fixed shapes (rows: the smallest
        of `PREFILL_ROW_BUCKETS` that holds the chunk, columns: a multiple of `PREFILL_WIDTH_MULTIPLE`;
        padding rows repeat the chunk's first prompt in its row, writing what it writes), replayed
        from one CUDA graph per shape on CUDA: an eager forward of every layer would cost the host
        more than the decode steps queued behind it cost the GPU.

        Args:
            rows: [k] int64 row indices; prompts: k lists of token ids (each <= the decoder's width).
        Returns:
            logits [k, vocab] of each prompt's last token.
        """
        largest, logits = self.PREFILL_ROW_BUCKETS[-1], []
        column_tensor = self._to_device(torch.tensor([column]))
        for start in range(0, len(prompts), largest):
            chunk = prompts[start : start + largest]
            size = next(b for b in self.PREFILL_ROW_BUCKETS if b >= len(chunk))
            width = min(-(-max(len(p) for p in chunk) // self.PREFILL_WIDTH_MULTIPLE) * self.PREFILL_WIDTH_MULTIPLE, self.width)
            input_ids = torch.full((size, width), pad_token_id, dtype=torch.long)
            real = torch.zeros(size, width, dtype=torch.bool)
            for i in range(size):  # left padding: every prompt ends at the last column
                ids = chunk[i] if i < len(chunk) else chunk[0]
                input_ids[i, width - len(ids) :] = torch.tensor(ids)
                real[i, width - len(ids) :] = True
            chunk_rows = rows[start : start + len(chunk)]
            chunk_rows = torch.cat([chunk_rows, chunk_rows[:1].expand(size - len(chunk))])
            out = self._prefill_call(self._to_device(input_ids), self._to_device(real), chunk_rows, column_tensor)
            logits.append(out[: len(chunk)].clone())  # the graph's output buffer is overwritten by the next replay
        return torch.cat(logits)

    def _prefill_call(self, *inputs: torch.Tensor) -> torch.Tensor:
        """`_prefill_forward`, replayed from its CUDA graph for this shape when there are graphs; if
        capturing one raises, the run goes on with the eager prefill after one warning."""
        if self.prefill_graphed is None:
            return self._prefill_forward(*inputs)
        try:
            return self.prefill_graphed(*inputs)
        except Exception as error:
            logger.warning("capturing the prefill as a CUDA graph failed (%s: %s); prefilling eagerly instead", type(error).__name__, error)
            torch.cuda.synchronize()
            self.prefill_graphed = None
            return self._prefill_forward(*inputs)

    def _prefill_forward(self, input_ids: torch.Tensor, real: torch.Tensor, rows: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The prefill of `_prefill`, on the device, with no host sync: input_ids, real (bool: not
        padding) [P, W], rows [P] int64, column [1] int64 -> logits [P, vocab] of the last column.
        Its attention on CUDA is the memory-efficient kernel (cuDNN's planned anew per shape, costing
        the host ~2 ms per call; BENCHMARKS.md, "where the decoder's time goes")."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from transformers import StaticCache

        device, width = input_ids.device, input_ids.shape[1]
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # [P, W]
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        allowed = (real[:, None, None, :] & causal) | torch.eye(width, dtype=torch.bool, device=device)  # a pad query sees itself
        # One static cache per shape, kept: transformers allocates a cache's tensors on its first write
        # (copying host data to the GPU), which must happen in the eager warm-up, never in the capture.
        cache = self.prefill_caches.get(tuple(input_ids.shape))
        if cache is None:
            cache = self.prefill_caches[tuple(input_ids.shape)] = StaticCache(config=self.model.config, max_cache_len=width)
        for layer in cache.layers:  # written from column 0 on
            layer.cumulative_length.zero_()
        attention = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) if device.type == "cuda" else contextlib.nullcontext()
        with attention:
            logits = self.model(
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=self._mask(allowed),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_argument: cache},
            ).logits[:, -1]
        columns = (column - width + torch.arange(width, device=device)) % self.length  # [W]
        for ring, new in zip(self.cache.layers, cache.layers):  # [batch, kv_heads, columns, head_dim] <- [P, kv_heads, W, head_dim]
            ring.keys.transpose(1, 2)[rows[:, None], columns[None, :]] = new.keys.transpose(1, 2)
            ring.values.transpose(1, 2)[rows[:, None], columns[None, :]] = new.values.transpose(1, 2)
        self.valid.index_fill_(0, rows, False)  # not `valid[rows] = False`: that copies a host scalar, which a capture refuses
        self.valid[rows[:, None], columns[None, :]] = real
        return logits

    def _pick(self, logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, sampler: "SeededSampling | None") -> torch.Tensor:
        """logits [rows, vocab] of reply tokens `steps` ([rows]) -> the tokens [rows]: greedy, or `sampler`'s draws."""
        return sampler.draw(logits, steps, seeds) if sampler is not None else logits.argmax(dim=-1)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the decoder's device, copied without a host sync (through pinned memory:
        a plain copy to the GPU waits for every queued step)."""
        if self.valid.device.type != "cuda":
            return host
        return host.pin_memory().to(self.valid.device, non_blocking=True)

    @torch.no_grad()
    def stream(self, requests, eos_ids: list[int], pad_token_id: int, sampler: "SeededSampling | None" = None):
        """Decode replies, rows refilled as they free up.

        The host never waits for the GPU to run dry: each check reads a copy of the rows' state taken
        at the check before (copied to pinned memory in stream order), so the steps queued since then
        keep the GPU busy while the host hands out the replies that had ended and queues the next
        prompts' prefill. A reply is collected at the second check after it ends.

        Args:
            requests: iterable of (key, prompt token ids, seed), consumed as rows free up. Prompts
                must be at most the decoder's width; the seed is used by `sampler`.
            sampler: draws each row's tokens with that row's seed (its `seeds` are unused); None = greedy.
        Yields:
            (key, new token ids) in the order replies end: the ids end with an EOS id when the reply
            ended by one, else there are max_new_tokens of them.
        """
        batch, device, max_new = self.valid.shape[0], self.valid.device, self.max_new_tokens
        pending = iter(requests)
        keys: list = [None] * batch  # the request each row holds
        live = torch.zeros(batch, dtype=torch.bool, device=device)  # the row's reply has not ended
        lengths = torch.zeros(batch, dtype=torch.long, device=device)  # tokens generated in the row's reply
        positions = torch.zeros(batch, dtype=torch.long, device=device)  # of the row's next input token
        seeds = torch.zeros(batch, dtype=torch.long, device=device)
        out = torch.full((batch, max_new), pad_token_id, dtype=torch.long, device=device)
        eos = self._to_device(torch.tensor(eos_ids))
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
        # The rows' state as of the last check, on the host (pinned: copied without a sync).
        pinned = device.type == "cuda"
        seen_live, seen_lengths, seen_out = (
            torch.zeros(batch, dtype=torch.bool, pin_memory=pinned),
            torch.zeros(batch, dtype=torch.long, pin_memory=pinned),
            torch.zeros(batch, max_new, dtype=torch.long, pin_memory=pinned),
        )
        seen = None  # after the first check: the event that the copies are done (True on the CPU)
        logits, column, step, busy = None, self.width, 0, torch.zeros((), dtype=torch.long, device=device)
        began, new_tokens, replies = time.time(), 0, 0
        # Host seconds at checks and, of them, waiting for the GPU (the GPU is the bottleneck when waiting
        # dominates), prefilling, and handing out replies (the caller's work on each yielded reply).
        checking = waiting = prefilling = handing_out = 0.0
        # The decoder's forwards attend with `self.attention`; the model gets its own back afterwards
        # (transformers' generate, the retry path, makes its masks by that implementation's name).
        config = self.model.config
        restore, config._attn_implementation = config._attn_implementation, self.attention
        try:
            while True:
                first = None
                if step % self.CHECK_EVERY == 0:
                    check_began = time.perf_counter()
                    if seen is not None:
                        if pinned:
                            seen.synchronize()  # the copies queued a check ago: the steps queued since still run
                        waiting += time.perf_counter() - check_began
                        alive, done_lengths = seen_live.tolist(), seen_lengths.tolist()
                        for r in range(batch):
                            if keys[r] is not None and not alive[r]:
                                handed = time.perf_counter()
                                yield keys[r], seen_out[r, : done_lengths[r]].tolist()
                                handing_out += time.perf_counter() - handed
                                keys[r] = None
                                new_tokens, replies = new_tokens + done_lengths[r], replies + 1
                    free = [r for r in range(batch) if keys[r] is None]
                    starting = [request for _, request in zip(free, pending)]
                    if starting:
                        prefill_began = time.perf_counter()
                        rows = self._to_device(torch.tensor(free[: len(starting)]))
                        for r, (key, _, _) in zip(free, starting):
                            keys[r] = key
                        prompt_logits = self._prefill(rows, [ids for _, ids, _ in starting], column, pad_token_id)
                        seeds[rows] = self._to_device(torch.tensor([seed for _, _, seed in starting]))
                        positions[rows] = self._to_device(torch.tensor([len(ids) for _, ids, _ in starting]))
                        lengths[rows], live[rows] = 0, True
                        first = rows, self._pick(prompt_logits, seeds[rows], lengths[rows], sampler)
                        prefilling += time.perf_counter() - prefill_began
                    if all(key is None for key in keys):
                        checking += time.perf_counter() - check_began
                        break
                    seen_live.copy_(live, non_blocking=pinned)
                    seen_lengths.copy_(lengths, non_blocking=pinned)
                    seen_out.copy_(out, non_blocking=pinned)
                    seen = torch.cuda.Event() if pinned else True
                    if pinned:
                        seen.record()
                    checking += time.perf_counter() - check_began
                if logits is not None:
                    tokens = self._pick(logits, seeds, lengths, sampler)
                if first is not None:
                    tokens[first[0]] = first[1]
                # Record each live row's token at its reply position, without a host sync.
                at = lengths.clamp(max=max_new - 1)[:, None]
                out.scatter_(1, at, torch.where(live[:, None], tokens[:, None], out.gather(1, at)))
                lengths += live
                busy += live.sum()
                live &= ~torch.isin(tokens, eos) & (lengths < max_new)
                logits = self._decode_step(tokens[:, None], positions[:, None], torch.full((1,), column, dtype=torch.long, device=device))
                positions += 1
                column, step = (column + 1) % self.length, step + 1
        finally:
            config._attn_implementation = restore
        seconds = time.time() - began
        self.stats = {
            "replies": replies,
            "new_tokens": new_tokens,
            "seconds": seconds,
            "steps": step,
            "busy_row_steps": busy.item(),
            "check_seconds": checking,
            "wait_seconds": waiting,
            "prefill_seconds": prefilling,
            "handout_seconds": handing_out,
        }
        logger.info(
            "%d replies, %d tokens decoded (end-of-turn tokens included) in %.1f s (%.0f tokens/s); %d decode steps of "
            "%d rows, %.0f%% of the rows busy; the host spent %.1f s at checks: %.1f s waiting for the GPU, %.1f s "
            "prefilling new prompts, %.1f s handing out replies",
            replies,
            new_tokens,
            seconds,
            new_tokens / max(seconds, 1e-9),
            step,
            batch,
            100 * busy.item() / max(step * batch, 1),
            checking,
            waiting,
            prefilling,
            handing_out,
        )
