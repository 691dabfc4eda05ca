"""A DSpark export served by llama.cpp (tools/llama_cpp_check.py, `--spec-type draft-dspark`).

In CI: the tool's side of the comparison. Its drafts (`dspark_drafts`: the block forward at given
anchors, then the greedy Markov walk) equal DeepSpec's own greedy drafts from its KV-cache path (the
tests/fixtures/dspark golden tensors); the replay of greedy speculative decoding (`greedy_walk`) and
of llama.cpp's block anchors (`block_anchors`) count as speculative_generate and llama.cpp do.

Where llama.cpp b11434 is built (`make engine-check`, or DFLASH_LLAMA_CPP_DIR): a tiny DSpark drafter
of a target with untied embeddings converts with llama.cpp's converter, serves and gives the target's
greedy output. As written, the export is drafted with its copy of the target's embedding as the LM
head (llama.cpp's converter drops lm_head and its loader then projects with token_embd): every drafted
block is ours made with that head, and not ours. Its speculators form (`--draft_form speculators`,
no copies) drafts our tokens.
"""

import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_dspark import FIXTURE, load_drafter
from torch import nn

from dflash_target import drafter_config_for_target
from dspark_model import DSparkDraftModel, save_dspark_export

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import llama_cpp_check  # noqa: E402

LLAMA_CPP_DIR = os.environ.get("DFLASH_LLAMA_CPP_DIR", llama_cpp_check.DEFAULT_DIR)
needs_llama_cpp = pytest.mark.skipif(
    llama_cpp_check.find_llama_cpp(LLAMA_CPP_DIR) is None,
    reason=f"llama.cpp b11434 is not built in {LLAMA_CPP_DIR}: `make engine-check` builds it (about 24 minutes on 2 cores)",
)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_tools_drafts_are_deepspecs_greedy_drafts():
    """At the fixture's two draft cases, `dspark_drafts` gives DeepSpec's greedy drafts (made from its
    KV cache, `draft_ops.py`), also with another block in the same pass: blocks do not see each other."""
    drafter, inputs, golden = load_drafter(), load_file(FIXTURE / "inputs.safetensors"), load_file(FIXTURE / "outputs.safetensors")
    for case in (0, 1):
        row, anchor = inputs["draft_cases"][case].tolist()
        tokens = inputs["input_ids"][row].tolist()
        features = inputs["context_features"][row : row + 1]
        expected = golden[f"draft{case}.greedy_tokens"][0].tolist()
        assert llama_cpp_check.dspark_drafts(drafter, features, tokens, [anchor]) == [expected]
        other = 2 if anchor > 2 else 9
        alone = llama_cpp_check.dspark_drafts(drafter, features, tokens, [other])[0]
        assert llama_cpp_check.dspark_drafts(drafter, features, tokens, sorted([anchor, other])) == (
            [alone, expected] if other < anchor else [expected, alone]
        )
    assert golden["draft0.greedy_tokens"].tolist() == [[2, 52, 59, 59]]


def test_the_greedy_replay_counts_as_speculative_decoding_and_finds_llama_cpps_anchors():
    generated = [10, 11, 12, 13, 14, 15, 16]  # the target's greedy output, the prefill token first
    drafts = [[11, 12, 99], [12, 13, 14], [13, 99, 99], [14, 15, 16], [15, 16, 17], [16, 17, 18]]
    stats = llama_cpp_check.greedy_walk(generated, drafts, max_new_tokens=7, eos=[])
    # anchor 10: accepts 11 12, the target adds 13; anchor 13: accepts 14 15 16, the output ends there
    assert stats == {"verify_forwards": 2, "committed": [3, 3], "accepted_drafts": [2, 3]}
    assert llama_cpp_check.accepted_as_llama_cpp_counts(stats, 7) == 2 + 2  # llama.cpp drafts at most tokens left - 1
    with_eos = llama_cpp_check.greedy_walk([10, 11, 2], [[11, 2, 5], [2, 5, 5]], max_new_tokens=7, eos=[2])
    assert with_eos == {"verify_forwards": 1, "committed": [2], "accepted_drafts": [2]}
    assert llama_cpp_check.block_anchors(generated, [[11, 12, 99], [14, 15, 16]]) == [0, 3]
    # rejected at once -> next anchor 11; 12 13 accepted -> 14; rejected -> 15; rejected -> 16, the last token: no block there
    assert llama_cpp_check.block_anchors(generated, [[99, 0], [12, 13], [99], [15, 16], [16]]) == [0, 1, 4, 5]


