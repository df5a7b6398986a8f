"""Diagnostics for one device run (not part of wb): per process, time spent in the delta update's
steps, appended to $WB_DIAG as one JSON line at exit."""
import atexit, os, time, json, functools
_out = os.environ.get("WB_DIAG")
if _out:
    T = {}
    RUNS = []
    PROFILED = []
    import cProfile
    PROF = cProfile.Profile() if os.environ.get("WB_PROF") else None

    def timed(name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                d = time.perf_counter() - t
                c = T.setdefault(name, [0, 0.0, 0.0]); c[0] += 1; c[1] += d; c[2] = max(c[2], d)
        return w

    def patch():
        from wb.runtime.engine import movers, program, update
        from wb.runtime.engine.deltas import batches as delta_batches
        from wb.runtime.engine.deltas import device as delta_device
        from wb.runtime.engine.deltas import tables as delta_tables
        from wb.runtime.engine.deltas import units as deltas
        from wb.runtime.transport import ucx
        for mod, names in [(deltas, ["land", "_settle", "keep"]),
                           (delta_batches, ["take_parked", "_apply_batch", "_apply_direct",
                                            "_counted", "_encode_start", "_encode_finish",
                                            "_post"]),
                           (delta_device, ["apply", "to_host"]),
                           (delta_tables, ["advance_many", "received_many", "apply_many",
                                           "count_many", "write_many"]),
                           (update, ["post_sends", "take_completions", "take_parked",
                                     "run_update"])]:
            for n in names:
                setattr(mod, n, timed(f"{mod.__name__.split('.')[-1]}.{n}", getattr(mod, n)))
        run0 = program.Program.run

        @functools.wraps(run0)
        def run(self, *a, **k):  # each update's own times: what the counters gained during it
            before = {n: list(v) for n, v in T.items()}
            profiling = PROF is not None and len(RUNS) >= 2 and k.get("delta") is not None
            t0 = time.perf_counter()
            if profiling:  # the later delta updates only (the first two compile and warm up)
                PROF.enable()
            try:
                return run0(self, *a, **k)
            finally:
                if profiling:
                    PROF.disable()
                    PROFILED.append(1)
                wall = round((time.perf_counter() - t0) * 1e3, 2)
                RUNS.append({"_wall": [1, wall], **{n: [v[0] - before.get(n, [0, 0.0])[0],
                                 round((v[1] - before.get(n, [0, 0.0])[1]) * 1e3, 2)]
                             for n, v in T.items() if v[0] != before.get(n, [0])[0]}})
        program.Program.run = run
        for cls, names in [(update._Update, ["post_ready_sends", "take_completions",
                                             "take_device_work", "post_staged_receives"]),
                           (ucx.UcxTransport, ["send", "recv", "progress"]),
                           (movers.HostMover, ["staging", "gather", "unpack", "pack"]),
                           ]:
            for n in names:
                if hasattr(cls, n):
                    setattr(cls, n, timed(f"{cls.__name__}.{n}", getattr(cls, n)))

    import importlib.abc, importlib.machinery, sys

    class _Hook(importlib.abc.MetaPathFinder):
        done = False

        def find_spec(self, name, path, target=None):
            if name == "wb.runtime.endpoints.group" and not _Hook.done:
                _Hook.done = True
                sys.meta_path.remove(self)
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                orig = spec.loader.exec_module

                def exec_module(mod):
                    orig(mod)
                    try:
                        patch()
                    except Exception as e:  # noqa: BLE001
                        T["patch_error"] = [0, 0.0, 0.0, repr(e)]
                spec.loader.exec_module = exec_module
                return spec
            return None

    def dump():
        if T:
            with open(_out, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "argv": " ".join(sys.argv)[:120], "t": {
                    k: [v[0], round(v[1] * 1e3, 2), round(v[2] * 1e3, 2)] + v[3:]
                    for k, v in T.items()}, "runs": RUNS}) + "\n")
    def dump_profile():
        if PROF is None or not PROFILED:
            return
        import io, pstats
        buf = io.StringIO()
        st = pstats.Stats(PROF, stream=buf)
        buf.write(f"pid {os.getpid()} {' '.join(sys.argv)[:100]}: {len(PROFILED)} updates\n")
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(35)
        with open(f"{os.environ['WB_PROF']}_{os.getpid()}.txt", "w") as f:
            f.write(buf.getvalue())
    atexit.register(dump)
    atexit.register(dump_profile)
    sys.meta_path.insert(0, _Hook())
