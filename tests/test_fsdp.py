"""engine.fsdp: FSDP2's per-parameter sharding built from scratch, against one process and
against PyTorch's own fully_shard (CPU Gloo mesh), with and without a mixed-precision policy,
at 2 and 3 ranks, with parameters whose first dimension divides neither."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.fsdp import MixedPrecisionPolicy, full_state_dict, fully_shard, gather_full
from engine.labs.fsdp2 import side_by_side
from engine.model.gpt import GPTConfig, TinyGPT
from tests.helpers import run_ranks

pytestmark = pytest.mark.filterwarnings("error")

ROWS, STEPS = 12, 3  # the global batch: 6 or 4 rows a rank


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 13), nn.Linear(13, width)  # 13 rows: odd

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Net(nn.Module):
    """A root parameter of 7 rows, blocks of 13 and 10, an output of 5: 2 and 3 divide few."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(7))
        self.inp = nn.Linear(7, 10)
        self.blocks = nn.ModuleList(Block(10) for _ in range(2))
        self.out = nn.Linear(10, 5)

    def forward(self, x):
        h = self.inp(x * self.scale)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 5, generator=g)


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _train(model, x, y, opt_name):
    optimizer, losses = _optimizer(opt_name, model.parameters()), []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _one_process(opt_name="sgd"):
    model, (x, y) = Net(), _data()
    return _train(model, x, y, opt_name), {n: p.detach() for n, p in model.named_parameters()}


def _ours(rank, world_size, policy, opt_name="sgd", reshard=True):
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=MixedPrecisionPolicy(*policy))
    fully_shard(model, reshard_after_forward=reshard, mp_policy=MixedPrecisionPolicy(*policy))
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    losses = _train(model, x[mine], y[mine], opt_name)
    return losses, full_state_dict(model), shapes


def _torchs(rank, world_size, policy, opt_name="sgd"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, mp_policy=TorchPolicy(*policy))
    torch_fully_shard(model, mesh=mesh, mp_policy=TorchPolicy(*policy))
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    losses = _train(model, x[mine], y[mine], opt_name)
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def _both(rank, world_size, policy, opt_name):
    return _ours(rank, world_size, policy, opt_name), _torchs(rank, world_size, policy, opt_name)


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


FP32, BF16, BF16_FP32 = (None, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp32_equals_one_process_and_pytorchs_fully_shard(world_size):
    _, single = _one_process()
    for rank, ((_, ours, shapes), (_, torchs)) in enumerate(
            run_ranks(_both, world_size, FP32, "sgd")):
        to_single, to_torch = _worst(ours, single), _worst(ours, torchs)
        print(f"rank {rank}/{world_size}: |ours - one process| {to_single:.2e}, "
              f"|ours - PyTorch fully_shard| {to_torch:.2e}, bit-identical to one process: "
              f"{to_single == 0}")
        assert to_single <= 1e-6 and to_torch <= 1e-6
        # the local shards: ceil(rows / n) rows, the last rank's fewer (no padding inside)
        chunk = -(-7 // world_size)
        assert shapes["scale"] == (min(chunk, 7 - rank * chunk),)
        assert shapes["blocks.0.up.weight"][1:] == (10,)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("policy", [BF16, BF16_FP32], ids=["bf16", "bf16-reduce-fp32"])
def test_a_mixed_precision_policy_trains_as_pytorchs_does(world_size, policy):
    _, single = _one_process()
    for (ours_losses, ours, _), (torch_losses, torchs) in run_ranks(_both, world_size, policy,
                                                                   "sgd"):
        to_torch, to_fp32 = _worst(ours, torchs), _worst(ours, single)
        print(f"{policy}: |ours - PyTorch| {to_torch:.2e}, |ours - fp32| {to_fp32:.2e}")
        assert ours_losses == pytest.approx(torch_losses, rel=1e-6)
        assert all(t.dtype == torch.float32 for t in ours.values())  # fp32 masters
        if policy == BF16 and world_size == 3:
            # reduced in bf16 over 3 ranks, one element of one gradient (the root's `scale`)
            # rounds one bf16 ulp apart from PyTorch's. The reduce-scatter inputs are not laid
            # out alike within a rank's segment (measured); how that changes Gloo's order of
            # addition was not traced. Bounded by lr x momentum-sum x ulp
            assert to_torch <= 1e-4 and to_torch < to_fp32 / 10
            continue
        assert to_torch <= 1e-6 < to_fp32  # bf16 compute moved both the same way


def _grads_and_bytes(rank, world_size):
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x).float(), y).backward()
    grads = {n: (p.grad.dtype, p.grad.shape == p.shape) for n, p in model.named_parameters()}
    return grads, meter.by_op(), [(e.op, e.dtype) for e in meter.events]


