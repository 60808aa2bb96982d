"""Reference downsampling rules, written apart from dvidshards.formats.downsample."""

from __future__ import annotations

import numpy as np


def dvid_port(hires: np.ndarray) -> np.ndarray:
    """DVID's downresArray: per 2x2x2 cell a vote map of the non-zero labels, the winner the
    label with most votes (0 when none); Go ranges over its map in random order, so ties are
    fixed here as FORMATS.md §3b says: to the smaller id."""
    nz, ny, nx = hires.shape
    lores = np.zeros((nz // 2, ny // 2, nx // 2), np.uint64)
    for z in range(0, nz, 2):
        for y in range(0, ny, 2):
            for x in range(0, nx, 2):
                votemap: dict[int, int] = {}
                for iz in range(2):
                    for iy in range(2):
                        for ix in range(2):
                            lbl = int(hires[z + iz, y + iy, x + ix])
                            if lbl != 0:
                                votemap[lbl] = votemap.get(lbl, 0) + 1
                winner, winner_votes = 0, 0
                for lbl in sorted(votemap):
                    if winner_votes < votemap[lbl]:
                        winner_votes, winner = votemap[lbl], lbl
                lores[z // 2, y // 2, x // 2] = winner
    return lores


def by_count(hires: np.ndarray, skip_zero: bool = True) -> np.ndarray:
    """The same rule from a table of (cell, label) vote counts: per cell the most votes, then the
    smaller label (fast enough for 128³ regions of real blocks with a hundred labels)."""
    nz, ny, nx = (s // 2 for s in hires.shape)
    labs = hires.reshape(nz, 2, ny, 2, nx, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1)
    cell = np.repeat(np.arange(nz * ny * nx, dtype=np.int64), 8)
    if skip_zero:
        cell, labs = cell[labs != 0], labs[labs != 0]
    uniq, rank = np.unique(labs, return_inverse=True)
    key, votes = np.unique(cell * max(len(uniq), 1) + rank, return_counts=True)
    cell_of, rank_of = key // max(len(uniq), 1), key % max(len(uniq), 1)
    order = np.lexsort((rank_of, -votes, cell_of))
    first = order[np.r_[True, cell_of[order][1:] != cell_of[order][:-1]]] if order.size else order
    out = np.zeros(nz * ny * nx, np.uint64)
    out[cell_of[first]] = uniq[rank_of[first]]
    return out.reshape(nz, ny, nx)
