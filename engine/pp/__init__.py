"""Pipeline parallelism: schedules as data, a simulator, and a runtime on real ranks."""

from engine.pp.actions import (Action, as_action, rank_of, virtual_stage, virtual_stages)
from engine.pp.schedules import (SimResult, gpipe, interleaved_1f1b, one_f_one_b, simulate,
                                 validate)
from engine.pp.registry import (SCHEDULES, PipelineSchedule, Schedule, build_schedule,
                                schedule_spec)
from engine.pp.partition import balanced_boundaries, split_model, uniform_boundaries
from engine.pp.observers import (PipelineRun, Recorder, measured_bubble, measured_idle,
                                 stage_times)
from engine.pp.runtime import run_pipeline

__all__ = ["Action", "as_action", "virtual_stage", "virtual_stages", "rank_of", "gpipe",
           "one_f_one_b", "interleaved_1f1b", "validate", "simulate", "SimResult",
           "run_pipeline", "PipelineRun", "Recorder", "split_model", "uniform_boundaries",
           "balanced_boundaries", "measured_bubble", "measured_idle", "stage_times",
           "SCHEDULES", "Schedule", "PipelineSchedule", "schedule_spec", "build_schedule"]
