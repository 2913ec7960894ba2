"""The drill in a notebook: one question at a time, instant feedback, saved scores."""

from __future__ import annotations

import html

from engine.drill.answers import Unreadable, show as show_value
from engine.drill.bank import Scores, draw


def question_text(q) -> str:
    """The question as plain text (the static fallback, and the widget's body)."""
    return q.as_text()


def drill_widget(count: int = 10, topic: str | None = None, seed: int | None = None,
                 scores_path=None):
    """A drill session: answer, press Check, read the explanation, press Next."""
    import ipywidgets as widgets

    questions = draw(count, topic, seed)
    scores = Scores(scores_path)
    state = {"i": 0, "right": 0}
    body = widgets.HTML()
    answer = widgets.Text(placeholder="a number, a letter, or y/n")
    check, nxt = widgets.Button(description="Check"), widgets.Button(description="Next")
    result = widgets.HTML()

    def show():
        if state["i"] >= len(questions):
            body.value = (f"<b>Done: {state['right']}/{len(questions)}</b><pre>"
                          f"{scores.table()}</pre>")
            answer.disabled = check.disabled = nxt.disabled = True
            return
        q = questions[state["i"]]
        body.value = (f"<b>{state['i'] + 1}/{len(questions)}</b><pre style='white-space: "
                      f"pre-wrap'>{question_text(q)}</pre>")
        answer.value, result.value = "", ""
        check.disabled = False

    def on_check(_):
        q = questions[state["i"]]
        try:
            correct = q.grade(q.read(answer.value))
        except Unreadable as e:  # asked again, never graded
            result.value = html.escape(f"could not read {answer.value!r}: {q.how_to_answer()} "
                                       f"({e}).")
            return
        state["right"] += correct
        scores.record(q, correct)
        scores.save()
        shown = show_value(q.answer, q.unit) if q.kind == "numeric" else (
            chr(ord("a") + q.answer) if q.kind == "choice" else "")
        evidence = f"<br>evidence: {q.evidence[0]}, “{q.evidence[1]}”" if q.evidence else ""
        result.value = (f"<b style='color:{'green' if correct else 'crimson'}'>"
                        f"{'right' if correct else 'not quite'}</b> {shown} — "
                        f"{q.explanation}{evidence}")
        check.disabled = True

    def on_next(_):
        state["i"] += 1
        show()

    check.on_click(on_check)
    nxt.on_click(on_next)
    show()
    return widgets.VBox([body, answer, widgets.HBox([check, nxt]), result])
