"""costs.roofline against the published per-layer profiles (Sailor's, in bench/data/gpu_runs).

For every profiled (model, GPU, micro-batch, tp): one transformer block's forward + backward as
published (the mean of the model's blocks) beside the roofline's -- the block's ops at the runs'
settings (fp32 with TF32 matmuls, Megatron's materialized attention) on the GPU type's fitted
plateau, memory efficiency and host time, plus Megatron's four TP all-reduces of the block's
activation (costs.comm at the node's fitted rate). OPT-350's and GPT-Neo-2.7's GeLU MLPs
(2 x hidden x 4 hidden) are the SwiGLU of equal parameters geotrain's model has (calibrate.gpu_runs
does the same for OPT).

The GPU types are the built-in defaults' (A100 for the A100-40, Hopper's for the GH200) with the
runs' TF32 peaks and the datasheets' HBM bandwidth: this table is what those defaults were fitted
on (docs/DECISIONS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.calibrate.gpu_runs import GpuRunData
from geotrain.costs import comm, roofline
from geotrain.costs.activations import BLOCK
from geotrain.spec.cluster import BUILTIN_GPU_TYPES, Datacenter
from geotrain.spec.model import ModelSpec

# profile GPU name -> (TF32 dense peak FLOP/s, HBM bytes/s, built-in type whose fitted efficiencies and
# host time it uses, the node's all-reduce rate in Gbit/s -- fitted with them: ~180 GB/s for the
# A100s' NVSwitch, ~360 GB/s for the GH200 quad's NVLink)
GPUS = {
    "A100-40": (156e12, 1.555e12, "a100-40g", 1450.0),     # A100 SXM4 40 GB datasheet
    "GH-96": (494e12, 4.0e12, "h100-80g", 2900.0),         # GH200 96 GB (Hopper) datasheet
}
# The runs' GPT-Neo-2.7 had 20 heads of 128, not the 32 of 80 models.json takes from Sailor's training
# config: the measured activation bytes per tp (llm_info) less 20 heads' s x s scores leave 16.5, 10.5,
# 7.5 hidden-sized tensors at tp 1, 2, 4 -- 4.5 + 12 / tp, OPT's 3 + 8 / tp plus GeLU's kept input --
# where 32 heads leave 6.9, 5.7, 5.2, fewer split tensors than q, k and v alone.
HEADS = {"GPT-Neo-2.7": 20}


@dataclass(frozen=True)
class FitRow:
    model: str
    gpu: str
    micro_batch: int
    tp: int
    published_s: float       # one block, forward + backward
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1


def block_spec(data: GpuRunData, model: str) -> ModelSpec:
    m = data.models[model]
    ffn = 4 * round(2 * int(m["ffn_hidden"]) / 3 / 4)       # SwiGLU of the GeLU MLP's parameters, divisible by 4
    heads = HEADS.get(model, int(m["heads"]))
    return ModelSpec(name=model, layers=int(m["transformer_layers"]), hidden=int(m["hidden"]), heads=heads,
                     kv_heads=heads, ffn=ffn, vocab=50304, seq_len=int(m["seq_len"]))


def predicted_block_s(spec: ModelSpec, gpu: str, micro_batch: int, tp: int) -> float:
    peak, bandwidth, builtin, node_gbps = GPUS[gpu]
    t = BUILTIN_GPU_TYPES[builtin]
    device = roofline.Device(peak, t.efficiency, bandwidth * t.memory_efficiency, host_s=t.host_us * 1e-6)
    f, b, w = roofline.kind_seconds(spec, micro_batch, tp, 4, device, attention="materialized")[BLOCK]
    node = Datacenter(name="node", gpu_type=builtin, gpus=tp, gpus_per_node=tp, intra_node_gbps=node_gbps)
    activation = micro_batch * spec.seq_len * spec.hidden * 4
    return f + b + w + (4 * comm.allreduce_time(activation, tp, tp, node) if tp > 1 else 0.0)


def fit_rows(data: GpuRunData) -> list[FitRow]:
    rows = []
    for model, per_gpu in data.profiles.items():
        spec = block_spec(data, model)
        for gpu, entries in per_gpu.items():
            if gpu not in GPUS:
                continue
            for e in entries:
                blocks = range(1, spec.layers + 1)
                published = sum(e["fwd_s"][i] + e["bwd_s"][i] for i in blocks) / len(blocks)
                mb, tp = int(e["mbs"]), int(e["tp"])
                rows.append(FitRow(model, gpu, mb, tp, published, predicted_block_s(spec, gpu, mb, tp)))
    return rows


def fit_markdown(rows: list[FitRow]) -> str:
    errs = sorted(abs(r.error) for r in rows)
    out = ["| model | GPU | micro-batch | tp | published ms | roofline ms | error |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r.model} | {r.gpu} | {r.micro_batch} | {r.tp} | {1e3 * r.published_s:.3f} | "
            f"{1e3 * r.predicted_s:.3f} | {100 * r.error:+.1f} % |" for r in rows]
    out.append(f"\n{len(rows)} points: |error| median {100 * errs[len(errs) // 2]:.1f} %, mean "
               f"{100 * sum(errs) / len(errs):.1f} %, 90th percentile {100 * errs[int(0.9 * len(errs))]:.1f} %, "
               f"worst {100 * errs[-1]:.1f} %; within 10 %: {sum(e <= 0.10 for e in errs)} of {len(errs)}")
    return "\n".join(out)


def _passes_left(per_sample_s: float, spec: ModelSpec, peak: float, bandwidth: float, eff: float) -> float:
    """One block's per-sample time less its linear GEMMs at eff x peak and costs.roofline's
    element-wise bytes (norms, adds, activation) at HBM bandwidth, in passes over its fp32 scores."""
    h, s = spec.hidden, spec.seq_len
    gemm = 3 * 2 * 12 * h * h * s                      # q/k/v, output, MLP: forward + backward FLOPs
    elementwise = 4 * s * (30 * h + 9 * 4 * h)
    return (per_sample_s - gemm / (peak * eff) - elementwise / bandwidth) * bandwidth / (4 * spec.heads * s * s)


def score_passes_left(data: GpuRunData) -> list[str]:
    """Whether one pass count for materialized attention can fit both models (they run the same
    attention code): per GPU and model, the published per-sample time of one block (tp 1, the
    largest micro-batch) as `_passes_left`, the GEMMs at the peak and at the GPU type's plateau;
    OPT's and GPT-Neo's counts meet at the plateau printed (above 1 would be beyond the peak: with
    models.json's 32 GPT-Neo heads it was ~4 on the A100)."""
    out = []
    for gpu, (peak, bandwidth, builtin, _) in GPUS.items():
        plateau = BUILTIN_GPU_TYPES[builtin].efficiency
        per_model = {}
        for model in ("OPT-350", "GPT-Neo-2.7"):
            spec = block_spec(data, model)
            e = max((e for e in data.profiles[model][gpu] if int(e["tp"]) == 1), key=lambda e: int(e["mbs"]))
            blocks = range(1, spec.layers + 1)
            t = sum(e["fwd_s"][i] + e["bwd_s"][i] for i in blocks) / len(blocks) / int(e["mbs"])
            per_model[model] = (t, spec)
            out.append(f"{gpu} {model}: {1e3 * t:.2f} ms a sample (tp 1, micro-batch {e['mbs']}); score passes "
                       f"left, GEMMs at the peak {_passes_left(t, spec, peak, bandwidth, 1.0):.1f}, at the "
                       f"plateau {plateau:g} {_passes_left(t, spec, peak, bandwidth, plateau):.1f}")

        def gap(eff: float, per_model=per_model, peak=peak, bandwidth=bandwidth) -> float:
            opt, neo = (_passes_left(*per_model[m], peak, bandwidth, eff) for m in ("OPT-350", "GPT-Neo-2.7"))
            return opt - neo

        lo, hi = 0.05, 10.0
        for _ in range(60):       # bisect the plateau at which the two counts meet
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if gap(lo) * gap(mid) > 0 else (lo, mid)
        out.append(f"{gpu}: one count for both models needs a GEMM plateau of {lo:.2f} x peak "
                   f"({_passes_left(*per_model['OPT-350'], peak, bandwidth, lo):.1f} passes)")
    return out
