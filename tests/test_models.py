"""Models: name resolution, errors, tiny models, published shapes, and the offline default model answering correctly."""

import dataclasses

import pytest
import torch

from labkit import models
from labkit.evaluate import generate
from tests.permissions import UMASK_CASES, modes, umask


@pytest.mark.parametrize("factory", [models.tiny_llama, models.tiny_gpt2])
def test_tiny_models_are_seeded_and_run(factory):
    a, b = factory(seed=3), factory(seed=3)
    ids = torch.randint(0, 512, (2, 10))
    out = a(input_ids=ids).logits
    assert out.shape == (2, 10, 512)
    assert torch.equal(out, b(input_ids=ids).logits)
    assert not torch.equal(out, factory(seed=4)(input_ids=ids).logits)


@pytest.mark.parametrize("factory", [models.tiny_llama, models.tiny_gpt2])
def test_tiny_models_leave_the_callers_rng_alone(factory):
    torch.manual_seed(11)
    expected = torch.rand(3)  # what the caller's next draw is, with no model built in between
    torch.manual_seed(11)
    factory(seed=3)
    assert torch.equal(torch.rand(3), expected)


def test_count_parameters_counts_tied_weights_once():
    m = models.tiny_llama(
        vocab_size=100, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    )
    assert m.get_input_embeddings().weight is m.get_output_embeddings().weight
    assert models.count_parameters(m) == sum(p.numel() for p in m.parameters())  # parameters() dedups
    m.model.layers[0].mlp.requires_grad_(False)
    assert models.count_parameters(m, trainable_only=True) == models.count_parameters(m) - 3 * 16 * 32


def test_local_directory_round_trip(tmp_path, capfd):
    from tokenizers import Tokenizer
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    model = models.tiny_llama()
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(512)} | {"<unk>": 0}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tmodels.WordLevel(vocab, unk_token="<unk>")), eos_token="t1"
    )
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = models.load_model(str(tmp_path))
    ids = torch.randint(0, 512, (1, 8))
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded_tok.pad_token == "t1"  # pad falls back to EOS
    assert not loaded.training
    # no "Loading weights" / "Writing model shards" bar (a frozen widget in a saved notebook), and the setting
    # left as it was
    for setting in (hf_logging.disable_progress_bar, hf_logging.enable_progress_bar):
        setting()
        was_on = hf_logging.is_progress_bar_enabled()
        capfd.readouterr()
        models.save_model(*models.load_model(str(tmp_path)), tmp_path / "saved")
        assert "%|" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled() == was_on


def test_unknown_names_get_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'smollm3'.*smollm2-135m"):
        models.resolve_model("smollm3")
    with pytest.raises(ValueError, match="non-empty"):
        models.resolve_model("")
    with pytest.raises(ValueError, match="no config.json"):
        models.resolve_model(str(tmp_path))


def test_hub_id_passes_through_and_fails_clearly_offline():
    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(OSError, match="needs internet access"):
        models.load_model("labkit-test/definitely-not-cached")


@pytest.mark.model
def test_default_model_is_smollm2_and_answers_a_fact(default_model):
    model, tokenizer = default_model
    assert model.config.model_type == "llama" and model.config.hidden_size == 576
    assert models.count_parameters(model) == 134_515_008
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.chat_template  # the chat template survived the conversion
    answer = generate(model, tokenizer, "What is the capital of France?", max_new_tokens=20)
    assert "Paris" in answer


def test_load_tokenizer_alone_matches_load_model(default_model):
    _, tokenizer = default_model
    alone = models.load_tokenizer("smollm2-135m")
    assert alone("Paris is a city.")["input_ids"] == tokenizer("Paris is a city.")["input_ids"]
    assert alone.vocab_size == 49152


def test_lab_llama_is_sized_by_the_profile():
    from labkit.profiles import PROFILES

    model = models.lab_llama(1000, PROFILES["smoke"], seed=0)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.max_position_embeddings) == (
        PROFILES["smoke"].train.hidden,
        PROFILES["smoke"].train.layers,
        3 * PROFILES["smoke"].train.hidden,
        PROFILES["smoke"].train.block_size,
    )
    assert cfg.num_key_value_heads == 2 and cfg.vocab_size == 1000


def test_llama_shape_builds_the_parameters_counted_by_hand():
    """Lab 09's model at the gpu profile's width: 12 heads of 64, 6 KV heads, an MLP of 2,048, tied head."""
    vocab, hidden, layers, seq = 1000, 768, 3, 256
    shape = models.llama_shape(vocab, hidden, layers, seq)
    assert (shape["num_heads"], shape["num_kv_heads"], shape["intermediate_size"]) == (12, 6, 2048)
    kv = 6 * 64
    per_block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * 2048 + 2 * hidden  # q, o; k, v; MLP; norms
    with torch.device("meta"):
        model = models.tiny_llama(**shape)
    assert sum(p.numel() for p in model.parameters()) == vocab * hidden + layers * per_block + hidden
    assert model.config.max_position_embeddings == seq + 1


@pytest.mark.parametrize(
    "args, match",
    [((1000, 576, 2, 64), "multiple of 128"), ((1000, 0, 2, 64), "multiple of 128"), ((0, 256, 2, 64), "vocab_size")],
)
def test_llama_shape_rejects_shapes_it_cannot_split_into_heads(args, match):
    with pytest.raises(ValueError, match=match):
        models.llama_shape(*args)


