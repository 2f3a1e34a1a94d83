"""Small deterministic models for tests, built without touching torch's global RNG (tests use threads)."""

from __future__ import annotations

import threading
from typing import Any, Callable

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


def sgd_on_union_batches(model: nn.Module, batch_for: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], *,
                         num_workers: int, steps: int, lr: float) -> nn.Module:
    """What ``num_workers`` synchronous workers must end at: one process doing SGD (cross entropy) on the
    union of their batches, ``batch_for(step, worker)``, each step. Trains and returns ``model``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        batches = [batch_for(step, worker) for worker in range(num_workers)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def run_workers(num_workers: int, body: Callable[[int], Any], *, timeout_s: float = 60.0) -> list:
    """Run ``body(index)`` in one thread per worker; re-raise the first error; return their results."""
    results, errors = [None] * num_workers, []

    def target(index):
        try:
            results[index] = body(index)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]
    return results
