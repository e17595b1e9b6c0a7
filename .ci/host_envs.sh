#!/usr/bin/env bash
# Build one virtual environment per real host from that host's own requirements, the way a user
# would: CPU torch first (the hosts' notes: a CUDA build must never be pulled), the host's pins,
# then this project with `pip install -e` (no PYTHONPATH). The host snapshots in ../shared/hosts are
# read-only, so each is copied to a writable folder first (its `-e .` writes an egg-info there).
#
#   .ci/host_envs.sh WORK     -> WORK/sd-scripts, WORK/musubi-tuner (host copies)
#                                WORK/venv-sd-scripts, WORK/venv-musubi (environments)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
hosts="${HOSTS_DIR:-$repo/../shared/hosts}"
work="$(mkdir -p "$1" && cd "$1" && pwd)"
pip_q=(-q --disable-pip-version-check)

copy_host() {  # copy_host NAME: a writable copy of the snapshot, made once
  [ -d "$work/$1" ] || cp -r "$hosts/$1" "$work/$1"
  chmod -R u+w "$work/$1"
}

copy_host sd-scripts
if [ ! -x "$work/venv-sd-scripts/bin/python" ]; then
  python3 -m venv "$work/venv-sd-scripts"
  py="$work/venv-sd-scripts/bin/python"
  "$py" -m pip install "${pip_q[@]}" torch==2.14.1 torchvision==0.29.1
  (cd "$work/sd-scripts" && "$py" -m pip install "${pip_q[@]}" -r requirements.txt)
  "$py" -m pip install "${pip_q[@]}" -e "$repo[map,dev]"
fi

copy_host musubi-tuner
if [ ! -x "$work/venv-musubi/bin/python" ]; then
  python3 -m venv "$work/venv-musubi"
  py="$work/venv-musubi/bin/python"
  "$py" -m pip install "${pip_q[@]}" torch==2.14.1 torchvision==0.29.1
  "$py" -m pip install "${pip_q[@]}" -e "$work/musubi-tuner"
  "$py" -m pip install "${pip_q[@]}" -e "$repo[map,dev]"
fi
