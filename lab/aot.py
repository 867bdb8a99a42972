"""Offline sm_90 builds of ioattn's Triton kernels on a machine without a GPU (a tool, not part of the package).

Triton's wheel carries ptxas and cuobjdump, so registers, spills, shared memory and the pipelined loop shape
(TTGIR) can be read at no device time. This is how the paged kernel's single-buffered gathers and its register
pressure were found (see ioattn/kernels/paged_attention.py).

    PYTHONPATH=. python3 lab/aot.py [--block-n 64] [--warps 4] [--stages 2] [--maxnreg N]
        [--page 16] [--prefill] [--fp8 e4m3|e5m2 [--fp8-cast]] [--fp16] [--paired]   # the paged kernel (decode)
        --forward [--block-m 128] [--head-dim 128] [--causal] [--pointers] [--fp8 e4m3]  # the dense forward
        --mla [--block-h 16] [--prefill --block-m 64]                          # the absorbed MLA kernel
        --gluon [--head-dim 128] [--causal] [--fp16 | --fp8 e4m3] [--stages N] [--block-n N]  # the Gluon forward
        --gluon-paged [--fp8 e4m3|e5m2] [--head-dim 128] [--block-n 32] [--stages 4] [--maxnreg 80] [--page 16]
        ... [--sass]                                            # also the SASS instruction count by opcode

prints, for one configuration (bf16; paged: 32/8 heads, D=128; forward: 32/8 heads, the dense (B, N, H, D)
layout), the cuobjdump resource line (REG: registers per thread, STACK: spill bytes), the shared memory, and
every shared-memory allocation of the final TTGIR with its shape: buffers x tile for the software pipeline's
loads (one buffer: the loop does not overlap them), buffers x 1 x i64 for its barriers. Pointer and stride
arguments are taken as 16-byte aligned, as the launcher's specialisation finds them for contiguous tensors.
"""

import argparse
import collections
import dataclasses
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


def cuobjdump(kernel, flag: str) -> str:
    """What Triton's bundled cuobjdump prints for the kernel's cubin with `flag`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(kernel) -> str:
    """cuobjdump -res-usage of the cubin: registers, stack (spills), shared and local bytes."""
    return " ".join(line.strip() for line in cuobjdump(kernel, "-res-usage").splitlines() if "REG" in line)


def sass_opcodes(kernel) -> collections.Counter:
    """The kernel's SASS instructions counted by opcode (predicates and modifiers dropped): where the
    per-element work goes, e.g. F2F / F2FP / PRMT for conversions, LDSM against LDS for shared-memory reads."""
    lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", cuobjdump(kernel, "-sass"))
    return collections.Counter(lines)


def matmul_loops(kernel) -> list[dict]:
    """The SASS loops (a branch back to an earlier address) that issue wgmmas (HGMMA; QGMMA for fp8), shortest
    first: their instructions, wgmmas and local-memory spill accesses (STL / LDL). A spill in the K/V loop costs
    every tile; one outside it, once per work tile."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);",
                                                                    cuobjdump(kernel, "-sass"))]
    loops = []
    for address, text in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target is None or int(target.group(1), 16) > address:
            continue
        body = [t for a, t in code if int(target.group(1), 16) <= a <= address]
        wgmma = sum(bool(re.search(r"\b[HQ]GMMA\b", t)) for t in body)
        if wgmma:
            loops.append(dict(start=int(target.group(1), 16), end=address, instructions=len(body), wgmma=wgmma,
                              spills=sum(bool(re.search(r"\b(STL|LDL)\b", t)) for t in body)))
    return sorted(loops, key=lambda loop: loop["instructions"])


def paged_kernel(block_m, block_n, warps, stages, page, decode, maxnreg=None, fp8=None, dtype="bf16", cast=False,
                 paired=False):
    """fp8: None (caches in the queries' dtype: K_scale/V_scale are None, as the launcher passes them) or "e4m3" /
    "e5m2"; dtype: the queries' ("bf16" or "fp16"); cast: Triton's conversion to bf16 instead of float16 dots."""
    from ioattn.kernels.paged_attention import paged_attention_kernel as kernel

    types = {n: "i32" for n in kernel.arg_names}
    types.update({n: f"*{dtype}" for n in ("Q", "K_cache", "V_cache")}, Out="*fp32", Lse="*fp32", scale_log2="fp32")
    if fp8 is not None:
        types.update(K_cache=f"*fp8{fp8.replace('e4m3', 'e4nv').replace('e5m2', 'e5')}", K_scale="*fp32",
                     V_scale="*fp32")
        types["V_cache"] = types["K_cache"]
    types.update({n: "*i32" for n in ("Block_table", "Seq_lens", "Cu_seqlens_q")})
    aligned = [n for n in kernel.arg_names if types.get(n, "").startswith("*") or n.startswith("stride_")]
    constexprs = dict(HEAD_DIM=128, BLOCK_D=128, GROUP=4, TOKENS=1 if decode else block_m // 4, BLOCK_M=block_m,
                      BLOCK_N=block_n, PAGE=page, DECODE=decode, IEEE=False, NUM_STAGES=stages, FP8=fp8 is not None,
                      FP16_DOTS=fp8 is not None and dtype == "bf16" and not cast, PAIRED=paired)
    if fp8 is None:
        constexprs.update(K_scale=None, V_scale=None)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constexprs, aligned, num_warps=warps, num_stages=stages, **extra)


