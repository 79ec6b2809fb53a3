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
    for d in (64, 128):
        assert rows[(d, "no")][0] == rows[(d, "no")][2] == "hopper (wgmma)"
        shortest = configs.HOPPER_MASKED_MIN_SEQLEN[d]
        assert rows[(d, f"yes, seqlen_q >= {shortest}")][0] == "hopper (wgmma)"
        assert rows[(d, f"yes, seqlen_q < {shortest}")][0] == "mma.sync"  # short causal calls: the mma.sync forward
    for d in (32, 96, 160, 256):
        assert rows[(d, "no")][0] == rows[(d, "yes")][0] == "mma.sync"
    assert {d for d, _ in rows} == set(configs.HEADDIMS)


@pytest.mark.parametrize("arch", [80, 86, 89, 90, 120])
def test_info_rows_are_the_rows_the_planners_choose(arch):
    rows = _table(arch)
    for (d, causal), (fwd, fwd_tile, bwd, bwd_tile) in rows.items():
        mask = "none" if causal == "no" else "causal"
        seqlen_q = configs.HOPPER_MASKED_MIN_SEQLEN[d] - 1 if "<" in causal else None
        chosen = configs.kernel_rows(arch, d, "bfloat16", mask, seqlen_q=seqlen_q)
        assert (fwd, fwd_tile, bwd, bwd_tile) == cli._row_text(chosen.forward) + cli._row_text(chosen.backward)
        assert f"{chosen.forward.block_m}x{chosen.forward.block_n}" in fwd_tile
    assert all(kernel == "mma.sync" for fwd, _, bwd, _ in rows.values() for kernel in (fwd, bwd)) == (arch != 90)


def test_info_table_for_a_given_arch_without_a_gpu():
    # `fa2cupy info --arch 90` prints the table of a compute capability whatever GPU (or none) is at hand.
    from click.testing import CliRunner

    result = CliRunner().invoke(cli.main, ["info", "--arch", "90"])
    assert result.exit_code == 0, result.output
    assert "kernels for sm_90" in result.output and "hopper (wgmma)" in result.output


@pytest.mark.parametrize("d", [192, 256])
def test_wide_hopper_forward_rows_only_with_the_option(d):
    # The wide rows (configs.FORWARD_HOPPER_WIDE_TABLE) are unmeasured on a GPU: by default d=192 and 256 run on the
    # mma.sync forward (and backward), with KernelOptions(hopper_forward_wide=True) on the Hopper forward, padded
    # and varlen, where TMA can copy the arrays and the forward is on the Hopper kernel at all.
    wide = KernelOptions(hopper_forward_wide=True)
    for mask, varlen in ((m, v) for m in configs.MASKS for v in (False, True)):
        default = configs.kernel_rows(90, d, "bfloat16", mask, varlen=varlen, seqlen_q=4096)
        assert default.forward == configs.forward_config(90, d, "bfloat16", mask, varlen)
        rows = configs.kernel_rows(90, d, "bfloat16", mask, varlen=varlen, seqlen_q=4096, options=wide)
        assert rows.forward is configs.FORWARD_HOPPER_WIDE_TABLE[d]
        assert rows.backward == default.backward  # (the backward is not the option's)
    assert configs.kernel_rows(90, d, "float16", options=wide, tma=False).forward.family == "fwd"
    assert configs.kernel_rows(80, d, "float16", options=wide).forward.family == "fwd"
    assert configs.kernel_rows(90, d, "float16", options=KernelOptions(hopper_forward_wide=True,
                                                                       hopper_forward=False)).forward.family == "fwd"
    assert configs.kernel_rows(90, d, "float16", "causal", mods=True, options=wide).forward.family == "fwd"
    # the option is part of the plan cache's key: calls with and without it never share a plan
    assert wide != KernelOptions() and hash(wide) != hash(KernelOptions())
    assert configs.kernel_rows(90, 128, "float16", options=wide).forward is configs.FORWARD_HOPPER_TABLE[128]


@pytest.mark.parametrize("d", [192, 256])
def test_wide_hopper_backward_rows_only_with_the_option(d):
    # The wide backward rows (configs.BACKWARD_HOPPER_WIDE_TABLE) have not run on a GPU: by default d=192 and 256
    # run on the mma.sync backward, with KernelOptions(hopper_backward_wide=True) on the Hopper dK/dV kernel, padded
    # and varlen, in atomic dQ mode without score modifiers, where TMA can copy the arrays.
    wide = KernelOptions(hopper_backward_wide=True)
    for mask, varlen in ((m, v) for m in configs.MASKS for v in (False, True)):
        default = configs.kernel_rows(90, d, "bfloat16", mask, varlen=varlen, seqlen_q=4096)
        assert default.backward == configs.backward_config(90, d, "bfloat16", mask)
        rows = configs.kernel_rows(90, d, "bfloat16", mask, varlen=varlen, seqlen_q=4096, options=wide)
        assert rows.backward is configs.BACKWARD_HOPPER_WIDE_TABLE[d]
        assert rows.forward == default.forward  # (the forward is not the option's)
    assert configs.kernel_rows(90, d, "float16", options=wide, tma=False).backward.family == "bwd"
    assert configs.kernel_rows(80, d, "float16", options=wide).backward.family == "bwd"
    assert configs.kernel_rows(90, d, "float16", options=KernelOptions(hopper_backward_wide=True,
                                                                       hopper_backward=False)).backward.family == "bwd"
    assert configs.kernel_rows(90, d, "float16", "causal", mods=True, options=wide).backward.family == "bwd"
    assert configs.kernel_rows(90, d, "float16", deterministic=True, options=wide).backward.family == "bwd"
    # both options together: the wide forward and the wide backward
    both = configs.kernel_rows(90, d, "float16", options=KernelOptions(hopper_forward_wide=True,
                                                                       hopper_backward_wide=True))
    assert both.forward is configs.FORWARD_HOPPER_WIDE_TABLE[d]
    assert both.backward is configs.BACKWARD_HOPPER_WIDE_TABLE[d]
    # the option is part of the plan cache's key: calls with and without it never share a plan
    assert wide != KernelOptions() and hash(wide) != hash(KernelOptions())
    assert configs.kernel_rows(90, 128, "float16", options=wide).backward is configs.BACKWARD_HOPPER_TABLE[128]
    assert configs.kernel_rows(90, 64, "float16", options=wide).backward is configs.BACKWARD_HOPPER_TABLE[64]

