"""The package's own CPU product kernel (``models.native``, the ``packed`` kind of ``models.products``): the product
within float32's rounding for the reduction length, each output rounding the same whatever the row count, the same
bits from its AVX2 build as from its AVX-512 one, and torch's kernels alone where it cannot be built."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trtllm_dflash.models import native, products

pytestmark = pytest.mark.skipif(native.isa_flags() is None, reason="the CPU has no AVX2 with FMA")

SHAPES = [(96, 48), (40, 37), (3, 576), (960, 576)]  # (out, in): whole panels, a partial one, fewer than one


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on float32 rounding in x · Wᵀ: reduction length × eps × Σ|x||w|."""
    return x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_the_packed_product_is_x_times_w_transposed(out_features, in_features):
    """Every row count a tile or its tail covers (1 to 33 rows), with and without a bias, against float64."""
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    packed = products.prepare("packed", w)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    with torch.inference_mode():
        for m in (*range(1, 18), 24, 33):
            x = torch.randn(m, in_features, generator=g)
            for b in (None, bias):
                got = products.run("packed", x, packed, b, out_features)
                exact = F.linear(x.double(), w.double(), None if b is None else b.double())
                assert got.shape == (m, out_features) and got.dtype == torch.float32
                assert ((got.double() - exact).abs() <= _tolerance(x, w) + 1e-12).all(), (m, b is None)


def test_an_output_rounds_the_same_whatever_the_row_count():
    """Row r of an m-row product equals the same row multiplied alone, bit for bit (a verify row rounds as the same
    token decoded alone), where x·Wᵀ's library kernels round differently between row counts."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(960, 576, generator=g)
    packed = products.prepare("packed", w)
    x = torch.randn(33, 576, generator=g)
    with torch.inference_mode():
        alone = torch.cat([products.run("packed", x[r:r + 1], packed, None) for r in range(33)])
        for m in (2, 3, 4, 5, 8, 12, 13, 16, 33):
            assert torch.equal(products.run("packed", x[:m], packed, None), alone[:m]), m


_PROBE = """
import json, sys, torch
from pathlib import Path
from trtllm_dflash.models import native
isa, out = json.loads(sys.argv[1]), Path(sys.argv[2])
torch.ops.load_library(str(native.build(isa, out.with_suffix(".so"))))
g = torch.Generator().manual_seed(5)
w, x = torch.randn(200, 77, generator=g), torch.randn(13, 77, generator=g)
torch.save(torch.ops.trtllm_dflash_cpu.packed_mm(x, native.pack(w)), out)
"""


@pytest.mark.skipif("-mavx512f" not in (native.isa_flags() or []), reason="needs a CPU with AVX-512 and AVX2")
def test_the_avx2_build_computes_the_avx512_builds_bits(tmp_path):
    """The kernel's lanes do the same fused multiply-adds in the same order in one AVX-512 register or two AVX2
    ones: both builds give the same bits (numerics do not depend on which x86 CPU runs them)."""
    results = []
    for name, isa in (("avx512", native.isa_flags()), ("avx2", ["-mavx2", "-mfma"])):
        out = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _PROBE, json.dumps(isa), str(out)], check=True, timeout=300)
        results.append(torch.load(out))
    assert torch.equal(*results)


def test_without_a_compiler_products_run_torchs_kernels(tmp_path):
    """No compiler (``CXX`` names none) on a fresh cache: the kind is not offered, one line on stderr says why, and
    products still compute x · Wᵀ."""
    code = ("import torch\nfrom trtllm_dflash.models import products, layers\n"
            "assert 'packed' not in products.candidates(torch.float32), products.candidates(torch.float32)\n"
            "assert 'packed' not in products.candidates(torch.float32)\n"
            "lin = layers.Linear(48, 32).requires_grad_(False)\nx = torch.randn(3, 48)\n"
            "with torch.inference_mode():\n"
            "    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TRTLLM_DFLASH_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "packed CPU product kernel is unavailable" in ln]
    assert len(lines) == 1 and "no-such-compiler" in lines[0], done.stderr
    assert not list((tmp_path / "cache").glob("kernels/*.so"))
