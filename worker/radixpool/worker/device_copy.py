"""Host values to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch then waits for
everything already queued on the stream: a step that builds its inputs that way cannot be
launched while the previous step still runs, which is the point of the overlapped loop
(`engine_core.py`). From page-locked memory the copy is queued like a kernel, in stream order,
and PyTorch's pinned-memory cache keeps the buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[bool] | torch.Tensor, dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """`values` (a host list or host tensor) as a tensor on `device`, queued, not awaited."""
    host = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or host.numel() == 0:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