def forward_kernel(block_m, block_n, warps, stages, head_dim, causal, tma, maxnreg=None, fp8=False):
    """The dense forward as `ioattn.ops.forward.launch_prefill_fwd` launches it for 32/8-head bf16 inputs without
    a mask (its placeholders: the mask argument is q, the cu_seqlens arguments are the LSE); fp8: e4m3 Q, K, V
    with block scales (`ioattn.ops.fp8_attention`), bf16 output."""
    from ioattn.kernels.prefill_fwd import MASK_NONE, prefill_fwd_kernel as kernel
    from ioattn.ops.forward import head_dim_padded

    types = {n: "i32" for n in kernel.arg_names}
    inputs = "*fp8e4nv" if fp8 else "*bf16"
    types.update({n: inputs for n in ("Q", "K", "V")}, O="*bf16", MASK=inputs, qk_scale="fp32")
    types.update({n: "*fp32" for n in ("LSE", "cu_seqlens_q", "cu_seqlens_k", "K_descale", "V_descale", "Q_scale")})
    aligned = [n for n in kernel.arg_names if (types.get(n, "").startswith("*") or n.startswith("stride_"))
               and n not in kernel.do_not_specialize]
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
                      GROUP=4, PACK_GQA=False, VARLEN=False, BOTTOM_RIGHT=True, LEFT_BOUNDED=False,
                      RIGHT_BOUNDED=causal, MASK_KIND=MASK_NONE, INPUT_PRECISION="ieee", LOOP_STAGES=None,
                      SCALE_POSITIVE=True, TMA=tma, DESCALE=False, FP8=fp8, ROUND_P=False)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constexprs, aligned, num_warps=warps, num_stages=stages, **extra)


