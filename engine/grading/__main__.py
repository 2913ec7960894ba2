"""``python -m engine.grading``: grade every exercise, print a score table, write junit XML.

    python -m engine.grading                      # grade your code in exercises/
    python -m engine.grading --only ch09          # one chapter (or exercise names, a,b,...)
    python -m engine.grading --only ch09.online_softmax --hint 2   # with the first two hints
    python -m engine.grading --junit report.xml   # also write junit XML (CI dashboards read it)
    python -m engine.grading --source solutions   # grade the reference solutions
    python -m engine.grading --root students/alice --junit alice.xml   # a student's submission

``--root`` is a folder holding ``exercises/``: a student's submission needs nothing else (the
checks, and the solutions they compare with, come from the installed course). Each exercise
runs in a process of its own with a time limit (``--timeout``): one that takes longer (a
``while True``) fails with "took longer than N s" and grading goes on; one whose file does not
compile or import fails on its own. The junit file is rewritten after every exercise, so a run
stopped midway leaves a valid file of what was graded. It and the report name the student
(``--student``, default the root's folder name) and the time of grading.

Grading exercises/ counts as an attempt, as check() does in a notebook: a failure of code that
runs reveals the exercise's next hint. Hint levels and drill scores are kept per root (the
learner's own checkout shares them with the notebooks; any other root has its own, see
engine.grading.progress.root_scores_path); ``--fresh`` ignores them and saves nothing. The end
is a table per chapter graded: exercises passed, the drill's score on the chapter's topics,
and what to do next.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone

from engine.drill.bank import Scores
from engine.grading import SOURCES, Report, course_root, format_report, registry
from engine.grading.core import HINT_IN_TERMINAL, HINT_LEVELS
from engine.grading.isolated import DEFAULT_TIMEOUT_S, run_isolated
from engine.grading.junit import junit_xml, write_atomically
from engine.grading.progress import (Attempts, attempts_path, chapter_titles, progress_table,
                                     root_scores_path, verdict)

__all__ = ["main", "parser", "junit_xml", "score_table"]


def score_table(reports: list[Report]) -> str:
    rows = [f"{'chapter':<9}{'exercise':<34}{'checks':>8}"]
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for report in reports:
        got, total = report.score
        totals[report.exercise.chapter][0] += got
        totals[report.exercise.chapter][1] += total
        rows.append(f"{report.exercise.chapter:<9}{report.exercise.name:<34}{got:>5}/{total}")
    rows.append("-" * 51)
    for chapter, (got, total) in totals.items():
        rows.append(f"{chapter:<9}{'chapter total':<34}{got:>5}/{total}")
    got = sum(g for g, _ in totals.values())
    total = sum(t for _, t in totals.values())
    rows.append(f"{'all':<9}{'score':<34}{got:>5}/{total}")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    """The grader's command line (the lab guide's commands are checked against it)."""
    cli = argparse.ArgumentParser(prog="python -m engine.grading", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--source", choices=SOURCES, default="exercises")
    cli.add_argument("--only", default="",
                     help="chapters (ch00) or exercise names, comma-separated")
    cli.add_argument("--junit", default="", help="write junit XML to this path")
    cli.add_argument("--root", default=None,
                     help="the folder graded: it holds exercises/ (default: the course "
                          "checkout found from here)")
    cli.add_argument("--student", default="",
                     help="the name in the report and the junit (default: the root's "
                          "folder name)")
    cli.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                     help="seconds one exercise may take before it fails (default "
                          f"{DEFAULT_TIMEOUT_S:g})")
    cli.add_argument("--hint", type=int, default=None, choices=range(len(HINT_LEVELS) + 1),
                     metavar="N", help="show hints 1 to N now (1 the idea, 2 the API to "
                                       "use, 3 the shape of the code)")
    cli.add_argument("--fresh", action="store_true",
                     help="ignore this root's saved hint levels and drill scores (and save "
                          "none)")
    return cli


def _selected(cli: argparse.ArgumentParser, only: str) -> tuple[list[str], bool]:
    """The exercises ``--only`` names (all without it), and whether it named any."""
    wanted = {item.strip() for item in only.split(",") if item.strip()}
    known = registry()
    unknown = sorted(wanted - set(known) - {n.split(".")[0] for n in known})
    if unknown:
        cli.error(f"--only: {', '.join(unknown)} matches no exercise; "
                  f"known: {', '.join(known)}")
    return [n for n in known if not wanted or n in wanted or n.split(".")[0] in wanted], \
        bool(wanted)


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    try:
        root = course_root(args.root)
    except (ValueError, FileNotFoundError) as e:
        cli.error(str(e))
    if args.timeout <= 0:
        cli.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    names, filtered = _selected(cli, args.only)
    student = args.student or root.name
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    learner = args.source == "exercises"  # the reference solutions are nobody's attempts
    saved = root_scores_path(root if args.root is not None else None)
    attempts, scores = Attempts(attempts_path(saved)), Scores(saved)
    if args.fresh:
        attempts.data, scores.items, scores.earlier = {}, {}, {}
    print(f"grading {student} ({root / args.source}) at {stamp}: {len(names)} exercise"
          f"{'s' if len(names) != 1 else ''}, at most {args.timeout:g} s each\n")
    reports, seconds = [], {}
    properties = {"source": args.source, "root": str(root), "time_limit_s": f"{args.timeout:g}"}
    try:
        for name in names:
            start = time.perf_counter()
            reports.append(run_isolated(name, args.source, root, args.timeout))
            seconds[name] = time.perf_counter() - start
            level = attempts.record(reports[-1], args.hint) if learner else args.hint or 0
            print(format_report(reports[-1], color=sys.stdout.isatty(), hint_level=level,
                                hint_command=HINT_IN_TERMINAL), flush=True)
            if args.junit:
                write_atomically(junit_xml(reports, seconds, student, stamp, properties),
                                 args.junit)
    except KeyboardInterrupt:
        print(f"\nstopped: {student} graded on {len(reports)} of {len(names)} exercises"
              + (f"; {args.junit} holds those" if args.junit and reports else ""))
        return 130
    finally:
        if learner and not args.fresh:
            attempts.save()
    print()
    print(score_table(reports))
    known = registry()
    last = {name: attempts.entry(name)["last"] for name in known} if learner else {}
    last.update({report.exercise.name: verdict(report) for report in reports})
    print()
    print(progress_table(known, last, attempts, scores, chapter_titles(root),
                         only=names if filtered else None, hint_command=HINT_IN_TERMINAL))
    got = sum(r.score[0] for r in reports)
    total = sum(r.score[1] for r in reports)
    print(f"\n{student}: {got}/{total} checks passed, "
          f"{sum(r.passed for r in reports)}/{len(reports)} exercises, graded {stamp}")
    if args.junit:
        print(f"junit XML written to {args.junit}")
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
