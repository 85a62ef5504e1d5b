"""`geotrain rehearse`: a multi-host deployment rehearsed on one machine.

The plan's datacenters become network namespaces joined by the kernel-emulated WAN (DC i at
10.77.(i+1).2, in plan order), each running ONE `torchrun` as a real host would: c10d rendezvous at
the first DC's address (its store a process of its own), `--local-addr` and `--wan-bind` the
namespace's address, `geotrain train PLAN --wan auto --dc DC`. Training runs through the code a real
cluster runs -- torchrun's agent, the c10d store, the "direct" striped transport, turns over TCP.

Hosts do not share a run directory, as real hosts may not: the last stage's datacenter (the one
whose rank owns the loss) writes RUN_DIR -- losses.jsonl, the merged measured trace, summary,
plan, prediction -- and every other datacenter RUN_DIR/hosts/<dc>/ (its ranks' own trace files).
Each torchrun's output is RUN_DIR/logs/<dc>.log.

What is measured per cross-DC link direction, and where:
  * connections -- in the kernel: `ss` inside the sending datacenter's namespace, sampled while
    training runs, counts the established TCP connections to each receiving rank's striped
    listener (its address from the rank's start-up log line), the most seen at once;
  * turns -- by the transport: each temporal turn a rank held is a `turn` event in the measured
    trace (runtime.cross_dc.RecordedTurns); per iteration, and how many were held at once;
  * bytes -- the `transfer` events of the measured trace, per iteration; and per datacenter, what
    crossed its emulated link in the whole run, whichever library sent it (the router's interface
    counters): a region plan's pipelines stay inside their DCs, so its only cross-DC bytes are
    the gradient reduction's, through the process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from geotrain.emulation.network import WanEmulation, emulation_available
from geotrain.errors import GeotrainError
from geotrain.process import descendants
from geotrain.trace.chrome import write_chrome
from geotrain.trace.merge import remerge
from geotrain.trace.schema import Trace
from geotrain.transport.turns import turn_slots

RDZV_PORT = 29400          # inside the first DC's namespace (a fresh network stack: always free)
LISTENING = re.compile(r"geotrain wan: rank (\d+) \(([^)]*)\) -> stage \d+ \([^)]*\): StripedTransport, .*"
                       r"\(listening on ([\d.]+):(\d+)\)")


@dataclass
class Host:
    """One datacenter of the rehearsal: one torchrun in one namespace."""

    dc: str
    ranks: list[int]
    out: Path
    log: Path
    worker: int = 0                  # a DiLoCo plan's worker (RUN_DIR/worker<W> for W > 0)
    address: str = ""
    netns: str = ""
    proc: subprocess.Popen | None = None


@dataclass
class Rehearsal:
    run_dir: Path
    hosts: list[Host]
    wall_s: float
    links: list[dict] = field(default_factory=list)
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)   # per DC, emulation.link_bytes


def dc_blocks(plan) -> list[tuple[str, list[int]]]:
    """(datacenter, its ranks) in the plan's order; a torchrun numbers one node's ranks
    contiguously, so each datacenter's ranks must be one block. A plan in one datacenter is one
    host: no WAN, still torchrun's agent, rendezvous and store as a cluster runs them."""
    blocks: list[tuple[str, list[int]]] = []
    for r in range(plan.num_ranks):
        dc = plan.dc_of_rank(r)
        if blocks and blocks[-1][0] == dc:
            blocks[-1][1].append(r)
        elif any(b[0] == dc for b in blocks):
            raise GeotrainError(f"datacenter {dc}'s ranks are not contiguous in the plan; one torchrun per "
                                "datacenter cannot start them")
        else:
            blocks.append((dc, [r]))
    if len(blocks) > 9:
        raise GeotrainError(f"the plan uses {len(blocks)} datacenters; rehearse emulates at most 9")
    return blocks


def emulation_cluster(cluster, dcs: list[str]):
    """The cluster restricted to `dcs`, in that order: DC i gets the i-th address, and c10d's
    rendezvous (which orders nodes by --local-addr) then numbers the nodes in the plan's order."""
    by_name = {d.name: d for d in cluster.datacenters}
    return cluster.model_copy(update={"datacenters": [by_name[d] for d in dcs],
                                      "wan_links": [ln for ln in cluster.wan_links if set(ln.between) <= set(dcs)]})


