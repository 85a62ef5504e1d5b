"""Pipeline schedules as per-stage ordered action lists (the one schedule representation).

The simulator and the real runtime both execute these lists, so a prediction and a
measurement can be compared action by action.
"""

from geotrain.schedule.actions import Action, Op, Schedule

__all__ = ["Action", "Op", "Schedule"]
