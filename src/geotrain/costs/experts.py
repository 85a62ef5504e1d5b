"""What a mixture of experts adds to the cost model, as the runtime runs it (runtime/expert_parallel.py).

* Compute: a token computes with its k routed experts (and the shared one): `units.block_matmul_params`.
* Parameters and memory: every expert is stored; under expert parallelism (ep > 1) a GPU holds
  1/ep of them (and 1/tp of each expert's rows). FSDP2 leaves EP-split experts alone, so under
  zero2/zero3 their parameters, gradients and optimizer state are held as under replicated DP.
* Communication per micro-batch and MoE block, inside the stage's DC: expert parallelism moves
  the routed rows (k per token, hidden wide, in the compute dtype) to their expert's GPU and
  back with all-to-alls -- two in the forward, two in the backward -- of which (ep-1)/ep leaves
  the GPU; under TP the experts' partial outputs are all-reduced over the TP group (k rows per
  token where a dense MLP all-reduces one), and the shared expert's as a dense MLP's.
"""

from __future__ import annotations

from geotrain.costs.comm import GBIT, allreduce_time
from geotrain.spec.cluster import Datacenter


def routed_params(spec) -> int:
    """Parameters of one block's routed experts, all of them."""
    return 3 * spec.hidden * spec.expert_ffn * spec.experts if spec.experts else 0


def block_params_per_gpu(spec, block_params: int, ep: int) -> int:
    """A block's parameters on one GPU of an EP group (before the tp split)."""
    return block_params - routed_params(spec) * (ep - 1) // ep


def routed_bytes(spec, micro_batch: int, dtype_bytes: int) -> int:
    """The routed rows of one micro-batch through one MoE block: k per token, hidden wide."""
    return spec.experts_per_token * micro_batch * spec.seq_len * spec.hidden * dtype_bytes


def all_to_all_time(nbytes: float, n: int, per_node: int, dc: Datacenter) -> float:
    """One all-to-all of `nbytes` per GPU over `n` GPUs packed `per_node` to a node: the share for
    GPUs of its node over NVLink-class `intra_node_gbps`, the rest over its NIC (`intra_dc_gbps`),
    both at once, one latency per peer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    g = max(1, min(n, per_node))
    on_node, off_node = nbytes * (g - 1) / n, nbytes * (n - g) / n
    return (max(on_node / (dc.intra_node_gbps * GBIT), off_node / (dc.intra_dc_gbps * GBIT))
            + (n - 1) * dc.intra_dc_latency_us * 1e-6)


def moe_comm_time(spec, blocks: int, micro_batch: int, dtype_bytes: int, ep: int, tp: int, dc: Datacenter) -> float:
    """Per micro-batch (forward + backward) of `blocks` MoE blocks on one GPU: the EP all-to-alls
    and, under TP, the experts' all-reduces beyond the one a dense MLP would run."""
    if not spec.experts or not blocks:
        return 0.0
    rows = routed_bytes(spec, micro_batch, dtype_bytes)
    t = 4 * all_to_all_time(rows, ep, max(1, dc.gpus_per_node // tp), dc) if ep > 1 else 0.0
    if tp > 1:      # in place of a dense MLP's all-reduce (forward, backward): the routed rows', the shared one's
        dense = allreduce_time(micro_batch * spec.seq_len * spec.hidden * dtype_bytes, tp, dc.gpus_per_node, dc)
        routed = allreduce_time(rows, tp, dc.gpus_per_node, dc)
        t += 2 * (routed - dense + (dense if spec.shared_expert_ffn else 0.0))
    return blocks * t


def replicated_expert_params(spec, blocks: int, ep: int, sharding: str) -> int:
    """Of a stage's parameters on one GPU, the EP-split experts FSDP2 leaves whole (zero2/zero3)."""
    if ep <= 1 or sharding not in ("zero2", "zero3", "fsdp"):
        return 0
    return blocks * routed_params(spec) // ep