def _torchrun_argv(host: Host, n_hosts: int, endpoint: str, rdzv_id: str, plan_path: Path,
                   train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n_hosts),
            "--nproc-per-node", str(len(host.ranks)), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id, "--rdzv-conf", "is_host=0", "--local-addr", host.address,
            "--max-restarts", "0", "--monitor-interval", "0.2",
            "-m", "geotrain.cli", "train", str(plan_path), "--wan", "auto", "--wan-bind", host.address,
            "--dc", host.dc, "--out", str(host.out), "--checkpoint-every", "0", *train_args]


STORE_SCRIPT = ("import sys, torch.distributed as d; s = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, "
                "wait_for_workers=False); print('ready', flush=True); sys.stdin.read()")


def _start_store(emu, host: Host, env: dict[str, str], port: int = RDZV_PORT,
                 timeout_s: float = 60.0) -> subprocess.Popen:
    """The rendezvous store at host.address:port in host's namespace, until its stdin closes. Not in an agent
    (is_host=1): one leaving torchrun's exit barrier first took it from the others closing the rendezvous."""
    p = emu.popen(host.dc, [sys.executable, "-c", STORE_SCRIPT, host.address, str(port)], env, text=True,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    ready = threading.Event()       # c10d's warnings may come first; the rest is drained
    threading.Thread(target=lambda: [ready.set() for line in p.stdout if line.strip() == "ready"], daemon=True).start()
    if not ready.wait(timeout_s):
        p.kill()
        raise GeotrainError(f"rehearse: the rendezvous store did not start in {host.dc} within {timeout_s:.0f} s")
    return p


def _stop_store(p: subprocess.Popen | None) -> None:
    if p is not None:      # closing its stdin ends it; killed if it has not ended in 5 s
        with contextlib.suppress(OSError):
            p.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5.0)
        p.kill()


class ConnectionSampler:
    """Samples the established TCP connections inside each namespace (`ss -N NS`) until stopped."""

    def __init__(self, namespaces: dict[str, str], every_s: float = 0.2):
        self.namespaces, self.every_s = namespaces, every_s
        self.samples: list[tuple[str, set[tuple[str, str]]]] = []    # (dc, {(local, peer)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rehearse-ss", daemon=True)

    def start(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for dc, ns in self.namespaces.items():
                r = subprocess.run(["ss", "-N", ns, "-tnH", "state", "established"], capture_output=True,
                                   text=True)
                if r.returncode == 0:
                    conns = {tuple(line.split()[-2:]) for line in r.stdout.splitlines() if line.strip()}
                    self.samples.append((dc, conns))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def listeners(logs: list[Path]) -> dict[str, tuple[int, str]]:
    """"addr:port" of every rank's striped listener -> (rank, its DC), from the ranks' start-up lines."""
    out = {}
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        for m in LISTENING.finditer(text):
            out[f"{m.group(3)}:{m.group(4)}"] = (int(m.group(1)), m.group(2))
    return out


def measured_connections(samples, listening: dict[str, tuple[int, str]]) -> dict[tuple[str, str, int], int]:
    """(sending DC, receiving DC, receiving rank) -> the most established connections seen at once
    from the sending DC to that rank's striped listener."""
    best: dict[tuple[str, str, int], int] = defaultdict(int)
    for dc, conns in samples:
        now: dict[tuple[str, str, int], int] = defaultdict(int)
        for _local, peer in conns:
            who = listening.get(peer)
            if who is not None and who[1] != dc:
                now[(dc, who[1], who[0])] += 1
        for k, n in now.items():
            best[k] = max(best[k], n)
    return dict(best)


def _max_at_once(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1]))
    now = most = 0
    for _, d in points:
        now += d
        most = max(most, now)
    return most


