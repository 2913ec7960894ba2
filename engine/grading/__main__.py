"""``python -m engine.grading``: grade every exercise, print a score table, write junit XML.

    python -m engine.grading                      # grade your code in exercises/
    python -m engine.grading --only ch09          # one chapter (or exercise names, a,b,...)
    python -m engine.grading --only ch09.online_softmax --hint 2   # with the first two hints
    python -m engine.grading --junit report.xml   # also write junit XML (CI dashboards read it)
    python -m engine.grading --source solutions   # grade the reference solutions
    python -m engine.grading --root students/alice --junit alice.xml   # a student's submission

    python -m engine.grading --class students --junit class.xml   # every student in a folder
    python -m engine.grading release --out student-course   # the course without solutions/

``--root`` is a folder holding ``exercises/``: a student's submission needs nothing else (the
checks come from the installed course). ``--class`` grades every folder of a class folder that
holds ``exercises/``, one after the other, and ends with a table of the class. Each exercise's
code runs in a worker process of its own with a time limit (``--timeout``), and the checks
compare what it sent back in this process (:mod:`engine.grading.isolated`): one that takes
longer (a ``while True``) fails with "took longer than N s" and grading goes on; one whose file
does not compile or import fails on its own. A submission's worker runs in a sandbox
(``--sandbox``, :mod:`engine.grading.sandbox`): bubblewrap where it works (no solutions/, no
network, no other student's folder, limits), else the limits alone; the report's first line
says which. The junit file is written by the grader alone, after the workers of each exercise
are gone, whole and atomically, so a run stopped midway leaves a valid file of what was
graded. It and the report name the student (``--student``, default the root's folder name)
and the time of grading.

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
from pathlib import Path
from typing import Callable
from datetime import datetime, timezone

from engine.drill.bank import Scores
from engine.grading import SOURCES, Report, course_root, format_report, registry
from engine.grading.core import HINT_IN_TERMINAL, HINT_LEVELS
from engine.grading.feedback import clean_text
from engine.grading.isolated import DEFAULT_TIMEOUT_S, run_isolated
from engine.grading.junit import class_junit_xml, junit_xml, write_atomically
from engine.grading.learner import installed_course
from engine.grading.processes import Subreaper
from engine.grading.release import write_release
from engine.grading.sandbox import DEFAULT_MEMORY_BYTES, Sandbox
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
    cli.add_argument("--class", dest="class_dir", default=None, metavar="DIR",
                     help="grade every folder in DIR that holds exercises/ (a class's "
                          "submissions), one junit for the class")
    cli.add_argument("--sandbox", choices=("auto", "bwrap", "limits", "none"), default=None,
                     help="where a submission's code runs: bubblewrap (auto: where it works), "
                          "limits alone, or none (a worker forked from the grader); default "
                          "auto with --root or --class, none for your own exercises/")
    cli.add_argument("--memory-gib", type=float, default=DEFAULT_MEMORY_BYTES / 2**30,
                     metavar="G", help="address space per process of a submission's worker "
                                       "and ranks (default %(default)g)")
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


def _students(cli, class_dir: str) -> list[Path]:
    folder = Path(class_dir).resolve()
    if not folder.is_dir():
        cli.error(f"--class: {class_dir!r} is not a folder")
    found = sorted(p for p in folder.iterdir() if (p / "exercises").is_dir())
    if not found:
        cli.error(f"--class: no folder in {str(folder)!r} holds exercises/")
    return found


def _sandbox_for(args, root: Path, graded_elsewhere: bool):
    """The sandbox a submission's workers start in, or None (forked from here)."""
    mode = args.sandbox or ("auto" if graded_elsewhere else "none")
    if mode == "none" or args.source != "exercises":
        return None
    if not (0.5 <= args.memory_gib <= 1024):
        raise ValueError(f"--memory-gib must be between 0.5 and 1024, got {args.memory_gib:g}")
    return Sandbox(root, installed_course() or course_root(None), mode,
                   memory_bytes=int(args.memory_gib * 2**30),
                   cpu_seconds=max(60, int(4 * args.timeout)))


def grade_student(args, root: Path, names: list[str], student: str, stamp: str,
                  sandbox, junit: Callable[[list[Report], dict], None] | None,
                  reports: list[Report]):
    """Grade ``names`` for one student into ``reports`` (what was graded stays there if the run
    is stopped); ``junit(reports, seconds)`` after each exercise."""
    learner = args.source == "exercises"  # the reference solutions are nobody's attempts
    saved = root_scores_path(root if args.root is not None or args.class_dir else None)
    attempts, scores = Attempts(attempts_path(saved)), Scores(saved)
    if args.fresh or args.class_dir:
        attempts.data, scores.items, scores.earlier = {}, {}, {}
    print(f"grading {clean_text(student, 200)} ({root / args.source}) at {stamp}: {len(names)} "
          f"exercise{'s' if len(names) != 1 else ''}, at most {args.timeout:g} s each")
    print(sandbox.protections() if sandbox is not None else
          "sandbox: none (a worker forked from the grader: grading your own code)")
    print()
    seconds: dict[str, float] = {}
    try:
        for name in names:
            start = time.perf_counter()
            reports.append(run_isolated(name, args.source, root, args.timeout,
                                        sandbox=sandbox))
            seconds[name] = time.perf_counter() - start
            level = attempts.record(reports[-1], args.hint) if learner else args.hint or 0
            print(format_report(reports[-1], color=sys.stdout.isatty(), hint_level=level,
                                hint_command=HINT_IN_TERMINAL), flush=True)
            if junit is not None:
                junit(reports, seconds)
    finally:
        if learner and not (args.fresh or args.class_dir):
            attempts.save()
    return reports, seconds, attempts, scores


