"""Cost model against hand-computed values and against the real PyTorch model (params, FLOPs)."""

import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from geotrain.costs import CostModel, comm
from geotrain.models.llama import build_unit
from geotrain.models.presets import PRESETS
from geotrain.spec.cluster import BUILTIN_GPU_TYPES, Datacenter

A100 = BUILTIN_GPU_TYPES["a100-80g"]


# -- parameters ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_unit_params_equal_the_real_model(name):
    spec = PRESETS[name]
    cost = CostModel(spec)
    for u in range(spec.num_units):
        assert cost.unit_params(u) == sum(p.numel() for p in build_unit(spec, u).parameters()), u
    assert cost.stage_params(range(spec.num_units)) == spec.param_count()


def test_big_presets_param_counts_are_the_published_ones():
    # Meta's released checkpoints: exact parameter counts of Llama-2 7B / 13B / 70B.
    exact = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192}
    for name, n in exact.items():
        assert CostModel(PRESETS[name]).stage_params(range(PRESETS[name].num_units)) == n, name
    n175 = CostModel(PRESETS["gpt3-175b"]).stage_params(list(range(PRESETS["gpt3-175b"].num_units)))
    assert abs(n175 - 175e9) / 175e9 < 0.01


def test_stage_params_of_a_list_equals_the_sum_of_its_units():
    spec = PRESETS["small"]
    cost = CostModel(spec)
    for units in ([0, 1, 2], [3, 4], [5, 6, 7], [1, 7], list(range(spec.num_units))):
        assert cost.stage_params(units) == sum(cost.unit_params(u) for u in units)
        assert cost.stage_params(range(units[0], units[-1] + 1)) == sum(
            cost.unit_params(u) for u in range(units[0], units[-1] + 1))


# -- FLOPs -----------------------------------------------------------------------------------
def test_block_flops_by_hand_tiny():
    # tiny: h=64, kv=2*16=32, ffn=172, s=64; micro-batch 2 -> 128 tokens.
    matmul_params = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 172  # 45312
    fwd = 2 * matmul_params * 128 + 4 * 2 * 64 * 64 * 64     # 11_599_872 + 2_097_152
    assert CostModel(PRESETS["tiny"]).unit_flops(1, 2) == (fwd, 2 * fwd)
    assert CostModel(PRESETS["tiny"]).unit_flops(5, 2) == (2 * 64 * 256 * 128, 4 * 64 * 256 * 128)
    assert CostModel(PRESETS["tiny"]).unit_flops(0, 2) == (0, 0)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_unit_flops_equal_torch_flop_counter(name):
    """FlopCounterMode counts the real model's matmuls (SDPA in its math form, so QK^T and AV
    show up as bmm); forward and backward must match ours exactly."""
    spec = PRESETS[name]
    cost = CostModel(spec, precision="fp32")
    for u in (0, 1, spec.num_units - 1):
        unit = build_unit(spec, u)
        x = (torch.randint(0, spec.vocab, (2, spec.seq_len)) if u == 0
             else torch.randn(2, spec.seq_len, spec.hidden, requires_grad=True))
        with sdpa_kernel(SDPBackend.MATH):
            with FlopCounterMode(display=False) as fwd:
                y = unit(x)
            with FlopCounterMode(display=False) as bwd:
                y.float().sum().backward()
        assert cost.unit_flops(u, 2) == (fwd.get_total_flops(), bwd.get_total_flops()), u


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-13b", "llama2-70b", "gpt3-175b"])
def test_training_flops_is_6_n_tokens_plus_attention(name):
    spec = PRESETS[name]
    cost = CostModel(spec)
    tokens = 1_000_000
    n = spec.param_count()
    h, L, s, v = spec.hidden, spec.layers, spec.seq_len, spec.vocab
    attention = 12 * L * h * s * tokens
    # Exact: the embedding gather and the norms do no matmul.
    non_matmul = v * h + (2 * L + 1) * h
    assert cost.training_flops(tokens) == pytest.approx(6 * (n - non_matmul) * tokens + attention, rel=1e-12)
    # The rule of thumb: 6 N tokens plus the attention term, off only by the embedding's share
    # (1.9% for 7B, the largest among these).
    assert cost.training_flops(tokens) == pytest.approx(6 * n * tokens + attention, rel=0.02)
    # ...and consistent with the per-unit numbers.
    per_seq = sum(sum(cost.unit_flops(u, 1)) for u in range(spec.num_units))
    assert cost.training_flops(s * 3) == pytest.approx(3 * per_seq, rel=1e-12)


