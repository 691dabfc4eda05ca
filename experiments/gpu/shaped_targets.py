"""Random-weight targets at real shapes and long GSM8K conversations, for the multi-GPU measurements:
    python3 experiments/gpu/shaped_targets.py WORK_DIR GSM8K_JSONL

WORK_DIR gets, each skipped when it is there already:
    q8b/          Qwen3-8B's shape (36 layers, hidden 4096, 32/8 heads) with the Qwen3 tokenizer: a config
                  only, for `train_dflash.py --target_random_init`
    small/        a small Qwen3 (8 layers, hidden 1024) with the same tokenizer, likewise
    conv8.jsonl   900 conversations of 8 GSM8K exchanges each (> 768 tokens, so every sample is cut
                  to a 768-token --max_seq_length: one shape for every batch)
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_target import find_qwen3_tokenizer_dir  # noqa: E402  (the repository root, on the path above)

work, gsm8k = Path(sys.argv[1]), Path(sys.argv[2])
common = dict(
    vocab_size=151936,
    tie_word_embeddings=False,
    eos_token_id=151645,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
shapes = {
    "q8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}
tokenizer = AutoTokenizer.from_pretrained(find_qwen3_tokenizer_dir())
for name, shape in shapes.items():
    if not (work / name / "config.json").is_file():
        Qwen3Config(**shape, **common).save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
if not (work / "conv8.jsonl").is_file():
    rows = [json.loads(line) for line in gsm8k.read_text().splitlines()]
    with open(work / "conv8.jsonl", "w") as f:
        for i in range(0, 8 * 900, 8):
            messages = [
                m for r in rows[i : i + 8] for m in ({"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]})
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
print(f"{work}: q8b/, small/, conv8.jsonl")
