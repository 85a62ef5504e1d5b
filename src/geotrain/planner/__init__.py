"""The planner: which DCs, stages, layer split, micro-batching, memory techniques and WAN use, searched
analytically and confirmed by simulation."""
