"""Model size, compute and training time at scale, against the Megatron-LM (SC 2021) paper."""

from __future__ import annotations

import pytest

from engine import theory

# Narayanan et al., SC 2021, Table 1: (attention heads, hidden size, layers) -> parameters in
# billions, with V = 51,200 and s = 2,048. The paper prints one decimal.
MEGATRON_TABLE_1 = {
    (24, 2304, 24): 1.7, (32, 3072, 30): 3.6, (32, 4096, 36): 7.5, (48, 6144, 40): 18.4,
    (64, 8192, 48): 39.1, (80, 10240, 60): 76.1, (96, 12288, 80): 145.6,
    (128, 16384, 96): 310.1, (128, 20480, 105): 529.6, (160, 25600, 128): 1008.0,
}


@pytest.mark.parametrize("heads, hidden, layers", sorted(MEGATRON_TABLE_1))
def test_parameter_counts_of_megatron_table_1(heads, hidden, layers):
    billions = theory.transformer_params(layers, hidden) / 1e9
    assert round(billions, 1) == MEGATRON_TABLE_1[heads, hidden, layers]


def test_gpt3_has_174_6_billion_parameters_and_trains_in_34_days():
    params = theory.transformer_params(96, 12288)
    assert round(params / 1e9, 1) == 174.6
    days = theory.training_days(300e9, 175e9, 1024, 140e12)
    assert days == pytest.approx(33.9, abs=0.05)  # the paper: "about 34 days"


def test_flops_per_step_are_about_six_or_eight_times_params_times_tokens():
    # the closed form: 96 B s l h^2 (...) ~ 8 * params * tokens when h is large
    params = theory.transformer_params(96, 12288)
    tokens = 1536 * 2048
    with_recompute = theory.transformer_flops(1536, 2048, 96, 12288)
    without = theory.transformer_flops(1536, 2048, 96, 12288, recompute=False)
    assert with_recompute / (params * tokens) == pytest.approx(8, rel=0.03)
    assert without / with_recompute == pytest.approx(72 / 96)


def test_activation_formula_with_tp_reduces_to_equation_one_at_t_1():
    s, b, h, a = 2048, 1, 12288, 96
    assert theory.tp_activation_bytes_per_layer(s, b, h, a, 1) == s * b * h * (34 + 5 * a * s / h)
    assert theory.tp_activation_bytes_per_layer(s, b, h, a, 8, recompute=True) == 2 * s * b * h
