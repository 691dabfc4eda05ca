"""Runs the repository's scripts as forks of one process that has imported their libraries once.

`python tests/fork_server.py train_dflash [...]`, started in the repository root with the
environment of the runs: it imports the named scripts, which import torch, transformers,
DeepSpeed, ... (~6 s of CPU per process), then forgets every module of the repository itself, so
that each run imports the project's code afresh, as a fresh interpreter does (through its own
sys.path, reading its own environment). It reads one JSON request per line on stdin,
{"script", "args", "cwd", "env", "stdout", "stderr"}, and forks a child for each: the child is what
`python SCRIPT ARGS` started in `cwd` would be (sys.argv, sys.path[0], `__main__`, os.environ, its
output in the named files, its exit status), only without the libraries' import time. The server
answers {"pid"} for each start and {"pid", "returncode"} (as subprocess gives it) for each exit; it
never runs a torch op, so every fork starts clean. The libraries read some environment variables
when they are imported: a run's environment may differ from the server's only where nothing
imported here reads it (conftest's ForkServer checks).
"""

import importlib
import json
import os
import runpy
import select
import signal
import sys


def run_child(request: dict) -> None:
    """In the forked child: become `python SCRIPT ARGS` in `cwd`; never returns."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stderr = stdout if request["stderr"] == request["stdout"] else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["script"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # the script returned: exit as the interpreter would at its end (atexit handlers included)


def forget_the_project(root: str) -> None:
    """Drop the modules whose files lie in the repository (not its virtual environment)."""
    for name, module in list(sys.modules.items()):
        path = os.path.abspath(getattr(module, "__file__", None) or "/")
        if path.startswith(root + os.sep) and "site-packages" not in path:
            del sys.modules[name]


def main() -> None:
    root = os.getcwd()
    sys.path[0] = root  # the repository root, not tests/
    for name in sys.argv[1:]:
        importlib.import_module(name)
    forget_the_project(root)
    pending, children = b"", set()
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the tests are done: a run still going was left by a failed test
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    run_child(json.loads(line))
                children.add(pid)
                print(json.dumps({"pid": pid}), flush=True)
        while True:  # report the children that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
