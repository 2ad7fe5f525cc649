"""How a command runs on this machine, decided once at start-up: the allocator settings
(allocator.py), the precision (precision.py: bf16 autocast only where the hardware has it),
torch.compile (compile.py: only where it pays) and the peak FLOP/s that MFU divides by (peaks.py).
Measurements are cached per machine (machine.py). Nothing here touches the model; the commands and
the trainer apply the choices from outside.
"""
