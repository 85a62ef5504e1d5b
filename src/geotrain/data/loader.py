"""Deterministic, resumable batches for data-parallel, micro-batched training.

The whole schedule of data is a pure function of (corpus, seq_len, global_batch, seed, step):

* the corpus is cut into non-overlapping windows of seq_len + 1 tokens (inputs and the targets
  shifted by one); every epoch visits all windows once in an order drawn from
  numpy's PCG64 seeded with (seed, epoch);
* the global batch of step s is windows s*B .. s*B+B-1 of that endless sequence of epochs;
* DP replica r of dp gets rows r*B/dp .. (r+1)*B/dp - 1, cut into micro-batches in order.

So the only state is the step number: a run resumed at step k sees exactly the batches an
uninterrupted run sees, replicas never share a window within an epoch, and changing dp (or the
micro-batch size) only regroups the same rows -- a pp x dp run and a single process train on
identical data.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenBatches:
    """Batches of (inputs, targets) int64 tensors, each (rows, seq_len), cut from `tokens`."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, dp: int = 1,
                 micro_batch: int | None = None, seed: int = 0):
        if seq_len < 1 or global_batch < 1 or dp < 1:
            raise ValueError("seq_len, global_batch and dp must be positive")
        if global_batch % dp:
            raise ValueError(f"global_batch={global_batch} is not a multiple of dp={dp}")
        per_replica = global_batch // dp
        micro_batch = per_replica if micro_batch is None else micro_batch
        if micro_batch < 1 or per_replica % micro_batch:
            raise ValueError(f"global_batch/dp={per_replica} is not a multiple of micro_batch={micro_batch}")
        self.tokens = np.asarray(tokens)
        # The int is `global_batch_size`: `global_batch(step)` is the method, as in the runtime's
        # SyntheticTokens, so either can feed a training loop.
        self.seq_len, self.global_batch_size, self.dp = seq_len, global_batch, dp
        self.micro_batch, self.seed = micro_batch, seed
        self.per_replica = per_replica
        self.num_microbatches = per_replica // micro_batch
        self.num_windows = (self.tokens.size - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the corpus ({self.tokens.size} tokens) is shorter than one sequence of {seq_len + 1}")
        self._orders: dict[int, np.ndarray] = {}

    # -- which window each row reads -----------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_windows)
            if len(self._orders) > 2:  # keep memory flat on long runs; epochs are visited in order
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def window_ids(self, step: int, rows: range | None = None) -> np.ndarray:
        """Window index of each row of the global batch of `step` (all rows by default)."""
        if step < 0:
            raise ValueError("step must be >= 0")
        rows = range(self.global_batch_size) if rows is None else rows
        g = step * self.global_batch_size + np.arange(rows.start, rows.stop, dtype=np.int64)
        epochs, pos = np.divmod(g, self.num_windows)
        ids = np.empty(len(g), dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            ids[sel] = self._order(int(epoch))[pos[sel]]
        return ids

    def _rows(self, step: int, rows: range) -> Batch:
        starts = self.window_ids(step, rows) * self.seq_len
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        seq = torch.from_numpy(self.tokens[idx].astype(np.int64))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

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

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must keep to reproduce the stream: the settings that define it
        (the step itself is the training step, saved by the trainer)."""
        return {"seed": self.seed, "seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        mismatch = [k for k in ("seq_len", "global_batch_size", "num_windows") if int(state[k]) != getattr(self, k)]
        if mismatch:
            raise ValueError(f"checkpointed data stream differs in {', '.join(mismatch)}: resuming would "
                             "not see the batches the original run saw")
        self.seed = int(state["seed"])
        self._orders.clear()