# -- memory ----------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,optimizer,per_param",
                         [("bf16", "adamw", 16), ("fp16", "adam", 16), ("fp32", "adamw", 16),
                          ("bf16", "sgd", 8), ("fp32", "sgd", 8)])
def test_training_state_bytes_per_param_under_replicate(precision, optimizer, per_param):
    spec = PRESETS["llama2-7b"]
    cost = CostModel(spec, precision=precision, optimizer=optimizer)
    units = range(3, 9)
    m = cost.stage_memory(units, A100, micro_batch=1, inflight=1, sharding="replicate", dp=8)
    assert (m.params + m.grads + m.optimizer) / cost.stage_params(units) == per_param


def test_sharding_divides_the_right_terms_by_dp():
    """The runtime's state at a step's peak: fp32 weights and gradients (autocast), Adam's fp32
    moments; zero1 shards the moments, FSDP (zero2/zero3) also the weights, but gathers them
    during the step (zero2: all, zero3: the root group and one prefetched block) and accumulates
    unsharded gradients until ALLREDUCE -- in bf16 both in bf16 (FSDP2's MixedPrecisionPolicy),
    which also spares autocast's per-micro-batch weight copies."""
    spec = PRESETS["llama2-13b"]
    cost = CostModel(spec, precision="bf16", checkpointing="full")
    units, dp = range(0, 11), 8
    rep = cost.stage_memory(units, A100, 2, 4, "replicate", dp)
    z = {s: cost.stage_memory(units, A100, 2, 4, s, dp) for s in ("zero1", "zero2", "zero3", "fsdp")}
    P = cost.stage_params(units)
    assert (rep.params, rep.grads, rep.optimizer) == (4 * P, 4 * P, 8 * P)
    assert (z["zero1"].params, z["zero1"].grads, z["zero1"].optimizer) == (4 * P, 4 * P, 8 * P / dp)
    assert (z["zero2"].params, z["zero2"].grads, z["zero2"].optimizer) == (4 * P / dp, 2 * P, 8 * P / dp)
    assert (z["zero3"].params, z["zero3"].grads, z["zero3"].optimizer) == (4 * P / dp, 2 * P, 8 * P / dp)
    assert z["fsdp"] == z["zero3"]
    block = 4 * 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120
    assert z["zero1"].activations == rep.activations
    for s in ("zero2", "zero3"):      # full checkpointing keeps no block weight copies; the recompute makes none
        assert z[s].activations == rep.activations
        assert rep.transient - z[s].transient == 2 * (block - 2 * 5120)
    none = CostModel(spec, precision="bf16", checkpointing="none")
    copies = 2 * 10 * (block - 2 * 5120)           # autocast's bf16 copies of 10 blocks' matmul weights
    assert (none.stage_memory(units, A100, 2, 4, "replicate", dp).activations
            - none.stage_memory(units, A100, 2, 4, "zero3", dp).activations) == 4 * copies
    assert z["zero2"].buffers - rep.buffers == 2 * P
    assert z["zero3"].buffers - rep.buffers == 2 * (block + spec.vocab * spec.hidden)  # embedding + one block
    fp32 = CostModel(spec, precision="fp32", checkpointing="full")
    f3 = fp32.stage_memory(units, A100, 2, 4, "zero3", dp)   # fp32: no policy, gathered and accumulated in fp32
    assert (f3.grads, f3.buffers - fp32.stage_memory(units, A100, 2, 4, "replicate", dp).buffers) == (
        4 * P, 4 * (block + spec.vocab * spec.hidden))
    # tensor parallelism divides the training state by tp
    tp2 = cost.stage_memory(units, A100, 2, 4, "replicate", dp, tp=2)
    assert (tp2.params, tp2.grads, tp2.optimizer) == (2 * P, 2 * P, 4 * P)
    assert tp2.total < rep.total


