"""Which GPUs this host gives its ranks, and which communicators two ranks on one GPU would break.

The launcher's half of `shared_gpu` (whose docstring says what runs staged instead): torch-free, so
`geotrain train` refuses a plan this host cannot run before any rank starts, without importing torch.
`GEOTRAIN_FAKE_GPUS=N` makes CPU ranks report N devices, so the staged paths run in the CPU tests.
"""

from __future__ import annotations

import glob
import hashlib
import os

from geotrain.errors import GeotrainError

FAKE_GPUS_ENV = "GEOTRAIN_FAKE_GPUS"


def key_of(text: str) -> int:
    """A device's key from what names it (host and index, or UUID); never 0, which means no GPU."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big") + 1


def shares(keys: list[int], members) -> bool:
    """Whether two of `members` (ranks) sit on one device."""
    on_gpu = [keys[r] for r in members if keys[r]]
    return len(on_gpu) != len(set(on_gpu))


def dp_group(plan, stage: int, t: int) -> list[int]:
    return [plan.rank(stage, d, t) for d in range(plan.dp)]


def tp_group(plan, stage: int, replica: int) -> list[int]:
    return [plan.rank(stage, replica, t) for t in range(plan.stage_tp(stage))]


def tied_group(plan, replica: int, t: int) -> list[int]:
    return [plan.rank(0, replica, t), plan.rank(plan.pp - 1, replica, t)]


def _ranks(rs) -> str:
    return ", ".join(map(str, rs))


def sharing_problem(plan, keys: list[int]) -> str | None:
    """One line naming the first communicator that cannot run with two ranks on one device, or None."""
    for s in range(plan.pp):
        for d in range(plan.dp):
            g = tp_group(plan, s, d)
            if len(g) > 1 and shares(keys, g):
                return (f"plan {plan.name!r}: the TP group of stage {s} (ranks {_ranks(g)}) has two ranks on one GPU, "
                        "and NCCL refuses that (tensor parallelism has no host-staged path): give each TP rank its "
                        "own GPU, or pin tp = 1")
        if plan.sharding == "zero1":
            for t in range(plan.stage_tp(s)):
                g = dp_group(plan, s, t)
                if len(g) > 1 and shares(keys, g):
                    return (f"plan {plan.name!r}: the ZeRO-1 group of stage {s} (ranks {_ranks(g)}) has two ranks "
                            "on one GPU, and NCCL refuses that (ZeroRedundancyOptimizer's broadcasts have no "
                            "host-staged path): use sharding replicate, zero2 or zero3, or one GPU per rank")
    return None


def device_problem(plan, gpus: int) -> str | None:
    """The launcher's check before any rank starts: this host runs every rank (LOCAL_RANK = rank) on
    `gpus` GPUs; the sharing problem, if any (`sharing_problem`), with the host's numbers."""
    if gpus < 1 or plan.num_ranks <= gpus:
        return None
    problem = sharing_problem(plan, [key_of(f"local:{r % gpus}") for r in range(plan.num_ranks)])
    return f"{problem} ({plan.num_ranks} ranks on {gpus} GPU(s) here)" if problem else None


def host_gpus() -> int:
    """GPUs this host gives its ranks (GEOTRAIN_FAKE_GPUS where set: the tests' CPU stand-in)."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        return max(1, int(fake))
    if not gpu_driver():
        return 0
    import torch  # here, not at the top: only a host with a GPU driver pays torch's import to count its GPUs

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_driver() -> bool:
    """Whether this host has a GPU driver torch could use (NVIDIA, ROCm, WSL's): without one, torch
    would find no device, and the launcher need not import it (~2 s) to learn that."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def cuda_available() -> bool:
    """torch.cuda.is_available(), importing torch only on a host with a GPU driver (`gpu_driver`)."""
    if not gpu_driver():
        return False
    import torch  # here, not at the top: see gpu_driver

    return torch.cuda.is_available()


def check_local_devices(plan) -> None:
    """Before our launcher starts any rank: refuse, in one line, a plan whose every rank runs on this host
    and puts two ranks of a communicator that cannot be staged (TP, ZeRO-1) on one GPU."""
    problem = device_problem(plan, host_gpus())
    if problem:
        raise GeotrainError(problem)


