"""Property-based fuzzing of every public op: each call either raises a clear ValueError/TypeError or returns the
float64 reference's result (no NaN); it never crashes the process, reads outside a tensor, or returns garbage.

Cases run in a worker process (`op_fuzz_worker.py`), so a segfault or an abort fails the case that caused it and
a fresh worker takes the next one. Hypothesis draws the arguments: dtypes, shapes (zero-length sequences, odd head
dims, GQA ratios, block sizes 1..256), memory layouts (packed qkv/kv views, transposed, strided, expanded,
non-unit last stride), index-tensor contents (out of range, negative, non-monotone, strided), extreme ints, and
backends. CI runs a bounded number of examples; `-m slow` runs many more (and on a GPU machine, on CUDA too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WORKER = Path(__file__).parents[1] / "op_fuzz_worker.py"
REPO = Path(__file__).resolve().parents[2]
CASE_TIMEOUT_S = 300
# Words every refusal of a given op must contain one of: the argument it names.
ARGUMENT_WORDS = ("q", "k", "v", "key", "value", "query", "cu_seqlens", "max_seqlen", "window_size", "softmax_scale",
                  "scale", "backend", "deterministic", "block_table", "seq_lens", "slot_mapping", "block_mapping",
                  "k_cache", "v_cache", "attn_mask", "num_splits", "sink_tokens", "head", "dtype", "src", "dst",
                  "sequence", "gather", "causal", "enable_gqa", "cache", "heads", "k_scale", "v_scale",
                  "latent_cache", "v_head_dim", "scale_block", "q_descale", "k_descale", "v_descale", "config")


class Worker:
    """One long-lived worker process; restarted after a case kills it."""

    def __init__(self, device: str):
        self.device = device
        self.process = None

    def _start(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # ioattn chooses by itself
        # The repository (for ioattn) and tests/ (for the shared float64 gradient reference).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)

    def run(self, case: dict) -> dict:
        if self.process is None or self.process.poll() is not None:
            self._start()
        case = dict(case, device=self.device)
        self.process.stdin.write(json.dumps(case) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(timeout=CASE_TIMEOUT_S)
            stderr = self.process.stderr.read()[-3000:]
            self.process = None
            return {"outcome": "crashed", "detail": f"worker exited with code {code}: {stderr}"}
        return json.loads(line)

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker("cuda" if torch.cuda.is_available() else "cpu")
    yield w
    w.close()


def check(worker: Worker, case: dict) -> None:
    result = worker.run(case)
    assert result["outcome"] in ("ok", "refused"), f"{result['outcome']}: {result['detail']}\ncase: {case}"
    if result["outcome"] == "refused":
        message = result["detail"].split(":", 1)[1].lower()
        assert any(word in message for word in ARGUMENT_WORDS), f"the refusal names no argument: {result['detail']}"


fuzz_settings = settings(max_examples=int(os.environ.get("IOATTN_FUZZ_EXAMPLES", "12")), deadline=None,
                         suppress_health_check=list(HealthCheck))


def knobs(draw, valid: dict, hostile: dict) -> dict:
    """One value per argument: all valid (half the cases), or all valid but one drawn from its hostile values, so
    that each refusal is the one argument's and the valid cases reach the kernels."""
    corrupt = draw(st.sampled_from([None] * len(hostile) + sorted(hostile)))
    return {name: draw(hostile[name] if name == corrupt else strategy) for name, strategy in valid.items()}