def test_gradients_land_on_the_shards_and_the_collectives_are_counted():
    for grads, by_op, events in run_ranks(_grads_and_bytes, 2):
        assert all(dtype == torch.float32 and same for dtype, same in grads.values())
        # the root gathered once (kept through backward), each block twice (forward and
        # backward); one reduce-scatter per group
        assert by_op["all_gather"]["count"] == 1 + 2 * 2
        assert by_op["reduce_scatter"]["count"] == 1 + 2
        assert {d for op, d in events if op == "all_gather"} == {"torch.bfloat16"}
        assert {d for op, d in events if op == "reduce_scatter"} == {"torch.float32"}


def _no_reshard(rank, world_size):
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x), y).backward()
    return meter.by_op()["all_gather"]["count"]


def test_without_reshard_after_forward_nothing_is_gathered_twice():
    assert run_ranks(_no_reshard, 2) == [3, 3]


def test_adamw_steps_the_shards_as_one_process():
    _, single = _one_process("adamw")
    for (_, ours, _), (_, torchs) in run_ranks(_both, 2, FP32, "adamw"):
        assert _worst(ours, single) <= 1e-6 and _worst(ours, torchs) <= 1e-6


def _bad_input(rank, world_size):
    model = Net()
    fully_shard(model)
    with pytest.raises(ValueError, match="fully_shard\\(Net\\): this module is already sharded"):
        fully_shard(model)
    return True


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="param_dtype=torch.int8"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="reduce_dtype='bf16'"):
        MixedPrecisionPolicy(reduce_dtype="bf16")
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # a likely mix-up

    with pytest.raises(TypeError, match=r"mp_policy=MixedPrecisionPolicy\(param_dtype=torch."
                                        r"bfloat16.*expected an engine.fsdp.MixedPrecisionPolicy"):
        fully_shard(Net(), mp_policy=TorchPolicy(param_dtype=torch.bfloat16))
    assert run_ranks(_bad_input, 2) == [True, True]


GPT = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
PSI = 28_032  # the tiny GPT's parameters (the tied embedding once)
ROOT = 64 * 32 + 16 * 32 + 2 * 32  # tok (= head), pos, ln_f: gathered once, kept


def _padded(n: int, prefix: str) -> int:
    """Elements of the tiny GPT's parameters under ``prefix`` (``""``: the root's, outside
    the blocks), each padded by ``theory.dim0_padding_rows`` to a multiple of ``n`` rows."""
    total = 0
    for name, p in TinyGPT(GPT, seed=0).named_parameters():
        if name.startswith("blocks.") == (prefix == "blocks."):
            total += (p.shape[0] + theory.dim0_padding_rows(p.shape[0], n)) * p[0].numel()
    return total


