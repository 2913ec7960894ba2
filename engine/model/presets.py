"""The model sizes ``python -m engine train --model NAME`` trains: a :class:`engine.model.gpt.
GPTConfig` per name, beside the models they configure.

``tiny-moe`` is the tiny GPT's shape with mixture-of-experts MLPs; its expert settings
(experts, top-k, capacity) are :data:`engine.moe.gpt.MOE_MODELS`. The planner's models of real
size (GPT-3, LLaMA, Mixtral) are :data:`engine.theory.planner.MODELS`.
"""

from __future__ import annotations

from engine.model.gpt import GPTConfig

MODELS = {
    "tiny": GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),
    "small": GPTConfig(vocab=256, seq_len=64, layers=4, heads=4, hidden=128),
    "medium": GPTConfig(vocab=512, seq_len=128, layers=8, heads=8, hidden=256),
    "tiny-moe": GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),  # MoE MLPs
}
