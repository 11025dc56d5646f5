"""One generation of the hidden-row bridge (services/bridge/channel.py): the store keys it lives under,
the transport both sides agreed for it and what carries that transport (a gloo or NCCL process group
of two ranks, or the CUDA IPC ring), and the frames that move rows over a process group.

A frame is a header [transfer_id, rows, bytes per row, dtype code] (int64) and the payload as bytes,
sent by p2p on tags 0 and 1 (an empty payload is not sent). A generation that ends is closed: an NCCL
group is aborted (a peer that died leaves its communicator unusable), a gloo group is dropped, the
receiver unmaps the IPC or shared-memory ring (the sender keeps its ring for the next generation).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.bridge.ipc import IpcReceiver, IpcSender
from services.bridge.rows import DTYPE_TO_PB
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
    pulls: int = 0                                # pull requests of this generation so far

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send_frame(self, tid: int, rows: torch.Tensor, stream) -> None:
        code = DTYPE_TO_PB[rows.dtype]
        row_bytes = rows.shape[1] * rows.element_size()
        payload = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes).to(self.wire)
        header = torch.tensor([tid, payload.shape[0], row_bytes, code], dtype=torch.int64, device=self.wire)
        self.pg.send([header], self.peer, 0).wait()
        if payload.numel():
            self.pg.send([payload], self.peer, 1).wait()
        if stream is not None:
            stream.synchronize()

    def recv_frame(self):
        """-> (transfer id, rows, bytes per row, dtype code, payload [rows, bytes per row] uint8)."""
        header = torch.empty(4, dtype=torch.int64, device=self.wire)
        self.pg.recv([header], self.peer, 0).wait()
        tid, n_rows, row_bytes, code = header.tolist()
        payload = torch.empty(n_rows, row_bytes, dtype=torch.uint8, device=self.wire)
        if payload.numel():
            self.pg.recv([payload], self.peer, 1).wait()
        return tid, n_rows, row_bytes, code, payload

    def close(self) -> None:
        if isinstance(self.ipc, (IpcReceiver, ShmReceiver)):
            self.ipc.close()
        if self.transport == "nccl" and self.pg is not None:
            try:
                getattr(self.pg, "abort", lambda: None)()
            except Exception as e:                 # the peer is gone already: nothing left to tear down
                log.warning("aborting the NCCL group of bridge generation %d: %s", self.generation, e)
        self.pg = self.ipc = None