def _three_sides(rank, world_size, cfg):
    return side_by_side(rank, world_size, cfg, sides=("ours", "torch", "zero3"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_tiny_gpt_as_pytorchs_fsdp2_and_beside_the_flat_bucket_zero3(world_size):
    n = world_size
    for index, rank in enumerate(run_ranks(_three_sides, n, GPT)):
        ours, torchs, zero3 = rank["ours"], rank["torch"], rank["zero3"]
        worst = _worst(ours.params, torchs.params)
        print(f"{n} ranks: |ours - PyTorch FSDP2| {worst:.2e}; bytes sent a step: ours "
              f"{ours.bytes_sent}, PyTorch {torchs.bytes_sent}, ZeRO-3 {zero3.bytes_sent}; "
              f"held: ours {ours.held.total}, PyTorch {torchs.held.total}, ZeRO-3 "
              f"{zero3.held.total}")
        assert ours.losses == pytest.approx(torchs.losses, rel=1e-6) and worst <= 1e-6
        # the same collectives as PyTorch's and the same bytes held: the tied embedding is
        # one parameter, sharded once
        assert ours.calls == torchs.calls == {"all_gather": 1 + 2 * GPT.layers,
                                              "reduce_scatter": 1 + GPT.layers}
        assert ours.held.optimizer == torchs.held.optimizer
        # our gradients are copies of the shards' rows, unpadded as the shards (issue 42: they
        # were views of the padded reduce-scatter buffer, 38,080 B on rank 2 of 3, not 35,968)
        assert ours.held.grads == ours.held.params
        if n == 2:
            assert ours.held == torchs.held  # no dimension to pad: the flat buckets' bytes exactly
            assert ours.bytes_sent == torchs.bytes_sent == zero3.bytes_sent == \
                round((theory.zero_comm_elements(PSI, n, 3) - (n - 1) / n * ROOT) * 4)
            zero3_held = theory.zero_model_state_bytes(PSI, n, 3, k=8, param_bytes=4,
                                                       grad_bytes=4)
            assert (ours.held.params, ours.held.grads) == (zero3_held["params"],
                                                           zero3_held["grads"])
            # AdamW's step counters besides: one 4-byte scalar per parameter
            assert ours.held.optimizer == zero3_held["optimizer"] + 4 * len(ours.params)
        # every collective carries each parameter padded to ceil(rows / n) rows a rank: the
        # blocks gathered twice (forward, backward) and reduce-scattered, the root once each
        assert ours.bytes_sent == round(4 * (n - 1) / n * (3 * _padded(n, "blocks.")
                                                           + 2 * _padded(n, "")))
        if n == 3:  # padded rows travel too (64 / 3, 16 / 3, 96 / 3 ... round up), and PyTorch's
            # last rank's local shards are views of padded storage: ours keep no padding
            assert ours.bytes_sent == torchs.bytes_sent > zero3.bytes_sent
            last = index == n - 1
            if last:
                assert ours.held.params < torchs.held.params
                assert ours.held.grads < torchs.held.grads
            else:
                assert ours.held == torchs.held


def _memory_and_accumulation(rank, world_size):
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    half = (mine.stop - mine.start) // 2
    loss = nn.functional.mse_loss(model(x[mine][:half]), y[mine][:half]) / 2
    freed = [t.untyped_storage().nbytes() for b in model.blocks for t in b.fsdp_state.last.tensors]
    kept = [t.untyped_storage().nbytes() for t in model.fsdp_state.last.tensors]
    loss.backward()
    after = [t.untyped_storage().nbytes() for t in model.fsdp_state.last.tensors]
    (nn.functional.mse_loss(model(x[mine][half:]), y[mine][half:]) / 2).backward()
    return freed, kept, after, full_grads(model)


def full_grads(model):
    return {n: gather_full(p, tensor=p.grad) for n, p in model.named_parameters()}


def test_blocks_free_their_gathered_parameters_and_gradients_accumulate_on_the_shards():
    reference, (x, y) = Net(), _data()
    for rows in (slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)):  # the same micro-batches
        (nn.functional.mse_loss(reference(x[rows]), y[rows]) / 2 / 2).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for freed, kept, after, grads in run_ranks(_memory_and_accumulation, 2):
        assert set(freed) == {0} and min(kept) > 0  # blocks resharded, the root kept
        assert set(after) == {0}  # freed once backward is through
        assert _worst(grads, expected) <= 1e-6


def _empty_root_net():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5))


def _empty_root(rank, world_size):
    model, (x, y) = _empty_root_net(), _data()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)  # nothing left for the root: no gathers, no reduce-scatters
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    roots = [m.fsdp_state.is_root for m in (model, model[0], model[2])]
    freed = [t.untyped_storage().nbytes() for t in model[0].fsdp_state.last.tensors]
    return ([tuple(p.grad.shape) for p in model.parameters()], full_grads(model), roots,
            meter.by_op()["all_gather"]["count"], freed)


def test_a_root_with_no_parameters_of_its_own():
    assert run_ranks(_empty_root, 2)[1][0] == [(4, 7), (4,), (2, 9), (2,)]
    reference, (x, y) = _empty_root_net(), _data()
    nn.functional.mse_loss(reference(x), y).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for _, grads, roots, gathers, freed in run_ranks(_empty_root, 2):
        # the empty root is the root (found at its first forward); the linears are not, so
        # they free their parameters after forward and gather them again for backward
        assert roots == [True, False, False] and gathers == 2 * 2 and set(freed) == {0}
        # a mean over 6 rows a rank then over 2 ranks, against a mean over 12: 1e-6 bounds it
        assert _worst(grads, expected) <= 1e-6


