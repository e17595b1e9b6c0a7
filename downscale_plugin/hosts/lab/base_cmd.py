"""``lab pretrain``: rerun a shipped lab base's pretraining (``lab/base.py``) and compare its digest
with the shipped file's, or (``--check``) only verify the shipped file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...provenance import code_revision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", required=True, metavar="{pretrain}")
    pretrain = sub.add_parser("pretrain", help="pretrain a shipped lab base bit for bit and compare it with the shipped weights")
    pretrain.add_argument("--base", default="multires", help="which base (default multires; lab/base.py BASES)")
    pretrain.add_argument("--out", default=".", help="folder for <base>.safetensors and <base>.json (default: the current folder)")
    pretrain.add_argument("--check", action="store_true", help="only verify the shipped file against its recorded sha256")


def run(args: argparse.Namespace) -> int:
    from ...lab.base import get_base, load_base, pretrain_base, sha256, shipped_record, state_bytes

    try:
        base = get_base(args.base)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if args.check:
        try:
            load_base(base.name)
        except (OSError, ValueError) as err:
            print(err, file=sys.stderr)
            return 1
        record = shipped_record(base)
        print(f"lab base {base.name!r}: {base.weights_path} ({record['bytes']} bytes) matches its recorded sha256 {record['sha256']}")
        return 0
    revision = code_revision()
    print(f"lab base {base.name!r}: pretraining at {base.settings.threads} thread(s), sizes {base.settings.sizes} px", flush=True)
    model, record = pretrain_base(base, log=lambda line: print(line, flush=True))
    blob = state_bytes(model)
    record.update(
        sha256=sha256(blob),
        bytes=len(blob),
        revision=revision,
        command=f"python -m downscale_plugin lab pretrain --base {base.name}",
    )
    try:
        shipped = shipped_record(base)  # read before writing: --out may be the shipped folder
    except FileNotFoundError:
        shipped = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{base.name}.safetensors").write_bytes(blob)
    (out / f"{base.name}.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out / base.name}.safetensors ({len(blob)} bytes, sha256 {record['sha256']}) and its record, {record['wall_s']} s")
    if shipped is None:
        print("no shipped base to compare with")
        return 0
    if shipped["sha256"] == record["sha256"]:
        print(f"matches the shipped base bit for bit (sha256 {shipped['sha256']})")
        return 0
    print(
        f"differs from the shipped base: sha256 {record['sha256']} here, {shipped['sha256']} shipped "
        f"(shipped: torch {shipped['torch']}, {shipped['threads']} thread(s); here: torch {record['torch']})"
    )
    return 1
