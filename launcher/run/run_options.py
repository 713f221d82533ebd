"""The flags of ``hpar run`` as click declares them (what ``hpar run --help`` lists), applied to
the command in launcher/cli.py by ``run_options``; their values are read into the typed trees
of launcher/run/flags.py."""

from __future__ import annotations

import click

from hpar.strategies.job.config import FIND_UNUSED_MODES, PRECISIONS, SCHEDULES, STRATEGIES

RUN_OPTIONS = (
    click.argument("script", required=False, type=click.Path(dir_okay=False)),
    click.option(
        "--gpus", type=int, default=None, help="Number of workers (GPUs, or CPU processes without CUDA). Default 1."
    ),
    click.option(
        "--hosts",
        default=None,
        help="Host file or inline list 'a:2,b:2', or ray / ray://HEAD:10001 (a Ray cluster's nodes); "
        "default this machine only.",
    ),
    click.option(
        "--strategy",
        type=click.Choice(("auto",) + STRATEGIES),
        default="auto",
        show_default=True,
        help="auto: profile the model and take the planner's choice.",
    ),
    click.option(
        "--plan",
        "plan_file",
        type=click.Path(dir_okay=False),
        default=None,
        help="Run a plan written by `hpar profile --plan-out`.",
    ),
    click.option("--steps", type=int, default=None, help="Training steps (default: the script's HPAR, else 100)."),
    click.option("--batch-size", type=int, default=None, help="Samples per worker per step (default: HPAR, else 32)."),
    click.option("--lr", type=float, default=None, help="Learning rate (default: HPAR, else 0.01)."),
    click.option("--seed", type=int, default=None, help="Random seed for the model and the data (default 0)."),
    click.option("--log-every", type=int, default=None, help="Steps between progress reports (default 10)."),
    click.option(
        "--run-dir",
        default=None,
        help="Run directory (default runs/<timestamp>); a new or empty one, made readable by you only.",
    ),
    click.option(
        "--group-readable",
        is_flag=True,
        help="Make a new run directory readable (never writable) by your group: mode 0750 instead of 0700.",
    ),
    click.option("--servers", type=int, default=None, help="Parameter servers for hybrid/ps (default one per host)."),
    click.option(
        "--schedule",
        type=click.Choice(SCHEDULES),
        default=None,
        help="Pipeline schedule (default from the plan, else 1f1b).",
    ),
    click.option(
        "--micro-batches", type=int, default=None, help="Pipeline micro-batches per batch (default from the plan)."
    ),
    click.option(
        "--pipeline-replicas",
        type=int,
        default=None,
        help="Pipeline x data parallelism: R replicas of --gpus/R stages (default: the planner's choice).",
    ),
    click.option(
        "--on-divergence",
        type=click.Choice(["off", "stop", "sync"]),
        default="off",
        show_default=True,
        help="Asynchronous pipelines: when the loss rises above --divergence-factor x its recent minimum, stop or fall back to synchronous 1f1b.",
    ),
    click.option(
        "--divergence-factor",
        type=float,
        default=2.0,
        show_default=True,
        help="Loss / recent minimum that trips --on-divergence.",
    ),
    click.option("--checkpoint-every", type=int, default=None, help="Checkpoint every N steps (0: never)."),
    click.option(
        "--keep-checkpoints",
        type=int,
        default=None,
        help="Keep the N newest complete checkpoints on disk, older ones are removed (default 2; 0: keep all).",
    ),
    click.option(
        "--resume",
        "resume_dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Continue the run in this run directory from its last checkpoint.",
    ),
    click.option(
        "--max-restarts",
        type=int,
        default=0,
        show_default=True,
        help="Restart the whole job from the last checkpoint after a failure, at most N times.",
    ),
    click.option(
        "--tune",
        type=click.Choice(("auto", "on", "off")),
        default="auto",
        show_default=True,
        help="--strategy auto: run a short trial of each of the cost model's best candidates and train with "
        "the fastest measured (auto: when the trials take under 5% of the run; off: the model's choice).",
    ),
    click.option(
        "--tune-steps",
        type=int,
        default=8,
        show_default=True,
        help="Measured steps of each --tune trial (after 2 warm-up steps).",
    ),
    click.option(
        "--min-hosts",
        type=int,
        default=0,
        help="With --max-restarts: a restart goes on with the hosts that "
        "answer when at least N do, resuming at that size (0: every host must answer).",
    ),
    click.option(
        "--stall-timeout",
        type=float,
        default=0.0,
        help="Seconds without progress after which a process counts as stalled (0: off).",
    ),
    click.option(
        "--phase-timeout",
        type=float,
        default=None,
        help="Seconds a process may spend in evaluate(), drawing its first batch, writing a checkpoint or the "
        "model, or a server on one request (default: --stall-timeout; 0: off).",
    ),
    click.option("--no-eval", is_flag=True, help="Skip evaluate() before and after training."),
    click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default=None,
        help="autocast precision of forward/backward (default: HPAR, else fp32); fp16 adds a GradScaler.",
    ),
    click.option(
        "--clip-grad-norm",
        type=float,
        default=None,
        help="Clip the global norm of the averaged gradient to X (default: HPAR, else off).",
    ),
    click.option(
        "--accumulate", type=int, default=None, help="Batches per worker per optimizer step (default: HPAR, else 1)."
    ),
    click.option(
        "--eval-every",
        type=int,
        default=None,
        help="Call evaluate() every N steps during training (default: HPAR, else 0: only before and after).",
    ),
    click.option(
        "--find-unused-parameters",
        type=click.Choice(FIND_UNUSED_MODES),
        default=None,
        help="DDP's find_unused_parameters: auto (default) turns it on only when a profiled step left a "
        "parameter without a gradient; on or off forces it.",
    ),
    click.option(
        "--staleness",
        type=int,
        default=None,
        help="hybrid/ps: a cache of each served table's hot rows on every worker, read while at most S updates "
        "behind the servers' (at most S of a worker's updates of a row held back); S = 0 trains as without it. An accuracy "
        "trade: never on unless given.",
    ),
    click.option(
        "--cache-rows",
        type=float,
        default=None,
        help="With --staleness: rows cached per table (an integer) or a fraction of each table's rows (< 1; "
        "default 0.1).",
    ),
    click.option(
        "--sync-batchnorm",
        is_flag=True,
        default=None,
        help="BatchNorm over every worker's batch (torch's SyncBatchNorm; allreduce, allreduce-sparse, hybrid, "
        "fsdp): N workers then equal one process on the concatenated batch, running statistics included.",
    ),
    click.option(
        "--compress",
        default=None,
        metavar="off|fp16|bf16|powersgd[:RANK]",
        help="Compress DDP's gradient AllReduce (allreduce, allreduce-sparse, hybrid's dense part): 16-bit casts "
        "or PowerSGD of rank RANK (default 2) with error feedback. An accuracy trade: off unless given.",
    ),
    click.option(
        "--allow-unequal-batches",
        is_flag=True,
        default=None,
        help="Train although the workers' first batches differ in size (each worker's mean gradient then "
        "weighs the same, as DDP does); refused otherwise.",
    ),
    click.option(
        "--worker-memory",
        type=float,
        default=None,
        metavar="GB",
        help="Memory of each worker's device in GB (10^9 bytes); default: the GPU's, or this host's RAM over its processes.",
    ),
    click.option(
        "--server-memory",
        type=float,
        default=None,
        metavar="GB",
        help="Host memory of each parameter server in GB; default: this host's RAM over its processes.",
    ),
    click.option("--force", is_flag=True, help="Run a strategy even when its predicted peak memory does not fit."),
    click.option("--plain", is_flag=True, help="Plain progress lines even on a terminal."),
    click.option("--ssh-key", default=None, help="SSH private key file."),
    click.option("--ssh-port", type=int, default=None, help="SSH port (default 22 or ~/.ssh/config)."),
    click.option("--ssh-user", default=None, help="SSH user (default from the host file or ~/.ssh/config)."),
    click.option("--ssh-local", is_flag=True, help="Use SSH even for localhost entries."),
    click.option(
        "--ssh-known-hosts",
        default=None,
        help="known_hosts file host keys are checked against (default $HPAR_SSH_KNOWN_HOSTS, else ~/.ssh/known_hosts).",
    ),
    click.option(
        "--ssh-accept-new",
        is_flag=True,
        help="Record the keys of hosts not yet in known_hosts "
        "(as StrictHostKeyChecking=accept-new); without it they are refused.",
    ),
    click.option("--python", "python_path", default=None, help="Interpreter on the hosts (default: this one's path)."),
    click.option("--sync", is_flag=True, help="Copy the script to hosts that lack it."),
    click.option(
        "--env",
        "env",
        multiple=True,
        metavar="KEY[=VALUE]",
        help="Also give remote processes KEY (this value, or the launcher's); repeatable.",
    ),
    click.option(
        "--device",
        type=click.Choice(("auto", "cpu", "cuda")),
        default="auto",
        show_default=True,
        help="Workers' device: auto (a GPU per worker where every host has enough, else CPU), cpu or cuda.",
    ),
)


def run_options(command):
    """``command`` with ``hpar run``'s argument and options, in the order ``--help`` lists them."""
    for option in reversed(RUN_OPTIONS):
        command = option(command)
    return command
