"""``python -m engine <command>``. Commands: ``train`` (the GPT on a dp x cp x tp x pp mesh,
experts over ep ranks borrowed from dp x cp), ``data`` (a text file as token ids for ``train
--data``: :mod:`engine.model.prepare`), ``drill`` (the interview drill) and ``parity`` (every
composed layout against one process).

:func:`main` is the commands as Python calls them (a notebook, a test): a failed launch raises.
:func:`command_line` is what the shell runs: there the lab's deliberate kill of a rank
(``train --kill-at-step K``) ends with what happened and what to do, no traceback
(:func:`engine.train.endings.killed_on_purpose`); any other failure keeps its traceback.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": "engine.train.cli", "data": "engine.model.prepare",
                "drill": "engine.drill.cli", "parity": "engine.compose.parity"}
    if not argv or argv[0] not in commands:
        print("usage: python -m engine {" + ",".join(commands) + "} [options]\n"
              "  train   train the GPT on a dp x cp x tp x pp mesh (python -m engine train "
              "--help)\n"
              "  data    a text file as token ids to train on (python -m engine data "
              "prepare TEXT_FILE --out PATH; python -m engine data --help)\n"
              "  drill   the interview drill (python -m engine drill --help)\n"
              "  parity  every composed layout against one process (python -m engine parity "
              "--help)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


def command_line(argv=None) -> int:
    """:func:`main` as ``python -m engine`` runs it; its exit code."""
    from engine.launch import RankDiedError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return main(argv)
    except RankDiedError as error:
        if argv[:1] != ["train"]:
            raise
        from engine.launch import LaunchEnv
        from engine.train.cli import parse
        from engine.train.endings import KILLED_EXIT, killed_on_purpose

        cfg, args, _ = parse(argv[1:])
        world = args.world_size or cfg.world_size
        said = None if LaunchEnv.read().under_torchrun else \
            killed_on_purpose(error, cfg, world, argv[1:])
        if said is None:
            raise  # a rank that died unexpectedly: its traceback is the evidence
        print(said, file=sys.stderr, flush=True)
        return KILLED_EXIT


if __name__ == "__main__":
    sys.exit(command_line())
