"""The tokenizer: a byte-level BPE trained on a bounded sample of the corpus with HF ``tokenizers``,
or a pretrained ``tokenizer.json``; and ``Encoder``, the fast exact encoding the preparation uses.

Byte-level: any text round-trips exactly (no unknown tokens), and training on the same documents
with the same settings gives the same merges, hence the same ids. ``<|endoftext|>`` (id 0) ends
every document in the token stream.

Pathological runs. A run of characters without whitespace (a base64 blob, minified code) becomes
one pre-token, and BPE on one long word is slow (training on a 2 MB word did not finish in 5
minutes). So every tokenizer here starts its pre-tokenization with a splitter that cuts each run
of non-whitespace (and of whitespace) into pieces of at most ``max_run`` characters, counted from
the start of the run. Text without such runs tokenizes exactly as without the splitter; the BPE
never sees a piece longer than ``max_run`` characters (plus the one leading space GPT-2's
pre-tokenizer attaches); and decoding still gives the text back byte for byte.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mega.data.corpus import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MIN_FREQUENCY = 2
MIN_VOCAB_SIZE = 257  # the 256 byte tokens and EOS
MAX_CACHED_CHUNK = 64  # characters: longer chunks are encoded but not memoized
# Per tokenizer worker: a natural-text vocabulary's common words fit well within this, and the
# budget is reached early at any corpus size, so data preparation's peak memory stays flat.
MEMO_BYTES = 16 << 20
_DICT_SLOT_BYTES = 64  # a dict entry (hash, key, value pointers) plus the table's spare room, amortized

# Unicode White_Space, the set the tokenizers' regex engine means by \s. Python's \s also holds
# U+001C..U+001F, which would put chunk boundaries where the tokenizer sees none.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# A chunk: a whitespace run and the non-whitespace run after it. Every chunk boundary is a
# whitespace run's start, where GPT-2's pre-tokenizer always starts a new pre-token and the run
# splitter starts counting afresh: so chunks tokenize independently, exactly as in the document.
_CHUNK = re.compile(f"[{_WS}]*[^{_WS}]+|[{_WS}]+")


def run_splitter(max_run: int) -> pre_tokenizers.Split:
    """Cuts runs of non-whitespace and of whitespace into pieces of at most ``max_run`` chars."""
    return pre_tokenizers.Split(Regex(rf"\S{{{max_run}}}|\s{{{max_run}}}"), behavior="isolated")


def settings(vocab_size: int, max_run: int, sample_mb: int) -> dict:
    """Everything that decides the trained tokenizer besides the documents (part of the cache key).
    The library version is included because its training algorithm decides the merges."""
    return {
        "kind": "byte_level_bpe",
        "vocab_size": vocab_size,
        "min_frequency": MIN_FREQUENCY,
        "special_tokens": [EOS_TOKEN],
        "max_run": max_run,
        "sample_mb": sample_mb,
        "tokenizers": tokenizers.__version__,
    }


def train_tokenizer(documents: Iterable[str], vocab_size: int, max_run: int) -> Tokenizer:
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [run_splitter(max_run), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def load_pretrained(path: str | Path, max_run: int, eos_token: str) -> Tokenizer:
    """A user's tokenizer.json (a local file: nothing is downloaded), with the run splitter put in
    front of its pre-tokenizer (text without runs over ``max_run`` characters is unaffected)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data.tokenizer_file {str(path)!r}: no such file ({path.resolve()})")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises plain Exceptions for malformed files
        raise DataError(f"{path}: not a HF tokenizers tokenizer.json ({err})") from None
    if tokenizer.token_to_id(eos_token) is None:
        raise DataError(
            f"{path}: has no token {eos_token!r} to end documents with; set data.eos_token "
            "to its end-of-text token (e.g. '</s>', '<|end_of_text|>')"
        )
    if not _has_run_splitter(json.loads(tokenizer.to_str()).get("pre_tokenizer")):
        current = tokenizer.pre_tokenizer
        tokenizer.pre_tokenizer = (
            pre_tokenizers.Sequence([run_splitter(max_run), current])
            if current is not None
            else run_splitter(max_run)
        )
    return tokenizer


def _has_run_splitter(spec: dict | None) -> bool:
    if not spec or spec.get("type") != "Sequence" or not spec.get("pretokenizers"):
        return False
    first = spec["pretokenizers"][0]
    return first.get("type") == "Split" and first.get("pattern", {}).get("Regex", "").startswith(r"\S{")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a prepared dataset: ``path`` is its index.json, its directory or the file."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    elif path.suffix == ".json" and path.name != TOKENIZER_FILE:
        try:
            name = json.loads(path.read_text()).get("tokenizer") or TOKENIZER_FILE
        except (OSError, ValueError):
            name = TOKENIZER_FILE
        path = path.parent / name
    if not path.is_file():
        raise DataError(f"{path}: no tokenizer file; run prepare_dataset first")
    return Tokenizer.from_file(str(path))


