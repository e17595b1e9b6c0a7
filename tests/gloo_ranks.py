"""Two-process tests on gloo (``torch.multiprocessing.spawn``, no launcher): the rendezvous store is served by the
test process on a port the kernel assigns, and held until the ranks are done. A port picked free in advance and
released before the ranks bind it can be taken by another process in between (EADDRINUSE under load); a store
that is already listening cannot lose its port."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=300)


def spawn_ranks(main: Callable[..., None], world: int, *args: object) -> None:
    """Run ``main(rank, world, port, *args)`` on ``world`` processes, the rendezvous store on ``port``."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    mp.spawn(main, args=(world, store.port, *args), nprocs=world, join=True)


def join_group(rank: int, world: int, port: int) -> None:
    """One rank's process group (one torch thread: two ranks share the machine's cores)."""
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
