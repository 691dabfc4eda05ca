"""Does a tensor-parallel engine work over a SUBGROUP of the ranks? (How --target_tp_size was chosen.)

Three processes over gloo on a CPU: ranks 0 and 1 load one copy of a target with tensor parallelism
over the group {0, 1}; rank 2 stays out of it, as a drafter rank does. Each group rank prints its
load time, the mean time of 3 forwards (batch 2 x 512 random tokens) and the largest difference of
layer 4's output from a whole copy's (written by --engine whole first). A hang (transformers 5.24,
whose from_pretrained builds its mesh over the whole world whatever `device_mesh` it is given) is
cut after 120 s with a traceback.

    python experiments/tp_subgroup_check.py --make_target /tmp/tp/target       # Qwen3, hidden 512, 8 layers
    torchrun --nproc_per_node 3 experiments/tp_subgroup_check.py --engine whole --target /tmp/tp/target
    torchrun --nproc_per_node 3 experiments/tp_subgroup_check.py --engine deepspeed --target /tmp/tp/target
    torchrun --nproc_per_node 3 experiments/tp_subgroup_check.py --engine transformers --target /tmp/tp/target
"""

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's flat modules


def make_target(path: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=4096,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(path, max_shard_size="10MB")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["whole", "deepspeed", "transformers"])
    parser.add_argument("--target", help="a safetensors target directory")
    parser.add_argument("--make_target", metavar="DIR", help="write the test target to DIR and exit")
    args = parser.parse_args(argv)
    if args.make_target:
        return make_target(args.make_target)
    faulthandler.dump_traceback_later(120, exit=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    input_ids = torch.randint(0, 4096, (2, 512), generator=torch.Generator().manual_seed(0))
    reference = Path(args.target) / "layer4_output.pt"
    if rank in (0, 1) and not (args.engine == "whole" and rank == 1):
        started = time.perf_counter()
        if args.engine == "whole":
            model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
        elif args.engine == "transformers":
            from torch.distributed.device_mesh import DeviceMesh

            model = AutoModelForCausalLM.from_pretrained(
                args.target, tp_plan="auto", device_mesh=DeviceMesh.from_group(group, "cpu"), dtype=torch.float32
            )
        else:
            from dflash_target import load_target_model

            model = load_target_model(args.target, AutoConfig.from_pretrained(args.target), dtype=torch.float32, device="cpu", tp_group=group)
        load_s = time.perf_counter() - started
        with torch.no_grad():
            model.model(input_ids=input_ids)
            started = time.perf_counter()
            for _ in range(3):
                output = model.model(input_ids=input_ids, output_hidden_states=True).hidden_states[5]
            forward_s = (time.perf_counter() - started) / 3
        if args.engine == "whole":
            torch.save(output, reference)
            difference = 0.0
        else:
            difference = (output - torch.load(reference)).abs().max().item()
        print(
            f"{args.engine} (transformers {transformers.__version__}) rank {rank}: load {load_s:.2f} s, forward "
            f"{forward_s:.3f} s, max |layer 4 - whole copy's| {difference:.2e}",
            flush=True,
        )
    elif args.engine == "deepspeed":
        from dflash_split import join_tensor_parallel_init

        join_tensor_parallel_init()
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
