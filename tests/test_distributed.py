"""Data-parallel training under torchrun: two gloo processes on the CPU."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[1] / "src"
SCRIPT = Path(__file__).with_name("ddp_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)  # a hang fails here


SYNC_FREE_SCRIPT = Path(__file__).with_name("sync_free_script.py")
BATCHED: dict[str, list[tuple[str, ...]]] = {
    # script -> the jobs (its arguments after the output directory: policy[, bundle_ranks]) run in one launch.
    # A job whose test reads absolute paths the run store wrote (the pointer job) is launched on its own.
    SCRIPT.name: [(s, "skip") for s in ("nan_input_rank1", "rewatch_nan_rank1", "loss_spike_rank1", "broken_rank1",
                                        "fsdp_nan_input_rank1", "fsdp_log_rank1", "fsdp_sqrt_rank1",
                                        "fsdp_lossfn_rank1", "ddp_sqrt_rank1", "fsdp_numerics",
                                        "fsdp_raise_together", "ddp_reads", "fsdp_reads")]
                 + [("broken_rank1", "rollback"), ("nan_input_rank1", "raise")],
    SYNC_FREE_SCRIPT.name: [(s, "skip") for s in ("ddp", "fsdp", "fsdp_log_rank1", "fsdp_sqrt_rank1",
                                                  "ddp_sqrt_rank1", "ddp_divergence")],
}
_batches: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


def _batch(script: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """Every job of ``BATCHED[script.name]`` run once per session in one torchrun launch (tests/gloo_batch.py):
    the output directory (one sub-directory per job) and the launch."""
    if script.name not in _batches:
        root = Path(tempfile.mkdtemp(prefix="nantrace-gloo-"))
        atexit.register(shutil.rmtree, root, True)
        jobs = []
        for i, (scenario, *rest) in enumerate(BATCHED[script.name]):
            out = root / str(i)
            out.mkdir()
            jobs.append([str(script), [scenario, rest[0], str(out), *rest[1:]] if script == SCRIPT
                         else [scenario, rest[0], str(out)]])
        (root / "jobs.json").write_text(json.dumps(jobs))
        _batches[script.name] = root, _launch([str(Path(__file__).with_name("gloo_batch.py")), str(root / "jobs.json")],
                                              timeout=600)
    return _batches[script.name]


def _torchrun(tmp_path: Path, scenario: str, policy: str = "skip", bundle_ranks: str | None = None,
              script: Path = SCRIPT) -> list[dict]:
    """Two gloo processes run ``script``'s ``scenario``; each rank's results (``rank{r}.json``) and whatever it
    wrote are in ``tmp_path``. A job listed in ``BATCHED`` comes from its script's one batched launch (copied)."""
    job = (scenario, policy) + ((bundle_ranks,) if bundle_ranks else ())
    if job in BATCHED.get(script.name, ()):
        root, proc = _batch(script)
        out = root / str(BATCHED[script.name].index(job))
        assert all((out / f"rank{r}.json").is_file() for r in range(2)), proc.stdout[-3000:] + proc.stderr[-3000:]
        shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    else:
        proc = _launch([str(script), scenario, policy, str(tmp_path)] + ([bundle_ranks] if bundle_ranks else []))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("scenario", ["nan_input_rank1", "rewatch_nan_rank1"])
def test_nan_on_rank1_only_is_attributed_to_rank1_and_every_rank_skips(tmp_path, scenario):
    # rewatch: a guard closed earlier left its (unremovable) comm hook; the new guard takes it over
    results = _torchrun(tmp_path, scenario)
    for res in results:
        assert res["local_grad_check"] is True
        assert res["replicas_equal"] and res["finite"] and res["steps"] == 8
        assert res["layer_norms_match"] is True and res["monitor_failures"] == []
        [incident] = res["incidents"]
        step, kind, rank, action = incident[:4]
        assert (step, rank, action) == (3, 1, "skipped")
    # rank 1 saw its own bad batch; rank 0 only received NaN gradients through the all-reduce
    assert results[1]["incidents"][0][1] == "nonfinite_input" and results[1]["incidents"][0][4] == "nonfinite_input"
    assert results[1]["incidents"][0][7] == "data"
    assert results[0]["incidents"][0][1] == "nonfinite_grad"
    assert results[0]["run_dir"].endswith("run") and results[1]["run_dir"].endswith(os.path.join("run", "rank1"))
    assert (tmp_path / "run" / "nantrace.db").is_file() and (tmp_path / "run" / "rank1" / "nantrace.db").is_file()


