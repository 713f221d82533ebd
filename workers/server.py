"""Parameter-server process entry point: ``python -m hpar.workers.server``.

Environment (set by the launcher): WORLD_SIZE (number of workers), HPAR_SERVER_INDEX,
HPAR_NUM_SERVERS, HPAR_PG_RANK (= WORLD_SIZE + index), HPAR_PG_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, HPAR_CONFIG. The server joins the default group, creates the same subgroups
as the workers, builds its shard of every PS table (same seed, so the same initial values
as the workers' model), then serves the workers until every one has finished
(strategies/runtimes/hybrid/ps_server.py). It reports bytes per step by table (``metric``) and
heartbeats through workers/report.py.
"""

from __future__ import annotations

import os

from hpar.strategies.job.context import peer_is_remote
from hpar.workers import report

report.install_stack_dump()  # first, so that a stall during start-up can be diagnosed too

import torch  # noqa: E402

from hpar.strategies.state import checkpoint

from hpar.strategies.common import measured_memory as memory
from hpar.strategies.job.config import load_config
from hpar.strategies.job.forward import inner_module
from hpar.strategies.runtimes.hybrid.build import broadcast_dense
from hpar.strategies.runtimes.hybrid.client import ps_tables
from hpar.strategies.runtimes.hybrid.hybrid_runtime import make_groups
from hpar.strategies.runtimes.hybrid.schedule import ServerSchedule, group_index
from hpar.strategies.runtimes.hybrid.ps_server import Server
from hpar.strategies.job.contract import JobError, load_job
from hpar.strategies.state.state import DiskFull
from hpar.workers.worker import cpu_threads, env_int, init_group, leave_group, run_entry


def main() -> int:
    cfg = load_config(os.environ["HPAR_CONFIG"], os.environ.get("HPAR_CONFIG_SHA256"))
    num_workers, index = env_int("WORLD_SIZE"), env_int("HPAR_SERVER_INDEX")
    num_servers = env_int("HPAR_NUM_SERVERS", cfg.servers or 1)
    pg_rank, pg_world = (
        env_int("HPAR_PG_RANK", num_workers + index),
        env_int("HPAR_PG_WORLD_SIZE", num_workers + num_servers),
    )
    torch.set_num_threads(cpu_threads())
    stop_beat = report.start_heartbeat(threads=torch.get_num_threads())
    job = load_job(cfg.script)
    host_of = init_group(cfg, pg_rank, pg_world)
    report.emit("event", {"kind": "phase", "phase": "serve"})  # past the rendezvous (launcher/run/health.py)
    make_groups(num_workers, cfg.device, host_of, cfg.plan)  # a member of none but the default (gloo) group
    mem = memory.start_process(torch.device("cpu"))  # peak memory from here to the end of serving
    torch.manual_seed(cfg.seed)
    model = inner_module(job.build_model())  # a torch.compile wrapper's module: the user's names, never run here
    opt = job.build_optimizer(model.parameters(), cfg.lr)
    tables = ps_tables(model, opt, cfg.strategy, cfg.plan, num_servers)
    broadcast_dense(model, {t.name for t in tables}, src=num_workers)  # the workers' initial dense state, from server 0
    params = dict(model.named_parameters())
    server = Server(
        cfg,
        tables,
        model,
        index,
        num_workers,
        is_remote=lambda rank: peer_is_remote(host_of, pg_rank, rank),
        schedule=ServerSchedule(job, opt),
        emit=report.emit,
        group_of={t.tid: group_index(opt, params[t.name]) for t in tables},
    )
    del params
    del model, opt
    step = checkpoint.latest_step(cfg.run_dir) if cfg.resume else None
    if step is not None:
        server.restore(cfg.run_dir, step)
    report.emit(
        "event", {"server": index, "message": f"serving {len(server.shards)} table shard(s) from step {server.applied}"}
    )
    server.serve()
    report.emit("event", {"kind": "memory", "role": "server", "rank": index, **mem.figures(), "trims": memory.trims()})
    server.write_final()  # its rows of every table, with the workers' dense part: RUN_DIR/model
    n = max(server.applied - (step or 0), 1)
    report.emit(
        "event",
        {
            "server": index,
            "message": "finished",
            "bytes_per_step": {k: {"sent": v[0] / n, "recv": v[1] / n} for k, v in sorted(server.totals.items())},
        },
    )
    leave_group(stop_beat)
    return 0


if __name__ == "__main__":
    run_entry(main, "hpar server", (JobError, ValueError, DiskFull))
