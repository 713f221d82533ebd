"""Chaos run: N random faults in a row against real `hpar run`s on this machine.

    python scripts/chaos.py --faults 100 [--seed 0] [--strategies allreduce,hybrid] [--out chaos.json]
    python scripts/chaos.py --emulate 2 --faults 10 [--kinds link_cut,worker_kill]

Each fault goes into a fresh run or into the resume of the run the previous fault interrupted
(a chain); a chain ends with a clean resume to the last step. Faults: SIGKILL of a worker, a
server (hybrid) or a guard; SIGSTOP of a worker (caught by --stall-timeout); SIGKILL, SIGINT or
SIGTERM to the launcher; SIGKILL of the worker writing a checkpoint (while its ``.tmp-*`` file
exists); a full disk under the run directory (a small tmpfs, as root); a hang in ``evaluate()``
(the next one after the fault: every run evaluates before training, every ``EVAL_EVERY`` steps
and after the last) and a hang in a worker's first batch (the run or resume starts with it;
both caught by the phase deadline, --stall-timeout). A hang is a marker file in the work
directory that the job's ``evaluate()`` or ``data()`` finds; the hung process writes when it
began, from which its detection and teardown times count. With ``--emulate H``
(root, iproute2, openssh-server) every run goes over SSH to H network-namespace test hosts
(scripts/testhosts.py), one worker per host, and one more fault joins: a link cut (one host's
veth set down mid-run; the launcher must name the lost host and stop; the link comes back once
the launcher has exited and must find nothing of the run left on that host).

Checked after every fault: no process of the run is left (15 s at most), every committed
checkpoint verifies and loads, and at the end of each chain the model equals, bit for bit, the
one an uninterrupted run of the same strategy trains. Figures: detection time (fault to the
launcher's failure or signal line) and teardown time (fault to no process left), median/max.
Exit code 0 when every check passed, 1 otherwise; the JSON report lists every fault.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # testhosts, beside this script
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support.runprocs import Launcher, run_processes, wait_for  # noqa: E402  (tests/support/: shared with the tests)

STEPS, EVERY, EVAL_EVERY = 24, 3, 4
SCRIPT = textwrap.dedent("""
    import os, time, torch, torch.nn as nn
    HPAR = {"steps": 24, "batch_size": 4, "lr": 0.01, "log_every": 1}
    HERE = os.path.dirname(os.path.abspath(__file__))
    def hang_if(what, rank=None):   # a marker "hang-<what>" (holding a rank, or nothing) makes this call hang
        marker = os.path.join(HERE, "hang-" + what)
        if os.path.exists(marker) and open(marker).read().strip() in ("", str(rank)):
            with open(os.path.join(HERE, "hang-started"), "w") as f:
                f.write(repr(time.time()))
            time.sleep(1000)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5000, 16)
            self.body = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 1))
        def forward(self, x):
            return self.body(self.emb(x)).squeeze(1)
    def model(): return M()
    def data(rank, world_size, batch_size):
        if os.environ.get("RANK") is not None:   # a worker's, not the launcher's check
            hang_if("data", rank)
        g = torch.Generator().manual_seed(rank)
        while True:
            time.sleep(0.15)
            yield torch.randint(0, 5000, (batch_size,), generator=g), torch.randn(batch_size, generator=g)
    def loss(o, t): return ((o - t) ** 2).mean()
    def optimizer(params): return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    def evaluate(model):
        hang_if("eval")
        return {"param_sum": float(sum(p.detach().sum() for p in model.parameters()))}
