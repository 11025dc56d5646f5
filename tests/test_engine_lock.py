"""services/servicer.py EngineLock: a Release never waits behind a step. Found probing as a user: Releases blocked on
a long forward held the target's few gRPC workers (GetInfo starved: health said "unreachable"), passed their
deadline and were dropped, and their requests kept their KV blocks for good."""
import random
import threading
import time

from services.servicer import EngineLock


class Engine:
    def __init__(self):
        self.held, self.calls, self.mu = set(), [], threading.Lock()

    def release(self, ids):
        with self.mu:
            self.calls.append(list(ids))
            n = len(self.held & set(ids))
            self.held -= set(ids)
            return n


def test_a_release_during_a_step_returns_at_once_and_frees_when_the_step_ends():
    eng = Engine()
    eng.held = {"a", "b", "c"}
    lock = EngineLock(eng.release)
    assert lock.release(["a"]) == (1, 0)                     # no step running: released now
    inside, leave = threading.Event(), threading.Event()

    def step():
        with lock:
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=step)
    t.start()
    inside.wait(10)
    t0 = time.monotonic()
    assert lock.release(["b", "zz"]) == (0, 2)               # deferred, answered without waiting for the step
    assert time.monotonic() - t0 < 0.5 and eng.held == {"b", "c"}
    leave.set()
    t.join(10)
    assert eng.held == {"c"} and eng.calls[-1] == ["b", "zz"]


def test_no_deferred_release_is_lost_when_steps_and_releases_race():
    eng = Engine()
    ids = [f"r{i}" for i in range(400)]
    eng.held = set(ids)
    lock = EngineLock(eng.release)
    stop = threading.Event()

    def steps():
        while not stop.is_set():
            with lock:
                time.sleep(random.random() * 1e-4)
    workers = [threading.Thread(target=steps) for _ in range(2)]
    for w in workers:
        w.start()
    for i in ids:
        lock.release([i])
        if random.random() < 0.3:
            time.sleep(1e-5)
    stop.set()
    for w in workers:
        w.join(10)
    assert eng.held == set()                                  # every id released: none left deferred


def test_a_release_deferred_just_after_the_step_let_go_is_not_left_behind():
    """The interleaving a race test rarely meets, forced: the Release finds the engine held, then the step ends (and
    finds nothing deferred), then the Release defers its ids: it must release them itself."""
    eng = Engine()
    eng.held = {"y"}
    lock = EngineLock(eng.release)
    waiting, go = threading.Event(), threading.Event()

    class Gate:                                   # the Release thread's append waits at the gate
        mu = threading.Lock()

        def __enter__(self):
            if threading.current_thread().name == "releaser":
                waiting.set()
                go.wait(10)
            self.mu.acquire()

        def __exit__(self, *exc):
            self.mu.release()
    lock._mu = Gate()
    inside = threading.Event()

    def step():
        with lock:
            inside.set()
            waiting.wait(10)                      # the Release failed to take the engine and waits to defer
    holder = threading.Thread(target=step)
    holder.start()
    inside.wait(10)
    got = {}
    releaser = threading.Thread(target=lambda: got.update(r=lock.release(["y"])), name="releaser")
    releaser.start()
    holder.join(10)                               # the step let go, with nothing deferred yet
    go.set()
    releaser.join(10)
    assert got["r"] == (0, 1) and eng.held == set()
