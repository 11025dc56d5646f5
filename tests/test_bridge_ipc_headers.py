"""The CUDA IPC ring's host headers (services/bridge/ipc.py SlotHeaders), across real processes: a
published header reads whole in the other process, an invalidated slot reads as empty, and the side
that attached never unlinks the segment (only its owner does)."""
import multiprocessing as mp

from services.bridge.ipc import SlotHeaders


def _read_all(name: str, q) -> None:
    h = SlotHeaders(4, name)
    q.put([h.read(s) for s in range(4)])
    h.close()


def test_slot_headers_cross_processes():
    owner = SlotHeaders(4)
    try:
        owner.publish(1, 9, 4, 4096, 2)
        owner.publish(2, 10, 1, 4096, 2)
        owner.invalidate(2)                                    # an overwrite is being queued
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_read_all, args=(owner.name, q))
        p.start()
        seen = q.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0
        assert seen[1] == (9, 4, 4096, 2)
        assert seen[2][0] == -1 and seen[0][0] == -1 and seen[3][0] == -1
        again = SlotHeaders(4, owner.name)                     # still there after the reader exited
        assert again.tid(1) == 9
        again.close()
    finally:
        owner.close()
