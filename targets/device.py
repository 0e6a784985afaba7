"""Device and dtype selection: CUDA with bf16 where it exists, else CPU with float32."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def select_device(device: str | torch.device | None = None) -> torch.device:
    if device is not None and str(device) != "auto":
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def select_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None and dtype != "auto":
        if dtype not in _DTYPES:
            from draftsmith.errors import ConfigError

            raise ConfigError(f"unknown dtype '{dtype}' (use one of {', '.join(_DTYPES)})")
        return _DTYPES[dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
