"""The gradient norm's exchange over a real (kernel-emulated) WAN costs stage 0 no round trip.

Two ranks, stage 0 in one DC and the last stage in the other, 20 ms apart, each running the real
`Trainer` + `GradNorm` over gloo. The last stage finishes its iteration first (as in 1F1B) and
sends its partial sum; stage 0 is still busy for 0.3 s. A gloo send leaves only once the receiver
has posted its receive, so stage 0 must have posted it before its iteration: then the partial is
waiting when stage 0 is done, and stage 0 steps within a few ms; posted when stage 0 is done, the
receiver's notice and the data cross the WAN first -- a 40 ms round trip on the critical path.
The norm both ranks clip with is the norm of both stages' gradients.

Run as a script (`python tests/test_grad_norm_wan.py RANK OUT`) it is one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

PY = sys.executable
LATENCY_MS = 20.0
BUSY_S = 0.3          # stage 0's iteration after the last stage's (its last backward)
STEPS = 3


def _spec(tmp: Path) -> Path:
    (tmp / "cluster.toml").write_text(f"""name = "norm-wan"
[[datacenters]]
name = "east"
gpu_type = "cpu"
gpus = 1
[[datacenters]]
name = "west"
gpu_type = "cpu"
gpus = 1
[[wan_links]]
between = ["east", "west"]
latency_ms = {LATENCY_MS}
capacity_gbps = 0.1
per_connection_gbps = 0.1
""")
    (tmp / "job.toml").write_text(f"""name = "norm-wan"
cluster = "{tmp / 'cluster.toml'}"
model = "tiny"
[job]
global_batch = 4
micro_batch = 2
precision = "fp32"
pp = 2
dp = 1
grad_clip = 1e-3
""")
    return tmp / "job.toml"


def _rank(rank: int, spec_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from geotrain.planner.manual import plan_from_job
    from geotrain.runtime.recipe import GradNorm
    from geotrain.runtime.recorder import Recorder
    from geotrain.runtime.trainer import Trainer
    from geotrain.spec.load import load_spec

    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    spec = load_spec(spec_path)
    plan = plan_from_job(spec)
    layer = torch.nn.Linear(8, 8)

    class Runner:        # one stage's iteration: a real backward, stage 0 busy for BUSY_S after it
        done, sq = 0.0, 0.0

        def run_iteration(self, batches, loss_scale=1.0):
            layer(torch.randn(4, 8)).square().sum().backward()
            Runner.sq = sum(float(p.grad.double().square().sum()) for p in layer.parameters())
            if plan.coords(rank)[0] == 0:
                time.sleep(BUSY_S)
            Runner.done = time.time()
            return 0.0

    rows = []
    trainer = Trainer(Runner(), list(layer.parameters()), torch.optim.SGD(layer.parameters(), lr=0.0),
                      job=spec.job, norm=GradNorm(plan, rank, torch.device("cpu"), 60.0),
                      recorder=Recorder(rank, 0.0, enabled=False))
    for step in range(1, STEPS + 1):
        dist.barrier()
        result = trainer.step(step, {})
        rows.append({"after_iteration_s": time.time() - Runner.done, "norm": result.grad_norm, "sq": Runner.sq})
    Path(out).write_text(json.dumps({"rows": rows}))
    dist.destroy_process_group()


def test_stage_0_finds_the_partial_sum_waiting(tmp_path):
    from geotrain.emulation import WanEmulation
    from geotrain.spec import Cluster
    from geotrain.spec.load import load_spec

    spec = _spec(tmp_path)
    cluster: Cluster = load_spec(spec).cluster
    with WanEmulation(cluster) as wan:
        procs = [wan.popen(dc, [PY, __file__, str(r), str(spec), str(tmp_path / f"rank{r}.json")],
                           env={**wan.rank_env(dc, "east", 29731), "RANK": str(r), "WORLD_SIZE": "2",
                                "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r, dc in enumerate(("east", "west"))]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text())["rows"] for r in (0, 1))
    # stage 0: from its iteration's end to its step's end -- no WAN crossing on the way
    waits = [r["after_iteration_s"] for r in first]
    assert min(waits) < 0.5 * LATENCY_MS * 1e-3, waits
    # the last stage waits for the total: one crossing after stage 0 is done
    assert min(r["after_iteration_s"] for r in last) >= 0.5 * BUSY_S, last
    for a, b in zip(first, last):
        assert a["norm"] == b["norm"] and abs(a["norm"] - (a["sq"] + b["sq"]) ** 0.5) <= 1e-12 * a["norm"]


if __name__ == "__main__":
    _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3])
