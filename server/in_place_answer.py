"""The servicer's side of in-place answers: where the service writes a unary answer's
rows, sized before the answer exists (see ``wire.InPlaceResponse``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from tokembed.server import wire
from tokembed.server.domain import EmbedOutput, Timings
from tokembed.server.service import EmbeddingService


class InPlaceAnswer:
    """Lets the service write a unary answer's rows straight into its response bytes
    (``wire.InPlaceResponse``); ``response`` is set once it did."""

    # Stand-ins for the durations measured later: any non-zero double encodes to the
    # same 9 bytes (a zero one is left out; then ``finish`` declines and we copy).
    _LATER = 1.0

    def __init__(
        self,
        service: EmbeddingService,
        request_id: str,
        allocate: Callable[[int], tuple[bytes, np.ndarray]] | None,
    ) -> None:
        self._manifest = service.info.model.manifest
        self._request_id = request_id
        self._allocate = allocate
        self.response: wire.InPlaceResponse | None = None

    def __call__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        lengths: tuple[int, ...] | None,
        timings: Timings,
    ) -> np.ndarray:
        stand_in = EmbedOutput(
            np.empty((0,), dtype), lengths, dataclasses.replace(timings, compute_s=self._LATER)
        )
        metadata = wire.response_metadata(
            stand_in, self._manifest.name, self._manifest.version, self._request_id, self._LATER
        )
        self.response = wire.InPlaceResponse(shape, dtype, len(metadata), self._allocate)
        return self.response.rows
