"""The two code maps of block-wise 8-bit state (core/q8_maps.hpp, docs/numerics.md 8f) are
torchao's (and bitsandbytes') dynamic maps bit for bit: the header's hex words against
torchao.optim.quant_utils.create_dynamic_map, computed here by torch's own linspace."""

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
quant_utils = pytest.importorskip("torchao.optim.quant_utils")

HEADER = Path(__file__).resolve().parents[2] / "core" / "q8_maps.hpp"


def header_map(name):
    """The 256 words of array `name` in the header, as ints."""
    text = HEADER.read_text()
    m = re.search(name + r"\[256\] = \{(.*?)\};", text, re.S)
    assert m, f"{name} not in {HEADER}"
    words = [int(w, 16) for w in re.findall(r"0x([0-9a-f]{8})", m.group(1))]
    assert len(words) == 256
    return words


@pytest.mark.parametrize("signed,name", [(True, "kQ8SignedBits"), (False, "kQ8UnsignedBits")])
def test_header_maps_equal_torchaos_dynamic_maps(signed, name):
    want = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    want_bits = [w & 0xFFFFFFFF for w in want.view(torch.int32).tolist()]
    assert header_map(name) == want_bits


def test_zero_codes():
    text = HEADER.read_text()
    signed_zero = int(re.search(r"kQ8SignedZero = (\d+);", text).group(1))
    unsigned_zero = int(re.search(r"kQ8UnsignedZero = (\d+);", text).group(1))
    assert header_map("kQ8SignedBits")[signed_zero] == 0
    assert header_map("kQ8UnsignedBits")[unsigned_zero] == 0


@pytest.mark.parametrize("non_negative", [False, True])
def test_the_extensions_map_equals_torchaos(non_negative):
    """stepcore.q8_map (what stepcore.torch checks an imported torchao state against)."""
    import stepcore

    want = torch.tensor(quant_utils.create_dynamic_map(signed=not non_negative),
                        dtype=torch.float32)
    got = torch.tensor(stepcore.q8_map(non_negative), dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
