"""The figures of issue 11 over the real-program cases of tests/test_programs.py.

    PYTHONPATH=src python tests/program_figures.py [--out /tmp/programs_report.txt]

For every case that must be diagnosed: was the first alarm at the right step (and of the
right kind), were op, cause and source right, were the weights protected; for the cases
whose exception has nothing to do with a value: was no incident reported. Prints one line
per case (nantrace's actual diagnosis where it is wrong) and the percentages.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_programs as tp  # noqa: E402

FIGURES = ("alarm", "op", "cause", "source", "protected")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    lines: list[str] = []
    totals = {k: 0 for k in FIGURES}
    n = 0
    unrelated_ok = unrelated_n = 0
    for name, fn in tp.CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    run, want = fn(Path(tmp))
            except Exception as exc:  # a case that could not run (a missing extra)
                lines.append(f"ERROR {name}: {type(exc).__name__}: {exc}")
                continue
            v = tp.verdict(run, want) if want is not None else None
        if want is None:
            unrelated_n += 1
            ok = not run.incidents
            unrelated_ok += ok
            lines.append(f"{'PASS' if ok else 'FAIL'} {name}: no incident expected"
                         + ("" if ok else f"; got {tp.describe(run.incidents[0])}"))
            continue
        n += 1
        for k in FIGURES:
            totals[k] += v[k]
        ok = all(v.values())
        main_incs = [i for i in run.incidents if i.action != "logged"]
        got = tp.describe(main_incs[0]) if main_incs else "no incident"
        wrong = ",".join(k for k, good in v.items() if not good)
        lines.append(f"{'PASS' if ok else 'FAIL'} {name}: want {want.kind}/{want.phase}/{want.op}/{want.module!r}/"
                     f"{want.cause}/{want.action} at step {want.step}"
                     + ("" if ok else f"\n     wrong: {wrong}\n     got:   {got}"))
    lines.append("")
    lines.append(f"figures over {n} real-program failures (zero-intrusive):")
    for k in FIGURES:
        lines.append(f"  {k:<10} {100.0 * totals[k] / max(n, 1):5.1f}%  ({totals[k]}/{n})")
    lines.append(f"  unrelated exceptions left alone (no incident): {unrelated_ok}/{unrelated_n}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
