"""pytest plugin (entry point ``pytest11``: loaded automatically once otb-spec is installed).

Gives your own test suite the checks ``otb-spec verify`` runs:

* ``otb_verify`` — fixture; ``otb_verify(target, kind, convention="verl", **options)`` runs every layer and fails the
  test with the full report (minimal failing case, reproduction snippet) unless the target conforms::

      def test_my_otb_conforms(otb_verify):
          otb_verify(my_trainer.compute_optimal_token_baseline_advantage, "otb")

* ``otb_verify_adapter`` — the same for a port written against the adapter protocol (``otb_spec.adapters``):
  ``otb_verify_adapter("fw-cpu")`` checks every kind the adapter implements;

* ``otb_golden_case`` / ``otb_special_case`` — fixtures parametrized over the golden / special cases of the kind named
  by ``@pytest.mark.otb_kind("otb")`` (default ``"otb"``), for tests that call your function their own way and
  compare with :func:`otb_spec.conformance.assert_matches_reference`::

      @pytest.mark.otb_kind("tir-otb")
      def test_mine_on_golden_cases(otb_golden_case):
          advantages, returns = my_multi_turn_otb(otb_golden_case)          # however your function is called
          assert_matches_reference(otb_golden_case, advantages=advantages, returns=returns)

  For Hypothesis properties, draw ``otb_spec.conformance.generated_cases(kind)`` with ``@given``.

Command-line options: ``--otb-max-examples N`` (default 100), ``--otb-seed S`` (default 0), ``--otb-device``
(default cpu) — the defaults of ``otb_verify``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

__all__ = ["otb_verify", "otb_verify_adapter"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("otb-spec", "OTB conformance (otb-spec)")
    group.addoption("--otb-max-examples", type=int, default=100,
                    help="Hypothesis examples per generated profile for otb_verify (default 100)")
    group.addoption("--otb-seed", type=int, default=0, help="Hypothesis seed for otb_verify (default 0)")
    group.addoption("--otb-device", default="cpu", help="device for otb_verify's inputs (default cpu)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "otb_kind(kind): the kind (otb, tir-otb, loo-otb, tir-loo-otb, sum-pi-squared, "
                                       "fused-token-statistics) whose golden/special cases otb_golden_case and "
                                       "otb_special_case run over")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    wanted = [name for name in ("otb_golden_case", "otb_special_case") if name in metafunc.fixturenames]
    if not wanted:
        return
    from otb_spec.conformance import KINDS, golden_cases, special_cases
    from otb_spec.conformance._checks import _slug

    marker = metafunc.definition.get_closest_marker("otb_kind")
    kind = "otb"
    if marker is not None:
        given = list(marker.args) + ([marker.kwargs["kind"]] if "kind" in marker.kwargs else [])
        if len(given) != 1 or set(marker.kwargs) - {"kind"}:
            raise pytest.UsageError(f"@pytest.mark.otb_kind: expected one kind, as otb_kind('tir-otb') or "
                                    f"otb_kind(kind='tir-otb'), got args {marker.args!r} and keywords "
                                    f"{marker.kwargs!r} (one test per kind: parametrize over several)")
        kind = given[0]
    if kind not in KINDS:
        raise pytest.UsageError(f"@pytest.mark.otb_kind({kind!r}): expected one of {', '.join(KINDS)}")
    for name in wanted:
        cases = golden_cases(kind) if name == "otb_golden_case" else special_cases(kind)
        metafunc.parametrize(name, cases, ids=[f"{_slug(c.name)}-{c.dtype}" for c in cases])


@pytest.fixture
def otb_verify(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``otb_verify(target, kind, *, convention="verl", **options) → Report``; fails the test unless conformant.

    ``target``: a callable or ``"package.module:callable"``; options as :func:`otb_spec.conformance.verify`
    (``device``, ``max_examples``, ``seed``, ``layers``, ``skips``, ``shrink_budget``, ``strict``, ``timeout``,
    ``fail_fast``, ``working_dtype``), ``device``, ``max_examples`` and ``seed`` defaulting to the ``--otb-*``
    command-line options. For your own implementation pass ``strict=True``: it then fails where it only reproduces
    one of verl 0.9.1's documented deviations (e.g. lengths rounded in bfloat16), which are otherwise listed and
    accepted."""
    from otb_spec.conformance import verify

    defaults = {"max_examples": request.config.getoption("--otb-max-examples"),
                "seed": request.config.getoption("--otb-seed"),
                "device": request.config.getoption("--otb-device")}

    def check(target: Any, kind: str, *, convention: str = "verl", **options: Any):
        report = verify(target, kind, convention=convention, **{**defaults, **options})
        if not report.conformant:
            pytest.fail(report.to_text(), pytrace=False)
        return report

    return check


@pytest.fixture
def otb_verify_adapter(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``otb_verify_adapter(adapter, *, kinds=None, **options) → Report``: :func:`otb_spec.conformance.verify_adapter`
    on a registered adapter name or an adapter object; fails the test unless conformant."""
    from otb_spec.conformance import verify_adapter

    defaults = {"max_examples": request.config.getoption("--otb-max-examples"),
                "seed": request.config.getoption("--otb-seed")}

    def check(adapter: Any, **options: Any):
        report = verify_adapter(adapter, **{**defaults, **options})
        if not report.conformant:
            pytest.fail(report.to_text(), pytrace=False)
        return report

    return check
