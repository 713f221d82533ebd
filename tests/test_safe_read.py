"""Checkpoints are read as data (strategies/state/safe_read.py): DCP's ``.metadata`` with an
allowlist of its own types, non-tensor items with ``torch.load(weights_only=True)``; a crafted
file is a one-line ValueError naming it, and what it asks for never runs. In one process."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpar.strategies.state import safe_read, state

warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class Opens:
    """Unpickles as ``open(marker, "w")`` (pickled as ``io.open``): it creates ``marker``, a sign
    that the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def hpar_like_state() -> dict:
    """State shaped as hpar's processes save it (strategies/state/state.py's namespace):
    weights, Adam's state and param groups by name, loop state (an LR schedule and an enabled
    GradScaler), random generators, a cache's int64 rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2), torch.optim.lr_scheduler.StepLR(opt, 2)],
        milestones=[2],
    )
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched.step()
    entries = state.model_entries(model)
    entries.update(state.optim_entries(model, opt))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    entries["loop.workers"] = {"scaler": scaler.state_dict(), "scheduler": sched.state_dict()}
    entries["rng.worker0"] = {"cpu": torch.get_rng_state()}
    entries["cache.worker0.emb"] = torch.arange(5, dtype=torch.int64)
    return entries


def save(path, entries: dict) -> str:
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return str(path)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_what_hpar_saves_reads_back_whole_as_torch_reads_it(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = save(tmp_path / "ck", hpar_like_state())
    dcp_to_torch_save(path, str(tmp_path / "ref.pt"))  # torch's own conversion (our file: trusted)
    want = torch.load(tmp_path / "ref.pt", weights_only=False)
    got = safe_read.load_all(path)
    assert same(want, got) and got["loop.workers"]["scheduler"]["_schedulers"][1]["step_size"] == 2
    assert got["loop.workers"]["scaler"]["scale"] == 1024.0
    assert set(safe_read.read_metadata(path).state_dict_metadata) == state.saved_keys(path)
    safe_read.check(path)
    # in place, as a process resumes: tensors keep their storage, other values are replaced
    into = hpar_like_state()
    keep = into["model.0.weight"]
    keep.zero_()
    into["loop.workers"]["scaler"]["scale"] = 1.0
    state.read(path, into)
    assert into["model.0.weight"] is keep and torch.equal(keep, want["model.0.weight"])
    assert same(into, want)


def test_the_allowlist_is_what_a_checkpoint_metadata_names(tmp_path):
    path = save(tmp_path / "ck", hpar_like_state())
    named = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    with open(os.path.join(path, ".metadata"), "rb") as f:
        Recording(f).load()
    dtypes = {(m, n) for m, n in named if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert named - dtypes <= safe_read.METADATA_GLOBALS
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in named
    md = safe_read.SafeReader(path).read_metadata()  # torch's post-processing, repeated
    assert md.storage_meta is not None and md.storage_meta.load_id


def crafted(tmp_path, obj) -> str:
    path = save(tmp_path / "ck", hpar_like_state())
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(obj, f)
    return path


@pytest.mark.parametrize("how", ["read_metadata", "saved_keys", "read", "read_all", "check", "SafeReader"])
def test_a_crafted_metadata_is_refused_by_every_reader_and_never_runs(tmp_path, how):
    marker = tmp_path / "ran"
    path = crafted(tmp_path, Opens(marker))
    call = {
        "read_metadata": lambda: safe_read.read_metadata(path),
        "saved_keys": lambda: state.saved_keys(path),
        "read": lambda: state.read(path, {"model.0.bias": torch.zeros(4)}),
        "read_all": lambda: state.read_all(path),
        "check": lambda: safe_read.check(path),
        "SafeReader": lambda: safe_read.SafeReader(path).read_metadata(),
    }[how]
    with pytest.raises(ValueError) as err:
        call()
    assert isinstance(err.value, safe_read.UnsafeCheckpoint)
    assert str(err.value) == (
        f"{path}/.metadata: names io.open, not checkpoint data; refusing to load it "
        "(a run directory's files are code: only load runs you trust)"
    )
    assert not marker.exists()


def test_the_crafted_metadata_is_code_to_torch_itself(tmp_path):
    """The vector is real: torch's own reader runs it (so the tests above test something)."""
    marker = tmp_path / "ran"
    path = crafted(tmp_path, Opens(marker))
    dcp.FileSystemReader(path).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize(
    "obj, says",
    [
        ({"a": 1}, "holds a dict, not checkpoint data"),
        (torch.Size([2]), "holds a Size, not checkpoint data"),
    ],
)
def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path, obj, says):
    path = crafted(tmp_path, obj)
    with pytest.raises(safe_read.UnsafeCheckpoint, match=says):
        safe_read.read_metadata(path)


