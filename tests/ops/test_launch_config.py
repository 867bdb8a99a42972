"""Launch configurations (`config=` of every kernel family) check themselves when built."""

import pytest

from ioattn.ops.backward import BwdConfig
from ioattn.ops.forward import FwdConfig
from ioattn.ops.mla import MLAConfig
from ioattn.ops.paged import PagedConfig


def test_launch_configs_refuse_what_the_kernels_cannot_build():
    # Every family's config is public (config=): a value no kernel builds fails naming its field.
    cases = [(PagedConfig, {}, dict(block_n=48)), (PagedConfig, {}, dict(block_n=8)),
             (PagedConfig, {}, dict(block_m=512)),
             (PagedConfig, {}, dict(num_warps=3)), (PagedConfig, {}, dict(num_stages=0)),
             (PagedConfig, {}, dict(maxnreg=16)), (PagedConfig, {}, dict(maxnreg=128.0)),
             (PagedConfig, {}, dict(paired_tiles="yes")), (PagedConfig, {}, dict(block_n=True)),
             (FwdConfig, dict(block_m=64, block_n=64, num_warps=4, num_stages=2), dict(block_m=48)),
             (FwdConfig, dict(block_m=64, block_n=64, num_warps=4, num_stages=2), dict(loop_stages=0)),
             (FwdConfig, dict(block_m=64, block_n=64, num_warps=4, num_stages=2), dict(tma=1)),
             (BwdConfig, dict(kv_block_n=64, kv_block_m=32, q_block_m=32, q_block_n=64, num_warps=4, num_stages=2,
                              atomic_dq=False), dict(dq_num_warps=6)),
             (MLAConfig, {}, dict(block_h=12)), (MLAConfig, {}, dict(programs_per_sm=0)),
             (MLAConfig, {}, dict(sms_per_program=0)), (MLAConfig, {}, dict(sms_per_program=2.0)),
             (MLAConfig, {}, dict(sms_per_program=True))]
    for config_type, base, bad in cases:
        with pytest.raises(ValueError, match=f"{config_type.__name__}.{next(iter(bad))}"):
            config_type(**{**base, **bad})
    assert FwdConfig(64, 64, 4, 2, loop_stages=None, maxnreg=None) and BwdConfig(64, 32, 32, 64, 4, 2, True)
