"""Reference for exercise ch12.loss_scaler (the engine's version is
engine/precision/loss_scaler.py, DynamicLossScaler.update)."""

import torch

_FP32_MAX = torch.finfo(torch.float32).max


def update_scale(scale, clean_steps, found_inf, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0, True
    clean_steps += 1
    if clean_steps == growth_interval:
        if scale * growth_factor <= _FP32_MAX:
            scale = scale * growth_factor
        clean_steps = 0
    return scale, clean_steps, False
