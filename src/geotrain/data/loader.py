"""Deterministic, resumable batches for data-parallel, micro-batched training.

The whole schedule of data is a pure function of (sources, seq_len, global_batch, seed, step):

* each source's tokens are cut into non-overlapping windows of seq_len + 1 tokens (inputs and
  the targets shifted by one); with `holdout`, the last fraction of each source's windows is the
  held-out split (`eval_batch`), never trained on;
* the global batch of step s is samples s*B .. s*B+B-1 of an endless sequence. One source: every
  epoch visits all its windows once in an order drawn from numpy's PCG64 seeded with
  (seed, epoch). Several sources: a fixed pattern of `MIX_PERIOD` samples gives source i its
  weight's share (largest remainders; within the pattern the source furthest behind its share
  goes next, as Megatron's blended datasets do), and source i's k-th sample is window k of its
  own endless sequence of epochs (seeded with (seed, i, epoch));
* DP replica r of dp gets rows r*B/dp .. (r+1)*B/dp - 1, cut into micro-batches in order.

So the only state is the step number: a run resumed at step k sees exactly the batches an
uninterrupted run sees, replicas never share a window within an epoch, and changing dp (or the
micro-batch size) only regroups the same rows -- a pp x dp run and a single process train on
identical data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

Batch = tuple["torch.Tensor", "torch.Tensor"]
MIX_PERIOD = 4096            # samples in one period of a mixture's pattern (weights to 1/4096)


def mix_pattern(weights: Sequence[float], period: int = MIX_PERIOD) -> np.ndarray:
    """Which source each of `period` consecutive samples comes from (see the module docstring)."""
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum() * period
    counts = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - counts), kind="stable")[: period - int(counts.sum())]:
        counts[i] += 1
    taken = np.zeros(len(w), dtype=np.int64)
    out = np.empty(period, dtype=np.int64)
    for k in range(period):
        i = int(np.argmax(counts * (k + 1) / period - taken))
        out[k] = i
        taken[i] += 1
    return out


class TokenBatches:
    """Batches of (inputs, targets) int64 tensors, each (rows, seq_len), cut from `tokens` (one
    array, or one per source with `weights`)."""

    def __init__(self, tokens: np.ndarray | Sequence[np.ndarray], *, seq_len: int, global_batch: int, dp: int = 1,
                 micro_batch: int | None = None, seed: int = 0, weights: Sequence[float] | None = None,
                 holdout: float = 0.0):
        if seq_len < 1 or global_batch < 1 or dp < 1:
            raise ValueError("seq_len, global_batch and dp must be positive")
        if global_batch % dp:
            raise ValueError(f"global_batch={global_batch} is not a multiple of dp={dp}")
        if not 0.0 <= holdout < 1.0:
            raise ValueError("holdout must be in [0, 1)")
        per_replica = global_batch // dp
        micro_batch = per_replica if micro_batch is None else micro_batch
        if micro_batch < 1 or per_replica % micro_batch:
            raise ValueError(f"global_batch/dp={per_replica} is not a multiple of micro_batch={micro_batch}")
        arrays = [np.asarray(tokens)] if isinstance(tokens, np.ndarray) else [np.asarray(t) for t in tokens]
        if not arrays:
            raise ValueError("no token sources")
        weights = [1.0] * len(arrays) if weights is None else [float(w) for w in weights]
        if len(weights) != len(arrays) or min(weights) <= 0:
            raise ValueError("one positive weight per source")
        # The int is `global_batch_size`: `global_batch(step)` is the method, as in the runtime's
        # SyntheticTokens, so either can feed a training loop.
        self.seq_len, self.global_batch_size, self.dp = seq_len, global_batch, dp
        self.micro_batch, self.seed, self.weights = micro_batch, seed, weights
        self.per_replica = per_replica
        self.num_microbatches = per_replica // micro_batch
        self.sources = arrays
        self.tokens = arrays[0]
        total = [(a.size - 1) // seq_len for a in arrays]
        for a, n in zip(arrays, total):
            if n < 1:
                raise ValueError(f"the corpus ({a.size} tokens) is shorter than one sequence of {seq_len + 1}")
        self.held_out = [int(n * holdout) if holdout else 0 for n in total]
        if holdout and min(self.held_out) < 1:
            raise ValueError(f"holdout={holdout:g} leaves no held-out window of {seq_len + 1} tokens in a source "
                             f"of {min(total)} windows")
        self.source_windows = [n - h for n, h in zip(total, self.held_out)]
        if min(self.source_windows) < 1:
            raise ValueError("the held-out split leaves no training window")
        self.num_windows = sum(self.source_windows)
        self._total = total
        self._offsets = np.cumsum([0] + total[:-1])          # a global window id = offset + local window
        self._pattern = mix_pattern(weights) if len(arrays) > 1 else None
        if self._pattern is not None:
            self._per_period = np.bincount(self._pattern, minlength=len(arrays))
            self._before = np.stack([np.cumsum(self._pattern == i) - (self._pattern == i)
                                     for i in range(len(arrays))])    # [source, k]: earlier ones of k's source
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    # -- which window each row reads -----------------------------------------------------------
    def _order(self, source: int, epoch: int) -> np.ndarray:
        order = self._orders.get((source, epoch))
        if order is None:
            key = [self.seed, epoch] if len(self.sources) == 1 else [self.seed, source, epoch]
            order = np.random.Generator(np.random.PCG64(key)).permutation(self.source_windows[source])
            if len(self._orders) > 2 * len(self.sources):   # keep memory flat on long runs
                self._orders.pop(next(iter(self._orders)))
            self._orders[(source, epoch)] = order
        return order

    def _source_of(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index of the sample within its source's stream) of global sample indices g."""
        if self._pattern is None:
            return np.zeros_like(g), g
        period, k = np.divmod(g, len(self._pattern))
        src = self._pattern[k]
        return src, period * self._per_period[src] + self._before[src, k]

    def window_ids(self, step: int, rows: range | None = None) -> np.ndarray:
        """Window index of each row of the global batch of `step` (all rows by default); with
        several sources, ids count the sources' windows one after another."""
        if step < 0:
            raise ValueError("step must be >= 0")
        rows = range(self.global_batch_size) if rows is None else rows
        g = step * self.global_batch_size + np.arange(rows.start, rows.stop, dtype=np.int64)
        src, idx = self._source_of(g)
        ids = np.empty(len(g), dtype=np.int64)
        for i in np.unique(src):
            sel = src == i
            epochs, pos = np.divmod(idx[sel], self.source_windows[i])
            part = np.empty(len(pos), dtype=np.int64)
            for epoch in np.unique(epochs):
                e = epochs == epoch
                part[e] = self._order(int(i), int(epoch))[pos[e]]
            ids[sel] = part + self._offsets[i]
        return ids

    def samples_per_source(self, steps: int) -> list[int]:
        """How many windows of each source the first `steps` steps read."""
        n = steps * self.global_batch_size
        if self._pattern is None:
            return [n]
        full, rest = divmod(n, len(self._pattern))
        return [int(full * c + np.count_nonzero(self._pattern[:rest] == i)) for i, c in enumerate(self._per_period)]

    def epochs(self, steps: int) -> list[float]:
        """Epochs of each source's training windows that `steps` steps cover."""
        return [k / n for k, n in zip(self.samples_per_source(steps), self.source_windows)]

    def _gather(self, ids: np.ndarray) -> Batch:
        import torch  # here, not at the top: the launcher tokenizes through this module and draws no batch

        src = np.searchsorted(self._offsets, ids, side="right") - 1
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        span = np.arange(self.seq_len + 1)[None, :]
        for i in np.unique(src):
            sel = src == i
            starts = (ids[sel] - self._offsets[i]) * self.seq_len
            out[sel] = self.sources[i][starts[:, None] + span]
        seq = torch.from_numpy(out)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def _rows(self, step: int, rows: range) -> Batch:
        return self._gather(self.window_ids(step, rows))

    def eval_batch(self, index: int, rows: int | None = None) -> Batch:
        """Held-out batch `index` (`rows` rows, default the global batch): windows of the held-out
        split in order, each source's in turn by its weight, cycling when they run out."""
        if not any(self.held_out):
            raise ValueError("no held-out split (holdout=0)")
        rows = self.global_batch_size if rows is None else rows
        g = index * rows + np.arange(rows, dtype=np.int64)
        src, idx = self._source_of(g)
        held = np.asarray(self.held_out)
        train = np.asarray(self.source_windows)
        return self._gather(self._offsets[src] + train[src] + idx % held[src])

    # -- the views training loops use ----------------------------------------------------------
    def global_batch(self, step: int) -> Batch:
        """The whole step's batch (what one process training alone would see)."""
        return self._rows(step, range(self.global_batch_size))

    def replica_batch(self, step: int, replica: int) -> Batch:
        """Rows replica*B/dp .. (replica+1)*B/dp of the global batch."""
        if not 0 <= replica < self.dp:
            raise ValueError(f"replica {replica} is outside 0..{self.dp - 1}")
        lo = replica * self.per_replica
        return self._rows(step, range(lo, lo + self.per_replica))

    def batch(self, step: int, replica: int, mb: int) -> Batch:
        """Micro-batch `mb` of DP replica `replica` at `step`: (micro_batch, seq_len) each."""
        if not 0 <= mb < self.num_microbatches:
            raise ValueError(f"micro-batch {mb} is outside 0..{self.num_microbatches - 1}")
        if not 0 <= replica < self.dp:
            raise ValueError(f"replica {replica} is outside 0..{self.dp - 1}")
        lo = replica * self.per_replica + mb * self.micro_batch
        return self._rows(step, range(lo, lo + self.micro_batch))

    def micro_batches(self, step: int, replica: int) -> list[Batch]:
        """All micro-batches of one replica for one step, in order."""
        inputs, targets = self.replica_batch(step, replica)
        return list(zip(inputs.split(self.micro_batch), targets.split(self.micro_batch)))

    def iterate(self, replica: int = 0, start_step: int = 0) -> Iterator[tuple[int, list[Batch]]]:
        """(step, micro-batches) from `start_step` on, forever; resuming is passing the step."""
        step = start_step
        while True:
            yield step, self.micro_batches(step, replica)
            step += 1

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.global_batch_size

    def state_dict(self) -> dict:
        """What a checkpoint must keep to reproduce the stream: the settings that define it
        (the step itself is the training step, saved by the trainer)."""
        state = {"seed": self.seed, "seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
                 "num_windows": self.num_windows}
        if len(self.sources) > 1:
            state["weights"] = list(self.weights)
        return state

    def load_state_dict(self, state: dict) -> None:
        mismatch = [k for k in ("seq_len", "global_batch_size", "num_windows") if int(state[k]) != getattr(self, k)]
        if [float(w) for w in state.get("weights", self.weights if len(self.sources) > 1 else [])] != \
                (list(self.weights) if len(self.sources) > 1 else []):
            mismatch.append("weights")
        if mismatch:
            raise ValueError(f"checkpointed data stream differs in {', '.join(mismatch)}: resuming would "
                             "not see the batches the original run saw")
        self.seed = int(state["seed"])
        self._orders.clear()
