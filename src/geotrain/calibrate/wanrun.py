"""Run a plan for real, one process per rank, with the user-space WAN between its datacenters.

The launch mirrors `geotrain.runtime.launch.launch` (same environment, one CPU thread per rank,
own process groups, cleanup by id) but starts `geotrain.calibrate.worker`, which routes cross-DC
transfers through the WAN helper's shaped, striped transport (see worker.py). The link settings
come from the spec's WanLinks and the plan's LinkPlans: latency, capacity, per-connection cap,
connections and fair/temporal sharing -- the same numbers the simulator is given.

Known limit (reported in docs/VALIDATION.md): the user-space shaper's aggregate cap is per sending
process, so DP pipelines sharing a link "fairly" do not slow each other down; validation cases keep
capacity >= dp x the per-transfer rate so that the simulator's fair sharing predicts no contention either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from geotrain.errors import GeotrainError

# GIL switch interval of the ranks ("" = Python's default, 5 ms). The user-space WAN moves each
# message through Python threads, so a shorter interval was tried against the ~5 ms per-message
# overhead the calibration run finds: it did not change it (docs/VALIDATION.md), so the default stays.
SWITCH_INTERVAL_S = ""


def wan_config(spec, plan) -> dict:
    """The WanRouting description (worker.py) of `plan` on `spec.cluster`."""
    from geotrain.plan.plan import LinkPlan

    rank_dc, rank_replica = [], []
    for r in range(plan.num_ranks):
        s, d, _ = plan.coords(r)
        rank_dc.append(plan.stages[s].dc)
        rank_replica.append(d)
    links = {}
    dcs = [st.dc for st in plan.stages]
    for a, b in zip(dcs, dcs[1:]):
        if a == b:
            continue
        wl = spec.cluster.link(a, b)
        if wl is None:
            raise GeotrainError(f"stages in {a} and {b} but the cluster has no WAN link between them")
        lp = plan.link_between(a, b) or LinkPlan(src_dc=a, dst_dc=b)
        for x, y in ((a, b), (b, a)):
            links[f"{x}->{y}"] = {"per_connection_gbps": wl.per_connection_gbps, "aggregate_gbps": wl.capacity_gbps,
                                  "delay_ms": wl.latency_ms, "connections": max(1, lp.connections),
                                  "sharing": lp.sharing, "order": list(lp.order) or list(range(plan.dp))}
    return {"rank_dc": rank_dc, "rank_replica": rank_replica, "links": links}


def launch_with_wan(spec, plan, out: Path, steps: int, timeout_s: float = 300.0) -> tuple[Path, float]:
    """Train `plan` for `steps` steps into `out`; returns (out/measured_trace.jsonl, background:
    threads of other work ready to run on the machine meanwhile, on average; see cpuload.py)."""
    from geotrain.calibrate.cpuload import CpuSampler
    from geotrain.runtime.launch import _first_failure, _kill_all, free_port
    from geotrain.runtime.trainer import RunConfig

    out = Path(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    err_dir = logs / "errors"
    for old in err_dir.glob("rank*.json"):
        old.unlink()
    cfg = RunConfig(spec=str(spec.path), out=str(out), plan=plan.to_dict(), steps=steps, progress=False,
                    predict=False, data="synthetic", checkpoint_every=0)
    cfg_path = logs / "run_config.json"
    cfg_path.write_text(json.dumps([asdict(cfg)], indent=1))
    wan_path = logs / "wan_config.json"
    wan_path.write_text(json.dumps(wan_config(spec, plan), indent=1))
    world = plan.num_ranks
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GEOTRAIN_THREADS": "1", "OMP_NUM_THREADS": "1",
            "GEOTRAIN_ERROR_DIR": str(err_dir), "GEOTRAIN_LAUNCHER_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
            "GEOTRAIN_WAN_CONFIG": str(wan_path),
            "GEOTRAIN_SWITCH_INTERVAL_S": os.environ.get("GEOTRAIN_SWITCH_INTERVAL_S", SWITCH_INTERVAL_S)}
    procs, files = [], []
    sampler = CpuSampler()
    try:
        for r in range(world):
            log = open(logs / f"rank{r}.log", "w")  # noqa: SIM115 -- closed in finally
            files.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "geotrain.calibrate.worker", str(cfg_path)],
                                          env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log,
                                          stderr=log, stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.time() + timeout_s
        pids = [p.pid for p in procs]
        while True:
            sampler.sample(pids)
            codes = [p.poll() for p in procs]
            if any(c not in (0, None) for c in codes):
                time.sleep(0.3)
                raise GeotrainError(_first_failure(err_dir, procs, lambda r: f"rank {r}") + f" (logs: {logs})")
            if all(c == 0 for c in codes):
                break
            if time.time() > deadline:
                raise GeotrainError(f"validation run did not finish within {timeout_s:.0f} s (logs: {logs})")
            time.sleep(0.05)
    finally:
        _kill_all(procs)
        for f in files:
            f.close()
    launch_with_wan.last_background_cores = sampler.background_cores()   # for the record (validate.py)
    return out / "measured_trace.jsonl", sampler.background_runnable()
