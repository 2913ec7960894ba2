"""The model: the one GPT (:mod:`~engine.model.gpt`: GPT-2's architecture and Llama 3's), its
attention kernel (:mod:`~engine.model.attention`), rotary positions
(:mod:`~engine.model.rope`) and RMSNorm (:mod:`~engine.model.rmsnorm`), the sizes ``engine
train --model`` names (:mod:`~engine.model.presets`: tiny to Llama 3 8B), the chapters' small
MLP (:mod:`~engine.model.mlp`), their synthetic data (:mod:`~engine.model.data`) and seeded
construction (:mod:`~engine.model.seed`).
"""
