#!/usr/bin/env bash
# The prepared GPU check: on a fresh machine with one CUDA GPU, this checkout, the host snapshots beside it
# (../shared/hosts) and a package registry, one command writes under OUT_DIR
#   production.json     realized/predicted saving at 1 024 px on every sd-scripts architecture (Flux, SD3, Lumina,
#                       Anima) at production width and published depth, in bf16 (bench_production.py --full_depth)
#   rng.json            the RNG trap and unrouted-equals-native on the device (gpu_rng_check.py, Flux, bf16, 1 024 px):
#                       bitwise where native repeats itself, else within the native runs' own spread
#   certify_memory.json the certifier's peak device (and host) memory per adapter parameter, 20 M parameters,
#                       2 probe counts x 2 bin counts (bench_certify_memory.py)
#   gpu_check.json      each part's command, exit status and seconds (the venv's too), the python, torch and device
# plus each part's log. Every check runs even when one before it failed; the exit status is 1 if any failed
# (2: bad usage, no host, no environment, or no CUDA device without --cpu-smoke).
#
#   benchmarks/gpu_check.sh OUT_DIR              # one CUDA GPU: the three checks take < 8 min on an H200
#   benchmarks/gpu_check.sh OUT_DIR --cpu-smoke  # CPU, small sizes (tests/test_gpu_check.py)
#
# The environment: PYTHON, if set, is used as it is (it needs torch and sd-scripts' requirements). Else the venv
# GPU_CHECK_VENV (default: .venv-gpu-check in this checkout) is built, and reused by a later run once built to its end: a
# CUDA torch/torchvision pair (TORCH_PACKAGES, default torch==2.14.1 torchvision==0.29.1: on x86-64 Linux the
# registry's wheels of these are CUDA builds), sd-scripts' requirements.txt (its `-e .` left out: the snapshot is
# read-only, and the benchmarks import it from SD_SCRIPTS_DIR), then this project with its map extra. pip's own variables
# (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX) choose the registry.
# The host: SD_SCRIPTS_DIR, if set; else ../shared/hosts/sd-scripts beside this checkout (sd-scripts main 48d368fa).
#
# --cpu-smoke runs the same three scripts on CPU at small sizes: every architecture (Flux included) at 128 px and
# reduced depth, the RNG check on Flux at 128 px, the memory check on a 0.2 M-parameter adapter; bf16 where the
# CPU has bf16 kernels (oneDNN's check), else fp32. So the whole chain is known to work before a device is lent.
set -uo pipefail
if [[ $# -lt 1 || "${1:-}" == -* ]]; then
    echo "usage: $0 OUT_DIR [--cpu-smoke]" >&2
    exit 2
fi
OUT=$1
SMOKE=${2:-}
if [[ -n "$SMOKE" && "$SMOKE" != "--cpu-smoke" ]]; then
    echo "$0: unknown option $SMOKE (allowed: --cpu-smoke)" >&2
    exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
SD_SCRIPTS_DIR=${SD_SCRIPTS_DIR:-$REPO/../shared/hosts/sd-scripts}
if [[ ! -f "$SD_SCRIPTS_DIR/flux_train_network.py" ]]; then
    echo "$0: no sd-scripts checkout at $SD_SCRIPTS_DIR (set SD_SCRIPTS_DIR, or put the snapshot at ../shared/hosts/sd-scripts)" >&2
    exit 2
fi
SD_SCRIPTS_DIR=$(cd "$SD_SCRIPTS_DIR" && pwd)
export SD_SCRIPTS_DIR PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$SECONDS

FAILED=0
PARTS=()
record() {  # NAME EXIT START COMMAND: one entry of gpu_check.json
    PARTS+=("$1" "$2" "$((SECONDS - $3))" "$4")
}

build_venv() {  # the environment a fresh machine lacks; its log is OUT/venv.log
    local venv=$1 torch_packages=${TORCH_PACKAGES:-torch==2.14.1 torchvision==0.29.1}
    local pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" || return 1
    # shellcheck disable=SC2086 # the package list is split on purpose
    "${pip[@]}" $torch_packages || return 1
    grep -v '^[[:space:]]*-e[[:space:]]' "$SD_SCRIPTS_DIR/requirements.txt" >"$venv/host-requirements.txt"
    "${pip[@]}" -r "$venv/host-requirements.txt" || return 1
    "${pip[@]}" -e "$REPO[map]" || return 1  # scipy: the certifier's sequential test
    touch "$venv/.gpu-check-built"  # a build that ran to its end, for a later run to reuse
}

if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
else
    VENV=${GPU_CHECK_VENV:-$REPO/.venv-gpu-check}
    PY=$VENV/bin/python
    start=$SECONDS
    echo "== venv: $VENV" >&2
    if [[ -f "$VENV/.gpu-check-built" ]]; then
        echo "(reused)" >"$OUT/venv.log"
        record venv 0 "$start" "reused $VENV"
    elif build_venv "$VENV" >"$OUT/venv.log" 2>&1; then
        record venv 0 "$start" "built $VENV"
    else
        tail -n 20 "$OUT/venv.log" >&2
        echo "$0: could not build the environment at $VENV (log: $OUT/venv.log)" >&2
        exit 2
    fi
fi

# the interpreter's torch, whether the CPU has bf16 kernels, and the CUDA device's name (none: -), as one line
read -r TORCH BF16_CPU DEVICE < <("$PY" - <<'EOF'
import torch
bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
print(torch.__version__, int(bf16), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF
)
if [[ -z "${TORCH:-}" ]]; then
    echo "$0: $PY cannot import torch" >&2
    exit 2
fi

if [[ "$SMOKE" == "--cpu-smoke" ]]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    DTYPE=$([[ "$BF16_CPU" == 1 ]] && echo bf16 || echo fp32)
    PRODUCTION=(--device cpu --dtype "$DTYPE" --archs sd3,anima,lumina,flux --px 128 --warmup 0 --reps 1 --threads 1)
    RNG=(--device cpu --dtype "$DTYPE" --arch flux --px 128 --steps 2 --threads 1)
    MEMORY=(--device cpu --params 200000 --probes 8,16 --bins 2,4 --threads 1)
else
    if [[ "$DEVICE" == "-" ]]; then
        echo "$0: torch $TORCH at $PY sees no CUDA device (on a CPU: --cpu-smoke)" >&2
        exit 2
    fi
    DTYPE=bf16
    PRODUCTION=(--device cuda --dtype bf16 --full_depth)
    RNG=(--device cuda --dtype bf16 --arch flux --px 1024 --steps 3)
    MEMORY=(--device cuda --params 20000000 --probes 8,16 --bins 2,4)
fi

part() {  # NAME SCRIPT ARGS...: run one check, log it, record its status
    local name=$1 script=$2 start=$SECONDS
    shift 2
    echo "== $name: $PY benchmarks/$script $*" >&2
    "$PY" "$REPO/benchmarks/$script" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 6 "$OUT/$name.log" >&2
    [[ $rc -eq 0 ]] || FAILED=1
    record "$name" "$rc" "$start" "benchmarks/$script $*"
}

CHECKS=$SECONDS
part production bench_production.py "${PRODUCTION[@]}" --json "$OUT/production.json"
part rng gpu_rng_check.py "${RNG[@]}" --json "$OUT/rng.json"
part certify_memory bench_certify_memory.py "${MEMORY[@]}" --json "$OUT/certify_memory.json"

"$PY" - "$OUT/gpu_check.json" "${SMOKE:-cuda}" "$PY" "$TORCH" "$DEVICE" "$DTYPE" "$SD_SCRIPTS_DIR" \
    "$((SECONDS - CHECKS))" "$((SECONDS - START))" "${PARTS[@]}" <<'EOF'
import json, sys
path, mode, python, torch, device, dtype, host, checks, total, *rest = sys.argv[1:]
parts = {rest[i]: {"exit": int(rest[i + 1]), "seconds": int(rest[i + 2]), "command": rest[i + 3]} for i in range(0, len(rest), 4)}
summary = {
    "mode": mode, "python": python, "torch": torch, "device": device if device != "-" else "cpu", "dtype": dtype,
    "sd_scripts": host, "checks_seconds": int(checks), "total_seconds": int(total), "parts": parts,
    "checks_budget_seconds": 480 if mode == "cuda" else None,  # the three checks on one H200
}
with open(path, "w") as fh:
    json.dump(summary, fh, indent=1)
EOF
exit $FAILED
