"""--model SPEC resolution and strict weight loading."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from amp_postmortem.errors import ModelSpecError
from amp_postmortem.replaying.model_spec import build_model, load_weights, resolve_factory

FACTORY_FILE = """
import torch.nn as nn
from helper_layers import width   # a neighbour of this file


def build():
    return nn.Sequential(nn.Linear(width, 3), nn.ReLU())


def not_a_model():
    return 42


def needs_args(depth):
    return nn.Linear(depth, depth)
"""


@pytest.fixture
def model_file(tmp_path):
    (tmp_path / "helper_layers.py").write_text("width = 5\n")
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY_FILE)
    return path


def test_file_spec_loads_the_factory_and_lets_it_import_neighbours(model_file):
    model = build_model(f"{model_file}:build")
    assert isinstance(model, nn.Sequential) and model[0].in_features == 5


def test_module_spec_and_dotted_attribute():
    assert build_model("torch.nn:Identity").__class__ is nn.Identity
    assert resolve_factory("torch.nn.modules.linear:Identity") is nn.Identity


@pytest.mark.parametrize("spec, message", [
    ("no_colon_here", "is not of the form package.module:factory or path/to/file.py:factory"),
    ("definitely_missing_pkg_xyz:build", "cannot import 'definitely_missing_pkg_xyz'"),
    ("torch.nn:NoSuchThing", "'NoSuchThing' not found"),
    ("missing/dir/model.py:build", "file 'missing/dir/model.py' does not exist"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ModelSpecError) as err:
        build_model(spec)
    assert message in str(err.value)


def test_factory_must_return_a_module_and_errors_are_wrapped(model_file):
    with pytest.raises(ModelSpecError, match="returned int, not a torch.nn.Module"):
        build_model(f"{model_file}:not_a_model")
    with pytest.raises(ModelSpecError, match="could not be built with no arguments: TypeError"):
        build_model(f"{model_file}:needs_args")


def test_no_spec_is_an_error_that_says_what_to_pass():
    # Never a fallback to the recorded class: a bundle must not pick the code.
    with pytest.raises(ModelSpecError) as err:
        build_model(None, model_class="torch.nn.modules.linear.Identity")
    assert "pass --model package.module:factory or path/to/file.py:factory" in str(err.value)
    assert "--model recorded" in str(err.value)


def test_weights_load_strictly_with_missing_and_unexpected_keys_listed():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.pop("0.bias")
    state["head.weight"] = torch.zeros(1)
    with pytest.raises(ModelSpecError) as err:
        load_weights(model, state)
    assert str(err.value) == ("the bundle's weights do not fit Sequential (missing from the bundle: 0.bias; "
                              "not in the model: head.weight); build the model the run trained")


def test_shape_mismatch_is_named():
    with pytest.raises(ModelSpecError, match=r"shape mismatch for weight \(3, 2\) vs \(2, 2\)"):
        load_weights(nn.Linear(2, 2), {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})


def test_tied_weights_saved_under_one_name_and_nonpersistent_buffers():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3)
            self.out = nn.Linear(3, 4, bias=False)
            self.out.weight = self.emb.weight
            self.register_buffer("cache", torch.zeros(2), persistent=False)

    src = Tied()
    state = {"emb.weight": torch.arange(12.0).view(4, 3), "cache": torch.ones(2)}
    dst = Tied()
    load_weights(dst, state)
    assert torch.equal(dst.out.weight, state["emb.weight"]) and torch.equal(dst.cache, torch.ones(2))
    assert src is not dst
