"""The thinking quota against a plain hash draw: how far each lands from the requested share.

    .venv/bin/python bench/mix_quota.py

Prints, for n conversations (ids p000000...) and fractions f, the quota's share (plan's
thinking_modes) and, over 100 salts, the worst error of a per-id hash draw and how many salts miss ±1 %.
"""

from __future__ import annotations

import argparse
import hashlib

from dflash_pipeline.dataset.prompts import Prompt
from dflash_pipeline.steps.plan import thinking_modes


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for n in (2000, 5000):
        prompts = [Prompt(f"p{i:06d}", [], b"", i) for i in range(n)]
        for f in (0.1, 0.3, 0.5):
            share = sum(bool(m) for _, m in thinking_modes(iter(prompts), f)) / n
            draws = [sum(int(hashlib.sha256(f"{s}:{p.id}".encode()).hexdigest()[:16], 16) / 2**64 < f
                         for p in prompts) / n for s in range(100)]
            worst = max(abs(d - f) for d in draws)
            over = sum(abs(d - f) > 0.01 for d in draws)
            print(f"n={n} f={f}: quota share {share:.4f}; hash draw, 100 salts: worst |err| {worst:.4f}, "
                  f"{over}/100 outside +-1%")


if __name__ == "__main__":
    main()
