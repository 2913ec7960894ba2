"""``python -m engine drill``: the interview drill in a terminal.

Interactive by default. ``--answers FILE`` (one answer per line, ``-`` for stdin) runs it
without a person: for scripted practice, and for the tests. Answers are read the way people
type them (:mod:`engine.drill.answers`): numbers with units or arithmetic (``175 MB``,
``2*7/8*100``, ``approx 1.88``), letters (``a``, ``B)``, ``(c)``, ``a) whole heads``). A
30-second item shows its question only: say (or type) your answer and press Enter, then the
outline is shown and you answer y or n, whether yours covered it; in a file of answers such an
item takes two lines, your answer (any text, or empty) and then y or n. An answer the drill
cannot read is asked again, never graded. When the input ends (Ctrl-D, or the end of the file)
the sitting stops: only the answered items are scored and saved.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from engine.drill.answers import Unreadable, show
from engine.drill.bank import Scores, by_kind, by_topic, draw
from engine.drill.items import TOPICS, Question
from engine.validation import positive_int


def render(q: Question, index: int, total: int, original: bool = True) -> str:
    return f"\n[{index}/{total}] " + q.as_text(indent="    ", original=original)


def feedback(q: Question, correct: bool, value) -> str:
    """Right or not, the answer, and why."""
    if q.kind == "numeric":
        head = f"{'right' if correct else 'not quite'}: {show(q.answer, q.unit)}"
        if not correct:
            head += f" (you: {show(value, q.unit)})"
    elif q.kind == "choice":
        head = f"{'right' if correct else 'not quite'}: {chr(ord('a') + q.answer)}) " \
               f"{q.options[q.answer]}"
    else:
        head = "noted" if correct else "noted: go back over it"
    text = f"  -> {head}. {q.explanation}"
    if q.evidence:
        text += f"\n     evidence: {q.evidence[0]}, section \"{q.evidence[1]}\""
    return text


SAY_PROMPT = "  your answer (say it, then press Enter)> "


def prompt_for(q: Question) -> str:
    return {"numeric": "  answer> ", "choice": "  letter> ", "outline": "  did you cover it "
            "(y/n)> "}[q.kind]


Ask = Callable[[str], "str | None"]  # shows a prompt, returns the answer, None at end of input


def ask_terminal(prompt: str) -> str | None:
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        print()
        return None


def ask_from(lines: Iterator[str]) -> Ask:
    """Answers from ``lines`` (a file or a pipe), read one at a time after each prompt and
    echoed, so the transcript reads like a sitting."""
    def ask(prompt: str) -> str | None:
        print(prompt, end="", flush=True)
        line = next(lines, None)
        if line is None:
            print("(end of input)", flush=True)
            return None
        line = line.rstrip("\r\n")
        print(line, flush=True)
        return line
    return ask


@dataclass
class Sitting:
    right: int = 0
    answered: int = 0
    drawn: int = 0

    @property
    def skipped(self) -> int:
        return self.drawn - self.answered

    def summary(self) -> str:
        text = f"score: {self.right}/{self.answered}"
        if self.skipped:
            text += f" ({self.skipped} of {self.drawn} skipped: the input ended; not scored)"
        return text


def sit(questions: list[Question], ask: Ask, scores: Scores, original: bool = True) -> Sitting:
    """Ask each question until it is answered in a form the drill reads; stop at the end of
    input. Records only the answered ones in ``scores``."""
    sitting = Sitting(drawn=len(questions))
    for i, q in enumerate(questions, 1):
        print(render(q, i, len(questions), original), flush=True)
        if q.kind == "outline":  # the outline only once the learner has said an answer
            if ask(SAY_PROMPT) is None:
                break
            print(q.reveal(indent="    "), flush=True)
        while (response := ask(prompt_for(q))) is not None:
            try:
                value = q.read(response)
                break
            except Unreadable as e:
                print(f"  {q.unreadable(response, e)}", flush=True)
        if response is None:
            break
        correct = q.grade(value)
        sitting.right += correct
        sitting.answered += 1
        scores.record(q, correct)
        print(feedback(q, correct, value), flush=True)
    return sitting


def listing() -> str:
    """The bank's size: per topic, and in all, with the count of each kind."""
    def kinds(topic=None) -> str:
        n = by_kind(topic)
        return (f"{n['numeric']} numeric, {n['choice']} misconception{'s' * (n['choice'] != 1)}, "
                f"{n['outline']} outline{'s' * (n['outline'] != 1)}")
    lines = [f"{topic:<18}{n:>4} items: {kinds(topic)}" for topic, n in by_topic().items()]
    lines.append(f"{'in all':<18}{sum(by_topic().values()):>4} items: {kinds()}")
    return "\n".join(lines)


def _count(text: str) -> int:
    try:
        return positive_int("--count", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--count must be a positive int, got {text!r}") \
            from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine drill",
                                     description="The distributed-training interview drill.")
    parser.add_argument("--topic", choices=TOPICS, help="draw from one topic (default: all)")
    parser.add_argument("--count", type=_count, default=10,
                        help="questions per sitting (default: 10)")
    parser.add_argument("--seed", type=int, help="draw the same questions again")
    parser.add_argument("--answers", help="a file of answers, one per line ('-': stdin)")
    parser.add_argument("--scores", help="where to keep the scores (default: $DRILL_SCORES or "
                                         "~/.cache/distributed-course/drill.json)")
    parser.add_argument("--no-original", dest="original", action="store_false",
                        help="leave out the question as asked in the source interview")
    parser.add_argument("--list", action="store_true",
                        help="print the bank's size per topic and kind, and in all")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    questions = draw(args.count, args.topic, args.seed)
    scores = Scores(args.scores)
    if args.answers is None:
        sitting = sit(questions, ask_terminal, scores, args.original)
    elif args.answers == "-":
        sitting = sit(questions, ask_from(iter(sys.stdin)), scores, args.original)
    else:
        with open(args.answers, encoding="utf-8") as source:
            sitting = sit(questions, ask_from(iter(source)), scores, args.original)
    print(f"\n{sitting.summary()}")
    if not sitting.answered:
        print("nothing answered: no score saved")
        return 0
    scores.save()
    print(f"\nall sittings so far ({scores.path}):")
    print(scores.table())
    return 0
