"""Pipeline schedules as per-stage ordered action lists (the one schedule representation).

The simulator and the real runtime both execute these lists, so a prediction and a
measurement can be compared action by action.
"""

from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.builders import BUILDERS, build_schedule
from geotrain.schedule.checks import check_schedule, peak_inflight
from geotrain.schedule.lower import lower
from geotrain.schedule.schedule_error import ScheduleError
from geotrain.schedule.wan_warmup import wan_extra_warmup

__all__ = ["Action", "Op", "Schedule", "BUILDERS", "build_schedule", "lower", "check_schedule", "peak_inflight",
           "wan_extra_warmup", "ScheduleError"]
