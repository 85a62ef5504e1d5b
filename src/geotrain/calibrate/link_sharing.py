"""Temporal vs fair sharing of one emulated WAN link, measured through the runtime's own WAN path.

d two-stage DP pipelines (stage 0 in DC "east", stage 1 in "west") run 1F1B over the kernel
emulation, one process per stage as a rank is, every cross-DC transfer through `StripedTransport`
and, under temporal sharing, `RemoteTurns` of a served `TurnArbiter` with the link's `Handoff` --
the pieces `runtime.rank_run.build_transport` wires for a training run. Compute is slept, not run:
eight pipelines on two shared cores would measure the CPU, not the link. Each case keeps its
connections and alternates the sharing between rounds, so the machine's drift hits both alike.

    measure(cases, cluster) -> per case and sharing: iteration times, and per turn its wait and hold;
    simulated(case, sharing, cluster) -> the simulator's iteration time for the same pipelines.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from geotrain.costs import StageTimes
from geotrain.emulation.network import WanEmulation
from geotrain.emulation.ports import spread_port_connections
from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.layout.stage_costs import StageCosts, plan_inputs
from geotrain.schedule.actions import Op
from geotrain.schedule.builders import build_schedule
from geotrain.sim.simulate import simulate_costs
from geotrain.spec import Cluster
from geotrain.transport.auth import SECRET_ENV, new_secret, run_secret, write_secret_file
from geotrain.transport.turns import link_handoff, turn_slots, turns_via_store

DCS = ("east", "west")
SHARINGS = ("fair", "temporal")
STORE_PORT = 29431            # inside the freshly made east namespace nothing else listens
WARM_TAG = 9999
MIN_CHUNK_BYTES = 4096        # as runtime.cross_dc: a message uses all K connections from K x 4 KiB up


@dataclass(frozen=True)
class PipelineCase:
    """d two-stage pipelines over the link; compute times in seconds per micro-batch."""

    d: int
    microbatches: int
    forward_s: float
    backward_s: float
    nbytes: int                # one boundary tensor (activation or gradient)
    connections: int


def link_cluster(capacity_gbps: float, per_connection_gbps: float, latency_ms: float) -> Cluster:
    """Two DCs joined by one link."""
    return Cluster.model_validate({
        "name": "sharing-check",
        "datacenters": [{"name": n, "gpu_type": "cpu", "gpus": 64, "gpus_per_node": 8} for n in DCS],
        "wan_links": [{"between": list(DCS), "latency_ms": latency_ms, "capacity_gbps": capacity_gbps,
                       "per_connection_gbps": per_connection_gbps, "max_connections": 64}],
    })


def case_plan(case: PipelineCase, sharing: str) -> Plan:
    """The plan the case runs: pp=2 over east/west, dp=d, 1F1B, the link shared as `sharing` says."""
    links = (LinkPlan(src_dc=DCS[0], dst_dc=DCS[1], connections=case.connections, sharing=sharing,
                      order=tuple(range(case.d)) if sharing == "temporal" else ()),)
    return Plan(stages=(StagePlan(dc=DCS[0], chunks=((0, 1),)), StagePlan(dc=DCS[1], chunks=((1, 2),))),
                dp=case.d, micro_batch=1, num_microbatches=case.microbatches, schedule="1f1b", links=links,
                name=f"sharing-d{case.d}-{sharing}")


class CaseCosts(StageCosts):
    """A case's costs: its compute (sleeps, in the runs) and boundary tensor as given, no DP sync
    or optimizer step; the link priced as every plan's is."""

    def __init__(self, case: PipelineCase, cluster: Cluster):
        super().__init__(None, cluster)
        self.case = case

    def stage_compute(self, plan, v: int) -> StageTimes:
        b = self.case.backward_s
        return StageTimes(forward=self.case.forward_s, backward=b, backward_input=b / 2, backward_weight=b / 2)

    def tp_comm(self, units, micro_batch: int, tp: int, dc: str) -> float:
        return 0.0

    def stage_sync(self, plan, s: int, spread=None) -> float:
        return 0.0

    def stage_optimizer(self, plan, s: int) -> float:
        return 0.0

    def plan_tied_sum(self, plan) -> float:
        return 0.0

    def boundary_bytes(self, micro_batch: int) -> int:
        return self.case.nbytes


def simulated(case: PipelineCase, sharing: str, cluster: Cluster, iterations: int = 3) -> float:
    """The simulator's steady-state iteration time (s) for the case."""
    plan, costs = case_plan(case, sharing), CaseCosts(case, cluster)
    inp = plan_inputs(costs, plan)
    res = simulate_costs(plan, cluster, inp.stage_costs, inp.allreduce, inp.optimizer, tokens_per_iteration=1,
                         iterations=iterations, costs=costs)
    return res.metrics.iteration_time


