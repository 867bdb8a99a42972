"""Offline sm_90 builds of ioattn's Triton kernels on a machine without a GPU (a tool, not part of the package).

Triton's wheel carries ptxas and cuobjdump, so registers, spills, shared memory and the pipelined loop shape
(TTGIR) can be read at no device time. This is how the paged kernel's single-buffered gathers and its register
pressure were found (see ioattn/kernels/paged_attention.py).

    python3 bench/explore/aot.py [--block-n 64] [--warps 4] [--stages 2] [--page 16] [--maxnreg N] [--prefill]

prints, for one paged-attention configuration (bf16, 32/8 heads, D=128), the cuobjdump resource line, the
shared memory and the number of buffers of each shared-memory allocation in the final TTGIR.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "0")  # compile for real, whatever this machine has
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, signature: dict, constexprs: dict, divisible16=(), num_warps=4, num_stages=2, **options):
    """signature: arg name -> Triton type ('*bf16', 'i32', 'fp32'); constexprs: name -> value; divisible16: args
    known to be multiples of 16 (pointers: 16-byte aligned), as the launcher's specialisation would find them."""
    sig = {name: ("constexpr" if name in constexprs else signature[name]) for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible16}
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def resources(kernel) -> str:
    """cuobjdump -res-usage of the cubin: registers, stack (spills), shared and local bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line)


def paged_kernel(block_m, block_n, warps, stages, page, decode, maxnreg=None):
    from ioattn.kernels.paged_attention import paged_attention_kernel as kernel

    types = {n: "i32" for n in kernel.arg_names}
    types.update({n: "*bf16" for n in ("Q", "K_cache", "V_cache")}, Out="*fp32", Lse="*fp32", scale_log2="fp32")
    types.update({n: "*i32" for n in ("Block_table", "Seq_lens", "Cu_seqlens_q")})
    aligned = [n for n in kernel.arg_names if types.get(n, "").startswith("*") or n.startswith("stride_")]
    constexprs = dict(HEAD_DIM=128, BLOCK_D=128, GROUP=4, TOKENS=1 if decode else block_m // 4, BLOCK_M=block_m,
                      BLOCK_N=block_n, PAGE=page, DECODE=decode, IEEE=False, NUM_STAGES=stages)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constexprs, aligned, num_warps=warps, num_stages=stages, **extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--maxnreg", type=int)
    p.add_argument("--prefill", action="store_true", help="multi-token queries (128-row tiles) instead of decode")
    args = p.parse_args()
    kernel = paged_kernel(128 if args.prefill else 16, args.block_n, args.warps, args.stages, args.page,
                          not args.prefill, args.maxnreg)
    buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x", kernel.asm["ttgir"])
    print(resources(kernel))
    print(f"shared {kernel.metadata.shared} B; buffers per pipelined allocation: {buffers}")


if __name__ == "__main__":
    main()
