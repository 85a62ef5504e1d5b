"""NCCL on one host that emulates several: each emulated DC is a host of its own to NCCL.

All emulated DCs (network namespaces, `network`) share one machine, and a namespace does not hide its
GPUs, so without this NCCL would join ranks of two DCs as ranks of one host, by P2P or SHM, and the
emulated WAN would carry none of their traffic (a wrong measurement, not an error).
"""

from __future__ import annotations

from collections.abc import Mapping


def nccl_host_env(host_id: str, ifname: str, inherited: Mapping[str, str]) -> dict[str, str]:
    """NCCL variables that make an emulated DC a host of its own, minus those `inherited` sets (a
    user's own NCCL settings win). What NCCL documents of each:
    - NCCL_HOSTID: overrides the string NCCL hashes into its host identity (by default the kernel's
      boot_id, /proc/sys/kernel/random/boot_id), which decides whether two ranks may use the
      P2P/IPC/SHM transports (NVIDIA/nccl PR #248, "Rework the P2P/IPC/SHM container fix"). One id per
      DC: ranks of one DC keep P2P/SHM, ranks of two DCs take the NET transport.
    - NCCL_SOCKET_IFNAME: which IP interfaces NCCL uses; a leading "=" matches the exact name
      (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html). "=gt0" is the namespace's veth to
      the router, so NET traffic crosses the delayer and the shaper.
    - NCCL_IB_DISABLE=1: no IB/RoCE transport, NCCL falls back to IP sockets (same page). RDMA devices
      are not per network namespace by default, so NET/IB would bypass the veth just as P2P would.
    Not handled: a box whose GPUs share a multi-node NVLink fabric (GB200-class racks), where NCCL
    may join distinct hosts over NVLink anyway (NCCL_MNNVL_ENABLE; its entry was not checked).
    A real cluster (one torchrun per host) never comes here: its hosts differ already, and its NICs
    are the operator's choice."""
    wanted = {"NCCL_HOSTID": host_id, "NCCL_SOCKET_IFNAME": f"={ifname}", "NCCL_IB_DISABLE": "1"}
    return {k: v for k, v in wanted.items() if k not in inherited}
