"""The model: the one GPT (:mod:`~engine.model.gpt`), its attention kernel
(:mod:`~engine.model.attention`), the sizes ``engine train --model`` names
(:mod:`~engine.model.presets`), the chapters' small MLP (:mod:`~engine.model.mlp`), their
synthetic data (:mod:`~engine.model.data`) and seeded construction (:mod:`~engine.model.seed`).
"""
