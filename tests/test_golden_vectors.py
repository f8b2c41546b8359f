"""Golden vectors: the files follow their schema, hold the reference's outputs and tolerances, round-trip, can be used
without otb-spec, and the copy committed under vectors/ is what the current reference produces."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from otb_spec.cli import main
from otb_spec.conformance import golden_cases, special_cases
from otb_spec.conformance.vectors import VECTOR_KINDS, read_vector, vector_json_schema, write_vectors

pytestmark = pytest.mark.bitexact  # bit-for-bit assertions: .ci/run repeats them at baseline SIMD, one thread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "vectors")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vectors")
    manifest = write_vectors(str(directory), generated=2, special=False, seed=0)
    return str(directory), manifest


def _holds(got, expected, rtol, atol) -> bool:
    """The rule stated in every vector, in plain NumPy."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    within = np.abs(got - expected) <= atol + rtol * np.abs(expected)
    finite_where_needed = np.isfinite(got) | ~np.isfinite(expected)
    return bool(np.all((within | np.isinf(atol)) & finite_where_needed))


def test_manifest_lists_every_file_and_every_kind(written):
    directory, manifest = written
    assert manifest["schema"] == "otb-spec-vectors" and manifest["schema_version"] == 1
    assert {entry["kind"] for entry in manifest["cases"]} == set(VECTOR_KINDS)     # every kind but the fused one
    assert {entry["source"] for entry in manifest["cases"]} == {"golden", "generated"}
    for entry in manifest["cases"]:
        assert os.path.isfile(os.path.join(directory, entry["json"]))
        assert os.path.isfile(os.path.join(directory, entry["npz"]))
    golden = sum(len(golden_cases(kind)) for kind in VECTOR_KINDS)
    assert sum(entry["source"] == "golden" for entry in manifest["cases"]) == golden
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as handle:
        assert json.load(handle) == manifest


def test_every_vector_follows_the_json_schema(written):
    jsonschema = pytest.importorskip("jsonschema")
    directory, manifest = written
    validator = jsonschema.Draft202012Validator(vector_json_schema())
    validator.check_schema(vector_json_schema())
    for entry in manifest["cases"]:
        with open(os.path.join(directory, entry["json"]), encoding="utf-8") as handle:
            validator.validate(json.load(handle))
    with open(os.path.join(directory, "schema.json"), encoding="utf-8") as handle:
        assert json.load(handle) == vector_json_schema()


def test_vectors_hold_the_reference_outputs_and_round_trip(written):
    directory, manifest = written
    for entry in manifest["cases"]:
        case, expected, tolerances = read_vector(os.path.join(directory, entry["json"]))
        assert case.kind == entry["kind"] and case.dtype == entry["dtype"]
        reference = case.expected()
        for name, value in expected.items():
            rtol, atol = tolerances[name]
            assert _holds(reference[name], value, rtol, atol), (entry["id"], name)
            np.testing.assert_array_equal(atol, np.broadcast_to(case.tolerances()[name].atol, atol.shape))
        with np.load(os.path.join(directory, entry["npz"])) as arrays:          # no pickle needed
            for name, value in expected.items():
                np.testing.assert_array_equal(arrays[f"expected_{name}"], value)
            if case.kind != "sum-pi-squared":
                np.testing.assert_array_equal(arrays["rewards"], case.rewards)
                labels = arrays["group_labels"]
                ids = [repr(i) for i in case.group_ids.tolist()]
                assert all((labels[a] == labels[b]) == (ids[a] == ids[b])
                           for a in range(len(ids)) for b in range(len(ids)))


def test_non_finite_numbers_are_spelled_out(written):
    directory, manifest = written
    entry = next(e for e in manifest["cases"] if "excluded" in e["name"] and e["kind"] == "sum-pi-squared")
    with open(os.path.join(directory, entry["json"]), encoding="utf-8") as handle:
        text = handle.read()
    assert '"-inf"' in text and "Infinity" not in text and "NaN" not in text