@pytest.mark.parametrize(
    "name, published, embeddings",
    [
        ("SmolLM2-135M", 134_515_008, 49152 * 576),  # the model card's 135M; the embedding doubles as the LM head
        ("Llama-2-7B", 6_738_415_616, 2 * 32000 * 4096),  # Touvron et al. (2023): 6.74 B; embedding and LM head
    ],
)
def test_published_shapes_have_the_published_parameter_counts(name, published, embeddings):
    shape = models.PUBLISHED_SHAPES[name]
    assert shape.n_params == published
    assert shape.n_params - shape.linear_params == embeddings + (2 * shape.num_layers + 1) * shape.hidden_size
    with torch.device("meta"):  # built without memory, as lab 09 counts them; parameters() holds a tied head once
        assert sum(p.numel() for p in models.tiny_llama(**dataclasses.asdict(shape)).parameters()) == published


@pytest.mark.parametrize("tied", [True, False])
def test_decoder_shape_counts_what_transformers_builds(tied):
    shape = models.DecoderShape(100, 16, 2, num_heads=4, num_kv_heads=2, intermediate_size=40, tie_word_embeddings=tied)
    model = models.tiny_llama(**dataclasses.asdict(shape))
    linears = {n: m.weight.shape for n, m in model.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    assert {n.split(".")[-1]: (s[1], s[0]) for n, s in linears.items()} == shape.linear_shapes()
    # per layer: q, o 16 × 16; k, v 16 × 8 (2 KV heads of 4); gate, up, down 16 × 40; two norms of 16
    per_layer = 2 * 256 + 2 * 128 + 3 * 640
    assert shape.linear_params == 2 * per_layer
    assert shape.n_params == models.count_parameters(model) == 2 * (per_layer + 32) + 16 + (1 + (not tied)) * 1600


def test_decoder_shape_refuses_impossible_shapes():
    with pytest.raises(ValueError, match="num_heads \\(4\\) must be a multiple of num_kv_heads \\(3\\)"):
        models.DecoderShape(100, 16, 2, num_heads=4, num_kv_heads=3, intermediate_size=40, tie_word_embeddings=True)
    with pytest.raises(TypeError, match="intermediate_size must be an int"):
        models.DecoderShape(100, 16, 2, num_heads=4, num_kv_heads=2, intermediate_size=40.0, tie_word_embeddings=True)
    with pytest.raises(TypeError, match="tie_word_embeddings must be True or False"):
        models.DecoderShape(100, 16, 2, num_heads=4, num_kv_heads=2, intermediate_size=40, tie_word_embeddings=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        models.PUBLISHED_SHAPES["Llama-2-7B"].num_layers = 40


@pytest.mark.model
def test_smollm2_shape_is_the_offline_checkpoints(default_model):
    model, _ = default_model
    cfg = model.config
    built = (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    shape = models.PUBLISHED_SHAPES["SmolLM2-135M"]
    assert built + (cfg.intermediate_size, cfg.tie_word_embeddings) == tuple(dataclasses.asdict(shape).values())
    assert models.count_parameters(model) == shape.n_params


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(512)} | {"<unk>": 0}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tmodels.WordLevel(vocab, unk_token="<unk>")), eos_token="t1"
    )


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_saved_models_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    tok = _word_tokenizer()
    with umask(mask):
        dest = models.save_model(models.tiny_llama(), tok, tmp_path / "m")
    found = modes(dest)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= found.keys()  # safetensors writes 0600
    assert found == dict.fromkeys(found, file_mode) | {".": dir_mode}


@pytest.mark.parametrize(
    "build, kwargs, match",
    [
        (
            "tiny_llama",
            {"num_heads": 4, "num_kv_heads": 3},
            r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)",
        ),
        ("tiny_llama", {"hidden_size": 30}, r"hidden_size \(30\) must be a multiple of num_heads \(4\)"),
        ("tiny_llama", {"num_layers": 0}, "num_layers must be an int >= 1, got 0"),
        ("tiny_gpt2", {"vocab_size": 0}, "vocab_size must be an int >= 1, got 0"),
        ("tiny_gpt2", {"hidden_size": 64.0}, "hidden_size must be an int >= 1, got 64.0"),
    ],
)
def test_tiny_models_refuse_impossible_shapes(build, kwargs, match):
    with pytest.raises(ValueError, match=match):
        getattr(models, build)(**kwargs)


def test_count_parameters_wants_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        models.count_parameters("model")


def test_load_model_names_a_bad_device_before_loading(monkeypatch):
    monkeypatch.setattr(models, "resolve_model", lambda name: "/nonexistent-so-loading-would-fail")
    with pytest.raises(ValueError, match=r"device must be a torch device .* got 'gpu0'"):
        models.load_model("anything", device="gpu0")


def test_saving_again_replaces_a_model_an_older_labkit_saved_and_nothing_else(tmp_path):
    """Re-running lab 06 or 07 saves where an older labkit saved without its marker: that model is replaced; a
    folder that also holds someone's notes is refused, with everything in it left as it was."""
    from labkit import fileio

    tok, dest = _word_tokenizer(), tmp_path / "m"
    models.save_model(models.tiny_llama(), tok, dest)
    (dest / fileio.OUTPUT_MARKER).unlink()
    assert models.is_saved_model(dest)
    models.save_model(models.tiny_llama(), tok, dest)  # no error: its own earlier save
    (dest / fileio.OUTPUT_MARKER).unlink()
    (dest / "notes.txt").write_text("mine")
    before = sorted(p.name for p in dest.iterdir())
    assert not models.is_saved_model(dest)
    with pytest.raises(FileExistsError, match="holds files labkit did not write"):
        models.save_model(models.tiny_llama(), tok, dest)
    assert sorted(p.name for p in dest.iterdir()) == before and (dest / "notes.txt").read_text() == "mine"
