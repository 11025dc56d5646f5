"""One generation of the hidden-row bridge (services/bridge/channel.py): the store keys it lives under,
the transport both sides agreed for it and what carries that transport (a gloo or NCCL process group
of two ranks, or the CUDA IPC or shared-memory ring), and how far its frames got (push.py moves them over a
process group). A generation that ends is closed: an NCCL
group is aborted (a peer that died leaves its communicator unusable), a gloo group is dropped, the
receiver unmaps the IPC or shared-memory ring (the sender keeps its ring for the next generation).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from services.bridge.ipc import IpcReceiver, IpcSender
from services.bridge.shm import ShmReceiver, ShmSender

log = logging.getLogger("tandem.bridge")


@dataclass
class Link:
    generation: int
    prefix: str                                   # its keys in the store: tandem-bridge/<generation>/
    transport: str                                # gloo | nccl | ipc | shm
    rank: int                                     # 0: sender (target), 1: receiver (draft)
    wire: torch.device                            # where frames travel: the CPU for gloo
    pg: object = None                             # the two-rank process group (gloo, NCCL)
    ipc: IpcSender | IpcReceiver | ShmSender | ShmReceiver | None = None   # the ring of ipc or shm
    frames: int = 0                               # frames pushed (target) or received (draft) so far (push.py)
    pushing_since: float | None = None            # target: when the push in flight began (the watcher's timeout)
    stop: threading.Event = field(default_factory=threading.Event)    # draft: its drain thread stops
    drain: threading.Thread | None = None         # draft: the thread receiving this generation's frames

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def close(self) -> None:
        if isinstance(self.ipc, (IpcReceiver, ShmReceiver)):
            self.ipc.close()
        if self.transport == "nccl" and self.pg is not None:
            try:
                getattr(self.pg, "abort", lambda: None)()
            except Exception as e:                 # the peer is gone already: nothing left to tear down
                log.warning("aborting the NCCL group of bridge generation %d: %s", self.generation, e)
        self.pg = self.ipc = None
