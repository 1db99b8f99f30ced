"""One multi-host run, inside its own network and mount namespace (started by
`python -m tests.multihost`):

    python -m tests.multihost.run --fault host --out var/multihost/host --task var/multihost/task

Builds the hosts (tests.multihost.net), gives each its credentials, starts every host's
supervisor, submits the arith experiment from the operator's address, injects the fault while
polling the version timeline, waits for the end, reads `asyncrl ledger/status --json`, checks
that every weight version reached the rollouts through NATS (no rollout host has a file of the
trainer's weight store), stops the hosts and writes <out>/result.json.

Faults (one per run, at a third of the steps), each lasting OUTAGE_S, or until a third of the
steps left at the fault have been trained if that comes first (a short run would otherwise end
during the fault: what was faulted came back to a finished run, and the run passed without
showing it could; one that ends before the fault is over anyway is an error):
    nats   kill -9 the NATS node that leads the trajectory stream; it stays down (its
           supervisor is SIGSTOPped meanwhile), then its supervisor restarts it
    link   host b (two rollouts and a NATS node) loses its network
    host   every process of host b is SIGKILLed; after the outage the host boots again
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from asyncrl.client import AsyncrlClient
from tests.chaos.watch import POLL_S, TERMINAL, ExperimentWatch
from tests.multihost import net

ARITH = net.ROOT / "examples" / "arith" / "experiment.yaml"
OUTAGE_S = 20.0
FAULTS = ("none", "nats", "link", "host")


@dataclass(frozen=True)
class Config:
    fault: str
    out: Path
    task: Path
    steps: int | None = None
    """trainer.total_steps; None: the demo's own (250)."""
    batch_size: int | None = None
    n_samples: int | None = None
    backend: str | None = None
    timeout_s: float = 1500.0
    stall_s: float = 180.0

    def overrides(self) -> list[str]:
        t = self.task.resolve()
        sets = [
            f"name=multihost-{self.fault}",
            f"model.path={t / 'model'}",
            f"dataset.path={t / 'train.jsonl'}",
            f"eval.dataset_path={t / 'eval.jsonl'}",
        ]
        if self.steps is not None:
            sets += [f"trainer.total_steps={self.steps}", "trainer.checkpoint_every=4"]
            sets += ["eval.every_versions=0", "eval.max_prompts=32"]
        if self.batch_size is not None:
            sets.append(f"trainer.batch_size={self.batch_size}")
        if self.n_samples is not None:
            sets += [f"rollout.n_samples={self.n_samples}", "rollout.filter=none"]
        if self.backend is not None:
            sets.append(f"trainer.backend={self.backend}")
        return sets