def test_bundles_replay_to_the_origin_rank_never_to_a_transient(tmp_path):
    """Rank 0 only received rank 1's NaN through the all-reduce: its bundle replays to "came from
    rank 1", not to "transient"; rank 1's own bundle replays to its bad batch."""
    import torch
    from torch import nn

    import nantrace

    _torchrun(tmp_path, "nan_input_rank1")
    [received] = sorted((tmp_path / "run" / "incidents").iterdir())
    [own] = sorted((tmp_path / "run" / "rank1" / "incidents").iterdir())
    again = nantrace.replay(received)
    assert (again.rank, again.transient, again.details["received_from_rank"]) == (1, None, 1)
    assert "came from rank 1" in again.summary and "transient" not in again.summary.lower()
    assert str(own.parent) in again.fix
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    origin = nantrace.replay(own, model=model)
    assert (origin.cause, origin.transient) == ("nonfinite_input", False), origin.summary


@pytest.fixture(scope="module")
def pointer_job(tmp_path_factory) -> Path:
    """One job with ``bundle_ranks="origin"``: rank 1's batch holds a NaN at step 3 (read only)."""
    out = tmp_path_factory.mktemp("pointer_job")
    _torchrun(out, "nan_input_rank1", bundle_ranks="origin")
    return out


def _replay_cli(target: Path, *, cwd: Path) -> subprocess.CompletedProcess:
    """``nantrace replay TARGET --model ddp_script:make_model``, as a user runs it."""
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "nantrace", "replay", str(target), "--model", "ddp_script:make_model"],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=240)


def test_with_pointers_only_the_origin_rank_writes_a_full_bundle(pointer_job):
    """Rank 1 (the origin) writes the full bundle; rank 0 a pointer to it, also named in its run store."""
    from nantrace.storage.bundle import REQUIRED
    from nantrace.storage.pointer import POINTER_FILE, load_pointer
    from nantrace.storage.runstore import RunStore

    run = pointer_job / "run"
    [own] = sorted((run / "rank1" / "incidents").iterdir())
    assert sorted(p.name for p in own.iterdir()) == sorted(REQUIRED)
    [pointer_dir] = sorted((run / "incidents").iterdir())
    assert [p.name for p in pointer_dir.iterdir()] == [POINTER_FILE]
    assert (pointer_dir / POINTER_FILE).stat().st_size < 2_000
    pointer = load_pointer(pointer_dir)
    assert (pointer.version, pointer.step, pointer.kind, pointer.writer_rank, pointer.world_size) == (
        1, 3, "nonfinite_grad", 0, 2)
    assert pointer.holders == {1: os.path.join("..", "..", "rank1", "incidents")} and pointer.origin_ranks == [1]
    assert pointer.figures["grad_norm"] == "nan" and pointer.figures["nonfinite_grads"] == 4
    [stored] = RunStore(run, readonly=True).incidents()
    assert stored.bundle == str(pointer_dir) and stored.id == pointer.incident_id
    assert stored.details["bundle_pointer"] == {"holder_ranks": [1], "bundle_prefix": "step000003-",
                                                "incidents": {"1": os.path.join("..", "..", "rank1", "incidents")}}
    [origin_stored] = RunStore(run / "rank1", readonly=True).incidents()
    assert origin_stored.bundle == str(own) and "bundle_pointer" not in origin_stored.details


def test_the_origin_bundle_replays_to_its_bad_batch_and_the_pointer_follows_it(pointer_job):
    import torch

    import nantrace

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from ddp_script import make_model
    finally:
        sys.path.remove(str(SCRIPT.parent))
    [own] = sorted((pointer_job / "run" / "rank1" / "incidents").iterdir())
    [pointer_dir] = sorted((pointer_job / "run" / "incidents").iterdir())
    torch.manual_seed(0)
    origin = nantrace.replay(own, model=make_model())
    assert (origin.cause, origin.phase, origin.op, origin.rank, origin.transient) == (
        "nonfinite_input", "data", None, 1, False), origin.summary
    followed = nantrace.replay(pointer_dir, model=make_model())
    assert (followed.cause, followed.op, followed.rank, followed.bundle) == ("nonfinite_input", None, 1, str(own))
    assert followed.details["followed_pointer"] == str(pointer_dir) and followed.details["bundle_rank"] == 1
    proc = _replay_cli(pointer_dir, cwd=SCRIPT.parent)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{pointer_dir} is a pointer from rank 0: replaying rank 1's bundle {own}"
    assert "nonfinite_input" in lines[1] and "Traceback" not in proc.stderr
    assert lines[-1] == "reproduced: same op, module and cause as recorded"


