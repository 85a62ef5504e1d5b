"""Shrink a plan file to one that trains on this machine in seconds, keeping what acceptance rests on.

`shrink(doc)` takes a plan file's document (the plan and its resolved experiment) and returns
one for a few CPU ranks, keeping every choice the commands judge a plan by:

  * layout -- the stages' datacenter pattern (a run of stages in one DC becomes one stage, at
    least min(pp, 2) stages stay), chunks per stage (interleaved), whether a stage holds a single
    unit (an embedding or head alone), tp > 1 (as 2, distinct per-stage degrees kept distinct),
    dp (at most 2; a region plan keeps one pipeline per DC of its replicas), ep (at most 2);
  * schedule (with each stage's wan-1f1b extra warm-up, at most 1), sharding, precision,
    per-stage checkpointing, micro-batches the fewest the schedule accepts;
  * the model's family and shape flags (GQA group, an explicit head size, MoE with top-k,
    shared expert, tied embeddings, biases, norms, sliding window), at widths every tiny tp divides;
  * DiLoCo (workers, fragments, overlap, codec; the fewest inner steps those allow) and each
    link's connections (at most 2), sharing, temporal order, boundary compression;
  * the cluster's datacenters, GPU types and WAN links, with the GPUs the tiny plan needs (whole
    nodes of 2, or of the widest tiny tp).
Made small and left out: 16-token sequences of a 256-token vocabulary, synthetic data, one step;
no Hugging Face weights (random init of the same shape) and no RoPE scaling (a context extension
past the trained length, which 16 tokens never reach); no [bubbletea] table.
"""

from __future__ import annotations

import copy
import itertools

from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan
from geotrain.schedule.builders import schedule_for_plan

HEAD_DIM = 8


def _tiny_tp(tps: list[int]) -> dict[int, int]:
    """tp -> tiny tp: 1 stays 1; the distinct larger ones become 2, 4, ... in order (at most 4)."""
    big = sorted({t for t in tps if t > 1})
    return {1: 1, **{t: min(2 ** (i + 1), 4) for i, t in enumerate(big)}}


