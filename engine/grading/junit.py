"""The grader's junit XML: one ``testsuite`` per chapter, one ``testcase`` per check, naming the
student and when they were graded, rewritten whole after every exercise.

CI dashboards and class spreadsheets read junit. Each ``testsuite`` is named
``"<student>: <chapter>"`` and carries ``timestamp`` and ``hostname`` attributes and the
properties ``student``, ``timestamp``, ``source`` and ``time_limit_s``; ``testcase`` is
``classname`` = the exercise, ``name`` = the check. :func:`write_atomically` writes a temporary
file beside the target and renames it over it, so a grading run stopped at any moment (Ctrl-C,
``kill -9``) leaves the file of the last exercise finished, complete and parseable.
"""

from __future__ import annotations

import os
import socket
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from engine.grading.core import Report
from engine.grading.feedback import MESSAGE_CHARS, clean_text, printed_lines


def junit_xml(reports: list[Report], seconds: dict[str, float], student: str = "",
              timestamp: str = "", properties: dict[str, str] | None = None) -> ET.ElementTree:
    """The junit tree of ``reports`` (``seconds``: each exercise's wall time, shared among its
    checks), for ``student`` graded at ``timestamp`` (ISO 8601)."""
    student = clean_text(student, 200)
    suites = ET.Element("testsuites", name=f"grade: {student}" if student else "grade")
    by_chapter: dict[str, list[Report]] = defaultdict(list)
    for report in reports:
        by_chapter[report.exercise.chapter].append(report)
    shared = {"student": student, "timestamp": timestamp, **(properties or {})}
    for chapter, chapter_reports in by_chapter.items():
        results = [(rep, res) for rep in chapter_reports for res in rep.results]
        suite = ET.SubElement(suites, "testsuite",
                              name=f"{student}: {chapter}" if student else chapter,
                              tests=str(len(results)),
                              failures=str(sum(not res.passed for _, res in results)),
                              errors="0", timestamp=timestamp, hostname=socket.gethostname(),
                              time=f"{sum(seconds[r.exercise.name] for r in chapter_reports):.3f}")
        listed = ET.SubElement(suite, "properties")
        for key, value in shared.items():
            ET.SubElement(listed, "property", name=key, value=clean_text(str(value)))
        for rep, res in results:
            case = ET.SubElement(suite, "testcase", classname=rep.exercise.name, name=res.name,
                                 time=f"{seconds[rep.exercise.name] / len(rep.results):.3f}")
            if not res.passed:
                failure = ET.SubElement(case, "failure", message=clean_text(
                    res.message, MESSAGE_CHARS), type=res.kind)
                failure.text = clean_text("\n".join(
                    [*(f"{f.file}, line {f.line}, in {f.function}" for f in res.frames),
                     *(f"{k} = {v!r}" for k, v in res.inputs.items())]), 4 * MESSAGE_CHARS)
        printed = "\n".join(printed_lines("\n".join(rep.output for rep in chapter_reports)))
        if printed:
            ET.SubElement(suite, "system-out").text = printed
    return ET.ElementTree(suites)


def class_junit_xml(graded: list[tuple[str, list[Report], dict[str, float]]], timestamp: str,
                    properties: dict[str, str] | None = None) -> ET.ElementTree:
    """One junit tree for several students (``(student, reports, seconds)`` each): every
    student's chapters are ``testsuite`` elements named ``"<student>: <chapter>"``."""
    if len(graded) == 1:
        student, reports, seconds = graded[0]
        return junit_xml(reports, seconds, student, timestamp, properties)
    root = ET.Element("testsuites", name="grade: class")
    for student, reports, seconds in graded:
        root.extend(junit_xml(reports, seconds, student, timestamp, properties).getroot())
    return ET.ElementTree(root)


def write_atomically(tree: ET.ElementTree, path: str | Path) -> None:
    """Write ``tree`` to ``path`` through a temporary file renamed over it: a reader (or a run
    stopped midway) only ever sees a whole file."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                     dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as out:
            tree.write(out, encoding="utf-8", xml_declaration=True)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide it from a CI reader
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
