"""The model sizes ``python -m engine train --model NAME`` trains: a :class:`engine.model.gpt.
GPTConfig` per name, beside the models they configure.

``tiny``, ``small`` and ``medium`` are GPT-2's architecture at sizes a CPU trains in seconds;
``tiny-moe`` is the tiny GPT's shape with mixture-of-experts MLPs (its expert settings:
:data:`engine.moe.gpt.MOE_MODELS`). The models of real size, their published parameter counts
asserted on the meta device (tests/test_presets.py):

* ``gpt2-124m``: GPT-2 small (Radford et al. 2019; the 124M checkpoint): 12 layers, hidden
  768, 12 heads, 1,024 positions, GPT-2's BPE vocabulary of 50,257, the head tied to the token
  embedding: 124,439,808 parameters.
* ``llama3-1b``: Llama 3.2 1B's shape (Meta, model card, 2024): 16 layers, hidden 2,048, 32
  query and 8 key/value heads, SwiGLU width 8,192, vocabulary 128,256, the head tied:
  1,235,814,400 parameters.
* ``llama3-8b``: Llama 3 8B (Grattafiori et al. 2024, table 3): 32 layers, hidden 4,096, 32
  query and 8 key/value heads, SwiGLU width 14,336, vocabulary 128,256, the head untied:
  8,030,261,248 parameters.
* ``llama-tiny``: the Llama architecture (RMSNorm, rotary positions with Llama 3's theta,
  SwiGLU, grouped-query attention, no biases, an untied head) at ``tiny``'s size, for tests
  and the CPU.

Llama 3's sequence length here is its pre-training context, 8,192 (the 3.1 and 3.2 models
extend it to 128K by rescaling the rotary frequencies, which changes no parameter and is left
out). The planner's models (GPT-3, LLaMA, Mixtral) are :data:`engine.theory.planner.MODELS`.
"""

from __future__ import annotations

from engine.model.gpt import GPTConfig

LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", rope_theta=500_000.0,
             bias=False, qkv_bias=False)  # Llama 3's choices over GPT-2's

MODELS = {
    "tiny": GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),
    "small": GPTConfig(vocab=256, seq_len=64, layers=4, heads=4, hidden=128),
    "medium": GPTConfig(vocab=512, seq_len=128, layers=8, heads=8, hidden=256),
    "tiny-moe": GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),  # MoE MLPs
    "llama-tiny": GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32, kv_heads=2,
                            ffn_hidden=96, tied=False, **LLAMA),
    "gpt2-124m": GPTConfig(vocab=50_257, seq_len=1_024, layers=12, heads=12, hidden=768),
    "llama3-1b": GPTConfig(vocab=128_256, seq_len=8_192, layers=16, heads=32, hidden=2_048,
                           kv_heads=8, ffn_hidden=8_192, tied=True, **LLAMA),
    "llama3-8b": GPTConfig(vocab=128_256, seq_len=8_192, layers=32, heads=32, hidden=4_096,
                           kv_heads=8, ffn_hidden=14_336, tied=False, **LLAMA),
}
