"""``nantrace demo``: train a small transformer on the CPU until it meets a real failure.

Progress goes to stderr; the diagnosis and the summary (what happened, where the run
directory and the report are, the command that replays the failure) go to stdout, so
``nantrace demo > demo.log`` keeps the results.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import typer

from ..taxonomy import Action

SHORT_HELP = "Train a small transformer on the CPU until it meets a real NaN; see the diagnosis."
DEMO_MODEL = "DemoTransformer"


def demo(
    out: Path = typer.Option(Path("nantrace-demo"), "--out", metavar="DIR",
                             help="Run directory to write (replaced if it holds an earlier demo run)."),
    steps: int = typer.Option(120, "--steps", min=20, metavar="N", help="Training steps."),
    fail_at: int = typer.Option(70, "--fail-at", min=1, metavar="STEP",
                                help="Step whose batch holds a record emptied by a cleaning bug."),
    report: bool = typer.Option(True, "--report/--no-report", help="Also write the HTML report."),
) -> None:
    """Train a small transformer on synthetic data until one batch turns the loss NaN.

    One batch holds a record emptied by a cleaning bug: its fully masked attention row makes
    softmax return NaN. nantrace blocks that update, explains which op, module and line
    produced the NaN and why, and the run goes on. Writes the run directory (run store,
    incident bundle) and the HTML report.
    """
    import torch
    import torch.nn.functional as F
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import nantrace

    from ..console import CONSOLE, OUT, display_path, print_incident
    from ..demo.data import make_batch
    from ..demo.model import DemoTransformer
    from ._invocation import nantrace_command

    if fail_at >= steps:
        raise typer.BadParameter(f"--fail-at ({fail_at}) must be below --steps ({steps})")
    _clear(out)
    torch.manual_seed(0)
    model = DemoTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = nantrace.watch(model, optimizer, run_dir=out, config=nantrace.Config(outputs={"print_incidents": False}))
    CONSOLE.print(f"[bold]nantrace demo[/bold]: a 2-layer transformer classifier, {steps} steps on synthetic data (CPU)",
                  soft_wrap=True)
    start = time.perf_counter()
    losses: list[float] = []
    with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                  TextColumn("incidents {task.fields[incidents]}"), TimeElapsedColumn(),
                  console=CONSOLE, transient=False) as progress:
        task = progress.add_task("train", total=steps, loss="-", incidents=0)
        for step in range(steps):
            tokens, labels = make_batch(step, empty_at=fail_at)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(tokens), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            progress.update(task, advance=1, loss=f"{loss.item():.4f}", incidents=len(guard.incidents))
    guard.close()
    with torch.no_grad():
        correct = total = 0
        for step in range(10_000, 10_008):
            tokens, labels = make_batch(step)
            correct += int((model(tokens).argmax(-1) == labels).sum())
            total += labels.numel()
    for incident in guard.incidents:
        print_incident(incident, OUT)
    finite = [l for l in losses[-10:] if l == l]
    skipped = sum(1 for i in guard.incidents if i.action == Action.SKIPPED)
    say = lambda text: OUT.print(text, soft_wrap=True, highlight=False)  # noqa: E731
    say(f"Trained {steps} steps in {time.perf_counter() - start:.1f}s: {len(guard.incidents)} incident(s), "
        f"{skipped} update(s) skipped; final loss {sum(finite) / max(len(finite), 1):.3f}, "
        f"held-out accuracy {correct / total:.0%}. Training went on.")
    say(f"Run directory: [bold]{display_path(str(out))}[/bold] (run store {display_path(str(out / 'nantrace.db'))})")
    command = nantrace_command()
    bundles = [i.bundle for i in guard.incidents if i.bundle]
    if bundles:
        say(f"Reproduce the failure anywhere: [bold]{command} replay {display_path(bundles[0])}[/bold]")
    if report:
        try:
            from ..report.render import render_report
        except ImportError:
            say(f"No HTML report: it needs plotly (pip install 'nantrace[report]'), then {command} report {out}")
            return
        path = render_report(out, out / "report.html")
        say(f"Report: [bold]{display_path(str(path))}[/bold] (open it in a browser)")


def _clear(out: Path) -> None:
    """Remove an earlier demo run in ``out``; refuse (exit 2) to touch anything else."""
    from ..console import error as console_error
    from ..storage.runstore import DB_NAME, RunStore

    if not out.exists():
        return
    if not out.is_dir():
        console_error(f"--out {out} is a file; choose a directory")
        raise typer.Exit(2)
    if (out / DB_NAME).exists():
        try:
            with RunStore(out, readonly=True) as store:
                model = store.get_meta("model_class")
        except ValueError:
            model = None
        if model == DEMO_MODEL:
            shutil.rmtree(out)
            return
        console_error(f"{out} holds a nantrace run that is not a demo run ({model}); choose another --out")
        raise typer.Exit(2)
    if any(out.iterdir()):
        console_error(f"{out} exists and is not a nantrace run directory; choose another --out")
        raise typer.Exit(2)