def test_activation_memory_scales_with_inflight_and_checkpointing():
    spec = PRESETS["llama2-7b"]
    units = range(1, 9)
    none = CostModel(spec, checkpointing="none")
    full = CostModel(spec, checkpointing="full")
    sel = CostModel(spec, checkpointing="selective")
    a = [none.stage_memory(units, A100, 1, k, "zero1", 8).activations for k in (1, 2, 5)]
    assert a[1] == 2 * a[0] and a[2] == 5 * a[0]
    fp32_input = 4096 * 4096 * 4   # a non-first stage keeps its fp32 input
    assert a[0] == 8 * none.unit_activation_bytes(1, 1) + fp32_input
    # full keeps each block's fp32 output; one block's full set is recomputed during its backward,
    # beside the MLP's two T x ffn gradients
    f = full.stage_memory(units, A100, 1, 5, "zero1", 8)
    assert f.activations == 5 * (8 * full.unit_activation_bytes(1, 1) + fp32_input)
    mlp_grads = 2 * 2 * 4096 * spec.ffn
    assert f.transient == none.unit_activation_bytes(1, 1) - full.unit_activation_bytes(1, 1) + mlp_grads
    assert none.stage_memory(units, A100, 1, 5, "zero1", 8).transient == mlp_grads
    assert full.unit_activation_bytes(1, 1) == 2 * full.boundary_bytes(1) == 4096 * 4096 * 4
    assert full.unit_activation_bytes(1, 1) < sel.unit_activation_bytes(1, 1) < none.unit_activation_bytes(1, 1)
    # checkpointing applies to blocks only
    for u in (0, spec.num_units - 1):
        assert full.unit_activation_bytes(u, 1) == none.unit_activation_bytes(u, 1)


def test_the_peak_comes_with_gradients_only_after_a_backward():
    """GPipe with all micro-batches in flight peaks at its first backward (no gradients yet) or at
    its second (one micro-batch fewer, every gradient); more micro-batches than in flight: both."""
    spec = PRESETS["tiny"]
    cost = CostModel(spec, precision="fp32")
    units = range(0, spec.num_units)
    cpu = BUILTIN_GPU_TYPES["cpu"]
    gpipe = cost.stage_memory(units, cpu, 2, 4, "replicate", 1, num_microbatches=4)
    steady = cost.stage_memory(units, cpu, 2, 4, "replicate", 1, num_microbatches=8)
    per_mb = steady.activations / 4
    assert steady.grads == 4 * cost.stage_params(units)
    assert gpipe.grads == 0 and gpipe.activations == steady.activations   # activations outweigh the grads
    assert steady.total - gpipe.total == pytest.approx(steady.grads + 4 * 16 * 2 * spec.seq_len)  # + data
    assert per_mb > steady.grads


def test_total_is_the_sum_of_the_parts():
    m = CostModel(PRESETS["tiny"]).stage_memory(range(0, 3), BUILTIN_GPU_TYPES["cpu"], 2, 2, "zero2", 2)
    assert m.total == m.params + m.grads + m.optimizer + m.activations + m.buffers + m.transient + m.data


# -- time ------------------------------------------------------------------------------------
def test_stage_times_are_flops_over_achieved_peak():
    """The FLOP accounting (forward, dgrad/wgrad split, recompute) on a GPU type priced linearly
    (roofline = false); costs.roofline's per-op times are tests/test_roofline.py's."""
    spec = PRESETS["llama2-7b"]
    units = [1, 2, 3, 4]
    rate = 312e12 * 0.5
    A100 = BUILTIN_GPU_TYPES["a100-80g"].model_copy(update={"roofline": False, "efficiency": 0.5})
    f, b = CostModel(spec).unit_flops(1, 2)
    t = CostModel(spec).stage_times(units, A100, 2)
    assert t.forward == pytest.approx(4 * f / rate)
    assert t.backward == pytest.approx(4 * b / rate)
    assert t.backward_input + t.backward_weight == pytest.approx(t.backward)
    # dgrad = wgrad for matmuls; attention's backward is all input-gradient work
    attn = 4 * 2 * 4096 * 4096 * 4096
    assert t.backward_input - t.backward_weight == pytest.approx(4 * 2 * attn / rate)
    full = CostModel(spec, checkpointing="full").stage_times(units, A100, 2)
    assert full.forward == pytest.approx(t.forward)
    assert full.backward == pytest.approx(t.backward + t.forward)
    assert full.backward_weight == pytest.approx(t.backward_weight)
    # selective policies replay what they do not keep: elementwise ops only (memory-bound: each byte
    # not kept written and read once), plus attention's products (keep-matmul) or every matmul
    # (keep-attention)
    bw = CostModel(spec).memory_bandwidth(A100)
    for mode, flops in (("selective", 0), ("keep-matmul", 4 * attn), ("keep-attention", 4 * f - 4 * attn)):
        cm = CostModel(spec, checkpointing=mode)
        _, kept, _, none = cm._activations(2, 1)
        sel = cm.stage_times(units, A100, 2)
        assert sel.backward == pytest.approx(t.backward + flops / rate + 4 * 2 * (none - kept) / bw), mode
        assert sel.forward == pytest.approx(t.forward) and sel.backward_weight == pytest.approx(t.backward_weight)
    # tp divides compute; fp32 runs at the fp32 peak
    assert CostModel(spec).stage_times(units, A100, 2, tp=4).forward == pytest.approx(t.forward / 4)
    assert CostModel(spec, precision="fp32").stage_times(units, A100, 2).forward == pytest.approx(
        4 * f / (19.5e12 * 0.5))