def test_a_pointer_whose_bundle_is_elsewhere_says_where_without_a_traceback(pointer_job, tmp_path):
    """Rank 0's directory copied alone (rank 1's bundle on another machine): one line, exit code 2."""
    shutil.copytree(pointer_job / "run" / "incidents", tmp_path / "run" / "incidents")
    [pointer_dir] = sorted((tmp_path / "run" / "incidents").iterdir())
    proc = _replay_cli(pointer_dir, cwd=SCRIPT.parent)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    expected = os.path.join(str(tmp_path / "run" / "rank1" / "incidents"), "step000003-*")
    assert proc.stderr == (f"error: {str(pointer_dir)!r} is a pointer written by rank 0 for step 3 (nonfinite_grad): "
                           f"the full bundle is held by rank 1 and is not on this filesystem (rank 1: {expected}); "
                           "replay it where that rank's run directory is, or copy its incidents directory there (if "
                           "it is not there either, that rank wrote none for this step: past "
                           "Config.outputs.max_bundles, or a repeat of its episode's incident)\n")


def test_a_local_loss_spike_on_one_rank_makes_every_rank_skip(tmp_path):
    results = _torchrun(tmp_path, "loss_spike_rank1")
    spikes = {r["rank"]: [i for i in r["incidents"] if i[0] == 45] for r in results}
    assert [i[:4] for i in spikes[1]] == [[45, "loss_spike", 1, "skipped"]]
    # rank 0 sees the spike's gradients after the all-reduce: an explosion, traced to rank 1
    assert [i[:4] for i in spikes[0]] == [[45, "grad_explosion", 1, "skipped"]]
    assert all(r["replicas_equal"] for r in results)


@pytest.mark.parametrize("policy, actions, counts", [
    ("skip", ["skipped", "paused"], [5, 1]),           # 5 skipped updates in a row, then pause
    ("rollback", ["rolled_back", "paused"], [3, 1]),   # 3 rollbacks (rollback_max_retries), then pause
])
def test_the_escalation_ladder_escalates_on_every_rank_at_the_same_step(tmp_path, policy, actions, counts):
    """Rank 1's data stays broken from step 3: both ranks count one episode and pause together."""
    results = _torchrun(tmp_path, "broken_rank1", policy=policy)
    for res in results:
        assert [i[3] for i in res["incidents"]] == actions and res["counts"] == counts
        assert res["incidents"][0][0] == 3 and res["incidents"][0][2] == 1  # traced to rank 1 on both ranks
    assert [r["raised_step"] for r in results] == [3 + sum(counts) - 1] * 2
    assert [r["raised"] for r in results] == ["nonfinite_grad", "nonfinite_input"]
    assert all(r["replicas_equal"] and r["finite"] for r in results)


def test_raise_policy_raises_on_every_rank_without_hanging(tmp_path):
    results = _torchrun(tmp_path, "nan_input_rank1", policy="raise")
    assert [r["raised"] for r in results] == ["nonfinite_grad", "nonfinite_input"]
    assert all(r["replicas_equal"] for r in results)


def test_fsdp2_nan_on_rank1_is_attributed_and_every_rank_skips(tmp_path):
    results = _torchrun(tmp_path, "fsdp_nan_input_rank1")
    for res in results:
        assert res["sharded"] and res["replicas_equal"] and res["finite"] and res["steps"] == 8
        # per-layer figures are the model's (shard norms combined across ranks), and no monitor broke
        assert res["layer_norms_match"] is True and res["monitor_failures"] == []
        [incident] = [i for i in res["incidents"] if i[1].startswith("nonfinite")]
        assert (incident[0], incident[2], incident[3]) == (3, 1, "skipped")
    assert results[1]["incidents"][0][1] == "nonfinite_input"
    assert results[0]["incidents"][0][1] == "nonfinite_grad"


