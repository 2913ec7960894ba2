"""``python -m engine <command>``. Commands: ``train`` (the GPT on a dp x tp x pp mesh) and
``drill`` (the interview drill)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": "engine.train", "drill": "engine.drill.cli",
                "parity": "engine.compose.parity"}
    if not argv or argv[0] not in commands:
        print("usage: python -m engine {" + ",".join(commands) + "} [options]\n"
              "  train   train the GPT on a dp x tp x pp mesh (python -m engine train --help)\n"
              "  drill   the interview drill (python -m engine drill --help)\n"
              "  parity  every composed layout against one process (python -m engine parity "
              "--help)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
