"""Print the fault table for the notes: fault, how injected, rows expected/present/duplicated, requests wasted.

    .venv/bin/python bench/fault_table.py

Runs the same scenarios as tests/integration/test_faults.py (real moto S3 server, simulated SGLang
servers over loopback, the DAG's own Worker), each into a fresh dataset root. "wasted" = generation
requests the servers received minus completions in the final dataset (failed attempts included).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import boto3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))

from dflash_pipeline.dev.faultlab import TcpCut, run_scenario  # noqa: E402
from dflash_pipeline.dev.sim import SimFleet  # noqa: E402
from dflash_pipeline.dev.stack import MotoServer  # noqa: E402

COMMON = dict(token_time_s=0.0005, length_scale=0.05, max_running_requests=6)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with MotoServer(log_path=Path(tempfile.mkdtemp()) / "moto.log") as moto:
        moto.create_bucket("faults")
        s3 = moto.client()
        scenarios = [
            ("errors-500", "error_rate=0.3 on every server (HTTP 500)", {"error_rate": 0.3}, {}, True),
            ("queue-full-503", "max_queued_requests=0, client 12 in flight vs 6 slots", {"max_queued_requests": 0}, {"concurrency_per_server": 12}, True),
            ("hangs", "hang_rate=0.03, request_timeout_s=1", {"hang_rate": 0.03, "hang_s": 30.0}, {"request_timeout_s": 1}, True),
            ("resets", "reset_rate=0.1 (TCP RST, no response)", {"reset_rate": 0.1}, {}, True),
        ]
        for name, how, knobs, params, repair in scenarios:
            with SimFleet.uniform(3, **COMMON, **knobs) as fleet:
                rows.append(run_scenario(name, how, s3_client=s3, bucket="faults", fleet=fleet, params=params, repair_run=repair))
        with SimFleet.uniform(3, **COMMON) as fleet:
            fleet.servers[0].update_config(crash_after_requests=60, restart_after_s=1.5)
            rows.append(run_scenario("crash-and-back", "server 0 crashes after 60 requests, back after 1.5 s", s3_client=s3, bucket="faults", fleet=fleet))
        with SimFleet.uniform(3, **COMMON) as fleet:
            fleet.servers[0].update_config(crash_after_requests=60)
            rows.append(run_scenario("gone-for-good", "server 0 crashes after 60 requests, never back", s3_client=s3, bucket="faults", fleet=fleet))
        with SimFleet.uniform(2, **{**COMMON, "token_time_s": 0.002}) as fleet:
            cut = TcpCut(moto.port).start()
            client = boto3.client("s3", endpoint_url=cut.url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")

            def during() -> None:
                time.sleep(2.0)
                cut.cut()
                time.sleep(30.0)
                cut.restore()

            rows.append(run_scenario("s3-outage-30s", "TCP forwarder to S3 cut for 30 s mid-run", s3_client=s3, bucket="faults", fleet=fleet, n=600, during=during, store_client=client,
                           params={"claim_lease_s": 120}))
            cut.stop()
    print("| fault | how injected | runs | rows expected | present | duplicated | completions | error rows | requests wasted | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.name} | {r.injected} | {r.runs} | {r.expected} | {r.present} | {r.duplicated} | {r.completions} | {r.error_rows} | {r.wasted} | {r.wall_s} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
