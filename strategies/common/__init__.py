"""What every stage and process shares, below the flow: ``devices`` (what moves between host
and device, CUDA-event timing), ``groups`` (which process group, gloo or NCCL, carries what;
what gloo can reduce), ``gather`` (small AllGathers of ints and JSON), ``measured_memory``
(measured peak memory) and ``activity`` (what a process is busy with outside the steps, for the
launcher's phase deadline). Imports nothing of hpar but specs/.
"""