def test_a_dspark_config_is_read_where_deepspec_keeps_its_keys():
    deepspec = {"architectures": ["Qwen3DSparkModel"], "block_size": 4, "target_layer_ids": [1, 3, 4]}
    assert llama_cpp_check.is_dspark(deepspec) and not llama_cpp_check.is_dspark({"architectures": ["DFlashDraftModel"]})
    assert llama_cpp_check.drafter_setting(deepspec, "target_layer_ids") == [1, 3, 4]
    assert llama_cpp_check.drafter_setting({**deepspec, "dflash_config": {"target_layer_ids": [0]}}, "target_layer_ids") == [0]
    assert llama_cpp_check.drafter_setting(deepspec, "block_size", 16) == 4


def test_the_check_knows_when_llama_cpp_reads_the_embedding_as_the_lm_head(tmp_path):
    """llama.cpp b11434 projects a DSpark export's drafts with its embed_tokens copy: the check says
    so when that copy is not the LM head's (an untied target), and not for a tied one."""
    drafter = load_drafter()
    embed, head = drafter.target_embed_tokens, drafter.target_lm_head
    save_dspark_export(drafter, tmp_path / "untied")
    assert not torch.equal(embed.weight, head.weight)
    assert llama_cpp_check.llama_cpp_reads_embedding_as_head(str(tmp_path / "untied"))
    tied = nn.Linear(drafter.config.hidden_size, drafter.config.vocab_size, bias=False)
    tied.weight = embed.weight
    drafter.attach_target(embed, tied)
    save_dspark_export(drafter, tmp_path / "tied")
    assert not llama_cpp_check.llama_cpp_reads_embedding_as_head(str(tmp_path / "tied"))
    # the Markov term on scaled or capped logits: llama.cpp adds it to the raw ones
    config = {"architectures": ["Qwen3DSparkModel"], "block_size": 4}
    assert llama_cpp_check.engine_notes({**config, "dflash_config": {"output_multiplier": 1.0}}) == []
    (note,) = llama_cpp_check.engine_notes({**config, "dflash_config": {"final_logit_softcapping": 30.0}})
    assert "final_logit_softcapping" in note and "dflash.cpp:816-827" in note


@needs_llama_cpp
def test_llama_cpp_drafts_like_our_dspark_drafter(trainable_qwen3_target, tmp_path):
    from transformers import AutoConfig, Qwen3ForCausalLM

    torch.manual_seed(5)
    config = drafter_config_for_target(
        AutoConfig.from_pretrained(trainable_qwen3_target),
        mask_token_id=151669,
        num_draft_layers=2,
        block_size=4,
        target_layer_ids=[0, 2],
        drafter="dspark",
        markov_rank=8,
        num_anchors=16,
    )
    drafter = DSparkDraftModel(config)
    target = Qwen3ForCausalLM.from_pretrained(trainable_qwen3_target)
    drafter.attach_target(target.model.embed_tokens, target.lm_head)
    save_dspark_export(drafter, tmp_path / "export")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 38 + 47?"}\n{"prompt": "Calculate 225 divided by 15."}\n')
    assert not torch.equal(target.model.embed_tokens.weight, target.lm_head.weight)  # untied, as Qwen3-8B's

    def check(draft_form: str) -> list[dict]:
        results = llama_cpp_check.main(
            [
                *("--draft_model", str(tmp_path / "export"), "--target_model", str(trainable_qwen3_target), "--data", str(prompts)),
                *("--num_prompts", "2", "--max_new_tokens", "24", "--llama_cpp_dir", LLAMA_CPP_DIR, "--draft_form", draft_form),
                *("--work_dir", str(tmp_path / "work"), "--timeout_s", "300"),
            ]
        )
        per_prompt = results["per_prompt"]
        for prompt in per_prompt:
            assert prompt["ours_equals_target"] and prompt["llama_cpp_equals_its_target_alone"]  # both sides lossless
        agreeing = [prompt for prompt in per_prompt if prompt["llama_cpp_target_alone_equals_ours"]]
        assert agreeing, per_prompt
        for prompt in agreeing:
            assert prompt["llama_cpp_equals_target"] and prompt["llama_cpp_accepted_drafts"] == prompt["our_accepted_drafts"], prompt
            assert prompt["blocks_compared"] >= 3, prompt
        return agreeing

    # the export as written: every block is ours with the embedding as the LM head, and not ours
    as_written = check("export")
    for prompt in as_written:
        assert prompt["blocks_equal_embedding_as_head"] == prompt["blocks_compared"], prompt
    assert sum(p["blocks_equal"] for p in as_written) < sum(p["blocks_compared"] for p in as_written), as_written
    # its speculators form, without the copies: llama.cpp drafts with the target's LM head, our tokens
    for prompt in check("speculators"):
        assert prompt["blocks_equal"] == prompt["blocks_compared"] and prompt["blocks_equal_embedding_as_head"] is None, prompt