""")
FAULTS = (
    "worker_kill",
    "server_kill",
    "guard_kill",
    "worker_stop",
    "launcher_kill",
    "launcher_int",
    "launcher_term",
    "checkpoint_kill",
    "disk_full",
    "link_cut",
    "eval_hang",
    "first_batch_hang",
)
STALL = 4.0
HOSTS: list[str] = []  # with --emulate: the --hosts/--ssh-* arguments of every run
CUT: list = []  # with --emulate: the test hosts (testhosts.TestHosts), and the index of a cut link


def find(run_dir: str, module: str, rank: str | None = None, guard: bool = False) -> psutil.Process | None:
    """The process running ``python -m module`` (or the guard above it) of the run."""
    for p in run_processes(run_dir):
        try:
            cmd, env = p.cmdline(), p.environ()
        except psutil.Error:
            continue
        if cmd[1:2] == ["-c"]:
            continue  # over SSH: the session wrapper above the guard (launcher/procs/ssh.py)
        is_guard = cmd[1:3] == ["-m", "hpar.workers.guard"]
        if (
            module in cmd
            and is_guard == guard
            and (rank is None or env.get("RANK", env.get("HPAR_SERVER_INDEX")) == rank)
        ):
            return p
    return None


def steps_done(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return sum(1 for line in open(path) if '"kind":"metric"' in line and '"role":"worker"' in line)


def checkpoints_ok(run_dir: str) -> list[str]:
    """Problems with the committed checkpoints (each verifies and loads), empty when none."""
    from hpar.strategies.state import checkpoint

    try:
        latest = checkpoint.latest_step(run_dir)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for step in checkpoint.steps_on_disk(run_dir):
        if latest is not None and step <= latest:
            why = checkpoint.verify_step(run_dir, step)
            if why is None:
                from hpar.strategies.state import state

                try:  # every process's state, read back whole (torch.distributed.checkpoint)
                    state.read_all(checkpoint.step_dir(run_dir, step))
                except Exception as exc:
                    why = f"{checkpoint.step_dir(run_dir, step)}: {exc}"
            if why:
                problems.append(why)
    return problems


def same_model(a: str, b: str) -> bool:
    """Whether runs ``a`` and ``b`` left bitwise equal final models (RUN_DIR/model)."""
    import torch
    from hpar.strategies.state import state

    x, y = (state.read_all(os.path.join(d, state.FINAL)) for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run_args(script: str, strategy: str, run_dir: str, resume: bool) -> list[str]:
    common = ["--plain", "--stall-timeout", str(STALL), *HOSTS]
    if resume:
        return ["--resume", run_dir, *common]
    return [
        script,
        "--gpus",
        "2",
        "--strategy",
        strategy,
        "--checkpoint-every",
        str(EVERY),
        "--eval-every",
        str(EVAL_EVERY),
        "--run-dir",
        run_dir,
        *common,
    ]


def inject(kind: str, strategy: str, run_dir: str, launcher: Launcher, rng: random.Random) -> str | None:
    """Inject ``kind`` into the running ``launcher``; returns why it could not be, or None."""
    rank = str(rng.randrange(2))
    if kind in ("worker_kill", "worker_stop", "guard_kill", "server_kill"):
        module = "hpar.workers.server" if kind == "server_kill" else "hpar.workers.worker"
        p = find(run_dir, module, "0" if kind == "server_kill" else rank, guard=kind == "guard_kill")
        if p is None:
            return "process not found"
        p.send_signal(signal.SIGSTOP if kind == "worker_stop" else signal.SIGKILL)
    elif kind.startswith("launcher_"):
        launcher.proc.send_signal(
            {"launcher_kill": signal.SIGKILL, "launcher_int": signal.SIGINT, "launcher_term": signal.SIGTERM}[kind]
        )
    elif kind == "checkpoint_kill":
        ckpt = os.path.join(run_dir, "checkpoints")
        writer = find(run_dir, "hpar.workers.worker", "0")
        caught = wait_for(lambda: any(n.startswith(".tmp-") for _, _, fs in os.walk(ckpt) for n in fs), 20, 0.001)
        if writer is None:
            return "writer not found"
        writer.send_signal(signal.SIGKILL)
        if not caught:
            return "no checkpoint write caught in 20 s (killed anyway)"
    elif kind == "link_cut":
        import testhosts

        made = CUT[0]
        index = rng.randrange(len(made.hosts))
        testhosts.set_link(made.prefix, index, False)
        CUT[1:] = [index]
    elif kind == "eval_hang":  # the next evaluate() on worker 0 hangs
        open(os.path.join(os.path.dirname(run_dir), "hang-eval"), "w").close()
    elif kind == "disk_full":
        filler = os.path.join(run_dir, "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default="allreduce,hybrid")
    ap.add_argument("--out", default=None, help="JSON report file")
    ap.add_argument("--work", default=None, help="directory for the runs (default: a temporary one, removed)")
    ap.add_argument("--kinds", default=",".join(FAULTS), help="the faults to draw from (comma-separated)")
    ap.add_argument(
        "--emulate", type=int, default=0, metavar="H", help="run over SSH on H test hosts (root), with link cuts"
    )
    args = ap.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(FAULTS)
    if unknown or (args.kinds == "link_cut" and not args.emulate):
        ap.error(
            f"--kinds: {', '.join(sorted(unknown)) or 'link_cut'} is not a fault here (link_cut needs --emulate H)"
        )
    rng = random.Random(args.seed)
    work = args.work or tempfile.mkdtemp(prefix="hpar-chaos-")
    os.makedirs(work, exist_ok=True)
    if args.emulate:
        return emulated(args, work)
    return chaos(args, rng, work)


def emulated(args, work: str) -> int:
    """The chaos run over ``args.emulate`` test hosts, which are removed afterwards."""
    import testhosts

    reason = testhosts.unavailable()
    if reason:
        print(f"chaos: --emulate: {reason}", file=sys.stderr)
        return 2
    prefix = f"ch{os.getpid() % 10000}"
    made = testhosts.up(args.emulate, prefix=prefix, net=255)
    try:
        hosts = os.path.join(work, "hosts.txt")
        with open(hosts, "w") as f:
            f.writelines(f"root@{a}:22 slots=1\n" for a in made.addresses)
        HOSTS[:] = ["--hosts", hosts, "--ssh-key", made.key, "--ssh-known-hosts", made.known_hosts]
        CUT[:] = [made]
        return chaos(args, random.Random(args.seed), work)
    finally:
        testhosts.down(prefix)


def chaos(args, rng: random.Random, work: str) -> int:
    """Inject ``args.faults`` faults in a row (see the module docstring); 0 when every check passed."""
    script = os.path.join(work, "chaos_job.py")
    open(script, "w").write(SCRIPT)
    log = os.path.join(work, "launchers.log")
    strategies = args.strategies.split(",")
    root = os.geteuid() == 0
    reference = {}
    for s in strategies:  # the uninterrupted runs every resume must equal
        d = os.path.join(work, f"reference-{s}")
        code = Launcher(run_args(script, s, d, False), log).wait(600)
        assert code == 0, f"the uninterrupted {s} run failed ({code}); see {log}"
        reference[s] = d
    records, chains, chain = [], 0, None  # chain: (strategy, run dir, on tmpfs)
    for i in range(args.faults):
        kinds = [
            k
            for k in args.kinds.split(",")
            if (k != "disk_full" or root)
            and (k != "server_kill" or "hybrid" in strategies)
            and (k != "link_cut" or CUT)
        ]
        kind = rng.choice(kinds)
        from hpar.strategies.state import checkpoint

        if chain is not None and not chain[2] and checkpoint.usable_step(chain[1])[0] is None:
            records[-1]["chain_result"] = {
                "skipped": "faulted before its first checkpoint",
                "orphans": 0,
                "bit_identical": True,
            }
            chain = None
        if kind == "disk_full" or chain is None or chain[2] or rng.random() < 0.3:
            if chain is not None:
                records[-1]["chain_result"] = finish_chain(chain, script, log, reference)
                print(json.dumps({"chain_result": records[-1]["chain_result"]}), flush=True)
            strategy = "hybrid" if kind == "server_kill" else rng.choice(strategies)
            run_dir = os.path.join(work, f"run-{i}")
            tmpfs = kind == "disk_full"
            if tmpfs:
                os.makedirs(run_dir)
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", run_dir], check=True)
            chain, resume = (strategy, run_dir, tmpfs), False
            chains += 1
        else:
            strategy, run_dir, _ = chain
            if strategy != "hybrid" and kind == "server_kill":
                kind = "worker_kill"
            resume = True
        at_start = kind == "first_batch_hang"  # the run (or the resume) starts with the fault
        if at_start:
            open(os.path.join(work, "hang-data"), "w").write(str(rng.randrange(2)))
        launcher = Launcher(run_args(script, strategy, run_dir, resume), log)
        before = steps_done(run_dir)
        if not at_start:
            wait_for(
                lambda: steps_done(run_dir) >= before + 2 * rng.randint(1, 4) or launcher.proc.poll() is not None, 120
            )
        rec = {"fault": kind, "strategy": strategy, "resumed": resume, "run_dir": run_dir}
        if launcher.proc.poll() is not None:
            rec["skipped"] = f"the run ended before the fault (exit {launcher.proc.returncode})"
        else:
            t0 = time.monotonic()
            why = None if at_start else inject(kind, strategy, run_dir, launcher, rng)
            if at_start:  # its processes have yet to start: the fault is on once the hang began
                wait_for(
                    lambda: os.path.exists(os.path.join(work, "hang-started")) or launcher.proc.poll() is not None, 120
                )
            if why:
                rec["note"] = why
            # teardown: fault to no process of the run left (the launcher's own exit not counted)
            gone = wait_for(lambda: not run_processes(run_dir), 135)
            t_gone = time.monotonic()
            code = launcher.wait(120)
            if kind == "link_cut":  # back up once the launcher is done: nothing may be left there
                import testhosts

                testhosts.set_link(CUT[0].prefix, CUT[1], True)
                lost = CUT[0].addresses[CUT[1]]
                rec.update(
                    cut_host=lost,
                    host_named=launcher.first_line(f" on {lost} failed: ") is not None,
                    said_lost=launcher.first_line(f"lost the connection to its host {lost}") is not None,
                )
            gone = gone and wait_for(lambda: not run_processes(run_dir), 15)
            left = run_processes(run_dir)
            for p in left:
                p.kill()
            if launcher.proc.poll() is None:
                launcher.proc.kill()
            seen = launcher.first_line("failed:", "received, stopping") if kind != "launcher_kill" else None
            if kind.endswith("_hang"):  # counted from when the process began to hang
                began = hang_began(work)
                t0 = began if began is not None else t0
                rec.update(
                    hang_named=launcher.first_line("failed: stalled: in ") is not None, hang_began=began is not None
                )
            rec.update(
                exit_code=code,
                orphans=len(left),
                teardown_s=round(t_gone - t0, 2) if gone else None,
                detection_s=round(seen - t0, 2) if seen else None,
            )
        for name in ("hang-data", "hang-eval", "hang-started"):  # the next run or resume goes on
            if os.path.exists(os.path.join(work, name)):
                os.unlink(os.path.join(work, name))
        if chain[2]:
            os.unlink(os.path.join(run_dir, "filler")) if os.path.exists(os.path.join(run_dir, "filler")) else None
        rec["checkpoint_problems"] = checkpoints_ok(run_dir)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if chain is not None and records:
        records[-1]["chain_result"] = finish_chain(chain, script, log, reference)
    return report(records, chains, args, work)


def hang_began(work: str) -> float | None:
    """When the hung process began to hang (``time.monotonic()``'s clock), None if it did not."""
    try:
        began = float(open(os.path.join(work, "hang-started")).read())
    except (OSError, ValueError):
        return None
    return began - (time.time() - time.monotonic())


def finish_chain(chain, script: str, log: str, reference: dict) -> dict:
    """Resume the chain's run to the end and compare its model with the uninterrupted one."""
    strategy, run_dir, tmpfs = chain
    try:
        from hpar.strategies.state import checkpoint

        resume = checkpoint.latest_step(run_dir) is not None
        if not resume:  # faulted before its first checkpoint: start again in a new directory
            run_dir = run_dir.rstrip("/") + "-again"
        code = Launcher(run_args(script, strategy, run_dir, resume), log).wait(600)
        equal = code == 0 and same_model(run_dir, reference[strategy])
        return {"exit_code": code, "bit_identical": equal, "orphans": len(run_processes(run_dir))}
    finally:
        if tmpfs:
            subprocess.run(["umount", "-l", chain[1]], check=False)


def report(records: list[dict], chains: int, args, work: str) -> int:
    done = [r for r in records if "skipped" not in r]
    det = [r["detection_s"] for r in done if r.get("detection_s") is not None]
    tear = [r["teardown_s"] for r in done if r.get("teardown_s") is not None]
    results = [r["chain_result"] for r in records if "chain_result" in r and "skipped" not in r["chain_result"]]
    figures = {
        "faults": len(records),
        "injected": len(done),
        "chains": chains,
        "orphans": sum(r.get("orphans", 0) for r in done) + sum(c["orphans"] for c in results),
        "processes_not_gone_in_15s": sum(1 for r in done if r.get("teardown_s") is None),
        "checkpoint_problems": sum(len(r["checkpoint_problems"]) for r in records),
        "resumes_bit_identical": f"{sum(c['bit_identical'] for c in results)}/{len(results)}",
        "detection_s": {"median": statistics.median(det), "max": max(det)} if det else None,
        "teardown_s": {"median": statistics.median(tear), "max": max(tear)} if tear else None,
        "by_fault": {k: sum(1 for r in done if r["fault"] == k) for k in FAULTS},
        "lost_host_not_named": sum(1 for r in done if r.get("host_named") is False),
        "hangs_not_named": sum(1 for r in done if r.get("hang_began") and not r.get("hang_named")),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"figures": figures, "faults": records}, f, indent=2)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    ok = (
        figures["orphans"] == 0
        and figures["lost_host_not_named"] == 0
        and figures["checkpoint_problems"] == 0
        and figures["processes_not_gone_in_15s"] == 0
        and figures["hangs_not_named"] == 0
        and all(c["bit_identical"] for c in results)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
