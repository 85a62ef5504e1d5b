"""htb rate limits on the router's egress towards each DC: link capacity and a per-connection cap.

A real long fat pipe limits one TCP connection by window/RTT; here that limit is a class per flow
bucket: under one parent class per (source DC -> this DC) link (`rate = ceil = capacity`), `BUCKETS`
children (`rate` tiny, `ceil = per-connection cap`), chosen by a u32 match on TCP source-port bits
1..6 (Linux hands connect() even ephemeral ports, so bit 0 would fill only half the buckets).
Children get a tiny `rate` because htb guarantees each child its rate even past the parent.

Two connections that hash to the same bucket share one cap; the project's own striped transport
binds its connections to consecutive even source ports so they never do. Non-TCP traffic from a
source DC goes to its own leaf under the link (capped by capacity only).

Pure functions returning `tc` argument lists, so the layout is testable without root.
"""

from __future__ import annotations

BUCKET_BITS = 6
BUCKETS = 1 << BUCKET_BITS
PORT_MASK = (BUCKETS - 1) << 1          # source-port bits 1..6
OTHER_LEAF = 0xFF                       # minor offset of the non-TCP leaf under a link class


def _bits(gbps: float) -> str:
    return f"{max(8, int(gbps * 1e9))}bit"


MIN_MTU, MAX_MTU = 1280, 65000
PACKET_MS = 1.0                         # a packet takes at most this long to serialize at the slowest cap


def emulation_mtu(rates_gbps: list[float], max_mtu: int = MAX_MTU) -> int:
    """The MTU of the emulated network: a packet serializes in at most PACKET_MS at the slowest
    per-connection cap (clamped to [MIN_MTU, max_mtu]).

    htb lets a packet through whenever its class has credit and charges it afterwards, so a
    message smaller than a packet (or than the burst) crosses at line speed however low the cap:
    with the former fixed 64 KB MTU (and 130 KB of burst) a 16 KB boundary tensor on a 5 Mbit/s
    link took ~0 ms instead of its 26 ms, and a validation run at 5 Mbit/s ran as fast as one at
    50. Fast links keep large packets (the Python delayer handles a few thousand packets/s)."""
    slowest = min((r for r in rates_gbps if r > 0), default=0.0)
    if slowest <= 0:
        return max_mtu
    return int(min(max_mtu, max(MIN_MTU, slowest * 1e9 / 8 * PACKET_MS * 1e-3)))


def _burst(gbps: float, mtu: int) -> int:
    """Bytes: one MTU-sized packet (htb needs burst >= MTU) or 1 ms at the rate, whichever is more:
    a larger burst lets small messages through faster than the cap (see emulation_mtu)."""
    return int(max(mtu + 100, gbps * 1e9 / 8 * 0.001))


def bucket_of_port(port: int) -> int:
    return (port & PORT_MASK) >> 1


def link_classid(src_index: int) -> int:
    return (src_index + 1) << 8


def htb_commands(dev: str, sources: list[tuple[int, str, float, float]], mtu: int,
                 queue_bytes: int | None = None) -> list[list[str]]:
    """`tc` argv lists (without the leading "tc") shaping `dev`, the router's port towards one DC.

    sources: (source DC index, source subnet CIDR, capacity Gbit/s, per-connection Gbit/s) for every
    DC with a link to this one. queue_bytes: a bfifo of that size under each leaf (a router buffer
    of about one bandwidth-delay product, so queueing delay stays bounded like on a real WAN);
    None keeps htb's default packet fifo."""
    cmds: list[list[str]] = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "ffff",
                              "r2q", "1"]]
    for src, cidr, cap, per_conn in sources:
        parent = link_classid(src)
        per_conn = min(per_conn, cap)
        burst = str(_burst(cap, mtu))
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{parent:x}", "htb",
                     "rate", _bits(cap), "ceil", _bits(cap), "burst", burst, "cburst", burst,
                     "quantum", str(mtu + 2000)])
        # Guaranteed child rates must sum well below the parent's: 1/(1000 * leaves) of capacity.
        tiny = _bits(cap / (1000 * (BUCKETS + 1)))
        leaf_burst = str(_burst(per_conn, mtu))
        for b in [*range(BUCKETS), OTHER_LEAF]:
            ceil = per_conn if b != OTHER_LEAF else cap
            cls = parent + (b + 1 if b != OTHER_LEAF else OTHER_LEAF)
            cmds.append(["class", "add", "dev", dev, "parent", f"1:{parent:x}", "classid", f"1:{cls:x}", "htb",
                         "rate", tiny, "ceil", _bits(ceil), "burst", leaf_burst, "cburst", leaf_burst,
                         "quantum", str(mtu + 2000)])
            if b != OTHER_LEAF:
                cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                             "match", "ip", "src", cidr, "match", "ip", "protocol", "6", "0xff",
                             "match", "ip", "sport", str(b << 1), hex(PORT_MASK), "flowid", f"1:{cls:x}"])
            if queue_bytes:
                cmds.append(["qdisc", "add", "dev", dev, "parent", f"1:{cls:x}", "handle", f"{cls:x}:", "bfifo",
                             "limit", str(max(queue_bytes, 4 * mtu))])
        cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                     "match", "ip", "src", cidr, "flowid", f"1:{parent + OTHER_LEAF:x}"])
    return cmds
