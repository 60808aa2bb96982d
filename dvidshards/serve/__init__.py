"""Servers: ``view`` (neuroglancer on a local precomputed server of an export) and ``flight``
(an export's block records over Arrow Flight)."""
