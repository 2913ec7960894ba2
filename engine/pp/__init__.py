"""Pipeline parallelism: schedules as data, a simulator, and a runtime on real ranks."""

from engine.pp.actions import (Action, as_action, rank_of, virtual_stage, virtual_stages)
from engine.pp.schedules import (SimResult, gpipe, interleaved_1f1b, one_f_one_b, simulate,
                                 validate)
from engine.pp.registry import SCHEDULES, Schedule, build_schedule, schedule_spec
from engine.pp.runtime import (PipelineRun, balanced_boundaries, measured_bubble, measured_idle,
                               run_pipeline, split_model, stage_times, uniform_boundaries)

__all__ = ["Action", "as_action", "virtual_stage", "virtual_stages", "rank_of", "gpipe",
           "one_f_one_b", "interleaved_1f1b", "validate", "simulate", "SimResult",
           "run_pipeline", "PipelineRun", "split_model", "uniform_boundaries",
           "balanced_boundaries", "measured_bubble", "measured_idle", "stage_times",
           "SCHEDULES", "Schedule", "schedule_spec", "build_schedule"]