def _order(rank, world_size):
    model = _empty_root_net()
    fully_shard(model)
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): its parameters \['weight', "
                                         r"'bias'\] are already sharded"):
        fully_shard(model[0])  # the root first, a child after: refused, as PyTorch does
    model, (x, _) = _empty_root_net(), _data()
    fully_shard(model[0])
    fully_shard(model)
    model[0](x)  # a child's forward first: it becomes a root ...
    with pytest.raises(RuntimeError, match="'0' \\(Linear\\) already ran forward as a root"):
        model(x)  # ... and the model's first forward then finds it, as PyTorch's does
    return True


def test_the_root_is_found_at_the_first_forward_and_children_are_sharded_first():
    assert run_ranks(_order, 2) == [True, True]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_gradients_are_divided_around_the_sum_as_pytorchs(world_size):
    from engine.fsdp.comm import divide_before

    assert [divide_before(n) for n in (1, 2, 3, 4, 8, 16)] == [1, 2, 2, 2, 4, 4]
    for (losses, ours, _), (torch_losses, torchs) in run_ranks(
            _both, world_size, (torch.float16, None), "sgd"):
        print(f"fp16 at {world_size} ranks: |ours - PyTorch| {_worst(ours, torchs):.2e}")
        assert losses == pytest.approx(torch_losses, rel=1e-6)
        # at 3 ranks one element of the root's `scale` gradient rounds one 16-bit ulp apart,
        # as in bf16 (test_a_mixed_precision_policy_trains_as_pytorchs_does)
        assert _worst(ours, torchs) == 0.0 if world_size == 2 else _worst(ours, torchs) <= 1e-4


class DictBlock(nn.Module):
    """A block whose output is a dict: its parameters must survive until backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.up = nn.Linear(7, 13)

    def forward(self, x):
        return {"h": torch.tanh(self.up(x)), "note": "not a tensor"}


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = DictBlock()
        torch.manual_seed(4)
        self.inp, self.out = nn.Linear(7, 7), nn.Linear(13, 5)

    def forward(self, x):  # inp first: backward needs the block's weight for inp's gradient
        return self.out(self.block(self.inp(x))["h"])


def _dict_net():
    return DictNet()


def _dict_grads(model, x, y):
    nn.functional.mse_loss(model(x), y).backward()


def _dict_output_on_rank(rank, world_size):
    model, (x, y) = _dict_net(), _data()
    fully_shard(model.block)
    fully_shard(model)
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    _dict_grads(model, x[mine], y[mine])
    return {n: p.grad.clone() for n, p in model.named_parameters()}, \
        {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_a_block_that_returns_a_dict_keeps_its_parameters_for_backward():
    """The tensors of any output, however nested, tell the block a backward will come (a
    dict's were missed: its gathered storage was freed, and backward failed)."""
    reference, (x, y) = _dict_net(), _data()
    _dict_grads(reference, x, y)
    results = run_ranks(_dict_output_on_rank, 2)
    for name, p in reference.named_parameters():
        shards = [grads[name] for grads, _ in results]
        whole = torch.cat(shards)[: p.shape[0]]  # dim-0 shards, the last one padded or short
        assert (whole - p.grad).abs().max().item() <= 1e-6, name


def _watched_blocks():
    """The sharded Net, its data, and the list each block's gather (+) and free (-) is told
    to, in order."""
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    names = {id(b.fsdp_state): f"block{i}" for i, b in enumerate(model.blocks)}
    seen = []
    for block in model.blocks:
        block.fsdp_state.observer = lambda group, nbytes: seen.append(
            (names[id(group)], "+" if nbytes > 0 else "-"))
    return model, (x, y), seen


def _gathers_in_order(rank, world_size):
    model, (x, y), seen = _watched_blocks()
    landed = []
    model.blocks[0].up.register_full_backward_hook(  # block 0's backward, block 1's done
        lambda *a: landed.append(all(p.grad is None for p in model.blocks[1].parameters())))
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    loss = nn.functional.mse_loss(model(x[mine]), y[mine])
    forward = list(seen)
    seen.clear()
    loss.backward()
    return forward, seen, landed, all(p.grad is not None for p in model.parameters())


def test_backward_prefetches_the_next_group_and_gradients_land_when_backward_ends():
    """Backward reaches block 1 and gathers it; block 0's backward comes next, so its gather
    starts then (FSDP's backward prefetch), before block 1 is freed: two blocks whole at
    once, never three. Block 1's reduce-scatter travels while block 0 computes: its shards'
    gradients land when the backward ends, not before."""
    for forward, backward, landed, every_grad in run_ranks(_gathers_in_order, 2):
        assert forward == [("block0", "+"), ("block0", "-"), ("block1", "+"), ("block1", "-")]
        assert backward == [("block1", "+"), ("block0", "+"), ("block1", "-"),
                            ("block0", "-")]
        assert landed == [True] and every_grad


def _after_a_failed_backward(rank, world_size, fail):
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    mine = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    if fail:  # block 1's reduce-scatter is in flight when block 0's backward raises
        def boom(*args):
            raise RuntimeError("a backward that raises")
        handle = model.blocks[0].up.register_full_backward_hook(boom)
        try:
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        except RuntimeError:
            pass
        handle.remove()
        for p in model.parameters():
            p.grad = None
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    return full_grads(model)


def test_a_backward_that_raised_leaves_no_gradient_to_the_next_step():
    clean, after = (run_ranks(_after_a_failed_backward, 2, fail)[0] for fail in (False, True))
    assert _worst(clean, after) == 0


def _shards_given_new_storage(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))  # rows even over 2
    fully_shard(model[0])
    fully_shard(model)
    even = model[0].fsdp_state.columns.holds_the_shards()
    for p in model.parameters():  # as a module.to(...) that converts does: new storage
        p.data = p.data.clone() + 1.0
    expected = gather_full(model[0].weight)
    seen = []
    model[0].register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    model(torch.ones(2, 8))
    return even, torch.allclose(seen[0], torch.ones(2, 8) @ expected.T + gather_full(
        model[0].bias))


