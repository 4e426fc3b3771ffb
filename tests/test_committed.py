"""What is committed must stay portable: results and shipped releases hold no path of the machine that made them."""
import json

import pytest
import yaml

from conftest import ROOT

pytestmark = pytest.mark.unit

COMMITTED = sorted([*ROOT.glob("results/**/*.json"), *ROOT.glob("results/**/*.yaml"),
                    *ROOT.glob("src/cifarkit/pretrained/*/*.json"), *ROOT.glob("src/cifarkit/pretrained/*/*.yaml")])


def strings(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_absolute_machine_path(path):
    document = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    absolute = [s for s in strings(document) if s.startswith(("/", "~")) or (len(s) > 2 and s[1:3] == ":\\")]
    assert absolute == []
