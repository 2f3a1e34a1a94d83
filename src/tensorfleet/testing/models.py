"""Small deterministic models for tests, built without touching torch's global RNG (tests use threads)."""

from __future__ import annotations

import torch
from torch import nn


def seeded_mlp(*sizes: int, activation: type[nn.Module] = nn.Tanh, seed: int = 0, scale: float = 0.5) -> nn.Module:
    """An MLP with layers ``sizes[0] -> ... -> sizes[-1]``, every parameter drawn from N(0, scale²) by ``seed``."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(fan_in, fan_out)] + ([activation()] if i < len(sizes) - 2 else [])
    model = nn.Sequential(*layers)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model
