"""meshlm's C kernels, compiled on the machine that runs them: the builder (build.py), the Kernel
helper (kernel.py), the C sources, the fp32 kernel (fp32_rows.py) and the bf16 one (bf16_rows.py;
the int8 and int4 ones are defined in meshlm.quant.row_kernel, .int4_kernel, .int4_bf16_kernel and
.int8_bf16_kernel, beside the torch ops they repeat), and the kernels' torch operators in C++
(operators.cpp, operators.py).

The contract, for each kernel: it is used only after its check against a reference passed in this
process, and only where its probe, measured once per machine (CPU, torch version, threads; cached in
machine.json), found it faster than PyTorch's path: whether a plain loop beats oneDNN depends on the
CPU. Where it cannot be had (its source missing from the install, no compiler, a failed build or
check, MESHLM_NATIVE=0) its user keeps PyTorch's ops and the precision line names the reason and its
fix: never a silent fallback. Below meshlm.runtime and meshlm.quant: it imports neither, and they
import it, not each other (tests/test_imports.py).
"""