class Run(ExperimentWatch):
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.hosts = net.layout(cfg.out)
        self.a, self.b, self.c = self.hosts
        self.env = net.operator_env(self.hosts, self.a)
        super().__init__(self.env["ASYNCRL_SCHEDULER"], cfg.timeout_s, cfg.stall_s)
        os.environ.update(self.env)  # this process's own client presents the admin token
        for key in [k for k in os.environ if k.startswith("ASYNCRL_") and k not in self.env]:
            del os.environ[key]
        self.phases: dict[str, float] = {}

    def cli(self, *args: str, timeout: float = 300):
        return net.asyncrl(*args, env=self.env, timeout=timeout)

    def cli_json(self, *args: str) -> dict:
        done = self.cli(*args, self.experiment_id, "--json", timeout=180)
        if done.returncode != 0:
            text = re.sub(r"[─━│╭╮╰╯]+|\s{2,}", " ", done.stdout + done.stderr)
            return {"error": text[-2000:]}
        return json.loads(done.stdout)

    # ---------------------------------------------------------------- bring-up

    def up(self) -> None:
        started = time.time()
        net.make_network(self.hosts)
        net.make_secrets(self.hosts, self.a)
        net.start_hosts(self.hosts, self.a)
        asyncio.run(self.wait_workers())
        self.phases["up_s"] = round(time.time() - started, 1)

    async def wait_workers(self, timeout: float = 180) -> None:
        """Until the scheduler lists every host's workers (by their advertised address)."""
        want = Counter()
        for host in self.hosts:
            for kind in host.services:
                if kind != "scheduler":
                    want[(host.ip, kind)] = host.rollouts if kind == "rollout" else 1
        deadline = time.monotonic() + timeout
        async with AsyncrlClient(self.scheduler, timeout_s=5.0) as client:
            while True:
                try:
                    workers = await client.workers()
                except Exception:  # the scheduler is still starting
                    workers = []
                seen = Counter((w.address.rsplit(":", 1)[0], kind_name(w.kind)) for w in workers)
                missing = want - seen
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers missing after {timeout}s: {dict(missing)}")
                await asyncio.sleep(0.5)

    def submit(self) -> None:
        id_file = self.cfg.out / "experiment_id"
        sets = [a for o in self.cfg.overrides() for a in ("--set", o)]
        done = self.cli("submit", str(ARITH), "--id-file", str(id_file), *sets)
        if done.returncode != 0:
            raise RuntimeError(f"submit failed: {done.stdout}{done.stderr}")
        self.t0 = time.time()
        self.experiment_id = id_file.read_text().strip()

    # ---------------------------------------------------------------- faults

    async def inject(self) -> None:
        if self.cfg.fault == "none":
            return
        total = self.cfg.steps or 250
        if not await self.reach(max(2, total // 3), timeout=600):
            self.errors.append(f"fault {self.cfg.fault}: the run ended before it")
            return
        await getattr(self, f"fault_{self.cfg.fault}")()
        if self.state in TERMINAL:
            self.errors.append(
                f"fault {self.cfg.fault}: the run ended ({self.state} at v{self.version}) before"
                " the fault was over: nothing recovered from it"
            )

    async def outage(self, fault: dict) -> None:
        """Wait OUTAGE_S, or until a third of the steps left at the fault are trained (then the
        run still has two thirds of them when the faulted part comes back, however fast it
        trains: 40 steps of B=4 trained their last 27 in the 20 s of a nats or host fault, and
        host b takes ~3 s to boot); note how far training went meanwhile."""
        total = self.cfg.steps or 250
        until_version = fault["at_version"] + max(1, (total - fault["at_version"]) // 3)
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline and self.version < until_version:
            if self.state in TERMINAL:
                break
            await asyncio.sleep(POLL_S / 2)
        fault["back_s"] = round(self.since() - fault["at_s"], 2)
        fault["progress_during"] = self.version - fault["at_version"]

    async def fault_nats(self) -> None:
        leader = await self.stream_leader()
        host = next(h for h in self.hosts if h.nats_name == leader)
        pid, sup = net.pid_of(host, "nats"), net.supervisor_pid(host)
        os.kill(sup, signal.SIGSTOP)  # no restart while the node is down
        os.kill(pid, signal.SIGKILL)
        fault = self.mark(f"kill -9 {leader} (stream leader, host {host.name})")
        try:
            await self.outage(fault)
        finally:
            os.kill(sup, signal.SIGCONT)

    async def fault_link(self) -> None:
        net.link(self.b, up=False)
        fault = self.mark("host b: link down")
        try:
            await self.outage(fault)
        finally:
            net.link(self.b, up=True)

    async def fault_host(self) -> None:
        killed = net.kill_host(self.b)
        fault = self.mark("host b: every process SIGKILLed", processes=killed)
        await self.outage(fault)
        await asyncio.to_thread(net.restart_host, self.b, self.hosts, self.a)
        fault["restarted_s"] = round(self.since() - fault["at_s"], 2)

    async def stream_leader(self) -> str:
        from asyncrl.natsutil import STREAM, connect

        nc = await connect(identity="admin")
        try:
            info = await nc.jetstream().stream_info(STREAM)
            return info.cluster.leader
        finally:
            await nc.close()

    async def cluster_evidence(self) -> dict:
        """The NATS cluster as the run leaves it: replicas and peers of the trajectory stream
        and of the scheduler's KV bucket (read with the scheduler's NATS user: the admin's may
        not look at the bucket)."""
        from asyncrl.natsutil import KV_BUCKET, STREAM, connect

        nc = await connect(identity="scheduler")
        try:
            js = nc.jetstream()
            found = {}
            for name in (STREAM, f"KV_{KV_BUCKET}"):
                info = await js.stream_info(name)
                peers = [info.cluster.leader, *(r.name for r in info.cluster.replicas or [])]
                found[name] = {"replicas": info.config.num_replicas, "peers": sorted(peers)}
            return found
        finally:
            await nc.close()

    # ---------------------------------------------------------------- evidence

    def weights_evidence(self) -> dict:
        """Where the rollouts got their versions: the URIs in their logs and what their hosts
        hold. No file of the trainer's weight store (host a) may be on a rollout host, and every
        version a rollout loaded after the base model came from the object store."""
        uris: dict[str, set[str]] = {}
        fetches: list[float] = []  # seconds per fetch from the object store (not from cache)
        for host in (self.b, self.c):
            for log in sorted((host.var / "log").glob("rollout-*.log")):
                for line in log.read_text(errors="replace").splitlines():
                    if '"weights_fetched"' in line or '"weights_updated"' in line:
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue
                        uri = str(event.get("uri", ""))
                        scheme = uri.split("://", 1)[0] if "://" in uri else "path"
                        uris.setdefault(host.name, set()).add(scheme)
                        if event["event"] == "weights_fetched" and event.get("seconds"):
                            fetches.append(float(event["seconds"]))
        trainer_store = self.a.var / "weights"
        leaked = [
            str(p)
            for host in (self.b, self.c)
            for p in host.root.rglob("*")
            if trainer_store in p.parents
        ]
        cached = {
            host.name: len(list((host.var / "weights-cache").rglob("config.json")))
            for host in (self.b, self.c)
        }
        fetches.sort()
        return {
            "uri_schemes": {k: sorted(v) for k, v in uris.items()},
            "cached": cached,
            "leaked": leaked,
            "fetches": len(fetches),
            "fetch_s_median": fetches[len(fetches) // 2] if fetches else None,
            "fetch_s_max": fetches[-1] if fetches else None,
        }


def kind_name(kind: int) -> str:
    from asyncrl.v1 import common_pb2

    return common_pb2.WorkerKind.Name(kind).removeprefix("WORKER_KIND_").lower()


def execute(cfg: Config) -> dict:
    run = Run(cfg)
    result: dict = {"run": cfg.fault, "fault": cfg.fault, "faults": [], "timeline": []}
    result["batch_size"] = cfg.batch_size or 16
    started = time.time()
    try:
        run.up()
        run.submit()
        result["experiment"] = run.experiment_id
        asyncio.run(run.watch(run.inject()))
        result["wall_s"] = round(run.since(), 1)
        result["ledger"] = run.cli_json("ledger")
        result["status"] = run.cli_json("status")
        evals = result["status"].get("progress", {}).get("evals", [])
        result["eval_accuracy"] = [e.get("accuracy", 0.0) for e in evals[:1] + evals[1:][-1:]]
        result["weights"] = run.weights_evidence()
        result["nats"] = asyncio.run(run.cluster_evidence())
    except Exception as e:
        run.errors.append(f"{type(e).__name__}: {e}")
    finally:
        result |= {"faults": run.faults, "timeline": run.timeline, **run.phases}
        net.stop_hosts(run.hosts)
    if run.errors:
        result["error"] = "; ".join(run.errors)
    result["total_s"] = round(time.time() - started, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task", type=Path, required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--n-samples", type=int, default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--timeout", type=float, default=1500.0)
    a = p.parse_args()
    cfg = Config(
        a.fault, a.out.resolve(), a.task.resolve(), a.steps, a.batch_size, a.n_samples,
        a.backend, a.timeout,
    )  # fmt: skip
    result = execute(cfg)
    (cfg.out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
