"""How a command runs on this machine, decided once at start-up: the allocator settings
(allocator.py), the precision (precision.py: bf16 autocast only where the hardware has it),
torch.compile (compile.py: only where it pays), the peak FLOP/s that MFU divides by (peaks.py) and
fp32 decoding's weight layout (split_linear.py, over meshlm.kernels' fp32 kernel) and bf16
decoding's linear layers (bf16_linear.py, over its bf16 kernel), and a decoding model's weights on
2 MB pages (huge_pages.py). Measurements are cached per machine
(meshlm.machine). The commands, the trainer and meshlm.decoding apply the choices to the model from
outside.
"""
