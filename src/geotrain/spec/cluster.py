"""Cluster spec: GPU types, datacenters, and the WAN links between them.

Units are the ones operators quote: Gbit/s for bandwidth, ms for WAN one-way latency, us for
intra-DC latency, GiB for memory, TFLOP/s for compute.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from geotrain.spec.base import Identifier, Strict, bounded_float, bounded_int

PRECISIONS = ("fp32", "bf16", "fp16")


class GPUType(Strict):
    """A GPU model: peak dense FLOP/s by precision, memory and its bandwidth, and the fraction of
    peak a large GEMM really achieves (the plateau of costs.roofline's GEMM-shape curve: smaller
    GEMMs fall off it, element-wise ops are priced by memory bandwidth, each kernel pays a launch).

    `roofline = false` prices compute as FLOPs / (peak x efficiency), nothing else: the CPU
    emulation target, whose real times come from a measured profile."""

    bf16_tflops: bounded_float(1e-3, 1e5)     # 1 GFLOP/s .. 100 PFLOP/s per GPU
    fp16_tflops: bounded_float(1e-3, 1e5)
    fp32_tflops: bounded_float(1e-3, 1e5)     # an fp32 job's matmul peak (TF32's where the runtime uses it)
    memory_gib: bounded_float(1e-3, 1e5)      # 1 MiB .. 100 TiB
    efficiency: bounded_float(1e-3, 1.0) = 0.5    # below 0.1 % of peak no kernel runs (and times overflow)
    memory_tbps: bounded_float(1e-6, 1e4) | None = None   # HBM TB/s; None: bf16 peak / 200 FLOP per byte
    memory_efficiency: bounded_float(1e-3, 1.0) = 0.6     # the fraction of it unfused element-wise kernels reach
    host_us: bounded_float(0.0, 1e6) = 100.0   # host dispatch per kernel: a pass takes at least kernels x this
    roofline: bool = True

    def peak_flops(self, precision: str) -> float:
        return {"fp32": self.fp32_tflops, "bf16": self.bf16_tflops, "fp16": self.fp16_tflops}[precision] * 1e12

    def achieved_flops(self, precision: str) -> float:
        return self.peak_flops(precision) * self.efficiency

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


# Public datasheet numbers (dense, no sparsity; HBM bandwidth of the SXM parts). `efficiency` (the
# GEMM plateau, reached only as d / (d + 133) -> 1), `memory_efficiency` and `host_us` are fitted to
# the published per-layer profiles (docs/DECISIONS.md, "A GPU-shaped compute model"): A100 0.87, 0.71,
# 103 us; Hopper 0.48, 0.61, 78 us (GH200 in a power-capped node, with its Grace host: an H100 at
# full power may do more); V100 takes A100's. `cpu` is this project's emulation target.
BUILTIN_GPU_TYPES: dict[str, GPUType] = {
    "a100-40g": GPUType(bf16_tflops=312, fp16_tflops=312, fp32_tflops=19.5, memory_gib=40, efficiency=0.87,
                        memory_tbps=1.555, memory_efficiency=0.71, host_us=103),
    "a100-80g": GPUType(bf16_tflops=312, fp16_tflops=312, fp32_tflops=19.5, memory_gib=80, efficiency=0.87,
                        memory_tbps=2.039, memory_efficiency=0.71, host_us=103),
    "h100-80g": GPUType(bf16_tflops=989, fp16_tflops=989, fp32_tflops=67, memory_gib=80, efficiency=0.48,
                        memory_tbps=3.35, memory_efficiency=0.61, host_us=78),
    "v100-32g": GPUType(bf16_tflops=125, fp16_tflops=125, fp32_tflops=15.7, memory_gib=32, efficiency=0.87,
                        memory_tbps=0.9, memory_efficiency=0.71, host_us=103),
    "cpu": GPUType(bf16_tflops=0.1, fp16_tflops=0.02, fp32_tflops=0.06, memory_gib=4, efficiency=1.0,
                   roofline=False),
}


class Datacenter(Strict):
    name: Identifier
    gpu_type: str
    gpus: bounded_int(1, 10**7)
    gpus_per_node: bounded_int(1, 1024) = 8
    intra_node_gbps: bounded_float(1e-3, 1e12) = 2400.0     # up to 1e12: "free" links in what-if studies
    intra_dc_gbps: bounded_float(1e-3, 1e12) = 200.0
    intra_dc_latency_us: float = Field(5.0, ge=0, le=1e6)
    price_per_gpu_hour: float | None = Field(None, ge=0, le=1e6)
    # DCs of one region (zones of a cloud region): the planner may spread a stage's DP replicas
    # over them, the gradient reduction then crossing their links (planner/regions.py).
    region: Identifier | None = None


class WanLink(Strict):
    """A bidirectional WAN link; each direction has the full `capacity_gbps`.

    One TCP connection over a long fat pipe is window/RTT bound, hence `per_connection_gbps`:
    n parallel connections reach min(n * per_connection_gbps, capacity_gbps)."""

    # TOML gives a list; strict mode would insist on a Python tuple, so only this field is lax
    # (its items are still strict strings).
    between: tuple[str, str] = Field(strict=False)
    latency_ms: float = Field(gt=0, le=1e4)              # > 0: light takes time; 10 s one way: past any WAN
    capacity_gbps: bounded_float(1e-6, 1e12)              # 1 kbit/s .. 1e12 (a "free" WAN in studies)
    per_connection_gbps: bounded_float(1e-6, 1e12)
    max_connections: bounded_int(1, 4096) = 64
    loss: float = Field(0.0, ge=0, lt=1)                 # a fraction of packets: below 100 %
    jitter_ms: float = Field(0.0, ge=0, le=1e4)
    egress_usd_per_gb: float | None = Field(None, ge=0, le=1e4)   # $ per GB sent over the link (either way)

    @field_validator("between")
    @classmethod
    def _distinct(cls, v: tuple[str, str]) -> tuple[str, str]:
        if v[0] == v[1]:
            raise ValueError("a WAN link must join two different datacenters")
        return v

    def rate_gbps(self, connections: int) -> float:
        """Effective rate of one transfer striped over `connections` TCP connections."""
        n = max(1, min(connections, self.max_connections))
        return min(n * self.per_connection_gbps, self.capacity_gbps)

    def connections_to_saturate(self) -> int:
        """The fewest connections that reach the link's capacity (capped by max_connections)."""
        need = -(-self.capacity_gbps // self.per_connection_gbps)
        return int(min(max(1, need), self.max_connections))


class Cluster(Strict):
    name: str = "cluster"
    gpu_types: dict[str, GPUType] = Field(default_factory=dict)
    datacenters: list[Datacenter] = Field(min_length=1)
    wan_links: list[WanLink] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_references(self) -> Cluster:
        names = [dc.name for dc in self.datacenters]
        seen: set[str] = set()
        for i, n in enumerate(names):
            if n in seen:
                raise ValueError(f"datacenters[{i}].name: duplicate datacenter name {n!r}")
            seen.add(n)
        for i, dc in enumerate(self.datacenters):
            if dc.gpu_type not in self.gpu_types and dc.gpu_type not in BUILTIN_GPU_TYPES:
                known = sorted(set(self.gpu_types) | set(BUILTIN_GPU_TYPES))
                raise ValueError(
                    f"datacenters[{i}].gpu_type: unknown GPU type {dc.gpu_type!r} (known: {', '.join(known)})"
                )
        pairs: set[frozenset[str]] = set()
        for i, link in enumerate(self.wan_links):
            for end in link.between:
                if end not in seen:
                    raise ValueError(f"wan_links[{i}].between: unknown datacenter {end!r}")
            key = frozenset(link.between)
            if key in pairs:
                raise ValueError(f"wan_links[{i}].between: duplicate link {link.between[0]}-{link.between[1]}")
            pairs.add(key)
        return self

    def gpu(self, gpu_type: str) -> GPUType:
        return self.gpu_types.get(gpu_type) or BUILTIN_GPU_TYPES[gpu_type]

    def dc(self, name: str) -> Datacenter:
        for d in self.datacenters:
            if d.name == name:
                return d
        raise KeyError(name)

    def link(self, a: str, b: str) -> WanLink | None:
        """The WAN link joining datacenters a and b (either order), or None."""
        key = {a, b}
        for link in self.wan_links:
            if set(link.between) == key:
                return link
        return None

    @property
    def total_gpus(self) -> int:
        return sum(dc.gpus for dc in self.datacenters)

    @property
    def total_memory_bytes(self) -> float:
        return sum(dc.gpus * self.gpu(dc.gpu_type).memory_bytes for dc in self.datacenters)
