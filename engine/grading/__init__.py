"""The grader: one set of checks per exercise, used three ways.

* In a notebook, ``check("ch00.p2p_broadcast")`` runs the checks on the learner's code in
  ``exercises/`` (or on a function passed as ``impl=``) and prints pass or fail: for a failure,
  what was expected and seen, the learner's own lines that led to it, and what the ranks
  printed. Hints come in three levels (the idea, the API to use, the shape of the code): none
  while the exercise is "not implemented", then one more per failed attempt, or on request
  (``check(name, hint=2)``); attempts are kept beside the drill's scores
  (:mod:`engine.grading.progress`). It grades in a child process with a time limit
  (:mod:`engine.grading.isolated`, ``check(name, timeout=S)``): an endless loop fails the
  exercise with the line it loops on, instead of hanging the notebook.
* ``python -m engine.grading`` (``make grade ARGS=...``) prints a score table per chapter, a
  progress table (exercises passed, drill scores, what to do next) and writes junit XML
  (:mod:`engine.grading.junit`). ``--root`` grades any folder holding ``exercises/`` (a
  student's submission). Each exercise runs in a child process with a time limit
  (:mod:`engine.grading.isolated`): an endless loop, or a file that does not compile, fails
  that exercise alone; the others are still graded.
* ``tests/test_grading.py`` proves, for every exercise, that each check passes on ``solutions/``
  and fails on the untouched stub in ``exercises/``.

While an exercise is graded, the engine's own implementation of what it asks
(``Exercise.blocks``) raises :class:`EngineAnswerBlocked` for the learner's code
(:mod:`engine.grading.blocking`).

An exercise is a triple: a stub ``exercises/<module>.py``, a reference ``solutions/<module>.py``
with the same names, and an :class:`Exercise` in an ``engine/grading/chapters/chNN.py`` module;
the package :mod:`engine.grading.chapters` collects them (:func:`registry`, and the drills).
"""

from engine.grading.blocking import EngineAnswerBlocked
from engine.grading.chapters import get_exercise, registry
from engine.grading.core import (CheckFailed, CheckResult, Exercise, Frame, Report, passed,
                                 run_ranks)
from engine.grading.feedback import format_report
from engine.grading.learner import SOURCES, ExerciseLoadError, course_root, load_impl
from engine.grading.progress import show_progress
from engine.grading.isolated import check
from engine.grading.runner import run_checks

__all__ = ["check", "run_checks", "registry", "get_exercise", "load_impl", "course_root",
           "format_report", "run_ranks", "passed", "show_progress", "CheckFailed",
           "CheckResult", "EngineAnswerBlocked", "Exercise", "ExerciseLoadError", "Frame",
           "Report", "SOURCES"]
