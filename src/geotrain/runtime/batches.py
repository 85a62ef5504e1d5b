"""Where a rank's micro-batches come from.

`geotrain.data` (the built-in corpus and byte tokenizer) is used when present; until then, and
for tests that need no corpus, `SyntheticTokens` gives a deterministic, learnable stream: every
batch is a pure function of (seed, step, replica, micro-batch), so any process -- a pipeline
rank, a resumed run, a single-process reference -- can reproduce exactly the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from geotrain.data import TokenBatches, data_report, describe_data, load_tokenizer, open_batches
from geotrain.errors import GeotrainError
from geotrain.trace.schema import json_text

if TYPE_CHECKING:
    import torch


class SyntheticTokens:
    """Sequences of arithmetic progressions mod vocab (start and stride random per sequence):
    a model can learn to continue them, so the loss visibly falls within a few dozen steps."""

    def __init__(self, vocab: int, seq_len: int, micro_batch: int, num_microbatches: int, dp: int, seed: int = 0):
        self.vocab, self.seq_len, self.micro_batch = vocab, seq_len, micro_batch
        self.num_microbatches, self.dp, self.seed = num_microbatches, dp, seed

    def batch(self, step: int, replica: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (micro_batch, seq_len) int64; targets are inputs shifted by one."""
        import torch  # here, not at the top: the launcher imports make_source and never draws a batch

        index = (step * self.dp + replica) * self.num_microbatches + mb
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab, (self.micro_batch, 1), generator=g)
        stride = torch.randint(1, 8, (self.micro_batch, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def eval_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out global batch `index`: drawn from a seed stream training never uses."""
        import torch  # here, not at the top: the launcher imports make_source and never draws a batch

        rows = self.micro_batch * self.num_microbatches * self.dp
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + (1 << 48) + index)
        start = torch.randint(0, self.vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step's batch as one tensor pair (what single-process training would see)."""
        import torch  # here, not at the top: the launcher imports make_source and never draws a batch

        parts = [self.batch(step, r, j) for r in range(self.dp) for j in range(self.num_microbatches)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])


def make_source(spec, plan, data, seed: int, progress: bool = True):
    """The batch source: "synthetic" (SyntheticTokens), else geotrain.data's loader over the job's
    sources (None / "stdlib": the built-in corpus; a path or [[job.data]] tables: the user's data),
    tokenized by the model directory's tokenizer.json, else in bytes."""
    dp = plan.dp * plan.num_workers      # DiLoCo: worker w's replica d reads replica w * dp + d's data
    if data == "synthetic":
        return SyntheticTokens(spec.model.vocab, spec.model.seq_len, plan.micro_batch, plan.num_microbatches,
                               dp, seed)

    try:
        tokenizer = load_tokenizer(spec.model.hf)        # the model directory's tokenizer.json, else bytes
    except ValueError as e:
        raise GeotrainError(f"tokenizer: {e}") from None
    if spec.model.vocab < tokenizer.vocab_size:
        raise GeotrainError(f"model vocab={spec.model.vocab} is smaller than the tokenizer's {tokenizer.vocab_size} "
                            "symbols; use a model with a larger vocab or data = \"synthetic\"")
    try:
        return open_batches(data, seq_len=spec.model.seq_len, global_batch=plan.global_batch, dp=dp,
                            micro_batch=plan.micro_batch, seed=seed, spec_path=spec.path, tokenizer=tokenizer,
                            holdout=spec.job.eval_split if spec.job.eval_every else 0.0, progress=progress)
    except ValueError as e:
        raise GeotrainError(f"data: {e}") from None


def write_data_report(source, out: Path, steps: int, show: bool) -> None:
    """RUN_DIR/data.json (files, documents, tokens, epochs the run covers) and its console line."""
    if not isinstance(source, TokenBatches):
        return
    report = data_report(source, steps)
    (out / "data.json").write_text(json_text(report, indent=1) + "\n")
    if show:
        print(describe_data(report), flush=True)


class RankBatches:
    """This rank's micro-batches of a step, on its device: the ranks holding the first or last
    virtual stage read them (inputs, targets); the others get none."""

    def __init__(self, source, replica: int, num_microbatches: int, device: torch.device, needed: bool):
        self.source, self.replica, self.m, self.device, self.needed = source, replica, num_microbatches, device, needed

    def for_step(self, step: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Step `step`'s (1-based) micro-batches."""
        if not self.needed:
            return {}
        return {j: tuple(t.to(self.device) for t in self.source.batch(step - 1, self.replica, j))
                for j in range(self.m)}

    def for_eval(self, index: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """This replica's micro-batches of held-out global batch `index`."""
        if not self.needed:
            return {}
        inputs, targets = self.source.eval_batch(index)
        per = inputs.shape[0] // self.source.dp
        mine = [t[self.replica * per:(self.replica + 1) * per].to(self.device) for t in (inputs, targets)]
        return dict(enumerate(zip(*(t.split(per // self.m) for t in mine))))

    def state_dict(self) -> dict | None:
        return self.source.state_dict() if hasattr(self.source, "state_dict") else None

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state)
