"""The pytest plugin, as a user's own suite sees it: loaded through its entry point in a fresh pytest process."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("torch")


def test_plugin_is_registered_as_a_pytest11_entry_point():
    names = {entry.name: entry.value for entry in entry_points(group="pytest11")}
    assert names.get("otb_spec") == "otb_spec.pytest_plugin"


def test_otb_verify_passes_conformant_functions_and_adapters_and_fails_a_broken_one(pytester):
    pytester.makepyfile(test_user_suite="""
        import otb_torch
        from otb_spec.conformance.mutants import rho_not_squared

        def test_drop_in(otb_verify):
            report = otb_verify(otb_torch.compute_optimal_token_baseline_advantage, "otb")
            assert report.conformant and report.max_examples == 5

        def test_broken(otb_verify):
            otb_verify(rho_not_squared, "otb", layers=("golden",))

        def test_adapter(otb_verify_adapter):
            report = otb_verify_adapter("numpy-reference", kinds=("otb", "sum-pi-squared"))
            assert report.kinds == ("otb", "sum-pi-squared")
    """)
    result = pytester.runpytest_subprocess("--otb-max-examples", "5", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*FAIL otb/golden/*", "*reproduce:*", "*RESULT: NOT CONFORMANT*"])


def test_golden_and_special_case_fixtures_are_parametrized_by_kind(pytester):
    pytester.makepyfile(test_user_cases="""
        import pytest
        import otb_torch, torch
        from otb_spec.conformance import assert_matches_reference

        def tensor(case, array):
            dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[case.dtype]
            return None if array is None else torch.tensor(array).to(dtype)

        @pytest.mark.otb_kind("tir-otb")
        def test_golden(otb_golden_case):
            case = otb_golden_case
            advantages, returns = otb_torch.compute_multi_turn_optimal_token_baseline_advantage(
                tensor(case, case.rewards), tensor(case, case.response_mask), case.group_ids,
                tensor(case, case.log_probs), tensor(case, case.sum_pi_squared),
                rollout_is_weights=tensor(case, case.is_weights), handle_zero_tail=case.handle_zero_tail,
                epsilon=case.epsilon)
            assert_matches_reference(case, advantages=advantages, returns=returns)

        @pytest.mark.otb_kind("sum-pi-squared")
        def test_special(otb_special_case):
            got = otb_torch.calculate_sum_pi_squared_from_logits(tensor(otb_special_case, otb_special_case.logits))
            assert_matches_reference(otb_special_case, sum_pi_squared=got)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    from otb_spec.conformance import golden_cases, special_cases

    result.assert_outcomes(passed=len(golden_cases("tir-otb")) + len(special_cases("sum-pi-squared")))
    result.stdout.fnmatch_lines(["*test_golden*a-lone-non-empty-member*float32*PASSED*"])


def test_an_unknown_kind_is_a_usage_error(pytester):
    pytester.makepyfile(test_bad_kind="""
        import pytest

        @pytest.mark.otb_kind("not-a-kind")
        def test_bad_kind(otb_golden_case):
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*otb_kind('not-a-kind'): expected one of*"])


def test_plugin_options_are_listed_in_help(pytester):
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*--otb-max-examples*", "*--otb-seed*", "*--otb-device*"])


def test_the_kind_marker_takes_one_kind_by_position_or_keyword(pytester):
    """otb_kind(kind='tir-otb') selects that kind (it fell back to 'otb'); two kinds are a usage error (the second was
    dropped)."""
    pytester.makepyfile(test_marker="""
        import pytest

        @pytest.mark.otb_kind(kind="tir-otb")
        def test_by_keyword(otb_golden_case):
            assert otb_golden_case.kind == "tir-otb"
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    from otb_spec.conformance import golden_cases

    result.assert_outcomes(passed=len(golden_cases("tir-otb")))
    pytester.makepyfile(test_marker="""
        import pytest

        @pytest.mark.otb_kind("otb", "tir-otb")
        def test_two_kinds(otb_golden_case):
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*otb_kind: expected one kind*"])
