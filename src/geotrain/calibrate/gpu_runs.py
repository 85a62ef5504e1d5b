"""Published GPU training runs as geotrain inputs: a run's spec, its pinned plan, its measured profile.

The data (`bench/data/gpu_runs/`, its README says where from) are Sailor's (SOSP'25) measurements
of OPT-350 on Clariden (GH200, 4 GPUs a node): per run the plan and the measured iteration time,
gradient reduction and peak memory; per layer the forward/backward times, parameters and saved
activation bytes. This module turns them into what geotrain reads -- a Llama-shaped model holding
OPT's bytes and parameters (what still differs: `APPROXIMATIONS`), a (micro-batch, tp) profile
(`sailor_profile`) carrying the measured activation bytes, and one node's link from the published
NCCL curve (`node_link`) -- so the simulator predicts each run from the inputs a user would give.
docs/VALIDATION.md, section 1, says why each choice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geotrain.costs.unit_times import table_key
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan, StagePlan
from geotrain.spec.load import load_spec

FILES = ("runs_clariden_opt350.json", "profiles.json", "models.json", "cluster_clariden.json", "setup.json")
GPU_TYPE = "gh200-96g"
DC = "clariden"
FFN = 2732                      # SwiGLU width holding OPT's 2 x 4h MLP parameters, divisible by tp 1..4
HBM_BYTES_PER_S = 4.0e12        # GH200 96 GB HBM3 datasheet (the optimizer step is memory-bound)
# Per profiled GPU of profiles.json: HBM bandwidth (datasheets) and the GPU as a geotrain GPU type, so
# that an imported profile's times scale to another GPU by the ratio of achieved FLOP/s (unit_times).
GPU_HBM_BYTES_PER_S = {"GH-96": HBM_BYTES_PER_S, "A100-40": 1.555e12}
# Efficiency: the built-in types' large-GEMM plateau (spec.cluster: Hopper 0.48, A100 0.87), so that a profile
# imported for a GPU and used on the built-in type of that GPU is not rescaled.
GH200_TYPE = {"bf16_tflops": 989, "fp16_tflops": 989, "fp32_tflops": 67, "memory_gib": 96.0, "efficiency": 0.48,
              "memory_tbps": HBM_BYTES_PER_S / 1e12, "memory_efficiency": 0.61, "host_us": 78.0}
A100_40_TYPE = {"bf16_tflops": 312, "fp16_tflops": 312, "fp32_tflops": 19.5, "memory_gib": 40.0, "efficiency": 0.87,
                "memory_tbps": 1.555, "memory_efficiency": 0.71, "host_us": 103.0}
GPU_REFERENCE = {"GH-96": GH200_TYPE, "A100-40": A100_40_TYPE}
NVLINK_GBPS = 2 * 8 * 150       # inside a node: the intra-node curves peak near 250 GB/s for 4 GPUs
APPROXIMATIONS = (
    "blocks: geotrain's are identical; each is the mean of Sailor's 24 profiled blocks (block 1 is "
    "0.2-10 % slower than the others in the profile)",
    "the embedding holds vocab x hidden parameters per tp share; OPT's learned positions (2048 x 1024, "
    "replicated over tp) are not in it: 2.1 M of 103.7 M parameters per GPU at tp 4",
    "SwiGLU with ffn 2732 for OPT's GeLU MLP (ffn 4096): +0.05 % parameters a block; no biases (+0.04 %)",
    "the embedding's backward is what Sailor's profile measured (~1 us: not captured)",
)


@dataclass(frozen=True)
class GpuRunData:
    runs: list[dict[str, Any]]
    profiles: dict[str, Any]
    models: dict[str, Any]
    cluster: dict[str, Any]
    setup: dict[str, Any]
    directory: Path


def load_gpu_runs(directory: str | Path) -> GpuRunData:
    """The folder's five files, or a one-line GeotrainError naming what is missing or malformed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise GeotrainError(f"--gpu-runs {directory}: not a directory (the folder of runs_clariden_opt350.json, "
                            "profiles.json, ...; bench/data/gpu_runs in the repository)")
    docs = []
    for name in FILES:
        try:
            docs.append(json.loads((directory / name).read_text()))
        except FileNotFoundError:
            raise GeotrainError(f"--gpu-runs {directory}: {name} is missing") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GeotrainError(f"--gpu-runs {directory}: cannot read {name} ({e})") from None
    runs, profiles, models, cluster, setup = docs
    try:
        return GpuRunData(runs=list(runs["runs"]), profiles=profiles["profiles"], models=models["models"],
                          cluster=cluster, setup=setup, directory=directory)
    except (KeyError, TypeError) as e:
        raise GeotrainError(f"--gpu-runs {directory}: unexpected layout ({e!r} missing)") from None


def curve_time(coeffs: list[float], nbytes: float) -> float:
    """Seconds to send `nbytes` by a published bandwidth curve (cluster_clariden.json's formula)."""
    x = math.log2(nbytes / 1e6)
    return nbytes / 1e9 / (coeffs[0] * x * x + coeffs[1] * x + coeffs[2])


