"""The shared idioms: each leaves the process as it found it."""

import os
import sys
import warnings

import pytest
import torch
from torch import nn

from labkit import torchutil
from labkit.models import tiny_gpt2, tiny_llama


def test_decoder_layers_finds_llama_and_gpt2_blocks_and_names_what_it_looked_for():
    llama, gpt2 = tiny_llama(), tiny_gpt2()
    assert torchutil.decoder_layers(llama) is llama.model.layers
    assert torchutil.decoder_layers(gpt2) is gpt2.transformer.h
    with pytest.raises(ValueError, match="Linear.*model.layers"):
        torchutil.decoder_layers(nn.Linear(2, 2))


def test_decoder_linears_names_every_block_linear_in_order_and_refuses_blocks_without_one():
    llama = tiny_llama(num_layers=2)
    expected = [
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    linears = torchutil.decoder_linears(llama)
    assert list(linears) == expected
    assert all(m is llama.get_submodule(name) for name, m in linears.items())
    with pytest.raises(ValueError, match=r"no nn.Linear inside the decoder blocks of GPT2LMHeadModel .*Conv1D"):
        torchutil.decoder_linears(tiny_gpt2())


def test_activation_checkpointing_switches_a_transformers_model_and_refuses_others():
    model = tiny_llama()
    assert torchutil.activation_checkpointing(model) is False
    assert torchutil.activation_checkpointing(model, on=True) is True and model.model.gradient_checkpointing
    assert torchutil.activation_checkpointing(model, on=False) is False and not model.model.gradient_checkpointing
    with pytest.raises(ValueError, match="transformers model, got Linear"):
        torchutil.activation_checkpointing(nn.Linear(2, 2))


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_turns_dropout_off_and_restores_the_mode_even_after_an_error(training):
    model = nn.Sequential(nn.Dropout(0.5))
    model.train(training)
    with torchutil.eval_mode(model):
        assert not model[0].training
    assert model[0].training is training
    with pytest.raises(KeyError), torchutil.eval_mode(model):
        raise KeyError("boom")
    assert model[0].training is training


def test_environ_sets_for_the_call_and_restores_set_and_unset_variables(monkeypatch):
    monkeypatch.setenv("LABKIT_TEST_SET", "before")
    monkeypatch.delenv("LABKIT_TEST_UNSET", raising=False)
    monkeypatch.delenv("LABKIT_TEST_BY_THE_CALL", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError), torchutil.environ(LABKIT_TEST_SET="during", LABKIT_TEST_UNSET="1"):
        assert (os.environ["LABKIT_TEST_SET"], os.environ["LABKIT_TEST_UNSET"]) == ("during", "1")
        os.environ["LABKIT_TEST_BY_THE_CALL"] = "a library's import set this"
        raise RuntimeError
    assert os.environ["LABKIT_TEST_SET"] == "before"
    assert "LABKIT_TEST_UNSET" not in os.environ and "LABKIT_TEST_BY_THE_CALL" not in os.environ
    assert dict(os.environ) == before


def test_quiet_holds_back_output_and_named_warnings_and_shows_the_output_on_failure(capsys):
    with torchutil.quiet("library"):
        print("banner")
        print("progress", file=sys.stderr)
    assert capsys.readouterr() == ("", "")
    with pytest.warns(UserWarning, match="signal"), torchutil.quiet("library", ignore_warnings=("noise.*",)):
        warnings.warn("noise from the library", UserWarning, stacklevel=1)
        warnings.warn("signal the reader needs", UserWarning, stacklevel=1)
    with pytest.raises(RuntimeError, match=r"loading failed; its output ends with:\nstep 3 of 4") as err:
        with torchutil.quiet("loading"):
            print("step 3 of 4")
            raise OSError("disk")
    assert isinstance(err.value.__cause__, OSError)


def test_quiet_holds_back_the_transformers_log_for_the_call_only():
    import logging

    from transformers.utils import logging as hf_logging

    seen: list[str] = []
    catcher = logging.Handler()
    catcher.emit = lambda record: seen.append(record.getMessage())  # whichever stream transformers' handler holds
    root = hf_logging.get_logger("transformers")
    root.addHandler(catcher)
    original = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # whatever an earlier test left
    try:
        with torchutil.quiet("loading"):
            hf_logging.get_logger("transformers.modeling_utils").warning("`loss_type=None` was set in the config")
        assert seen == [] and hf_logging.get_verbosity() == hf_logging.WARNING
        hf_logging.get_logger("transformers.modeling_utils").warning("after the call")
        assert seen == ["after the call"]
    finally:
        root.removeHandler(catcher)
        hf_logging.set_verbosity(original)


@pytest.mark.parametrize(
    "value, integer, number",
    [(3, True, True), (True, False, False), (3.0, False, True), ("3", False, False), (float("nan"), False, False)]
    + [(float("inf"), False, False), (None, False, False), (-2, True, True)],
)
def test_is_int_and_is_number_refuse_bools_text_and_non_finite_values(value, integer, number):
    assert (torchutil.is_int(value), torchutil.is_number(value)) == (integer, number)


def test_token_ids_are_checked_against_the_embedding_and_skipped_without_one():
    llama = tiny_llama(vocab_size=40)
    assert torchutil.vocab_size(llama) == 40 and torchutil.vocab_size(torch.nn.Linear(2, 2)) is None
    torchutil.check_token_ids(torch.tensor([[0, 39]]), 40)
    torchutil.check_token_ids(torch.tensor([[99]]), None)  # a model without an embedding: nothing to check
    with pytest.raises(ValueError, match=r"input ids hold token id 40, outside the model's vocabulary \[0, 40\)"):
        torchutil.check_token_ids(torch.tensor([[3, 40]]), 40)
    with pytest.raises(ValueError, match="token id -2"):
        torchutil.check_token_ids(torch.tensor([-2, 5]), 40)


def test_replace_module_puts_the_new_module_at_a_dotted_name_or_at_the_top():
    from labkit.torchutil import replace_module

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    new = torch.nn.Linear(3, 1)
    replace_module(model, "1.1", new)
    assert model[1][1] is new and isinstance(model[1][0], torch.nn.ReLU)
    top = torch.nn.Identity()
    replace_module(model, "0", top)
    assert model[0] is top
    with pytest.raises(AttributeError):
        replace_module(model, "2.0", new)


def test_module_name_finds_a_submodule_by_identity():
    model = tiny_llama()
    assert torchutil.module_name(model, model.model.layers) == "model.layers"
    assert torchutil.module_name(model, model.model.layers[1].mlp.up_proj) == "model.layers.1.mlp.up_proj"
    assert torchutil.module_name(model, model) == ""
    with pytest.raises(ValueError, match="not a submodule"):
        torchutil.module_name(model, nn.Linear(2, 2))


@pytest.mark.parametrize(
    "check, args, error, message",
    [
        (torchutil.check_int, ("n", True), TypeError, "n must be an int, got True"),
        (torchutil.check_int, ("n", 2.0), TypeError, "n must be an int, got 2.0"),
        (torchutil.check_int, ("n", 0, 1), ValueError, "n must be an int >= 1, got 0"),
        (torchutil.check_number, ("lr", float("inf")), TypeError, "lr must be a finite number, got inf"),
        (torchutil.check_number, ("lr", "1e-3"), TypeError, "lr must be a finite number, got '1e-3'"),
        (torchutil.check_number, ("lr", -1.0, 0), ValueError, "lr must be a number >= 0, got -1.0"),
        (torchutil.check_bool, ("inplace", 1), TypeError, "inplace must be True or False, got 1"),
        (torchutil.check_module, (nn.Linear,), TypeError, "model must be a torch.nn.Module, got type"),
        (torchutil.as_path, ("out_dir", None), TypeError, "out_dir must be a path .*got None"),
        (torchutil.as_path, ("out_dir", ""), TypeError, "out_dir must be a path .*got ''"),
    ],
)
def test_the_shared_checks_name_the_argument_and_what_is_allowed(check, args, error, message):
    with pytest.raises(error, match=message):
        check(*args)


def test_the_shared_checks_pass_what_is_allowed(tmp_path):
    torchutil.check_int("n", 0)
    torchutil.check_number("lr", 3)
    torchutil.check_bool("inplace", False)
    torchutil.check_module(nn.Linear(1, 1))
    assert torchutil.as_path("out_dir", str(tmp_path)) == tmp_path