DTYPES = st.sampled_from(["float16", "bfloat16", "float32"])
BAD_DTYPES = st.sampled_from(["float64", "int32", "bool"])
HEADS = st.sampled_from([(2, 2), (4, 2), (4, 1), (6, 3)])
BAD_HEADS = st.sampled_from([(3, 2), (2, 0), (2, 4)])
HEAD_DIMS = st.sampled_from([8, 16, 24, 40, 64, 72])
BAD_HEAD_DIMS = st.sampled_from([7, 0, 12, 264])
WINDOWS = st.sampled_from([(-1, -1), (-1, 0), (3, -1), (2, 1), (0, 0), (2**31 - 1, -1)])
BAD_WINDOWS = st.sampled_from([(-2, 5), (2**40, -1), (1.5, 0), (1,), "full"])
SCALES = st.sampled_from([None, 0.5, 1.0, -0.25, 3])
BAD_SCALES = st.sampled_from([float("inf"), float("nan"), "abc", True])
BACKENDS = st.sampled_from(["auto", "triton", "torch"])
# The attention ops also take "gluon": refused by name off sm_90 and for what the Gluon forward does not take.
ATTENTION_BACKENDS = st.sampled_from(["auto", "triton", "torch", "gluon"])
BAD_BACKENDS = st.sampled_from(["cuda", None, 1])
SEEDS = st.integers(0, 2**31)
KV_FORMATS = st.sampled_from([None, None, "fp8_e4m3", "fp8_e5m2"])  # None: the cache in the query's dtype
BAD_SCALES_FP8 = st.sampled_from(["missing", "shape", "zero", "nan", "float64", "extra"])


@st.composite
def dense_cases(draw):
    case = knobs(draw, dict(
        seed=SEEDS, dtype=DTYPES, B=st.integers(0, 2), Nq=st.integers(0, 20), Nk=st.integers(0, 20), heads=HEADS,
        D=HEAD_DIMS, causal=st.booleans(), window=WINDOWS, scale=SCALES, backend=ATTENTION_BACKENDS,
        deterministic=st.sampled_from([None, True, False]),
        layout=st.sampled_from(["contiguous", "qkv_packed", "kv_packed", "transposed", "strided", "last_dim_strided",
                                "expanded"]),
        grad=st.booleans(), do_layout=st.sampled_from(["contiguous", "transposed", "strided", "expanded"]),
    ), dict(dtype=BAD_DTYPES, heads=BAD_HEADS, D=BAD_HEAD_DIMS, window=BAD_WINDOWS, scale=BAD_SCALES,
            backend=BAD_BACKENDS, deterministic=st.sampled_from([1, "yes"]), causal=st.sampled_from([1, None])))
    case["Hq"], case["Hkv"] = case.pop("heads")
    return dict(op="flash_attn_func", **case)


@st.composite
def fp8_forward_cases(draw):
    case = knobs(draw, dict(
        seed=SEEDS, dtype=st.sampled_from(["float16", "bfloat16"]), B=st.integers(0, 2), Nq=st.integers(0, 20),
        Nk=st.integers(0, 20), heads=HEADS, D=st.sampled_from([64, 128]), causal=st.booleans(), window=WINDOWS,
        scale=SCALES, backend=st.sampled_from(["auto", "triton", "gluon"]),
        mode=st.sampled_from(["quantize", "hadamard", "e4m3"]), scale_block=st.sampled_from([128, 256]),
        descales=st.just("ok"), config=st.sampled_from([None, None, "wide", "threshold"]),
    ), dict(dtype=BAD_DTYPES, heads=BAD_HEADS, D=st.sampled_from([0, 48, 96, 264]), window=BAD_WINDOWS,
            scale=BAD_SCALES, backend=BAD_BACKENDS, scale_block=st.sampled_from([64, 100, 0, "x"]),
            descales=BAD_SCALES_FP8, config=st.sampled_from(["block_n_32", "threshold_8"])))
    case["Hq"], case["Hkv"] = case.pop("heads")
    return dict(op="flash_attn_fp8_func", **case)


