"""Randomized fault schedules (issues 13, 24): N seeded schedules against real processes, one table.

    .venv/bin/python bench/chaos.py --schedules 50 [--first-seed 1] [--s3-only] [--servers N] [--s3-rates 0.1,0.15,0.05]
    .venv/bin/python bench/chaos.py --schedules 100 [--no-transitions]

Starts its own moto server; each schedule runs a simulated fleet, a fault-injecting S3 front and
one generate worker process per server (SIGTERM/SIGKILL and retries included), and in most
schedules faults at the chunk protocol's state transitions (delays, lost leases, a stop landing in
a window, checkpoints in flight at the stop; dev/transitions.py; `--no-transitions`: none), and in
most a chunk or two of prompts no server can serve and servers busy enough to shed requests with
503 (dev/chaos_liveness.py; `--no-liveness`: none). See
dev/chaos.py. Prints one row per schedule and the totals (wasted work, the worst stop, the
transition faults injected); exits 1 if any schedule lost, duplicated or stored an unfinished row,
left a claim, hung, took longer than stop_grace_s + 1.5 s to stop, had a try end with an unexpected
exception (a ServerBroken over prompts nobody can serve included) or a thread logging a failure, or
stored an unservable prompt as anything but a ContextLengthExceeded error row. A failing schedule's thread
dumps and slow stops are printed under its row.

Columns: stop_s = the schedule's longest stop (SIGTERM or transition-requested stop -> process exit;
`-` none); stops = how many were measured; T faults = transition faults injected (d delay, l lease
lost (held+released), s stop, sd stop delay, c checkpoint slowed, sc stop with a checkpoint in flight).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from dflash_pipeline.dev.chaos import STOP_GRACE_S, STOP_MARGIN_S, ChaosResult, Event, random_schedule, run_schedule
from dflash_pipeline.dev.stack import MotoServer

_SHORT = {"delay": "d", "lose_held": "l", "lose_released": "l", "stop": "s", "stop_delay": "sd",
          "checkpoint_slowed": "c", "stop_in_checkpoint": "sc"}


def _tfaults(counts: dict[str, int]) -> str:
    short: Counter[str] = Counter()
    for kind, n in counts.items():
        if kind in _SHORT:
            short[_SHORT[kind]] += n
    return " ".join(f"{k}{short[k]}" for k in ("d", "l", "s", "sd", "c", "sc") if short[k]) or "-"


def _details(r: ChaosResult) -> list[str]:
    out = [f"      logs: {r.log_dir}"]
    out += [f"      hang: {h}" for h in r.hangs]
    out += [f"      slow stop: {s} (bound {r.stop_bound_s:.1f}s)" for s in r.slow_stops]
    out += [f"      protocol error: {e}" for e in r.protocol_errors]
    out += [f"      claim left: {c}" for c in r.claims_left_detail]
    out += [f"      failed try: {f}" for f in r.failed_tries_detail]
    out += [f"      thread error: {e}" for e in r.thread_errors]
    out += [f"      unservable prompt: {e}" for e in r.liveness_problems]
    for dump in r.thread_dumps:
        out += ["      " + line for line in dump.splitlines()]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=50)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--s3-only", action="store_true", help="S3 faults only (no server, worker or transition events)")
    ap.add_argument("--no-transitions", action="store_true", help="no faults at the protocol's state transitions")
    ap.add_argument("--no-liveness", action="store_true",
                    help="no unservable chunks nor busy servers (dev/chaos_liveness.py)")
    ap.add_argument("--servers", type=int, default=None, help="fleet size (default: drawn, 2-4)")
    ap.add_argument("--outage-s", type=float, default=8.0, help="longest S3 outage drawn (seconds)")
    ap.add_argument("--force-outage", action="store_true",
                    help="add to every schedule one S3 outage of exactly --outage-s, 2-6 s after the start")
    ap.add_argument("--s3-rates", default=None, metavar="SLOWDOWN,CONFLICT,LOST",
                    help="fix the S3 fault rates (e.g. 0.10,0.15,0.05) instead of drawing them")
    ap.add_argument("--bound-s", type=float, default=300.0, help="a schedule still running after this is a hang")
    args = ap.parse_args()
    bad: list[int] = []
    totals = {"rows": 0, "requests": 0, "wasted": 0, "stops": 0, "peer_claims": 0, "failed_tries": 0,
              "early_sigterms": 0, "no_stop": 0, "unservable": 0, "shed": 0}
    tfaults: Counter[str] = Counter()
    worst: tuple[float, int] = (0.0, 0)
    with MotoServer() as moto:
        bucket = moto.create_bucket("chaos")
        client = moto.client()
        print(f"{'seed':>5} {'ok':>3} {'rows':>5} {'miss':>4} {'dup':>3} {'unfin':>5} {'claims':>6} "
              f"{'reqs':>5} {'wasted':>6} {'tries':>5} {'wall_s':>6} {'hangs':>5} {'stop_s':>6} {'stops':>5} "
              f"{'T faults':<22} schedule | S3 faults injected", flush=True)
        t0 = time.monotonic()
        for seed in range(args.first_seed, args.first_seed + args.schedules):
            sc = random_schedule(seed, s3_only=args.s3_only, n_servers=args.servers, outage_s=args.outage_s,
                                 transitions=not args.no_transitions, liveness=not args.no_liveness)
            if args.force_outage:
                at = 2.0 + (seed * 7919 % 400) / 100.0
                sc.events = sorted([*sc.events, Event(at, "outage", 0, args.outage_s)], key=lambda e: e.at_s)
            if args.s3_rates:
                sd, cf, lo = (float(x) for x in args.s3_rates.split(","))
                sc.s3 = {"slowdown": sd, "conflict": cf, "lost": lo}
            r = run_schedule(sc, s3_endpoint=moto.endpoint_url, s3_port=moto.port, bucket=bucket,
                             s3_client=client, bound_s=args.bound_s)
            if not r.ok:
                bad.append(seed)
            totals["rows"] += r.rows
            totals["requests"] += r.requests
            totals["wasted"] += r.wasted
            totals["stops"] += len(r.stops)
            totals["peer_claims"] += r.peer_claims_swept
            totals["failed_tries"] += r.failed_tries
            totals["early_sigterms"] += r.early_sigterms
            totals["no_stop"] += not r.stops
            totals["unservable"] += r.liveness.get("unservable", 0)
            totals["shed"] += r.liveness.get("queue_full", 0)
            tfaults.update(r.transition_faults)
            if r.max_stop_s >= worst[0] and r.stops:
                worst = (r.max_stop_s, seed)
            stop_s = f"{r.max_stop_s:.2f}" if r.stops else "-"
            print(f"{seed:>5} {'yes' if r.ok else 'NO':>3} {r.rows:>5} {r.missing:>4} {r.duplicated:>3} "
                  f"{r.unfinished_stored:>5} {r.claims_left:>6} {r.requests:>5} {r.wasted:>6} {r.tries:>5} "
                  f"{r.wall_s:>6.1f} {len(r.hangs):>5} {stop_s:>6} {len(r.stops):>5} "
                  f"{_tfaults(r.transition_faults):<22} "
                  f"{r.schedule}{' HUNG' if r.hung else ''} | {r.s3_faults}"
                  f"{' | shed ' + str(r.liveness.get('queue_full', 0)) if r.liveness.get('queue_full') else ''}",
                  flush=True)
            if not r.ok:
                print("\n".join(_details(r)), flush=True)
    print(f"\n{args.schedules} schedules in {time.monotonic() - t0:.0f}s: {len(bad)} failed"
          f"{' (seeds ' + ', '.join(map(str, bad)) + ')' if bad else ''}; rows {totals['rows']}, "
          f"requests {totals['requests']}, wasted {totals['wasted']} "
          f"({totals['wasted'] / max(1, totals['rows']):.1%} of rows)")
    print(f"stops measured {totals['stops']}: worst {worst[0]:.2f}s (seed {worst[1]}); bound "
          f"{STOP_GRACE_S + STOP_MARGIN_S:g}s (stop_grace_s {STOP_GRACE_S:g} + {STOP_MARGIN_S:g}); "
          f"tries failed with an exception {totals['failed_tries']}; schedules without a measured stop "
          f"{totals['no_stop']}; SIGTERMs before a child's handler was in (not measured) {totals['early_sigterms']}")
    print(f"liveness faults: unservable prompts {totals['unservable']} (all ContextLengthExceeded error rows "
          f"unless a row above says otherwise), requests shed by busy servers (503 queue full) {totals['shed']}")
    print(f"transition faults injected: {dict(sorted(tfaults.items())) or 'none'}; "
          f"injected peer's claims swept at the end {totals['peer_claims']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
