"""Tile configurations timed when re-tuning the shipped tables in fa2cupy/configs.py; not shipped, compiled on
demand by the tools that time them.

    FORWARD_CANDIDATES, BACKWARD_CANDIDATES    bench/dev/tune_fwd.py, bench/dev/tune_bwd.py
                                               (``TUNE=1`` / ``TUNE_BWD=1 bash bench/dev/run_device.sh``)
    DECODE_CANDIDATES                          bench/dev/tune_decode.py
    WINDOW_FORWARD_CANDIDATES,                 ``python bench/window_speed.py --candidates``
    WINDOW_BACKWARD_CANDIDATES

Scripts in bench/dev/ import it as ``candidates`` (their folder is first on ``sys.path``); others put bench/dev/ on
``sys.path`` first. Rows are written with the shipped tables' row helpers, so a candidate reads like a table row.
"""

from fa2cupy.configs import BwdConfig, DecodeConfig, FwdConfig, _bwd, _fwd

#: Extra forward configurations timed by bench/dev/tune_fwd.py when re-tuning the table.
FORWARD_CANDIDATES: dict[int, tuple[FwdConfig, ...]] = {
    64: (
        _fwd(64, 128, 128, 4, min_blocks=2),
        _fwd(64, 128, 96, 4, min_blocks=2),
        _fwd(64, 128, 64, 4, min_blocks=2),
        _fwd(64, 128, 64, 4, stages=3, min_blocks=2),
        _fwd(64, 256, 64, 8),
    ),
    96: (
        _fwd(96, 128, 64, 8, q_in_regs=True),
        _fwd(96, 128, 32, 4, min_blocks=2),
    ),
    128: (
        _fwd(128, 128, 32, 4, min_blocks=2),
        _fwd(128, 128, 32, 4, stages=3, min_blocks=2),
        _fwd(128, 192, 32, 6),
        _fwd(128, 256, 32, 8),
        _fwd(128, 128, 128, 8, q_in_regs=True),
    ),
}

#: Window-forward tiles timed against the shipped row: smaller query blocks waste fewer keys at the window's edges
#: (a 128-row block's band covers left + 128 keys), at the cost of more K/V traffic per row (docs/design.md, "Why the
#: 8x window bar is hard"). The 2-warp 64-row row keeps each warp's 32 rows (the shipped row's MMA reuse) with 4
#: blocks per SM.
WINDOW_FORWARD_CANDIDATES: dict[int, tuple[FwdConfig, ...]] = {
    128: (
        _fwd(128, 64, 32, 2, min_blocks=4),
        _fwd(128, 64, 32, 4, min_blocks=4),
        _fwd(128, 64, 64, 4, min_blocks=2),
    ),
}

#: Extra backward configurations timed by bench/dev/tune_bwd.py when re-tuning the table.
BACKWARD_CANDIDATES: dict[int, tuple[BwdConfig, ...]] = {
    64: (
        _bwd(64, 128, 128, 8, 4),
        _bwd(64, 128, 128, 8, 4, warps_keys2=8),
        _bwd(64, 64, 128, 8, 4),
        _bwd(64, 128, 128, 8, 2, warps_keys2=4),
    ),
    128: (
        _bwd(128, 64, 128, 8, 4),
        _bwd(128, 64, 128, 8, 4, stages=1),
        _bwd(128, 64, 128, 8, 2),
    ),
}

#: Window-backward tiles: 64-key blocks see left + 64 query rows instead of left + 128 (less edge waste), with twice
#: the dQ atomics per key.
WINDOW_BACKWARD_CANDIDATES: dict[int, tuple[BwdConfig, ...]] = {
    128: (
        _bwd(128, 64, 64, 8, 4),
        _bwd(128, 64, 64, 4, 2),
    ),
}

#: Decode tiles at d=128: (keys per tile, ring depth, warps, L2 prefetch).
DECODE_CANDIDATES = tuple(
    DecodeConfig(128, bn, st, w, pf)
    for bn, st, w, pf in ((16, 3, 4, False), (16, 3, 4, True), (16, 4, 4, True), (32, 2, 4, False),
                          (64, 2, 2, True), (16, 2, 8, True), (32, 3, 2, True), (32, 2, 2, True), (16, 2, 4, True),
                          (32, 3, 4, True), (16, 6, 4, True), (64, 3, 2, True), (16, 5, 4, True), (32, 2, 4, True))
)