def gluon_forward_kernel(head_dim, causal, dtype="bf16", stages=None, block_n=None, pingpong=None, window=False,
                         varlen=False, **override):
    """The Gluon warp-specialized forward as `ioattn.ops.gluon_forward` launches it (its defaults for the head
    dim and mask unless stages / block_n / other GluonConfig fields in override are given); dtype "fp8": e4m3
    inputs (V transposed), bf16 output, block scales;
    window: a sliding window bounded on both sides; varlen: packed sequences (cu_seqlens)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from ioattn.kernels.gluon_fwd import gluon_fwd_kernel as kernel
    from ioattn.ops.gluon_forward import BLOCK_M, box_layout, fp8_gluon_config, gluon_config, separate_o, tile_layout

    fp8 = dtype == "fp8"
    cfg = fp8_gluon_config(head_dim) if fp8 else gluon_config(head_dim, masked=causal or window)
    block_n, stages = block_n or cfg.block_n, stages or cfg.stages
    gl_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8e4nv"}[dtype]
    name = "fp8e4nv" if fp8 else dtype

    def desc(rows, elem=name, gl_elem=gl_dtype):
        return f"tensordesc<{elem}[1, {rows}, 1, {head_dim}],{tile_layout(rows, head_dim, gl_elem)!r}>"

    types = dict(q_desc=desc(BLOCK_M), k_desc=desc(block_n), v_desc=desc(block_n), LSE="*fp32", qk_scale_log2="fp32",
                 o_desc=desc(BLOCK_M, "bf16", "bfloat16") if fp8 else desc(BLOCK_M))
    pingpong = cfg.pingpong if pingpong is None else pingpong
    cfg = dataclasses.replace(cfg, block_n=block_n, stages=stages, pingpong=pingpong, **override)
    constexprs = dict(CONSUMERS=cfg.consumers, SNAKE=cfg.snake, LEFT=window, RIGHT=causal or window, BLOCK_N=block_n,
                      STAGES=stages, RESCALE_THRESHOLD=cfg.rescale_threshold, PINGPONG=cfg.pingpong,
                      CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                      SEPARATE_O=separate_o(head_dim, cfg, 2, fp8), VARLEN=varlen, BAND=cfg.band,
                      P_SHARED=fp8 and cfg.fp8_p_shared, OVERLAP=cfg.overlap, DYNAMIC=cfg.dynamic)
    if cfg.dynamic:
        types.update(Tile_counter="*i32")
    else:
        constexprs.update(Tile_counter=None)
    if varlen:
        types.update(Cu_seqlens_q="*i32", Cu_seqlens_k="*i32", O=f"*{name}")
    else:
        constexprs.update(Cu_seqlens_q=None, Cu_seqlens_k=None, O=None)
    if fp8:
        vt_layout = box_layout((1, 1, head_dim, block_n), "float8e4nv")
        types.update(v_desc=f"tensordesc<fp8e4nv[1, 1, {head_dim}, {block_n}],{vt_layout!r}>",
                     Q_scale="*fp32", K_scale="*fp32", V_scale="*fp32")
    else:
        constexprs.update(Q_scale=None, K_scale=None, V_scale=None)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()},
                         {(kernel.arg_names.index("LSE"),): [["tt.divisibility", 16]]})
    return triton.compile(src, target=TARGET, options=dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))


def gluon_paged_kernel(cache="e4m3", head_dim=128, block_n=32, stages=4, maxnreg=80, page=16, query="bf16",
                       threshold=0.0, release=False):
    """The Gluon paged decode (`PagedConfig(kernel="gluon")`) for 32/8 heads: cache "e4m3" / "e5m2" (fp8) or
    "bf16" / "fp16" (the queries' dtype), TMA boxes of min(page, block_n) slots; release: it lets a dependent launch
    (the split combine) start early."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from ioattn.kernels.gluon_paged import gluon_paged_decode_kernel as kernel

    fp8 = cache in ("e4m3", "e5m2")
    name, gl_name = {"e4m3": ("fp8e4nv", "float8e4nv"), "e5m2": ("fp8e5", "float8e5"), "bf16": ("bf16", "bfloat16"),
                     "fp16": ("fp16", "float16")}[cache]
    query = query if fp8 else cache
    rows = min(page, block_n)
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], getattr(gl, gl_name))
    desc = f"tensordesc<{name}[{rows}, {head_dim}],{layout!r}>"
    types = {n: "i32" for n in kernel.arg_names}
    types.update(k_desc=desc, v_desc=desc, Q=f"*{query}", Block_table="*i32", Seq_lens="*i32", Out="*fp32",
                 Lse="*fp32", K_scale="*fp32", V_scale="*fp32", scale_log2="fp32")
    constexprs = dict(GROUP=4, BLOCK_N=block_n, PAGE=page, STAGES=stages, RESCALE_THRESHOLD=float(threshold),
                      RELEASE_DEPENDENTS=release)
    if not fp8:
        constexprs.update(K_scale=None, V_scale=None)
    aligned = ("Q", "Out", "Lse", "stride_qt", "stride_qh", "stride_ot", "stride_oh")
    sig = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()},
                         {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=TARGET, options=dict(num_warps=4, maxnreg=maxnreg))


