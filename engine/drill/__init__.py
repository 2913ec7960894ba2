"""The interview drill: a bank of numeric, misconception and 30-second-answer items."""

from engine.drill.bank import BANK, Scores, by_topic, draw
from engine.drill.items import TOPICS, Question

__all__ = ["BANK", "Scores", "by_topic", "draw", "TOPICS", "Question"]
