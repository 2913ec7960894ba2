"""Files and lines per package of ``engine/``, at the working tree or at a git revision.

    python scripts/package_lines.py            # the working tree
    python scripts/package_lines.py --rev REV  # any commit, e.g. to compare before and after

The engine's root (``engine/*.py``) is its own row, ``(root)``; a package's row counts every
module under it, subpackages included (``grading`` holds ``grading/chapters``).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sources(rev: str | None) -> dict[str, str]:
    """``{path: text}`` of every ``engine/**/*.py`` in the working tree or at ``rev``."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "engine").rglob("*.py")}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "engine"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout
            for name in names if name.endswith(".py")}


def per_package(files: dict[str, str]) -> dict[str, tuple[int, int]]:
    """``{package: (files, lines)}``; the root's modules under ``(root)``."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for path, text in files.items():
        parts = Path(path).parts
        package = parts[1] if len(parts) > 2 else "(root)"
        out[package][0] += 1
        out[package][1] += len(text.splitlines())
    return {name: (n, lines) for name, (n, lines) in sorted(out.items())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    args = parser.parse_args(argv)
    table = per_package(sources(args.rev))
    print(f"{'package':<12}{'files':>7}{'lines':>8}")
    for name, (n, lines) in table.items():
        print(f"{name:<12}{n:>7}{lines:>8}")
    print(f"{'total':<12}{sum(n for n, _ in table.values()):>7}"
          f"{sum(lines for _, lines in table.values()):>8}")


if __name__ == "__main__":
    main()
