"""Which device a rank computes on, and in which dtype.

Nothing here touches an accelerator's API unless the device is one; the
launcher asks a short-lived child process about the GPUs (``gpu_facts``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; others as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


BF16_CAPABILITY = (8, 0)  # CUDA's bfloat16 arithmetic starts with Ampere
BF16_NCCL = (2, 10)  # the first NCCL that carries bfloat16


def resolve_dtype(dtype: str, device: str, bf16_ready) -> str:
    """``auto`` -> ``bf16`` (bf16 compute, fp32 master weights) on CUDA when
    ``bf16_ready()`` (``takes_bf16`` of the job's GPUs), else ``fp32``; others as
    given. ``bf16_ready`` is asked only for ``auto`` on CUDA."""
    if dtype != "auto":
        return dtype
    return "bf16" if device == "cuda" and bf16_ready() else "fp32"


def takes_bf16(capabilities, nccl) -> bool:
    """Whether GPUs of these compute capabilities, with this NCCL version (None:
    no NCCL), compute in bfloat16 and carry it between ranks."""
    return all(tuple(c) >= BF16_CAPABILITY for c in capabilities) and (
        nccl is None or tuple(nccl) >= BF16_NCCL
    )


_GPU_FACTS = """
import json, torch
gpus = [{"name": torch.cuda.get_device_name(i), "capability": torch.cuda.get_device_capability(i)}
        for i in range(torch.cuda.device_count())]
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
print(json.dumps({"gpus": gpus, "nccl": nccl}))
"""


def gpu_facts() -> dict:
    """The visible GPUs (name, compute capability) and the NCCL version, asked of a
    short-lived child process: the launching process creates no CUDA context, so
    every rank gets its whole GPU (a context holds memory on the device it is on)."""
    out = subprocess.run(
        [sys.executable, "-c", _GPU_FACTS], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise ValueError(f"cannot query the GPUs: {out.stderr.strip().splitlines()[-1:]}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    facts["nccl"] = tuple(facts["nccl"]) if facts["nccl"] else None
    return facts


def rank_device(kind: str) -> torch.device:
    """The device this rank computes on: the CPU, or for ``cuda`` its local rank's GPU.

    ``LOCAL_RANK`` indexes the GPUs this process sees (already renumbered by
    ``CUDA_VISIBLE_DEVICES``); a process that sees one GPU uses it whatever its local rank.
    """
    if kind != "cuda":
        return torch.device(kind)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but this process sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}); "
            "start at most one rank per visible GPU on each node"
        )
    return torch.device("cuda", local_rank)
