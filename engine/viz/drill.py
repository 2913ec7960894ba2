"""The drill in a notebook: one question at a time, instant feedback, saved scores."""

from __future__ import annotations

import html

from engine.drill.answers import Unreadable, show as show_value
from engine.drill.bank import Scores, draw


def question_text(q, answered: bool = False) -> str:
    """The question as plain text (the static fallback, and the widget's body). An outline
    item's outline is shown only once ``answered``."""
    return q.as_text(answered=answered)


def drill_widget(count: int = 10, topic: str | None = None, seed: int | None = None,
                 scores_path=None):
    """A drill session: answer, press Check, read the explanation, press Next. A 30-second
    item shows its question only: say (or type) an answer, press Show outline, then answer y or
    n, whether yours covered it, and press Check."""
    import ipywidgets as widgets

    questions = draw(count, topic, seed)
    scores = Scores(scores_path)
    state = {"i": 0, "right": 0, "revealed": False}
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
        state["revealed"] = False
        body.value = _body(q, answered=False)
        answer.value, result.value = "", ""
        outline = q.kind == "outline"
        answer.placeholder = "your answer, or leave empty" if outline else \
            "a number or a letter"
        check.description = "Show outline" if outline else "Check"
        check.disabled = False

    def _body(q, answered: bool) -> str:
        return (f"<b>{state['i'] + 1}/{len(questions)}</b><pre style='white-space: "
                f"pre-wrap'>{html.escape(question_text(q, answered))}</pre>")

    def on_check(_):
        q = questions[state["i"]]
        if q.kind == "outline" and not state["revealed"]:  # answered: now the outline
            state["revealed"] = True
            body.value = _body(q, answered=True)
            answer.value, answer.placeholder = "", "y or n"
            check.description = "Check"
            result.value = "Did your answer cover the outline? Type y or n and press Check."
            return
        try:
            correct = q.grade(q.read(answer.value))
        except Unreadable as e:  # asked again, never graded
            result.value = html.escape(q.unreadable(answer.value, e))
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