def gluon_mla_kernel(block_n=32, stages=3, page=64, maxnreg=None, cache="bf16", wide=False, release=False,
                     seesaw=False, stage_out=False, out="fp32"):
    """The Gluon MLA decode (`MLAConfig(kernel="gluon")`) for DeepSeek-V3's latent 512 + rope 64: TMA boxes of
    min(page, block_n) slots; wide: the 64-heads-per-program wgmma kernel (8 warps); release: it lets a dependent
    launch (the split combine) start early; seesaw: the wide kernel's seesaw schedule (4 warps + partitions);
    stage_out: O stored through the ring's stages; out: O's type (fp32 split partials, or q's type)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from ioattn.kernels.gluon_mla import gluon_mla_decode_kernel as kernel

    name, gl_name = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16", "float16")}[cache]
    rows = min(page, block_n)
    descs = {}
    for arg, width in (("lat_desc", 512), ("rope_desc", 64)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, width], getattr(gl, gl_name))
        descs[arg] = f"tensordesc<{name}[{rows}, {width}],{layout!r}>"
    types = {n: "i32" for n in kernel.arg_names}
    types.update(descs, Q=f"*{name}", Block_table="*i32", Seq_lens="*i32", Out=f"*{out}", Lse="*fp32",
                 scale_log2="fp32")
    constexprs = dict(BLOCK_N=block_n, PAGE=page, STAGES=stages, WIDE=wide, RELEASE_DEPENDENTS=release,
                      SEESAW=seesaw, STAGE_OUT=stage_out)
    aligned = ("Q", "Out", "Lse", "stride_qt", "stride_qh", "stride_os", "stride_ot", "stride_oh")
    sig = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()},
                         {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=8 if wide and not seesaw else 4)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=options)


def mla_kernel(block_h, tokens, block_n, warps, stages, page, decode, maxnreg=None):
    """The absorbed MLA kernel as `ioattn.ops.mla` launches it for DeepSeek-V3's latent 512 + rope 64, bf16."""
    from ioattn.kernels.mla_attention import mla_attention_kernel as kernel

    types = {n: "i32" for n in kernel.arg_names}
    types.update(Q="*bf16", Cache="*bf16", Out="*fp32", Lse="*fp32", scale_log2="fp32")
    types.update({n: "*i32" for n in ("Block_table", "Seq_lens", "Cu_seqlens_q")})
    aligned = [n for n in kernel.arg_names if (types.get(n, "").startswith("*") or n.startswith("stride_"))
               and n not in kernel.do_not_specialize]
    constexprs = dict(LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=block_h, TOKENS=tokens, BLOCK_N=block_n,
                      PAGE=page, DECODE=decode, IEEE=False, NUM_STAGES=stages)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constexprs, aligned, num_warps=warps, num_stages=stages, **extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, help="keys per tile (default 64; gluon: its head dim's config)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, help="pipeline stages (default 2; gluon: its head dim's config)")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--maxnreg", type=int)
    p.add_argument("--prefill", action="store_true", help="paged: multi-token queries (128-row tiles), not decode")
    p.add_argument("--fp8", choices=("e4m3", "e5m2"), help="paged: an fp8 cache instead of one in the queries' dtype; "
                   "forward (e4m3): the FP8 forward")
    p.add_argument("--fp8-cast", action="store_true", help="paged fp8: Triton's conversion, not float16 dots")
    p.add_argument("--paired", action="store_true", help="paged: whole tiles two per loop step (paired_tiles)")
    p.add_argument("--forward", action="store_true", help="the dense forward kernel instead of the paged one")
    p.add_argument("--block-m", type=int, default=128, help="forward: query rows per tile")
    p.add_argument("--head-dim", type=int, default=128, help="forward: head dim")
    p.add_argument("--causal", action="store_true", help="forward: causal (the window's right bound at 0)")
    p.add_argument("--pointers", action="store_true", help="forward: pointer loads instead of tensor descriptors")
    p.add_argument("--mla", action="store_true", help="the absorbed MLA kernel (latent 512 + rope 64)")
    p.add_argument("--block-h", type=int, default=16, help="mla: query heads per program")
    p.add_argument("--gluon", action="store_true", help="the Gluon warp-specialized forward (sm_90)")
    p.add_argument("--fp16", action="store_true", help="gluon and paged: fp16 instead of bf16 (queries)")
    p.add_argument("--sass", action="store_true", help="also count the SASS instructions by opcode")
    p.add_argument("--no-pingpong", action="store_true", help="gluon: consumers issue their wgmmas unordered")
    p.add_argument("--gluon-paged", action="store_true", help="the Gluon paged decode (sm_90)")
    args = p.parse_args()
    if args.gluon_paged:
        cache = args.fp8 or ("fp16" if args.fp16 else "bf16")
        kernel = gluon_paged_kernel(cache, args.head_dim, args.block_n or 32, args.stages or 4, args.maxnreg or 80,
                                    args.page, "fp16" if args.fp16 else "bf16")
    elif args.gluon:
        kernel = gluon_forward_kernel(args.head_dim, args.causal,
                                      "fp8" if args.fp8 == "e4m3" else "fp16" if args.fp16 else "bf16", args.stages,
                                      args.block_n, False if args.no_pingpong else None)
    elif args.mla:
        tokens = 1 if not args.prefill else max(1, args.block_m // args.block_h)
        kernel = mla_kernel(args.block_h, tokens, args.block_n or 32, args.warps, args.stages or 2, args.page,
                            not args.prefill, args.maxnreg)
    elif args.forward:
        kernel = forward_kernel(args.block_m, args.block_n or 64, args.warps, args.stages or 2, args.head_dim,
                                args.causal, not args.pointers, args.maxnreg, args.fp8 == "e4m3")
    else:
        kernel = paged_kernel(128 if args.prefill else 16, args.block_n or 64, args.warps, args.stages or 2,
                              args.page, not args.prefill, args.maxnreg, args.fp8, "fp16" if args.fp16 else "bf16",
                              args.fp8_cast, args.paired)
    allocs = re.findall(r"%(\w+) = ttg.local_alloc : \(\) -> !ttg.memdesc<([^,]+),", kernel.asm["ttgir"])
    print(resources(kernel))
    print(f"shared {kernel.metadata.shared} B; allocations: " + ", ".join(f"{n} {shape}" for n, shape in allocs))
    if args.sass:
        opcodes = sass_opcodes(kernel)
        print(f"SASS: {sum(opcodes.values())} instructions; "
              + ", ".join(f"{op} {n}" for op, n in opcodes.most_common()))


if __name__ == "__main__":
    main()