def test_optimizer_time_is_memory_bound_and_sharded():
    spec = PRESETS["llama2-7b"]
    cost = CostModel(spec)
    units = range(1, 9)
    P = cost.stage_params(units)
    bw = 2.039e12        # the A100-80G's HBM (its GPU type's memory_tbps)
    assert cost.optimizer_time(units, A100, "replicate", 8) == pytest.approx(P * 28 / bw)
    assert cost.optimizer_time(units, A100, "zero1", 8) == pytest.approx(P * 28 / bw / 8)
    prof = CostModel(spec, profile={"memory_bytes_per_s": 1e12})
    assert prof.optimizer_time(units, A100, "replicate", 8, tp=2) == pytest.approx(P / 2 * 28 / 1e12)


DC = Datacenter(name="a", gpu_type="a100-80g", gpus=64, gpus_per_node=8, intra_node_gbps=2400.0,
                intra_dc_gbps=200.0, intra_dc_latency_us=5.0)


def _sync(B, n, sharding="replicate", m=4, tp=1, gather=None):
    """comm.dp_sync_time of a one-chunk stage of B gradient bytes (and `gather` parameter bytes)."""
    return comm.dp_sync_time(comm.sync_collectives(sharding, [(B, B if gather is None else gather)], m), n, DC, tp)


def test_allreduce_ring_inside_a_node():
    B = 1e9
    assert _sync(B, 1) == 0
    expect = 2 * 3 / 4 * B / (2400e9 / 8) + 2 * 3 * 5e-6
    assert _sync(B, 4) == pytest.approx(expect)
    # zero1: the all-reduce, then ZeroRedundancyOptimizer's broadcast of the updated parameters (an all-gather)
    assert _sync(B, 4, "zero1") == pytest.approx(3 / 2 * expect)
    assert _sync(B, 4, "zero2") == pytest.approx(expect)  # reduce-scatter + all-gather
    # zero3: the reduce-scatter and m+1 gathers (FSDP2 reshards after every forward)
    assert _sync(B, 4, "zero3", m=4) == pytest.approx(6 / 2 * expect)
    fp16 = 3 / 4 * 3 * B / (2400e9 / 8) + 2 * 3 * 5e-6    # fp16 gradients, the fp32 weights gathered
    assert _sync(B, 4, "zero2", gather=2 * B) == pytest.approx(fp16)


def test_allreduce_hierarchical_across_nodes():
    B, lat = 1e9, 5e-6
    intra = 7 / 8 * B / (2400e9 / 8) + 7 * lat     # reduce-scatter inside each of 4 nodes
    inter = 3 / 4 * (B / 8) / (200e9 / 8) + 3 * lat  # ring across nodes on 1/8 of the data
    assert _sync(B, 32) == pytest.approx(2 * (intra + inter))
    # with tp=2 only 4 replicas share a node: 8 nodes
    intra2 = 3 / 4 * B / (2400e9 / 8) + 3 * lat
    inter2 = 7 / 8 * (B / 4) / (200e9 / 8) + 7 * lat
    assert _sync(B, 32, tp=2) == pytest.approx(2 * (intra2 + inter2))
    assert _sync(B, 32) > _sync(B, 8)


def test_grad_bytes_and_boundary_bytes():
    spec = PRESETS["llama2-7b"]
    cost = CostModel(spec)
    assert cost.grad_bytes(range(1, 5)) == 2 * 4 * cost.unit_params(1)
    assert cost.grad_bytes(range(1, 5), tp=2) == 4 * cost.unit_params(1)
    assert CostModel(spec, precision="fp32").grad_bytes([1]) == 4 * cost.unit_params(1)
    assert cost.boundary_bytes(3) == 3 * 4096 * 4096 * 2


def test_tp_comm_is_four_allreduces_per_block():
    spec = PRESETS["llama2-7b"]
    cost = CostModel(spec)
    B = cost.boundary_bytes(1)
    one = 2 * 3 / 4 * B / (2400e9 / 8) + 2 * 3 * 5e-6
    assert cost.tp_comm_time(range(0, 5), 1, 4, DC) == pytest.approx(4 * 4 * one)
    assert cost.tp_comm_time(range(0, 5), 1, 1, DC) == 0


