"""Data: every text source, offline BPE, packing, split and sharding, clear errors."""
import gzip
import json
import os

import numpy as np
import pytest
import torch

from orchestration.data import tokens as data

from orchestration.models import loading as models

DOCS = ["The quick brown fox jumps over the lazy dog. " * 4,
        "def add(a, b):\n    return a + b\n" * 3,
        "Pack my box with five dozen liquor jugs! 0123456789 " * 3]


@pytest.fixture(scope="module")
def bpe():
    return data.train_bpe(DOCS * 5, vocab_size=300)


# ------------------------------------------------------------------ sources
def test_text_file_and_gzip(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(DOCS[1].encode()))
    assert data.load_texts(tmp_path / "a.txt") == [DOCS[0]]
    assert data.load_texts(str(tmp_path / "b.txt.gz")) == [DOCS[1]]


def test_directory_sorted_recursive_skips_hidden(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "z.txt").write_text("zzz")
    (tmp_path / "sub" / "a.md").write_text("aaa")
    (tmp_path / ".hidden").write_text("never")
    assert data.load_texts(tmp_path) == ["aaa", "zzz"]  # sub/a.md < z.txt


def test_jsonl_text_field(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")
    assert data.load_texts(p, text_field="body") == DOCS
    with pytest.raises(ValueError, match=r"d.jsonl:1: no field 'text' \(fields: \['body', 'id'\]\)"):
        data.load_texts(p)


def test_jsonl_bad_line_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        data.load_texts(p)
    p.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match="is int, not a string"):
        data.load_texts(p)


def test_hf_dataset_save_to_disk_and_object(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"content": DOCS})
    ds.save_to_disk(str(tmp_path / "saved"))
    assert data.load_texts(tmp_path / "saved", text_field="content") == DOCS
    dd = datasets.DatasetDict({"train": ds, "test": ds.select([0])})
    dd.save_to_disk(str(tmp_path / "saved_dict"))
    assert data.load_texts(tmp_path / "saved_dict", text_field="content", split="test") == DOCS[:1]
    assert data.load_texts(ds, text_field="content") == DOCS
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['content'\]\)"):
        data.load_texts(ds)
    with pytest.raises(ValueError, match="no split 'validation'"):
        data.load_texts(dd, text_field="content", split="validation")


def test_local_json_and_csv_via_datasets(tmp_path):
    pytest.importorskip("datasets")
    p = tmp_path / "rows.json"
    p.write_text(json.dumps([{"text": d} for d in DOCS]))
    assert data.load_texts(p, cache_dir=str(tmp_path / "cache")) == DOCS
    c = tmp_path / "rows.csv"
    c.write_text("text,n\n" + "".join(f'"{d}",{i}\n' for i, d in enumerate(["alpha beta", "gamma"])))
    assert data.load_texts(c, cache_dir=str(tmp_path / "cache")) == ["alpha beta", "gamma"]


def test_list_of_texts_and_prefixes():
    assert data.load_texts(DOCS) == DOCS
    with pytest.raises(TypeError, match="document 1 of the list is int"):
        data.load_texts(["a", 1])
    assert data.load_texts("task:add")[0].count("=") == 1
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        data.load_texts("corpus:nope")


# ------------------------------------------------------------------ clear errors
def test_missing_empty_and_undecodable(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_texts(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no text found"):
        data.load_texts(tmp_path / "empty.txt")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        data.load_texts(tmp_path / "emptydir")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not valid UTF-8 text \(byte 3"):
        data.load_texts(tmp_path / "latin1.txt")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01binary")
    with pytest.raises(ValueError, match="NUL bytes"):
        data.load_texts(tmp_path / "bin.dat")
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "good.txt").write_text("good text")
    (d / "bad.bin").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="bad.bin"):
        data.load_texts(d, on_decode_error="raise")
    assert data.load_texts(d, on_decode_error="skip") == ["good text"]
    with pytest.raises(TypeError, match="unsupported text source"):
        data.load_texts(3.5)


# ------------------------------------------------------------------ tokenizers
def test_offline_bpe_roundtrip_deterministic_and_saved(tmp_path, bpe):
    text = "Jumps over 42 dogs: def add(a, b) -> ü ✓"
    ids = bpe.encode(text, add_special_tokens=False)
    assert bpe.decode(ids) == text  # byte-level: unseen characters still round-trip
    assert len(bpe) == 300 and bpe.eos_token_id == 0
    again = data.train_bpe(DOCS * 5, vocab_size=300)
    assert again.backend_tokenizer.to_str() == bpe.backend_tokenizer.to_str()
    bpe.save_pretrained(str(tmp_path / "tok"))
    loaded = data.load_tokenizer(tmp_path / "tok")
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert data.load_tokenizer(tmp_path / "tok" / "tokenizer.json").encode(text) == ids
    assert data.load_tokenizer(bpe.backend_tokenizer).encode(text) == ids


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no tokenizer \(tokenizer.json / tokenizer.model / vocab files\) in "
                       + str(tmp_path)):
        data.load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_bpe(DOCS, vocab_size=100)


