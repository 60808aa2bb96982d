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
    """The same rule from each cell's 8 labels sorted: a label's votes are its equals among the 8,
    the winner the first of the most votes (so ties go to the smaller label); 0 casts no vote when
    ``skip_zero`` (fast enough for 128³ regions of real blocks with a hundred labels)."""
    nz, ny, nx = (s // 2 for s in hires.shape)
    cells = np.sort(hires.reshape(nz, 2, ny, 2, nx, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8), axis=1)
    votes = np.zeros(cells.shape, np.int8)
    for j in range(8):
        for k in range(8):
            votes[:, j] += cells[:, j] == cells[:, k]
    if skip_zero:
        votes[cells == 0] = -1  # a cell of zeros only keeps 0 (its first label)
    winner = cells[np.arange(len(cells)), np.argmax(votes, axis=1)]
    return winner.reshape(nz, ny, nx)
