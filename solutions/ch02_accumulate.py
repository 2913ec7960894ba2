"""Reference for exercise ch02.accumulate."""

from torch import nn


def accumulation_step(model, optimizer, micro_batches, loss_fn=nn.functional.mse_loss):
    """One optimizer step over k micro-batches; only the last backward synchronises."""
    optimizer.zero_grad()
    k, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        loss = loss_fn(model(x), y) / k  # the mean over micro-batches, not the sum
        if i < k - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