# ------------------------------------------------------------------ packing
def test_pack_is_concatenation_with_separators():
    t = data.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, separator=0)
    assert t.dtype == torch.int64
    assert t.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert data.pack([[1, 2, 3], [4, 5]], 2).tolist() == [[1, 2], [3, 4]]  # tail dropped
    with pytest.raises(ValueError, match="fewer than one sequence"):
        data.pack([[1, 2]], 8)


def test_build_token_dataset_matches_manual_encoding(tmp_path, bpe):
    (tmp_path / "c.txt").write_text(DOCS[0])
    ds = data.build_token_dataset(DOCS, bpe, seq_len=16)
    stream = []
    for d in DOCS:
        stream += bpe.encode(d, add_special_tokens=False) + [bpe.eos_token_id]
    n = len(stream) // 16
    assert ds.tokens.shape == (n, 16) and ds.tokens.dtype == torch.int64
    assert ds.tokens.flatten().tolist() == stream[: n * 16]
    capped = data.build_token_dataset(DOCS, bpe, seq_len=16, max_tokens=40)
    assert capped.tokens.shape == (2, 16)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        data.build_token_dataset(tmp_path / "c.txt", bpe, seq_len=10_000)


# ------------------------------------------------------------------ split / shard / batches
def _dataset(n=23, t=5):
    return data.TokenDataset(torch.arange(n * t, dtype=torch.int64).reshape(n, t))


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_shards_disjoint_cover_and_deterministic(count):
    ds = _dataset()
    shards = [ds.shard(i, count) for i in range(count)]
    rows = [tuple(r.tolist()) for s in shards for r in s.tokens]
    assert len(rows) == len(set(rows)) == len(ds)  # disjoint + full coverage
    assert set(rows) == {tuple(r.tolist()) for r in ds.tokens}
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(torch.equal(s.tokens, ds.shard(i, count).tokens) for i, s in enumerate(shards))


def test_shard_errors():
    ds = _dataset(3)
    with pytest.raises(ValueError, match="shard index"):
        ds.shard(3, 3)
    with pytest.raises(ValueError, match="shard count"):
        ds.shard(0, 0)
    with pytest.raises(ValueError, match="a shard would be empty"):
        ds.shard(0, 4)


