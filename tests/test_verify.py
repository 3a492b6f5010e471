"""verify: tolerance per dtype, structure walking, fresh inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoopt.check.compare import Tolerance, compare, tf32_enabled
from autoopt.check.inputs import fresh_like, input_sets


def test_within_float32_tolerance_passes_and_beyond_fails() -> None:
    x = torch.randn(100)
    assert compare(x, x + 1e-7).ok
    result = compare(x, x + 1e-2)
    assert not result.ok
    assert "float32 tolerance" in result.detail and "output" in result.detail


def test_half_types_get_their_own_tolerance() -> None:
    x = torch.randn(100)
    noisy = x + 5e-3 * torch.randn(100)
    assert not compare(x, noisy).ok
    assert compare(x.bfloat16(), noisy.bfloat16()).ok
    strict = {torch.bfloat16: Tolerance(rtol=1e-6, atol=1e-6)}
    assert not compare(x.bfloat16(), noisy.bfloat16(), strict).ok


def test_large_outputs_are_judged_relative_to_their_scale() -> None:
    x = torch.randn(100) * 1e4
    assert compare(x, x * (1 + 1e-6)).ok


def test_nan_in_the_same_place_matches_and_elsewhere_fails() -> None:
    a = torch.tensor([1.0, float("nan")])
    assert compare(a, a.clone()).ok
    assert not compare(a, torch.tensor([float("nan"), 1.0])).ok


def test_nested_structures_dataclasses_and_objects_are_walked() -> None:
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: int

    class Cache:
        def __init__(self, k: torch.Tensor) -> None:
            self.keys = [k]

    t = torch.randn(3)
    expected = {"a": (Out(t, 1), Cache(t))}
    assert compare(expected, {"a": (Out(t.clone(), 1), Cache(t.clone()))}).ok
    wrong = compare(expected, {"a": (Out(t, 1), Cache(t + 1))})
    assert not wrong.ok and "keys[0]" in wrong.detail
    assert not compare(expected, {"a": (Out(t, 2), Cache(t))}).ok
    assert "structure" in compare((t,), (t, t)).detail


def test_integer_outputs_must_match_exactly() -> None:
    assert not compare(torch.tensor([1, 2]), torch.tensor([1, 3])).ok
    assert "dtype" in compare(torch.ones(2), torch.ones(2, dtype=torch.float64)).detail


def test_fresh_inputs_keep_shape_dtype_range_and_masks() -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 50, (4, 16))
    image = torch.rand(2, 3, 8, 8)
    mask = torch.rand(4, 16) > 0.5
    new_ids, new_image, new_mask = (fresh_like(v, g) for v in (ids, image, mask))
    assert new_ids.dtype == torch.int64 and new_ids.shape == ids.shape
    assert int(new_ids.min()) >= 5 and int(new_ids.max()) <= 49
    assert not torch.equal(new_ids, ids)
    assert new_image.shape == image.shape and not torch.equal(new_image, image)
    assert float(new_image.min()) >= 0  # a non-negative input stays non-negative
    assert torch.equal(new_mask, mask)


def test_input_sets_start_with_the_example_and_walk_containers() -> None:
    xs = [torch.randn(2), torch.randn(3)]
    sets = input_sets((xs,), {"scale": 2.0}, n_random=2)
    assert len(sets) == 3
    assert sets[0][0][0] is xs
    assert [t.shape for t in sets[1][0][0]] == [torch.Size([2]), torch.Size([3])]
    assert sets[2][1] == {"scale": 2.0}


def test_tf32_follows_pytorch_settings_and_cpu_fp32_stays_strict() -> None:
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert not tf32_enabled()
        torch.set_float32_matmul_precision("high")
        assert tf32_enabled()
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True
        assert tf32_enabled()
        x = torch.randn(100)  # on the CPU, TF32 never applies: fp32's tolerance holds
        assert not compare(x, x + 5e-4 * torch.randn(100)).ok
    finally:
        torch.backends.cudnn.allow_tf32 = conv
        torch.set_float32_matmul_precision(matmul)


@pytest.mark.gpu
def test_cuda_fp32_gets_tf32_room_unless_tf32_is_off_or_the_user_sets_fp32() -> None:
    x = torch.randn(1000, device="cuda")
    noisy = x + 3e-4 * torch.randn(1000, device="cuda")  # TF32-sized rounding, not fp32's
    conv = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        result = compare(x, noisy)
        assert result.ok, result.detail
        assert not compare(x, noisy, {torch.float32: Tolerance(rtol=1e-4, atol=1e-5)}).ok
        assert not compare(x, x + 1e-2 * torch.randn(1000, device="cuda")).ok
        torch.backends.cudnn.allow_tf32 = False
        failed = compare(x, noisy)
        assert not failed.ok and "TF32" not in failed.detail
    finally:
        torch.backends.cudnn.allow_tf32 = conv


def test_a_float_mask_stays_a_mask_and_gets_padding() -> None:
    """An all-ones float attention mask turned into noise would overflow ``(1 - m) * min``
    in eager itself; a 0/1 pattern with some zeros verifies padded batches too."""
    mask = torch.ones(4, 16)
    fresh = fresh_like(mask, torch.Generator().manual_seed(0))
    assert set(fresh.unique().tolist()) == {0.0, 1.0}


def test_a_small_gradient_is_judged_at_its_own_scale() -> None:
    """Gradients were all held to the largest one's scale, so a small weight's gradient could
    be wrong entirely and pass (a BERT query weight's, 0.008, next to embeddings' 100)."""
    from autoopt.check.compare import GRAD_PREFIX

    torch.manual_seed(0)
    expected = {f"{GRAD_PREFIX}embedding": torch.randn(64, 32) * 100,
                f"{GRAD_PREFIX}query": torch.randn(32, 32) * 0.008}
    wrong = dict(expected)
    wrong[f"{GRAD_PREFIX}query"] = torch.zeros(32, 32)
    result = compare(expected, wrong)
    assert not result.ok and "query" in result.detail
    # Rounding noise on a gradient that is zero in exact arithmetic still passes.
    noisy = dict(expected)
    noisy[f"{GRAD_PREFIX}bias"] = expected[f"{GRAD_PREFIX}bias"] = torch.zeros(32)
    noisy[f"{GRAD_PREFIX}bias"] = torch.randn(32) * 1e-6 * 100
    assert compare(expected, noisy).ok
