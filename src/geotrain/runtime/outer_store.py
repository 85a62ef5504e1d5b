"""The DiLoCo workers' rendezvous: a torch.distributed TCPStore that outlives any one worker.

Each worker is its own torch.distributed job (its own store and process groups), so a lost worker
takes nothing of the others' down. What the workers share -- where each rank's outer transport
listens, heartbeats, and who takes part in each outer exchange (runtime.outer_group) -- lives in
this store, hosted by its own process: `python -m geotrain.runtime.outer_store HOST PORT` (the
built-in launcher starts it in the first worker's DC; under torchrun, start it on a host every
worker reaches and give its address to each worker's ranks). It holds only small strings; the
outer gradients move over the authenticated striped transport.
"""

from __future__ import annotations

import signal
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

READY = "geotrain outer store ready"


def connect(address: str, timeout_s: float = 60.0) -> TCPStore:
    """A client of the store at "host:port"."""
    from torch.distributed import TCPStore  # here, not at the top: the launcher imports READY, never torch

    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def serve(host: str, port: int) -> None:
    """Host the store until SIGTERM (the launcher's, at the end of the run)."""
    from torch.distributed import TCPStore  # here, not at the top: see connect

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    print(f"{READY} on {host}:{store.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
