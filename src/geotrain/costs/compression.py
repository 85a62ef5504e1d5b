"""Bytes on the wire of compressed tensors: the one count the runtime's codecs, the simulator,
the planner and the WAN byte totals share (runtime.compress encodes exactly these sizes).

Two families:
  * pipeline boundaries (activations forward, their gradients back) crossing a WAN link, per the
    plan's LinkPlan.compression: "none" (the training precision), "bf16", "fp8-e4m3", "fp8-e5m2" or
    "int8" -- the 8-bit ones with one fp32 scale per row of `row` elements (a row of the hidden
    dimension) --, and optionally a rank-r factorisation (LinkPlan.rank > 0): the tensor viewed as
    rows x `row`, sent as two bf16 factors (rows x r and r x row);
  * DiLoCo's outer pseudo-gradients (OuterPlan.compression): "fp32", "bf16", or "int8" / "int4"
    with one fp32 scale per block of OUTER_BLOCK values (int4 packs two values per byte).
"""

from __future__ import annotations

BOUNDARY_CODECS = ("none", "bf16", "fp8-e4m3", "fp8-e5m2", "int8")
OUTER_CODECS = ("fp32", "bf16", "int8", "int4")
OUTER_BLOCK = 128
SCALE_BYTES = 4          # one fp32 scale
FACTOR_BYTES = 2         # low-rank factors travel in bf16

_VALUE_BYTES = {"bf16": 2.0, "fp8-e4m3": 1.0, "fp8-e5m2": 1.0, "int8": 1.0, "fp32": 4.0, "int4": 0.5}
_SCALED = {"fp8-e4m3", "fp8-e5m2", "int8"}


def rows_of(numel: int, row: int) -> int:
    """Rows of `row` elements a flat tensor of `numel` is cut into (the last one may be short)."""
    return -(-numel // max(1, row))


def boundary_wire_bytes(numel: int, elem_bytes: int, codec: str = "none", row: int = 1, rank: int = 0) -> int:
    """Bytes one boundary message of `numel` elements (of `elem_bytes` each in the training
    precision) takes on the wire under `codec` (rows of `row` elements; `rank` > 0: low-rank)."""
    if codec not in BOUNDARY_CODECS:
        raise ValueError(f"unknown boundary compression {codec!r} (known: {', '.join(BOUNDARY_CODECS)})")
    rows = rows_of(numel, row)
    if rank > 0:
        r = min(rank, rows, row)
        return (rows + row) * r * FACTOR_BYTES
    if codec == "none":
        return numel * elem_bytes
    values = int(numel * _VALUE_BYTES[codec])
    return values + (rows * SCALE_BYTES if codec in _SCALED else 0)


def boundary_ratio(elem_bytes: int, codec: str, row: int, micro_batch_rows: int, rank: int = 0) -> float:
    """Wire bytes over uncompressed bytes for a boundary of `micro_batch_rows` rows of `row`."""
    n = micro_batch_rows * row
    return boundary_wire_bytes(n, elem_bytes, codec, row, rank) / (n * elem_bytes)


def outer_wire_bytes(numel: int, codec: str = "fp32", block: int = OUTER_BLOCK) -> int:
    """Bytes `numel` pseudo-gradient values take on the wire under the outer codec."""
    if codec not in OUTER_CODECS:
        raise ValueError(f"unknown outer-gradient compression {codec!r} (known: {', '.join(OUTER_CODECS)})")
    if codec in ("fp32", "bf16"):
        return int(numel * _VALUE_BYTES[codec])
    blocks = rows_of(numel, block)
    values = numel if codec == "int8" else -(-numel // 2)
    return values + blocks * SCALE_BYTES


def changes_numerics(codec: str, precision_bytes: int, rank: int = 0) -> bool:
    """Whether a boundary codec alters what the receiver computes with (bf16 on a bf16 run does not)."""
    if rank > 0:
        return True
    return codec not in ("none",) and not (codec == "bf16" and precision_bytes == 2)
