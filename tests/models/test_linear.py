"""`ioattn.models.llama.linear`: F.linear's result (to float32 rounding) on every side of the skinny threshold, with
and without bias, contiguous like F.linear's, and the skinny form taken only where it is meant to be."""

import pytest
import torch
import torch.nn.functional as F

from ioattn.models import llama
from ioattn.reference import rel_error


@pytest.mark.parametrize("rows", [1, 4, llama.SKINNY_ROWS, llama.SKINNY_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen), torch.randn(80, 96, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    out = llama.linear(x, weight, b)
    assert out.shape == (rows, 80) and out.is_contiguous()
    assert rel_error(out, x.double() @ weight.double().t() + (0 if b is None else b.double())) < 1e-6
    assert rel_error(out, F.linear(x, weight, b)) < 1e-6


def test_skinny_form_only_for_few_float32_cpu_rows(monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *args: calls.append(1) or real_mm(*args))
    weight = torch.randn(8, 16)
    llama.linear(torch.randn(llama.SKINNY_ROWS, 16), weight)
    assert calls == [1]
    llama.linear(torch.randn(llama.SKINNY_ROWS + 1, 16), weight)
    llama.linear(torch.randn(4, 16, dtype=torch.float64), weight.double())
    llama.linear(torch.randn(2, 4, 16), weight)
    assert calls == [1]
