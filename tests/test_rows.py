"""The one chooser of a call's kernel rows (configs.kernel_rows), which the planners and ``fa2cupy info`` use: the
Hopper rows where they run, the mma.sync rows elsewhere; and ``fa2cupy info``'s table of them, without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fa2cupy import configs
from fa2cupy.options import KernelOptions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # cli.py lives in the repository root

import cli  # noqa: E402


def _table(arch):
    """{(headdim, causal column): (forward, forward tile, backward, backward tile)} from tile_table_text."""
    lines = cli.tile_table_text(arch).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("headdim"))
    rows = {}
    for line in lines[header + 2:]:
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if not cells or not cells[0].isdigit():
            break
        rows[(int(cells[0]), cells[1])] = tuple(cells[2:])
    return rows


def test_info_shows_the_hopper_rows_that_run_on_sm90():
    # fa2cupy info printed configs.forward_config(arch, d, dtype, causal) with a bool where the mask belongs: the
    # mma.sync forward row for causal and non-causal alike, and never the Hopper rows that run at head dims 64 and
    # 128 on compute capability 9.0, nor any backward row.
    rows = _table(90)
    for d in (64, 128, 192, 256):
        assert rows[(d, "no")][0] == rows[(d, "no")][2] == "hopper (wgmma)"
        shortest = configs.HOPPER_MASKED_MIN_SEQLEN[d]
        assert rows[(d, f"yes, seqlen_q >= {shortest}")][0] == "hopper (wgmma)"
        assert rows[(d, f"yes, seqlen_q < {shortest}")][0] == "mma.sync"  # short causal calls: the mma.sync forward
    assert rows[(32, "no")][0] == rows[(32, "yes")][0] == "mma.sync"  # below HOPPER_PAD_MIN_HEADDIM
    for d, width in ((96, 128), (160, 192), (224, 256)):  # the Hopper kernels at the next width, on the arrays
        assert rows[(d, "no")][0] == rows[(d, "no")][2] == f"hopper (wgmma), at width {width}"
        assert rows[(d, f"yes, seqlen_q < {configs.HOPPER_MASKED_MIN_SEQLEN[width]}")][0] == "mma.sync"
    assert {d for d, _ in rows} == set(configs.HEADDIMS)


@pytest.mark.parametrize("arch", [80, 86, 89, 90, 120])
def test_info_rows_are_the_rows_the_planners_choose(arch):
    rows = _table(arch)
    for (d, causal), (fwd, fwd_tile, bwd, bwd_tile) in rows.items():
        mask = "none" if causal == "no" else "causal"
        seqlen_q = int(causal.rsplit(" ", 1)[1]) - 1 if "<" in causal else None
        widths = [configs.padded_call_width(arch, d, "bfloat16", backward, mask, seqlen_q=seqlen_q)
                  for backward in (False, True)]
        forward = configs.kernel_rows(arch, widths[0], "bfloat16", mask, seqlen_q=seqlen_q).forward
        backward = configs.kernel_rows(arch, widths[1], "bfloat16", mask).backward
        want = [cli._row_text(forward), cli._row_text(backward)]
        for (kernel, _), width in zip(want, widths):
            assert width == d or (arch == 90 and kernel.startswith("hopper"))
        assert (fwd, fwd_tile, bwd, bwd_tile) == tuple(
            text + (f", at width {w}" if i == 0 and w != d else "") for (row, w) in zip(want, widths)
            for i, text in enumerate(row))
        assert f"{forward.block_m}x{forward.block_n}" in fwd_tile
    assert all(kernel == "mma.sync" for fwd, _, bwd, _ in rows.values() for kernel in (fwd, bwd)) == (arch != 90)


def test_info_table_for_a_given_arch_without_a_gpu():
    # `fa2cupy info --arch 90` prints the table of a compute capability whatever GPU (or none) is at hand.
    from click.testing import CliRunner

    result = CliRunner().invoke(cli.main, ["info", "--arch", "90"])
    assert result.exit_code == 0, result.output
    assert "kernels for sm_90" in result.output and "hopper (wgmma)" in result.output
    # the note on modifier calls names the head dims the Hopper forward and backward take them at
    assert ("Softcap, ALiBi and dropout run on the Hopper rows above: the forward's at d = 64, 128, 192 and 256 "
            "(padded calls only at 256; at d = 64 on 2 consumer warpgroups), the backward's at d = 64, 128, 192 and "
            "256 (padded calls only at 128; dropout not at 64)") in " ".join(result.output.split())


@pytest.mark.parametrize("d", [192, 256])
def test_wide_hopper_rows(d):
    # d=192 and 256 run on the Hopper forward and dK/dV kernels, padded and varlen, where TMA can copy the arrays;
    # hopper_forward/hopper_backward=False take the mma.sync kernels; softcap, ALiBi and dropout the Hopper kernels'
    # modifier rows (the forward's varlen calls not at 256); the deterministic backward the Hopper dK/dV kernel, its
    # dQ reductions in turns (no dQ kernel of its own).
    for mask, varlen in ((m, v) for m in configs.MASKS for v in (False, True)):
        rows = configs.kernel_rows(90, d, "bfloat16", mask, varlen=varlen, seqlen_q=4096)
        assert rows.forward is configs.FORWARD_HOPPER_TABLE[d]
        assert rows.backward is configs.BACKWARD_HOPPER_TABLE[d]
        off = configs.kernel_rows(90, d, "bfloat16", mask, varlen=varlen, seqlen_q=4096,
                                  options=KernelOptions(hopper_forward=False, hopper_backward=False))
        assert off.forward == configs.forward_config(90, d, "bfloat16", mask, varlen)
        assert off.backward == configs.backward_config(90, d, "bfloat16", mask)
    rows = configs.kernel_rows(90, d, "float16", tma=False)
    assert rows.forward.family == "fwd" and rows.backward.family == "bwd"
    rows = configs.kernel_rows(80, d, "float16")
    assert rows.forward.family == "fwd" and rows.backward.family == "bwd"
    for dm in (d, 128):  # softcap or ALiBi: the Hopper forward, at d = 256 for padded calls only
        for varlen in (False, True):
            rows = configs.kernel_rows(90, dm, "float16", "causal", mods=True, varlen=varlen)
            hopper = not (varlen and dm == 256)
            want = (configs.FORWARD_HOPPER_TABLE[dm] if hopper
                    else configs.forward_config(90, dm, "float16", "causal", varlen, mods=True))
            assert rows.forward == want
            # the backward: the Hopper kernel's modifier rows where it has them (every width; 128 padded only)
            want = (configs.BACKWARD_HOPPER_TABLE[dm] if configs.hopper_bwd_takes_mods(dm, varlen)
                    else configs.backward_config(90, dm, "float16", "causal", mods=True))
            assert rows.backward == want
    assert (configs.HOPPER_MODS_HEADDIMS, configs.HOPPER_MODS_PADDED_ONLY) == ((64, 128, 192, 256), (256,))
    for varlen in (False, True):  # dropout: the modifier rows too
        rows = configs.kernel_rows(90, d, "float16", "causal", mods=True, varlen=varlen, dropout=True)
        assert rows.forward == (configs.forward_config(90, d, "float16", "causal", varlen, mods=True)
                                if varlen and d == 256 else configs.FORWARD_HOPPER_TABLE[d])
        assert rows.backward is configs.BACKWARD_HOPPER_TABLE[d]
    rows = configs.kernel_rows(90, d, "float16", "causal", mods=True, dropout=True,
                               options=KernelOptions(hopper_backward_mods=False))
    assert rows.forward is configs.FORWARD_HOPPER_TABLE[d] and rows.backward.family == "bwd"
    rows = configs.kernel_rows(90, d, "float16", deterministic=True)
    assert rows.backward is configs.BACKWARD_HOPPER_TABLE[d] and rows.backward_dq is None
    # a short masked call: the mma.sync forward, the Hopper backward
    rows = configs.kernel_rows(90, d, "float16", "causal", seqlen_q=configs.HOPPER_MASKED_MIN_SEQLEN[d] - 1)
    assert rows.forward.family == "fwd" and rows.backward is configs.BACKWARD_HOPPER_TABLE[d]


def test_padded_causal_calls_with_modifiers_take_the_causal_modifier_variant():
    # Dropout, softcap and ALiBi run in the modifier variant: a padded causal forward in its causal instantiation
    # (compile-time bounds), every other masked call (varlen, windows, the backward) in the window one.
    from fa2cupy import forward

    assert forward.kernel_variant(True, (-1, -1), 0.0, False, 0.1, causal_mods=True)[:2] == ("causal", True)
    assert forward.kernel_variant(True, (-1, -1), 0.0, False, 0.1)[:2] == ("window", True)  # (the backward)
    assert forward.kernel_variant(True, (8, -1), 30.0, False, causal_mods=True)[:2] == ("window", True)
    assert forward.kernel_variant(False, (-1, -1), 30.0, False, causal_mods=True)[:2] == ("window", True)
    # the padded Hopper forward's unmasked modifier variant: calls without a mask or dropout
    unmasked = dict(causal_mods=True, unmasked_mods=True)
    assert forward.kernel_variant(False, (-1, -1), 30.0, False, **unmasked)[:2] == ("none", True)
    assert forward.kernel_variant(False, (-1, -1), 0.0, True, **unmasked)[:2] == ("none", True)
    assert forward.kernel_variant(False, (-1, -1), 30.0, False, 0.1, **unmasked)[:2] == ("window", True)
    assert forward.kernel_variant(False, (8, -1), 0.0, True, **unmasked)[:2] == ("window", True)
    assert forward.kernel_variant(True, (-1, -1), 0.0, True, **unmasked)[:2] == ("causal", True)
    assert forward.kernel_variant(False, (-1, -1), 0.0, False, **unmasked)[:2] == ("none", False)
    # the padded Hopper kernels' ALiBi-only instantiations: ALiBi alone; the forward's at a positive fp32 scale, no
    # mask or causal, the dK/dV kernel's for every mask and scale
    assert forward.alibi_only_kernel("none", 0.0, True, 0.0, 0.125)
    assert forward.alibi_only_kernel("causal", 0.0, True, 0.0, 0.125)
    assert not forward.alibi_only_kernel("window", 0.0, True, 0.0, 0.125)
    assert not forward.alibi_only_kernel("none", 30.0, True, 0.0, 0.125)  # (softcap too)
    assert not forward.alibi_only_kernel("none", 0.0, True, 0.1, 0.125)  # (dropout too)
    assert not forward.alibi_only_kernel("none", 30.0, False, 0.0, 0.125)  # (softcap alone)
    assert not forward.alibi_only_kernel("none", 0.0, True, 0.0, 0.0)  # (UnitScoreMods' unscaled kind)
    assert not forward.alibi_only_kernel("none", 0.0, True, 0.0, 1e-50)  # (0 in fp32)
    assert not forward.alibi_only_kernel("none", 0.0, False, 0.0, 0.125)
    for mask, scale in (("window", 0.125), ("window", -0.125), ("none", 0.0)):
        assert forward.alibi_only_kernel(mask, 0.0, True, 0.0, scale, backward=True)
    assert not forward.alibi_only_kernel("window", 30.0, True, 0.0, 0.125, backward=True)
    assert not forward.alibi_only_kernel("window", 0.0, True, 0.1, 0.125, backward=True)
    assert not forward.alibi_only_kernel("window", 0.0, False, 0.0, 0.125, backward=True)
    shipped = set(configs.forward_instantiations())
    for dtype in configs.DTYPE_TAGS:
        for (fam, d), config in configs.FORWARD_TABLE.items():
            assert config.name_expression(dtype, "causal", True) in shipped
            assert config.name_expression(dtype, "causal", True, True) not in shipped  # (varlen: the window one)
