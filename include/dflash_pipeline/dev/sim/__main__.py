"""CLI: run N simulated SGLang servers until SIGINT/SIGTERM.

    python -m dflash_pipeline.dev.sim --count 4 --base-port 0 --max-running-requests 16 \\
        --token-time-s 0.001 --length-scale 0.05 --urls-file /tmp/urls.txt \\
        --set error_rate=0.01 --server-set 2:slow_factor=2.0
    python -m dflash_pipeline.dev.sim --count 3 --engines sglang,vllm,vllm   # a mixed fleet

``--engine vllm|sglang`` sets every server's wire flavour (vllm_wire.py), ``--engines`` one per
server. Every SimConfig field has a flag (``--error-rate``, ``--reasoning-parser none``, ...); ``--set
key=value`` does the same generically and ``--server-set INDEX:key=value`` overrides one server.
The URLs file (one URL per line) is written atomically once every server is listening, so a
caller can wait for it to appear.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any, Sequence

from dflash_pipeline.dev.sim.server import SimConfig, SimFleet, coerce_field_value

logger = logging.getLogger(__name__)

_SKIP_FLAGS = {"port"}  # ports come from --base-port


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip().replace("-", "_"), value


def _server_key_value(text: str) -> tuple[int, str, str]:
    index, sep, rest = text.partition(":")
    if not sep or not index.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected INDEX:key=value, got {text!r}")
    key, value = _key_value(rest)
    return int(index), key, value


def build_parser() -> argparse.ArgumentParser:
    """Flags for every SimConfig field plus fleet-level options."""
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.dev.sim",
                                     description="Simulated SGLang servers.")
    parser.add_argument("--count", type=int, default=1, help="number of servers")
    parser.add_argument("--base-port", type=int, default=0,
                        help="0: free ports; otherwise server i listens on base+i")
    parser.add_argument("--urls-file", default=None, help="write one URL per line when ready")
    parser.add_argument("--set", dest="sets", action="append", type=_key_value, default=[],
                        metavar="KEY=VALUE", help="set a SimConfig field on every server")
    parser.add_argument("--server-set", dest="server_sets", action="append",
                        type=_server_key_value, default=[], metavar="INDEX:KEY=VALUE",
                        help="set a SimConfig field on one server (0-based index)")
    parser.add_argument("--engines", default=None, metavar="E1,E2,...",
                        help="wire flavour per server (sglang or vllm), comma-separated, one per server")
    parser.add_argument("--log-level", default="WARNING")
    fields = parser.add_argument_group("SimConfig fields")
    for field in dataclasses.fields(SimConfig):
        if field.name in _SKIP_FLAGS:
            continue
        fields.add_argument("--" + field.name.replace("_", "-"), dest="field_" + field.name,
                            default=None, metavar="VALUE", help=f"({field.type})")
    return parser


def build_configs(args: argparse.Namespace) -> list[SimConfig]:
    """One SimConfig per server: field flags, then --set, then --server-set."""
    if args.count < 1:
        raise ValueError("--count must be >= 1")
    common: dict[str, Any] = {}
    for field in dataclasses.fields(SimConfig):
        raw = getattr(args, "field_" + field.name, None)
        if raw is not None:
            common[field.name] = coerce_field_value(field.name, raw)
    for key, value in args.sets:
        common[key] = coerce_field_value(key, value)
    engines = [e.strip() for e in args.engines.split(",")] if getattr(args, "engines", None) else None
    if engines is not None and len(engines) != args.count:
        raise ValueError(f"--engines lists {len(engines)} servers, --count is {args.count}")
    configs = []
    for index in range(args.count):
        values = dict(common)
        if engines is not None:
            values["engine"] = engines[index]
        values["port"] = 0 if args.base_port == 0 else args.base_port + index
        for target, key, value in args.server_sets:
            if target == index:
                values[key] = coerce_field_value(key, value)
        configs.append(SimConfig(**values))
    for target, _, _ in args.server_sets:
        if target >= args.count:
            raise ValueError(f"--server-set index {target} >= --count {args.count}")
    return configs


def _write_urls(path: str, urls: Sequence[str]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("".join(url + "\n" for url in urls))
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the fleet, publish URLs, serve until a signal, stop cleanly."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        configs = build_configs(args)
    except (KeyError, ValueError) as exc:
        parser.error(str(exc))
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        logger.info("signal %s: stopping", signum)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    fleet = SimFleet(configs).start()
    try:
        if args.urls_file:
            _write_urls(args.urls_file, fleet.urls)
        # The CLI's output proper: one URL per line on stdout (logs go to stderr).
        sys.stdout.write("".join(f"{url}\n" for url in fleet.urls))
        sys.stdout.flush()
        stop.wait()
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
