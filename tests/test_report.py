"""The HTML report (``nantrace report``): content, non-finite values, downsampling, errors, CLI."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import nantrace
from nantrace.incident import Incident
from nantrace.report import render_report
from nantrace.report.data import load_report_data, read_snippet
from nantrace.report.figures import encode_heatmap
from nantrace.storage.runstore import DB_NAME, RunStore

pytest.importorskip("plotly")

NAN, INF = float("nan"), float("inf")
NAN_STEP = 6


# ----------------------------------------------------------------------------- helpers
class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # <origin> NaN for a negative feature


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = LogFeatures()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.features(x))


def _origin_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if "# <origin>" in line)


def _train_real(run_dir: Path, steps: int = 12) -> list[Incident]:
    """A real watched run: a negative feature at NAN_STEP makes torch.log produce NaN in 'features'."""
    torch.manual_seed(0)
    model = LogNet()
    opt = torch.optim.SGD([{"params": model.body[0].parameters(), "lr": 0.05},
                           {"params": model.body[2].parameters(), "lr": 0.01}])
    guard = nantrace.watch(model, opt, run_dir=run_dir, config=nantrace.Config(print_incidents=False))
    for step in range(steps):
        x = torch.rand(8, 4) + 0.5
        if step == NAN_STEP:
            x[2, 1] = -1.0
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    guard.close()
    return list(guard.incidents)


def _incident(step: int, **fields: object) -> Incident:
    base: dict[str, object] = dict(step=step, kind="nonfinite_grad", phase="backward", op="aten.sqrt.default",
                                   module="enc.norm", source=None, rank=0, cause="grad_singularity",
                                   summary="sqrt at 0 in backward", fix="add eps inside the sqrt", action="skipped")
    base.update(fields)
    return Incident(**base)  # type: ignore[arg-type]


def _synthetic(run_dir: Path, steps: int, *, loss=None, grad=None, layers: int = 0, layer_fn=None,
               incidents: tuple[Incident, ...] = (), skipped: set[int] | frozenset[int] = frozenset(),
               scale=None, activations: int = 0) -> Path:
    """A run store written with RunStore's own methods (the guard's path), for edge cases."""
    with RunStore(run_dir) as store:
        store.set_meta("model_class", "Synthetic")
        store.set_meta("optimizer_class", "AdamW")
        store.set_meta("policy", "skip")
        store.set_meta("num_parameters", 1234)
        if layers:
            store.set_meta("layer_names", [f"layers.{i}" for i in range(layers)])
        if activations:
            store.set_meta("activation_names", [f"act.{i}" for i in range(activations)])
        for s in range(steps):
            store.log_step(step=s, loss=loss(s) if loss else 1.0 / (s + 1), grad_norm=grad(s) if grad else 1.0,
                           param_norm=10.0, lr=[1e-3], scale=scale(s) if scale else None, skipped=s in skipped,
                           action="skipped" if s in skipped else None, wall_time=1000.0 + s)
            if layers:
                store.log_layer_stats(s, [(i, *layer_fn(s, i)) for i in range(layers)] if layer_fn else
                                      [(i, 1.0, 1.0, 1e-3) for i in range(layers)])
            if activations and s % 2 == 0:
                store.log_activation_stats(s, [(i, 2.0 if i else INF, 1 if (i == 0 and s == 4) else 0)
                                               for i in range(activations)])
        for inc in incidents:
            store.log_incident(inc)
    return run_dir


def _figures(page: str) -> dict[str, dict]:
    m = re.search(r'<script type="application/json" id="nantrace-figures">(.*?)</script>', page, re.S)
    assert m, "figure data block missing"
    return {spec["div"]: spec["figure"] for spec in json.loads(m.group(1))}


def _trace(fig: dict, prefix: str) -> dict:
    return next(t for t in fig["data"] if str(t.get("name", "")).startswith(prefix))


def _array(value: object) -> list[float]:
    if isinstance(value, dict):  # plotly's typed-array encoding of numpy arrays
        import base64

        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"])).tolist()
    return [math.nan if v is None else v for v in value]  # type: ignore[union-attr]


def _xs(trace: dict) -> list[float]:
    return _array(trace["x"])


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Incident]]:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    return run_dir, _train_real(run_dir)


# ----------------------------------------------------------------------------- real run
def test_real_run_report_has_the_incident_card_curves_and_embedded_plotly(real_run):
    run_dir, incidents = real_run
    [incident] = incidents
    assert (incident.step, incident.op, incident.module, incident.cause) == (NAN_STEP, "aten.log.default", "features",
                                                                              "log_nonpositive")
    path = render_report(run_dir)
    assert path == run_dir / "report.html"
    page = path.read_text(encoding="utf-8")

    card = page[page.index(f'id="incident-{incident.id}"'):]
    card = card[:card.index("</article>")]
    for text in ("aten.log.default", "features", "log_nonpositive", "nonfinite_loss", "forward",
                 "skipped", f"step {NAN_STEP}"):
        assert text in card, text
    from html import escape

    assert escape(incident.fix) in card and escape(incident.summary) in card
    # the code snippet: the origin line of this file, highlighted, HTML-escaped
    line = _origin_line()
    assert f":{line}</figcaption>" in card
    assert re.search(rf'<span class="hl"><span class="ln">{line}</span>\s*return torch\.log\(x\)', card)
    # chain, input statistics and the health figures leading up to it
    assert "Chain (origin" in card and "Inputs of the origin op" in card and "Leading up to it" in card
    assert '<svg class="spark"' in card and "NaN" in card
    if incident.bundle:
        assert incident.bundle in card

    # header facts
    assert "LogNet" in page and "SGD" in page and "skip" in page
    # curves with the incident marked, lr per param group, plotly embedded once, nothing remote
    figs = _figures(page)
    assert {"curve-loss", "curve-norms", "curve-lr"} <= set(figs)
    assert _xs(_trace(figs["curve-loss"], "NaN")) == [NAN_STEP]
    marker = _trace(figs["curve-loss"], "incident")
    assert _xs(marker) == [NAN_STEP] and marker["customdata"] == [incident.id]
    assert [t["name"] for t in figs["curve-lr"]["data"] if t["name"].startswith("lr")] == ["lr (group 0)", "lr (group 1)"]
    assert _xs(_trace(figs["curve-loss"], "update skipped")) == [NAN_STEP]
    assert page.count("<script") == 3  # plotly.js, the figure data, the page script
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert not re.search(r"""<link[^>]*href=["']?https?:""", page)
    assert "Plotly.newPlot" in page and "plotly.js" in page.lower()


