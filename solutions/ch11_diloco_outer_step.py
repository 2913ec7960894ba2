"""Solution of ch11.diloco_outer_step: DiLoCo's outer Nesterov step (Douillard et al., 2023,
Algorithm 1), torch.optim.SGD's update written out."""

import torch


def outer_step(start, ends, outer_lr, momentum, buffer, nesterov=True):
    delta = start - torch.stack(list(ends)).mean(dim=0)  # the pseudo-gradient: start - end
    new_buffer = momentum * buffer + delta
    update = delta + momentum * new_buffer if nesterov else new_buffer
    return start - outer_lr * update, new_buffer
