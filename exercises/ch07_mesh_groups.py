"""Exercise ch07.mesh_groups: which ranks form each data-, tensor- and pipeline-parallel group.

``Mesh(dp=, tp=, pp=)`` numbers the ``dp x tp x pp`` ranks with tensor parallelism fastest,
then data parallelism, then pipeline stages (Megatron-LM's order; Narayanan et al., SC 2021,
section 3.3):

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index

so the ranks of a tensor-parallel group are consecutive, on one node's NVLink.

Fill in ``mesh_groups``, save, then run ``check("ch07.mesh_groups")`` in
course/07_3d_parallelism.ipynb (or ``make grade``). It is checked on layouts you do not see
against the groups that ``engine.topology.Mesh`` builds.
"""


def mesh_groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """``{"tp": [...], "dp": [...], "pp": [...]}``: for each kind, every group of that kind,
    each a list of global ranks in increasing order (for ``pp``, that is stage order).

    A tensor-parallel group is the ``tp`` ranks that share a (dp index, pp index); a
    data-parallel group the ``dp`` ranks that share a (tp index, pp index); a pipeline group
    the ``pp`` ranks that share a (dp index, tp index). Every rank is in exactly one group of
    each kind. Example, dp = tp = pp = 2: tp groups [0, 1], [2, 3], [4, 5], [6, 7]."""
    raise NotImplementedError("ch07.mesh_groups: write me")
