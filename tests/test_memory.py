"""engine.observe.memory: model-state bytes by unique storage, and the activation tracker."""

from __future__ import annotations

import pytest
import torch

from engine.observe.memory import (ActivationTracker, StateTensors, model_state_bytes,
                           unique_storage_bytes)
from engine.model.mlp import MLP
from engine.model.gpt import GPTConfig, TinyGPT


def _one_adam_step(model, **kwargs):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kwargs)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return opt


def test_fp32_adam_is_4_4_8_bytes_per_parameter_plus_step_counters():
    model = MLP((16, 64, 64, 8))
    psi = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    opt = _one_adam_step(model)
    got = model_state_bytes(model, opt)
    assert got.params == 4 * psi
    assert got.grads == 4 * psi
    assert got.optimizer == 8 * psi + 4 * n_tensors  # exp_avg, exp_avg_sq; a float32 step each
    assert got.total == got.params + got.grads + got.optimizer
    assert got.memory_allocated is None  # a CPU model


def test_before_the_first_step_there_are_no_grads_or_optimizer_state():
    model = MLP((16, 8))
    opt = torch.optim.Adam(model.parameters())
    got = model_state_bytes(model, opt)
    assert (got.grads, got.optimizer) == (0, 0)
    assert got.params == 4 * (16 * 8 + 8)


def test_sgd_without_momentum_keeps_no_state_and_half_precision_halves_params():
    model = MLP((16, 32, 8)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 16, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    psi = sum(p.numel() for p in model.parameters())
    got = model_state_bytes(model, opt)
    assert (got.params, got.grads, got.optimizer) == (2 * psi, 2 * psi, 0)


def test_tied_weights_and_views_are_counted_once():
    model = TinyGPT(GPTConfig(vocab=50, seq_len=8, layers=1, heads=2, hidden=16))
    unique = {p.data_ptr(): p for p in model.parameters()}  # parameters() already dedups ties
    assert model.head.weight is model.tok.weight
    assert model_state_bytes(model).params == sum(4 * p.numel() for p in unique.values())

    flat = torch.zeros(100)
    views = [flat[:30], flat[30:], flat.view(10, 10)]
    assert unique_storage_bytes(views) == 400


def test_shared_storage_between_fields_counts_once_in_total():
    model = torch.nn.Linear(4, 4, bias=False)
    model.weight.grad = model.weight.detach()  # contrived: grad aliases the weight's memory
    got = model_state_bytes(model)
    assert (got.params, got.grads, got.total) == (64, 64, 64)


def test_activation_tracker_counts_saved_tensors_once_and_skips_parameters():
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    with ActivationTracker(exclude=[w]) as acts:
        h = x @ w  # saves x (and w, excluded)
        y = h.exp()  # saves its output, a new 8x32 tensor
        z = y * y  # saves y (already counted)
    assert acts.bytes == 2 * 8 * 32 * 4
    z.sum().backward()  # the graph still works with the hooks applied


def _tracked(module, inputs, precision):
    with ActivationTracker(exclude=module.parameters()) as acts:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = module(*inputs)
    out.float().sum().backward()  # the graph still works with the hooks applied
    return acts


def test_autocasts_copies_of_the_weights_are_not_activations():
    """A Linear(256, 256) on 4 rows: in fp32 autograd keeps the input (4,096 B); under bf16
    autocast it keeps the input's bf16 copy (2,048 B) and the weight's bf16 copy, which is the
    parameter in another dtype (131,072 B, in cast_bytes), not an activation. Before, the
    tracker counted 133,120 B of activations in bf16."""
    linear = torch.nn.Linear(256, 256)
    x = torch.randn(4, 256, requires_grad=True)
    fp32, bf16 = (_tracked(linear, [x], precision) for precision in ("fp32", "bf16"))
    assert (fp32.bytes, fp32.count, fp32.cast_bytes) == (4 * 256 * 4, 1, 0)
    assert (bf16.bytes, bf16.count, bf16.cast_bytes) == (4 * 256 * 2, 1, 256 * 256 * 2)


def test_a_gpt_under_autocast_casts_each_matmul_weight_once():
    cfg = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
    model = TinyGPT(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab, (3, cfg.seq_len))
    fp32, bf16 = (_tracked(model, [tokens], precision) for precision in ("fp32", "bf16"))
    matmul_weights = [p for name, p in model.named_parameters()  # the head is tok, tied
                      if p.dim() == 2 and not name.startswith("pos.")]
    assert bf16.cast_bytes == sum(2 * p.numel() for p in matmul_weights)
    assert fp32.cast_bytes == 0 and bf16.bytes < fp32.bytes
    assert bf16.count == fp32.count  # the same tensors saved, some in bf16


@pytest.mark.gpu
def test_cuda_reports_allocator_numbers():
    model = MLP((16, 8)).cuda()
    got = model_state_bytes(model)
    assert got.memory_allocated is not None and got.memory_allocated >= got.params
    assert got.max_memory_allocated >= got.memory_allocated


def test_any_object_with_state_tensors_is_counted_through_the_protocol():
    class Holder:  # a strategy of one's own
        def state_tensors(self):
            return StateTensors(params=[torch.zeros(10)], buffers=[torch.zeros(5)],
                                offloaded=[torch.zeros(3)])

    got = model_state_bytes(Holder())
    # total is what is on the device: host-offloaded bytes are reported apart
    assert (got.params, got.grads, got.buffers, got.offloaded, got.total) == (40, 0, 20, 12, 60)


def test_tensors_on_the_meta_device_are_counted_each_storage_once():
    """A dry run's model lives on the meta device: no memory, but its storages' sizes."""
    from engine.observe.memory import unique_storage_bytes

    with torch.device("meta"):
        model = torch.nn.Linear(8, 4)
    params = list(model.parameters())
    assert unique_storage_bytes(params + [params[0][1:]]) == (8 * 4 + 4) * 4  # a view: once
    assert model_state_bytes(model).params == (8 * 4 + 4) * 4
