"""Rank entry for the live flood test: the runtime's worker with its descriptor limit lowered to
GEOTRAIN_TEST_NOFILE (`ulimit -n` for this rank only), so a flood of slow openers from the test
exhausts it while the rank trains."""

from __future__ import annotations

import os
import resource
import sys

from geotrain.runtime.worker import main

_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(os.environ["GEOTRAIN_TEST_NOFILE"]), hard))

if __name__ == "__main__":
    sys.exit(main())
