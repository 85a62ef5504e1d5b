"""Work that needs several layers at once, right under the commands.

The layers below never import each other upward (see docs/ARCHITECTURE.md and the import
contract in pyproject.toml), so anything that joins them -- plan then confirm by simulation,
predict beside a finished run, re-simulate a plan for a report, the per-rank entry that plugs
BubbleTea into the runtime -- lives here, one module per job, and the commands call it.
"""
