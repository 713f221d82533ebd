"""Pipeline communication cannot deadlock on NCCL (issue 13, item 4).

NCCL's send does not complete until the peer's matching receive runs, and one pair's
operations run in order. The strictest model of that: every posted batch of operations
(``Links`` posts its queued sends together with its next receive, one ``batch_isend_irecv``)
completes only when every operation in it meets its counterpart in the peer's currently
posted batch. These tests drive the real ``Links`` of every stage through the same calls as
``strategies/runtimes/pipeline/pipeline_runtime.py``, record the batches they post, and replay them under that
model for every schedule, K = 2..8 stages and M = 1..8 micro-batches.
"""

import itertools

import pytest
import torch

from hpar.strategies.runtimes.pipeline.comm import Links
from hpar.strategies.plan.schedules import ASYNC_SCHEDULES, SYNC_SCHEDULES, is_synchronous, stage_ops


class Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


class Recorder:
    """A transport that records the batches a stage posts (op, peer, channel) and completes
    them at once (receives get zeros: a header of zeros announces a float32 scalar)."""

    def __init__(self):
        self.batches = []

    def post(self, ops):
        for o in ops:
            if o.op == "recv":
                o.tensor.zero_()
        self.batches.append([(o.op, o.peer, o.channel) for o in ops])
        return [Done() for _ in ops]


class Unpaired(Links):
    """The order before the fix: every send posted on its own, as soon as it is made."""

    def _queue(self, tensor, dst, tag, channel):
        super()._queue(tensor, dst, tag, channel)
        self._post([])


def transcripts(schedule: str, K: int, M: int, steps: int = 2, links_class=Links) -> list[list]:
    """Each stage's posted batches, driving Links exactly as runtime.train does."""
    out = []
    for k in range(K):
        rec = Recorder()
        links = links_class(k, K, torch.device("cpu"), transport=rec)
        act = torch.zeros(())

        def run(op):
            if op.kind == "F":
                if k > 0:
                    links.recv_activation()
                if k < K - 1:
                    links.send_activation(act)
            else:
                if k < K - 1:
                    links.recv_gradient()
                if k > 0:
                    links.send_gradient(act)

        def end_step():
            links.flush()
            if K > 1 and k == K - 1:
                links.send_loss(0.0)
            elif K > 1 and k == 0:
                links.recv_loss()

        if is_synchronous(schedule):
            for _ in range(steps):
                for op in stage_ops(schedule, K, k, M):
                    run(op)
                end_step()
        else:
            for op in stage_ops(schedule, K, k, steps * M):
                run(op)
                if op.kind == "B" and (op.micro + 1) % M == 0:
                    end_step()
        links.flush()
        out.append([b for b in rec.batches if b])
    return out


def replay(per_stage: list[list], buffered=("host",)) -> bool:
    """True when the stages' batches all complete; False on deadlock. A send on the dense
    channel (NCCL on CUDA) blocks until its receive is posted; a send on a ``buffered``
    channel (gloo's asynchronous isend on the host channel, which no stream orders)
    completes when posted, its receive once the send is posted. The i-th send from a to b on
    a channel meets the i-th receive at b from a on it."""
    count, ids = {}, []
    for k, batches in enumerate(per_stage):
        ids.append([])
        for batch in batches:
            mine = []
            for op, peer, channel in batch:
                key = (k, peer, channel) if op == "send" else (peer, k, channel)
                n = count.get((key, op), 0)
                count[(key, op)] = n + 1
                mine.append((key, n, op))
            ids[-1].append(mine)
    assert all(count.get((key, "recv")) == n for (key, op), n in count.items() if op == "send"), "unmatched messages"
    pos, done = [0] * len(per_stage), set()
    while any(pos[k] < len(ids[k]) for k in range(len(ids))):
        posted = {x for k in range(len(ids)) if pos[k] < len(ids[k]) for x in ids[k][pos[k]]}
        for key, n, op in posted:
            if op == "send" and key[2] in buffered:
                done.add((key, n, "send"))
        for key, n, op in posted:
            if op == "recv" and key[2] in buffered and (key, n, "send") in done:
                done.add((key, n, "recv"))
            if op == "send" and (key, n, "recv") in posted:
                done |= {(key, n, "send"), (key, n, "recv")}
        moved = False
        for k in range(len(ids)):
            if pos[k] < len(ids[k]) and all(x in done for x in ids[k][pos[k]]):
                pos[k] += 1
                moved = True
        if not moved:
            return False
    return True


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES + ASYNC_SCHEDULES)
def test_no_schedule_deadlocks_with_blocking_sends(schedule):
    for K, M in itertools.product(range(2, 9), range(1, 9)):
        assert replay(transcripts(schedule, K, M)), f"{schedule} K={K} M={M} deadlocks"


def test_the_model_finds_the_unpaired_1f1b_deadlock():
    # each send posted alone (the order before the fix): stage 0 sends activation 1 while
    # stage 1 sends gradient 0, neither receive posted
    assert not replay(transcripts("1f1b", 2, 2, links_class=Unpaired))
    assert replay(transcripts("gpipe", 2, 1, links_class=Unpaired))  # nothing to cross with one micro-batch
    # and with every channel blocking, the end-of-step loss would need its own pairing
    assert not replay(transcripts("async", 2, 1), buffered=())


def test_headers_and_losses_travel_on_the_host_channel():
    stages = transcripts("1f1b", 3, 4, steps=1)
    flat = [x for b in stages[0] + stages[1] + stages[2] for x in b]
    assert ("send", 1, "host") in flat and ("send", 0, "host") in flat  # header 0->1, loss 2->0
    from_2 = [ch for b in stages[1] for op, peer, ch in b if op == "recv" and peer == 2]
    assert from_2 and set(from_2) == {"dense"}  # stage 1 gets only gradients from stage 2, on the dense group
