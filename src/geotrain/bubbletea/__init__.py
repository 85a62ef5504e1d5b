"""BubbleTea: LLM prefill placed inside the idle windows (bubbles) of training GPUs.

bubbles   -- each rank's predicted idle windows within an iteration (from a trace);
prefill_cost -- time a + b*tokens + c*sum(len^2) and memory of prefill beside training;
scheduler -- places (chunked) prefill requests into the earliest bubble they fit, never
             letting a chunk overrun into training work;
workload  -- synthetic request streams for simulation.
"""
