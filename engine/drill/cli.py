"""``python -m engine drill``: the interview drill in a terminal.

Interactive by default. ``--answers FILE`` (one answer per line, ``-`` for stdin) runs it
without a person: for scripted practice, and for the tests. Numeric answers are numbers;
multiple choice takes the letter; 30-second prompts take y or n after you compare your answer
with the outline.
"""

from __future__ import annotations

import argparse
import sys

from engine.drill.bank import Scores, by_topic, draw
from engine.drill.items import TOPICS, Question


def render(q: Question, index: int, total: int) -> str:
    return f"\n[{index}/{total}] " + q.as_text(indent="    ")


def feedback(q: Question, correct: bool) -> str:
    if q.kind == "numeric":
        head = f"{'right' if correct else 'not quite'}: {q.answer:.4g}"
    elif q.kind == "choice":
        head = f"{'right' if correct else 'not quite'}: {chr(ord('a') + q.answer)}) " \
               f"{q.options[q.answer]}"
    else:
        head = "noted" if correct else "noted: go back over it"
    text = f"  -> {head}. {q.explanation}"
    if q.evidence:
        text += f"\n     evidence: {q.evidence[0]}, section \"{q.evidence[1]}\""
    return text


def prompt_for(q: Question) -> str:
    return {"numeric": "  answer> ", "choice": "  letter> ", "outline": "  did you cover it "
            "(y/n)> "}[q.kind]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine drill",
                                     description="The distributed-training interview drill.")
    parser.add_argument("--topic", choices=TOPICS)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--answers", help="a file of answers, one per line ('-': stdin)")
    parser.add_argument("--scores", help="where to keep the scores (default: ~/.cache/...)")
    parser.add_argument("--list", action="store_true", help="print the bank's size per topic")
    args = parser.parse_args(argv)
    if args.list:
        for topic, n in by_topic().items():
            print(f"{topic:<18}{n:>4} items")
        return 0
    questions = draw(args.count, args.topic, args.seed)
    scripted = None
    if args.answers:
        source = sys.stdin if args.answers == "-" else open(args.answers, encoding="utf-8")
        scripted = [line.strip() for line in source]
    scores, right = Scores(args.scores), 0
    for i, q in enumerate(questions, 1):
        print(render(q, i, len(questions)))
        if scripted is not None:
            response = scripted[i - 1] if i - 1 < len(scripted) else ""
            print(prompt_for(q) + response)
        else:
            response = input(prompt_for(q))
        correct = q.grade(response)
        right += correct
        scores.record(q, correct)
        print(feedback(q, correct))
    scores.save()
    print(f"\nscore: {right}/{len(questions)}\n\nall sittings so far ({scores.path}):")
    print(scores.table())
    return 0
