"""The target and the drafter during speculative decoding (dflash_decoding.py): their KV caches, cut
back to the committed tokens after every verify forward, and their CUDA graphs; also the static-cache
check that regeneration and batched decoding use (`static_cache_problem`).

In reading order:
  - the target's runner: a growing KV cache cut back after each verify forward (`TargetRunner`,
    checked at start-up by `check_verify_keep`), or a static one replayed as CUDA graphs
    (`StaticTargetRunner`);
  - the drafter's side: its static context cache (`DFlashStaticContextCache`) and its draft pass
    (`Drafting`: greedy drafts, q for sampling, DFlash2's selector walk, DSpark's Markov walk);
  - `resolve_kv_cache` (`--kv_cache`, `--cuda_graphs`) and `Decoder`: both, made once per run and
    reused for every prompt.

On a GPU, plain and speculative decoding run with static KV caches (transformers' `StaticCache` for
the target, a preallocated context cache for the drafter) and every fixed-shape forward (one-token
decode, block verify, draft pass) is captured once as a CUDA graph and replayed (`resolve_kv_cache`:
eval_dflash.py's `--kv_cache`, `--cuda_graphs`). A small target at batch size 1 is bound by Python
and kernel launches, not by the GPU: without graphs the speedup would measure that overhead. On a
CPU both run with growing (dynamic) caches; the static path computes the same tokens there (tested).
Targets with linear-attention layers (Qwen3.5, Qwen3-Next) decode with a dynamic cache whose
recurrent state is restored and re-run after a partly rejected block (`TargetRunner`).
"""

import inspect
import logging

import torch
import transformers
from transformers import DynamicCache

from dflash_compile import CUDAGraphCall

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# The target during decoding: a growing KV cache, or a static one replayed as CUDA graphs


class LayerOutputCapture:
    """Forward hooks that keep the outputs of target decoder layers `layer_ids` from the last forward.

    Layer i's output is HF `hidden_states[i + 1]`. Hooks are used rather than
    `output_hidden_states`, whose last entry transformers replaces with the final-norm output,
    and so the full target can run its normal cached, logits-producing forward (verification needs
    the logits; `TargetFeatureExtractor` calls the decoder without the LM head).
    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, target, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        layers = target.get_decoder().layers
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            # Decoder layers return a tensor in transformers 5; older / remote-code ones a tuple.
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def features(self) -> torch.Tensor | None:
        """[batch, T, len(layer_ids) * hidden] of the last forward (T = its input length), in list
        order; None without layers (plain decoding)."""
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def cache_argument_name(target) -> str:
    """The keyword under which `target`'s forward takes its KV cache: transformers 5.24 names it
    `cache` (and warns on `past_key_values`); 5.17 only accepts `past_key_values`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


# Layer types whose cache holds a recurrent state rather than per-position keys and values
# (transformers' `layer_types` names; "hybrid" layers hold both).
RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"}


def _needs_rollback_cache(target) -> bool:
    """Whether the target's cache holds state that cannot be cut back (linear-attention layers:
    Qwen3.5, Qwen3-Next). Their recurrent state after a verify forward includes the rejected
    drafts, and transformers can crop only attention keys/values.

    Raises:
        ValueError: the target's config names recurrent layers, but this transformers gives its
            cache no linear-attention layers, so rejected drafts could not be rolled back.
    """
    layer_types = getattr(target.config.get_text_config(decoder=True), "layer_types", None) or []
    recurrent = sorted(RECURRENT_LAYER_TYPES.intersection(layer_types))
    linear = getattr(transformers.cache_utils, "LinearAttentionCacheLayerMixin", None)
    found = linear is not None and any(isinstance(layer, linear) for layer in DynamicCache(config=target.config).layers)
    if recurrent and not found:
        raise ValueError(
            f"the target has {'/'.join(recurrent)} layers, but transformers {transformers.__version__} builds its cache "
            "without linear-attention layers, so rejected drafts cannot be rolled back and decoding would not be "
            "lossless; use a transformers version that requirements.txt allows"
        )
    return found


