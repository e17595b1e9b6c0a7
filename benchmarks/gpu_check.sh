#!/usr/bin/env bash
# The GPU check, as a lent machine runs it. That machine starts bare, reaches no package registry, and gets this
# checkout and the carried paths (64 MiB in all); no ../shared travels. So, beforehand, here:
#
#   bash benchmarks/gpu_prepare.sh                     # fills .gpu/: wheels of what the image lacks, sd-scripts' code
#
# then on the machine (device tool: carry [".gpu"]), from the repository root:
#
#   bash benchmarks/gpu_check.sh "$OUT"                # one CUDA GPU of 80 GB
#   bash benchmarks/gpu_check.sh OUT --cpu-smoke       # here, on CPU: the same steps at small sizes (tests/test_gpu_check.py)
#
# Steps, with the machine's own python3 (PYTHON overrides) and its torch:
#   install         .gpu/requirements.txt from .gpu/wheels into a fresh folder, pip --no-index --no-deps (no registry,
#                   no pip configuration), first on PYTHONPATH; then this checkout; the host is .gpu/hosts/sd-scripts
#   production      bench_production.py: realized/predicted saving at 1 024 px on sd-scripts' Flux, SD3, Lumina and
#                   Anima at production width and published depth, bf16 (Flux with gradient checkpointing, below)
#   rng             gpu_rng_check.py: the RNG trap and unrouted-equals-native on Flux at production width, 1 024 px, bf16
#   certify_memory  bench_certify_memory.py: the certifier's peak device memory per adapter parameter, 20 M parameters
# Each part writes its JSON and log as it ends, and gpu_check.json (each step's command, exit status, seconds and the
# targets it missed; the python, torch, device, host, the carried packages' versions) is rewritten after each step:
# 8 files under OUT, the most the device tool brings back. GPU_CHECK_PARTS (default production,rng,certify_memory)
# runs some of the parts, e.g. to rerun one.
#
# Targets; the exit status is 1 when one is missed (the part's JSON and gpu_check.json's "missed" say which):
#   production      per architecture and route realized/predicted saving >= 0.95 and |predicted - measured relative
#                   cost| <= 0.03 of the native step; routing nothing costs <= 0.5 % of the native step, end to end
#                   and in the hook's own work
#   rng             the unrouted run equals native bitwise where native repeats itself, else lies within twice the
#                   native runs' spread with the routed run outside it; the generators' states equal; no trap violation
#   certify_memory  <= 34 device bytes per adapter parameter at each of the 2 x 2 settings (README.md's bound)
# The smoke run checks the same figures against bounds any CPU run meets (CPU times on a shared machine cannot hold
# the GPU's targets), so it runs the checks, not the values; GPU_CHECK_MISS=1 sets bounds no run meets (the exit
# status's test). Exit status 2: bad usage, no .gpu/ (run gpu_prepare.sh), the install failed, no torch, or no CUDA
# device without --cpu-smoke.
#
# Memory on an 80 GB card (benchmarks/gpu_memory_estimate.py; RESULTS.md "The prepared GPU check" has the table):
# bf16 weights + LoRA states + activations at 1 024 px and production text lengths, published depth, without
# gradient checkpointing: sd3 14.1 GiB, anima 16.0, lumina 28.7, flux 59.1. Checkpointed where that passes 58.5 GiB
# (three quarters of the 78 GiB an H100 leaves usable): flux, 25.8 GiB with it. The check's peak is Flux's float32
# build before its bf16 conversion, 44.3 GiB.
# Time on one H100 (gpu_time_estimate.py: the FLOP model's steps, downscale_plugin/flops.py, at an assumed 400
# TFLOP/s effective bf16, plus the start-up, building and imports a CPU smoke run measured): about 5 minutes in all
# (5.5 at 200 TFLOP/s), under the 8 a device call is planned for.
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
ALL_PARTS=(production rng certify_memory)
IFS=, read -r -a PARTS <<<"${GPU_CHECK_PARTS:-production,rng,certify_memory}"
for name in "${PARTS[@]}"; do
    if [[ " ${ALL_PARTS[*]} " != *" $name "* ]]; then
        echo "$0: GPU_CHECK_PARTS: unknown part '$name' (allowed: ${ALL_PARTS[*]})" >&2
        exit 2
    fi
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
GPU=$REPO/.gpu
CHECKPOINTED=flux  # gpu_memory_estimate.py: only Flux passes 58.5 GiB without gradient checkpointing
if [[ ! -f "$GPU/requirements.txt" || ! -f "$GPU/hosts/sd-scripts/flux_train_network.py" ]]; then
    echo "$0: no prepared $GPU (run 'bash benchmarks/gpu_prepare.sh' where a registry is reachable, then carry .gpu)" >&2
    exit 2
fi
export SD_SCRIPTS_DIR=$GPU/hosts/sd-scripts  # the host gpu_prepare.sh copied, whatever the environment says
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$SECONDS
STEPS=()    # name, exit status, seconds, command: four entries a step
SUMMARY=()  # the run's facts for gpu_check.json, set once the install is done