# ----------------------------------------------------------------------------- inside one DC
class _TimedTurns:
    """A turn client that notes, per turn, (asked, granted, released) -- wall clock."""

    def __init__(self, inner):
        self.inner, self.log, self._asked = inner, [], {}
        self.handoff = inner.handoff

    def acquire(self) -> None:
        t = time.time()
        self.inner.acquire()
        self._asked[threading.get_ident()] = (t, time.time())

    def release(self) -> None:
        asked, granted = self._asked.pop(threading.get_ident())
        self.inner.release()
        self.log.append((asked, granted, time.time()))

    def close(self) -> None:
        self.inner.close()


def _iteration(case: PipelineCase, actions, transport, peer: int, bufs) -> None:
    """One DP pipeline's stage: its action list once, compute as sleeps, transfers for real."""
    sends = []
    for a in actions:
        if a.op == Op.FORWARD:
            time.sleep(case.forward_s)
        elif a.op == Op.BACKWARD:
            time.sleep(case.backward_s)
        elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            sends.append(transport.send(bufs[0], peer, (a.op == Op.SEND_GRAD) * 1000 + a.mb))
        elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
            transport.recv(bufs[1], peer, (a.op == Op.RECV_GRAD) * 1000 + a.mb).wait()
    for w in sends:
        w.wait()


def _barrier(store, name: str, d: int, role: int, replica: int) -> None:
    """Every stage process of both DCs (2 d of them) has reached `name`."""
    store.set(f"{name}/{role}/{replica}", "1")
    store.wait([f"{name}/{ro}/{r}" for ro in (0, 1) for r in range(d)])


def _stage(index: int, case: PipelineCase, role: int, replica: int, hosts: list[str], secret: bytes,
           cluster: Cluster, rounds: int) -> dict:
    """One DP pipeline's stage in its own process (as a rank is): returns its runs' (start, end)."""
    import torch  # lazy: torch only in the worker processes (the parent builds namespaces)
    from torch.distributed import TCPStore  # lazy: as above

    from geotrain.transport.striped import StripedTransport  # lazy: torch, as above

    d, me = case.d, hosts[role]
    store = TCPStore(hosts[0], STORE_PORT, is_master=False, timeout=timedelta(seconds=60))
    link = cluster.wan_links[0]
    slots = turn_slots("temporal", link.capacity_gbps, link.rate_gbps(case.connections), d)
    client = arbiter = None
    if slots:              # as runtime.rank_run.build_transport decides: else every pipeline always has a slot
        handoff = link_handoff(link.capacity_gbps, link.rate_gbps(case.connections), link.latency_ms, slots)
        # Replica 0's process serves the direction's arbiter (over TCP, the run's secret); all are clients.
        inner, arbiter = turns_via_store(store, f"c{index}/turns/{role}", replica, list(range(d)), host=me,
                                         is_host=replica == 0, timeout_s=120, slots=slots, secret=secret,
                                         handoff=handoff)
        client = _TimedTurns(inner)
    current = [None]                      # the turns this run's transfers take (None: fair sharing)
    transport = StripedTransport(role * d + replica, store, secret=secret, host=me, connections=case.connections,
                                 turns=lambda _dst: current[0], prefix=f"c{index}/striped",
                                 min_chunk_bytes=MIN_CHUNK_BYTES, timeout_s=120, max_message_bytes=case.nbytes,
                                 connect=spread_port_connections)
    actions = build_schedule("1f1b", 2, case.microbatches).actions[role]
    bufs = (torch.zeros(case.nbytes, dtype=torch.uint8), torch.empty(case.nbytes, dtype=torch.uint8))
    peer = (1 - role) * d + replica

    def run(name: str, sharing: str) -> tuple[float, float]:
        current[0] = client if sharing == "temporal" else None
        _barrier(store, f"c{index}/{name}", d, role, replica)   # everyone starts (and switches turns) together
        t0 = time.time()
        _iteration(case, actions, transport, peer, bufs)
        return t0, time.time()

    # Connections open (handshakes, one message each way) before anything is measured.
    _barrier(store, f"c{index}/warm", d, role, replica)
    warm = transport.send(bufs[0], peer, WARM_TAG)
    transport.recv(bufs[1], peer, WARM_TAG).wait()
    warm.wait()
    if client is not None:               # the turn client's connection too
        client.acquire()
        client.release()
        client.log.clear()
    runs: dict[str, list] = {s: [] for s in SHARINGS}
    for rnd in range(rounds):
        for sharing in (SHARINGS if rnd % 2 == 0 else SHARINGS[::-1]):
            runs[sharing].append(run(f"r{rnd}{sharing}", sharing))
    _barrier(store, f"c{index}/done", d, role, replica)   # every peer has received everything: close
    transport.close()
    if client is not None:
        client.close()
    if arbiter is not None:
        arbiter.close()
    return {"runs": runs, "turns": client.log if client is not None else []}


