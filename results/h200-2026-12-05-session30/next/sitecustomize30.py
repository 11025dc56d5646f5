# session 30 probe (not part of Tandem), put in .gpu/site/ as sitecustomize.py beside session 27's probe
# (../../h200-2026-12-04-session27/sitecustomize27.py) copied as .gpu/site/probe27.py: that probe as it is
# (TANDEM_PHASES_DIR: each process logs (name, start, end, thread) per call of the round's functions), and with
# TANDEM_ALTERNATE_ORDER=1 the target's RowChannel.pushes answers False every other time it is read (once a Verify
# with `ahead`): those rounds push the rows into the ring BEFORE the next Propose, the others after it.
import os
import sys
import threading
import time

_here = os.path.dirname(os.path.abspath(__file__))
exec(compile(open(os.path.join(_here, "probe27.py")).read(), os.path.join(_here, "probe27.py"), "exec"))

if os.environ.get("TANDEM_ALTERNATE_ORDER") == "1":
    def _alternate():
        while True:
            cls = getattr(sys.modules.get("services.bridge.channel"), "RowChannel", None)
            if cls is not None:
                orig, flip = cls.pushes, [False]

                def pushes(self):
                    flip[0] = not flip[0]
                    return orig.fget(self) and flip[0]
                cls.pushes = property(pushes)
                return
            time.sleep(0.01)
    threading.Thread(target=_alternate, daemon=True).start()
