"""Which transport a bridge uses, from both sides' request and device: one pure function, so target and
draft compute the same answer from the same two records (and both fail naming both when they cannot)."""
from __future__ import annotations

import os
import platform
import socket

import torch

from infra.defaults import BRIDGE_TRANSPORTS, transport_misfit
from services.bridge.ipc import device_uuid
from services.bridge.shm import shm_identity

TRANSPORTS = BRIDGE_TRANSPORTS                  # what a side may ask for (inline: no channel at all)


class TransportError(RuntimeError):
    """Target and draft cannot agree on a transport for their devices."""


def endpoint(requested: str, device) -> dict:
    """This side's record for `choose_transport`: the same GPU has the same UUID in every process."""
    device = torch.device(device)
    return {"requested": requested, "device": str(device), "uuid": device_uuid(device),
            "process": f"{socket.gethostname()}:{os.getpid()}", "shm": shm_identity(),
            "tso": platform.machine().lower() in ("x86_64", "amd64")}


def choose_transport(sender: dict, receiver: dict) -> str:
    """Both sides' `endpoint` records -> gloo | nccl | ipc | shm; TransportError naming both sides.

    auto: NCCL between two GPUs, CUDA IPC on one GPU, shm between two CPU processes that share /dev/shm
    on x86-64 (shm.py: its slot check needs total store order), gloo otherwise (a CPU side elsewhere, or
    both ends in one process). An explicit choice on one side wins over auto on the
    other; two different explicit choices are an error, as is one the devices cannot carry."""
    s, r = sender["requested"], receiver["requested"]
    both = (f"target --hidden-transport {s} on {sender['device']} (GPU {sender['uuid'] or '-'}), "
            f"draft --hidden-transport {r} on {receiver['device']} (GPU {receiver['uuid'] or '-'})")
    for side, v in (("target", s), ("draft", r)):
        if v not in TRANSPORTS:
            raise TransportError(f"{side} asks for hidden transport {v!r}, expected one of {list(TRANSPORTS)}")
    if "auto" not in (s, r) and s != r:
        raise TransportError(f"target and draft ask for different hidden-row transports: {both}")
    want = r if s == "auto" else s
    cuda = sender["device"].startswith("cuda") and receiver["device"].startswith("cuda")
    same_gpu = cuda and bool(sender["uuid"]) and sender["uuid"] == receiver["uuid"]
    same_process = sender["process"] == receiver["process"]
    cpu = not sender["device"].startswith("cuda") and not receiver["device"].startswith("cuda")
    same_shm = bool(sender.get("shm")) and sender.get("shm") == receiver.get("shm")
    if want == "auto":
        if cpu:
            return "shm" if same_shm and not same_process and sender.get("tso") and receiver.get("tso") else "gloo"
        return "gloo" if not cuda or (same_gpu and same_process) else "ipc" if same_gpu else "nccl"
    misfit = transport_misfit(want, cuda, same_gpu, same_process, cpu, same_shm)
    if misfit:
        raise TransportError(f"{misfit}: {both}")
    return want
