"""`accelerate launch`, with the same arguments, that ends a failed run with its first error.

    python launch.py --config_file accelerate_configs/8gpu.yaml train_dflash.py --config configs/qwen3-8b.yaml
    python launch.py train_dflash.py                  # the offline CPU demo, one process

`accelerate launch` itself runs the same ranks, but after a failure it prints its own traceback
(for one process, with the script's stderr inside it a second time; for several, torchrun's table of
failed ranks) and exits with status 1 whatever the script returned, so the script's one-line
`error: ...` is buried and a job script cannot tell a bad setting (status 2) from a crash. This file
runs accelerate's own launcher in this process (its argument parser and `launch_command`) and
handles the failure itself: the last line on stderr is the error of the rank that failed first, and
the exit status is that rank's.

A rank of train_dflash.py leaves its error line in the file torch's elastic agent gives each rank
(TORCHELASTIC_ERROR_FILE); with one process (no agent) the script's own last line is already its
error. A rank that died without a word (a signal: out of memory, killed) is named with its signal.
"""

import logging
import os
import subprocess
import sys

import torch
from accelerate.commands.config import default_config_file
from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def first_error(error: ChildFailedError) -> tuple[str, int]:
    """(error line, exit status) of the rank that failed first: the earliest error line a rank left
    in its error file, else the first failure torchrun observed (a signal, or a crash with no file)."""
    recorded = []
    for rank, failure in error.failures.items():
        message = failure.error_file_data.get("message")
        if isinstance(message, dict) and str(message.get("message", "")).startswith("error: "):
            recorded.append((int(message["extraInfo"].get("time_ns", 0)), rank, message["message"], failure.exitcode))
    if recorded:
        _, _, line, exitcode = min(recorded)
        return line, exitcode
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        name = failure.signal_name()
        hint = " (out of host memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        return f"error: rank {rank} was stopped by {name}{hint}", 128 - failure.exitcode
    return f"error: rank {rank} exited with status {failure.exitcode} (its output is above)", failure.exitcode


def fill_launch_defaults(args) -> None:
    """With no accelerate config (no --config_file, no `accelerate config` file), the values accelerate
    would take anyway: one process per GPU (one on a CPU), one machine, no mixed precision, no dynamo.
    Set here, they spare every such launch (the demo's among them) accelerate's five-line warning that
    each was not passed; a multi-GPU warning, and any value given, stay as they are."""
    if args.config_file is not None or os.path.isfile(default_config_file):
        return
    defaults = {
        "num_processes": max(0 if args.cpu else torch.cuda.device_count(), 1),
        "num_machines": 1,
        "mixed_precision": "no",
        "dynamo_backend": "no",
    }
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def main(argv: list[str]) -> int:
    args = launch_command_parser().parse_args(argv)
    fill_launch_defaults(args)
    args.quiet = False  # quiet turns every failure into status 1; this file reports failures itself
    # The agent logs each failed and stopped rank as it handles the failure; the summary below is enough.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as error:  # one process: its stderr, already shown, ends with its error
        return error.returncode if error.returncode > 0 else 128 - error.returncode
    except ChildFailedError as error:
        line, exitcode = first_error(error)
        sys.stdout.flush()
        print(line, file=sys.stderr)
        return exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
