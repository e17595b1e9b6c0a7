#!/usr/bin/env bash
# Fills .gpu/ in this checkout (git-ignored) with what a lent GPU machine lacks for benchmarks/gpu_check.sh. That
# machine starts bare, reaches no package registry and gets only the working tree and the carried paths (64 MiB in
# all), so this runs here, where the registry is reachable, and the device run carries the folder:
#
#   bash benchmarks/gpu_prepare.sh                 # here; SD_SCRIPTS_DIR: the host (default ../shared/hosts/sd-scripts)
#   device run: carry [".gpu"], command: bash benchmarks/gpu_check.sh "$OUT"
#
# .gpu/requirements.txt  the pins below; gpu_check.sh installs exactly these (--no-index --no-deps)
# .gpu/wheels/           their wheels for the machine's CPython 3.12 on manylinux x86-64, then for this machine's python
#                        (the smoke run's), which adds a file only where a wheel is not for both (pure-python and abi3
#                        wheels are); pip picks each interpreter's own from the one folder
# .gpu/hosts/sd-scripts/ sd-scripts' Python code the check imports (top-level scripts, library/, networks/): no git
#                        history, no images, nothing else
# .gpu/SOURCES           where each came from, the host tree's hash, this checkout's revision
#
# The pins. The machine's image ('cuda', device tool KINDS.md: Python 3.12.3, torch 2.11.0, accelerate 1.15.0,
# safetensors 0.8.0, transformers 5.17.0, huggingface_hub 1.33.0, numpy 2.5.2, scipy, einops, opencv, rich,
# sentencepiece) has no diffusers, toml, voluptuous or imagesize, which sd-scripts imports, and its transformers 5
# lacks CLIPFeatureExtractor, which sd-scripts' library/lpw_stable_diffusion.py imports through train_util.py. So
# sd-scripts' own pins (its requirements.txt) of those, with what transformers 4.54.1 needs that the image holds at
# another version: huggingface-hub < 1.0 and tokenizers < 0.22. Everything else comes from the image.
# Fails (exit 1) when .gpu/ passes 64 MiB; prints its size and the size of all that travels.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
GPU=$REPO/.gpu
PY=${PYTHON:-python3}
HOST=${SD_SCRIPTS_DIR:-$REPO/../shared/hosts/sd-scripts}
LIMIT=$((64 * 1024 * 1024))  # the device tool's limit on the working tree and carried paths together
PINS=(
    transformers==4.54.1      # sd-scripts' pin; the image's 5.17.0 has no CLIPFeatureExtractor
    tokenizers==0.21.4        # transformers 4.54.1: >= 0.21, < 0.22 (the image: 0.23.2); an abi3 wheel
    huggingface-hub==0.34.3   # sd-scripts' pin; transformers 4.54.1 wants < 1.0 (the image: 1.33.0)
    diffusers==0.32.1         # sd-scripts' pin; train_network.py imports it
    toml==0.10.2              # sd-scripts' pin; this project's own dependency too
    voluptuous==0.15.2        # sd-scripts' pin; library/config_util.py
    imagesize==1.4.1          # sd-scripts' pin; library/train_util.py
)

if [[ ! -f "$HOST/flux_train_network.py" ]]; then
    echo "$0: no sd-scripts checkout at $HOST (set SD_SCRIPTS_DIR)" >&2
    exit 2
fi
HOST=$(cd "$HOST" && pwd)
rm -rf "$GPU"
mkdir -p "$GPU/wheels" "$GPU/hosts/sd-scripts"
printf '%s\n' "${PINS[@]}" >"$GPU/requirements.txt"

pip_download=("$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: -d "$GPU/wheels" -r "$GPU/requirements.txt")
machine=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
echo "== wheels for the machine (CPython 3.12, manylinux x86-64)" >&2
"${pip_download[@]}" "${machine[@]}"
shared=$(ls "$GPU/wheels")
echo "== wheels for this python ($("$PY" -c 'import sys; print(sys.version.split()[0])')), where the machine's are not for it" >&2
"${pip_download[@]}"
local_only=$(comm -13 <(echo "$shared") <(ls "$GPU/wheels"))

echo "== sd-scripts' Python code from $HOST" >&2
files=$(cd "$HOST" && find . -maxdepth 1 -name '*.py' && find library networks -name '*.py' -not -path '*/__pycache__/*')
# shellcheck disable=SC2086 # one path a word: the host's file names have no spaces
(cd "$HOST" && tar -cf - $files) | tar -C "$GPU/hosts/sd-scripts" -xf -
host_hash=$(cd "$GPU/hosts/sd-scripts" && find . -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
revision=unknown  # a checkout without git history: gpu_check.sh then says so
if git -C "$REPO" rev-parse -q HEAD >/dev/null 2>&1; then
    revision=$(git -C "$REPO" rev-parse HEAD)$(git -C "$REPO" diff --quiet HEAD -- . || echo "+changes")
fi
{
    echo "revision $revision"
    echo "sd-scripts $HOST: $(echo "$files" | wc -l) files, sha256 of the tree $host_hash"
    echo "wheels for CPython 3.12 manylinux x86-64 (and any python where pure or abi3): $(echo "$shared" | tr '\n' ' ')"
    echo "wheels for this python only (the smoke run's): ${local_only:-none}"
} >"$GPU/SOURCES"
cat "$GPU/SOURCES" >&2

size=$(du -sb "$GPU" | cut -f1)
if [[ $revision == unknown ]]; then  # no git to say what is ignored: the whole checkout
    tree=$(du -sb --exclude=.gpu "$REPO" | cut -f1)
else  # what the device tool sends: tracked files and untracked ones git does not ignore
    tree=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
fi
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "$GPU: $(mib "$size"); with the working tree that travels: $(mib $((size + tree))) (limit $(mib $LIMIT))"
if ((size + tree > LIMIT)); then
    echo "$0: .gpu and the working tree pass the device tool's 64 MiB" >&2
    exit 1
fi
