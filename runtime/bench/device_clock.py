"""Wall-clock timing of device work for the micro-benchmarks: the device is synchronized before reading the clock,
so queued CUDA / MPS kernels are counted where they ran (a no-op on the CPU)."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def ms_since(start: float, device: torch.device) -> float:
    sync(device)
    return (time.perf_counter() - start) * 1e3
