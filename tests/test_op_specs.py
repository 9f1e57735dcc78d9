"""Every operator describes itself in one place, its spec (`kernels_pallas/ops.py`, `<op>/spec.py`): every op folder
has one and is registered, every op a layer names has one, and every spec's cases build and run against its
reference, with the implementation dispatch chooses here.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

from kernels_pallas import cases, ops, registry, selftest
from kernels_pallas.calls import OpCall

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted(ops.specs())


def test_the_registry_lists_exactly_the_op_folders():
    folders = sorted(p.name for p in (ROOT / "kernels_pallas").iterdir() if (p / "__init__.py").is_file())
    assert sorted(ops.FOLDERS) == folders
    for folder in folders:
        assert (ROOT / "kernels_pallas" / folder / "spec.py").is_file(), f"kernels_pallas/{folder} has no spec.py"
        spec = ops.spec(folder)  # the folder's spec is registered under the folder's name
        assert spec.api == f"kernels_pallas.{folder}.api", spec.api
        api_source = (ROOT / "kernels_pallas" / folder / "api.py").read_text()
        assert f'registry.dispatch("{folder}"' in api_source, f"{folder}/api.py dispatches under another name"


def test_every_op_a_layer_names_has_a_spec():
    """The ops named in `OpCall.of(...)` anywhere in the runtime, and the flagships' calls with their parameters."""
    named = set()
    for path in [*(ROOT / "day0jax").rglob("*.py"), *(ROOT / "kernels_pallas").rglob("*.py")]:
        named |= set(re.findall(r'OpCall\.of\(\s*"(\w+)"', path.read_text()))
    assert named and named <= set(SPECS), f"ops without a spec: {sorted(named - set(SPECS))}"
    for family, calls in cases.families().items():
        for call in calls:
            unknown = {name for name, _ in call.params} - set(ops.spec(call.op).params)
            assert not unknown, f"{family}: {call.op} parameters {sorted(unknown)} are not in its spec"


@pytest.mark.parametrize("name", SPECS)
def test_spec_describes_its_calls_and_makes_its_cases(name):
    spec = ops.spec(name)
    assert set(spec.example) <= set(spec.params)
    call = OpCall.of(name, **spec.example)
    assert call.describe() and spec.title
    if spec.api is None:  # plain jax.numpy in the layers: described only
        assert spec.cases is None and spec.build is None and spec.phases is None
        assert cases.cases_from_calls([call]) == []
        return
    for scale in cases.SCALES:
        built = cases.cases_from_calls([call], "bfloat16", scale=scale)
        assert built and all(c.op == name for c in built), (scale, built)
        for case in built:
            case.build(0, abstract=True)
    if spec.phases is not None:
        first = cases.cases_from_calls([call], "bfloat16", scale="startup")[0]
        assert all(label and phase.op == name for label, phase in spec.phases(call, first))


@pytest.mark.parametrize("name", [n for n in SPECS if ops.spec(n).api is not None])
def test_spec_cases_run_against_the_reference(name):
    """Each tiny case's inputs, built concretely, have the shapes of its abstract build; the reference runs on them
    and the implementation dispatch would choose here agrees with it."""
    call = OpCall.of(name, **ops.spec(name).example)
    for trial in selftest.trials(cases.cases_from_calls([call], "float32", scale="tiny"), seed=1):
        args, kwargs = trial.inputs
        shapes = [(x.shape, x.dtype) for x in jax.tree.leaves((args, kwargs)) if hasattr(x, "shape")]
        abstract = [(x.shape, x.dtype) for x in jax.tree.leaves(trial.case.build(1, abstract=True))
                    if hasattr(x, "shape")]
        assert shapes == abstract, trial.case.name
        assert cases.max_relative_error(trial.reference, trial.reference) == 0.0  # finite, defined everywhere
        chosen = registry.chosen(name, *args, **kwargs)
        if chosen != registry.REFERENCE:
            row = trial.check(chosen)
            assert row["ok"], row