def _fork_stage(*args) -> tuple[int, int]:
    """Run `_stage(*args)` in a forked child (torch already imported here: cheap); (pid, read end)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        code = 1
        try:
            with os.fdopen(wfd, "w") as f:
                json.dump(_stage(*args), f)
            code = 0
        except BaseException as e:  # noqa: BLE001 -- reported in one line by the parent
            print(f"stage process {args[2]}/{args[3]} of case {args[0]}: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            os._exit(code)
    os.close(wfd)
    return pid, rfd


def _worker(config_path: str, role: int) -> None:
    """One DC: (east) the rendezvous store; per case, one forked process per pipeline stage."""
    import torch.distributed  # lazy: torch, in the worker only (imported once, before the forks)

    cfg = json.loads(Path(config_path).read_text())
    cluster = Cluster.model_validate(cfg["cluster"])
    hosts = cfg["hosts"]
    server = torch.distributed.TCPStore(hosts[0], STORE_PORT, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=60)) if role == 0 else None
    secret = run_secret()                # the driver's 0600 file (GEOTRAIN_SECRET_FILE)
    rows = []
    for i, c in enumerate(cfg["cases"]):
        case = PipelineCase(**c)
        kids = [_fork_stage(i, case, role, r, hosts, secret, cluster, cfg["rounds"]) for r in range(case.d)]
        outs = []
        for pid, fd in kids:
            with os.fdopen(fd) as f:
                text = f.read()
            _, status = os.waitpid(pid, 0)
            if status != 0:
                sys.exit(1)
            outs.append(json.loads(text))
        times = {s: [max(o["runs"][s][k][1] for o in outs) - min(o["runs"][s][k][0] for o in outs)
                     for k in range(cfg["rounds"])] for s in SHARINGS}
        log = sorted(tuple(x) for o in outs for x in o["turns"])
        rows.append({"times": times, "turn_wait": [g - a for a, g, _ in log], "turn_held": [r - g for _, g, r in log]})
    del server
    print(json.dumps(rows), flush=True)


# ----------------------------------------------------------------------------- the driver (root)
def measure(cases: list[PipelineCase], cluster: Cluster, rounds: int = 2, timeout_s: float = 300.0) -> list[dict]:
    """Run every case (see the module docstring) in one pair of DC processes over one emulated
    network (root only). Returns per case and sharing {case, sharing, iterations (s, as measured in
    east, where the last backward ends), iteration_s (their median), turn_wait_s, turn_held_s}."""
    with tempfile.TemporaryDirectory(prefix="gt-sharing-") as tmp:
        cfg = Path(tmp) / "cases.json"
        secret = write_secret_file(Path(tmp) / "secret", new_secret())
        with WanEmulation(cluster, lifetime_s=timeout_s + 60) as emu:
            hosts = [emu.address(dc) for dc in DCS]
            cfg.write_text(json.dumps({"cluster": cluster.model_dump(mode="json"), "hosts": hosts,
                                       "rounds": rounds, "cases": [asdict(c) for c in cases]}))
            env = {SECRET_ENV: str(secret), "PYTHONPATH": os.pathsep.join(sys.path)}
            procs = [emu.popen(dc, [sys.executable, "-m", "geotrain.calibrate.link_sharing", str(cfg), str(role)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for role, dc in enumerate(DCS)]
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=timeout_s)
                if p.returncode != 0:
                    raise RuntimeError(f"link-sharing worker failed: {(err.strip().splitlines() or ['?'])[-1]}")
                outs.append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for case, east, west in zip(cases, *outs, strict=True):
        for sharing in SHARINGS:
            its = east["times"][sharing]
            turns = sharing == "temporal"
            rows.append({"case": case, "sharing": sharing, "iterations": its, "iteration_s": statistics.median(its),
                         "turn_wait_s": east["turn_wait"] + west["turn_wait"] if turns else [],
                         "turn_held_s": east["turn_held"] + west["turn_held"] if turns else []})
    return rows


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