def _script():
    """tests/ddp_script.py as a module: the scenarios' models and batches, for one-process runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nantrace_ddp_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_process_diagnosis(scenario: str) -> tuple[list, str | None]:
    """What nantrace says in one process about rank 1's failing batch of ``scenario``:
    [kind, cause, op, module, phase] and the source line."""
    import torch

    import nantrace

    script = _script()
    model = script.build(scenario)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(101)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    for step in range(4):
        x, y = script.batch(scenario, 1, step, gen, w)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        opt.zero_grad()
        script.loss_of(scenario, 1, 3, model(x), y).backward()
        opt.step()
        [incident] = guard.incidents
    finally:
        guard.close()
    return [incident.kind, incident.cause, incident.op, incident.module, incident.phase], incident.source


@pytest.mark.parametrize("origin, op, wrapper", [
    ("log", "aten.log.default", "fsdp"), ("sqrt", "aten.sqrt.default", "fsdp"), ("lossfn", "aten.log.default", "fsdp"),
    # DDP: the backward origin, spread by the all-reduce; its forward and loss-code origins are replayed by rank 1
    # alone, as in one process (FSDP2's lockstep replay of them is the path these cases exist for)
    ("sqrt", "aten.sqrt.default", "ddp"),
])
def test_rank1_names_the_op_it_names_alone_and_every_rank_skips(tmp_path, origin, op, wrapper):
    """NaN made by rank 1's step only: in its forward (log of a negative value), in its backward
    (sqrt at an exact 0: a finite forward, an infinite derivative), or in its loss code (log of a
    negative weight: under FSDP2 the loss tape is replayed on every rank, agreed by an all-reduce).
    The reduce-scatter (FSDP2) or all-reduce (DDP) spreads a NaN gradient to rank 0 before any
    check of the reduced gradients; every rank still names rank 1 and skips the same step, and
    rank 1's diagnosis is the one the same batch gets in one process. Under FSDP2 every rank
    replays together (rank 0's collectives meet rank 1's), and nothing hangs (the timeout)."""
    expected, source = _one_process_diagnosis(f"fsdp_{origin}_rank1")
    assert expected[2] == op and expected[1] != "unknown", expected
    results = _torchrun(tmp_path, f"{wrapper}_{origin}_rank1")
    for res in results:
        assert res["local_grad_check"] is True and res["sharded"] is (wrapper == "fsdp")
        assert res["replicas_equal"] and res["finite"] and res["steps"] == 8  # training went on
        [incident] = res["incidents"]
        assert (incident[0], incident[2], incident[3]) == (3, 1, "skipped"), res
        assert res["details"][0]["origin_ranks"] == [1]
        assert "localisation_error" not in res["details"][0] and "not_replayable" not in res["details"][0]
    own, received = results[1], results[0]
    assert own["incidents"][0][1:2] + own["incidents"][0][4:8] == expected, own
    assert own["sources"][0] == source
    assert "came from rank 1" in received["summaries"][0] and "came from rank 1" not in own["summaries"][0]
    assert received["incidents"][0][1] == ("nonfinite_loss" if origin == "lossfn" else "nonfinite_grad")
    assert received["incidents"][0][5] is None  # no op of its own
    if wrapper == "fsdp":  # rank 0 replayed too, and says whose incident names the op
        assert "came from rank 1" in received["details"][0]["localisation"]
        assert "localisation" not in own["details"][0]


def test_fsdp2_local_gradient_check_keeps_the_numerics_and_close_removes_it(tmp_path):
    """Six healthy FSDP2 steps with and without nantrace: the same weights bit for bit; after
    close() every parameter group reduce-scatters through FSDP's own comm again."""
    for res in _torchrun(tmp_path, "fsdp_numerics"):
        assert res["local_grad_check"] is True and res["bitwise_equal"] is True
        assert res["comms_after_close"] and set(res["comms_after_close"]) == {"DefaultReduceScatter"}


def test_fsdp2_an_exception_is_recorded_without_a_lone_replay_and_nothing_hangs(tmp_path):
    """Under FSDP2 a replay issues collectives: a rank that raised must not replay alone. Every
    rank records the exception (kind ``exception``, "not replayed") and the job ends."""
    results = _torchrun(tmp_path, "fsdp_raise_together")
    for res in results:
        assert res["raised"] is not None and "out of bounds" in res["raised"]
        [incident] = res["incidents"]
        step, kind, cause, localisation, exception = incident
        assert (step, kind, cause) == (2, "exception", "unknown")
        assert localisation.startswith("not replayed: under FSDP2") and exception.startswith("IndexError")
