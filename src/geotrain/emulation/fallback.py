"""Choosing between the kernel-emulated WAN and the user-space fallback, for the runtime.

`start_wan(cluster)` returns a started WanEmulation where this machine allows it (root, netns,
TUN), else None after saying clearly, once, on stderr, that delay and rate limits are emulated
inside the project's own transport instead; `fallback_shaper(cluster)` then gives the
StripedTransport shaper per DC pair. In the fallback only StripedTransport traffic is shaped
(gloo collectives inside a DC are unaffected anyway; cross-DC gloo traffic would not be delayed).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from geotrain.config import Cluster
from geotrain.emulation.network import WanEmulation, WanUnavailable, emulation_available
from geotrain.emulation.shaper import ShaperConfig, shaper_for_link

FALLBACK_NOTICE = ("geotrain wan: kernel WAN emulation unavailable ({why}); emulating WAN delay and rate limits "
                   "inside the project's own transport (StripedTransport shaper) instead -- only its cross-DC "
                   "transfers are delayed and rate-limited")


def start_wan(cluster: Cluster, *, rate_scale: float = 1.0, **kw) -> WanEmulation | None:
    ok, why = emulation_available()
    if ok:
        try:
            return WanEmulation(cluster, rate_scale=rate_scale, **kw).start()
        except WanUnavailable as e:
            why = str(e)
    print(FALLBACK_NOTICE.format(why=why), file=sys.stderr)
    return None


def fallback_shaper(cluster: Cluster, dc_of_rank: Callable[[int], str], my_dc: str,
                    rate_scale: float = 1.0) -> Callable[[int], ShaperConfig | None]:
    """For StripedTransport(shaper=...): the link's limits towards a rank in another DC, None inside a DC."""

    def shaper(dst: int) -> ShaperConfig | None:
        other = dc_of_rank(dst)
        if other == my_dc:
            return None
        link = cluster.link(my_dc, other)
        return shaper_for_link(link, rate_scale) if link is not None else None

    return shaper