@st.composite
def varlen_cases(draw):
    batch = draw(st.integers(0, 3))
    lengths = st.lists(st.integers(0, 12), min_size=batch, max_size=batch)
    case = knobs(draw, dict(
        seed=SEEDS, dtype=DTYPES, lens_q=lengths, lens_k=lengths, heads=HEADS, D=HEAD_DIMS, causal=st.booleans(),
        window=WINDOWS, scale=SCALES, backend=ATTENTION_BACKENDS, cu_q=st.just("ok"), cu_k=st.just("ok"),
        max_q=st.just("exact"),
    ), dict(dtype=BAD_DTYPES, heads=BAD_HEADS, D=BAD_HEAD_DIMS, window=BAD_WINDOWS, backend=BAD_BACKENDS,
            cu_q=st.sampled_from(("strided", "decreasing", "short_end", "long_end", "nonzero_start", "huge", "int64")),
            cu_k=st.sampled_from(("strided", "decreasing", "long_end", "huge")),
            max_q=st.sampled_from(["small", "huge", "negative", "float"])))
    case["Hq"], case["Hkv"] = case.pop("heads")
    return dict(op="flash_attn_varlen_func", **case)


@st.composite
def sdpa_cases(draw):
    b, nq, nk = draw(st.integers(0, 2)), draw(st.integers(0, 12)), draw(st.integers(0, 12))
    case = knobs(draw, dict(
        seed=SEEDS, dtype=DTYPES, heads=HEADS, D=HEAD_DIMS, causal=st.booleans(), scale=SCALES,
        gqa=st.just(True), backend=ATTENTION_BACKENDS, mask=st.sampled_from([None, "bool", "float32"]),
        mask_shape=st.sampled_from([(nq, nk), (b, 1, nq, nk), (1, nk), (1, 1, 1, nk)]),
    ), dict(dtype=BAD_DTYPES, heads=BAD_HEADS, D=BAD_HEAD_DIMS, scale=BAD_SCALES, backend=BAD_BACKENDS,
            gqa=st.just(False), mask=st.sampled_from(["int32"]), mask_shape=st.sampled_from([(nq + 1, nk), (2, 3, 1, 1, 1)])))
    case["Hq"], case["Hkv"] = case.pop("heads")
    if case["mask"] is not None:
        case["causal"] = False  # a mask with is_causal is its own refusal, drawn as such below
    elif draw(st.integers(0, 9)) == 9:
        case.update(mask="bool", causal=True)
    return dict(op="sdpa", B=b, Nq=nq, Nk=nk, mask_shape=list(case.pop("mask_shape")), **case)


@st.composite
def paged_cases(draw):
    batch = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    decode = draw(st.booleans())
    q_lens = None if decode else [draw(st.integers(0, n)) for n in lens]
    case = knobs(draw, dict(
        seed=SEEDS, dtype=DTYPES, page=st.sampled_from([1, 2, 4, 16, 64, 256]), Hkv=st.sampled_from([1, 2]),
        group=st.sampled_from([1, 2, 4, 8]), D=st.sampled_from([16, 32, 40]),
        window=st.sampled_from([(-1, -1), (5, -1), (0, -1), (3, 0)]), sinks=st.sampled_from([0, 2]),
        splits=st.sampled_from([0, 1, 3, 64]), gather=st.sampled_from([None, False] + ([True] if not decode else [])),
        table=st.just("ok"), lens=st.just("ok"), cu_q=st.just("ok"),
        extra_query=st.just(False), backend=BACKENDS, kv=KV_FORMATS, scales=st.just("ok"),
        config=st.sampled_from([None, "triton"]),
    ), dict(dtype=BAD_DTYPES, backend=BAD_BACKENDS, scales=BAD_SCALES_FP8, page=st.sampled_from([3, 512]), splits=st.sampled_from([-1, 65, 1.0]),
            # the Gluon decode takes none of these head dims (nor a CPU); block_n 16 it cannot build at all
            config=st.sampled_from(["gluon", "gluon_block_n_16"]),
            sinks=st.sampled_from([-1, 2**40]), table=st.sampled_from(["oob", "num_blocks", "negative", "evicted", "transposed"]),
            lens=st.sampled_from(["past_capacity", "negative"]), window=BAD_WINDOWS,
            gather=st.sampled_from(["yes"]), extra_query=st.just(not decode),
            cu_q=st.sampled_from(["ok"] if decode else ["strided", "short_end", "decreasing"])))
    if case.pop("extra_query"):
        q_lens[0] = lens[0] + 1  # more queries than keys
    return dict(op="paged_attention", batch=batch, seq_lens=lens, q_lens=q_lens, **case)


