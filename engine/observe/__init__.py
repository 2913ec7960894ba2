"""What measures and checks, never the algorithm: the kernels report to it.

* :mod:`~engine.observe.meter`: ``CommMeter``, what this rank put on the wire, op by op;
  :mod:`~engine.observe.durations`, how each event's start and end were obtained;
* :mod:`~engine.observe.clock`: one clock for host and GPU work (CUDA events as host time);
* :mod:`~engine.observe.trace`: timelines exported as Chrome trace JSON;
* :mod:`~engine.observe.memory`: the bytes a rank holds (model states and activations);
* :mod:`~engine.observe.nccl_rules`: NCCL's rules enforced on any backend;
  :mod:`~engine.observe.patching`, the one patcher they and the grader use.
"""
