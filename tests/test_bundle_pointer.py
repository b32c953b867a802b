"""Bundle pointers (``storage/pointer.py``) and who writes a full bundle (``storage/bundle_policy.py``),
without a process group: the format, its round trip, bad input, and the policy's choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import nantrace
from nantrace.incident import Incident
from nantrace.storage.bundle_policy import ALL_RANKS_UP_TO, bundle_holders, resolve_bundle_ranks
from nantrace.storage.pointer import (POINTER_FILE, BundlePointer, find_target, is_pointer, load_pointer,
                                      missing_message, pointer_note, write_pointer)

SRC = Path(__file__).resolve().parents[1] / "src"


def _incident(kind: str = "nonfinite_grad", **details) -> Incident:
    return Incident(step=7, kind=kind, phase="backward", op=None, module=None, source=None, rank=1, cause="unknown",
                    summary="rank 1's NaN", fix="look at rank 1", action="skipped", id="abcdef012345", details=details)


def _watched(root: Path, rank: int, world_size: int = 16) -> SimpleNamespace:
    """What ``write_pointer`` reads of the guard's view: the rank's own run directory, its rank, the world size."""
    return SimpleNamespace(run_dir=str(root if rank == 0 else root / f"rank{rank}"), rank=rank, world_size=world_size)


# ---------------------------------------------------------------- the policy
@pytest.mark.parametrize("setting, world, expected", [
    ("auto", 2, "all"), ("auto", ALL_RANKS_UP_TO, "all"), ("auto", ALL_RANKS_UP_TO + 1, "origin"),
    ("auto", 16_384, "origin"), ("origin", 2, "origin"), ("all", 16_384, "all"),
])
def test_auto_means_every_rank_up_to_one_node_and_origin_above(setting, world, expected):
    assert resolve_bundle_ranks(setting, world) == expected


@pytest.mark.parametrize("rank, details, kind, expected", [
    (0, {"origin_ranks": [1]}, "nonfinite_grad", [1]),            # received through the all-reduce
    (1, {"origin_ranks": [1]}, "nonfinite_input", None),          # the origin writes its own
    (2, {"origin_ranks": [3, 1]}, "nonfinite_grad", [1, 3]),      # several origins, lowest first
    (3, {"origin_ranks": [3, 1]}, "nonfinite_input", None),
    (0, {}, "nonfinite_grad", None),                              # no origin: rank 0 holds the bundle
    (5, {}, "nonfinite_grad", [0]),
    (5, {"peer_rank": 2}, "grad_explosion", [0]),                 # followed a peer, no origin
    (5, {"origin_ranks": [1]}, "exception", None),                # an exception is the rank's own
])
def test_bundle_holders_at_scale(rank, details, kind, expected):
    assert bundle_holders(_incident(kind, **details), rank=rank, world_size=16, setting="auto") == expected


def test_one_process_and_all_always_write_a_full_bundle():
    incident = _incident(origin_ranks=[1])
    assert bundle_holders(incident, rank=0, world_size=1, setting="origin") is None
    assert bundle_holders(incident, rank=0, world_size=4, setting="all") is None
    assert bundle_holders(incident, rank=0, world_size=4, setting="auto") is None
    assert bundle_holders(incident, rank=0, world_size=4, setting="origin") == [1]


def test_the_config_option_is_validated_and_documented():
    assert nantrace.Config().outputs.bundle_ranks == "auto"
    assert nantrace.Config(outputs={"bundle_ranks": "origin"}).outputs.bundle_ranks == "origin"
    with pytest.raises(ValueError) as err:
        nantrace.Config(outputs={"bundle_ranks": "some"})
    assert str(err.value) == "Config.outputs.bundle_ranks must be one of 'auto', 'origin', 'all', got 'some'"


# ---------------------------------------------------------------- the format
def test_a_pointer_round_trips_and_names_the_origin_relative_to_itself(tmp_path):
    incident = _incident(origin_ranks=[1], loss=0.5, grad_norm=float("nan"), nonfinite_grads=[{"name": "w"}] * 3)
    path = Path(write_pointer(_watched(tmp_path, rank=2), incident, [1]))
    assert path == tmp_path / "rank2" / "incidents" / "step000007-nonfinite_grad-abcdef012345"
    assert [p.name for p in path.iterdir()] == [POINTER_FILE] and is_pointer(path) and is_pointer(path / POINTER_FILE)
    rel = os.path.join("..", "..", "..", "rank1", "incidents")
    assert incident.bundle == str(path)
    assert incident.details["bundle_pointer"] == {"holder_ranks": [1], "incidents": {"1": rel},
                                                  "bundle_prefix": "step000007-"}
    data = json.loads((path / POINTER_FILE).read_text())
    assert data == {"nantrace_bundle_pointer": 1, "step": 7, "kind": "nonfinite_grad", "cause": "unknown",
                    "action": "skipped", "incident_id": "abcdef012345", "writer_rank": 2, "world_size": 16,
                    "origin_ranks": [1], "holders": [{"rank": 1, "incidents": rel}], "bundle_prefix": "step000007-",
                    "summary": "rank 1's NaN", "figures": {"loss": 0.5, "grad_norm": "nan", "nonfinite_grads": 3}}
    loaded = load_pointer(path)
    assert loaded == BundlePointer.from_dict(data) and loaded.path == path
    assert load_pointer(path / POINTER_FILE).path == path
    assert pointer_note(incident.details) == "a pointer: rank 1 holds the full bundle; nantrace replay follows it"
    assert pointer_note({}) is None


def test_rank0_points_into_rank_directories_and_others_back_to_rank0(tmp_path):
    to_rank3 = load_pointer(write_pointer(_watched(tmp_path, rank=0), _incident(origin_ranks=[3]), [3]))
    assert to_rank3.holders == {3: os.path.join("..", "..", "rank3", "incidents")}
    to_rank0 = load_pointer(write_pointer(_watched(tmp_path, rank=4), _incident(kind="nonfinite_param"), [0]))
    assert to_rank0.holders == {0: os.path.join("..", "..", "..", "incidents")} and to_rank0.origin_ranks == []


def test_find_target_picks_the_holders_bundle_of_the_step(tmp_path):
    pointer = load_pointer(write_pointer(_watched(tmp_path, rank=0), _incident(origin_ranks=[1, 2]), [1, 2]))
    assert find_target(pointer) is None
    for rank, step in ((2, 7), (1, 70)):  # rank 2 holds step 7; rank 1 only a later step with the same prefix
        bundle = tmp_path / f"rank{rank}" / "incidents" / f"step0000{step:02d}-nonfinite_input-{rank}"
        bundle.mkdir(parents=True)
        (bundle / "env.json").write_text(json.dumps({"step": step}))
    assert find_target(pointer) == (2, tmp_path / "rank2" / "incidents" / "step000007-nonfinite_input-2")
    first = tmp_path / "rank1" / "incidents" / "step000007-nonfinite_input-1"
    first.mkdir()
    (first / "env.json").write_text(json.dumps({"step": 7}))
    assert find_target(pointer) == (1, first)


@pytest.mark.parametrize("text, message", [
    ("{not json", "is corrupt or unreadable (truncated or not written by nantrace): JSONDecodeError: "),
    ('{"step": 3}', "is not a nantrace bundle pointer (no 'nantrace_bundle_pointer' field)"),
    ('{"nantrace_bundle_pointer": "1"}', "has no valid pointer format version (found '1')"),
    ('{"nantrace_bundle_pointer": 99}', "was written in pointer format 99; this nantrace reads formats 1..1: "
                                        "upgrade nantrace to follow it"),
    ('{"nantrace_bundle_pointer": 1, "step": 3, "kind": "nonfinite_grad"}', "is not a valid nantrace bundle pointer: "
     "missing cause, action, incident_id, writer_rank, world_size, origin_ranks, holders, summary"),
    ('{"nantrace_bundle_pointer": 1, "step": 3, "kind": "k", "cause": "c", "action": "a", "incident_id": "i", '
     '"writer_rank": 0, "world_size": 2, "origin_ranks": [1], "holders": [{"rank": "one", "incidents": "x"}], '
     '"summary": "s"}', "is not a valid nantrace bundle pointer: ValueError: invalid literal for int()"),
])
def test_bad_pointers_get_a_clear_error(tmp_path, text, message):
    (tmp_path / POINTER_FILE).write_text(text)
    with pytest.raises(ValueError) as err:
        load_pointer(tmp_path)
    assert str(err.value).startswith(repr(str(tmp_path / POINTER_FILE)) + " ") and message in str(err.value)


def test_a_pointer_naming_no_holder_is_refused():
    data = BundlePointer(step=1, kind="nonfinite_grad", cause="unknown", action="skipped", incident_id="x",
                         writer_rank=0, world_size=2, holders={1: "../../rank1/incidents"}, origin_ranks=[1],
                         summary="s").to_dict()
    data["holders"] = []
    with pytest.raises(ValueError, match="it names no rank holding the bundle"):
        BundlePointer.from_dict(data)


def test_replay_of_a_pointer_without_its_bundle_says_where_it_should_be(tmp_path):
    pointer_dir = Path(write_pointer(_watched(tmp_path, rank=0), _incident(origin_ranks=[1]), [1]))
    with pytest.raises(ValueError) as err:
        nantrace.replay(pointer_dir)
    assert str(err.value) == missing_message(load_pointer(pointer_dir))
    env = dict(os.environ, COLUMNS="80", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    (pointer_dir / POINTER_FILE).write_text('{"nantrace_bundle_pointer": 7}')
    proc = subprocess.run([sys.executable, "-m", "nantrace", "replay", str(pointer_dir)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: {str(pointer_dir / POINTER_FILE)!r} was written in pointer format 7; this "
                           "nantrace reads formats 1..1: upgrade nantrace to follow it\n")
