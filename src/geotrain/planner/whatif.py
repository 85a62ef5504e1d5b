"""What-if sweeps: re-plan with one knob changed, and compare with the baselines at each value.

Keys: wan.latency_ms, wan.capacity_gbps, wan.per_connection_gbps (applied to every WAN link),
dc.<name>.gpus, model (a preset name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from geotrain.errors import GeotrainError
from geotrain.models.presets import PRESETS
from geotrain.spec.load import Spec

WAN_KEYS = ("latency_ms", "capacity_gbps", "per_connection_gbps")


@dataclass
class SweepRow:
    value: str
    iteration_s: float
    tokens_per_s: float
    plan_summary: str
    baselines: dict[str, float] = field(default_factory=dict)   # name -> iteration time (inf: n/a)
    note: str = ""

    def speedup(self, name: str) -> float:
        b = self.baselines.get(name, math.inf)
        return b / self.iteration_s if math.isfinite(b) and self.iteration_s > 0 else math.nan


def parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, vals = text.partition("=")
    values = [v.strip() for v in vals.split(",") if v.strip()]
    if not sep or not values:
        raise GeotrainError(f"--sweep expects KEY=V1,V2,... (got {text!r})")
    return key.strip(), values


def apply_value(spec: Spec, key: str, value: str) -> Spec:
    """The spec with `key` set to `value` (validated through the same pydantic models)."""
    cl = spec.cluster
    if key.startswith("wan."):
        field_name = key[4:]
        if field_name not in WAN_KEYS:
            raise GeotrainError(f"unknown sweep key {key!r} (wan keys: {', '.join('wan.' + k for k in WAN_KEYS)})")
        if not cl.wan_links:
            raise GeotrainError(f"cannot sweep {key}: the cluster has no WAN links")
        v = _number(key, value)
        links = [link.model_validate({**link.model_dump(), field_name: v}) for link in cl.wan_links]
        dumped = [x.model_dump() for x in links]
        return replace(spec, cluster=cl.model_validate({**cl.model_dump(), "wan_links": dumped}))
    if key.startswith("dc.") and key.endswith(".gpus"):
        name = key[3:-5]
        names = [d.name for d in cl.datacenters]
        if name not in names:
            raise GeotrainError(f"unknown datacenter {name!r} in {key} (known: {', '.join(names)})")
        n = _number(key, value)
        if not isinstance(n, int):
            raise GeotrainError(f"{key}: {value!r} is not a whole number of GPUs")
        dcs = [{**d.model_dump(), "gpus": n} if d.name == name else d.model_dump() for d in cl.datacenters]
        return replace(spec, cluster=cl.model_validate({**cl.model_dump(), "datacenters": dcs}))
    if key == "model":
        if value not in PRESETS:
            raise GeotrainError(f"unknown model preset {value!r} (known: {', '.join(PRESETS)})")
        return replace(spec, model=PRESETS[value])
    raise GeotrainError(f"unknown sweep key {key!r} (use wan.latency_ms, wan.capacity_gbps, "
                        f"wan.per_connection_gbps, dc.<name>.gpus or model)")


def _number(key: str, value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise GeotrainError(f"{key}: {value!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise GeotrainError(f"{key}: {value!r} must be a finite number >= 0")
    return int(v) if v.is_integer() else v


def chain_of(plan) -> list[str]:
    out: list[str] = []
    for st in plan.stages:
        if not out or out[-1] != st.dc:
            out.append(st.dc)
    return out


def plot(rows: list[SweepRow], key: str, path: str) -> None:
    """Iteration time of the plan and of each baseline vs the swept value, and our speedup.

    Each baseline keeps one colour and marker in both panels (matplotlib's colour cycle would
    restart per axes and give one name two colours), and the time axis is logarithmic only when
    there is something positive to draw (a sweep where nothing is feasible still gets a picture)."""
    # lazy: matplotlib only when called (importers that never call it stay free of it)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only when called (importers that never call it stay free of it)
    import matplotlib.pyplot as plt

    xs = list(range(len(rows)))
    labels = [r.value for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    plan_ys = [r.iteration_s if math.isfinite(r.iteration_s) else math.nan for r in rows]
    ax1.plot(xs, plan_ys, "o-", color="C0", label="geotrain plan", linewidth=2)
    names = sorted({n for r in rows for n in r.baselines})
    markers = "sD^vP*X"
    drawn = [y for y in plan_ys if y == y and y > 0]
    for i, n in enumerate(names):
        color, marker = f"C{i + 1}", markers[i % len(markers)]
        ys = [r.baselines.get(n, math.inf) for r in rows]
        ys = [y if math.isfinite(y) else math.nan for y in ys]
        drawn += [y for y in ys if y == y and y > 0]
        ax1.plot(xs, ys, linestyle="--", marker=marker, color=color, label=n)
        ax2.plot(xs, [r.speedup(n) for r in rows], linestyle="-", marker=marker, color=color, label=f"vs {n}")
    ax1.set_ylabel("iteration time (s)")
    ax2.set_ylabel("speedup of the plan (x)")
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (ax1, ax2):
        ax.set_xticks(xs, labels)
        ax.set_xlabel(key)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if drawn:
        ax1.set_yscale("log")
    else:
        ax1.text(0.5, 0.5, "no feasible plan at any value", ha="center", va="center", transform=ax1.transAxes)
    fig.suptitle(f"what-if: {key}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as e:
        raise GeotrainError(f"cannot write sweep plot {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)


def check_plot_path(path: str, option: str = "--plot") -> None:
    """Refuse, before any planning, a plot path matplotlib cannot write (unknown format, no such folder)."""
    # lazy: matplotlib only when called (importers that never call it stay free of it)
    from matplotlib.backend_bases import FigureCanvasBase

    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise GeotrainError(f"{option} {path}: unknown picture format {p.suffix or '(none)'!r} "
                            f"(use one of: {', '.join('.' + k for k in sorted(known))})")
    if not p.parent.is_dir():
        raise GeotrainError(f"{option} {path}: folder {p.parent} does not exist")
