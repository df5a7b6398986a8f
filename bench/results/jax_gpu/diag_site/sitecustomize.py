"""Diagnostics for one device run (not part of wb): per process, time spent in chosen
functions and the one-sided channel's counts, appended to $WB_DIAG at exit."""
import atexit, os, sys, time, json, functools
_out = os.environ.get("WB_DIAG")
if _out:
    T = {}
    chans = []
    RUNS = []
    EV = []
    READS = []
    FLUSHES = []
    LAUNCHES = []
    GEV = []
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
        from wb.runtime.transport import memory, ipc, notes
        from wb.runtime.endpoints import group, sender, receiver
        from wb.runtime.engine import program, buffers
        for n in ("as_array", "check_buffers", "copy_of", "settle"):
            setattr(buffers, n, timed(f"buffers.{n}", getattr(buffers, n)))
        from wb.runtime.engine import movers, update
        from wb.runtime.transport import ucx
        for cls, names in [(movers.DeviceMover, ["pack", "pack_many", "unpack", "_fused", "direct"]),
                           (update._Update, ["post_ready_sends", "take_completions", "take_device_work", "post_staged_receives", "post_zero_copy_receives"]),
                           (ucx.UcxTransport, ["send", "recv", "progress"]),
                           (memory.CudaMemory, ["export", "open", "new_round", "copy_many", "_describe"]),
                           (ipc.Channel, ["send", "recv", "pump"]),
                           (sender.Sender, ["push"]), (receiver.Receiver, ["apply"]),
                           (program.Program, ["run"]),
                           (group.SenderGroup, ["push"]), (group.ReceiverGroup, ["apply"])]:
            for n in names:
                setattr(cls, n, timed(f"{cls.__name__}.{n}", getattr(cls, n)))
        EV.clear()
        cm = memory.CudaMemory.copy_many
        def copy_many(self, items, peer):
            import cupy as cp
            st = self._stream(peer)
            e0 = cp.cuda.Event(); e0.record(st)
            t = time.time()
            tok = cm(self, items, peer)
            e1 = cp.cuda.Event(); e1.record(st)
            EV.append((t, e0, e1, len(items), sum(int(it[3]) for it in items)))
            return tok
        memory.CudaMemory.copy_many = copy_many
        from wb.runtime.engine import gather
        gcopy = gather.copy
        def gather_copy(ptrs, tab, stage, itemsize, *, scatter):  # packs and unpacks, timed on the GPU
            import cupy as cp
            st = cp.cuda.get_current_stream()
            e0 = cp.cuda.Event(); e0.record(st)
            t = time.time()
            gcopy(ptrs, tab, stage, itemsize, scatter=scatter)
            e1 = cp.cuda.Event(); e1.record(st)
            nb = sum(int(b.nbytes) for b in (stage if isinstance(stage, list) else [stage]))
            GEV.append((t, e0, e1, "unpack" if scatter else "pack", nb))
        gather.copy = gather_copy
        rd = ipc.Channel._read
        def _read(self, peer, buf):
            READS.append((time.time(), int(notes.HEADER.unpack_from(buf)[0])))
            return rd(self, peer, buf)
        ipc.Channel._read = _read
        def counted(name, queue, into):  # times and sizes of a channel step's queued work
            fn = getattr(ipc.Channel, name)
            def w(self):
                k = sum(len(v) for v in getattr(self, queue).values())
                if k:
                    into.append((time.time(), k))
                return fn(self)
            setattr(ipc.Channel, name, w)
        counted("_launch", "_starting", LAUNCHES)
        counted("_flush", "_out", FLUSHES)
        if os.environ.get("WB_FLUSH_ROWS"):
            ipc.FLUSH_ROWS = int(os.environ["WB_FLUSH_ROWS"])
        if os.environ.get("WB_STAGING_BYTES"):  # every update's staging budget, whatever asked
            ru = program.run_update
            def run_update(*a, **k):
                k["staging_bytes"] = int(os.environ["WB_STAGING_BYTES"])
                return ru(*a, **k)
            program.run_update = run_update
        prun = program.Program.run
        def run(self, *a, **k):
            tr = k.get("trace")
            if tr is None:
                tr = k["trace"] = []
            before = {n: v[1] for n, v in T.items() if isinstance(v, list)}
            t0 = time.time()
            st = prun(self, *a, **k)
            after = {n: round((v[1] - before.get(n, 0.0)) * 1e3, 3) for n, v in T.items() if isinstance(v, list) and v[1] - before.get(n, 0.0) > 1e-5}
            ents = [e for e in tr]
            rec = {"rank": self.rank, "call": round(t0, 6), "start": round(st.start_s, 6), "end": round(st.end_s, 6), "cpu": after, "n": len(ents)}
            if ents:
                units = self.units
                def kind(e):
                    g = self.messages[e.message]
                    return ("out" if g.out else "in") + ("" if (g.zc_src if g.out else g.zc_dst) else "+pack") + ("+frame" if e.message in units and units[e.message].__class__.__name__ == "Frame" else "")
                rec["msgs"] = [(e.message, kind(e), e.peer, e.nbytes, round((e.ready - st.start_s) * 1e3, 3) if e.ready else None, round((e.posted - st.start_s) * 1e3, 3) if e.posted else None, round((e.done - st.start_s) * 1e3, 3) if e.done else None) for e in ents]
            rec["copies"] = []
            for (t, e0, e1, k, nb) in EV:
                e1.synchronize()
                import cupy as cp
                rec["copies"].append((round((t - st.start_s) * 1e3, 3), round(cp.cuda.get_elapsed_time(e0, e1), 3), k, nb))
            EV.clear()
            rec["kernels"] = []  # (launched ms, GPU ms from the launch's start event, kind, bytes)
            for (t, e0, e1, kind, nb) in GEV:
                e1.synchronize()
                import cupy as cp
                rec["kernels"].append((round((t - st.start_s) * 1e3, 3), round(cp.cuda.get_elapsed_time(e0, e1), 3), kind, nb))
            GEV.clear()
            rec["reads"] = [(round((t - st.start_s) * 1e3, 3), k) for t, k in READS if t >= t0 - 0.01]
            rec["flushes"] = [(round((t - st.start_s) * 1e3, 3), k) for t, k in FLUSHES if t >= t0 - 0.01]
            rec["launches"] = [(round((t - st.start_s) * 1e3, 3), k) for t, k in LAUNCHES if t >= t0 - 0.01]
            READS.clear(); FLUSHES.clear(); LAUNCHES.clear()
            RUNS.append(rec)
            return st
        program.Program.run = run
        init = ipc.Channel.__init__
        def cinit(self, *a, **k):
            init(self, *a, **k); chans.append(self)
        ipc.Channel.__init__ = cinit
        for G in (group.SenderGroup, group.ReceiverGroup):
            gi = G.__init__
            def ginit(self, *a, _gi=gi, **k):
                _gi(self, *a, **k)
                ad = self.adapter
                for n in ("buffers", "settle", "received"):
                    if hasattr(ad, n):
                        setattr(ad, n, timed(f"{type(ad).__name__}.{n}", getattr(ad, n)))
            G.__init__ = ginit
    import importlib.abc, importlib.machinery
    class Hook(importlib.abc.MetaPathFinder):
        done = False
        def find_spec(self, name, path, target=None):
            if name == "wb.runtime.endpoints.group" and not Hook.done:
                Hook.done = True
                sys.meta_path.remove(self)
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                orig = spec.loader.exec_module
                def exec_module(mod):
                    orig(mod)
                    try:
                        patch()
                    except Exception as e:
                        T["patch_error"] = str(e)
                spec.loader.exec_module = exec_module
                return spec
            return None
    sys.meta_path.insert(0, Hook())
    def dump():
        if not T:
            return
        rec = {"pid": os.getpid(), "argv": " ".join(sys.argv)[:120],
               "t": {k: v if isinstance(v, str) else [v[0], round(v[1] * 1e3, 2), round(v[2] * 1e3, 2)] for k, v in T.items()},
               "chan": [c.counts for c in chans], "runs": RUNS}
        with open(_out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    atexit.register(dump)