def _cache_snapshot(cache) -> list[dict]:
    """Every layer's state, restorable with `_cache_restore`. Attention layers replace their `keys`
    and `values` on update (torch.cat), so references suffice; every other tensor may be written in
    place (linear-attention conv and recurrent states, token counters), so those (small, fixed-size)
    tensors are cloned, whether they sit on the layer or in one of its dicts."""

    def copy(value):
        return value.clone() if torch.is_tensor(value) else value

    snapshot = []
    for layer in cache.layers:
        state = {}
        for name, value in vars(layer).items():
            if name in ("keys", "values"):
                state[name] = value
            elif isinstance(value, dict):
                state[name] = {k: copy(v) for k, v in value.items()}
            else:
                state[name] = copy(value)
        snapshot.append(state)
    return snapshot


def _cache_restore(cache, snapshot: list[dict]) -> None:
    for layer, state in zip(cache.layers, snapshot):
        layer.__dict__.update(state)


class TargetRunner:
    """The target with transformers' `DynamicCache`: every forward appends to the cache, and after a
    verify forward `keep` cuts it back to the committed tokens. Works for every causal LM; on a GPU
    each forward pays Python and kernel-launch time (about 27 ms per forward for a 135M target on an
    H200, BENCHMARKS.md).

    Attention-only targets get a cache of full-length layers, which crop exactly (sliding-window
    layers still see only their window: the masks come from the config). A target with
    linear-attention layers (Qwen3.5, Qwen3-Next) keeps a recurrent state that cannot be cropped:
    `verify` saves the cache first, and when drafts were rejected `keep` restores it and runs the
    committed tokens again (one extra forward of those tokens per partly rejected block).

    Attributes: `length`, the positions in the cache; `rollback`, whether the target needs the re-run.
    """

    def __init__(self, target, layer_ids: list[int]):
        self.target = target
        self.capture = LayerOutputCapture(target, layer_ids)
        self.cache_argument = cache_argument_name(target)
        self.rollback = _needs_rollback_cache(target)
        self.cache = None
        self.length = 0
        self._verify = None  # (block, features, first position, saved cache) of the last verify forward

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a new sequence: input_ids [1, P] -> (logits [1, 1, vocab] after the last prompt
        token, context features [1, P, F])."""
        self.cache = DynamicCache(config=self.target.config) if self.rollback else DynamicCache()
        self.length = 0
        return self.forward(input_ids, logits_to_keep=1)

    def forward(self, tokens: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, T] at positions length..length+T-1, appended to the cache -> (logits
        [1, T or logits_to_keep, vocab], context features [1, T, F])."""
        logits = self.target(input_ids=tokens, use_cache=True, logits_to_keep=logits_to_keep, **{self.cache_argument: self.cache}).logits
        self.length += tokens.shape[1]
        return logits, self.capture.features()

    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify forward: `forward(block)`, remembered so that `keep` can cut it back.
        block [1, b] -> (logits [1, b, vocab], features [1, b, F])."""
        saved = _cache_snapshot(self.cache) if self.rollback else None
        start = self.length
        logits, features = self.forward(block)
        self._verify = (block, features, start, saved)
        return logits, features

    def keep(self, count: int) -> torch.Tensor:
        """Keep the first `count` tokens of the last `verify` block (the anchor and the accepted
        drafts) in the cache and drop the rest. Returns their features [1, count, F], the context
        the drafter gets next (None without layer ids)."""
        block, features, start, saved = self._verify
        self._verify = None
        if count == block.shape[1]:
            return features
        if saved is None:
            self.crop(start + count)
            return features[:, :count] if features is not None else None
        _cache_restore(self.cache, saved)  # the state before the block, then only the kept tokens
        self.length = start
        return self.forward(block[:, :count])[1]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (transformers 5 `crop` takes -tokens_to_remove).

        Raises:
            ValueError: for a target with linear-attention layers (use `verify` and `keep`).
        """
        if self.rollback:
            raise ValueError("a linear-attention target's cache cannot be cropped; use verify() and keep()")
        if self.length > length:
            self.cache.crop(length - self.length)
        self.length = length

    def close(self) -> None:
        self.capture.__exit__()


