"""Measured loss costs of the cross-DC modes: what `plan --compare` shows beside each mode and
what `cross_dc = "auto"` weighs against `max_loss_gap`.

The built-in table (loss_table.toml beside this file) is written by bench/bench_cross_dc.py: a
small model trained on real text over the emulated WAN at equal token budgets, each mode's final
eval loss against synchronous training's (`gap` = relative excess), labelled with the model, data
and steps it was measured on. A user adds rows measured on their own model with [job] loss_table
= "file.toml" (same format; their rows are preferred). A mode is matched on its kind and codec,
then the nearest measured H (in log scale) and fragment count; where several rows match (2 and 3
DCs), the largest gap is taken. Modes that are synchronous training by construction (pipelines,
synchronous or hierarchical DP, bf16 boundaries of a bf16 run) cost nothing and need no row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import tomllib

from geotrain.errors import SpecError

BUILTIN = Path(__file__).with_name("loss_table.toml")


@dataclass(frozen=True)
class LossRow:
    mode: str                   # "diloco" (fragments > 1: streaming) or "compressed"
    gap: float                  # (eval loss - synchronous eval loss) / synchronous eval loss
    inner_steps: int = 0
    fragments: int = 1
    compression: str = "fp32"   # outer codec, or the boundary codec of a "compressed" row
    workers: int = 2
    train_gap: float | None = None
    label: str = ""             # "tiny, Python stdlib docs, 2 DCs, 1,024 steps"
    source: str = "built-in"


def load_rows(path: Path, source: str) -> list[LossRow]:
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SpecError(str(path), "loss_table", f"cannot read the loss table ({e})") from None
    rows = []
    for i, r in enumerate(doc.get("row", [])):
        try:
            rows.append(LossRow(mode=str(r["mode"]), gap=float(r["gap"]), inner_steps=int(r.get("inner_steps", 0)),
                                fragments=int(r.get("fragments", 1)), compression=str(r.get("compression", "fp32")),
                                workers=int(r.get("workers", 2)),
                                train_gap=float(r["train_gap"]) if "train_gap" in r else None,
                                label=str(r.get("label", "")), source=source))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError(str(path), f"row[{i}]", f"a loss row needs mode and gap ({e})") from None
        if not math.isfinite(rows[-1].gap):
            raise SpecError(str(path), f"row[{i}].gap", "must be a finite number")
    return rows


def table_for(spec) -> list[LossRow]:
    """The user's rows (job.loss_table, relative to the spec), then the built-in ones."""
    rows: list[LossRow] = []
    if spec.job.loss_table:
        path = Path(spec.job.loss_table)
        if not path.is_absolute() and spec.path is not None:
            path = Path(spec.path).parent / path
        rows += load_rows(path, str(path))
    if BUILTIN.is_file():
        rows += load_rows(BUILTIN, "built-in")
    return rows


def lookup(rows: list[LossRow], mode: str, compression: str, inner_steps: int = 0,
           fragments: int = 1) -> LossRow | None:
    """The measured row for a mode (see the module docstring), or None."""
    same = [r for r in rows if r.mode == mode and r.compression == compression and (r.fragments > 1) == (fragments > 1)]
    if not same:
        return None
    first = same[0].source
    same = [r for r in same if r.source == first]           # the user's rows win over the built-in ones
    if mode == "diloco":
        near = min(abs(math.log(max(1, r.inner_steps)) - math.log(max(1, inner_steps))) for r in same)
        same = [r for r in same if abs(math.log(max(1, r.inner_steps)) - math.log(max(1, inner_steps))) == near]
    return max(same, key=lambda r: r.gap)
