"""Past 2**31 elements: apex and TransformerEngine both shipped kernels that overflowed int32 indexing.

One bf16 tensor of 2**31 + 37 elements (4 GiB) packed into a bucket at an offset, so both the source
index and the bucket index pass 2**31. Runs on the cpp backend (and CUDA when present) only: the
torch reference has no such bug to find and the Triton interpreter would take hours.
"""
import pytest
import torch
from conftest import target_skip_reason

from parallel_layers import ops

BIG = (1 << 31) + 37


def available_gib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


@pytest.mark.parametrize("device,backend", [("cpu", "cpp"), ("cuda", "cuda"), ("cuda", "triton")])
def test_pack_and_unscale_past_2_31_elements(device, backend):
    why = target_skip_reason(device, backend)
    if why:
        pytest.skip(why)
    if device == "cpu" and available_gib() < 12:
        pytest.skip(f"needs ~9 GiB of free memory, {available_gib():.1f} GiB available")
    if device == "cuda" and torch.cuda.mem_get_info()[0] < 10 * (1 << 30):
        pytest.skip("needs ~9 GiB of free GPU memory")
    big = torch.ones(BIG, dtype=torch.bfloat16, device=device)
    big[-5:] = torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    small = torch.full((3,), 7.0, dtype=torch.bfloat16, device=device)
    bucket = ops.pack_bucket([small, big], dtype=torch.bfloat16, scale=0.5, backend=backend)
    assert bucket.numel() == BIG + 3
    assert bucket[:3].float().tolist() == [3.5] * 3
    assert bucket[3:8].float().tolist() == [0.5] * 5
    assert bucket[-5:].float().tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]
    del bucket
    big[-1] = float("inf")  # the very last element must be seen by the non-finite check
    norm, found = ops.unscale_and_norm([small, big], inv_scale=1.0, backend=backend)
    assert found.item() == 1.0