@torch.no_grad()
def check_verify_keep(target) -> None:
    """Start-up check of the rollback that lossless decoding rests on: a verify forward of 5 tokens
    followed by `keep(2)` must leave the target's cache as if only those 2 had been fed. Runs the
    same forwards on a fresh cache without the rejected tokens and compares the next logits
    (identical kernels and shapes, so they agree to rounding). Cheap: five forwards of a few tokens.

    Raises:
        ValueError: the two differ (the transformers version's cache keeps state that `keep` does
            not cut back); the message names the transformers version.
    """
    vocab = target.get_input_embeddings().weight.shape[0]
    device = target.get_input_embeddings().weight.device
    tokens = torch.randint(0, vocab, (1, 14), generator=torch.Generator().manual_seed(0)).to(device)
    prompt, block, after = tokens[:, :6], tokens[:, 6:11], tokens[:, 11:]
    runner, reference = TargetRunner(target, []), TargetRunner(target, [])
    try:
        runner.prefill(prompt)
        runner.verify(block)
        runner.keep(2)
        logits = runner.forward(after)[0].float()
        reference.prefill(prompt)
        reference.forward(block[:, :2])
        expected = reference.forward(after)[0].float()
    finally:
        runner.close()
        reference.close()
    difference = (logits - expected).abs().max().item()
    if difference > 1e-3 * (1.0 + expected.abs().max().item()):
        raise ValueError(
            f"verify-then-keep does not roll the target's cache back on transformers {transformers.__version__} "
            f"({'restore and re-run' if runner.rollback else 'crop'}: next logits differ by {difference:.3g} from "
            "a cache that never saw the rejected drafts), so speculative decoding would not be lossless; "
            "use a transformers version that requirements.txt allows"
        )