def test_split_held_out_disjoint_spread_deterministic():
    ds = _dataset(100)
    train, held = ds.split(0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    firsts = sorted(r[0].item() for r in torch.cat([train.tokens, held.tokens]))
    assert firsts == [r[0].item() for r in ds.tokens]  # disjoint, complete
    assert torch.equal(ds.split(0.1, seed=3)[1].tokens, held.tokens)
    assert not torch.equal(ds.split(0.1, seed=4)[1].tokens, held.tokens)
    assert held.tokens[:, 0].max() - held.tokens[:, 0].min() > 50 * 5  # not just the tail
    with pytest.raises(ValueError, match="eval_fraction"):
        ds.split(1.0)
    with pytest.raises(ValueError, match="keep any for training"):
        _dataset(1).split(0.5)


def test_batches_epochs_are_permutations_and_deterministic():
    ds = _dataset(12)
    got = list(ds.batches(4, seed=7, epochs=2))
    assert len(got) == 6 and all(b.shape == (4, 5) for b in got)
    epoch0 = torch.cat(got[:3])[:, 0].sort().values
    assert torch.equal(epoch0, ds.tokens[:, 0])
    again = list(ds.batches(4, seed=7, epochs=2))
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    with pytest.raises(ValueError, match="batch_size"):
        next(ds.batches(13))


def test_token_dataset_validates():
    with pytest.raises(ValueError, match="int64"):
        data.TokenDataset(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError):
        data.TokenDataset([[1, 2]])


# ------------------------------------------------------------------ broken tokenizers
def _word_level(vocab, **kw):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def test_tokenizerless_model_dir_and_degenerate_tokenizers_raise(tmp_path, bpe):
    from tokenizers import Tokenizer, models
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    (model_dir / "model.safetensors").write_bytes(b"")
    bpe.save_pretrained(str(tmp_path / "only_config"))  # tokenizer_config.json without tokenizer.json:
    (tmp_path / "only_config" / "tokenizer.json").unlink()  # transformers 5 builds a len-1 tokenizer
    for d in (model_dir, tmp_path / "only_config"):
        with pytest.raises(ValueError, match=r"no tokenizer \(tokenizer.json / tokenizer.model / vocab files\) in "
                           + str(d)):
            data.load_tokenizer(d)
        with pytest.raises(ValueError, match="no tokenizer"):
            data.build_token_dataset(DOCS, d, seq_len=8)
    Tokenizer(models.BPE()).save(str(tmp_path / "only_config" / "tokenizer.json"))  # file there, but empty
    with pytest.raises(ValueError, match="degenerate tokenizer"):
        data.load_tokenizer(tmp_path / "only_config")
    with pytest.raises(ValueError, match="degenerate tokenizer"):  # probe -> one repeated id
        data.load_tokenizer(_word_level({"[UNK]": 0, "zzz": 1}))


def test_single_id_stream_is_rejected():
    tok = _word_level({"[UNK]": 0, "Hello": 1, "world": 2})  # passes the probe, no eos
    with pytest.raises(ValueError, match=r"every one of its 40 tokens is id 0 \(fewer than 2 distinct ids\)"):
        data.build_token_dataset(["foo bar baz qux " * 10], tok, seq_len=8)
    assert data.build_token_dataset(["Hello foo world bar " * 10], tok, seq_len=8).tokens.unique().tolist() == [0, 1, 2]


# ------------------------------------------------------------------ pieces: same ids as whole documents
# Cut candidates next to every awkward neighbour: blank lines, indentation, CRLF, tabs,
# non-ASCII, digits, the special token's text, a line break right after a contraction.
TRICKY = ("def f(x):\n    return x\n\n\nclass A:\n\tpass\r\nüñí ✓ 日本語\nit's\n'll be 12345\n"
          "<|endoftext|>\nend.\n  \n x\n") * 12


def _whole_stream(tok, docs):
    stream = []
    for ids in data.encode_documents(tok, docs):
        stream += ids + [tok.eos_token_id]
    return stream


def _tokenizers(bpe):
    toks = [bpe]
    base = str(models.cache_root() / models.BASE_MODEL_VERSION)
    if os.path.isfile(os.path.join(base, "tokenizer.json")):  # the trainer's default model
        toks.append(data.load_tokenizer(base))
    return toks


def test_pieces_give_the_ids_of_whole_documents(monkeypatch, bpe):
    monkeypatch.setattr(data, "_PIECE_CHARS", 50)  # TRICKY (~1 K chars) -> ~20 pieces
    monkeypatch.setattr(data, "_BATCH_CHARS", 120)  # and pieces of one document in several batches
    docs = [TRICKY, "short doc", DOCS[1] * 20, TRICKY[7:]]
    for tok in _tokenizers(bpe):
        assert data._cuts_are_exact(tok)
        pieces = data._pieces(tok, TRICKY, True)
        assert len(pieces) > 10 and "".join(pieces) == TRICKY
        whole = _whole_stream(tok, docs)
        got = data.build_token_dataset(docs, tok, seq_len=16)
        n = len(whole) // 16
        assert got.tokens.flatten().tolist() == whole[: n * 16]
        capped = data.encode_stream(tok, docs, separator=tok.eos_token_id, max_tokens=333)
        assert capped.dtype == np.int32 and capped.tolist() == whole[:333]


def test_pieces_not_cut_for_a_metaspace_tokenizer(monkeypatch):
    # SentencePiece-style pre-tokenizers mark the start of every encoded string: cutting
    # would add a mark per piece, so such tokenizers are encoded whole (same ids again).
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator([TRICKY] + DOCS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                               show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")
    monkeypatch.setattr(data, "_PIECE_CHARS", 50)
    assert not data._cuts_are_exact(tok)
    assert data._pieces(tok, TRICKY, True) == [TRICKY]  # the per-cut check alone also refuses
    assert data.encode_stream(tok, [TRICKY, DOCS[0]], separator=tok.eos_token_id).tolist() == \
        _whole_stream(tok, [TRICKY, DOCS[0]])


# ------------------------------------------------------------------ token cache
def _no_encoding(*a, **k):
    raise AssertionError("tokenized although the cache should have answered")


def test_token_cache_hit_and_invalidation(tmp_path, monkeypatch, capsys, bpe):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(DOCS[0] * 3)
    (src / "b.txt").write_text(DOCS[1] * 3)
    cache = tmp_path / "cache"
    first = data.build_token_dataset(src, bpe, seq_len=16, token_cache=cache)
    assert [p.suffix for p in cache.iterdir()] == [".safetensors"]  # one file, no tmp left
    real = data.encode_stream
    monkeypatch.setattr(data, "encode_stream", _no_encoding)
    again = data.build_token_dataset(src, bpe, seq_len=16, token_cache=cache)
    assert torch.equal(again.tokens, first.tokens) and again.tokens.dtype == torch.int64
    for changed in [dict(seq_len=8), dict(max_tokens=48), dict(on_decode_error="skip"),
                    dict(text_field="body")]:  # every packing argument is in the key
        with pytest.raises(AssertionError, match="tokenized although"):
            data.build_token_dataset(src, bpe, **{"seq_len": 16, **changed}, token_cache=cache)
    assert capsys.readouterr().err == ""  # key misses, not a rejected file
    st = (src / "a.txt").stat()
    os.utime(src / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touch
    with pytest.raises(AssertionError, match="tokenized although"):
        data.build_token_dataset(src, bpe, seq_len=16, token_cache=cache)
    other = data.train_bpe(DOCS * 5, vocab_size=280)  # a different tokenizer is another key
    with pytest.raises(AssertionError, match="tokenized although"):
        data.build_token_dataset(DOCS, other, seq_len=16, token_cache=cache)
    monkeypatch.setattr(data, "encode_stream", real)
    data.build_token_dataset(DOCS, bpe, seq_len=16, token_cache=cache)
    (src / "c.txt").write_text("a new file")
    with pytest.raises(AssertionError, match="tokenized although"):  # new file in the directory
        monkeypatch.setattr(data, "encode_stream", _no_encoding)
        data.build_token_dataset(src, bpe, seq_len=16, token_cache=cache)
    assert torch.equal(data.build_token_dataset(DOCS, bpe, seq_len=16, token_cache=cache).tokens,
                       data.TokenDataset(data.pack(data.encode_documents(bpe, DOCS), 16, separator=0)).tokens)


def test_token_cache_ignores_damaged_files(tmp_path, capsys, bpe):
    cache = tmp_path / "cache"
    want = data.build_token_dataset(DOCS, bpe, seq_len=16, token_cache=cache).tokens
    (f,) = cache.iterdir()
    good = f.read_bytes()
    for damage in [good[: len(good) // 2], b"not a safetensors file", b""]:
        f.write_bytes(damage)
        got = data.build_token_dataset(DOCS, bpe, seq_len=16, token_cache=cache).tokens
        assert torch.equal(got, want)
        assert "ignoring unusable token cache" in capsys.readouterr().err
        assert f.read_bytes() == good  # rebuilt
    from safetensors.torch import save_file
    save_file({"tokens": torch.full((2, 16), 10_000, dtype=torch.int32)}, str(f))  # ids past the vocab
    assert torch.equal(data.build_token_dataset(DOCS, bpe, seq_len=16, token_cache=cache).tokens, want)
    assert "ids < 300" in capsys.readouterr().err


# ------------------------------------------------------------------ decode policy and flag wording
def test_directory_skips_binary_files_with_one_warning(tmp_path, capsys):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    for i in range(5):
        (tmp_path / "pkg" / "__pycache__" / f"m{i}.pyc").write_bytes(b"\xa7\r\r\n\x00\x00" + bytes([i]))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert data.load_texts(tmp_path) == ["x = 1\n"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "left out 6 of 7 files" in err[0] and "and 3 more" in err[0]
    assert "pkg/__pycache__/m0.pyc" in err[0]
    with pytest.raises(ValueError, match=r"latin1.txt: not valid UTF-8 .* --data.on-decode-error skip"):
        data.load_texts(tmp_path, on_decode_error="raise")
    with pytest.raises(ValueError, match=r"latin1.txt: not valid UTF-8 .* --data.on-decode-error skip"):
        data.load_texts(tmp_path / "latin1.txt")  # a file named on its own raises under auto
    with pytest.raises(ValueError, match="leaves no text"):
        data.load_texts(tmp_path / "latin1.txt", on_decode_error="skip")
    with pytest.raises(ValueError, match=r"--data.on-decode-error must be one of auto, raise, skip"):
        data.load_texts(tmp_path, on_decode_error="ignore")


def test_field_errors_name_the_cli_flag(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"choose one with --data.text-field"):
        data.load_texts(p)
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match=r"choose one with --data.text-field"):
        data.load_texts(datasets.Dataset.from_dict({"body": ["x"]}))
