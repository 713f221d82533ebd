"""Compute time on a device you do not have, from the profile's FLOPs and bytes: the roofline
model (Williams, Waterman & Patterson, "Roofline: an insightful visual performance model for
multicore architectures", CACM 2009). A layer is bound either by arithmetic or by memory
traffic, so its time is

    t = max(FLOPs / flops_per_s, bytes moved / memory bytes_per_s)

``--device-tflops`` gives the first rate, ``--device-mem-gbps`` the second. A wide Linear is
compute bound; a ReLU, a LayerNorm, an embedding lookup or an optimizer step does few FLOPs per
byte and is memory bound (FLOPs alone price it at nothing). Without ``--device-mem-gbps`` a
layer costs its FLOPs alone, as hpar's projections always did, and an optimizer update, memory
bound whatever is given, moves its bytes at FLOP/s / FLOP_PER_BYTE (an H100's ratio).

Bytes moved by layer ``l`` for one batch, forward and backward (fp32 as profiled): forward
reads its parameters P and input A_in and writes its output A_out; backward reads P, A_in and
the output gradient (A_out bytes) and writes the input gradient (A_in) and the parameter
gradient (P). Hence ``3 P + 3 A_in + 2 A_out``, where A_in is the previous layer's output
(0 for the first layer: the batch itself is not counted) and an embedding table counts only the
rows a batch touches (``alpha`` of its bytes). Element-wise work inside a layer that the
profile cannot see (intermediate tensors) is not counted: the figure is a lower bound, as
rooflines are.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOP_PER_BYTE = 20.0  # FLOP/s : memory bytes/s of a GPU (H100 SXM fp32 67 TF / 3.35 TB/s)


@dataclass(frozen=True)
class DeviceSpec:
    """A worker's device for projections: ``flops`` FLOP/s and ``mem_Bps`` memory bytes/s
    (None: ``flops / FLOP_PER_BYTE``). Raises ValueError for a rate that is not positive."""

    flops: float
    mem_Bps: float | None = None

    def __post_init__(self):
        if not self.flops > 0:
            raise ValueError(f"--device-tflops must be positive, got {self.flops / 1e12}")
        if self.mem_Bps is not None and not self.mem_Bps > 0:
            raise ValueError(f"--device-mem-gbps must be positive, got {self.mem_Bps / 1e9}")

    @property
    def memory_Bps(self) -> float:
        return self.mem_Bps or self.flops / FLOP_PER_BYTE

    def seconds(self, flops: float, nbytes: float) -> float:
        """Roofline seconds of work doing ``flops`` FLOPs over ``nbytes`` bytes of memory;
        FLOPs alone when no memory bandwidth was given (hpar's projections before
        ``--device-mem-gbps`` existed, kept so that their figures do not move)."""
        compute = flops / self.flops
        return compute if self.mem_Bps is None else max(compute, nbytes / self.mem_Bps)


def layer_bytes(profile) -> list[float]:
    """Bytes each layer of ``profile`` (strategies/profile/profiler.Profile) moves in one
    batch's forward and backward: ``3 P + 3 A_in + 2 A_out`` (module docstring)."""
    params = [0.0] * len(profile.layers)
    for p in profile.params:
        if 0 <= p.layer < len(params):
            params[p.layer] += p.alpha * p.bytes if p.embedding_module else p.bytes
    out = []
    for li, layer in enumerate(profile.layers):
        a_in = profile.layers[li - 1].activation_bytes if li > 0 else 0
        out.append(3.0 * params[li] + 3.0 * a_in + 2.0 * layer.activation_bytes)
    return out


def layer_seconds(profile, device: DeviceSpec) -> list[float]:
    """Forward + backward seconds of each layer of one batch on ``device`` (roofline)."""
    return [device.seconds(l.flops, b) for l, b in zip(profile.layers, layer_bytes(profile))]


def compute_seconds(profile, device: DeviceSpec) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one batch on ``device``: the layers' roofline times
    plus the FLOPs outside every layer (the loss) at the FLOP rate, split in the profile's
    forward : backward FLOP ratio (1 : 2 when it counted none)."""
    layers = layer_seconds(profile, device)
    rest = max(0.0, profile.flops - sum(l.flops for l in profile.layers)) / device.flops
    total = sum(layers) + rest
    share = profile.forward_flops / profile.flops if profile.flops > 0 else 1.0 / 3.0
    return total * share, total * (1.0 - share)


def update_seconds_per_byte(device: DeviceSpec) -> float:
    """Seconds per parameter byte of an optimizer update on ``device``: memory bound, 3 bytes
    moved per parameter byte (read the weight and its gradient, write the weight)."""
    return 3.0 / device.memory_Bps