def test_a_name_reached_through_an_allowed_module_is_refused():
    # protocol 4 resolves dotted names attribute by attribute: an allowed module must not lend its imports
    for module, name in [
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch", "load"),
        ("torch", "Size.__class__"),
        ("builtins", "eval"),
        ("posix", "system"),
    ]:
        data = pickle.dumps(None, protocol=4)
        unpickler = safe_read._MetadataUnpickler(io.BytesIO(data))
        with pytest.raises(safe_read._Refused, match=name.replace(".", r"\.")):
            unpickler.find_class(module, name)


def test_torn_metadata_and_items_outside_the_checkpoint_are_refused_in_one_line(tmp_path):
    path = save(tmp_path / "ck", hpar_like_state())
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        data = f.read()
    with open(meta, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(safe_read.UnsafeCheckpoint, match="cannot be read as checkpoint metadata") as err:
        safe_read.read_metadata(path)
    assert "\n" not in str(err.value)
    with open(meta, "wb") as f:
        f.write(data)
    md = dcp.FileSystemReader(path).read_metadata()  # our own file: trusted
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(
        safe_read.UnsafeCheckpoint, match="places an item at '../../etc/passwd', outside the checkpoint"
    ):
        safe_read.read_metadata(path)
    md = dcp.FileSystemReader(path).read_metadata()
    md.state_dict_metadata["model.0.weight"] = torch.Size([1 << 40])  # an allowed type where an entry goes
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(safe_read.UnsafeCheckpoint, match="lists 'model.0.weight' as a Size, not checkpoint data"):
        safe_read.load_all(path)


@pytest.mark.parametrize("how", ["read", "load", "read_all", "check"])
def test_a_crafted_non_tensor_item_is_refused_and_never_runs(tmp_path, how):
    marker = tmp_path / "ran"
    entries = hpar_like_state()
    entries["loop.workers"]["scheduler"]["gamma"] = Opens(marker)  # what a crafted .distcp holds
    path = save(tmp_path / "run" / "checkpoints" / "step-3", entries)
    assert not marker.exists()
    call = {
        "read": lambda: state.read(path, {"loop.workers": {"scheduler": {"gamma": None}}}),
        "load": lambda: state.load(str(tmp_path / "run"), 3, {"loop.workers": {"scheduler": {"gamma": 0.1}}}),
        "read_all": lambda: state.read_all(path),
        "check": lambda: safe_read.check(path),
    }[how]
    with pytest.raises(safe_read.UnsafeCheckpoint) as err:
        call()
    line = str(err.value)
    assert line.startswith(
        f"{path}/__0_0.distcp (item loop.workers.scheduler.gamma) names io.open, "
        "not checkpoint data; refusing to load it"
    ), line
    assert "\n" not in line and not marker.exists()


def test_the_crafted_item_is_code_to_torch_itself(tmp_path):
    marker = tmp_path / "ran"
    path = save(tmp_path / "ck", {"x": torch.zeros(2), "evil": Opens(marker)})
    dcp.load({"evil": None}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert marker.exists()