# -- profile ---------------------------------------------------------------------------------
def test_profile_replaces_the_flop_estimate():
    spec = PRESETS["tiny"]
    cpu = BUILTIN_GPU_TYPES["cpu"]
    profile = {"block": {"1": [0.010, 0.020], "4": [0.040, 0.080]}, "head": {2: [0.005, 0.010]}}
    cost = CostModel(spec, precision="fp32", profile=profile)
    t = cost.stage_times([1, 2], cpu, 1)
    assert (t.forward, t.backward) == pytest.approx((0.020, 0.040))
    assert cost.stage_times([1], cpu, 2).forward == pytest.approx(0.020)   # interpolated
    assert cost.stage_times([1], cpu, 8).forward == pytest.approx(0.080)   # proportional beyond
    assert cost.stage_times([5], cpu, 1).forward == pytest.approx(0.0025)  # proportional below
    # the embedding is not profiled: FLOP estimate (a gather: 0)
    assert cost.stage_times([0], cpu, 1).forward == 0
    # full checkpointing recomputes the measured forward
    full = CostModel(spec, precision="fp32", checkpointing="full", profile=profile)
    assert full.stage_times([1], cpu, 1).backward == pytest.approx(0.030)
    # measured on the cpu "GPU"; another GPU type scales by achieved FLOP/s
    ref = CostModel(spec, precision="fp32", profile={**profile, "reference_gpu": cpu.model_dump()})
    ratio = cpu.achieved_flops("fp32") / A100.achieved_flops("fp32")
    assert ref.stage_times([1], A100, 1).forward == pytest.approx(0.010 * ratio)
    with pytest.raises(ValueError):
        CostModel(spec, profile={"blocks": {}})


def test_bad_arguments_are_rejected():
    spec = PRESETS["tiny"]
    for kw in ({"precision": "fp8"}, {"checkpointing": "some"}, {"optimizer": "lion"}):
        with pytest.raises(ValueError):
            CostModel(spec, **kw)
    with pytest.raises(ValueError):
        CostModel(spec).stage_memory([1], A100, 1, 1, "zero4", 2)
    with pytest.raises(IndexError):
        CostModel(spec).unit_params(spec.num_units)


def test_stage_queries_are_fast():
    """The planner asks hundreds of thousands of times: each query must be O(1) in the units."""
    spec = PRESETS["gpt3-175b"]
    cost = CostModel(spec, checkpointing="selective")
    units = list(range(0, 50))
    t0 = time.perf_counter()
    for i in range(20_000):
        cost.stage_times(units, A100, 1 + i % 4)
        cost.stage_memory(units, A100, 1 + i % 4, 4, "zero2", 8)
    assert time.perf_counter() - t0 < 2.0


def test_measured_profile_feeds_the_cost_model():
    from geotrain.calibrate.timers import measure_units

    spec = PRESETS["tiny"]
    prof = measure_units(spec, micro_batches=(1, 2), precision="fp32", repeats=1)
    assert set(prof) == {"embedding", "block", "head"}
    assert all(set(t) == {"1", "2"} and all(v > 0 for v in t["1"] + t["2"]) for t in prof.values())
    cost = CostModel(spec, precision="fp32", profile=prof)
    t = cost.stage_times(range(0, 3), BUILTIN_GPU_TYPES["cpu"], 2)
    assert t.forward == pytest.approx(prof["embedding"]["2"][0] + 2 * prof["block"]["2"][0])


def test_memory_helpers_agree_with_the_spec_check():
    from geotrain.costs.memory import DTYPE_BYTES, optimizer_state_bytes_per_param, training_state_bytes_per_param

    for precision, p in DTYPE_BYTES.items():
        for opt in ("adamw", "adam", "sgd"):
            assert training_state_bytes_per_param(precision, opt) == 2 * p + optimizer_state_bytes_per_param(
                precision, opt)


def test_profiled_backward_splits_like_the_flops():
    spec = PRESETS["tiny"]
    cpu = BUILTIN_GPU_TYPES["cpu"]
    prof = {"embedding": {"1": [0.001, 0.004]}, "block": {"1": [0.01, 0.02]}, "head": {"1": [0.002, 0.004]}}
    cost = CostModel(spec, profile=prof)
    emb = cost.stage_times([0], cpu, 1)
    assert (emb.backward_input, emb.backward_weight) == (0, pytest.approx(0.004))
    head = cost.stage_times([spec.num_units - 1], cpu, 1)  # a pure matmul: dgrad = wgrad
    assert head.backward_input == pytest.approx(0.002) and head.backward_weight == pytest.approx(0.002)
    f = CostModel(spec).stage_times([1], cpu, 1)
    block = cost.stage_times([1], cpu, 1)
    assert block.backward_input / block.backward == pytest.approx(f.backward_input / f.backward)
