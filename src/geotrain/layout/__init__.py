"""Plans: where each pipeline stage runs, how the WAN is used, and the planner that picks one."""

from geotrain.layout.plan import LinkPlan, Plan, StagePlan, load_plan, save_plan

__all__ = ["LinkPlan", "Plan", "StagePlan", "load_plan", "save_plan"]
