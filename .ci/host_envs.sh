#!/usr/bin/env bash
# Build one virtual environment per real host from that host's own requirements, the way a user
# would: torch and torchvision first, the host's pins, then this project with `pip install -e` (no
# PYTHONPATH). The host snapshots in ../shared/hosts are read-only, so each is copied to a writable
# folder first (its `-e .` writes an egg-info there).
#
# torch==2.14.1 / torchvision==0.29.1 are the CUDA builds (PyPI's only Linux wheels: they pull
# nvidia-* cuda-toolkit, cudnn, nccl and triton, about 4 GB), run here on the CPU. A CPU pair cannot be
# had from the registries this machine reaches: the one CPU torch on it is 2.13.0+cpu (a local wheel,
# the default suite's), and PyPI's torchvision 0.28.0, its match, is built against CUDA torch
# (`import torchvision` with 2.13.0+cpu fails: "operator torchvision::nms does not exist"); CPU
# torchvision wheels live only on PyTorch's own index.
#
# sd-scripts' environment also gets the [lab] extra (peft): tests/test_lab.py compares the lab's σ
# sampler bitwise with the checkout's own (SD_SCRIPTS_DIR), and the lab imports peft.
#
#   .ci/host_envs.sh WORK     -> WORK/sd-scripts, WORK/musubi-tuner (host copies)
#                                WORK/venv-sd-scripts, WORK/venv-musubi (environments)
# The host copies and their environments are made once; the project is installed into each every time.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
hosts="${HOSTS_DIR:-$repo/../shared/hosts}"
work="$(mkdir -p "$1" && cd "$1" && pwd)"
pip_q=(-q --disable-pip-version-check)
torch_pair=(torch==2.14.1 torchvision==0.29.1)  # CUDA builds, see above

copy_host() {  # copy_host NAME: a writable copy of the snapshot, made once
  [ -d "$work/$1" ] || cp -r "$hosts/$1" "$work/$1"
  chmod -R u+w "$work/$1"
}

copy_host sd-scripts
py="$work/venv-sd-scripts/bin/python"
if [ ! -x "$py" ]; then
  python3 -m venv "$work/venv-sd-scripts"
  "$py" -m pip install "${pip_q[@]}" "${torch_pair[@]}"
  (cd "$work/sd-scripts" && "$py" -m pip install "${pip_q[@]}" -r requirements.txt)
fi
"$py" -m pip install "${pip_q[@]}" -e "$repo[map,dev,lab]"

copy_host musubi-tuner
py="$work/venv-musubi/bin/python"
if [ ! -x "$py" ]; then
  python3 -m venv "$work/venv-musubi"
  "$py" -m pip install "${pip_q[@]}" "${torch_pair[@]}"
  "$py" -m pip install "${pip_q[@]}" -e "$work/musubi-tuner"
fi
"$py" -m pip install "${pip_q[@]}" -e "$repo[map,dev]"