def node_link(data: GpuRunData, pair: str = "n=1->1") -> tuple[float, float]:
    """(bytes/s, latency s) of the alpha-beta line t = latency + bytes / rate closest (least squares
    on relative error) to a published inter-node curve between 1 MB and 1 GB, where the curve was
    measured; `pair` names the curve (default: one GPU pair, i.e. one node's NIC)."""
    coeffs = data.cluster["inter_node"]["GH-96"]["GH-96"][pair]["coeffs"]
    sizes = [1e6 * 2 ** (k / 3) for k in range(31)]           # 1 MB .. 1 GB
    rows = [(1 / curve_time(coeffs, s), s / curve_time(coeffs, s)) for s in sizes]
    # minimise sum (a * r0 + g * r1 - 1)^2 over (a, g): alpha = a, 1 / rate = g
    s00 = sum(r0 * r0 for r0, _ in rows)
    s01 = sum(r0 * r1 for r0, r1 in rows)
    s11 = sum(r1 * r1 for _, r1 in rows)
    b0, b1 = sum(r0 for r0, _ in rows), sum(r1 for _, r1 in rows)
    det = s00 * s11 - s01 * s01
    alpha, g = (b0 * s11 - b1 * s01) / det, (s00 * b1 - s01 * b0) / det
    return 1 / g, max(0.0, alpha)


def padded_vocab(data: GpuRunData, model: str, tp: int) -> int:
    return int(data.models[model]["vocab"]["padded_vocab_by_tp"][str(tp)])


def cluster_toml(data: GpuRunData, nodes: int) -> str:
    """One DC of `nodes` nodes: the GH200 (memory from the data, datasheet peaks; the times come from
    the profile), NVLink inside a node, each GPU's share of the node's inter-node link (`node_link`)."""
    per_node = int(data.cluster["gpus_per_node"])
    rate, latency = node_link(data)
    gib = data.cluster["mem_per_gpu_bytes"] / 2 ** 30
    return f'''name = "clariden-{nodes}"
# {data.cluster["name"]}: {nodes} node(s) of {per_node} x {data.cluster["gpu_type"]}
[gpu_types.{GPU_TYPE}]
bf16_tflops = 989
fp16_tflops = 989
fp32_tflops = 67
memory_gib = {gib:.4f}
efficiency = 0.5

[[datacenters]]
name = "{DC}"
gpu_type = "{GPU_TYPE}"
gpus = {nodes * per_node}
gpus_per_node = {per_node}
intra_node_gbps = {NVLINK_GBPS}
# one node's link (the one-pair NCCL curve, alpha-beta fit) shared by its {per_node} GPUs
intra_dc_gbps = {rate * 8 / 1e9 / per_node:.3f}
intra_dc_latency_us = {latency * 1e6:.1f}
'''


def model_toml(data: GpuRunData, model: str, tp: int) -> str:
    m = data.models[model]
    return f'''name = "{model.lower()}-as-llama"
# {model} as geotrain's Llama-shaped decoder (calibrate/gpu_runs.py: what is approximated)
layers = {m["transformer_layers"]}
hidden = {m["hidden"]}
heads = {m["heads"]}
kv_heads = {m["heads"]}
ffn = {FFN}
vocab = {padded_vocab(data, model, tp)}
seq_len = {m["seq_len"]}
'''


def job_toml(run: dict[str, Any]) -> str:
    return f'''name = "{run["id"].rsplit("/", 1)[-1]}"
cluster = "cluster.toml"
model = "model.toml"

[job]
global_batch = {run["gbs"]}
micro_batch = {run["mbs"]}
precision = "fp32"
checkpointing = "none"
sharding = "replicate"
optimizer = "adamw"
schedule = "1f1b"
pp = {run["pp"]}
dp = {run["dp"]}
tp = {run["tp"]}
'''


