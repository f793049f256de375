"""The five ways a tokenizer trains what the target model never produced (issue 22), against any checkout.

    .venv/bin/python bench/tokenize_cases.py                          # this checkout
    .venv/bin/python bench/tokenize_cases.py --code /path/to/other/checkout

Writes five completions parts (Qwen's real BPE; the engine stand-in is the simulator's token model,
dev/sim/tokens.py, of this checkout), then tokenizes them with the `dflash_pipeline` of `--code` in a
subprocess and says, per case, PASS or FAIL with what was trained:

1. thinking off: the empty `<think>\\n\\n</think>\\n\\n` block the template writes must not be trained;
2. a Qwen3.6-style template: the `<think>\\n` of the generation prompt must not be trained;
3. a turn cut by max_tokens inside its thinking: no `</think>` or `<|im_end|>` the model never wrote;
4. regenerate=all_turns: the row that trains turn 1 must not carry turn 0's reasoning in its context;
5. engine ids that are not the canonical encoding of their text: the trained ids must be the engine's.

Checkouts before token-exact tokenization (their `tokenize_table` takes a ConversationTokenizer) are
driven through that API; the checks are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))


def write_cases(out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.dataset.records import PART_SCHEMA
    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template, ensure_qwen_tokenizer
    from dflash_pipeline.dev.sim.rows import engine_row
    from dflash_pipeline.dev.sim.tokens import SimTokenModel

    import argparse as a_mod
    import inspect
    import textwrap

    src = inspect.getsource(a_mod) + inspect.getsource(textwrap)
    p = [x.strip("\n") for x in src.split("\n\n") if len(x.strip()) > 40]
    q3 = ensure_qwen_tokenizer()
    q36 = copy_with_template(out / "q36", "qwen3.6", source=q3)
    tm3, tm36 = SimTokenModel(q3), SimTokenModel(q36)
    cases = {}
    cases["1_thinking_off_empty_block"] = (q3, False, [engine_row(tm3, [{"role": "user", "content": p[0]}],
                                                                  [("", p[1])], thinking=False)], [p[1] + "<|im_end|>\n"])
    cases["2_qwen36_prompt_opens_think"] = (q36, True, [engine_row(tm36, [{"role": "user", "content": p[2]}],
                                                                   [(p[3], p[4])], thinking=True)],
                                            [f"{p[3]}\n</think>\n\n{p[4]}<|im_end|>\n"])
    r = engine_row(tm36, [{"role": "user", "content": p[5]}], [(p[6], p[8])], thinking=True, max_tokens=40)
    cases["3_truncated_in_thinking"] = (q36, True, [r], [tm36.tokenizer.decode(list(r["output_token_ids"][0]),
                                                                               skip_special_tokens=False)])
    msgs = [{"role": "user", "content": "Q0 " + p[10]}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "Q1 " + p[11]}]
    r = engine_row(tm36, msgs, [("REASONING-0 " + p[20], "ANSWER-0"), ("REASONING-1 " + p[21], "ANSWER-1")], thinking=True)
    cases["4_all_turns_context_as_sent"] = (q36, True, [r], "no REASONING-0 in the row of turn 1")
    r = engine_row(tm36, [{"role": "user", "content": p[40]}], [(p[41], p[42])], thinking=True, noncanonical=0.3)
    cases["5_engine_ids_noncanonical"] = (q36, True, [r], [int(x) for x in r["output_token_ids"][0]])
    index = {}
    for name, (tok, thinking, rows, expect) in cases.items():
        t = pa.Table.from_pylist([{c: x.get(c) for c in PART_SCHEMA.names} for x in rows], schema=PART_SCHEMA)
        pq.write_table(t, out / f"{name}.parquet")
        index[name] = {"tokenizer": str(tok), "thinking": thinking, "expect": expect}
    (out / "cases.json").write_text(json.dumps(index))


CHECK = r'''
import json, sys
from pathlib import Path
import numpy as np, pyarrow.parquet as pq
import dflash_pipeline.steps.tokenize as T
from dflash_pipeline.steps.validate.tokencount import load_recounter
out = Path(sys.argv[1]); cases = json.loads((out / "cases.json").read_text()); fails = 0
for name, c in cases.items():
    table = pq.read_table(out / f"{name}.parquet")
    kw = {"min_loss_tokens": 1} if "min_loss_tokens" in T.TokenizeSettings.__dataclass_fields__ else {}
    S = T.TokenizeSettings(tokenizer=c["tokenizer"], enable_thinking=c["thinking"], **kw)
    rec = load_recounter(c["tokenizer"], lambda b, k: None, enable_thinking=c["thinking"])
    b = T.TrainingRowBuilder(rec, S) if hasattr(T, "TrainingRowBuilder") else T.ConversationTokenizer(rec, S)
    rows = T.tokenize_table(table, b)[0].to_pylist(); tok = rec.tokenizer; exp = c["expect"]
    def runs(r):
        m = np.asarray(r["loss_mask"]); e = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
        return [tok.decode(r["input_ids"][s:t], skip_special_tokens=False) for s, t in zip(e[::2], e[1::2])]
    if name.startswith("4"):
        text = tok.decode(rows[-1]["input_ids"], skip_special_tokens=False)
        ok = len(rows) == 2 and "REASONING-0" not in text
        got = f"{len(rows)} row(s); turn 0's reasoning in the row that trains turn 1: {'REASONING-0' in text}"
    elif name.startswith("5"):
        trained = [i for i, m in zip(rows[0]["input_ids"], rows[0]["loss_mask"]) if m]
        ok = trained[: len(exp)] == exp
        got = f"{sum(a != b for a, b in zip(trained, exp))} of {len(exp)} generated ids differ from the engine's"
    else:
        got_runs = [x for r in rows for x in runs(r)]; ok = got_runs == exp
        got = "trained " + repr([x[:20] + "..." + x[-22:] for x in got_runs])
    fails += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: {got}")
print(f"{fails} of {len(cases)} cases failed")
sys.exit(1 if fails else 0)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", type=Path, default=REPO, help="checkout whose include/ tokenizes (default: this one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenize-cases-") as tmp:
        write_cases(Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(args.code.resolve() / "include")}
        print(f"tokenizing with {args.code.resolve() / 'include'}", flush=True)
        return subprocess.run([sys.executable, "-c", CHECK, tmp], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
