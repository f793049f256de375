"""Randomized fault schedules (issue 13): N seeded schedules against real processes, one table.

    .venv/bin/python bench/chaos.py --schedules 50 [--first-seed 1] [--s3-only] [--servers N] [--s3-rates 0.1,0.15,0.05]

Starts its own moto server; each schedule runs a simulated fleet, a fault-injecting S3 front and
one generate worker process per server (SIGTERM/SIGKILL and retries included; see dev/chaos.py).
Prints one row per schedule and the totals; exits 1 if any schedule lost, duplicated or stored an
unfinished row, left a claim, or hung.
"""

from __future__ import annotations

import argparse
import sys
import time

from dflash_pipeline.dev.chaos import Event, random_schedule, run_schedule
from dflash_pipeline.dev.stack import MotoServer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=50)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--s3-only", action="store_true", help="S3 faults only (no server or worker events)")
    ap.add_argument("--servers", type=int, default=None, help="fleet size (default: drawn, 2-4)")
    ap.add_argument("--outage-s", type=float, default=8.0, help="longest S3 outage drawn (seconds)")
    ap.add_argument("--force-outage", action="store_true",
                    help="add to every schedule one S3 outage of exactly --outage-s, 2-6 s after the start")
    ap.add_argument("--s3-rates", default=None, metavar="SLOWDOWN,CONFLICT,LOST",
                    help="fix the S3 fault rates (e.g. 0.10,0.15,0.05) instead of drawing them")
    ap.add_argument("--bound-s", type=float, default=300.0, help="a schedule still running after this is a hang")
    args = ap.parse_args()
    bad = 0
    totals = {"rows": 0, "requests": 0, "wasted": 0, "dup_prompts": 0}
    with MotoServer() as moto:
        bucket = moto.create_bucket("chaos")
        client = moto.client()
        print(f"{'seed':>5} {'ok':>3} {'rows':>5} {'miss':>4} {'dup':>3} {'unfin':>5} {'claims':>6} "
              f"{'reqs':>5} {'wasted':>6} {'tries':>5} {'wall_s':>6}  schedule | S3 faults injected")
        t0 = time.monotonic()
        for seed in range(args.first_seed, args.first_seed + args.schedules):
            sc = random_schedule(seed, s3_only=args.s3_only, n_servers=args.servers, outage_s=args.outage_s)
            if args.force_outage:
                at = 2.0 + (seed * 7919 % 400) / 100.0
                sc.events = sorted([*sc.events, Event(at, "outage", 0, args.outage_s)], key=lambda e: e.at_s)
            if args.s3_rates:
                sd, cf, lo = (float(x) for x in args.s3_rates.split(","))
                sc.s3 = {"slowdown": sd, "conflict": cf, "lost": lo}
            r = run_schedule(sc, s3_endpoint=moto.endpoint_url, s3_port=moto.port, bucket=bucket,
                             s3_client=client, bound_s=args.bound_s)
            bad += not r.ok
            totals["rows"] += r.rows
            totals["requests"] += r.requests
            totals["wasted"] += r.wasted
            print(f"{seed:>5} {'yes' if r.ok else 'NO':>3} {r.rows:>5} {r.missing:>4} {r.duplicated:>3} "
                  f"{r.unfinished_stored:>5} {r.claims_left:>6} {r.requests:>5} {r.wasted:>6} {r.tries:>5} "
                  f"{r.wall_s:>6.1f}  {r.schedule}{' HUNG' if r.hung else ''} | {r.s3_faults}", flush=True)
    print(f"\n{args.schedules} schedules in {time.monotonic() - t0:.0f}s: {bad} failed; rows {totals['rows']}, "
          f"requests {totals['requests']}, wasted {totals['wasted']} "
          f"({totals['wasted'] / max(1, totals['rows']):.1%} of rows)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