def write_run_spec(data: GpuRunData, run: dict[str, Any], directory: str | Path):
    """Write the run's cluster, model and experiment TOML into `directory`; returns the loaded Spec."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cluster.toml").write_text(cluster_toml(data, int(run["nodes"])))
    (directory / "model.toml").write_text(model_toml(data, run["model"], int(run["tp"])))
    path = directory / "spec.toml"
    path.write_text(job_toml(run))
    return load_spec(path)


def run_plan(run: dict[str, Any]) -> Plan:
    """The run's plan pinned as it ran: Sailor's layer ranges as unit ranges (the same indices), one
    stage per range in the one DC, 1F1B, fp32, no checkpointing, replicated DP."""
    stages = tuple(StagePlan(dc=DC, chunks=((int(s["layers"][0]), int(s["layers"][1]) + 1),)) for s in run["stages"])
    if any(int(r["tp"]) != int(run["tp"]) for s in run["stages"] for r in s["replicas"]):
        raise GeotrainError(f"run {run['id']}: replicas of different tp are not converted")
    if int(run["mbs"]) * int(run["dp"]) * int(run["microbatches_per_replica"]) != int(run["gbs"]):
        raise GeotrainError(f"run {run['id']}: mbs x dp x micro-batches != gbs")
    return Plan(stages=stages, dp=int(run["dp"]), micro_batch=int(run["mbs"]),
                num_microbatches=int(run["microbatches_per_replica"]), schedule="1f1b", tp=int(run["tp"]),
                precision="fp32", checkpointing="none", sharding="replicate",
                name=run["id"].rsplit("/", 1)[-1])


def has_lm_head(models: dict[str, Any], model: str) -> bool:
    """Whether Sailor's last layer of `model` holds the vocabulary projection (OPT-350's does;
    GPT-Neo-2.7's is the final LayerNorm alone: the artifact's model has no LM-head layer)."""
    m = models[model]
    last = int(m["llm_info_per_layer"]["1"]["params_floats"][-1])
    return last >= int(m["hidden"]) * int(m["vocab"]["padded_vocab_by_tp"]["1"])


def sailor_profile(data: GpuRunData, model: str, gpu: str) -> dict[str, Any]:
    """Sailor's per-layer profile of `model` on `gpu` as a geotrain measured profile: per (mbs, tp)
    the embedding (layer 0), one block (the mean of layers 1..L) and the head (layer L+1), forward
    and backward seconds and -- where models.json has that tp -- the activation bytes a micro-batch
    keeps (act_mem_floats x 4 x mbs). A last layer without the LM head (GPT-Neo-2.7) is not taken
    as geotrain's head, whose vocabulary projection it never measured: the head is left to the
    cost model's estimate."""
    entries = data.profiles[model][gpu]
    layers = int(data.models[model]["transformer_layers"])
    info = data.models[model]["llm_info_per_layer"]
    kinds = {"embedding": [0], "block": list(range(1, layers + 1)), "head": [layers + 1]}
    if not has_lm_head(data.models, model):
        del kinds["head"]
    out: dict[str, Any] = {kind: {} for kind in kinds}
    for e in entries:
        mbs, tp = int(e["mbs"]), int(e["tp"])
        act = info.get(str(tp), {}).get("act_mem_floats")
        for kind, idx in kinds.items():
            fwd = sum(e["fwd_s"][i] for i in idx) / len(idx)
            bwd = sum(e["bwd_s"][i] for i in idx) / len(idx)
            row = [fwd, bwd]
            if act is not None:
                row.append(4.0 * mbs * sum(act[i] for i in idx) / len(idx))
            out[kind][table_key(mbs, tp)] = row
    if any(len({len(r) for r in out[k].values()}) > 1 for k in out):   # bytes for some tps only: drop them
        out = {k: {key: r[:2] for key, r in t.items()} for k, t in out.items()}
    out["memory_bytes_per_s"] = GPU_HBM_BYTES_PER_S.get(gpu, HBM_BYTES_PER_S)
    out["source"] = (f"Sailor (SOSP'25) per-layer profile of {model} on {gpu} (profiles.json in "
                     f"{data.directory}), imported by geotrain.calibrate.gpu_runs")
    return out


def import_sailor_profile(directory: str | Path, model: str, gpu: str) -> dict[str, Any]:
    """`sailor_profile` of `model` on `gpu` from a folder in the gpu_runs format (only its
    profiles.json and models.json are read), with the GPU it was measured on as `reference_gpu`:
    what `geotrain profile --import-sailor` writes. A one-line GeotrainError for a missing folder,
    file, model or GPU."""
    directory = Path(directory)
    docs = []
    for name in ("profiles.json", "models.json"):
        try:
            docs.append(json.loads((directory / name).read_text()))
        except FileNotFoundError:
            raise GeotrainError(f"--import-sailor {directory}: {name} is missing (the gpu_runs folder format: "
                                "bench/data/gpu_runs)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GeotrainError(f"--import-sailor {directory}: cannot read {name} ({e})") from None
    try:
        profiles, models = docs[0]["profiles"], docs[1]["models"]
    except (KeyError, TypeError) as e:
        raise GeotrainError(f"--import-sailor {directory}: unexpected layout ({e!r} missing)") from None
    if model not in profiles or model not in models:
        raise GeotrainError(f"--import-sailor: no model {model!r} (the folder has {', '.join(sorted(profiles))})")
    if gpu not in profiles[model]:
        raise GeotrainError(f"--import-sailor: no profile of {model} on {gpu!r} (there are: "
                            f"{', '.join(sorted(profiles[model]))})")
    data = GpuRunData(runs=[], profiles=profiles, models=models, cluster={}, setup={}, directory=directory)
    out = sailor_profile(data, model, gpu)
    if gpu in GPU_REFERENCE:
        out["reference_gpu"] = dict(GPU_REFERENCE[gpu])
    return out
