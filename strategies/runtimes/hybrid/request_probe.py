"""The CPU one parameter-server request costs on this machine, measured with hpar's own client
and server (the hybrid spec's ``cluster_probe``, read into the cluster description where the
processes share busy cores; strategies/plan/cluster.py).
"""

from __future__ import annotations

import statistics
import time

import torch

from hpar.strategies.plan.probe import _in_threads, _loopback_pair


def probe_requests(steps: int = 150, rows: int = 64, dim: int = 16, rounds: int = 3, timeout_s: float = 60.0) -> float:
    """CPU seconds one parameter-server request costs, all of it: hpar's own client
    (strategies/runtimes/hybrid/client.py) and server (strategies/runtimes/hybrid/ps_server.py) serve an embedding
    table of ``4 * rows`` rows of ``dim`` floats (SGD) between two threads of this process over
    loopback gloo; each step the client pulls ``rows`` rows, pushes their gradients and sends
    DONE (three requests), and the server answers, adds and applies them. The figure is the
    process's CPU time (``time.process_time``: both ends, gloo's I/O threads and the system
    time of their sockets) over ``steps`` steps after 20 warm-up ones, per request; the median
    of ``rounds`` rounds, with one intra-op thread. Dedup of the ids and the update's bytes are
    left out (the cost model has terms of their own for them). Figures: (BENCHMARKS.md, "The
    cost model against measurement").
    Raises RuntimeError if it fails."""
    from torch import nn
    from hpar.strategies.job.config import RunConfig
    from hpar.strategies.runtimes.hybrid.client import PSClient, ps_tables
    from hpar.strategies.runtimes.hybrid.ps_server import Server
    from hpar.strategies.specs.registry import HYBRID

    pgs, warm, threads = _loopback_pair(timeout_s), 20, torch.get_num_threads()
    total = warm + steps
    cfg = RunConfig(
        script="<request probe>",
        strategy=HYBRID.name,
        world_size=1,
        steps=total,
        batch_size=rows,
        lr=0.1,
        seed=0,
        run_dir="",
        log_every=total,
    )
    per_request = []
    for _ in range(rounds):
        model = nn.Sequential(nn.Embedding(4 * rows, dim))
        tables = ps_tables(model, torch.optim.SGD(model.parameters(), lr=0.1), HYBRID.name, cfg.plan, 1)
        out: dict = {}

        def worker(pg) -> None:
            try:
                client, table = PSClient(tables, 1, 1, group=pg), tables[0]
                for step in range(total):
                    if step == warm:
                        out["cpu"] = time.process_time()
                    ids = torch.randperm(4 * rows)[:rows].sort().values
                    grads = torch.ones_like(client.pull(table, ids, step))
                    for work in client.push(table, ids, grads, step) + client.done(step):
                        work.wait()
                out["cpu"] = time.process_time() - out["cpu"]
                client.finish()
            except Exception as exc:
                out["error0"] = exc

        def server(pg) -> None:
            try:
                Server(cfg, tables, model, 0, 1, group=pg).serve()
            except Exception as exc:
                out["error1"] = exc

        torch.set_num_threads(1)  # as each process on busy cores has (an idle intra-op thread spins)
        try:
            _in_threads([(worker, (pgs[0],)), (server, (pgs[1],))], timeout_s, out)
        finally:
            torch.set_num_threads(threads)
        per_request.append(out["cpu"] / (3 * steps))
    return statistics.median(per_request)
