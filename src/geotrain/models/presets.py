"""Named model shapes, from one that trains on a CPU in seconds to ones only ever planned.

The shapes are data (`presets.toml` beside this file), so adding one is an edit of a table,
and the spec loader validates a preset exactly like a shape the user wrote."""

from __future__ import annotations

from pathlib import Path

from geotrain.models.shape import ModelShape

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PRESETS_FILE = Path(__file__).with_name("presets.toml")


def _load() -> dict[str, ModelShape]:
    with open(PRESETS_FILE, "rb") as f:
        return {name: ModelShape(name=name, **fields) for name, fields in tomllib.load(f).items()}


PRESETS: dict[str, ModelShape] = _load()
