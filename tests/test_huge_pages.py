"""A decoding model's weights on 2 MB pages (meshlm.runtime.huge_pages): collapsing changes no
tensor's contents or address; where it reports memory collapsed, the kernel's own accounting
(/proc/self/smaps) has huge pages there, and where it cannot it says why in one line; prepare
builds a quantized layer's kernel operands before it collapses, and the precision line says what
it did; `meshlm generate` asks for it only for a long generation. Whether this machine's Linux
gives huge pages at all is not assumed."""
import contextlib
import copy
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import build, tiny

from meshlm import decoding
from meshlm.generate import Sampling, generate
from meshlm.quant import quantize_model
from meshlm.runtime import huge_pages


def huge_kb(address: int) -> int | None:
    """AnonHugePages (kB) of the mapping holding `address` (None off Linux)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps.read_text()):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= address < hi:
            return int(re.search(r"AnonHugePages:\s+(\d+)", block).group(1))
    return None


def test_collapsing_keeps_every_value_and_address_and_huge_pages_are_where_it_says():
    t = torch.randn(6 << 20 >> 2)  # 6 MB: at least two whole 2 MB pages inside it
    before, address = t.clone(), t.data_ptr()
    done = huge_pages.back([t, t[1000:], t.view(-1, 4)])  # one storage, three views
    assert torch.equal(t, before) and t.data_ptr() == address
    assert done.regions == 1  # the views share one region
    if done.bytes:
        assert done.why_not is None and done.bytes % huge_pages.PAGE == 0
        assert huge_kb(address + huge_pages.PAGE) > 0  # the kernel's own count
    else:
        assert done.why_not and "\n" not in done.why_not


def test_regions_cover_each_storage_in_whole_pages_and_merge_neighbours():
    page = huge_pages.PAGE
    big, other = torch.empty(5 * page, dtype=torch.uint8), torch.empty(3 * page, dtype=torch.uint8)
    regions = huge_pages._regions([big, big[7:], other])
    assert len(regions) in (1, 2)  # two storages: one region if they share a page
    for (lo, hi), inner in regions:
        assert lo % page == 0 and hi % page == 0
        for a, b in inner:
            assert a % page == 0 and b % page == 0 and lo <= a and b <= hi
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in (big, other)]
    for a, b in spans:  # every byte of each storage is in a region, and its whole pages inner
        region = [(r, i) for r, i in regions if r[0] <= a and b <= r[1]]
        assert len(region) == 1
        assert (-(-a // page) * page, b // page * page) in region[0][1]


def test_nothing_to_do_off_the_cpu_or_off_linux(monkeypatch):
    assert huge_pages.back([]) == huge_pages.Backed()
    monkeypatch.setattr(sys, "platform", "darwin")
    done = huge_pages.back([torch.randn(1 << 20)])
    assert done.bytes == 0 and done.why_not == "no transparent huge pages on darwin"


@pytest.mark.parametrize("bits", [None, 4])
def test_prepare_collapses_after_building_the_quantized_operands_and_says_so(bits):
    model = build(tiny(d_model=64, vocab_size=8192, spec="1+1R2+1"))
    if bits:
        model, _ = quantize_model(model, bits, activations="int8")
    other = copy.deepcopy(model)
    assert "pages" not in decoding.for_decoding("auto", other)[1].reason  # not asked for
    _, chosen = decoding.for_decoding("auto", model, huge=True)
    assert re.search(r"; weights' memory on 2 MB pages \(\d+ MB\)$|; weights on 4 KB pages "
                     r"\(.+\)$", chosen.reason), chosen.reason
    if bits:  # the operands the w4a8 kernel reads exist (as buffers) before any token
        assert any("._int4rows_0" in n for n, _ in model.named_buffers())
    s = Sampling(max_new_tokens=6, temperature=0, stop_at_eos=False)
    assert generate(model, [[5, 6, 7]], s) == generate(other, [[5, 6, 7]], s)


class Stop(Exception):
    """Raised where prepare would lay the weights out: the test has what it asked."""


@pytest.mark.parametrize("new_tokens", [8, decoding.HUGE_PAGES_STEPS])
def test_meshlm_generate_collapses_only_for_a_long_generation(tmp_path, monkeypatch, new_tokens):
    from meshlm.checkpoint import save_model
    from meshlm.cli import main

    asked = []

    def prepare(model, chosen, huge=False):
        asked.append(huge)
        raise Stop

    monkeypatch.setattr(decoding, "prepare", prepare)
    save_model(build(tiny(vocab_size=8192, context_length=4096)), tmp_path / "ckpt")
    with contextlib.suppress(Stop):
        main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", str(new_tokens)])
    assert asked == [new_tokens >= decoding.HUGE_PAGES_STEPS]
