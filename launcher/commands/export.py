"""``hpar export RUN_DIR --format torch|safetensors|hf --out PATH``: a run's trained model, which
it wrote where it lived (RUN_DIR/model), as one file or directory people load
(strategies/state/export_files.py)."""

from __future__ import annotations

import click

from hpar.strategies.state.export_files import FORMATS


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="torch",
    show_default=True,
    help="torch: one torch.save file; safetensors: model.safetensors; hf: a transformers "
    "save_pretrained directory (from_pretrained loads it).",
)
@click.option(
    "--out",
    required=True,
    help="The file (torch) or the directory to write into (safetensors, hf; "
    "made when absent, other files in it are left alone).",
)
@click.option("--force", is_flag=True, help="Replace files in the way that no earlier hpar export wrote.")
@click.option("--script", default=None, help="hf: the script whose model() to fill (default: the run's).")
def export(run_dir, fmt, out, script, force):
    """Write RUN_DIR's trained model as FORMAT at OUT."""
    from hpar.launcher.usage import fail
    from hpar.strategies.state.export_files import export as run_export
    from hpar.strategies.job.contract import JobError

    try:
        written = run_export(run_dir, fmt, out, script, force)
    except (ValueError, JobError) as exc:
        fail(str(exc), getattr(exc, "user_traceback", None))
    click.echo(f"hpar: wrote {written}")
