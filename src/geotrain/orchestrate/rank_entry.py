"""Per-rank entry with BubbleTea plugged in: `python -m geotrain.orchestrate.rank_entry CONFIG.json`.

The runtime's worker with `bubbletea.runtime_hook.make_hook` installed as the bubble hook, so
prefill requests run in the rank's pipeline bubbles while the runtime itself never imports
BubbleTea. `geotrain train --serve-prefill` launches its ranks with this entry (local_run.RANK_ENTRY).
"""

from __future__ import annotations

import sys

from geotrain.bubbletea.runtime_hook import make_hook
from geotrain.runtime.worker import main as worker_main


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, bubble_hook=make_hook)


if __name__ == "__main__":
    sys.exit(main())
