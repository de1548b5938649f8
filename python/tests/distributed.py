"""Runs a test body on N CPU processes joined by a gloo process group (torch.multiprocessing), and
brings each rank's result back (torch.save through a temporary folder)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, folder: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHDYNAMO_DISABLE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    # No rank tears gloo down while a peer may still be talking to it: a pair destroyed under a
    # peer's pending send ends in std::terminate ("terminate called without an active
    # exception", SIGABRT) on a loaded machine. After the barrier nothing is in flight.
    dist.barrier()
    dist.destroy_process_group()
    # The result is on disk; skip the interpreter's teardown, whose destructor order across
    # torch's and gloo's threads is what aborts, not anything the test checks.
    os._exit(0)


def run_processes(world: int, fn, *args):
    """fn(rank, world, *args) on `world` processes (fn must be importable: a module-level function
    of a test helper module); returns the results in rank order. A failing rank fails the call."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_entry, args=(world, _free_port(), folder, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]