def test_a_port_can_check_itself_with_the_files_alone(written):
    """What a port in another language does: read JSON, run its function, apply the stated rule."""
    torch = pytest.importorskip("torch")
    import otb_torch

    directory, manifest = written
    checked = 0
    for entry in manifest["cases"]:
        if entry["kind"] != "otb":
            continue
        with open(os.path.join(directory, entry["json"]), encoding="utf-8") as handle:
            data = json.load(handle)
        special = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}
        decode = lambda v: np.array([[special[x] if isinstance(x, str) else x for x in row]  # noqa: E731
                                     for row in v], dtype=np.float64)
        dtype = torch.float64 if data["dtype"] == "float64" else torch.float32
        t = lambda v: None if v is None else torch.tensor(decode(v), dtype=dtype)  # noqa: E731
        inputs = data["inputs"]
        advantages, returns = otb_torch.compute_optimal_token_baseline_advantage(
            t(inputs["rewards"]), t(inputs["response_mask"]), np.array(inputs["group_ids"], dtype=object),
            t(inputs["log_probs"]), t(inputs["sum_pi_squared"]), rollout_is_weights=t(inputs["is_weights"]),
            **data["options"])
        for name, got in (("advantages", advantages), ("returns", returns)):
            tolerance = data["tolerance"][name]
            atol = decode(tolerance["atol"]) if isinstance(tolerance["atol"], list) else tolerance["atol"]
            assert _holds(got.double().numpy(), decode(data["expected"][name]), tolerance["rtol"], atol), entry["id"]
        checked += 1
    assert checked > 20


def test_committed_vectors_match_the_current_reference(tmp_path):
    """vectors/ in the repository (golden and a generated sample): inputs reproduce exactly, outputs within the
    stated tolerance. Regenerate with the command in vectors/README.md when the reference changes on purpose."""
    with open(os.path.join(COMMITTED, "manifest.json"), encoding="utf-8") as handle:
        manifest = json.load(handle)
    fresh = write_vectors(str(tmp_path), generated=0, special=False)
    fresh_golden = {entry["id"]: entry for entry in fresh["cases"]}
    for entry in manifest["cases"]:
        case, expected, tolerances = read_vector(os.path.join(COMMITTED, entry["json"]))
        reference = case.expected()
        with np.load(os.path.join(COMMITTED, entry["npz"])) as arrays:          # the .npz twin is committed too
            for name, value in expected.items():
                assert _holds(reference[name], value, *tolerances[name]), (entry["id"], name)
                np.testing.assert_array_equal(arrays[f"expected_{name}"], value)
        if entry["source"] == "golden":
            regenerated, _, _ = read_vector(os.path.join(str(tmp_path), fresh_golden[entry["id"]]["json"]))
            for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights", "logits"):
                a, b = getattr(case, name), getattr(regenerated, name)
                assert (a is None) == (b is None) and (a is None or np.array_equal(a, b, equal_nan=True))
    assert {e["id"] for e in manifest["cases"] if e["source"] == "golden"} == set(fresh_golden)


def test_cli_vectors_writes_a_directory(tmp_path):
    status = main(["vectors", "--out", str(tmp_path / "v"), "--kind", "sum-pi-squared", "--generated", "1",
                   "--no-special"])
    assert status == 0
    files = glob.glob(str(tmp_path / "v" / "sum-pi-squared" / "*.json"))
    assert len(files) == len(golden_cases("sum-pi-squared")) + 3
    assert main(["vectors", "--out", str(tmp_path / "w"), "--generated", "-1"]) == 2
    keep = tmp_path / "v" / "sum-pi-squared" / "mine.txt"                   # not ours: left alone
    keep.write_text("notes")
    assert main(["vectors", "--out", str(tmp_path / "v"), "--kind", "sum-pi-squared", "--generated", "0",
                 "--no-special"]) == 0                                      # a second run, fewer cases
    files = glob.glob(str(tmp_path / "v" / "sum-pi-squared" / "*.json"))
    assert len(files) == len(golden_cases("sum-pi-squared")) and keep.exists()   # no stale case of the first run


@pytest.mark.slow
def test_special_vectors_are_written(tmp_path):
    manifest = write_vectors(str(tmp_path), kinds=("otb", "sum-pi-squared"), generated=0, special=True)
    special = [entry for entry in manifest["cases"] if entry["source"] == "special"]
    assert len(special) == len(special_cases("otb")) + len(special_cases("sum-pi-squared"))
    for entry in special:
        case, expected, tolerances = read_vector(os.path.join(str(tmp_path), entry["json"]))
        for name, value in expected.items():
            assert _holds(case.expected()[name], value, *tolerances[name])
