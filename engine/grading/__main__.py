"""``python -m engine.grading``: grade every exercise, print a score table, write junit XML.

    python -m engine.grading                      # grade your code in exercises/
    python -m engine.grading --only ch00          # one chapter (or exercise names, a,b,...)
    python -m engine.grading --junit report.xml   # also write junit XML (CI dashboards read it)
    python -m engine.grading --source solutions   # grade the reference solutions
    python -m engine.grading --root PATH          # the course folder (default: found from here)

An exercise whose file does not compile or import fails on its own; the others are graded.
Grading exercises/ counts as an attempt, as check() does in a notebook: a failure of code that
runs reveals the exercise's next hint. The end is a table per chapter: exercises passed, the
drill's score on the chapter's topics, and what to do next.
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

from engine.drill.bank import Scores
from engine.grading import SOURCES, Report, course_root, format_report, registry, run_checks
from engine.grading.progress import Attempts, chapter_titles, progress_table, verdict


def junit_xml(reports: list[Report], seconds: dict[str, float]) -> ET.ElementTree:
    suites = ET.Element("testsuites", name="grade")
    by_chapter: dict[str, list[Report]] = defaultdict(list)
    for report in reports:
        by_chapter[report.exercise.chapter].append(report)
    for chapter, chapter_reports in by_chapter.items():
        results = [(rep, res) for rep in chapter_reports for res in rep.results]
        suite = ET.SubElement(suites, "testsuite", name=chapter, tests=str(len(results)),
                              failures=str(sum(not res.passed for _, res in results)))
        for rep, res in results:
            case = ET.SubElement(suite, "testcase", classname=rep.exercise.name, name=res.name,
                                 time=f"{seconds[rep.exercise.name] / len(rep.results):.3f}")
            if not res.passed:
                failure = ET.SubElement(case, "failure", message=res.message)
                failure.text = "\n".join(f"{k} = {v!r}" for k, v in res.inputs.items())
    return ET.ElementTree(suites)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=SOURCES, default="exercises")
    parser.add_argument("--only", default="",
                        help="chapters (ch00) or exercise names, comma-separated")
    parser.add_argument("--junit", default="", help="write junit XML to this path")
    parser.add_argument("--root", default=None, help="the course folder (holds exercises/)")
    args = parser.parse_args(argv)
    try:
        root = course_root(args.root)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))

    wanted = {item.strip() for item in args.only.split(",") if item.strip()}
    known = registry()
    unknown = sorted(wanted - set(known) - {n.split(".")[0] for n in known})
    if unknown:
        parser.error(f"--only: {', '.join(unknown)} matches no exercise; "
                     f"known: {', '.join(known)}")
    names = [n for n in known if not wanted or n in wanted or n.split(".")[0] in wanted]
    learner = args.source == "exercises"  # the reference solutions are nobody's attempts
    attempts = Attempts()
    reports, seconds = [], {}
    for name in names:
        start = time.perf_counter()
        reports.append(run_checks(name, source=args.source, root=root))
        seconds[name] = time.perf_counter() - start
        level = attempts.record(reports[-1]) if learner else 0
        print(format_report(reports[-1], color=sys.stdout.isatty(), hint_level=level))
    if learner:
        attempts.save()
    print()
    print(score_table(reports))
    last = {name: attempts.entry(name)["last"] for name in known} if learner else {}
    last.update({report.exercise.name: verdict(report) for report in reports})
    print()
    print(progress_table(known, last, attempts, Scores(), chapter_titles(root)))
    if args.junit:
        junit_xml(reports, seconds).write(args.junit, encoding="utf-8", xml_declaration=True)
        print(f"junit XML written to {args.junit}")
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
