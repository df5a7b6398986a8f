"""``python -m wb``: the command line (``demo``, ``plan``, ``bench``, ``check``), the applications that sit above
the library and its shims (the only part of ``wb`` that imports ``wb_torch`` / ``wb_jax``, lazily)."""

from __future__ import annotations

import argparse
import json
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a JAX trainer feeding PyTorch rollouts (or the reverse) "
                                        "between local processes over UCX, in all four sync "
                                        "modes, checked after every update (no cluster)")
    demo.add_argument("--trainer", choices=("jax", "torch"), default="jax")
    demo.add_argument("--rollout", choices=("torch", "jax"), default="torch")
    demo.add_argument("--replicas", type=int, default=2, help="rollout replicas (default 2)")
    demo.add_argument("--tp", type=int, default=2, help="TP degree of each PyTorch side (default 2)")
    demo.add_argument("--cuda", action="store_true",
                      help="every process on the CUDA devices (a node's PyTorch workers spread "
                           "over the GPUs; a JAX rollout needs --tp GPUs), checked zero-copy")
    demo.add_argument("--rollout-dtype", default=None, metavar="DTYPE",
                      help="the PyTorch rollouts' parameter dtype (float32, float16, bfloat16; "
                           "default bfloat16, the trainer's): wb converts in flight; "
                           "float8_e4m3fn: block-scaled FP8 projections, quantised by the "
                           "trainers")
    demo.add_argument("--check", action="store_true",
                      help="after every update, every rollout checks its live weights against "
                           "the trainers' claim, through its source maps (wb.Receiver.check)")
    demo.add_argument("--delta", action="store_true",
                      help="train with a step that changes about 3%% of the weights, sent as "
                           "deltas (wb.Sender(delta=True)): the bytes per version fall after "
                           "the first")
    demo.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    pl = sub.add_parser("plan", help="build a preset deployment's source maps and plan; report "
                                     "traffic, simulated EWTT and baselines")
    pl.add_argument("--preset", required=True, help="moonlight-16b-a3b, qwen3-235b-a22b, "
                                                     "deepseek-v3, kimi-k2 or tiny")
    pl.add_argument("--plot", metavar="FILE.png", help="draw the load on every link")
    pl.add_argument("--no-verify", action="store_true", help="skip Plan.verify()")
    pl.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    pl.add_argument("--setup", action="store_true",
                    help="instead: time the set-up through a real store, every rank simulated "
                         "here (layouts published, plan made, every rank's part fetched and "
                         "loaded); prints a JSON object as the last line")
    pl.add_argument("--delta-density", type=float, metavar="D",
                    help="also simulate every message as a delta with a fraction D of its "
                         "elements changed (e.g. what `bench/bench_delta.py` measures per "
                         "version), on the plan a job that sends deltas makes (larger pieces: "
                         "agree_parts(delta=True)): reports delta_ewtt_s, delta_link_ratio (the "
                         "busiest link's bytes as deltas over dense) and that plan's dense EWTT")
    pl.add_argument("--sample", type=int, default=8,
                    help="with --setup: how many ranks' parts to load, largest first (default 8)")
    be = sub.add_parser("bench", help="wb vs broadcast vs naive P2P vs the ideal, measured side by "
                                      "side between local processes over UCX")
    be.add_argument("--quick", action="store_true", help="the small 'quick' profile (CI, smoke)")
    from wb.cli.bench.runner import PROFILES

    be.add_argument("--profile", choices=tuple(PROFILES), default=None,
                    help="sizes and emulated link rates (default: cpu, or gpu with --cuda)")
    be.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    be.add_argument("--cuda", type=int, default=None, metavar="DEVICE",
                    help="put every process's buffers on this CUDA device (CuPy)")
    be.add_argument("--devices", choices=("one", "spread", "role"), default="one",
                    help="with --cuda: all processes on that device, spread over all devices, or "
                         "trainers on device 0 and rollouts on device 1")
    be.add_argument("--links", choices=("shaped", "real"), default="shaped",
                    help="emulated per-GPU NIC/NVLink rates (default) or the machine's own links")
    be.add_argument("--modes", nargs="*", choices=("sync", "sender", "receiver", "both"),
                    default=None, help="sync modes for AGST (default all four; none: EWTT only)")
    be.add_argument("--out", metavar="DIR", help="write bench.json and bench.png there")
    be.add_argument("--polling", choices=("on", "off"), default=None,
                    help="UCX progress threads busy-poll (on) or wait on events (off); default: "
                         "the profile's, else none with --cuda (the update loop progresses UCX)")
    be.add_argument("--trace", action="store_true",
                    help="with --out: also write every rank's per-message times of its last wb "
                         "run (trace_rR.json)")
    be.add_argument("--checksums", choices=("on", "compare"), default="on",
                    help="compare: also run wb's plan without its per-message checks "
                         "(checksums_ratio: wb's EWTT over that)")
    be.add_argument("--delta", type=float, metavar="LR", default=None,
                    help="also send versions made by Adam at learning rate LR (e.g. 1e-6), dense "
                         "and as deltas, and report the bytes and EWTT of each per version")
    be.add_argument("--delta-versions", type=int, default=4, metavar="N",
                    help="versions of --delta (default 4; the first is dense in both)")
    be.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ch = sub.add_parser("check", help="ask a running job's rollouts to check the weights they "
                                      "serve against the trainers' (through their source maps); "
                                      "exit 0 if every one matches")
    ch.add_argument("--store", required=True, metavar="DIR|tcp://HOST:PORT",
                    help="the job's store: a DirectoryStore's directory (or dir:/path), or a "
                         "torch TCPStore; signed with WB_JOB_KEY as the job's")
    ch.add_argument("--name", default="wb", help="the job's name (Sender/Receiver name=; "
                                                 "default wb)")
    ch.add_argument("--timeout", type=float, default=120.0,
                    help="seconds to wait for every rollout's answer (default 120)")
    ch.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    from wb.errors import SpecError

    try:
        return _run(args)
    except SpecError as e:  # bad arguments: say so, without a traceback
        parser.error(str(e))


