"""Rank entry for the live tampering test: the runtime's worker, except that rank 0 dials the
test's relay (GEOTRAIN_TEST_RELAY=host:port) instead of rank 1's striped listener, as DNS or a
NAT pointing at a middlebox would. Only the address lookup changes; every byte still goes through
the real transport's handshake, frames, drops and resends."""

from __future__ import annotations

import os
import sys

from geotrain.runtime.worker import main
from geotrain.transport.striped import StripedTransport

_real_lookup = StripedTransport.lookup


def _via_relay(self: StripedTransport, rank: int) -> tuple[str, int]:
    if self.rank == 0 and rank == 1:
        host, _, port = os.environ["GEOTRAIN_TEST_RELAY"].rpartition(":")
        return host, int(port)
    return _real_lookup(self, rank)


StripedTransport.lookup = _via_relay

if __name__ == "__main__":
    sys.exit(main())
