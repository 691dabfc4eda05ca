"""A random-weight target with the shape and tokenizer of a real one, and a random drafter for it, for
speed measurements: python3 tools/gpu/random_target.py FILES OUT_DIR

FILES holds config.json and the tokenizer files (e.g. SmolLM2-135M-Instruct's); OUT_DIR gets a bf16
model folder (random weights, so generation never stops early) and OUT_DIR/drafter (5 layers).
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_model import DFlashDraftModel  # noqa: E402  (the repository root, on the path above)
from dflash_target import drafter_config_for_target  # noqa: E402

files, out = Path(sys.argv[1]), Path(sys.argv[2])
config = AutoConfig.from_pretrained(files)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
for f in files.iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
DFlashDraftModel(drafter_config_for_target(config, mask_token_id=16)).save_pretrained(out / "drafter")
print(f"{out}: random {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")
