"""losses.jsonl, TensorBoard event files and the progress display, on the rank that owns the loss
(`train_config.report_rank`).

Each step's row: loss, learning rate, gradient norm (before clipping), step time, tokens, and the
held-out loss and perplexity on eval steps. RUN_DIR/tb/ gets the same numbers through
`torch.utils.tensorboard` (`tensorboard --logdir runs/`). A resumed run keeps the loss lines up to
its checkpoint (its own, or those of the run it resumed from: the curve continues on the new
layout) and recomputes the rest; TensorBoard drops its events past the checkpoint (purge_step).
A step whose loss is NaN or infinite is written as null and stops the run in one line
(job.nan_policy "stop", the default) or is trained past ("continue").
"""

from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from geotrain.errors import GeotrainError
from geotrain.trace.schema import json_text


class LossLog:
    """The loss rows of a run (`active` on the reporting rank only; elsewhere every call is a no-op)."""

    def __init__(self, out: Path, active: bool, steps: int, start: int, tokens_per_step: int, t0: float,
                 progress: bool = True, resume_from: Path | None = None, nan_policy: str = "stop"):
        self.tokens_per_step, self.t0, self.nan_policy = tokens_per_step, t0, nan_policy
        self.bar = None
        self.file = None
        self.tb = None
        self.rows: list[dict] = []          # what losses.jsonl holds, kept for the summary (no read-back)
        if not active:
            return
        out.mkdir(parents=True, exist_ok=True)
        if resume_from is not None and resume_from.resolve() != out.resolve():
            self.rows = _carry_losses(resume_from / "losses.jsonl", out / "losses.jsonl", start)
        else:
            self.rows = _trim_losses(out / "losses.jsonl", start)
        self.file = open(out / "losses.jsonl", "a")  # noqa: SIM115 -- closed in close()
        self.tb = TensorBoard(out / "tb", start, self.rows)
        if progress:
            if sys.stdout.isatty():
                self.bar = tqdm(total=steps, initial=start, desc="train", unit="step", file=sys.stdout,
                                dynamic_ncols=True)
            else:
                self.bar = _LineProgress(steps, start)

    def record(self, step: int, loss: float | None, skipped: bool, loss_scale: float, seconds: float,
               **extra) -> None:
        """One step's row; `extra`: more fields of the row (BubbleTea's `prefill`, a resume's layout).
        A loss that is not finite is written as null beside `loss_nonfinite` ("nan", "inf": JSON has
        no NaN), and with nan_policy "stop" ends the run with a one-line GeotrainError."""
        bad = loss is not None and not math.isfinite(loss)
        if self.file is not None:
            row = {"step": step, "loss": None if bad else loss, **({"loss_nonfinite": str(loss)} if bad else {}),
                   "skipped": skipped, "loss_scale": loss_scale, "step_time_s": seconds,
                   "tokens": self.tokens_per_step, "time": time.time() - self.t0, "wall": time.time(), **extra}
            self.file.write(json_text(row) + "\n")      # valid JSON whatever the numbers: NaN / inf as null
            self.file.flush()
            self.rows.append(row)
            if self.tb is not None:
                self.tb.put(row)
            if bad and self.nan_policy == "stop":
                raise GeotrainError(f"step {step}: the training loss is {loss} (diverged, or broken weights or data); "
                                    'stopped there (losses.jsonl holds it as null; job.nan_policy = "continue" '
                                    "trains on)")
        if self.bar is not None:
            more = {"skipped": "yes"} if skipped else {}
            if extra.get("lr") is not None:
                more["lr"] = f"{extra['lr']:.2e}"
            if extra.get("eval_loss") is not None:
                more["eval"] = f"{extra['eval_loss']:.4f}"
            self.bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "-",
                                 tok_s=f"{self.tokens_per_step / seconds:,.0f}", **more)
            self.bar.update(1)
            if extra.get("eval_loss") is not None:
                line = (f"eval at step {step}: held-out loss {extra['eval_loss']:.4f}"
                        + (f", perplexity {extra['eval_perplexity']:.4g}" if extra.get("eval_perplexity") else ""))
                (self.bar.write if hasattr(self.bar, "write") else print)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


# losses.jsonl key -> TensorBoard tag
TB_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "step_time_s": "train/step_time_s",
           "loss_scale": "train/loss_scale", "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity"}


class TensorBoard:
    """RUN_DIR/tb through torch.utils.tensorboard's SummaryWriter, on a thread of its own: importing
    tensorboard (~1 s) and writing events never hold up a step. On resume the events past `start`
    are purged (purge_step); rows carried over from another run are written first into a new dir."""

    def __init__(self, path: Path, start: int, carried: list[dict]):
        self.rows: queue.SimpleQueue = queue.SimpleQueue()
        for row in carried if not path.exists() else []:
            self.rows.put(row)
        self.thread = threading.Thread(target=self._run, args=(path, start), name="tensorboard", daemon=True)
        self.thread.start()

    def put(self, row: dict) -> None:
        self.rows.put(row)

    def close(self) -> None:
        self.rows.put(None)
        self.thread.join(timeout=60)

    def _run(self, path: Path, start: int) -> None:
        try:
            # lazy: tensorboard (protobuf) only on the reporting rank, off the training thread
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("note: tensorboard is not installed; no RUN_DIR/tb/ (pip install tensorboard)", flush=True)
            return
        writer = SummaryWriter(str(path), purge_step=start + 1 if start else None)
        try:
            while (row := self.rows.get()) is not None:
                _tb_row(writer, row)
        finally:
            writer.close()


def _tb_row(writer, row: dict) -> None:
    step = row["step"]
    for key, tag in TB_TAGS.items():
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            writer.add_scalar(tag, v, step)
    if row.get("step_time_s"):
        writer.add_scalar("train/tokens_per_s", row["tokens"] / row["step_time_s"], step)
    writer.flush()


class _LineProgress:
    """Progress for logs and pipes: one plain line every tenth of the run, where tqdm's
    carriage-return redraws would pile up into one unreadable line."""

    def __init__(self, total: int, initial: int = 0):
        self.total, self.n, self.every = total, initial, max(1, total // 10)
        self.first, self.t0, self.postfix = initial, time.time(), {}

    def set_postfix(self, **kw: str) -> None:
        self.postfix = kw

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.n % self.every == 0 or self.n == self.total:
            extra = "  ".join(f"{key} {val}" for key, val in self.postfix.items())
            took = time.time() - self.t0
            eta = took / max(1, self.n - self.first) * (self.total - self.n)
            print(f"train step {self.n}/{self.total}  {extra}  ({took:.1f} s, ETA {eta:.0f} s)", flush=True)

    def close(self) -> None:
        pass


def _trim_losses(path: Path, start: int) -> list[dict]:
    """On resume, drop loss lines past the checkpoint (they are recomputed); fresh run: start empty.
    Returns the rows kept."""
    if start == 0 or not path.exists():
        path.write_text("")
        return []
    return _keep_losses(path.read_text().splitlines(), path, start)


def _carry_losses(source: Path, path: Path, start: int) -> list[dict]:
    """Resumed from another run: its loss lines up to the checkpoint open this run's curve."""
    return _keep_losses(source.read_text().splitlines() if source.exists() else [], path, start)


def _keep_losses(lines: list[str], path: Path, start: int) -> list[dict]:
    """Write to `path` the loss lines up to step `start`; returns them parsed."""
    keep = [(line, json.loads(line)) for line in lines if line.strip()]
    keep = [(line, row) for line, row in keep if row["step"] <= start]
    path.write_text("".join(line + "\n" for line, _ in keep))
    return [row for _, row in keep]
