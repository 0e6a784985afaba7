"""Device and dtype selection: CUDA with bf16 where it exists, else CPU with float32; the CPU allocator."""

from __future__ import annotations

import os
import sys

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def select_device(device: str | torch.device | None = None) -> torch.device:
    """The device asked for; "auto" -> CUDA if any, else the CPU. A bare "cuda" means THIS rank's GPU
    under a launcher (`local_cuda_device`): eight ranks of `accelerate launch` load onto eight GPUs."""
    if device is not None and str(device) != "auto":
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            return local_cuda_device(os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
        return d
    if torch.cuda.is_available():
        return local_cuda_device(os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
    return torch.device("cpu")


def local_cuda_device(local_rank: str | int | None, count: int) -> torch.device:
    """`cuda:LOCAL_RANK` under a launcher (torchrun / accelerate launch set LOCAL_RANK), plain "cuda" (the
    current device) without one. More ranks on a node than GPUs is an error, not a silent pile-up."""
    if local_rank is None or str(local_rank).strip() in ("", "-1"):
        return torch.device("cuda")
    rank = int(local_rank)
    if count and rank >= count:
        from draftsmith.errors import ConfigError

        raise ConfigError(f"LOCAL_RANK={rank} but this node has {count} CUDA device(s): launch at most "
                          f"{count} processes per node (accelerate launch --num_processes)")
    return torch.device("cuda", rank)


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


# mallopt(3) parameters (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def release_memory() -> bool:
    """Hand the memory a finished stage freed back to the system (glibc `malloc_trim`): with the allocator tuned
    as below, freed blocks otherwise stay resident until the process ends, and a later stage's peak stacks on
    an earlier one's leftovers. Returns whether anything could be asked of the allocator."""
    import gc

    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def tune_cpu_allocator() -> bool:
    """Keep freed memory inside the process (glibc): no mmap per large block, no trimming, 1 GB growth steps.

    A CPU training step allocates and frees tensors of tens of MB (activations, logits, gradients). glibc
    serves each with a fresh mmap and returns it on free, so every step zero-fills its pages again in the
    kernel, and a CPU training step spends a large share of its time in system calls and page faults. With
    mmap off, the trim threshold at its maximum and a 1 GB top pad, freed blocks are reused and the steps run
    faster (measured in BENCHMARKS.md). The price is an RSS that stays at its peak until the process ends.
    Called by every `draftsmith` command and script; DRAFTSMITH_MALLOC=0 leaves the allocator alone, and a
    MALLOC_*_ variable set by the user wins (glibc reads those at start). Returns whether it changed anything.
    """
    if os.environ.get("DRAFTSMITH_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or os.environ.get("GLIBC_TUNABLES"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(_M_TOP_PAD, 1 << 30))
