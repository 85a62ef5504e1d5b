"""Dynamic loss scaling for fp16 whose overflow decision is global.

torch.amp.GradScaler decides per process; in a pipeline every rank of every stage must skip the
same steps or the replicas and stages drift apart. So each rank unscales its own gradients,
and one all-reduce (MAX) of the found-inf flag over the world group decides for everyone. The
growth/backoff rule is GradScaler's: halve on overflow, double after `growth_interval` clean steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from geotrain.torch_compat import amp_unscale_


class GlobalLossScaler:
    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    def local_found_inf(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale this rank's gradients in place; True if any is inf or NaN."""
        if not self.enabled:
            return False
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if not grads:
            return False
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=grads[0].device)
        # Private, on purpose: it is the fused op torch.amp.GradScaler.unscale_ itself runs (one kernel
        # for all gradients: multiply by 1/scale, flag inf/NaN). GradScaler cannot do the job: it decides
        # per process -- for DTensor gradients over their own mesh only (pytorch#132816), never across
        # pipeline stages -- and keeps found_inf in private per-optimizer state, so the world-wide MAX
        # below could not be applied through its public API. Public per-tensor ops (isfinite, mul_)
        # would do the same at two kernels per gradient tensor. Present since torch 1.6, also in 2.11.
        amp_unscale_(grads, found, inv)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Apply the (already global) overflow decision to the scale."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": float(self.scale), "growth_tracker": float(self.growth_tracker)}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self.growth_tracker = int(d["growth_tracker"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor gradient (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
