"""The composed engine: one model, parallelised by functions, trained by one loop.

torchtitan, Megatron-Core and picotron are each one system: a mesh of named dimensions
(:class:`engine.topology.Mesh`), functions that parallelise one model definition, one training
loop. This package is that system for the engine, built from the per-concept layers a learner
reads (:mod:`engine.tp`, :mod:`engine.cp`, :mod:`engine.moe`, :mod:`engine.dp`,
:mod:`engine.zero`), bottom up:

* :mod:`~engine.compose.plan`: :class:`Plan`, the degrees and choices of one layout, checked
  against the model and the batch before any rank starts;
* :mod:`~engine.compose.model`: :class:`GPT`, the one GPT definition
  (:class:`engine.model.gpt.GPT`: grouped-query attention, dense or MoE feed-forward layers, tied
  or untied embeddings) with its MoE layers built from :class:`ModelConfig`;
* :mod:`~engine.compose.data`: the global batch of step k, the same sequences whatever the
  layout (``varlen``: packed documents, padding, a loss mask), and each rank's slice of it;
* :mod:`~engine.compose.loss`: the loss normalised by the global count of tokens;
* :mod:`~engine.compose.experts`: expert parallelism and its gradient rule;
* :mod:`~engine.compose.pipeline`: the pipeline split and the step through a schedule;
* :mod:`~engine.compose.usp`: 2D context parallelism (Ulysses inside, ring across) on the mesh;
* :mod:`~engine.compose.parallelize`: ``parallelize(model, mesh, plan)`` in a fixed order
  (TP + SP, CP, EP, PP, then the data-parallel wrapper: DDP, ZeRO-1/2 or ZeRO-3);
* :mod:`~engine.compose.state`: the whole parameters back from any layout, for comparing;
* :mod:`~engine.compose.resume`: what each rank of any layout saves to resume bit for bit;
* :mod:`~engine.compose.reshard`: those files joined offline into the whole model and its
  AdamW state, and cut for any other layout (``--resume --reshard``);
* :mod:`~engine.compose.loop`: the one training step and loop, with hooks;
* :mod:`~engine.compose.formulas`: the bytes each kind of group must carry, by formula;
* :mod:`~engine.compose.traffic`: bytes on the wire per kind of group, counted;
* :mod:`~engine.compose.parity`: the parity matrix, every layout against one process.
"""