def _stage_groups(stages: list[dict], keep: int) -> list[list[int]]:
    """Consecutive stages in one DC as one group; the first group split while fewer than `keep`."""
    groups = [list(g) for _, g in itertools.groupby(range(len(stages)), key=lambda s: stages[s]["dc"])]
    while len(groups) < keep:
        widest = max(range(len(groups)), key=lambda i: len(groups[i]))
        g = groups[widest]
        groups[widest:widest + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


def shrink(doc: dict) -> dict:
    """A tiny plan file document with the same acceptance-relevant choices as `doc` (see module)."""
    doc = copy.deepcopy(doc)
    p, spec = doc["plan"], doc["resolved_spec"]
    model, cluster, job = spec["model"], spec["cluster"], spec["job"]
    stages = p["stages"]
    v = len(stages[0]["chunks"])
    groups = _stage_groups(stages, min(len(stages), 2))
    pp = len(groups)
    tps = [st["tp"] or p["tp"] for st in stages]
    tiny = _tiny_tp([*tps, p["tp"]])
    # units per virtual stage: a group's chunk k is one consecutive range; at most 2 units each
    counts = []
    for k in range(v):
        for g in groups:
            n = sum(stages[s]["chunks"][k][1] - stages[s]["chunks"][k][0] for s in g)
            counts.append(min(n, 2))
    counts[-1] += max(0, 3 - sum(counts))           # at least one block
    edges = list(itertools.accumulate(counts, initial=0))
    new_stages = []
    for i, g in enumerate(groups):
        first = stages[g[0]]
        t = tiny[tps[g[0]]]
        new_stages.append({"dc": first["dc"], "chunks": [[edges[k * pp + i], edges[k * pp + i + 1]] for k in range(v)],
                           "checkpointing": first["checkpointing"], "tp": None if t == tiny[p["tp"]] else t})
    ep = min(p.get("ep", 1), 2)
    replicas = list(dict.fromkeys(p["replica_dcs"]))
    dp = max(len(replicas), min(p["dp"], 2)) if replicas else min(p["dp"], 2)
    dp += -dp % ep
    if replicas:
        replicas = (replicas * dp)[:dp]
    p.update(stages=new_stages, dp=dp, ep=ep, tp=tiny[p["tp"]], micro_batch=1, replica_dcs=replicas,
             extra_warmup=[min(p["extra_warmup"][g[0]], 1) for g in groups] if p["extra_warmup"] else [],
             pipeline_offsets=p["pipeline_offsets"][:dp] if p["pipeline_offsets"] else [])
    used = {st["dc"] for st in new_stages} | set(replicas)
    for lp in p["links"]:
        lp.update(connections=min(lp["connections"], 2), rank=min(lp["rank"], 4),
                  order=list(range(dp)) if lp["order"] else [])
    p["links"] = [lp for lp in p["links"] if {lp["src_dc"], lp["dst_dc"]} <= used]
    if p["outer"]:
        o = p["outer"]
        o["workers"] = [[w[g[0]] for g in groups] for w in o["workers"]]
        o["fragments"] = min(o["fragments"], 2)
        o["overlap"] = min(o["overlap"], 1)
        o["inner_steps"] = o["fragments"] * (o["overlap"] + 1)
        o["connections"] = min(o["connections"], 2)
        used |= {dc for w in o["workers"] for dc in w}
    widest = max(tiny.values())
    group = max(1, model["heads"] // model["kv_heads"])
    heads = widest * min(group, 2)
    explicit = model["head_size"] and model["head_size"] * model["heads"] != model["hidden"]
    ffn = model["ffn"]
    model.update(layers=sum(counts) - 2, heads=heads, kv_heads=widest, hidden=heads * HEAD_DIM + (8 if explicit else 0),
                 head_size=HEAD_DIM if model["head_size"] else 0, ffn=16 * widest, vocab=256, seq_len=16,
                 max_positions=64 if model["max_positions"] else 0, hf=None, rope_scaling=None,
                 sliding_window=8 if model["sliding_window"] else 0)
    if model["experts"]:
        experts = min(model["experts"], 4)
        model.update(experts=experts, experts_per_token=min(model["experts_per_token"], experts),
                     expert_ffn=model["ffn"] if model["expert_ffn"] == ffn else 8 * widest,
                     shared_expert_ffn=8 * widest if model["shared_expert_ffn"] else 0)
    p["num_microbatches"] = _fewest_microbatches(p)
    gpn = max(2, widest)
    need = Plan.from_dict(p).gpus_per_dc()
    for d in cluster["datacenters"]:
        n = need.get(d["name"], 0)
        d.update(gpus=max(gpn, n + -n % gpn), gpus_per_node=gpn)
    job.update(global_batch=max(1, len(p["outer"]["workers"]) if p["outer"] else 1) * dp * p["num_microbatches"],
               micro_batch=1, steps=1, pp=None, dp=None, tp=p["tp"] if len({tiny[t] for t in tps}) == 1 else "auto",
               ep=ep if model["experts"] else "auto", data="synthetic", eval_every=0, checkpoint_every=0,
               boundary_rank=min(job["boundary_rank"], 4), warmup_steps=0)
    if p["outer"]:
        o = p["outer"]
        job["diloco"].update(inner_steps=o["inner_steps"], fragments=o["fragments"], overlap=o["overlap"],
                             connections=o["connections"], workers=o["workers"])
    spec["bubbletea"] = None
    return doc


def _fewest_microbatches(p: dict) -> int:
    """The fewest micro-batches (1 ..) the plan's schedule builder accepts."""
    for m in range(1, 33):
        try:
            schedule_for_plan(Plan.from_dict({**p, "num_microbatches": m}))
            return m
        except GeotrainError:
            continue
    raise GeotrainError(f"no micro-batch count up to 32 runs schedule {p['schedule']} on the tiny plan")