def link_reports(spec, plan, trace_path: Path, conns: dict[tuple[str, str, int], int]) -> list[dict]:
    """Per cross-DC link direction: the plan's connections, sharing and turn slots beside what was
    measured (see the module docstring)."""
    trace = Trace.read_jsonl(trace_path)
    its = sorted({e.iteration for e in trace.events}) or [0]
    n_it = len(its)
    out = []
    dcs = list(dict.fromkeys(st.dc for st in plan.stages))
    for a, b in [(x, y) for x in dcs for y in dcs if x != y]:
        name = f"{a}->{b}"
        xfer = [e for e in trace.events if e.kind == "transfer" and e.link == name]
        if not xfer:
            continue
        lp = plan.link_between(a, b)
        k = max(1, int(lp.connections)) if lp is not None else 1
        sharing = lp.sharing if lp is not None else "fair"
        wl = spec.cluster.link(a, b)
        slots = turn_slots(sharing, wl.capacity_gbps, wl.rate_gbps(k), plan.dp) if wl is not None else 0
        temporal = slots > 0
        turns = [e for e in trace.events if e.kind == "turn" and e.link == name]
        senders: dict[int, set[int]] = defaultdict(set)
        for e in xfer:
            senders[e.peer].add(e.rank)
        per_pair = [conns.get((a, b, r), 0) / len(s) for r, s in sorted(senders.items())]
        out.append({
            "link": name, "plan_connections": k, "sharing": sharing, "plan_turns": temporal,
            "turn_slots": slots if temporal else None,
            "measured_connections_per_pair": per_pair,
            "measured_connections": sum(conns.get((a, b, r), 0) for r in senders),
            "pairs": sum(len(s) for s in senders.values()),
            "turns_per_iteration": len(turns) / n_it,
            "turn_pipelines": len({plan.coords(e.rank)[1] for e in turns}),
            "turns_held_at_once": _max_at_once([(e.start, e.end) for e in turns]) if turns else 0,
            "transfers_per_iteration": len(xfer) / n_it,
            "bytes_per_iteration": sum(e.bytes for e in xfer) / n_it,
        })
    return out


