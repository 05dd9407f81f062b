"""Pieces of a stored checkpoint, read once per data-parallel group and passed to the DP peers
that need them.

A piece is a byte range of one file of the checkpoint that the manifest can verify on its own:
one serialised tensor shard or object of dist_checkpointing's files (the manifest's ``ranges``)
or a whole file. ``fetch`` is collective:

1. each rank names the pieces it needs (its load plan); the DP group learns every rank's list;
2. every piece needed in the group gets one reader among the ranks that need it (the least
   loaded so far, largest pieces first: the same choice on every rank), which fetches it from
   the store with ranged reads and verifies it against the manifest (sha256);
3. every rank of the job learns every rank's verdict, so all take the same decision: a corrupt
   or torn checkpoint raises ``CorruptCheckpoint`` naming the file on every rank;
4. each reader sends each piece to the other ranks of its DP group that need it (point to point,
   in one order every rank follows), and nobody else.

A rank holds the pieces it needs until the loader has consumed them (``release``). The counters
say what that cost: bytes read from the store, received from and sent to peers, and the most
bytes held at once (``peak_bytes``, with the staged files and load buffers the caller adds).
``share=False`` is the naive alternative, kept for the benchmark: every rank reads all it needs
itself.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mega.storage import CorruptCheckpoint, StorageError, StorageUnavailable
from mega.storage.base import MAX_SPAN, entry_of

Piece = tuple[str, int, int]  # (path in the checkpoint, offset, length)
READ_THREADS = 8  # concurrent ranged reads per rank


@dataclass
class ExchangeStats:
    read_bytes: int = 0  # fetched from the store by this rank
    received_bytes: int = 0  # from DP peers
    sent_bytes: int = 0  # to DP peers
    held_bytes: int = 0  # now: pieces in memory, plus what the caller adds (staged files, buffers)
    peak_bytes: int = 0
    pieces: int = 0  # fetched or received
    sources: dict = field(default_factory=dict)  # piece -> "store" | "peer rank N", for audits

    def hold(self, n: int) -> None:
        self.held_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)


class PieceExchange:
    """The pieces of checkpoint ``manifest.name`` this rank needs, from ``store`` through its DP
    ``group`` (see the module docstring). ``device``: where collectives' tensors live (CUDA with
    NCCL, CPU with gloo). ``retry(what, fn)``: runs this rank's reads, trying them again while the
    store does not answer (restore's bounded wait; default: once)."""

    def __init__(self, store, manifest, group, device: torch.device, share: bool = True, retry=None):
        self.store, self.manifest = store, manifest
        self._retry = retry or (lambda what, fn: fn())
        self.group = group
        self.group_ranks = dist.get_process_group_ranks(group)
        self.me = self.group_ranks.index(dist.get_rank())
        self.device = device
        self.share = share and len(self.group_ranks) > 1
        self._entries = {e.path: e for e in manifest.files}
        self.stats = ExchangeStats()
        self._data: dict[Piece, memoryview] = {}
        self._uses: Counter = Counter()
        self._lock = threading.Lock()

    # -- what a wanted byte range is fetched as
    def piece_of(self, path: str, offset: int, length: int) -> Piece:
        """The verifiable piece holding bytes [offset, offset+length) of ``path``: that range
        when the manifest hashed it, else the whole file. CorruptCheckpoint when the manifest
        does not list the file or the range lies outside it."""
        entry = self._entries.get(path) or entry_of(self.manifest, path)  # the latter raises
        if offset < 0 or offset + length > entry.size:
            raise CorruptCheckpoint(
                self.manifest.name,
                path,
                f"bytes [{offset}, {offset + length}) lie outside its {entry.size} bytes in the manifest",
            )
        if entry.range_hash(offset, length) is not None:
            return (path, offset, length)
        return (path, 0, entry.size)

    # -- collective
    def fetch(self, wanted: list[Piece]) -> None:
        """Collective over the job: make every byte range in ``wanted`` available to ``get``."""
        error = None
        mine: set[Piece] = set()
        for path, offset, length in wanted:
            try:
                piece = self.piece_of(path, offset, length)
            except CorruptCheckpoint as e:
                error = error or ("corrupt", e.name, e.relpath, e.reason)
                continue
            mine.add(piece)
            self._uses[piece] += 1
        needs = [sorted(mine)]
        if self.share:
            needs = [None] * len(self.group_ranks)
            dist.all_gather_object(needs, sorted(mine), group=self.group)
        me = self.me if self.share else 0
        readers, needers = _assign([set(n) for n in needs])
        if error is None:
            to_read, kept = [p for p, r in readers.items() if r == me], set()
            try:  # a retry reads only the pieces the failed round did not get
                self._retry(f"read of {self.manifest.name}", lambda: self._read(to_read, kept))
            except CorruptCheckpoint as e:
                error = ("corrupt", e.name, e.relpath, e.reason)
            except StorageUnavailable as e:
                error = ("unavailable", self.manifest.name, None, str(e))
            except Exception as e:
                error = ("storage", self.manifest.name, None, f"{type(e).__name__}: {e}")
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # every rank takes the same decision
        bad = [e for e in errors if e is not None]
        if bad:
            self.drop()
            kind, name, relpath, reason = bad[0]
            if kind == "corrupt":
                raise CorruptCheckpoint(name, relpath, reason)
            raise (StorageUnavailable if kind == "unavailable" else StorageError)(reason)
        if self.share:
            self._pass_on(readers, needers)

    def _read(self, pieces: list[Piece], kept: set) -> None:
        """Fetch and verify ``pieces`` not in ``kept`` from the store (adding them to it): ranged
        reads of up to MAX_SPAN bytes of adjacent pieces, READ_THREADS at a time."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for path, offset, length in sorted(set(pieces) - kept):
            by_file.setdefault(path, []).append((offset, length))
        batches = []
        for path, spans in by_file.items():
            batch, size = [], 0
            for span in spans:
                if batch and size + span[1] > MAX_SPAN:
                    batches.append((path, batch))
                    batch, size = [], 0
                batch.append(span)
                size += span[1]
            batches.append((path, batch))
        before = self.store.bytes_read

        def read(job):
            path, spans = job
            for (offset, length), view in zip(spans, self.store.read_pieces(self.manifest, path, spans)):
                self._keep((path, offset, length), view, "store")
                kept.add((path, offset, length))

        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            for f in [pool.submit(read, b) for b in batches]:
                f.result()
        self.stats.read_bytes += self.store.bytes_read - before

    def _pass_on(self, readers: dict[Piece, int], needers: dict[Piece, list[int]]) -> None:
        """Each reader sends its pieces to the other DP peers that need them. Every rank walks
        the pieces in the same order, so a blocking send always meets its receive."""
        for piece in sorted(readers):
            src, dsts = readers[piece], [i for i in needers[piece] if i != readers[piece]]
            length = piece[2]
            if not dsts or not length:
                if length == 0 and self.me in needers[piece] and piece not in self._data:
                    self._keep(piece, memoryview(b""), "empty")
                continue
            if src == self.me:
                with warnings.catch_warnings():  # read-only bytes: sent, never written
                    warnings.simplefilter("ignore", UserWarning)
                    buf = torch.frombuffer(self._data[piece], dtype=torch.uint8).to(self.device)
                for i in dsts:
                    dist.send(buf, self.group_ranks[i], group=self.group)
                    self.stats.sent_bytes += length
            elif self.me in dsts:
                buf = torch.empty(length, dtype=torch.uint8, device=self.device)
                dist.recv(buf, self.group_ranks[src], group=self.group)
                self._keep(piece, memoryview(buf.cpu().numpy()), f"peer rank {self.group_ranks[src]}")
                self.stats.received_bytes += length

    # -- the loader's side
    def get(self, path: str, offset: int, length: int) -> memoryview:
        piece = self.piece_of(path, offset, length)
        view = self._data[piece]
        return view[offset - piece[1] : offset - piece[1] + length]

    def release(self, path: str, offset: int, length: int) -> None:
        """One use of the piece holding these bytes is done; the last use frees it."""
        piece = self.piece_of(path, offset, length)
        self._uses[piece] -= 1
        if self._uses[piece] <= 0:
            view = self._data.pop(piece, None)
            del self._uses[piece]
            if view is not None:
                self.stats.held_bytes -= len(view)

    def drop(self) -> None:
        for piece in list(self._data):
            self.stats.held_bytes -= len(self._data.pop(piece))
        self._uses.clear()

    def _keep(self, piece: Piece, view: memoryview, source: str) -> None:
        with self._lock:  # reads land from several threads
            self._data[piece] = view
            self.stats.hold(len(view))
            self.stats.pieces += 1
            self.stats.sources[piece] = source


def _assign(needs: list[set]) -> tuple[dict, dict]:
    """(reader index per piece, needer indices per piece): each piece is read by one of the
    ranks that need it, the one with the fewest bytes assigned so far, largest pieces first."""
    needers: dict[Piece, list[int]] = {}
    for i, pieces in enumerate(needs):
        for p in pieces:
            needers.setdefault(p, []).append(i)
    load = [0] * len(needs)
    readers = {}
    for p in sorted(needers, key=lambda p: (-p[2], p)):
        r = min(needers[p], key=lambda i: (load[i], i))
        readers[p] = r
        load[r] += p[2]
    return readers, needers
