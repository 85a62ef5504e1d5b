"""Synthetic prefill workloads: Poisson arrivals and a prompt-length distribution."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geotrain.bubbletea.scheduler import Request


@dataclass(frozen=True)
class Workload:
    rate_per_s: float              # mean arrivals per second (Poisson)
    mean_prompt: int = 1024        # tokens; lognormal around this mean
    sigma: float = 0.6             # lognormal shape
    max_prompt: int = 8192
    seed: int = 0

    def requests(self, duration_s: float) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        n = rng.poisson(self.rate_per_s * duration_s)
        arrivals = np.sort(rng.uniform(0.0, duration_s, n))
        mu = np.log(self.mean_prompt) - self.sigma**2 / 2
        lengths = np.clip(rng.lognormal(mu, self.sigma, n).astype(int), 1, self.max_prompt)
        return [Request(i, float(t), int(L)) for i, (t, L) in enumerate(zip(arrivals, lengths))]