def bpe_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """The pieces the BPE model is given for ``text`` (after the pre-tokenizer, byte-level mapped)."""
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


class Encoder:
    """Encodes documents to token ids exactly as ``tokenizer.encode(doc, add_special_tokens=False)``.

    For byte-level BPE tokenizers (no normalizer, GPT-2 pre-tokenizer, no BPE dropout) it splits each
    document into chunks that tokenize independently (see ``_CHUNK``) and memoizes chunk -> ids:
    natural text repeats its words, so most chunks are dictionary hits and only the new ones go
    through the tokenizer (in one ``encode_batch_fast`` call per batch). Other tokenizers are
    called on whole documents. ``max_bytes`` bounds the memo's memory (keys, values and dict slots,
    counted as they are added; cleared when over), so a worker's footprint stops growing early
    whatever the corpus size, instead of filling with every distinct word a large corpus has.
    """

    def __init__(self, tokenizer: Tokenizer, max_bytes: int = MEMO_BYTES):
        self.tokenizer = tokenizer
        self.chunked = chunkable(json.loads(tokenizer.to_str()))
        self.max_bytes = max_bytes
        self._ids: dict[str, bytes] = {}  # chunk -> its ids as uint32 bytes (compact, joined in C)
        self.memo_bytes = 0  # what self._ids holds, as counted by _entry_bytes

    def encode(self, documents: list[str]) -> list[list[int]]:
        tokens, lengths = self.encode_flat(documents)
        bounds = np.cumsum([0, *lengths])
        return [tokens[lo:hi].tolist() for lo, hi in zip(bounds[:-1], bounds[1:])]

    def encode_flat(self, documents: list[str], eos: int | None = None) -> tuple[np.ndarray, list[int]]:
        """All documents' ids back to back (uint32; each followed by ``eos`` when given) and how
        many each document has (its ``eos`` included)."""
        tail = b"" if eos is None else np.uint32(eos).tobytes()
        if not self.chunked:
            pieces = [
                np.asarray(e.ids, dtype=np.uint32).tobytes() + tail
                for e in self.tokenizer.encode_batch_fast(documents, add_special_tokens=False)
            ]
        else:
            if self.memo_bytes > self.max_bytes:
                self._ids.clear()
                self.memo_bytes = 0
            chunked = [_CHUNK.findall(doc) for doc in documents]
            ids = self._ids
            new = list({c for chunks in chunked for c in chunks if c not in ids})
            if new:
                encoded = self.tokenizer.encode_batch_fast(new, add_special_tokens=False)
                ids.update(zip(new, (np.asarray(e.ids, dtype=np.uint32).tobytes() for e in encoded)))
            pieces = [b"".join(map(ids.__getitem__, chunks)) + tail for chunks in chunked]
            for chunk in new:  # long chunks (blobs, runs) are rarely seen twice: do not keep them
                if len(chunk) > MAX_CACHED_CHUNK:
                    del ids[chunk]
                else:
                    self.memo_bytes += _entry_bytes(chunk, ids[chunk])
        return np.frombuffer(b"".join(pieces), dtype=np.uint32), [len(p) // 4 for p in pieces]


def _entry_bytes(chunk: str, ids: bytes) -> int:
    """What one memo entry costs: the key and value objects plus its share of the dict's table."""
    return sys.getsizeof(chunk) + sys.getsizeof(ids) + _DICT_SLOT_BYTES


def chunkable(spec: dict) -> bool:
    """Whether chunk-wise encoding is exact for this tokenizer (its tokenizer.json as a dict)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if _has_run_splitter(pre):
        steps = steps[1:]
    model = spec.get("model") or {}
    return (
        spec.get("normalizer") is None
        and len(steps) == 1
        and steps[0].get("type") == "ByteLevel"
        and not steps[0].get("add_prefix_space")
        and steps[0].get("use_regex", True)
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
        # an added token holding whitespace could span a chunk boundary
        and not any(re.search(f"[{_WS}]", t.get("content", "")) for t in spec.get("added_tokens", []))
    )


def eos_id(tokenizer: Tokenizer, eos_token: str = EOS_TOKEN) -> int:
    return tokenizer.token_to_id(eos_token)


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def iter_chunks(text: str) -> Iterator[str]:
    """The independent chunks of ``text`` (for tests and tools)."""
    return iter(_CHUNK.findall(text))
