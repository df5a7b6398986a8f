"""Profiles every Python process started with this folder on PYTHONPATH (spawned workers
included) and appends each one's 25 most expensive functions (cumulative) to
$WB_PROFILE_OUT: an experiment's tool, not part of wb."""

import atexit
import cProfile
import io
import os
import pstats
import sys

_out = os.environ.get("WB_PROFILE_OUT")
if _out:
    _prof = cProfile.Profile()
    _prof.enable()

    def _dump():
        _prof.disable()
        s = io.StringIO()
        st = pstats.Stats(_prof, stream=s).sort_stats("cumulative")
        st.print_stats(25)
        head = f"\n===== pid {os.getpid()} {' '.join(sys.argv)[:200]}\n"
        with open(_out, "a") as f:
            f.write(head + s.getvalue()[-6000:])
    atexit.register(_dump)
