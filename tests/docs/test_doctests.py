"""Every example in the library's docstrings runs and prints what it shows."""
import doctest
import importlib
import pkgutil

import pytest

import parallel
import twinkle_metrics


def _modules():
    for pkg in (twinkle_metrics, parallel):
        yield pkg.__name__
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            yield info.name


MODULES = sorted(set(_modules()))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_public_metrics_have_examples():
    """Each public metric shows a call in its docstring, and that example is run above."""
    missing = [name for name in twinkle_metrics.__all__
               if isinstance(getattr(twinkle_metrics, name), type)
               and issubclass(getattr(twinkle_metrics, name), twinkle_metrics.Metric)
               and ">>>" not in (getattr(twinkle_metrics, name).__doc__ or "")]
    assert not missing, f"public metrics without a docstring example: {missing}"
