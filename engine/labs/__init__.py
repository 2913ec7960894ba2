"""What the chapters run and measure beside the engine, never mixed into a kernel's file:
chapter 05's tensor parallelism against ZeRO-3 (:mod:`~engine.labs.tp_zero3`), the 3D run of
chapter 07 (:mod:`~engine.labs.hybrid`), the ZeRO-3 and FSDP2 side by side of
chapter 12 (:mod:`~engine.labs.fsdp2`), chapter 11's DiLoCo experiment
(:mod:`~engine.labs.diloco`) and a checkpoint's blocking time, synchronous against
asynchronous (:mod:`~engine.labs.checkpoint_timing`).
"""
