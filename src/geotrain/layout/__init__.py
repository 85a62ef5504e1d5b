"""Plans as data: where each pipeline stage runs and how the WAN is used (`plan`), their checks, and
what a plan costs -- per stage (`stage_costs`, the one cost interface), in peak memory, WAN bytes
and price. The planner that picks one is `geotrain.planner`.
"""

from geotrain.layout.plan import LinkPlan, Plan, StagePlan, load_plan, save_plan

__all__ = ["LinkPlan", "Plan", "StagePlan", "load_plan", "save_plan"]
