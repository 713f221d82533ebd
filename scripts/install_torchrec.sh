#!/usr/bin/env bash
# Install TorchRec for `hpar run --strategy torchrec` (docs/strategies.md#torchrec): the tested,
# matching triple torch 2.13.0 + fbgemm-gpu-cpu 1.8.0 + torchrec 1.8.0, in the order that works.
# FBGEMM 1.X is built for torch 2.(X+5), TorchRec 1.X for FBGEMM 1.X. torchrec goes in with
# --no-deps: its metadata asks for the CUDA `fbgemm-gpu`, unpinned, whose install would overwrite
# the CPU build's `fbgemm_gpu` package (pip then says "torchrec 1.8.0 requires fbgemm-gpu, which
# is not installed": harmless, fbgemm-gpu-cpu provides it). PYTHON picks the interpreter.
set -euo pipefail
PY="${PYTHON:-python}"
torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
case "$torch_version" in
  2.13.*) ;;
  *) echo "install_torchrec.sh: torch $torch_version is installed; this installs TorchRec for torch 2.13 (pip install torch==2.13.0 first)" >&2
     exit 2 ;;
esac
"$PY" -m pip install -q fbgemm-gpu-cpu==1.8.0
"$PY" -m pip install -q --no-deps torchrec==1.8.0
"$PY" -m pip install -q tensordict torchmetrics==1.0.3 tqdm pyre-extensions   # torchrec's other dependencies
# the smoke check: FBGEMM's kernels load into this torch (a mismatch fails here, not in a run)
"$PY" -c 'import torch, fbgemm_gpu, torchrec
got = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 2, 3])).tolist()
assert got == [0, 1, 3, 6], got
print("install_torchrec.sh: torch", torch.__version__, "+ fbgemm_gpu", fbgemm_gpu.__version__, "+ torchrec", torchrec.__version__, "work")'
