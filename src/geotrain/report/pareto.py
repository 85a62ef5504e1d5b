"""Cost against throughput of the simulated finalists, the chosen plan marked (plan --pareto)."""

from __future__ import annotations

import math

from geotrain.errors import GeotrainError
from geotrain.layout.price import cost_per_mtoken, egress_per_iteration


def draw_pareto(spec, simulated, chosen_index: int, path: str, objective: str) -> int:
    """Write a PNG of $/1M tokens vs tokens/s, one point per simulated finalist (the Pareto front,
    cheaper and faster than every other, joined by a line); returns the points drawn."""
    import matplotlib  # optional heavy dependency: only for drawing

    matplotlib.use("Agg")
    # lazy: matplotlib only when called (importers that never call it stay free of it)
    import matplotlib.pyplot as plt

    pts = []
    for i, (plan, t) in enumerate(simulated):
        usd = cost_per_mtoken(spec.cluster, plan, t, spec.model.seq_len, egress_per_iteration(spec, plan))
        if usd is not None and math.isfinite(t) and t > 0:
            pts.append((plan.global_batch * spec.model.seq_len / t, usd, plan, i))
    if not pts:
        raise GeotrainError("--pareto: no simulated plan has a price (set price_per_gpu_hour for the DCs)")
    front, best = [], math.inf
    for x, y, _, _ in sorted(pts, key=lambda p: -p[0]):     # fastest first: keep each new cheapest
        if y < best:
            front.append((x, y))
            best = y
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:gray", label="simulated finalists")
    ax.plot(*zip(*sorted(front)), color="tab:blue", lw=1, label="Pareto front")
    for x, y, plan, i in pts:
        if i == chosen_index:
            ax.scatter([x], [y], s=160, facecolors="none", edgecolors="tab:red", lw=2,
                       label=f"chosen ({objective})")
        ax.annotate(f"{plan.name} ({plan.num_ranks} GPUs)", (x, y), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xlabel("tokens/s (simulated)")
    ax.set_ylabel("$ per 1M tokens (GPU-hours)")
    ax.set_title(f"{spec.name}: cost vs throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise GeotrainError(f"--pareto {path}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return len(pts)
