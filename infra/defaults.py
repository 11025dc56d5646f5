"""Defaults and limits every process agrees on, written once (services, gateway, `tandem serve`, benchmarks)."""
from __future__ import annotations

NUM_SPECULATIVE_TOKENS = 3      # K: draft tokens per round unless asked otherwise (0: plain decoding)
MAX_NUM_BATCHED_TOKENS = 2048   # prompt positions a gateway step prefills (gateway/chunking.py); 0: whole
MAX_DRAFT_TOKENS = 16           # the most a request may ask for (services: --max-draft-tokens)
MAX_MODEL_LEN = 4096            # positions a request may hold (target, draft, `tandem serve`; at most the model's)

# How hidden rows travel between target and draft. auto is settled by both sides from their devices
# (services/bridge/transport.py): NCCL between two GPUs, CUDA IPC on one GPU, gloo on the CPU;
# inline sends them in the gRPC messages (no bridge at all).
BRIDGE_TRANSPORTS = ("auto", "gloo", "nccl", "ipc")
HIDDEN_TRANSPORTS = BRIDGE_TRANSPORTS + ("inline",)


def transport_misfit(want: str, cuda: bool, same_gpu: bool, same_process: bool = False) -> str | None:
    """Why the devices cannot carry an explicitly asked transport (None: they can, or `want` is auto/gloo/inline)."""
    if want == "nccl" and (not cuda or same_gpu):
        return ("the nccl hidden transport needs target and draft on two different GPUs (NCCL refuses two ranks "
                "on one GPU; use auto or ipc there)")
    if want == "ipc" and (not cuda or not same_gpu or same_process):
        return ("the ipc hidden transport needs target and draft on the same GPU in two processes (use auto or "
                "nccl across GPUs)")
    return None