def test_shards_given_new_storage_are_gathered_as_they_are_now():
    """An even group's shards live in one buffer the all-gather sends as it is; shards that
    were given storage of their own since are copied in instead, never the stale buffer."""
    assert run_ranks(_shards_given_new_storage, 2) == [(True, True), (True, True)]


def _gathered_alive_after_steps(rank, world_size):
    import gc
    import weakref

    from engine.fsdp import gathered as gathered_module
    made = []
    real_init = gathered_module.Gathered.__init__

    def counted(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    gathered_module.Gathered.__init__ = counted
    try:
        _train(model, x, y, "sgd")
    finally:
        gathered_module.Gathered.__init__ = real_init
    gc.collect()
    return len(made), sum(ref() is not None for ref in made)


def test_a_forwards_gathered_tensors_are_not_kept_after_its_backward():
    """Each forward makes one ``Gathered`` a group; once its backward is through, only the
    group's ``last`` may keep it. (Unshard returning the tensors the Gathered holds made a
    cycle through their autograd node that the collector cannot see: every one lived on.)"""
    made, alive = run_ranks(_gathered_alive_after_steps, 2)[0]
    assert made == 3 * STEPS  # the root and two blocks, each step
    assert alive == 3  # each group's last


def _two_forwards_seen(rank, world_size):
    model, (x, y), seen = _watched_blocks()
    forwards = []
    for _ in range(2):
        loss = nn.functional.mse_loss(model(x), y)
        forwards.append(list(seen))
        loss.backward()
        seen.clear()
    return forwards


def test_a_forward_prefetches_the_group_the_last_forward_ran_next():
    """The first forward knows no order: each block is gathered as it starts. The second
    starts block 1's gather once block 0 is gathered, so it travels while block 0 computes
    (FSDP1's forward_prefetch): two blocks whole at once, as in backward, never three."""
    for first, second in run_ranks(_two_forwards_seen, 2):
        assert first == [("block0", "+"), ("block0", "-"), ("block1", "+"), ("block1", "-")]
        assert second == [("block0", "+"), ("block1", "+"), ("block0", "-"), ("block1", "-")]


def _after_a_forward_that_raised(rank, world_size):
    model, (x, y) = Net(), _data()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    nn.functional.mse_loss(model(x), y).backward()  # the order: block 0, then block 1
    fail = model.blocks[0].up.register_forward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x)  # block 1's gather started early, and no forward takes it
    fail.remove()
    with torch.no_grad():  # a step: the values that gather carried are stale now
        for p in model.parameters():
            p.add_(1.0)
    reference = Net()
    reference.load_state_dict(full_state_dict(model))
    return torch.equal(model(x), reference(x))


def test_a_prefetch_no_forward_took_is_dropped_not_used_later():
    """A forward that raised in block 0 leaves the shards in every slot (the post-forward hook
    runs anyway) and the gather it started early for block 1 is dropped when the next forward
    starts: after a step, that forward computes with the new values, not the stale ones."""
    assert run_ranks(_after_a_forward_that_raised, 2) == [True, True]
