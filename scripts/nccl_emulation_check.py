"""Does NCCL between two emulated DCs of one GPU box cross the emulated WAN? (root, namespaces)

`sudo .venv/bin/python scripts/nccl_emulation_check.py [--cpu]` brings up two DCs as network
namespaces (`emulation.WanEmulation`), starts ranks in them through the launcher training uses
(`runtime.launch.launch_ranks` with a kernel-mode `runtime.cross_dc.WanLaunch`, so each rank gets the
environment a training rank gets: `emulation.nccl.nccl_host_env`) and all-reduces 16 MiB a few
times. It passes when the router counted at least those bytes leaving each DC (the traffic crossed
the veth, the delayer and the shaper) and, with NCCL, when NCCL's own log (NCCL_DEBUG=INFO) shows
the NET transport between the DCs and no P2P/SHM channel between them. One GPU: one rank per DC (two
ranks of one host on one GPU are refused by NCCL; of two "hosts" they are not); four or more: two
per DC, whose pairs inside a DC should show P2P or SHM. --cpu: gloo on the CPU, the bytes check only.
Exit 0 when it passes, 1 when not, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

MIB = 16
ROUNDS = 3


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    cuda = os.environ.get("CHECK_BACKEND") == "nccl"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    x = torch.ones(MIB * 2**20 // 4, device="cuda" if cuda else "cpu")
    for _ in range(ROUNDS):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    print(f"rank {dist.get_rank()}: {ROUNDS} all-reduces of {MIB} MiB, value {float(x[0]):g}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (no GPU needed): the bytes check only")
    args = ap.parse_args()
    from geotrain.emulation import WanEmulation
    from geotrain.emulation.network import emulation_available
    from geotrain.runtime.cross_dc import WanLaunch
    from geotrain.runtime.launch import launch_ranks
    from geotrain.spec import Cluster

    ok, why = emulation_available()
    if not ok:
        print(f"cannot run: {why}")
        return 2
    gpus = 0
    if not args.cpu:
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("cannot run: no CUDA device (use --cpu for the gloo check)")
            return 2
    per_dc = 2 if gpus >= 4 or args.cpu else 1
    cluster = Cluster.model_validate({
        "name": "nccl-check", "datacenters": [{"name": "east", "gpu_type": "cpu", "gpus": per_dc},
                                              {"name": "west", "gpu_type": "cpu", "gpus": per_dc}],
        "wan_links": [{"between": ["east", "west"], "latency_ms": 2, "capacity_gbps": 1, "per_connection_gbps": 1}]})
    rank_dc = ["east"] * per_dc + ["west"] * per_dc
    env = {"CHECK_BACKEND": "gloo" if args.cpu else "nccl", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,NET"}
    with tempfile.TemporaryDirectory() as tmp, WanEmulation(cluster, lifetime_s=600) as emu:
        wan = WanLaunch("kernel", rank_dc, emulation=emu)
        logs = Path(tmp) / "logs"
        launch_ranks([sys.executable, __file__, "--rank"], len(rank_dc), logs, env=env, wan=wan, timeout_s=300,
                     rank0_stdout=False)
        crossed = emu.link_bytes()
        text = "".join((logs / f"rank{r}.log").read_text() for r in range(len(rank_dc)))
    need = MIB * 2**20 * ROUNDS // 2      # a ring all-reduce sends at least half the tensor out of each DC
    failures = [f"{dc} sent {c.get('out', 0):,} B over the emulated link, expected >= {need:,}"
                for dc, c in ((dc, crossed.get(dc, {})) for dc in ("east", "west")) if c.get("out", 0) < need]
    print("bytes out of each DC over the emulated link: " + ", ".join(f"{d} {c['out']:,}" for d, c in crossed.items()))
    if not args.cpu:
        # NCCL's INFO lines: "Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0", "... via P2P/CUMEM"
        channels = {(int(a), int(b), how) for a, b, how in
                    re.findall(r"(\d+)\[[0-9a-fx]+\] -> (\d+)\[[0-9a-fx]+\](?: \[\w+\])? via (\S+)", text)}
        for a, b, how in sorted(channels):
            print(f"  NCCL rank {a} ({rank_dc[a]}) -> {b} ({rank_dc[b]}) via {how}")
        across = {how.split("/")[0] for a, b, how in channels if rank_dc[a] != rank_dc[b]}
        if across != {"NET"}:
            failures.append(f"NCCL between the DCs went via {sorted(across) or 'nothing seen'}, not NET only")
    for f in failures:
        print("FAIL: " + f)
    print("PASS" if not failures else "the emulated WAN does not carry NCCL's traffic")
    return 1 if failures else 0


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main()
        sys.exit(0)
    sys.exit(main())
