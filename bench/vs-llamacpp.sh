#!/usr/bin/env bash
# candle-qmoe against llama.cpp on the CPU, side by side in one run on one machine
# (docs/architecture.md §6), written to bench/results/vs-llamacpp-cpu.json.
#
#   bench/vs-llamacpp.sh MODEL_DIR ['OUR BENCH FLAGS' ...]
#
# MODEL_DIR: a Hugging Face OLMoE folder (BF16 safetensors, config.json, tokenizer.json,
# tokenizer_config.json, generation_config.json). Every further argument is one more run of our
# bench with those extra flags (e.g. '--group-size 64 --pack /tmp/g64.qmoe' or '--experts bf16');
# our default run (INT4 experts, group 128) always comes first.
#
# 1. llama.cpp's CPU tools (llama-bench, llama-quantize) are built from the llama.cpp tree that
#    the pinned llama-cpp-python sdist vendors (Release, -DGGML_NATIVE=ON, CPU only), and its
#    convert_hf_to_gguf.py gets a venv with what it imports (torch, transformers, …, from PyPI);
#    all of it cached under $LLAMA_DIR (default /work/llama), never rebuilt when present.
# 2. MODEL_DIR is converted to a BF16 GGUF and quantized to Q4_0 and Q4_K_M (each llama-quantize
#    timed with /usr/bin/time -v), and our expert pack is made (cached under $LLAMA_DIR/models).
# 3. On an idle machine (1-minute load average below $MAX_LOAD, else it refuses): the memory
#    bandwidth probe, llama-bench -p $PROMPT -n $GEN -r $REPS -t $THREADS per format, then our
#    bench with the same threads, $REPS prompts of exactly $PROMPT tokens, $GEN tokens each;
#    every process under /usr/bin/time -v for its peak RSS.
# 4. bench/vs_llamacpp_report.py counts the weight bytes read per decoded token and writes the
#    JSON ($OUT).
#
# Environment: LLAMA_DIR, LLAMA_CPP_PYTHON_VERSION (default 0.3.36), THREADS (default: all
# cores), PROMPT (128), GEN (64), REPS (5), PACK (our pack; default cached), OUT, MAX_LOAD (0.5),
# WAIT_IDLE (seconds to wait for the load to fall below MAX_LOAD, 300), LLAMA_BUILD_NUMBER (for
# another version), REQUANTIZE=1 (quantize again, so that the recorded quantization times and
# peak RSS come from this run, on this machine), SMOKE=1 (prove the pipeline: -p 16 -n 8 -r 1,
# no idle check, JSON under $LLAMA_DIR/runs), DEPTH=N (decode after N tokens of context instead:
# llama-bench -p 0 -d N, our bench --prompt-tokens N; decode rates only; default OUT
# bench/results/vs-llamacpp-cpu-depthN.json), FORMATS (llama.cpp formats, default "Q4_0 Q4_K_M"),
# ROUNDS=N (default 1: run step 3 N times in turn — probe, every llama.cpp format, every run of
# ours — so that a machine whose bandwidth drifts by minutes weighs on both sides alike; the JSON
# gives each round and the medians, and the ratios as the median of each round's own ratio),
# ISA=avx2 (both sides restricted to AVX2 + FMA + F16C, as on a CPU without AVX-512 such as a
# Zen 3 EPYC: llama.cpp built with GGML_NATIVE=OFF and only those extensions, in
# $LLAMA_DIR/build-avx2, and our runs with QMOE_CPU_ISA=avx2; default OUT
# bench/results/vs-llamacpp-cpu-avx2.json), or ISA=noamx (llama.cpp built with every AVX-512
# extension it uses but without AMX, in $LLAMA_DIR/build-noamx; ours unchanged, it has no AMX
# path: for a VM that reports AMX but where llama.cpp's AMX kernels die of SIGILL).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
[[ $# -ge 1 && $1 != -h && $1 != --help ]] || usage
model_dir=$(cd "$1" && pwd)
shift
variants=("$@")

repo=$(cd "$(dirname "$0")/.." && pwd)
llama_dir=${LLAMA_DIR:-/work/llama}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
threads=${THREADS:-$(nproc)}
smoke=${SMOKE:-0}
if [[ $smoke == 1 ]]; then
  prompt=${PROMPT:-16} gen=${GEN:-8} reps=${REPS:-1}
else
  prompt=${PROMPT:-128} gen=${GEN:-64} reps=${REPS:-5}
fi
max_load=${MAX_LOAD:-0.5}
rounds=${ROUNDS:-1}
depth=${DEPTH:-0}
isa=${ISA:-native}
[[ $isa == native || $isa == avx2 || $isa == noamx ]] ||
  { echo "error: ISA=$isa: native, avx2 or noamx" >&2; exit 2; }
name=$(basename "$model_dir")
models=$llama_dir/models/$name
src=$llama_dir/src/llama_cpp_python-$version/vendor/llama.cpp
build=$llama_dir/build$([[ $isa == native ]] || echo "-$isa")
venv=$llama_dir/venv
target=${CARGO_TARGET_DIR:-$repo/target}
log() { printf '[vs-llamacpp %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

for f in config.json tokenizer.json tokenizer_config.json; do
  [[ -f $model_dir/$f ]] || { echo "error: $model_dir has no $f (convert_hf_to_gguf.py needs it)" >&2; exit 1; }
done

# --- 1. tools -------------------------------------------------------------------------------
missing=()
command -v cmake >/dev/null || missing+=(cmake)
[[ -x /usr/bin/time ]] || missing+=(time)
if [[ ${#missing[@]} -gt 0 ]]; then
  log "apt-get install ${missing[*]}"
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [[ ! -f $src/CMakeLists.txt ]]; then
  log "llama-cpp-python $version sdist (its vendored llama.cpp)"
  mkdir -p "$llama_dir/src"
  # --no-binary for this one package only: with :all: pip would also build the sdist's build
  # requirements (cmake, ninja) from source just to read its metadata.
  python3 -m pip download --quiet --no-binary llama-cpp-python --no-deps \
    "llama-cpp-python==$version" -d "$llama_dir/src"
  tar xzf "$llama_dir/src/llama_cpp_python-$version.tar.gz" -C "$llama_dir/src"
fi
# The sdist has no .git: the llama.cpp commit is the one its changelog names for this release.
llama_commit=$(awk -v v="## [$version]" '$0 == v {on=1; next} on && /^## \[/ {exit}
  on && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' \
  "$src/../../CHANGELOG.md")
llama_commit=${llama_commit:-unknown}
# Nor can it count llama.cpp's build number (its release tag b<N>): known for the pinned version.
case $version in
  0.3.36) build_number=11312 ;; # b11312 = 0c1e57098bba43ac29e6e3b677cdceebdd22334f
  *) build_number=${LLAMA_BUILD_NUMBER:-0} ;;
esac

if [[ $isa == avx2 ]]; then
  isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF)
elif [[ $isa == noamx ]]; then
  isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF)
else
  isa_flags=(-DGGML_NATIVE=ON)
fi
cmake_flags=(-DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DGGML_CUDA=OFF -DGGML_METAL=OFF
  -DGGML_VULKAN=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
  "-DLLAMA_BUILD_COMMIT=$llama_commit" "-DLLAMA_BUILD_NUMBER=$build_number")
# A build (and the venv below) is kept while its stamp names the same version and flags.
stamp="$version ${cmake_flags[*]}"
if [[ $(cat "$build/.stamp" 2>/dev/null) != "$stamp" ]]; then
  log "building llama-bench and llama-quantize in $build (llama.cpp $llama_commit)"
  rm -rf "$build"
  start=$SECONDS
  cmake -S "$src" -B "$build" "${cmake_flags[@]}" >"$llama_dir/build.log" 2>&1
  cmake --build "$build" --target llama-bench llama-quantize -j "$(nproc)" \
    >>"$llama_dir/build.log" 2>&1 || { tail -30 "$llama_dir/build.log" >&2; exit 1; }
  echo $((SECONDS - start)) >"$build/build-seconds"
  echo "$stamp" >"$build/.stamp"
fi
build_seconds=$(cat "$build/build-seconds" 2>/dev/null || echo unknown)

if [[ $(cat "$venv/.stamp" 2>/dev/null) != "$version" ]]; then
  log "converter venv $venv (torch, transformers, … from PyPI)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  # The vendored requirements, less the PyTorch index (not PyPI: PyPI's Linux torch is its CUDA
  # build, which imports on a machine without a GPU) and less PyPI's gguf (the vendored gguf-py
  # is the one that matches the converter).
  cat "$src/requirements/requirements-convert_legacy_llama.txt" \
    "$src/requirements/requirements-convert_hf_to_gguf.txt" |
    grep -Ev '^\s*(#|-r|--|$)|^gguf' >"$venv/requirements.txt"
  "$venv/bin/pip" install --quiet -r "$venv/requirements.txt" "$src/gguf-py"
  echo "$version" >"$venv/.stamp"
fi

# --- 2. weights -----------------------------------------------------------------------------
mkdir -p "$models"
bf16=$models/$name-bf16.gguf
read -r -a formats <<<"${FORMATS:-Q4_0 Q4_K_M}"
# The BF16 GGUF is needed only to quantize: it may be deleted once the formats exist (13 GB).
need_bf16=0
for fmt in "${formats[@]}"; do
  out=$models/$name-$fmt.gguf
  if [[ ! -s $out || $model_dir/config.json -nt $out || ${REQUANTIZE:-0} == 1 ]]; then need_bf16=1; fi
done
if ((need_bf16)) && [[ ! -s $bf16 || $model_dir/config.json -nt $bf16 ]]; then
  log "convert_hf_to_gguf.py $model_dir -> $bf16"
  /usr/bin/time -v -o "$models/convert-bf16.time" "$venv/bin/python" "$src/convert_hf_to_gguf.py" \
    "$model_dir" --outtype bf16 --outfile "$bf16.part" >"$models/convert-bf16.log" 2>&1 ||
    { tail -20 "$models/convert-bf16.log" >&2; exit 1; }
  mv "$bf16.part" "$bf16"
fi
for fmt in "${formats[@]}"; do
  out=$models/$name-$fmt.gguf
  if [[ ! -s $out || ($bf16 -nt $out && -s $bf16) || ${REQUANTIZE:-0} == 1 ]]; then
    log "llama-quantize $fmt"
    /usr/bin/time -v -o "$models/quantize-$fmt.time" "$build/bin/llama-quantize" \
      "$bf16" "$out.part" "$fmt" "$threads" >"$models/quantize-$fmt.log" 2>&1 ||
      { tail -20 "$models/quantize-$fmt.log" >&2; exit 1; }
    mv "$out.part" "$out"
  fi
done

log "building our bench and probes"
(cd "$repo" && cargo build --release --example bench --example quantize --example mem_bandwidth)
pack=${PACK:-$models/$name-g128.qmoe}
if [[ ! -s $pack || ( -z ${PACK:-} && $model_dir/config.json -nt $pack ) ]]; then
  log "our expert pack $pack"
  "$target/release/examples/quantize" --model-dir "$model_dir" --out "$pack" --force
fi

# --- 3. the timed runs ----------------------------------------------------------------------
load1() { cut -d' ' -f1 /proc/loadavg; }
busy() { awk -v l="$(load1)" -v m="$max_load" 'BEGIN {exit !(l > m)}'; }
if [[ $smoke != 1 ]]; then
  # The builds above raise the load average for a while: let it settle, up to $WAIT_IDLE s.
  waited=0
  while busy && ((waited < ${WAIT_IDLE:-300})); do
    ((waited == 0)) && log "waiting for the 1-minute load average ($(load1)) to fall below $max_load"
    sleep 10
    waited=$((waited + 10))
  done
  if busy; then
    echo "error: 1-minute load average $(load1) > $max_load: this benchmark needs an idle" \
      "machine (MAX_LOAD=... to override)" >&2
    exit 1
  fi
fi
run_dir=$llama_dir/runs/$name-$(date -u +%Y%m%dT%H%M%SZ)$([[ $smoke == 1 ]] && echo -smoke || true)
mkdir -p "$run_dir"
log "timed runs in $run_dir"
export RAYON_NUM_THREADS=$threads
our_env="RAYON_NUM_THREADS=$threads"
if [[ $isa == avx2 ]]; then
  export QMOE_CPU_ISA=$isa
  our_env+=" QMOE_CPU_ISA=$isa"
fi

report=(--model-dir "$model_dir" --cores "$(nproc)"
  --threads "$threads" --prompt "$prompt" --gen "$gen" --repetitions "$reps" --depth "$depth"
  --convert bf16 "$models/convert-bf16.time")
for fmt in "${formats[@]}"; do report+=(--quantize "$fmt" "$models/quantize-$fmt.time"); done
for ((round = 1; round <= rounds; round++)); do
  r=$([[ $rounds == 1 ]] || echo "-r$round")
  ((rounds == 1)) || log "round $round of $rounds"
  "$target/release/examples/mem_bandwidth" >"$run_dir/machine$r.json"
  report+=(--machine "$run_dir/machine$r.json")
  for fmt in "${formats[@]}"; do
    gguf=$models/$name-$fmt.gguf
    cmd=("$build/bin/llama-bench" -m "$gguf" -t "$threads" -p "$prompt" -n "$gen" -r "$reps" -o json)
    if ((depth > 0)); then
      cmd=("$build/bin/llama-bench" -m "$gguf" -t "$threads" -p 0 -n "$gen" -d "$depth" -r "$reps"
        -o json)
    fi
    log "${cmd[*]}"
    load=$(load1)
    /usr/bin/time -v -o "$run_dir/llama-$fmt$r.time" "${cmd[@]}" >"$run_dir/llama-$fmt$r.json" \
      2>"$run_dir/llama-$fmt$r.log" || { tail -20 "$run_dir/llama-$fmt$r.log" >&2; exit 1; }
    report+=(--llama "$fmt" "$gguf" "$run_dir/llama-$fmt$r.json" "$run_dir/llama-$fmt$r.time" "$load"
      "${cmd[*]}")
  done

  i=0
  for variant in "" "${variants[@]}"; do
    read -r -a extra <<<"$variant"
    cmd=("$target/release/examples/bench" --model-dir "$model_dir" --cpu --prompts "$reps" --blocks 1
      -n "$gen" --warmup "$((gen < 16 ? gen : 16))" --prompt-tokens "$((depth > 0 ? depth : prompt))"
      --json "$run_dir/ours-$i$r.json")
    run_pack=-
    if [[ " $variant " != *" --pack "* && " $variant " != *" --experts "* ]]; then
      cmd+=(--pack "$pack")
      run_pack=$pack
    elif [[ " $variant " == *" --pack "* ]]; then
      run_pack=$(sed -E 's/.*--pack +([^ ]+).*/\1/' <<<"$variant")
    fi
    cmd+=("${extra[@]}")
    label=int4-g128
    [[ -n $variant ]] && label=$variant
    log "${cmd[*]}"
    load=$(load1)
    /usr/bin/time -v -o "$run_dir/ours-$i$r.time" "${cmd[@]}" >"$run_dir/ours-$i$r.log" 2>&1 ||
      { tail -20 "$run_dir/ours-$i$r.log" >&2; exit 1; }
    report+=(--ours "$label" "$run_pack" "$run_dir/ours-$i$r.json" "$run_dir/ours-$i$r.time" "$load"
      "$our_env ${cmd[*]}")
    i=$((i + 1))
  done
done

if [[ $smoke == 1 ]]; then default_out=$run_dir/vs-llamacpp-cpu.json
elif ((depth > 0)); then default_out=$repo/bench/results/vs-llamacpp-cpu-depth$depth.json
elif [[ $isa != native ]]; then default_out=$repo/bench/results/vs-llamacpp-cpu-$isa.json
else default_out=$repo/bench/results/vs-llamacpp-cpu.json; fi
"$venv/bin/python" "$repo/bench/vs_llamacpp_report.py" "${report[@]}" --out "${OUT:-$default_out}" \
  --command "$([[ $isa == native ]] || echo "ISA=$isa ")THREADS=$threads PROMPT=$prompt GEN=$gen REPS=$reps ROUNDS=$rounds DEPTH=$depth FORMATS='${formats[*]}' bench/vs-llamacpp.sh$(printf ' %q' "$model_dir" "${variants[@]}")" \
  --llama-cpp source "llama-cpp-python $version sdist from PyPI, its vendor/llama.cpp" \
  --llama-cpp llama_cpp_python_version "$version" \
  --llama-cpp llama_cpp_commit "$llama_commit" \
  --llama-cpp llama_cpp_build_number "$build_number" \
  --llama-cpp cmake_flags "${cmake_flags[*]}" \
  --llama-cpp isa "$isa" \
  --llama-cpp targets "llama-bench llama-quantize" \
  --llama-cpp build_seconds "$build_seconds" \
  --llama-cpp compiler "$(cc --version | head -1)" \
  --llama-cpp converter_venv "$(tr '\n' ' ' <"$venv/requirements.txt")+ vendored gguf-py"
