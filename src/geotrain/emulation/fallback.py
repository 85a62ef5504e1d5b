"""The user-space fallback where the kernel-emulated WAN is impossible (no root, netns or TUN;
`runtime.cross_dc.open_wan` decides and says so): `fallback_shaper(cluster)` gives the
StripedTransport shaper per DC pair. In the fallback only StripedTransport traffic is shaped
(gloo collectives inside a DC are unaffected anyway; cross-DC gloo traffic would not be delayed).
"""

from __future__ import annotations

from collections.abc import Callable

from geotrain.emulation.user_shaper import ShaperConfig, shaper_for_link
from geotrain.spec import Cluster


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