def static_cache_problem(target) -> str | None:
    """Why the target cannot decode with a static KV cache (`StaticTargetRunner`), or None if it can."""
    from transformers import StaticCache

    implementation = getattr(target.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"a static KV cache needs sdpa or eager attention; this target uses {implementation!r}"
    if _needs_rollback_cache(target):
        return "this target has linear-attention layers, whose state a static cache cannot cut back"
    layers = StaticCache(config=target.config, max_cache_len=1).layers
    if not all(hasattr(layer, "cumulative_length") and not getattr(layer, "is_sliding", False) for layer in layers):
        return "this target's static cache has sliding-window layers"
    return None


class StaticTargetRunner(TargetRunner):
    """The target with a preallocated KV cache of `max_length` positions (transformers' `StaticCache`).

    The cache never moves and the attention mask (key position <= query position, over all
    `max_length` slots) is built inside the forward from the position ids, so every forward of a
    given length is one fixed computation: with `cuda_graphs` it is captured once per length (the
    prefill stays eager) and replayed. `crop` only moves the write position; positions past it hold
    stale keys that the causal mask hides until they are overwritten.

    Raises:
        ValueError: for targets whose attention implementation takes no 4D mask (flash, flex), or
            whose cache has sliding-window or linear-attention layers (`static_cache_problem`); use
            `TargetRunner` for those.
    """

    def __init__(self, target, layer_ids: list[int], max_length: int, cuda_graphs: bool = False):
        from transformers import StaticCache

        problem = static_cache_problem(target)
        if problem is not None:
            raise ValueError(f"{problem}: use --kv_cache dynamic")
        super().__init__(target, layer_ids)
        self.cache = StaticCache(config=target.config, max_cache_len=max_length)
        self.max_length = max_length
        self.additive_mask = getattr(target.config, "_attn_implementation", None) == "eager"
        self.dtype = target.get_input_embeddings().weight.dtype
        self.graphed = CUDAGraphCall(self._forward_at) if cuda_graphs else None

    def _forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [1, T] -> (logits [1, T or logits_to_keep, vocab], features [1, T, F]); no host sync."""
        # StaticCache writes at, then advances, each layer's cumulative_length (a device tensor):
        # point it at this forward's first position, from the inputs, so a replay does it too.
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(positions[0, 0])
        slots = torch.arange(self.max_length, device=tokens.device)
        mask = (slots[None, :] <= positions[0][:, None])[None, None]  # [1, 1, T, max_length], True = attend
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=tokens.device).masked_fill(~mask, torch.finfo(self.dtype).min)
        logits = self.target(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self.cache_argument: self.cache},
        ).logits
        return logits, self.capture.features()

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `TargetRunner.prefill`; eager (prompt lengths vary), into the same static cache."""
        self.length = 0
        return self.forward(input_ids, logits_to_keep=1, graphed=False)

    def forward(self, tokens: torch.Tensor, logits_to_keep: int = 0, graphed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """As `TargetRunner.forward`, replayed from a CUDA graph when the runner has them."""
        length = tokens.shape[1]
        if self.length + length > self.max_length:
            raise ValueError(f"{self.length + length} positions do not fit the static KV cache of {self.max_length}")
        positions = torch.arange(self.length, self.length + length, device=tokens.device)[None]  # [1, T]
        if graphed and self.graphed is not None:
            logits, features = self.graphed(tokens, positions)
            logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        else:
            logits, features = self._forward_at(tokens, positions, logits_to_keep)
        self.length += length
        return logits, features

    def crop(self, length: int) -> None:
        self.length = length


# ----------------------------------------------------------------------------------------------
# The drafter during decoding: its context cache, static for CUDA graphs, and its draft pass


class DFlashStaticContextCache:
    """`dflash_model.DFlashContextCache` in preallocated buffers of `max_length` positions, for CUDA graphs.

    keys[i], values[i]: [batch, kv_heads, max_length, head_dim], written in place by
    `extend_context`; positions >= `length` hold stale values that `draft_block` masks out. The
    buffers never move, so a CUDA graph of `draft_block` captured once stays valid: it reads the
    context length from `length_tensor` (a 0-dim int64 on the device), not from Python.
    """

    def __init__(self, config, batch: int, max_length: int, dtype: torch.dtype, device):
        shape = (batch, config.num_key_value_heads, max_length, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.max_length = max_length
        self.length = 0
        self.length_tensor = torch.zeros((), dtype=torch.long, device=device)

    def crop(self, length: int) -> None:
        """Set the context length (shorter or longer: the caller knows which positions are valid)."""
        if not 0 <= length <= self.max_length:
            raise ValueError(f"context length {length} outside the static cache's 0..{self.max_length}")
        self.length = length
        self.length_tensor.fill_(length)  # a device-side write: no host sync

    def extend(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> "DFlashStaticContextCache":
        """Write the new positions' (k, v) of every layer, each [batch, kv_heads, s_new, head_dim], in place."""
        start, s_new = self.length, kv[0][0].shape[2]
        if start + s_new > self.max_length:
            raise ValueError(f"context of {start + s_new} positions does not fit the static cache ({self.max_length})")
        for i, (k, v) in enumerate(kv):
            self.keys[i][:, :, start : start + s_new] = k
            self.values[i][:, :, start : start + s_new] = v
        self.crop(start + s_new)
        return self

    def key_layout(self, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block's first position as a 0-dim device tensor, key positions [max_length + B] of every
        slot then the block, which keys are valid [max_length + B] bool): no host sync."""
        start = self.length_tensor
        slots = torch.arange(self.max_length, device=device)
        key_positions = torch.cat([slots, start + torch.arange(block_size, device=device)])
        key_valid = torch.cat([slots < start, torch.ones(block_size, dtype=torch.bool, device=device)])
        return start, key_positions, key_valid


class Drafting:
    """The drafter's side of decoding: its context cache and its draft pass.

    kv_cache "dynamic": `DFlashContextCache`, grown by concatenation. "static":
    `DFlashStaticContextCache` of `max_length` positions; with `cuda_graphs` the draft pass is
    captured once and replayed (one graph for greedy drafts, one per sampling setting).
    `drafter` is a `DFlashDraftModel`, `DFlash2DraftModel` or `DSparkDraftModel` (or, with "dynamic",
    any object with `extend_context` and `draft_block`, and `draft_probs` or `draft_sample` for sampling).
    """

    def __init__(self, drafter, kv_cache: str = "dynamic", max_length: int | None = None, cuda_graphs: bool = False):
        self.drafter, self.static = drafter, kv_cache == "static"
        self.cache = None
        if self.static:
            weight = drafter.fc.weight
            self.cache = DFlashStaticContextCache(drafter.config, 1, max_length, weight.dtype, weight.device)
        self.cuda_graphs = self.static and cuda_graphs
        self.graphed = CUDAGraphCall(lambda anchor: self.drafter.draft_block(self.cache, anchor)) if self.cuda_graphs else None
        self.graphed_probs: dict[tuple[float, float], CUDAGraphCall] = {}
        self.graphed_samples: dict[tuple[float, float], CUDAGraphCall] = {}
        self.graphed_walks: dict[tuple[float, float, bool], CUDAGraphCall] = {}

    @property
    def length(self) -> int:
        return self.cache.length if self.cache is not None else 0

    def start(self, context_features: torch.Tensor) -> None:
        """A new sequence whose context is `context_features` [1, P, F]."""
        if self.static:
            self.cache.crop(0)
            self.drafter.extend_context(self.cache, context_features)
        else:
            self.cache = self.drafter.extend_context(None, context_features)

    def extend(self, context_features: torch.Tensor) -> None:
        self.cache = self.drafter.extend_context(self.cache, context_features)

    def draft(self, anchor: torch.Tensor) -> torch.Tensor:
        """anchor [1] int64 -> greedy drafts [1, B-1] int64 (the drafter's full block)."""
        if self.graphed is not None:
            return self.graphed(anchor)
        return self.drafter.draft_block(self.cache, anchor)

    def draft_probs(self, anchor: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """anchor [1] int64 -> the drafter's distribution q [1, B-1, vocab] float32 (`DFlashDraftModel.draft_probs`).
        Sampling from it happens outside, so a captured graph holds no random state and no host sync."""
        if not self.cuda_graphs:
            return self.drafter.draft_probs(self.cache, anchor, temperature, top_p)
        key = (temperature, top_p)
        if key not in self.graphed_probs:
            self.graphed_probs[key] = CUDAGraphCall(lambda a: self.drafter.draft_probs(self.cache, a, temperature, top_p))
        return self.graphed_probs[key](anchor)

    def draft_sample(self, anchor: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor):
        """anchor [1] int64, uniform [1, B-1] draws in [0, 1) -> a DFlash2 drafter's sampled block
        (`DFlash2DraftModel.draft_sample`: tokens, candidate ids, q rows over them). The draws come
        from outside, so a captured graph holds no random state."""
        if not self.cuda_graphs:
            return self.drafter.draft_sample(self.cache, anchor, temperature, top_p, uniform)
        key = (temperature, top_p)
        if key not in self.graphed_samples:
            self.graphed_samples[key] = CUDAGraphCall(lambda a, u: self.drafter.draft_sample(self.cache, a, temperature, top_p, u))
        return self.graphed_samples[key](anchor, uniform)

    def markov_walk(self, anchor: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor | None, confidence: bool):
        """A DSpark drafter's block (`DSparkDraftModel.markov_walk` on one draft pass): greedy at
        temperature 0, else sampled with `uniform`, and with `confidence` its confidence logits.

        Args:
            anchor: [1] int64; uniform: [1, gamma] draws in [0, 1), None at temperature 0.
        Returns:
            tokens [1, gamma] int64; q [1, gamma, vocab] float32, the distribution each was drawn
            from given the one before it (one-hot at temperature 0); confidence logits [1, gamma]
            float32 (`DSparkDraftModel.draft_confidence`), or None. No host sync, no random state.
        """

        def walk(a, u=None):
            hidden = self.drafter.draft_hidden(self.cache, a)  # [1, gamma, hidden]
            tokens, _, q = self.drafter.markov_walk(hidden, a, temperature, top_p, u)
            return tokens, q, self.drafter.draft_confidence(hidden, a, tokens) if confidence else None

        inputs = (anchor,) if uniform is None else (anchor, uniform)
        if not self.cuda_graphs:
            return walk(*inputs)
        key = (temperature, top_p, confidence)
        if key not in self.graphed_walks:
            self.graphed_walks[key] = CUDAGraphCall(walk)
        return self.graphed_walks[key](*inputs)


def resolve_kv_cache(kv_cache: str, cuda_graphs: str, device: torch.device, target=None) -> tuple[str, bool]:
    """(kv_cache, cuda_graphs) for `--kv_cache auto|static|dynamic` and `--cuda_graphs auto|on|off`:
    auto = static with CUDA graphs on a GPU, dynamic on a CPU (where graphs do not exist) and for a
    `target` that a static cache cannot serve (`static_cache_problem`: linear-attention or
    sliding-window layers, flash attention)."""
    if kv_cache not in ("auto", "static", "dynamic") or cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"--kv_cache must be auto, static or dynamic and --cuda_graphs auto, on or off; got {kv_cache!r}, {cuda_graphs!r}")
    on_gpu = device.type == "cuda"
    if kv_cache == "auto":
        problem = static_cache_problem(target) if target is not None and on_gpu else None
        if problem is not None:
            logger.info("--kv_cache auto: dynamic, because %s", problem)
        kv_cache = "static" if on_gpu and problem is None else "dynamic"
    graphs = cuda_graphs == "on" or (cuda_graphs == "auto" and on_gpu and kv_cache == "static")
    if graphs and (not on_gpu or kv_cache != "static"):
        raise ValueError("--cuda_graphs on needs a CUDA device and --kv_cache static")
    return kv_cache, graphs


class Decoder:
    """What decoding needs, made once per run and reused for every prompt: the target's runner
    (its KV cache and, on a GPU, its CUDA graphs) and the drafter's `Drafting`.

    Args:
        target: the full HF causal LM (verification needs its logits).
        drafter: a `DFlashDraftModel` / `DFlash2DraftModel` / `DSparkDraftModel` in the target's dtype with
            `attach_target` done, or None (plain greedy decoding only).
        kv_cache: "dynamic" or "static" (see `resolve_kv_cache`).
        max_length: with "static", the most positions one prompt plus its generation needs
            (prompt + max_new_tokens + the drafter's block size).
        cuda_graphs: replay forwards from CUDA graphs ("static" on CUDA only).
    """

    def __init__(self, target, drafter=None, kv_cache: str = "dynamic", max_length: int | None = None, cuda_graphs: bool = False):
        layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
        if kv_cache == "static":
            self.target = StaticTargetRunner(target, layer_ids, max_length, cuda_graphs)
        else:
            check_verify_keep(target)  # never decode with a cache that cannot be cut back
            self.target = TargetRunner(target, layer_ids)
        self.drafting = Drafting(drafter, kv_cache, max_length, cuda_graphs) if drafter is not None else None
        self.kv_cache, self.cuda_graphs = kv_cache, cuda_graphs

    def close(self) -> None:
        self.target.close()