@st.composite
def mla_cases(draw):
    batch = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    decode = draw(st.booleans())
    q_lens = None if decode else [draw(st.integers(0, n)) for n in lens]
    case = knobs(draw, dict(
        seed=SEEDS, dtype=DTYPES, page=st.sampled_from([1, 2, 4, 16, 64, 256]), heads=st.sampled_from([1, 3, 16, 20]),
        latent=st.sampled_from([32, 48]), rope=st.sampled_from([8, 16]), v_head_dim=st.just("latent"),
        q_extra=st.just(0), scale=SCALES, splits=st.sampled_from([0, 1, 3, 64]), table=st.just("ok"),
        lens=st.just("ok"), cu_q=st.just("ok"), extra_query=st.just(False), backend=BACKENDS,
        config=st.sampled_from([None, "triton", "triton_half_grid"]),
    ), dict(dtype=BAD_DTYPES, backend=BAD_BACKENDS, page=st.sampled_from([3, 512]), scale=BAD_SCALES,
            # the Gluon MLA decode takes none of these latents (nor a CPU); block_n 16, or a seesaw of 32-key
            # tiles, it cannot build at all
            config=st.sampled_from(["gluon", "gluon_wgmma", "gluon_block_n_16", "gluon_seesaw", "gluon_staged",
                                    "gluon_seesaw_block_n_32"]),
            splits=st.sampled_from([-1, 65, 1.0]), v_head_dim=st.sampled_from([0, 7, 2048, "all", None]),
            q_extra=st.sampled_from([8, -8]), heads=st.sampled_from([0]),
            table=st.sampled_from(["oob", "num_blocks", "negative", "evicted", "transposed"]),
            lens=st.sampled_from(["past_capacity", "negative"]), extra_query=st.just(not decode),
            cu_q=st.sampled_from(["ok"] if decode else ["strided", "short_end", "decreasing"])))
    if case["v_head_dim"] == "latent":
        case["v_head_dim"] = case["latent"]
    elif case["v_head_dim"] == "all":  # no RoPE part left
        case["v_head_dim"] = case["latent"] + case["rope"]
    if case.pop("extra_query"):
        q_lens[0] = lens[0] + 1  # more queries than keys
    return dict(op="mla_paged_attention", batch=batch, seq_lens=lens, q_lens=q_lens, **case)


@st.composite
def cache_write_cases(draw):
    case = knobs(draw, dict(
        seed=SEEDS, dtype=DTYPES, page=st.sampled_from([1, 4, 16]), Hkv=st.sampled_from([1, 3]),
        D=st.sampled_from([16, 24]), tokens=st.integers(0, 4), slots=st.sampled_from(["ok", "padding"]),
        slot_dtype=st.sampled_from(["int64", "int32"]), backend=BACKENDS, kv=KV_FORMATS, scales=st.just("ok"),
    ), dict(dtype=BAD_DTYPES, backend=BAD_BACKENDS, scales=BAD_SCALES_FP8, slots=st.sampled_from(["oob", "huge", "below_padding", "duplicate"]),
            slot_dtype=st.sampled_from(["float32"])))
    return dict(op="reshape_and_cache", **case)


@st.composite
def block_copy_cases(draw):
    pairs = draw(st.lists(st.tuples(st.integers(-2, 7), st.integers(-2, 7)), max_size=3))
    return dict(op=draw(st.sampled_from(["copy_blocks", "swap_blocks"])), seed=draw(SEEDS),
                pairs=[list(p) for p in pairs], kv=draw(KV_FORMATS))


