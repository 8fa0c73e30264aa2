"""visattn.layers.options: the one reader of layer-option text (train.py's mapping flags, visattn-bench)."""
from __future__ import annotations

import pytest
import yaml

from visattn.layers.options import load_yaml, parse_key_values


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("kernel_size=5,dilation=2", {"kernel_size": 5, "dilation": 2}, id="pairs"),
        pytest.param("lr=1e-3,precision=no,fused=true", {"lr": 1e-3, "precision": "no", "fused": True}, id="yaml-1.2-scalars"),
        pytest.param("window=[7,7],options={k: 64, j: [1, 2]}", {"window": [7, 7], "options": {"k": 64, "j": [1, 2]}}, id="nested-commas"),
        pytest.param("name='a,b',note=it's", {"name": "a,b", "note": "it's"}, id="quoted-comma-and-apostrophe"),
        pytest.param("empty=", {"empty": None}, id="empty-value"),
        pytest.param('{"linformer": {"k": 64}}', {"linformer": {"k": 64}}, id="json-mapping"),
        pytest.param("{kernel_size: 5, lr: 1e-3}", {"kernel_size": 5, "lr": 1e-3}, id="yaml-mapping"),
    ],
)
def test_parse_key_values(text, expected):
    parsed = parse_key_values(text)
    assert parsed == expected
    assert [type(value) for value in parsed.values()] == [type(value) for value in expected.values()]


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param("bogus", "expected KEY=VALUE pairs, got 'bogus'", id="no-equals"),
        pytest.param("=3", "expected KEY=VALUE pairs, got '=3'", id="no-key"),
        pytest.param("k=1,oops", "expected KEY=VALUE pairs, got 'oops'", id="bare-word-after-comma"),
        pytest.param("k=[1,", "value of 'k' is not valid YAML: '[1,'", id="bad-value"),
        pytest.param("{k: [1", "not a valid YAML/JSON mapping", id="bad-mapping"),
        pytest.param("{1: 2}", "expected a mapping with string keys", id="non-string-keys"),
    ],
)
def test_bad_option_text_is_one_line_value_error(text, message):
    with pytest.raises(ValueError) as error:
        parse_key_values(text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_load_yaml_reads_yaml_1_2_scalars_where_pyyaml_reads_yaml_1_1():
    text = "lr: 1e-3\nmixed_precision: no\nflag: on\nyes_: true\n"
    assert yaml.safe_load(text) == {"lr": "1e-3", "mixed_precision": False, "flag": True, "yes_": True}
    assert load_yaml(text) == {"lr": 1e-3, "mixed_precision": "no", "flag": "on", "yes_": True}
