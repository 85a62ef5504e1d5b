"""geotrain: plan, simulate and run LLM training across datacenters joined by a slow WAN.

Data flows one way: spec (TOML) -> config -> cost -> plan -> schedule -> {sim | runtime}
-> trace -> report / bubbletea.  See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
