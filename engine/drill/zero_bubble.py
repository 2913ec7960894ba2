"""Zero-bubble pipeline items (chapter 06): ZB-H2, the memory each schedule holds.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

from engine import theory
from engine.drill.items import Choice, Numeric

C06 = "course/06_pipeline.ipynb"
ZB_H2 = "ZB-H2: zero bubble for 2p-1 micro-batches"
TABLE = "The memory table: what each schedule holds and sends"
POST = "Post-validation: the optimizer step without a barrier"
V_SECTION = "ZB-V and DualPipeV: two chunks per GPU, placed in a V"


def _see(section: str) -> str:
    return f" (chapter 06, \"{section}\")"


def _zb_h2_bubble(rng):
    p = rng.choice([4, 8, 16])
    t_f, t_b = rng.choice([1.0, 1.5, 2.0]), rng.choice([1.0, 1.5, 2.0])
    t_w = rng.choice([0.5, 1.0])
    return (f"ZB-H2 on {p} stages, steps back to back (post-validated optimizer step), enough "
            f"micro-batches; per stage and micro-batch F = {t_f:g}, B (input gradient) = "
            f"{t_b:g}, W = {t_w:g}: idle time per stage per step, in units of those times?",
            theory.zb_h2_bubble_time(p, t_f, t_b, t_w),
            "(p-1)(F+B-2W): the warm-up forwards and the W's moved into the tail fill the rest; "
            "zero when F = B = W" + _see(ZB_H2) + ".")


def _zb_h2_memory(rng):
    p = rng.choice([4, 8, 16, 32])
    return (f"ZB-H2 on {p} stages: peak activations on stage 0, in micro-batches of that "
            "stage (M_B)?", theory.pipeline_peak_activations("zb_h2", p),
            "2p-1: the warm-up runs forwards until the first B arrives, 2(p-1)+1 slots on stage "
            "0; 1F1B and ZB-H1 hold p" + _see(TABLE) + ".")


def _v_hops(rng):
    p = rng.choice([4, 8, 16])
    return (f"ZB-V (or DualPipeV) on {p} GPUs, two chunks each: point-to-point messages between "
            "GPUs per micro-batch per step (activations forward plus gradients backward)?",
            theory.pipeline_p2p_hops("zb_v", p),
            "2p virtual stages, 2p-1 boundaries, the middle one on one GPU: 2(2p-2) = 4(p-1), "
            "twice 1F1B's 2(p-1)" + _see(TABLE) + ".")


def _dualpipe_v_memory(rng):
    p = rng.choice([4, 8, 16])
    return (f"DualPipeV on {p} GPUs (2p = {2 * p} chunk stages): peak activations per GPU, in "
            "micro-batches of a GPU's whole share of the model (M_B)?",
            theory.pipeline_peak_activations("dualpipe_v", p),
            "The DualPipe README counts PP+1 chunk micro-batches per device, PP = 2p chunks of "
            "half a GPU's share: p + 1/2, against ZB-V's p" + _see(TABLE) + ".")


def _h2_over_h1(rng):
    p = rng.choice([2, 4, 8, 16])
    return (f"{p} stages: ZB-H2's peak activations on stage 0 over ZB-H1's?",
            theory.pipeline_peak_activations("zb_h2", p)
            / theory.pipeline_peak_activations("zb_h1", p),
            "(2p-1)/p, nearly twice: what ZB-H2 pays to remove the bubble ZB-H1 leaves (a "
            "third of 1F1B's when F = B = W)" + _see(TABLE) + ".")


ITEMS: list = [  # Numeric, Choice and Outline items of topic 'pipeline'
    Numeric("zb-h2-bubble", "pipeline", _zb_h2_bubble, unit="units of F"),
    Numeric("zb-h2-memory", "pipeline", _zb_h2_memory, unit="micro-batches"),
    Numeric("zb-v-p2p-hops", "pipeline", _v_hops, unit="messages"),
    Numeric("dualpipe-v-memory", "pipeline", _dualpipe_v_memory, unit="micro-batches"),
    Numeric("zb-h2-over-h1-memory", "pipeline", _h2_over_h1, unit="x"),
    Choice("zb-post-validation", "pipeline",
           "ZB-H2's step is a parallelogram: stage 0 finishes first, stage p-1 last. What must "
           "change for steps to follow each other with zero bubble?",
           ("The global checks (gradient norm for clipping, NaN/inf) move after the optimizer "
            "step: each stage steps as soon as its own gradients are ready, and the step is "
            "rolled back and redone (clipped or skipped) in the rare case the check fails",
            "Nothing: the schedule alone removes every bubble",
            "The optimizer step moves onto the last stage, which gathers every gradient"), 0,
           "A check before the step is an all-reduce over the stages: all wait for the last "
           "one. The chapter simulates the step time both ways and shows the rollback equal "
           "to clipping before the step.",
           (C06, POST)),
    Choice("dualpipe-v-origin", "pipeline",
           "Where does DualPipeV come from?",
           ("The DualPipe repository: DualPipe (described in the DeepSeek-V3 technical report, "
            "two copies of the model fed from both ends) cut in half onto a V, an idea Sea AI "
            "Lab published; one copy of the model",
            "The DeepSeek-V3 technical report, which trained DeepSeek-V3 with it",
            "Megatron-LM's interleaved 1F1B with two chunks"), 0,
           "The report describes DualPipe; the V form was added to the repository later, "
           "crediting Sea AI Lab's \"cut-in-half\" post.",
           (C06, V_SECTION)),
]
