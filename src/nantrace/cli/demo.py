"""``nantrace demo``: train a small transformer on the CPU until it meets a real failure."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import typer


def demo(
    out: Path = typer.Option(Path("nantrace-demo"), "--out", help="Run directory to write (replaced if it is an earlier demo run)."),
    steps: int = typer.Option(120, "--steps", min=20, help="Training steps."),
    fail_at: int = typer.Option(70, "--fail-at", min=1, help="Step whose batch holds a record emptied by a cleaning bug."),
    report: bool = typer.Option(True, "--report/--no-report", help="Also write the HTML report."),
) -> None:
    """Train a small transformer on synthetic data; one batch holds an empty record, whose fully
    masked attention row turns the loss NaN. nantrace blocks that update, explains it, and the
    run goes on."""
    import torch
    import torch.nn.functional as F
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import nantrace

    from ..console import CONSOLE
    from ..console import error as console_error
    from ..demo.data import make_batch
    from ..demo.model import DemoTransformer

    if fail_at >= steps:
        raise typer.BadParameter(f"--fail-at ({fail_at}) must be below --steps ({steps})")
    if out.exists():
        if (out / "nantrace.db").exists():
            shutil.rmtree(out)
        elif any(out.iterdir()):
            console_error(f"{out} exists and is not a nantrace run directory; choose another --out")
            raise typer.Exit(2)
    torch.manual_seed(0)
    model = DemoTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = nantrace.watch(model, optimizer, run_dir=out)
    CONSOLE.print(f"[bold]nantrace demo[/bold]: a 2-layer transformer classifier, {steps} steps on synthetic data (CPU)")
    start = time.perf_counter()
    losses: list[float] = []
    with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                  TimeElapsedColumn(), console=CONSOLE, transient=False) as progress:
        task = progress.add_task("train", total=steps, loss="-")
        for step in range(steps):
            tokens, labels = make_batch(step, empty_at=fail_at)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(tokens), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            progress.update(task, advance=1, loss=f"{loss.item():.4f}")
    guard.close()
    with torch.no_grad():
        correct = total = 0
        for step in range(10_000, 10_008):
            tokens, labels = make_batch(step)
            correct += int((model(tokens).argmax(-1) == labels).sum())
            total += labels.numel()
    finite = [l for l in losses[-10:] if l == l]
    CONSOLE.print(
        f"\nTrained {steps} steps in {time.perf_counter() - start:.1f}s: {len(guard.incidents)} incident(s), "
        f"{sum(1 for i in guard.incidents if i.action == 'skipped')} update(s) skipped; "
        f"final loss {sum(finite) / max(len(finite), 1):.3f}, held-out accuracy {correct / total:.0%}. Training went on."
    )
    CONSOLE.print(f"Run directory: [bold]{out}[/bold] (run store {out / 'nantrace.db'})")
    bundles = [i.bundle for i in guard.incidents if i.bundle]
    if bundles:
        CONSOLE.print(f"Reproduce the failure anywhere: [bold]nantrace replay {bundles[0]}[/bold]", soft_wrap=True)
    if report:
        try:
            from ..report.render import render_report
        except ImportError:
            return
        path = render_report(out, out / "report.html")
        CONSOLE.print(f"Report: [bold]{path}[/bold]", soft_wrap=True)