@fuzz_settings
@given(case=dense_cases())
def test_flash_attn_func_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=fp8_forward_cases())
def test_flash_attn_fp8_func_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=varlen_cases())
def test_flash_attn_varlen_func_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=sdpa_cases())
def test_sdpa_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=paged_cases())
def test_paged_attention_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=mla_cases())
def test_mla_paged_attention_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=cache_write_cases())
def test_reshape_and_cache_fuzz(worker, case):
    check(worker, case)


@fuzz_settings
@given(case=block_copy_cases())
def test_block_copy_fuzz(worker, case):
    check(worker, case)


# The findings, kept as fixed cases: each crashed the process or returned garbage before.
KNOWN_CASES = [
    dict(op="flash_attn_func", seed=1, dtype="float16", B=1, Nq=40, Nk=40, Hq=2, Hkv=2, D=16, causal=True,
         window=(-1, -1), scale=None, backend="triton", deterministic=None, layout="qkv_packed", grad=True,
         do_layout="contiguous"),
    dict(op="flash_attn_func", seed=2, dtype="float16", B=2, Nq=24, Nk=24, Hq=4, Hkv=2, D=40, causal=False,
         window=(-1, -1), scale=None, backend="triton", deterministic=True, layout="kv_packed", grad=True,
         do_layout="strided"),
    dict(op="flash_attn_func", seed=3, dtype="bfloat16", B=1, Nq=9, Nk=17, Hq=2, Hkv=1, D=24, causal=True,
         window=(-1, -1), scale=None, backend="triton", deterministic=None, layout="contiguous", grad=True,
         do_layout="contiguous"),
    dict(op="flash_attn_varlen_func", seed=4, dtype="float32", lens_q=[3, 4, 5], lens_k=[3, 4, 5], Hq=2, Hkv=2,
         D=16, causal=True, window=(-1, -1), scale=None, backend="triton", cu_q="strided", cu_k="strided",
         max_q="exact"),
    dict(op="flash_attn_varlen_func", seed=5, dtype="float32", lens_q=[3, 4], lens_k=[3, 4], Hq=2, Hkv=2, D=16,
         causal=False, window=(-1, -1), scale=None, backend="triton", cu_q="short_end", cu_k="ok", max_q="exact"),
    *[dict(op="paged_attention", seed=6, dtype="float32", batch=2, seq_lens=[9, 4], q_lens=None, page=4, Hkv=2,
           group=2, D=16, window=(-1, -1), sinks=0, splits=0, gather=None, table=table, lens=lens, cu_q="ok")
      for table, lens in (("oob", "ok"), ("num_blocks", "ok"), ("evicted", "ok"), ("ok", "past_capacity"),
                          ("ok", "negative"))],
    dict(op="paged_attention", seed=7, dtype="bfloat16", batch=1, seq_lens=[20], q_lens=[21], page=4, Hkv=1,
         group=2, D=16, window=(-1, -1), sinks=0, splits=0, gather=None, table="ok", lens="ok", cu_q="ok"),
    dict(op="paged_attention", seed=8, dtype="bfloat16", batch=2, seq_lens=[30, 7], q_lens=None, page=2, Hkv=1,
         group=4, D=32, window=(-1, -1), sinks=0, splits=3, gather=None, table="ok", lens="ok", cu_q="ok"),
    dict(op="reshape_and_cache", seed=9, dtype="float32", page=4, Hkv=1, D=16, tokens=3, slots="oob",
         slot_dtype="int64"),
    # FP8 caches: bf16 decode over splits and GQA 4, a gathered chunk, saturating writes, and every bad scale.
    dict(op="paged_attention", seed=10, dtype="bfloat16", batch=2, seq_lens=[30, 7], q_lens=None, page=2, Hkv=2,
         group=4, D=32, window=(-1, -1), sinks=0, splits=3, gather=None, table="ok", lens="ok", cu_q="ok",
         kv="fp8_e4m3", scales="ok"),
    dict(op="paged_attention", seed=11, dtype="float16", batch=2, seq_lens=[21, 9], q_lens=[21, 4], page=4, Hkv=1,
         group=2, D=16, window=(-1, -1), sinks=0, splits=1, gather=True, table="ok", lens="ok", cu_q="ok",
         kv="fp8_e5m2", scales="ok"),
    dict(op="reshape_and_cache", seed=12, dtype="bfloat16", page=4, Hkv=3, D=16, tokens=4, slots="padding",
         slot_dtype="int64", kv="fp8_e4m3", scales="ok"),
    *[dict(op="paged_attention", seed=13, dtype="float32", batch=1, seq_lens=[9], q_lens=None, page=4, Hkv=2,
           group=1, D=16, window=(-1, -1), sinks=0, splits=0, gather=None, table="ok", lens="ok", cu_q="ok",
           kv="fp8_e4m3", scales=bad) for bad in ("missing", "shape", "zero", "nan", "float64")],
    # config=: an explicit Triton tile runs; the Gluon decode is refused by name (no sm_90 here, or head dim 32),
    # and a Gluon tile of 16 keys everywhere.
    *[dict(op="paged_attention", seed=14, dtype="bfloat16", batch=2, seq_lens=[30, 7], q_lens=None, page=16, Hkv=2,
           group=4, D=32, window=(-1, -1), sinks=0, splits=0, gather=None, table="ok", lens="ok", cu_q="ok",
           config=config) for config in ("triton", "gluon", "gluon_block_n_16")],
    # mla_paged_attention's config= likewise: the Gluon MLA decode at 16 and 64 heads per program (lockstep, seesaw,
    # O staged) refused by name (no sm_90 here, or latent 32 with RoPE 16); a Gluon tile of 16 keys, or a seesaw of
    # 32-key tiles, everywhere.
    *[dict(op="mla_paged_attention", seed=15, dtype="bfloat16", batch=2, seq_lens=[30, 7], q_lens=None, page=16,
           latent=32, rope=16, heads=16, v_head_dim=32, q_extra=0, scale=None, splits=0, table="ok", lens="ok",
           cu_q="ok", backend="auto", config=config)
      for config in ("triton", "gluon", "gluon_wgmma", "gluon_block_n_16", "gluon_seesaw", "gluon_staged",
                     "gluon_seesaw_block_n_32")],
    # A softmax row one-hot to 3.5e-7: dq cancels to far below its summands, which float32 rounds in any backward
    # (the gradient checks add float32's tolerance of those summands' magnitude).
    dict(op="flash_attn_func", seed=3, dtype="float16", B=1, Nq=1, Nk=2, D=72, causal=False, window=(-1, -1),
         scale=0.5, backend="auto", deterministic=None, layout="contiguous", grad=True, do_layout="contiguous", Hq=2,
         Hkv=2),
    # e4m3 inputs under MQA (4 query heads on 1 KV head): the per-query-head descales were an expanded view whose
    # head stride was 0, which the Triton kernel read past (heads 1-3 took stray scales: rel error 0.74).
    dict(op="flash_attn_fp8_func", seed=53335013, dtype="bfloat16", B=1, Nq=14, Nk=13, D=64, causal=True,
         window=(-1, 0), scale=3, backend="auto", mode="e4m3", scale_block=256, descales="ok", Hq=4, Hkv=1),
    # torch's CPU SDPA kernel under a causal call with a scale <= 0: NaN (its mask is applied before the scale).
    dict(op="sdpa", B=1, Nq=1, Nk=2, mask_shape=[1, 2], seed=0, dtype="float16", D=8, causal=True, scale=-0.25,
         gqa=True, backend="auto", mask=None, Hq=2, Hkv=2),
]


@pytest.mark.parametrize("index", range(len(KNOWN_CASES)))
def test_known_findings(worker, index):
    check(worker, KNOWN_CASES[index])


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.one_of(dense_cases(), fp8_forward_cases(), varlen_cases(), sdpa_cases(), paged_cases(), mla_cases(),
                      cache_write_cases(), block_copy_cases()))
def test_every_op_fuzz_long(worker, case):
    check(worker, case)
