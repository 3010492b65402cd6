"""Reading the wrapper's markers of a chain's segments through its cluster's transport.

A segment's ``seg-NNNN.start`` and ``seg-NNNN.end`` never change once written whole, so
the service reads each until it is there, then keeps it, and forgets it once the segment
has ended in the store (``forget``). A marker half written reads as not there yet. Only a
job the scheduler requeued runs again and writes them anew: its end marker is read, not
kept, while it waits to run again.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar, Union

from chainrun.model import Chain, EndMarker, StartMarker
from chainrun.schedulers.segment import SegmentJob, parse_end_marker, parse_start_marker
from chainrun.transport import Transport

_M = TypeVar("_M", StartMarker, EndMarker)


class MarkerReader:
    """Keeps each marker read, by (chain, segment, suffix); not thread-safe."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int, str], Union[StartMarker, EndMarker]] = {}

    def start(self, transport: Transport, chain: Chain, n: int) -> Optional[StartMarker]:
        return self._read(transport, chain, n, ".start", StartMarker, parse_start_marker)

    def end(self, transport: Transport, chain: Chain, n: int, keep: bool = True) -> Optional[EndMarker]:
        return self._read(transport, chain, n, ".end", EndMarker, parse_end_marker, keep)

    def forget(self, chain_id: str, n: int) -> None:
        """Segment ``n`` has ended in the store: its markers are not read again."""
        self._kept.pop((chain_id, n, ".start"), None)
        self._kept.pop((chain_id, n, ".end"), None)

    def _read(
        self,
        transport: Transport,
        chain: Chain,
        n: int,
        suffix: str,
        kind: type[_M],
        parse: Callable[[bytes], Optional[_M]],
        keep: bool = True,
    ) -> Optional[_M]:
        """Segment ``n``'s marker ``suffix``, read until it is there, then kept (if ``keep``)."""
        key = (chain.id, n, suffix)
        kept = self._kept.get(key)
        if isinstance(kept, kind):
            return kept
        data = transport.read_file(SegmentJob(chain.id, n, chain.spec, 0).stem + suffix)
        marker = parse(data) if data is not None else None
        if marker is not None and keep:  # else not written yet (or not whole yet: read again next tick)
            self._kept[key] = marker
        return marker