summarize() {  # rewrite OUT/gpu_check.json from the steps so far and each part's JSON
    "$PY" - "$OUT" "$((SECONDS - START))" "${SUMMARY[@]}" -- "${STEPS[@]}" <<'EOF'
import json, os, sys
out, total, *rest = sys.argv[1:]
facts, steps = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
summary = dict(zip(facts[::2], facts[1::2]))
summary["carried"] = json.loads(summary.get("carried", "{}"))
parts, missed = {}, []
for i in range(0, len(steps), 4):
    name, code, seconds, command = steps[i : i + 4]
    part = {"exit": int(code), "seconds": int(seconds), "command": command, "missed": []}
    path = os.path.join(out, f"{name}.json")
    if name != "install" and os.path.exists(path):
        with open(path) as fh:
            part["missed"] = json.load(fh).get("missed", [])
    if int(code) and not part["missed"]:
        part["missed"] = [f"exit status {code} (log: {name}.log)"]
    missed += [f"{name}: {m}" for m in part["missed"]]
    parts[name] = part
summary.update(parts=parts, missed=missed, ok=not missed, total_seconds=int(total))
summary["checks_seconds"] = sum(p["seconds"] for n, p in parts.items() if n != "install")
summary["checks_budget_seconds"] = 480 if summary.get("mode") == "cuda" else None  # the plan for one device call
with open(os.path.join(out, "gpu_check.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
EOF
}

step() {  # NAME COMMAND...: run one step, its output to OUT/NAME.log, and record it
    local name=$1 start=$SECONDS
    shift
    echo "== $name: $*" >&2
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 6 "$OUT/$name.log" >&2
    STEPS+=("$name" "$rc" "$((SECONDS - start))" "$*")
    summarize
    return $rc
}

# The install: into a fresh folder outside OUT (the device tool brings back files, not a package tree). pip reads no
# configuration and no PIP_* variable (--isolated, PIP_CONFIG_FILE=/dev/null) and reaches no index (--no-index).
SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
if ! step install env PIP_CONFIG_FILE=/dev/null "$PY" -m pip --isolated install --no-index --no-deps --no-compile \
    --no-cache-dir --disable-pip-version-check --target "$SITE" --find-links "$GPU/wheels" -r "$GPU/requirements.txt"; then
    echo "$0: could not install .gpu/requirements.txt from $GPU/wheels with $PY (log: $OUT/install.log)" >&2
    exit 2
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# the interpreter's torch, whether the CPU has bf16 kernels, the CUDA device (none: -), each carried package's version
# and whether it imports from the install (a JSON object), one a line
PROBE=$("$PY" - "$GPU/requirements.txt" "$SITE" <<'EOF'
import importlib.metadata as md, json, os, sys
import torch
bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
print(torch.__version__)
print(int(bf16))
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
pins = [line.split("==")[0] for line in open(sys.argv[1]) if line.strip()]
site = os.path.realpath(sys.argv[2])
carried = {}
for name in pins:
    dist = md.distribution(name)
    carried[name] = {"version": dist.version, "from_install": os.path.realpath(str(dist.locate_file(""))) == site}
print(json.dumps(carried))
EOF
)
{ read -r TORCH; read -r BF16_CPU; read -r DEVICE; read -r CARRIED; } <<<"$PROBE"
if [[ -z "${CARRIED:-}" ]]; then
    echo "$0: $PY cannot import torch or the carried packages (PYTHONPATH=$PYTHONPATH)" >&2
    exit 2
fi

MODE=cuda DTYPE=bf16
if [[ "$SMOKE" == "--cpu-smoke" ]]; then
    MODE=--cpu-smoke
    DTYPE=$([[ "$BF16_CPU" == 1 ]] && echo bf16 || echo fp32)
fi
REVISION=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || sed -n 's/^revision /gpu_prepare.sh at /p' "$GPU/SOURCES")
SUMMARY=(mode "$MODE" python "$PY" torch "$TORCH" device "$([[ "$DEVICE" == - ]] && echo cpu || echo "$DEVICE")" dtype "$DTYPE"
    sd_scripts "$SD_SCRIPTS_DIR" revision "$REVISION" carried "$CARRIED")
summarize

if [[ "$MODE" == --cpu-smoke ]]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    LOOSE=(--enforce --min_realized=-1e9 --max_error 1e9 --max_overhead 1e9)  # any finite figure meets these
    PRODUCTION=(--device cpu --dtype "$DTYPE" --archs sd3,anima,lumina,flux --px 128 --warmup 0 --reps 1 --threads 1 "${LOOSE[@]}")
    RNG=(--device cpu --dtype "$DTYPE" --arch flux --px 128 --steps 2 --threads 1)
    MEMORY=(--device cpu --params 200000 --probes 8,16 --bins 2,4 --threads 1 --enforce --max_bytes_per_param 1e9)
else
    if [[ "$DEVICE" == "-" ]]; then
        echo "$0: torch $TORCH at $PY sees no CUDA device (on a CPU: --cpu-smoke)" >&2
        exit 2
    fi
    PRODUCTION=(--device cuda --dtype bf16 --full_depth --warmup 2 --reps 8 --enforce)
    RNG=(--device cuda --dtype bf16 --arch flux --px 1024 --steps 3)
    MEMORY=(--device cuda --params 20000000 --probes 8,16 --bins 2,4 --enforce)
fi
PRODUCTION+=(--gradient_checkpointing "$CHECKPOINTED")
if [[ "${GPU_CHECK_MISS:-}" == 1 ]]; then  # bounds no run meets: the exit status's test
    PRODUCTION+=(--min_realized 1e9)
    MEMORY+=(--max_bytes_per_param 0)
fi

FAILED=0
for name in "${PARTS[@]}"; do
    case $name in
        production) step production "$PY" "$REPO/benchmarks/bench_production.py" "${PRODUCTION[@]}" --json "$OUT/production.json" ;;
        rng) step rng "$PY" "$REPO/benchmarks/gpu_rng_check.py" "${RNG[@]}" --json "$OUT/rng.json" ;;
        certify_memory) step certify_memory "$PY" "$REPO/benchmarks/bench_certify_memory.py" "${MEMORY[@]}" --json "$OUT/certify_memory.json" ;;
    esac || FAILED=1
done
exit $FAILED
