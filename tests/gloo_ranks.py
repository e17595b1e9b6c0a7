"""Two-process tests on gloo (``torch.multiprocessing.spawn``, no launcher): the rendezvous store is served by the
test process on a port the kernel assigns, and held until the ranks are done. A port picked free in advance and
released before the ranks bind it can be taken by another process in between (EADDRINUSE under load); a store
that is already listening cannot lose its port.

A rank that has done its work leaves with ``os._exit(0)``, past the interpreter's teardown: there, after the rank's
results are on disk and its group destroyed, torch's C++ static destructors sometimes end in ``std::terminate``
("terminate called without an active exception", SIGABRT with no Python frame on any thread; about 1 in 25 runs of
``tests/test_musubi_ranks.py``'s two-run resume ranks), which would fail a test whose ranks all passed."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=300)


def spawn_ranks(main: Callable[..., None], world: int, *args: object) -> None:
    """Run ``main(rank, world, port, *args)`` on ``world`` processes, the rendezvous store on ``port``."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    mp.spawn(_rank, args=(main, world, store.port, *args), nprocs=world, join=True)


def _rank(rank: int, main: Callable[..., None], world: int, port: int, *args: object) -> None:
    main(rank, world, port, *args)  # an exception ends the rank through mp.spawn, which reports it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def join_group(rank: int, world: int, port: int) -> None:
    """One rank's process group (one torch thread: two ranks share the machine's cores)."""
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