def release_parser() -> argparse.ArgumentParser:
    """``python -m engine.grading release``'s command line."""
    cli = argparse.ArgumentParser(prog="python -m engine.grading release",
                                  description=write_release.__doc__)
    cli.add_argument("--out", required=True, help="a new folder for the student's course")
    cli.add_argument("--course", default=None, help="the course to release (default: the "
                                                    "checkout found from here)")
    return cli


def release_main(argv: list[str]) -> int:
    """``python -m engine.grading release --out DIR``: the student's course, no solutions."""
    cli = release_parser()
    args = cli.parse_args(argv)
    try:
        done = write_release(course_root(args.course), Path(args.out))
    except (ValueError, FileNotFoundError) as e:
        cli.error(str(e))
    print(f"wrote {len(done['copied'])} files to {args.out}; left out "
          f"{len(done['left out'])}:")
    for line in done["left out"]:
        if not line.startswith((".git", "solutions/")):
            print(f"  {line}")
    print(f"  solutions/ ({sum(x.startswith('solutions/') for x in done['left out'])} files)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["release"]:
        return release_main(argv[1:])
    cli = parser()
    args = cli.parse_args(argv)
    if args.root is not None and args.class_dir is not None:
        cli.error("--root and --class: give one (--class grades every folder of a class)")
    try:
        roots = _students(cli, args.class_dir) if args.class_dir else [course_root(args.root)]
    except (ValueError, FileNotFoundError) as e:
        cli.error(str(e))
    if args.timeout <= 0:
        cli.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    names, filtered = _selected(cli, args.only)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    properties = {"source": args.source, "time_limit_s": f"{args.timeout:g}"}
    graded: list[tuple[str, list[Report], dict]] = []

    def write_junit(reports, seconds, student, root):
        if args.junit:
            every = [*graded, (student, reports, seconds)] if args.class_dir else \
                [(student, reports, seconds)]
            write_atomically(class_junit_xml(every, stamp, {**properties, "root": str(root)}),
                             args.junit)

    with Subreaper():
        for root in roots:
            student = args.student if args.student and not args.class_dir else root.name
            try:
                sandbox = _sandbox_for(args, root, args.root is not None or bool(args.class_dir))
            except (ValueError, RuntimeError) as e:
                cli.error(str(e))
            reports: list[Report] = []
            try:
                _, seconds, attempts, scores = grade_student(
                    args, root, names, student, stamp, sandbox,
                    lambda r, s, st=student, ro=root: write_junit(r, s, st, ro), reports)
            except KeyboardInterrupt:
                print(f"\nstopped: {clean_text(student, 200)} graded on {len(reports)} of "
                      f"{len(names)} exercises"
                      + (f"; {args.junit} holds those" if args.junit and
                         (reports or graded) else ""))
                return 130
            graded.append((student, reports, seconds))
            _student_tables(args, names, filtered, student, stamp, reports, attempts, scores,
                            root)
    if args.class_dir:
        print()
        print(class_table(graded))
    if args.junit:
        print(f"junit XML written to {args.junit}")
    return 0 if all(r.passed for _, reports, _ in graded for r in reports) else 1


def _student_tables(args, names, filtered, student, stamp, reports, attempts, scores, root):
    print()
    print(score_table(reports))
    known = registry()
    learner = args.source == "exercises"
    last = {name: attempts.entry(name)["last"] for name in known} if learner else {}
    last.update({report.exercise.name: verdict(report) for report in reports})
    print()
    print(progress_table(known, last, attempts, scores, chapter_titles(root),
                         only=names if filtered else None, hint_command=HINT_IN_TERMINAL))
    got = sum(r.score[0] for r in reports)
    total = sum(r.score[1] for r in reports)
    print(f"\n{clean_text(student, 200)}: {got}/{total} checks passed, "
          f"{sum(r.passed for r in reports)}/{len(reports)} exercises, graded {stamp}")


def class_table(graded) -> str:
    """One line per student: checks and exercises passed."""
    rows = [f"{'student':<24}{'checks':>10}{'exercises':>12}"]
    for student, reports, _ in graded:
        got = sum(r.score[0] for r in reports)
        total = sum(r.score[1] for r in reports)
        rows.append(f"{clean_text(student, 22):<24}{f'{got}/{total}':>10}"
                    f"{f'{sum(r.passed for r in reports)}/{len(reports)}':>12}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