def test_kernel_rows():
    rows = configs.kernel_rows(90, 128, "bfloat16", "causal", seqlen_q=4096)
    assert rows.forward is configs.FORWARD_HOPPER_TABLE[128] and rows.backward is configs.BACKWARD_HOPPER_TABLE[128]
    assert rows.backward_dq is None
    # Each thing that takes a call off the Hopper kernels: another GPU, another head dim, score modifiers, the
    # deterministic backward (dQ by its own kernel), a short masked forward, strides TMA cannot take, the options.
    assert configs.kernel_rows(80, 128, "bfloat16", "causal").forward == configs.forward_config(80, 128, "bfloat16",
                                                                                                "causal")
    assert configs.kernel_rows(90, 96, "float16").forward.family == "fwd"
    mods = configs.kernel_rows(90, 64, "bfloat16", "window", mods=True)
    assert mods.forward == configs.forward_config(90, 64, "bfloat16", "window", mods=True)
    assert mods.backward.family == "bwd"
    # The modifier variant keeps the plain rows' tile (128 x 128 at d=64 on sm_90), the window mask alone its own.
    assert mods.forward == configs.FORWARD_TABLE[("sm90", 64)]
    assert configs.forward_config(90, 64, "bfloat16", "window") == configs.FORWARD_MASKED_TABLE[("sm90", 64)]
    det = configs.kernel_rows(90, 64, "bfloat16", "causal", deterministic=True)
    assert det.forward.family == "fwd_hopper" and det.backward.family == "bwd"
    assert det.backward_dq == configs.backward_dq_config(90, 64, "bfloat16", "causal")
    assert configs.kernel_rows(90, 64, "bfloat16", "causal", seqlen_q=511).forward.family == "fwd"
    assert configs.kernel_rows(90, 64, "bfloat16", "causal", seqlen_q=512).forward.family == "fwd_hopper"
    no_tma = configs.kernel_rows(90, 64, "bfloat16", tma=False)
    assert no_tma.forward.family == "fwd" and no_tma.backward.family == "bwd"
    mma = configs.kernel_rows(90, 64, "bfloat16", options=KernelOptions(hopper_forward=False))
    assert mma.forward.family == "fwd" and mma.backward.family == "bwd_hopper"
    mma = configs.kernel_rows(90, 64, "bfloat16", options=KernelOptions(hopper_backward=False))
    assert mma.forward.family == "fwd_hopper" and mma.backward.family == "bwd"
    short = configs.kernel_rows(90, 64, "bfloat16", "causal", seqlen_q=1,
                                options=KernelOptions(hopper_masked_min_seqlen=0))
    assert short.forward.family == "fwd_hopper"
    # The varlen causal forward takes the masked row where the table has one (mma.sync at d=64 on sm_90).
    varlen = configs.kernel_rows(90, 64, "bfloat16", "causal", varlen=True, options=KernelOptions(hopper_forward=False))
    assert varlen.forward == configs.FORWARD_MASKED_TABLE[("sm90", 64)]


def test_padded_causal_calls_with_modifiers_take_the_causal_modifier_variant():
    # Dropout, softcap and ALiBi run in the modifier variant: a padded causal forward in its causal instantiation
    # (compile-time bounds), every other masked call (varlen, windows, the backward) in the window one.
    from fa2cupy import forward

    assert forward.kernel_variant(True, (-1, -1), 0.0, False, 0.1, causal_mods=True)[:2] == ("causal", True)
    assert forward.kernel_variant(True, (-1, -1), 0.0, False, 0.1)[:2] == ("window", True)  # (the backward)
    assert forward.kernel_variant(True, (8, -1), 30.0, False, causal_mods=True)[:2] == ("window", True)
    assert forward.kernel_variant(False, (-1, -1), 30.0, False, causal_mods=True)[:2] == ("window", True)
    shipped = set(configs.forward_instantiations())
    for dtype in configs.DTYPE_TAGS:
        for (fam, d), config in configs.FORWARD_TABLE.items():
            assert config.name_expression(dtype, "causal", True) in shipped
            assert config.name_expression(dtype, "causal", True, True) not in shipped  # (varlen: the window one)
