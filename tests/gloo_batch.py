"""Run several two-process gloo jobs in one ``torchrun`` launch (tests/test_distributed.py's ``_torchrun``).

Arguments: JOBS_JSON, a list of ``[script_path, [arg, ...]]``. The process group is made once; each job calls
``main(*args)`` of its script (tests/ddp_script.py, tests/sync_free_script.py), whose own
``init_process_group`` / ``destroy_process_group`` are passed over while the batch holds the group. A job that
raises writes ``rank{r}.error`` in its output directory (its third argument) and ends the launch, so that no rank
waits in a collective its peer has left. Starting the interpreters, importing torch and the rendezvous are paid
once for the batch instead of once per job.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import traceback

import torch.distributed as dist


def _load(path: str) -> object:
    name = "gloo_job_" + os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run(jobs: list[tuple[str, list[str]]]) -> None:
    dist.init_process_group("gloo")
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None  # the batch's group serves every job
    dist.destroy_process_group = lambda *a, **k: None
    try:
        for script, args in jobs:
            try:
                _load(script).main(*args)
            except BaseException:
                with open(os.path.join(args[2], f"rank{dist.get_rank()}.error"), "w") as f:
                    f.write(traceback.format_exc())
                sys.stderr.write(traceback.format_exc())
                sys.stderr.flush()
                os._exit(1)
            dist.barrier()
            gc.collect()
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run([(script, list(args)) for script, args in json.load(f)])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see ddp_script.py: gloo's threads may abort a rank during interpreter finalisation