def _run(args) -> int:
    if args.command == "check":
        from wb.cli.check import run_check

        report = run_check(args.store, name=args.name, timeout=args.timeout, quiet=args.json)
        if args.json:
            print(json.dumps(report))
        return 0 if report["ok"] else 1
    if args.command == "bench":
        from wb.cli.bench.runner import run_bench

        profile = "quick" if args.quick else args.profile or ("gpu" if args.cuda is not None
                                                              else "cpu")
        report = run_bench(profile=profile, replicas=tuple(args.replicas), cuda=args.cuda,
                           devices=args.devices, links=args.links, quiet=args.json,
                           out_dir=args.out, modes=args.modes, trace=args.trace,
                           checksums=args.checksums, delta_lr=args.delta,
                           delta_versions=args.delta_versions,
                           **({} if args.polling is None else {"polling": args.polling == "on"}))
        if args.json:
            print(json.dumps(report))
        return 0 if report["verified"] else 1
    if args.command == "plan":
        from wb.cli.plan import run_plan, run_setup

        if args.setup:
            print(json.dumps(run_setup(args.preset, sample=args.sample, quiet=args.json)))
            return 0
        report = run_plan(args.preset, plot=args.plot, verify=not args.no_verify, quiet=args.json,
                          delta_density=args.delta_density)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.command == "demo":
        from wb.cli.demo.runner import run_demo

        t0 = time.perf_counter()
        report = run_demo(trainer=args.trainer, rollout=args.rollout, replicas=args.replicas,
                          tp=args.tp, quiet=args.json, cuda=args.cuda,
                          rollout_dtype=args.rollout_dtype,
                          check=args.check, delta=args.delta)
        report["demo_s"] = round(time.perf_counter() - t0, 3)
        if args.json:
            print(json.dumps(report))
        return 0 if report["verified"] else 1
    return 2

