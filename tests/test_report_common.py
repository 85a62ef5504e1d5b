"""Hand-built traces for the report and Chrome-export tests (the simulator is tested elsewhere).

`gpipe_trace` lays out a GPipe iteration in closed form -- forwards back to back, a fixed
transfer time between stages, backwards in reverse -- so tests know every number in advance.
"""

from __future__ import annotations

from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.trace.schema import Event, Trace


def two_dc_plan(pp: int = 2, dp: int = 2, m: int = 4) -> Plan:
    dcs = ["east"] * (pp // 2) + ["west"] * (pp - pp // 2)
    per = 8 // pp if pp <= 8 else 1
    stages = tuple(StagePlan(dc=dcs[s], chunks=((s * per, (s + 1) * per),)) for s in range(pp))
    return Plan(stages=stages, dp=dp, micro_batch=2, num_microbatches=m, schedule="gpipe",
                links=(LinkPlan("east", "west", connections=4),), name="test-plan")


def gpipe_trace(plan: Plan, tf: float = 1.0, tb: float = 2.0, comm: float = 0.5, ar: float = 0.3,
                opt: float = 0.2, nbytes: int = 1000, source: str = "sim", slow: float = 1.0) -> Trace:
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    tf, tb, comm = tf * slow, tb * slow, comm * slow
    ev: list[Event] = []
    t_f_end = (m - 1) * tf + (pp - 1) * (tf + comm) + tf
    for s in range(pp):
        link = "east->west" if plan.stages[s].dc != plan.stages[min(s + 1, pp - 1)].dc else plan.stages[s].dc
        back_link = "west->east" if s > 0 and plan.stages[s].dc != plan.stages[s - 1].dc else plan.stages[s].dc
        for d in range(dp):
            r = plan.rank(s, d)
            if s > 0:
                ev.append(Event(r, "recv_wait", 0.0, s * (tf + comm), stage=s, mb=0))
            for j in range(m):
                a = j * tf + s * (tf + comm)
                ev.append(Event(r, "forward", a, a + tf, stage=s, mb=j))
                if s < pp - 1:
                    ev.append(Event(r, "transfer", a + tf, a + tf + comm, stage=s, mb=j, bytes=nbytes,
                                    link=link, peer=plan.rank(s + 1, d)))
            b_end = 0.0
            for j in range(m):
                b = t_f_end + j * tb + (pp - 1 - s) * (tb + comm)
                ev.append(Event(r, "backward", b, b + tb, stage=s, mb=j))
                b_end = b + tb
                if s > 0:
                    ev.append(Event(r, "transfer", b + tb, b + tb + comm, stage=s, mb=j, bytes=nbytes,
                                    link=back_link, peer=plan.rank(s - 1, d)))
            ev.append(Event(r, "allreduce", b_end, b_end + ar, stage=s, bytes=nbytes * 10, link=plan.stages[s].dc))
            ev.append(Event(r, "optimizer", b_end + ar, b_end + ar + opt, stage=s))
    return Trace(events=ev, num_ranks=plan.num_ranks, source=source, meta={"plan": plan.to_dict()})
