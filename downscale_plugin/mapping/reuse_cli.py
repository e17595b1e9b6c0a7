"""``python -m downscale_plugin windows``: the cache of certified windows (``reuse.py``), and the files users share.

    python -m downscale_plugin windows list
    python -m downscale_plugin windows export 3f9a flux1-dev_r16_1024.toml      # an entry by digest prefix
    python -m downscale_plugin windows import flux1-dev_r16_1024.toml           # validated, its provenance shown, then cached
    python -m downscale_plugin windows export --plugin_toml 3f9a windows.toml   # the windows alone (downscale_config=)
    python -m downscale_plugin windows remove 3f9a

``--cache DIR`` picks the folder (default as ``mode = "auto"`` finds it: ``reuse.cache_dir``). A run with
``mode = "auto"`` whose key is an imported entry's routes by its windows without certifying.
"""

from __future__ import annotations

import argparse
import os

from ..cli import fail, register
from .reuse import Entry, EntryError, cache_dir, entries, find_entry, import_entry, provenance, read_entry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache", help="the cache folder (default: $DOWNSCALE_PLUGIN_CACHE, else the user cache's downscale_plugin/windows)"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every cached entry: digest, date, arch, host, adapter, buckets, routes, how it ended, cost")
    export = actions.add_parser("export", help="write an entry (digest prefix or file) to a file to share")
    export.add_argument("entry")
    export.add_argument("dest")
    export.add_argument("--plugin_toml", action="store_true", help="write only the windows TOML (a downscale_config= file), not the key")
    imported = actions.add_parser("import", help="validate a shared windows file, show its provenance and add it to the cache")
    imported.add_argument("file")
    imported.add_argument("--replace", action="store_true", help="replace other windows cached under the same key")
    remove = actions.add_parser("remove", help="delete an entry (digest prefix)")
    remove.add_argument("entry")


def _row(e: Entry) -> str:
    routes = e.windows().get("routes", [])
    k = e.key
    return (
        f"{os.path.basename(e.path).removesuffix('.toml')}  {e.date or '?':<20}  {k.arch:<8} {k.host:<12} {k.network} r{k.rank or '?'}  "
        f"model {k.model[:19]}…  buckets {len(k.buckets)}  ε {k.margin:g}  {len(routes)} route rule(s)  {e.outcome}  cost {e.cost:.1f}"
    )


def run(args: argparse.Namespace) -> int:
    folder = cache_dir(args.cache)
    try:
        if args.action == "list":
            found, bad = entries(folder)
            print(f"{folder}: {len(found)} entr{'y' if len(found) == 1 else 'ies'}")
            for e in found:
                print(_row(e))
            for err in bad:
                print(f"skipped: {err}")
            return 0
        if args.action == "import":
            entry = read_entry(args.file)
            print("\n".join([f"{args.file}:", *(f"  {line}" for line in provenance(entry))]))
            print(f"imported as {import_entry(entry, folder, args.replace)}")
            return 0
        entry = find_entry(args.entry, folder)
        if args.action == "remove":
            os.remove(entry.path)
            print(f"removed {entry.path}")
            return 0
        with open(args.dest, "w") as fh:
            fh.write(entry.windows_text if args.plugin_toml else entry.render())
        print(f"wrote {args.dest}")
        return 0
    except EntryError as err:
        return fail([f"{args.action}: {err.where}: {p}" for p in err.problems])
    except (OSError, ValueError) as err:
        return fail([f"{args.action}: {err}"])


register("windows", "the cache of certified windows: list, export, import (validated), remove", add_arguments, run)
