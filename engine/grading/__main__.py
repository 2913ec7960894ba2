"""``python -m tests.grading``: grade every exercise, print a score table, write junit XML.

    python -m tests.grading                      # grade your code in exercises/
    python -m tests.grading --only ch00          # one chapter (or one exercise name)
    python -m tests.grading --junit report.xml   # also write junit XML (CI dashboards read it)
    python -m tests.grading --source solutions   # grade the reference solutions
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

from tests.grading import SOURCES, Report, format_report, registry, run_checks


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
    parser = argparse.ArgumentParser(prog="python -m tests.grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=SOURCES, default="exercises")
    parser.add_argument("--only", default="", help="a chapter (ch00) or an exercise name")
    parser.add_argument("--junit", default="", help="write junit XML to this path")
    args = parser.parse_args(argv)

    names = [n for n in registry() if n == args.only or n.split(".")[0] == args.only
             or not args.only]
    if not names:
        parser.error(f"--only {args.only!r} matches no exercise; known: {', '.join(registry())}")
    reports, seconds = [], {}
    for name in names:
        start = time.perf_counter()
        reports.append(run_checks(name, source=args.source))
        seconds[name] = time.perf_counter() - start
        print(format_report(reports[-1], color=sys.stdout.isatty()))
    print()
    print(score_table(reports))
    if args.junit:
        junit_xml(reports, seconds).write(args.junit, encoding="utf-8", xml_declaration=True)
        print(f"junit XML written to {args.junit}")
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
