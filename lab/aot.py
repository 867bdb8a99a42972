"""Offline sm_90 builds of ioattn's Triton kernels on a machine without a GPU (a tool, not part of the package).

Triton's wheel carries ptxas and cuobjdump, so registers, spills, shared memory and the pipelined loop shape
(TTGIR) can be read at no device time. This is how the paged kernel's single-buffered gathers and its register
pressure were found (see ioattn/kernels/paged_attention.py).

    PYTHONPATH=. python3 lab/aot.py [--block-n 64] [--warps 4] [--stages 2] [--maxnreg N]
        [--page 16] [--prefill] [--fp8 e4m3|e5m2]               # the paged kernel (the default: decode)
        --forward [--block-m 128] [--head-dim 128] [--causal] [--pointers]    # the dense forward kernel

prints, for one configuration (bf16; paged: 32/8 heads, D=128; forward: 32/8 heads, the dense (B, N, H, D)
layout), the cuobjdump resource line (REG: registers per thread, STACK: spill bytes), the shared memory, and
every shared-memory allocation of the final TTGIR with its shape: buffers x tile for the software pipeline's
loads (one buffer: the loop does not overlap them), buffers x 1 x i64 for its barriers. Pointer and stride
arguments are taken as 16-byte aligned, as the launcher's specialisation finds them for contiguous tensors.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

if __name__ == "__main__":  # compile for real, whatever this machine has (imported, it leaves the choice alone)
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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


def paged_kernel(block_m, block_n, warps, stages, page, decode, maxnreg=None, fp8=None):
    """fp8: None (bf16 caches: K_scale/V_scale are None, as the launcher passes them) or "e4m3" / "e5m2"."""
    from ioattn.kernels.paged_attention import paged_attention_kernel as kernel

    types = {n: "i32" for n in kernel.arg_names}
    types.update({n: "*bf16" for n in ("Q", "K_cache", "V_cache")}, Out="*fp32", Lse="*fp32", scale_log2="fp32")
    if fp8 is not None:
        types.update(K_cache=f"*fp8{fp8.replace('e4m3', 'e4nv').replace('e5m2', 'e5')}", K_scale="*fp32",
                     V_scale="*fp32")
        types["V_cache"] = types["K_cache"]
    types.update({n: "*i32" for n in ("Block_table", "Seq_lens", "Cu_seqlens_q")})
    aligned = [n for n in kernel.arg_names if types.get(n, "").startswith("*") or n.startswith("stride_")]
    constexprs = dict(HEAD_DIM=128, BLOCK_D=128, GROUP=4, TOKENS=1 if decode else block_m // 4, BLOCK_M=block_m,
                      BLOCK_N=block_n, PAGE=page, DECODE=decode, IEEE=False, NUM_STAGES=stages, FP8=fp8 is not None)
    if fp8 is None:
        constexprs.update(K_scale=None, V_scale=None)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constexprs, aligned, num_warps=warps, num_stages=stages, **extra)


def forward_kernel(block_m, block_n, warps, stages, head_dim, causal, tma, maxnreg=None):
    """The dense forward as `ioattn.ops.forward.launch_prefill_fwd` launches it for 32/8-head bf16 inputs without
    a mask (its placeholders: the mask argument is q, the cu_seqlens arguments are the LSE)."""
    from ioattn.kernels.prefill_fwd import MASK_NONE, prefill_fwd_kernel as kernel
    from ioattn.ops.forward import head_dim_padded

    types = {n: "i32" for n in kernel.arg_names}
    types.update({n: "*bf16" for n in ("Q", "K", "V", "O", "MASK")}, qk_scale="fp32")
    types.update({n: "*fp32" for n in ("LSE", "cu_seqlens_q", "cu_seqlens_k", "K_descale", "V_descale")})
    aligned = [n for n in kernel.arg_names if (types.get(n, "").startswith("*") or n.startswith("stride_"))
               and n not in kernel.do_not_specialize]
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
                      GROUP=4, PACK_GQA=False, VARLEN=False, BOTTOM_RIGHT=True, LEFT_BOUNDED=False,
                      RIGHT_BOUNDED=causal, MASK_KIND=MASK_NONE, INPUT_PRECISION="ieee", LOOP_STAGES=None,
                      SCALE_POSITIVE=True, TMA=tma, DESCALE=False)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constexprs, aligned, num_warps=warps, num_stages=stages, **extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--maxnreg", type=int)
    p.add_argument("--prefill", action="store_true", help="paged: multi-token queries (128-row tiles), not decode")
    p.add_argument("--fp8", choices=("e4m3", "e5m2"), help="paged: an fp8 cache (bf16 queries) instead of bf16")
    p.add_argument("--forward", action="store_true", help="the dense forward kernel instead of the paged one")
    p.add_argument("--block-m", type=int, default=128, help="forward: query rows per tile")
    p.add_argument("--head-dim", type=int, default=128, help="forward: head dim")
    p.add_argument("--causal", action="store_true", help="forward: causal (the window's right bound at 0)")
    p.add_argument("--pointers", action="store_true", help="forward: pointer loads instead of tensor descriptors")
    args = p.parse_args()
    if args.forward:
        kernel = forward_kernel(args.block_m, args.block_n, args.warps, args.stages, args.head_dim, args.causal,
                                not args.pointers, args.maxnreg)
    else:
        kernel = paged_kernel(128 if args.prefill else 16, args.block_n, args.warps, args.stages, args.page,
                              not args.prefill, args.maxnreg, args.fp8)
    allocs = re.findall(r"%(\w+) = ttg.local_alloc : \(\) -> !ttg.memdesc<([^,]+),", kernel.asm["ttgir"])
    print(resources(kernel))
    print(f"shared {kernel.metadata.shared} B; allocations: " + ", ".join(f"{n} {shape}" for n, shape in allocs))


if __name__ == "__main__":
    main()
