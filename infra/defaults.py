"""Defaults and limits every process agrees on, written once (services, gateway, `tandem serve`, benchmarks)."""
from __future__ import annotations

NUM_SPECULATIVE_TOKENS = 3      # K: draft tokens per round unless asked otherwise (0: plain decoding)
MAX_NUM_BATCHED_TOKENS = 2048   # prompt positions a gateway step prefills (gateway/chunking.py); 0: whole
MAX_DRAFT_TOKENS = 16           # the most a request may ask for (services: --max-draft-tokens)
DRAFT_Q_MASS = 0.99             # a sampled draft samples from its distribution's top tokens of this mass
DRAFT_Q_WIDTH = 1024            # (at most this many) and sends only those: kernels/noise.py top_mass
# `tandem serve` starts each child with this set to "1": it ends when the supervisor dies (even by SIGKILL), and
# the terminal's Ctrl-C is the supervisor's, which stops the children in order (tandem/cli.py, infra/grpc_server.py)
DIE_WITH_PARENT = "TANDEM_DIE_WITH_PARENT"
MAX_MODEL_LEN = 0               # context a request may use (target, draft, `tandem serve`); 0: the model's
                                # max_position_embeddings; never more than the model's or the KV cache's

# How hidden rows travel between target and draft. auto is settled by both sides from their devices
# (services/bridge/transport.py): NCCL between two GPUs, CUDA IPC on one GPU, shared host memory (shm)
# between two CPU processes of one host, gloo otherwise; inline sends them in the gRPC messages (no bridge).
BRIDGE_TRANSPORTS = ("auto", "gloo", "nccl", "ipc", "shm")
HIDDEN_TRANSPORTS = BRIDGE_TRANSPORTS + ("inline",)


def transport_misfit(want: str, cuda: bool, same_gpu: bool, same_process: bool = False, cpu: bool = False,
                     same_shm: bool = True) -> str | None:
    """Why the devices cannot carry an explicitly asked transport (None: they can, or `want` is auto/gloo/inline).
    cuda / cpu: both sides on GPUs / both on the CPU; same_shm: both see one /dev/shm."""
    if want == "nccl" and (not cuda or same_gpu):
        return ("the nccl hidden transport needs target and draft on two different GPUs (NCCL refuses two ranks "
                "on one GPU; use auto or ipc there)")
    if want == "ipc" and (not cuda or not same_gpu or same_process):
        return ("the ipc hidden transport needs target and draft on the same GPU in two processes (use auto or "
                "nccl across GPUs)")
    if want == "shm" and (not cpu or same_process or not same_shm):
        return ("the shm hidden transport needs target and draft on the CPU in two processes that share /dev/shm "
                "(one host; use auto or gloo otherwise)")
    return None
