"""Elastic training: when a datacenter's ranks die, re-plan without it and resume from the last checkpoint.

`train --elastic` runs the launch in a loop. A launch that ends in `RankFailure` names the
ranks killed from outside (a lost host, a preemption) or the first rank that failed; their
datacenter is dropped, `replan` plans the run again for what is left (the run's model, global
batch and precision), and the next launch resumes the run directory's own last complete
checkpoint on the new layout (`resume_from` = the run itself: DCP reshards on load). Every
re-plan is a line of RUN_DIR/elastic.jsonl (what failed, the checkpoint step, the layouts and the
wall-clock times of failure, detection, re-plan and relaunch) and the resumed step's line in
losses.jsonl says `resumed_from` and its layout; `losses.png` draws the curve over wall time with
each re-plan's gap.

A rehearsal cuts a datacenter on purpose (`--cut-dc DC:STEP`): once losses.jsonl shows STEP,
the launcher SIGKILLs that DC's rank process groups, which is what a lost DC looks like to the
survivors. On a real cluster nobody cuts; the ranks of a lost DC just die. A DiLoCo plan is not
re-planned: its lost worker is left behind or, with --elastic, restarted to rejoin
(runtime.diloco_launch); `WorkerCuts` rehearses that, cutting the DC in the worker that holds it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

from geotrain.errors import GeotrainError
from geotrain.layout.plan import save_plan
from geotrain.planner.replanning import describe, replan
from geotrain.runtime.diloco_launch import worker_dir
from geotrain.runtime.launch import RankFailure
from geotrain.runtime.runfile import latest_checkpoint
from geotrain.runtime.train_config import RunCase
from geotrain.trace.schema import json_text

MAX_REPLANS = 4


@dataclass
class Cut:
    """A rehearsed failure: `kill` SIGKILLs the DC's ranks, `link` sets its WAN interface down
    (kernel emulation), once the run has logged `after_step`."""

    dc: str
    after_step: int
    how: str = "kill"


def parse_cut(text: str, plan, how: str = "kill") -> Cut:
    flag = "--cut-dc" if how == "kill" else "--cut-link"
    dc, sep, step = text.replace("@", ":").partition(":")
    # a region plan's DCs are its pipelines', not only its stages'; a DiLoCo plan's, every worker's
    names = list(plan.gpus_per_dc()) if plan.outer is not None else plan.dcs_by_rank()
    if not sep or not step.isdigit() or int(step) < 1:
        raise GeotrainError(f"{flag} expects DC:STEP with STEP >= 1 (got {text!r})")
    if dc not in names:
        raise GeotrainError(f"{flag}: datacenter {dc!r} holds no stage of this plan (stages sit in "
                            f"{', '.join(names)})")
    if how == "link" and len(set(names)) < 2:
        raise GeotrainError(f"{flag}: this plan has no WAN link to cut (one datacenter)")
    return Cut(dc, int(step), how)


class CutWatcher:
    """Called by the launcher on every poll: once the run has logged step
    `cut.after_step`, SIGKILLs every rank of `cut.dc` or takes its WAN interface down. Only the
    launch whose plan still has that DC is cut."""

    def __init__(self, cut: Cut, plan, losses: Path):
        self.cut, self.losses = cut, losses
        self.ranks = [r for r in range(plan.num_ranks) if plan.dc_of_rank(r) == cut.dc]
        self.at: float | None = None
        self.wan = None
        self._size = -1

    def attach(self, wan) -> None:
        """The launch's WAN (runtime.launch.run_with_wan's on_wan): a link cut needs its emulation."""
        self.wan = wan

    def __call__(self, procs) -> None:
        if self.at is not None or not self.ranks or not self._reached():
            return
        self.at = time.time()
        if self.cut.how == "link":
            emu = getattr(self.wan, "emulation", None)
            if emu is None:
                raise GeotrainError("--cut-link needs the kernel WAN emulation (root, --wan kernel or auto)")
            emu.exec_in(self.cut.dc, ["ip", "link", "set", emu.ifname(self.cut.dc), "down"], check=True, timeout=30)
            return
        for r in self.ranks:
            try:
                os.killpg(procs[r].pid, signal.SIGKILL)   # each rank leads its own process group
            except ProcessLookupError:
                pass

    def _reached(self) -> bool:
        try:
            size = self.losses.stat().st_size
        except OSError:
            return False
        if size == self._size:
            return False
        self._size = size
        lines = self.losses.read_text().splitlines()
        return bool(lines) and json.loads(lines[-1])["step"] >= self.cut.after_step


class WorkerCuts:
    """A cut of a DiLoCo plan (runtime.diloco_launch's `watch(worker, procs)`): each worker's own
    CutWatcher over its own losses.jsonl, so the DC's ranks die in the worker that holds them --
    once: a restarted worker (--elastic) is not cut again."""

    def __init__(self, cut: Cut, plan, run_dir: Path):
        if cut.how != "kill":
            raise GeotrainError("--cut-link is not rehearsed for a DiLoCo plan (its workers meet over one store); "
                                "rehearse a lost worker with --cut-dc DC:STEP")
        self.watchers = {w: CutWatcher(cut, plan.worker_plan(w), worker_dir(run_dir, w) / "losses.jsonl")
                         for w in range(plan.num_workers)}

    def __call__(self, worker: int, procs) -> None:
        self.watchers[worker](procs)


_PEER = re.compile(r" failed: .*?\b(?:from|to) rank (\d+)\b")


def suspects(plan, failure) -> list[str]:
    """The datacenters that may be lost, most likely first.

    Ranks killed from outside: their DC. A rank whose transfer to or from a rank in another DC
    timed out (the link stayed down past the outage limit): either side may be the one cut off,
    so both, its peer's first. Else the DC of the first rank that failed. Empty: nothing points
    at a DC."""
    dc_of = [plan.dc_of_rank(r) for r in range(plan.num_ranks)]
    killed = [dc_of[r] for r in failure.killed if r < len(dc_of)]
    if killed:
        return [max(dict.fromkeys(killed), key=killed.count)]
    if failure.first is None or failure.first >= len(dc_of):
        return []
    mine = dc_of[failure.first]
    peer = _PEER.search(str(failure))
    if peer and int(peer.group(1)) < len(dc_of) and dc_of[int(peer.group(1))] != mine:
        return [dc_of[int(peer.group(1))], mine]
    return [mine]


def _best_replan(out: Path, dropped: list[str], candidates: list[str], home: str):
    """Re-plan without each candidate DC (plus those already dropped); the fastest predicted wins,
    within 1 % the one that keeps `home` (rank 0's DC, where the launcher and the store live)."""
    best, why = None, None
    for dc in candidates:
        try:
            r = replan(out, without=[*dropped, dc])
        except GeotrainError as e:
            why = why or e
            continue
        if best is None or r.after_s < 0.99 * best[1].after_s or (r.after_s <= 1.01 * best[1].after_s
                                                                    and best[0] == home):
            best = (dc, r)
    if best is None:
        raise why
    return best


def train_elastic(case: RunCase, launch_once, say=print, cut: Cut | None = None,
                  max_replans: int = MAX_REPLANS) -> list[dict]:
    """Run `launch_once(case, watch)` until it finishes, re-planning after each DC loss (the next
    case: the new plan, resuming this run's last checkpoint). Returns the re-plan events (also in
    RUN_DIR/elastic.jsonl)."""
    out, plan = Path(case.config.out), case.plan
    events: list[dict] = []
    dropped: list[str] = []
    log = out / "elastic.jsonl"
    if not case.config.resume.any and log.exists():
        log.unlink()
    while True:
        watcher = CutWatcher(cut, plan, out / "losses.jsonl") if cut is not None else None
        t_launch = time.time()
        try:
            launch_once(case, watcher)
            return events
        except RankFailure as failure:
            t_detect = time.time()
            candidates = suspects(plan, failure)
            if failure.user_error or not candidates:
                raise
            if len(events) >= max_replans:
                raise GeotrainError(f"{failure}; --elastic gave up after {max_replans} re-plans") from None
            ckpt = latest_checkpoint(out / "checkpoints")
            if ckpt is None:
                raise GeotrainError(f"{failure}; --elastic: no checkpoint to resume from (save some with "
                                    "--checkpoint-every N)") from None
            say(f"elastic: {failure}")
            try:
                dc, r = _best_replan(out, dropped, candidates, plan.stages[0].dc)
            except GeotrainError as why:
                raise GeotrainError(f"{failure}; --elastic cannot go on without "
                                    f"{' or '.join(candidates)}: {why}") from None
            dropped.append(dc)
            say(f"elastic: datacenter {dc} lost; re-planned without {', '.join(dropped)}, resuming from {ckpt.name}")
            t_replan = time.time()
            new_plan = out / f"replan{len(events) + 1}.json"
            save_plan(new_plan, r.after, spec_path=r.spec_path, spec=r.spec_after,
                      extra={"simulated_s": r.after_s, "replan": {"run": str(out.resolve()), "dropped": dropped}})
            for line in describe(r):
                say(line)
            resume_step = int(ckpt.name.split("_")[-1]) + 1
            event = {"replan": len(events) + 1, "lost_dc": dc, "suspects": candidates, "killed_ranks": failure.killed,
                     "first_failed_rank": failure.first, "error": str(failure), "checkpoint": ckpt.name,
                     "resume_step": resume_step, "plan": str(new_plan),
                     # what the lost layout logged past the checkpoint: the new layout computes these steps again
                     "lost_losses": {s: x for s, x in _losses(out).items() if s >= resume_step},
                     "before": _layout(r.before), "after": _layout(r.after),
                     "predicted_iteration_s": {"before": r.before_s, "after": r.after_s},
                     "wall": {"launch": t_launch, "cut": watcher.at if watcher else None, "detected": t_detect,
                              "replanned": t_replan}}
            events.append(event)
            with log.open("a") as f:
                f.write(json_text(event) + "\n")
            plan = r.after
            case = replace(case, plan=plan, config=case.config.with_(resume={"from_run": str(out)}))
            cut = cut if watcher is None or watcher.at is None else None


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "losses.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows}


def _layout(plan) -> dict:
    return {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp, "gpus": plan.gpus_per_dc(), "sharding": plan.sharding,
            "micro_batch": plan.micro_batch, "num_microbatches": plan.num_microbatches}


def plot_losses(run_dir: Path) -> Path | None:
    """RUN_DIR/losses.png: loss over wall-clock time, each re-plan a shaded gap from the failure to
    the first resumed step, labelled with the layouts before and after."""
    import matplotlib  # heavy: only when a run had a plot to draw

    matplotlib.use("Agg")
    # lazy: matplotlib only when called (importers that never call it stay free of it)
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (run_dir / "losses.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "wall" in r]
    if not rows:
        return None
    events = [json.loads(x) for x in (run_dir / "elastic.jsonl").read_text().splitlines()] \
        if (run_dir / "elastic.jsonl").exists() else []
    t0 = rows[0]["wall"] - rows[0].get("step_time_s", 0.0)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    pieces: list[list[dict]] = [[]]
    for r in rows:                      # one line per launch: nothing was trained across a gap
        if "resumed_from" in r and pieces[-1]:
            pieces.append([])
        pieces[-1].append(r)
    for piece in pieces:
        ax.plot([r["wall"] - t0 for r in piece], [r["loss"] for r in piece], marker=".", color="tab:blue")
    for e in events:
        resumed = next((r for r in rows if r["step"] == e["resume_step"] and "resumed_from" in r), None)
        start = (e["wall"].get("cut") or e["wall"]["detected"]) - t0
        end = (resumed["wall"] - t0) if resumed else start
        ax.axvspan(start, end, color="tab:red", alpha=0.15)
        b, a = e["before"], e["after"]
        ax.annotate(f"lost {e['lost_dc']}: pp{b['pp']}xdp{b['dp']} -> pp{a['pp']}xdp{a['dp']}, "
                    f"resumed at step {e['resume_step']}", (start, max(r["loss"] for r in rows)),
                    fontsize=8, color="tab:red", va="top")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("loss")
    ax.set_title(f"{run_dir.name}: loss" + (f", {len(events)} re-plan(s)" if events else ""))
    fig.tight_layout()
    path = run_dir / "losses.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
