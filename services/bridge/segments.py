"""Names of the bridge's POSIX shared-memory segments, and the sweep of those a killed process left.

The sender's segments (the shm ring `tandem-rows-...`, the slot headers `tandem-ipc-...`) are unlinked when it
closes, or by Python's resource tracker when it dies; a SIGKILL of its whole process group (`kill -9 -PGID`,
`timeout -s KILL`, systemd's final kill, an OOM kill of the cgroup) takes the tracker too, and the segment stays in
/dev/shm, in RAM, until reboot. So each name carries its creator's pid namespace and pid, and a sender sweeps the
segments of creators that are gone before it creates its own. Only its own pid namespace's: a pid of another
namespace (another container sharing /dev/shm) cannot be checked from here."""
from __future__ import annotations

import logging
import os
import re
import uuid

log = logging.getLogger("tandem.bridge")
SHM_DIR = "/dev/shm"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def segment_name(kind: str) -> str:
    """A new segment's name: tandem-<kind>-<pid namespace>-<pid>-<random>."""
    return f"tandem-{kind}-{_pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                  # another user's process: alive
        pass
    return True


def sweep_orphans(kind: str) -> list[str]:
    """Unlink this pid namespace's tandem-<kind>-* segments whose creator is gone -> their names."""
    pattern = re.compile(rf"tandem-{kind}-{_pid_namespace()}-(\d+)-[0-9a-f]+")
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    gone = [n for n in names if (m := pattern.fullmatch(n)) and not _alive(int(m.group(1)))]
    for n in gone:
        try:
            os.unlink(os.path.join(SHM_DIR, n))
        except OSError:
            pass
    if gone:
        log.warning("removed %d shared-memory segments left by killed processes: %s", len(gone), gone[:4])
    return gone
