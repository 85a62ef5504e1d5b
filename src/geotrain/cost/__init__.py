"""Cost model: FLOPs, bytes and time of each model unit, and memory per GPU of a stage."""
