#!/usr/bin/env bash
# The prepared GPU check: on one CUDA GPU, in one command, writes under OUT_DIR
#   production.json     realized/predicted saving at 1 024 px on every sd-scripts architecture at production
#                       width and published depth (bench_production.py --device cuda --dtype bf16 --full_depth)
#   rng.json            the RNG trap and bitwise-when-unrouted on the device (gpu_rng_check.py, Flux, 1 024 px)
#   certify_memory.json the certifier's peak device (and host) memory per adapter parameter, 20 M parameters,
#                       2 probe counts x 2 bin counts (bench_certify_memory.py)
#   gpu_check.json      each part's command, exit status and seconds
# plus each part's log. Every part runs even when one before it failed; the exit status is 1 if any failed.
#
#   SD_SCRIPTS_DIR=/path/to/sd-scripts benchmarks/gpu_check.sh OUT_DIR              # one CUDA GPU, < 8 min
#   SD_SCRIPTS_DIR=/path/to/sd-scripts benchmarks/gpu_check.sh OUT_DIR --cpu-smoke  # CPU, tiny sizes (tests/test_gpu_check.py)
#
# Needs sd-scripts (main 48d368fa) and its requirements importable by PYTHON (default python3); the
# project is taken from this checkout. --cpu-smoke runs the same scripts on CPU at small sizes (one
# architecture at 128 px and reduced depth, a 0.2 M-parameter adapter), so the whole chain is known
# to work before a device is lent.
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
if [[ -z "${SD_SCRIPTS_DIR:-}" ]]; then
    echo "$0: set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)" >&2
    exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [[ "$SMOKE" == "--cpu-smoke" ]]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    PRODUCTION=(--device cpu --dtype fp32 --archs anima --px 128 --warmup 0 --reps 1 --threads 1)
    RNG=(--device cpu --dtype fp32 --arch anima --px 128 --steps 2 --threads 1)
    MEMORY=(--device cpu --params 200000 --probes 8,16 --bins 2,4 --threads 1)
else
    PRODUCTION=(--device cuda --dtype bf16 --full_depth)
    RNG=(--device cuda --dtype bf16 --arch flux --px 1024 --steps 3)
    MEMORY=(--device cuda --params 20000000 --probes 8,16 --bins 2,4)
fi

FAILED=0
PARTS=()
part() {  # NAME SCRIPT ARGS...: run one part, log it, record its status
    local name=$1 script=$2
    shift 2
    local start=$SECONDS
    echo "== $name: $PY benchmarks/$script $*" >&2
    "$PY" "$REPO/benchmarks/$script" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 6 "$OUT/$name.log" >&2
    [[ $rc -eq 0 ]] || FAILED=1
    PARTS+=("$name" "$rc" "$((SECONDS - start))" "benchmarks/$script $*")
}

part production bench_production.py "${PRODUCTION[@]}" --json "$OUT/production.json"
part rng gpu_rng_check.py "${RNG[@]}" --json "$OUT/rng.json"
part certify_memory bench_certify_memory.py "${MEMORY[@]}" --json "$OUT/certify_memory.json"

"$PY" - "$OUT/gpu_check.json" "${SMOKE:-cuda}" "${PARTS[@]}" <<'EOF'
import json, sys
path, mode, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
parts = {rest[i]: {"exit": int(rest[i + 1]), "seconds": int(rest[i + 2]), "command": rest[i + 3]} for i in range(0, len(rest), 4)}
with open(path, "w") as fh:
    json.dump({"mode": mode, "parts": parts}, fh, indent=1)
EOF
exit $FAILED
