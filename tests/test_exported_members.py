"""The public surface is exactly each package's ``__all__``, and every name in it is documented
(as httpx checks its own)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import vramctl
import vramctl.batching
import vramctl.cache
import vramctl.cli
import vramctl.device
import vramctl.doctor
import vramctl.estimator
import vramctl.fit
import vramctl.guard
import vramctl.jobs
import vramctl.monitor
import vramctl.optimize
import vramctl.server
from tests import api_reference


def test_top_level_names_exist() -> None:
    for name in vramctl.__all__:
        assert hasattr(vramctl, name), name


def test_public_names_are_listed_by_dir() -> None:
    # The packages import their heavy names on first use (PEP 562); dir() still lists them.
    doctor_package = importlib.import_module("vramctl.doctor")
    for package in (vramctl, vramctl.device, vramctl.jobs, doctor_package):
        assert set(package.__all__) <= set(dir(package)), package.__name__


def _fresh(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing of vramctl or PyTorch imported yet)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_import_vramctl_does_not_import_pytorch() -> None:
    _fresh(
        "import sys, vramctl, vramctl.device, vramctl.jobs\n"
        "assert 'torch' not in sys.modules, 'import vramctl imported torch'\n"
        "from vramctl import Guard, estimate\n"
        "assert 'torch' in sys.modules and estimate.__module__.startswith('vramctl.estimator')"
    )


def test_optimize_is_the_package_and_is_called_as_its_function() -> None:
    # Whichever is imported first, vramctl.optimize is the package, and calling it calls
    # the function: docs/estimate.md's vramctl.optimize.OffloadedOptimizer works as written.
    for first in (
        "import vramctl",
        "import vramctl.optimize as m",
        "from vramctl.optimize import plan",
    ):
        _fresh(
            f"{first}\n"
            "import sys, inspect, torch, vramctl\n"
            "import vramctl.optimize as m\n"
            "assert vramctl.optimize is m is sys.modules['vramctl.optimize'], vramctl.optimize\n"
            "assert m.find_blocks and m.OffloadedOptimizer and vramctl.plan is m.plan\n"
            "model, step, report = vramctl.optimize(torch.nn.Linear(4, 4), device='cpu')\n"
            "assert isinstance(report, m.OptimizationReport), report\n"
        )


def test_doctor_is_the_package_and_is_called_as_its_function() -> None:
    # As for optimize; and importing it (for the report's types) imports no PyTorch.
    _fresh(
        "import sys, vramctl\n"
        "from vramctl.doctor import DoctorReport\n"
        "assert 'torch' not in sys.modules, 'vramctl.doctor imported torch'\n"
        "assert vramctl.doctor is sys.modules['vramctl.doctor'], vramctl.doctor\n"
        "assert isinstance(vramctl.doctor(), DoctorReport)\n"
        "from vramctl.optimize import doctor\n"
        "assert vramctl.doctor.doctor is doctor"
    )


def test_public_objects_say_they_are_from_vramctl() -> None:
    for name in vramctl.__all__:
        obj = getattr(vramctl, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert obj.__module__.startswith("vramctl"), (name, obj.__module__)


@pytest.mark.parametrize("name", list(api_reference.PACKAGES))
def test_all_is_exactly_the_public_attributes(name: str) -> None:
    """``__all__`` lists every public attribute of the package and nothing else (as httpx
    checks its own): no hand-kept list of names to forget."""
    package = api_reference.package(name)
    exported = list(package.__all__)
    assert len(exported) == len(set(exported)), f"{name}.__all__ repeats a name"
    for public in exported:
        getattr(package, public)  # the lazy names load
    attributes = {
        attribute
        for attribute, value in vars(package).items()
        if (not attribute.startswith("_") or attribute == "__version__")
        and attribute != "annotations"  # from __future__
        # Submodules bind themselves on their package; public only where __all__ says.
        and not (isinstance(value, ModuleType) and attribute not in exported)
    }
    assert sorted(attributes) == sorted(exported)


@pytest.mark.parametrize("name", list(api_reference.PACKAGES))
def test_each_public_name_is_vramctls_own(name: str) -> None:
    package = api_reference.package(name)
    for public in package.__all__:
        obj = getattr(package, public)
        if isinstance(obj, type) or inspect.isfunction(obj):
            # Defined in vramctl (a package may re-export a lower layer's name, as the
            # top level does the estimator's), never a private module's leak.
            assert obj.__module__.startswith("vramctl."), (name, public, obj.__module__)


def test_every_public_name_is_in_the_api_reference_and_it_is_current() -> None:
    """docs/api.md lists each package's __all__ with each name's summary: made from the
    code, so a new public name fails here until the page is written again."""
    assert api_reference.PAGE.read_text() == api_reference.render(), (
        "docs/api.md is out of date: run python tests/api_reference.py"
    )


@pytest.mark.parametrize("name", list(api_reference.PACKAGES))
def test_each_public_class_and_function_says_what_it_is(name: str) -> None:
    package = api_reference.package(name)
    for public in package.__all__:
        obj = getattr(package, public)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert api_reference.summary(obj), f"{name}.{public} has no docstring"


def test_every_package_with_public_names_is_in_the_reference() -> None:
    found = {m.name for m in pkgutil.iter_modules(vramctl.__path__, "vramctl.") if m.ispkg}
    assert found | {"vramctl"} == set(api_reference.PACKAGES)


def test_helpers_for_sibling_packages_are_not_public() -> None:
    # What the integrations, the fit and the server share with each other lives in each
    # package's _shared module, not in its __all__.
    assert not hasattr(vramctl.guard, "stash_grads")
    assert "run_target" not in vramctl.estimator.__all__
    from vramctl.estimator._shared import run_target
    from vramctl.guard._shared import stash_grads

    assert callable(run_target) and callable(stash_grads)


def test_devices_function_is_not_shadowed_by_the_package() -> None:
    assert callable(vramctl.devices)
    assert vramctl.devices()[-1].id == "cpu"


def _modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(vramctl.__path__, "vramctl.")
        if "__main__" not in m.name
    )


@pytest.mark.parametrize("name", _modules())
def test_every_module_declares_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    if name == "vramctl._version":
        return  # one constant, re-exported by the package
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
    for public in module.__all__:
        assert hasattr(module, public), (name, public)