def _stop(host: Host) -> None:
    """A torchrun still running: SIGTERM (the agent stops its workers), then SIGKILL to it and to
    every process it started, so nothing outlives the rehearsal inside a removed namespace."""
    p = host.proc
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=5.0)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:      # the agent is still alive: its workers are still its children
        for pid in [p.pid, *descendants(p.pid)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        p.wait(timeout=5.0)


def _last_error(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in reversed(lines):
        if "geotrain train: error:" in line:
            return line.split("geotrain train: error:", 1)[1].strip()
    for line in reversed(lines):
        if re.search(r"\w+(Error|Exception): ", line):
            return line.strip()
    return lines[-1].strip() if lines else "no output"


def _env() -> dict[str, str]:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GEOTRAIN_LAUNCHER_PID",
            "GEOTRAIN_SECRET_FILE", "GEOTRAIN_ERROR_DIR"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_rehearsal(spec, plan, plan_path: Path, run_dir: Path, train_args: list[str], rate_scale: float = 1.0,
                  timeout_s: float = 3600.0, say=print) -> Rehearsal:
    """Bring the emulated DCs up, one torchrun per DC inside its namespace, wait, measure, tear down."""
    ok, why = emulation_available()
    if not ok:
        raise GeotrainError(f"rehearse needs the kernel WAN emulation (network namespaces): {why}")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    hosts = []
    for w in range(plan.num_workers):       # DiLoCo: each worker its own torchrun job (runtime.diloco_launch)
        wp, base = plan.worker_plan(w), run_dir if w == 0 else run_dir / f"worker{w}"
        last = wp.dc_of(wp.pp - 1, 0)      # the loss owner's DC (runtime.train_config.report_rank)
        tag = "" if w == 0 else f"worker{w}-"
        hosts += [Host(dc, ranks, base if dc == last else base / "hosts" / dc, logs / f"{tag}{dc}.log", w)
                  for dc, ranks in dc_blocks(wp)]
    emu = WanEmulation(emulation_cluster(spec.cluster, list(dict.fromkeys(h.dc for h in hosts))),
                       rate_scale=rate_scale, lifetime_s=timeout_s + 600).start()
    sampler, stores = None, []
    t0 = time.time()
    try:
        for h in hosts:
            h.address, h.netns = emu.address(h.dc), emu.netns(h.dc)
        firsts = [next(h for h in hosts if h.worker == w) for w in range(plan.num_workers)]
        ends = [f"{f.address}:{RDZV_PORT + w}" for w, f in enumerate(firsts)]
        say(f"rehearse: {len(hosts)} hosts, one torchrun each inside its datacenter's namespace (gt-{emu.tag}-*): "
            + ", ".join(f"{h.dc} {h.address} ranks {h.ranks[0]}-{h.ranks[-1]}" for h in hosts)
            + f"; c10d rendezvous at {', '.join(ends)}")
        sampler = ConnectionSampler({h.dc: h.netns for h in hosts}).start()
        env = _env()
        W = plan.num_workers                # DiLoCo: the workers' store too (a TCPStore, as runtime.outer_store)
        starts = [*((f, RDZV_PORT + w) for w, f in enumerate(firsts)), *([(hosts[0], RDZV_PORT + W)] if W > 1 else [])]
        with ThreadPoolExecutor(len(starts)) as pool:       # each imports torch: side by side
            futures = [pool.submit(_start_store, emu, h, {**env, **emu.host_env(h.dc, env)}, p) for h, p in starts]
        errors = [f.exception() for f in futures]
        stores += [f.result() for f, e in zip(futures, errors) if e is None]
        if any(errors):
            raise next(e for e in errors if e)
        outer = ["--outer-store", f"{hosts[0].address}:{RDZV_PORT + W}"] if W > 1 else []
        for h in hosts:
            h.out.mkdir(parents=True, exist_ok=True)
            n = sum(1 for x in hosts if x.worker == h.worker)
            argv = _torchrun_argv(h, n, ends[h.worker], f"rehearse-{emu.tag}-{h.worker}", plan_path,
                                  [*train_args, *(["--diloco-worker", str(h.worker), *outer] if outer else [])])
            with open(h.log, "w") as f:
                h.proc = emu.popen(h.dc, argv, {**env, **emu.host_env(h.dc, env)},   # one NCCL host per DC
                                   stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        _wait(hosts, emu, t0 + timeout_s, say, run_dir / "losses.jsonl")
    finally:
        if sampler is not None:
            sampler.stop()
        for h in hosts:
            _stop(h)
        for st in stores:
            _stop_store(st)
        crossed = emu.link_bytes()
        emu.stop()
    wall = time.time() - t0
    hosts = [h for h in hosts if h.worker == 0]     # what is measured and compared: worker 0's run
    _gather_host_traces(hosts, run_dir, plan)
    trace = run_dir / "measured_trace.jsonl"
    if not trace.exists():
        raise GeotrainError(f"the run wrote no {trace} (logs: {logs})")
    conns = measured_connections(sampler.samples, listeners([h.log for h in hosts]))
    return Rehearsal(run_dir, hosts, wall, link_reports(spec, plan, trace, conns), crossed)


def _gather_host_traces(hosts: list[Host], run_dir: Path, plan) -> None:
    """Each host's ranks wrote their trace in that host's run directory; copy them into RUN_DIR/trace and
    merge (what a user does after a real multi-host run: copy, then `geotrain report`)."""
    for h in hosts:
        if h.out != run_dir:
            for f in (h.out / "trace").glob("rank*.jsonl"):
                (run_dir / "trace").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, run_dir / "trace" / f.name)
    merged = remerge(run_dir)
    if merged is not None:
        write_chrome(merged, run_dir / "measured_trace.chrome.json", plan)


def _wait(hosts: list[Host], emu, deadline: float, say=None, losses: Path | None = None,
          every_s: float = 10.0) -> None:
    """Until every torchrun ended (or one failed, or the deadline); says every `every_s` how far the run is
    (the steps in `losses`), so a rehearsal is not a minute of silence."""
    started = last = time.time()
    while True:
        if say is not None and time.time() - last >= every_s:
            last = time.time()
            done = sum(1 for ln in losses.read_text().splitlines() if ln.strip()) \
                if losses is not None and losses.is_file() else 0
            say(f"rehearse: {time.time() - started:.0f} s, "
                + (f"{done} step(s) done" if done else "rendezvous and start-up (no step yet)"))
        codes = [h.proc.poll() for h in hosts]
        for h, c in zip(hosts, codes):
            if c not in (None, 0):
                time.sleep(0.5)   # its peers' torchruns notice; the first failure is this one
                raise GeotrainError(f"the torchrun of datacenter {h.dc} failed (exit {c}): {_last_error(h.log)} "
                                    f"(log: {h.log})")
        if all(c == 0 for c in codes):
            return
        emu.check()
        if time.time() > deadline:
            raise GeotrainError(f"the rehearsal did not finish in time (logs: {hosts[0].log.parent})")
        time.sleep(0.1)


def losses_of(run_dir: Path) -> list[float]:
    path = Path(run_dir) / "losses.jsonl"
    if not path.is_file():
        raise GeotrainError(f"{run_dir}: no losses.jsonl (not a training run directory?)")
    return [json.loads(x)["loss"] for x in path.read_text().splitlines() if x.strip()]


def median_step_s(run_dir: Path, skip: int = 1) -> float | None:
    """Median step wall time of a run, the first `skip` steps (start-up, connections) left out."""
    rows = [json.loads(x) for x in (Path(run_dir) / "losses.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in rows[skip:]] or [r["step_time_s"] for r in rows]
    return statistics.median(times) if times else None
