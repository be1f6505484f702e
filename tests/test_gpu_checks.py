"""benchmarks/gpu_checks.py judges its bf16 comparisons by each path's own error against float32's textbook, so that
they fail on a real defect only: the chunked checks pass on the code as it is, and fail for a head whose log-probs
are off by 0.1 with an exact gradient, and for one whose value is exact and gradient 1.4 times too large (the class
of the autocast bug fixed before), in float32 and under bf16 autocast."""

import pytest
import torch

from benchmarks.gpu_checks import DEFECTS, Checks, GemmNoise, bf16_step

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def checks():
    return Checks(torch.device("cpu"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_chunked_check_passes_on_the_code_as_it_is(checks, dtype):
    ok, figures = checks.chunked(dtype)
    assert ok, figures


@pytest.mark.parametrize("defect", sorted(DEFECTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_chunked_check_fails_on_a_defective_head(checks, dtype, defect):
    ok, figures = checks.chunked(dtype, path=DEFECTS[defect])
    assert not ok, figures
    if dtype == "bfloat16":  # caught by the quantity the defect is in, by a wide margin
        quantity = "value" if defect == "value+0.1" else "grad"
        assert figures[f"{quantity}_err_over_bound"] > 2, figures


def test_bf16_step_is_the_spacing_of_bfloat16_values():
    x = torch.tensor([1.0, 1.5, 10.4, 0.3, 100.0])
    step = bf16_step(x)
    above = (x.to(torch.bfloat16).float() + step).to(torch.bfloat16).float()  # the next bf16 value up
    assert torch.equal(above - x.to(torch.bfloat16).float(), step)
    assert step[0].item() == 2.0**-7 and step[2].item() == 2.0**-4


def test_gemm_noise_moves_bf16_products_by_roundings_and_is_a_function_of_the_shapes():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=g).bfloat16(), torch.randn(128, 256, generator=g).bfloat16()
    plain = a @ b
    with GemmNoise(seed=1) as noise:
        first, again = a @ b, a @ b
    with GemmNoise(seed=2):
        other = a @ b
    assert noise.products == 2 and torch.equal(first, again)  # the same product, the same "kernel"
    moved = lambda x: (x != plain).float().mean().item()  # noqa: E731
    assert 0 < moved(first) < 0.2 and 0 < moved(other) and not torch.equal(first, other)
    # each value moved by at most one bf16 step from the exact float32 product's rounding
    assert ((first.float() - plain.float()).abs() <= bf16_step(plain)).all()