def test_default_output_replaced_atomically_and_o_anywhere(real_run, tmp_path, monkeypatch):
    run_dir, _ = real_run
    target = tmp_path / "deep" / "er" / "r.html"
    assert render_report(run_dir, target) == target and target.stat().st_size > 1_000_000
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    # a failure while writing leaves the previous report whole and no temporary file behind
    before = target.read_bytes()
    import nantrace.report.render as render_mod

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(render_mod.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        render_report(run_dir, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.html"]
    # a directory as output gets report.html inside it
    monkeypatch.undo()
    assert render_report(run_dir, tmp_path) == tmp_path / "report.html"


def test_missing_or_foreign_directory_is_a_clear_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        render_report(tmp_path / "nope")
    with pytest.raises(ValueError, match="nantrace.db"):
        render_report(tmp_path)
    (tmp_path / DB_NAME).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ValueError, match="not a readable nantrace run store"):
        render_report(tmp_path)
    assert not (tmp_path / "report.html").exists()


def test_path_to_the_database_itself_is_accepted(real_run, tmp_path):
    run_dir, _ = real_run
    out = render_report(run_dir / DB_NAME, tmp_path / "x.html")
    assert "LogNet" in out.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- edge cases
def test_nonfinite_values_are_marked_not_dropped(tmp_path):
    nan_steps, inf_steps = {3, 9}, {5}
    run = _synthetic(
        tmp_path, 20,
        loss=lambda s: NAN if s in nan_steps else (INF if s in inf_steps else 1.0),
        grad=lambda s: INF if s == 9 else (0.0 if s == 12 else 1.0),
        scale=lambda s: 65536.0 if s < 10 else NAN,
        skipped=nan_steps | inf_steps,
        incidents=(_incident(9, kind="nonfinite_loss", history=[{"step": 8, "loss": 1.0, "grad_norm": "inf"},
                                                                {"step": 9, "loss": "nan", "grad_norm": "inf"}]),),
    )
    figs = _figures(render_report(run).read_text(encoding="utf-8"))
    loss = figs["curve-loss"]
    assert _xs(_trace(loss, "NaN")) == sorted(nan_steps)
    assert _xs(_trace(loss, "+Inf")) == sorted(inf_steps)
    # the line itself breaks at the non-finite steps instead of drawing a made-up value
    line = _trace(loss, "loss")
    drawn = dict(zip(_xs(line), _array(line["y"])))
    assert all(math.isnan(drawn[s]) for s in nan_steps | inf_steps) and drawn[4] == 1.0
    norms = figs["curve-norms"]
    assert _xs(_trace(norms, "+Inf")) == [9]
    assert _xs(_trace(norms, "≤ 0")) == [12]  # zero cannot sit on the log axis: marked instead
    assert _xs(_trace(figs["curve-scale"], "NaN")) == list(range(10, 20))


def test_history_strings_nan_inf_render_as_nonfinite(tmp_path):
    inc = _incident(4, history=[{"step": 2, "loss": 0.5, "grad_norm": 1.0}, {"step": 3, "loss": "nan", "grad_norm": "inf"}],
                    input_stats=[{"arg": "arg0", "dtype": "float32", "shape": [2, 3], "min": "-inf", "max": 3.0,
                                  "min_abs": 0.0, "zeros": 1, "negatives": 2, "nan": 0, "inf": 2}])
    page = render_report(_synthetic(tmp_path, 6, incidents=(inc,))).read_text(encoding="utf-8")
    card = page[page.index(f'id="incident-{inc.id}"'):]
    assert '<span class="nonfinite">NaN</span>' in card and '<span class="nonfinite">+Inf</span>' in card
    assert '<span class="nonfinite">-Inf</span>' in card  # input stats min
    assert "<title>step 3: loss = NaN</title>" in card  # the sparkline's red dot


def test_no_incidents_no_layer_stats(tmp_path):
    page = render_report(_synthetic(tmp_path, 30)).read_text(encoding="utf-8")
    assert "No incidents" in page and '<article class="card' not in page
    assert "No per-layer statistics" in page
    figs = _figures(page)
    assert not any(k.startswith("heatmap-") for k in figs)
    assert not any(str(t.get("name", "")).startswith(("NaN", "incident")) for t in figs["curve-loss"]["data"])


def test_empty_run_renders(tmp_path):
    with RunStore(tmp_path):
        pass
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert "No steps were recorded" in page and "No incidents" in page
    assert _figures(page) == {}


def test_layer_heatmaps_show_dead_layers_and_nonfinite_cells(tmp_path):
    def layer_fn(s: int, i: int) -> tuple[float, float, float]:
        if i == 2:
            return 0.0, 1.0, 0.0  # a dead layer
        if s == 7 and i == 1:
            return NAN, 1.0, NAN
        if s == 8 and i == 0:
            return INF, 1.0, 1e-3
        return 10.0 ** (i - 1), 1.0, 1e-3

    run = _synthetic(tmp_path, 20, layers=4, layer_fn=layer_fn, activations=3)
    data = load_report_data(run)
    grad = next(h for h in data.heatmaps if h.key == "layer_grad_norm")
    assert grad.layers == ["layers.0", "layers.1", "layers.2", "layers.3"] and grad.values.shape == (4, 20)
    col = {int(s): c for c, s in enumerate(grad.start)}
    assert math.isnan(grad.values[1, col[7]]) and math.isinf(grad.values[0, col[8]])
    assert (grad.values[2] == 0).all()
    enc = encode_heatmap(grad.values, grad.present)
    z_zero, z_inf, z_nan = enc.tickvals[0], enc.tickvals[-2], enc.tickvals[-1]
    assert enc.ticktext[0] == "0" and enc.ticktext[-2:] == ["Inf", "NaN"]
    assert enc.z[2, 0] == pytest.approx(z_zero) and enc.z[1, col[7]] == pytest.approx(z_nan)
    assert enc.z[0, col[8]] == pytest.approx(z_inf)
    finite = enc.z[np.isfinite(grad.values) & (grad.values > 0)]
    assert (finite > z_zero).all() and (finite < z_inf).all()  # Viridis range apart from the special bands
    act = next(h for h in data.heatmaps if h.key == "activation_absmax")
    assert math.isinf(act.values[0, 0]) and math.isnan(act.values[0, 2])  # step 4: 1 non-finite output

    page = render_report(run).read_text(encoding="utf-8")
    figs = _figures(page)
    assert {"heatmap-layer_grad_norm", "heatmap-layer_update_ratio", "heatmap-activation_absmax"} <= set(figs)
    assert _xs(_trace(figs["heatmap-layer_grad_norm"], "non-finite")) == [7, 8]


def test_every_chart_shares_the_step_range_and_sampled_heatmaps_fill_it(tmp_path):
    """The activation heatmap (sampled every 2nd step here) draws only its measured columns,
    on the same x range and plot width as the curves; the root module's row is labelled."""
    run = _synthetic(tmp_path, 20, layers=3, activations=3)
    with RunStore(run) as store:  # the guard names the model itself '' and a never-called container
        store.set_meta("activation_names", ["", "blocks", "blocks.0"])
        store.log_activation_stats(0, [(0, 2.0, 0), (2, 3.0, 0)])
        store._conn.execute("DELETE FROM activation_stats WHERE layer = 1")
    figs = _figures(render_report(run).read_text(encoding="utf-8"))
    ranges = {div: fig["layout"]["xaxis"]["range"] for div, fig in figs.items()}
    assert set(map(tuple, ranges.values())) == {(-0.5, 19.5)}, ranges
    margins = {(fig["layout"]["margin"]["l"], fig["layout"]["margin"]["r"]) for fig in figs.values()}
    assert len(margins) == 1  # plot areas line up one above the other
    act = figs["heatmap-activation_absmax"]
    heat = next(t for t in act["data"] if t["type"] == "heatmap")
    assert _array(heat["x"]) == list(range(0, 20, 2))  # measured columns only: no blank ones between them
    assert heat["y"] == ["(model)", "blocks.0"]  # the root labelled, the never-measured container left out
    assert "measured every 2 steps" in _figure_titles(run)["heatmap-activation_absmax"]
    assert "1 never-measured row not shown" in _figure_titles(run)["heatmap-activation_absmax"]


def test_log_axes_are_labelled_at_powers_of_ten(tmp_path):
    run = _synthetic(tmp_path, 30, grad=lambda s: 10.0 ** (s % 5 - 2))
    norms = _figures(render_report(run).read_text(encoding="utf-8"))["curve-norms"]
    assert (norms["layout"]["yaxis"]["type"], norms["layout"]["yaxis"]["dtick"]) == ("log", 1)
    linear, log = norms["layout"]["updatemenus"][0]["buttons"]
    assert linear["args"][0]["yaxis.dtick"] is None and log["args"][0]["yaxis.dtick"] == 1


def test_an_interrupted_run_says_so(tmp_path):
    import signal

    script = (f"import os, signal, torch, nantrace\nm = torch.nn.Linear(2, 1)\no = torch.optim.SGD(m.parameters(), "
              f"lr=0.1)\ng = nantrace.watch(m, o, run_dir={str(tmp_path)!r})\nfor _ in range(4):\n    o.zero_grad()\n"
              f"    m(torch.randn(3, 2)).sum().backward()\n    o.step()\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert '<span class="nonfinite">interrupted</span>' in page
    assert re.search(r"This run was interrupted: its process \(pid \d+\) ended without closing the run \(killed, or "
                     r"the machine went down\)\. The report shows every step recorded, up to step 3\.", page)


def test_paths_are_shown_relative_to_the_run_working_directory(real_run, tmp_path, monkeypatch):
    run_dir, incidents = real_run
    monkeypatch.chdir(run_dir.parent)
    page = render_report(run_dir, tmp_path / "r.html").read_text(encoding="utf-8")
    assert f"run directory <code>{run_dir.name}</code>" in page
    assert str(run_dir.parent) not in page.replace(str(run_dir.parent / run_dir.name), "")


def _figure_titles(run: Path) -> dict[str, str]:
    page = (run / "report.html").read_text(encoding="utf-8")
    return {m.group(2): m.group(1) for m in re.finditer(
        r'<h3 class="plot-title">(.*?)</h3><div class="plotly-target" id="(.*?)">', page)}


def test_downsampling_keeps_extremes_incidents_and_every_nonfinite_value(tmp_path):
    steps = 30_000
    rng = np.random.default_rng(0)
    noise = rng.uniform(0.9, 1.1, steps)
    spike, incident_step = 12_345, 23_456
    nan_steps = set(range(5_000, 5_000 + 2_500)) | {29_999}  # more than are marked one by one
    loss = lambda s: NAN if s in nan_steps else (1e3 if s == spike else float(noise[s]))  # noqa: E731
    inc = _incident(incident_step, kind="loss_spike", cause="loss_divergence", phase=None, op=None, module=None,
                    action="logged")
    run = _synthetic(tmp_path, steps, loss=loss, incidents=(inc,))
    data = load_report_data(run, max_curve_buckets=500)
    assert data.downsampled
    curve = next(c for c in data.curves if c.key == "loss")
    assert len(curve.x) <= 3 * 500 + 10
    assert np.nanmax(curve.y) == 1e3 and spike in curve.x.tolist()  # the spike survives
    assert incident_step in curve.x.tolist()  # the incident step is drawn at its real value
    assert curve.nan.total == len(nan_steps) and not curve.nan.exact  # counted per bucket, none lost
    assert curve.nan.start.min() <= 5_000 and curve.nan.end.max() == 29_999
    # buckets without a finite value break the line
    inside = (curve.x > 5_100) & (curve.x < 7_400)
    assert np.isnan(curve.y[inside]).all()
    few = load_report_data(run, max_curve_buckets=500, max_exact_marks=10_000)
    assert few.curves[0].nan.exact and sorted(few.curves[0].nan.start.tolist()) == sorted(nan_steps)


def test_heatmap_is_bucketed_and_sampling_keeps_special_steps(tmp_path):
    steps, layers = 3_000, 5
    bad_step = 1_501  # not on the sampling stride, but its global grad norm is NaN

    def layer_fn(s: int, i: int) -> tuple[float, float, float]:
        if s == bad_step and i == 3:
            return NAN, 1.0, 1e-3
        return 1.0 + i, 1.0, 1e-3

    run = _synthetic(tmp_path, steps, layers=layers, layer_fn=layer_fn, grad=lambda s: NAN if s == bad_step else 1.0)
    exact = load_report_data(run, max_heatmap_columns=100)
    grad = exact.heatmaps[0]
    assert grad.values.shape == (layers, 100) and grad.bucket_width == 30 and grad.stride == 1
    assert grad.rows_read == steps * layers
    col = int(np.searchsorted(grad.start, bad_step, side="right") - 1)
    assert math.isnan(grad.values[3, col]) and grad.nonfinite_cells == 1
    assert grad.values[4, 0] == 5.0
    sampled = load_report_data(run, max_heatmap_columns=100, max_exact_layer_rows=steps * layers // 4)
    grad = sampled.heatmaps[0]
    assert grad.stride == 4 and grad.rows_read < steps * layers // 3
    assert math.isnan(grad.values[3, col]) and grad.nonfinite_cells == 1
    page = render_report(run, tmp_path / "s.html").read_text(encoding="utf-8")
    assert "max over buckets of 3 steps" in page  # 3,000 steps into at most 1,000 columns
    assert "recorded step was read" not in page
    page = render_report(run, tmp_path / "t.html", max_exact_layer_rows=5_000).read_text(encoding="utf-8")
    assert "every 3rd recorded step was read (" in page
    assert "every 3rd step read" in page


@pytest.mark.slow
def test_large_run_renders_fast_and_small(tmp_path):
    """20,000 steps × 100 layers (2 M rows) through the benchmark's writer: fast, bounded, marks kept."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location(
        "report_scale", Path(__file__).resolve().parents[1] / "benchmarks" / "report_scale.py")
    bench = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(bench)
    bench.write_store(tmp_path, 20_000, 100)
    start = time.perf_counter()
    out = render_report(tmp_path)
    elapsed = time.perf_counter() - start
    assert elapsed < 30 and out.stat().st_size < 20e6
    figs = _figures(out.read_text(encoding="utf-8"))
    assert _xs(_trace(figs["curve-loss"], "NaN")) == [5_000]  # the benchmark's NaN step (25 %)
    assert _xs(_trace(figs["curve-norms"], "+Inf")) == [12_200]  # the end of its explosion (61 %)
    heat = figs["heatmap-layer_grad_norm"]
    assert _xs(_trace(heat, "non-finite")) == [5_000, 12_200]  # buckets of 20 steps starting there


def test_untrusted_text_is_escaped(tmp_path):
    evil = "</script><script>alert('x')</script><b>"
    inc = _incident(2, summary=evil, fix=evil, module=evil, op=evil, source=f"{evil}.py:1",
                    chain=[{"op": evil, "module": evil, "phase": "backward", "source": evil, "origin": True}],
                    details={"note": evil})
    run = _synthetic(tmp_path, 5, incidents=(inc,), layers=2)
    with RunStore(run) as store:
        store.set_meta("model_class", evil)
        store.set_meta("layer_names", [evil, "ok"])
    page = render_report(run).read_text(encoding="utf-8")
    assert "<script>alert" not in page and "<b>" not in page
    figs = _figures(page)  # the JSON block still parses: no value closed the script element
    assert figs["heatmap-layer_grad_norm"]["data"][0]["y"][0] == evil


def test_read_snippet_finds_relative_sources(tmp_path, monkeypatch):
    project = tmp_path / "proj"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "model.py").write_text("a = 1\nb = 2\nc = x.log()\nd = 4\n")
    run_dir = project / "runs" / "r1"
    run_dir.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    snip = read_snippet("pkg/model.py:3", run_dir)  # found from the run directory's parents
    assert snip is not None and snip.line == 3 and (3, "c = x.log()") in snip.lines and snip.lines[0][0] == 1
    assert read_snippet("pkg/model.py:99", run_dir) is None
    assert read_snippet("elsewhere.py:3", run_dir) is None
    assert read_snippet(None, run_dir) is None and read_snippet("no-line", run_dir) is None
    assert read_snippet("model.py:3", run_dir, {"cwd": str(project / "pkg")}) is not None


# ----------------------------------------------------------------------------- CLI
def _app():
    import typer

    from nantrace.cli.report import report_command

    app = typer.Typer(add_completion=False)
    app.command("report")(report_command)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps "report" a subcommand, as in the real CLI
        pass

    return app


def test_cli_report_command(real_run, tmp_path):
    from typer.testing import CliRunner

    run_dir, _ = real_run
    runner = CliRunner()
    out = tmp_path / "cli.html"
    result = runner.invoke(_app(), ["report", str(run_dir), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert str(out) in result.stdout and out.stat().st_size > 1_000_000
    result = runner.invoke(_app(), ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
    result = runner.invoke(_app(), ["report", "--help"])
    assert result.exit_code == 0 and "--output" in result.output


def _registered() -> bool:
    from nantrace.cli.main import app

    return any(c.name == "report" for c in app.registered_commands)


@pytest.mark.xfail(not _registered(), reason="`nantrace report` is not registered in cli/main.py yet", strict=False)
def test_cli_subprocess(real_run, tmp_path):
    run_dir, _ = real_run
    out = tmp_path / "sub.html"
    env = dict(os.environ, COLUMNS="200")
    done = subprocess.run([sys.executable, "-m", "nantrace.cli.main", "report", str(run_dir), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert out.is_file() and str(out) in done.stdout
    bad = subprocess.run([sys.executable, "-m", "nantrace.cli.main", "report", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_a_pointer_incident_names_the_rank_holding_the_bundle_and_reads_nothing_of_it(tmp_path):
    """Rank 0's report under ``bundle_ranks="origin"``: the card links the pointer, says which rank
    holds the full bundle, and the report reads neither that rank's store nor its bundle."""
    pointer = str(tmp_path / "incidents" / "step000004-nonfinite_grad-p")
    inc = _incident(4, bundle=pointer, details={"origin_ranks": [3], "bundle_pointer": {
        "holder_ranks": [3], "incidents": {"3": "../../rank3/incidents"}, "bundle_prefix": "step000004-"}})
    page = render_report(_synthetic(tmp_path, 6, incidents=(inc,))).read_text(encoding="utf-8")
    card = page[page.index(f'id="incident-{inc.id}"'):]
    from nantrace.console import display_path

    shown = display_path(pointer)  # as the card shows paths: relative to the working directory when under it
    assert (f"<dd><code>{shown}</code> (a pointer: rank 3 holds the full bundle; nantrace replay follows it)</dd>"
            in card)
    assert f"Reproduce: <code>nantrace replay {shown}</code>" in card
