"""One part of the check in its own process: `python -m bench.gpu.part JOB.json OUT.json`.

JOB holds {part, shape, work, sizes, device, cap_s}; OUT gets {"ok": true, ...the part's
figures} or {"ok": false, "error": the traceback's tail}. A process per part keeps one part's
CUDA memory, process groups and crashes away from the next.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path


def run_job(job: dict) -> dict:
    work = Path(job["work"])
    if job["part"] == "train":
        from bench.gpu import train

        return train.run(job["shape"], work, job["sizes"])
    if job["part"] == "engine":
        from bench.gpu import engine

        return engine.run(job["shape"], work, job["sizes"], job["device"])
    if job["part"] == "stack":
        from bench.gpu import stack

        return stack.run(job["shape"], work, job["sizes"], job["device"], job["cap_s"])
    if job["part"] == "weights":
        from bench.gpu import weights

        return weights.run(job["shape"], work, job["sizes"], job["device"])
    if job["part"] == "math":
        from bench.gpu import math_recipe

        return math_recipe.run(job["shape"], work, job["sizes"], job["device"], job["cap_s"])
    raise ValueError(
        f"part: unknown part {job['part']!r} (train | engine | weights | math | stack)"
    )


def main(job_file: str, out_file: str) -> None:
    warnings.filterwarnings("ignore")
    job = json.loads(Path(job_file).read_text())
    t0 = time.perf_counter()
    try:
        result = {"ok": True, **run_job(job)}
    except BaseException as exc:  # noqa: BLE001 - reported, never raised: the next part runs
        tail = "".join(traceback.format_exception(exc))[-4000:]
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "traceback": tail}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    Path(out_file).write_text(json.dumps(result, indent=1, default=str))
    try:
        from services.trainer.megatron.parallel import shutdown_distributed

        shutdown_distributed()
    except Exception:  # noqa: BLE001 - nothing to shut down
        pass


if __name__ == "__main__":
    main(*sys.argv[1:3])
