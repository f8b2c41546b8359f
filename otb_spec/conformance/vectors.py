"""Golden vectors: conformance cases as language-neutral files, for ports that cannot run Python.

``write_vectors(directory)`` (``otb-spec vectors --out DIR``) writes, for every case:

* ``<kind>/<source>-<NNN>-<slug>.<dtype>.json`` — inputs, options, the reference's outputs and the per-element
  tolerance (schema ``otb-spec-vector``, version 1; ``schema.json`` in the same directory is its JSON Schema);
* the same arrays in a ``.npz`` next to it (float64 arrays, group ids as a Unicode array and as integer labels —
  loadable without pickle);

plus ``manifest.json`` listing every case. docs/vectors.md documents the format; :func:`read_vector` reads a case
back as a :class:`~otb_spec.conformance.Case` with its expected outputs and tolerances.

A port passes a vector when, for each output, ``|got − expected| ≤ atol + rtol·|expected|`` holds elementwise (``atol``
``"inf"`` marks an ill-conditioned element that is not checked) and ``got`` is finite wherever ``expected`` is.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import numpy as np

from otb_spec._version import __version__
from otb_spec.conformance._cases import (GENERATED_PROFILES, KINDS, Case, compute_dtype_for, generated_cases,
                                         golden_cases, reference_options, special_cases)
from otb_spec.conformance._checks import _fingerprint, _slug

__all__ = ["VECTOR_SCHEMA", "VECTOR_SCHEMA_VERSION", "VECTOR_KINDS", "write_vectors", "read_vector",
           "vector_json_schema"]

VECTOR_SCHEMA = "otb-spec-vector"
VECTOR_SCHEMA_VERSION = 1
# The kinds with vectors. fused-token-statistics has none: its inputs (hidden states, an LM head) and its gradient
# outputs are outside schema version 1, and a port in another language can run it through its own autodiff only.
VECTOR_KINDS = tuple(kind for kind in KINDS if kind != "fused-token-statistics")
_INPUTS = {"otb": ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights"),
           "sum-pi-squared": ("logits",)}
_FUNCTIONS = {
    "otb": "single-turn OTB with verl 0.9.1 semantics (compute_optimal_token_baseline_advantage; "
           "otb_spec.optimal_token_baseline)",
    "tir-otb": "multi-turn OTB with verl 0.9.1 semantics (compute_multi_turn_optimal_token_baseline_advantage; "
               "otb_spec.multi_turn_optimal_token_baseline)",
    "loo-otb": "leave-one-out OTB, position alignment (otb_spec.leave_one_out_token_baseline)",
    "tir-loo-otb": "multi-turn leave-one-out OTB, valid-token alignment (otb_spec.leave_one_out_token_baseline with "
                   "align='valid_token')",
    "sum-pi-squared": "Σπ² = Σ_v softmax(z)_v² over the last axis (verl calculate_sum_pi_squared_from_logits; "
                      "otb_spec.sum_pi_squared)",
}


def _encode(array: np.ndarray | None) -> Any:
    """Nested lists of floats; non-finite numbers as the strings "inf", "-inf", "nan" (JSON has none)."""
    if array is None:
        return None
    values = np.asarray(array, dtype=np.float64)
    if np.isfinite(values).all():
        return values.tolist()
    objects = values.astype(object)
    objects[np.isposinf(values)] = "inf"
    objects[np.isneginf(values)] = "-inf"
    objects[np.isnan(values)] = "nan"
    return objects.tolist()


def _decode(values: Any) -> np.ndarray | None:
    if values is None:
        return None
    mapping = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}

    def convert(item: Any) -> Any:
        if isinstance(item, list):
            return [convert(x) for x in item]
        return mapping[item] if isinstance(item, str) else float(item)

    return np.asarray(convert(values), dtype=np.float64)


def _encode_ids(ids: np.ndarray) -> list:
    """Group ids as JSON strings or integers (others by their repr; only equality of ids matters)."""
    encoded = []
    for value in np.asarray(ids, dtype=object).tolist():
        if isinstance(value, (bool, np.bool_)):
            encoded.append(repr(value))
        elif isinstance(value, (int, np.integer)):
            encoded.append(int(value))
        elif isinstance(value, str):
            encoded.append(value)
        else:
            encoded.append(repr(value))
    return encoded


def _labels(ids: np.ndarray) -> np.ndarray:
    first: dict = {}
    return np.array([first.setdefault(repr(v), len(first)) for v in np.asarray(ids, dtype=object).tolist()],
                    dtype=np.int64)


def _tolerance_json(tolerance) -> dict:
    return {"rtol": _encode(tolerance.rtol) if np.ndim(tolerance.rtol) else float(tolerance.rtol),
            "atol": _encode(np.broadcast_to(tolerance.atol, np.shape(tolerance.atol))) if np.ndim(tolerance.atol)
            else float(tolerance.atol),
            "reason": tolerance.reason}


def _case_json(case: Case, case_id: str, source: str) -> dict:
    compute = compute_dtype_for(case.dtype)
    inputs_kind = "sum-pi-squared" if case.kind == "sum-pi-squared" else "otb"
    inputs = {}
    for name in _INPUTS[inputs_kind]:
        value = getattr(case, name)
        inputs[name] = _encode_ids(value) if name == "group_ids" else _encode(value)
    options = {} if case.kind == "sum-pi-squared" else {"epsilon": case.epsilon}
    if case.kind in ("otb", "tir-otb"):
        options["handle_zero_tail"] = case.handle_zero_tail
    options.update(reference_options(case.kind))            # tir-loo-otb: align = "valid_token"
    tolerances = case.tolerances(output_dtype=case.dtype, compute_dtype=compute)
    return {
        "schema": VECTOR_SCHEMA,
        "schema_version": VECTOR_SCHEMA_VERSION,
        "otb_spec_version": __version__,
        "id": case_id,
        "kind": case.kind,
        "function": _FUNCTIONS[case.kind],
        "source": source,
        "name": case.name,
        "note": case.note,
        "dtype": case.dtype,
        "compute_dtype": compute,
        "options": options,
        "inputs": inputs,
        "expected": {name: _encode(value) for name, value in case.expected().items()},
        "tolerance": {name: _tolerance_json(tolerance) for name, tolerance in tolerances.items()},
        "rule": "|got − expected| ≤ atol + rtol·|expected| elementwise; atol \"inf\": not checked (ill-conditioned);"
                " got must be finite wherever expected is",
    }


def _npz_arrays(case: Case) -> dict:
    arrays: dict[str, np.ndarray] = {}
    inputs_kind = "sum-pi-squared" if case.kind == "sum-pi-squared" else "otb"
    for name in _INPUTS[inputs_kind]:
        value = getattr(case, name)
        if value is None:
            continue
        if name == "group_ids":
            arrays["group_ids"] = np.array([str(v) for v in _encode_ids(value)])
            arrays["group_labels"] = _labels(value)
        else:
            arrays[name] = np.asarray(value, dtype=np.float64)
    for name, value in case.expected().items():
        arrays[f"expected_{name}"] = np.asarray(value, dtype=np.float64)
    for name, tolerance in case.tolerances(output_dtype=case.dtype).items():
        shape = np.shape(case.expected()[name])
        arrays[f"atol_{name}"] = np.broadcast_to(np.asarray(tolerance.atol, dtype=np.float64), shape).copy()
        arrays[f"rtol_{name}"] = np.broadcast_to(np.asarray(tolerance.rtol, dtype=np.float64), shape).copy()
    return arrays


def _sample_generated(kind: str, profile: str, count: int, seed: int) -> list[Case]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    cases: list[Case] = []
    seen: set[str] = set()

    @hypothesis_seed(seed)
    @settings(max_examples=max(count * 8, 1), database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(generated_cases(kind, profile=profile))
    def collect(case: Case) -> None:
        key = _fingerprint(case)
        if key not in seen:
            seen.add(key)
            cases.append(replace(case, name=f"{profile} profile"))

    collect()
    # Hypothesis starts from its simplest draws (T = 1, no padding): keep the `count` richest, in drawing order
    richest = sorted(range(len(cases)), key=lambda i: _richness(cases[i]), reverse=True)[:count]
    return [cases[i] for i in sorted(richest)]


def _richness(case: Case) -> tuple:
    """How much of the behaviour a case exercises, for choosing the committed sample: masked positions inside the
    rows (holes, padding), more than one position and group, then size."""
    if case.kind == "sum-pi-squared":
        return (int(case.logits.shape[-1] > 2), int(np.isneginf(case.logits).any()), case.logits.size)
    mask = np.asarray(case.response_mask)
    groups = len({repr(g) for g in np.asarray(case.group_ids, dtype=object).tolist()})
    return (int(mask.shape[1] > 1), int((mask == 0).any()), int(groups > 1), int(case.is_weights is not None),
            mask.size)


def _remove_previous(directory: str) -> None:
    """Remove the case files an earlier run's manifest in ``directory`` lists (only those: our own outputs), so that
    the folder holds exactly the cases of the new manifest."""
    try:
        with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as handle:
            previous = json.load(handle)
    except (OSError, ValueError):
        return
    if not isinstance(previous, dict) or previous.get("schema") != "otb-spec-vectors":
        return
    root = os.path.realpath(directory)
    for entry in previous.get("cases", []):
        for key in ("json", "npz"):
            name = entry.get(key) if isinstance(entry, dict) else None
            path = os.path.realpath(os.path.join(directory, name)) if isinstance(name, str) else None
            if path is not None and path.startswith(root + os.sep) and os.path.isfile(path):
                os.remove(path)


def write_vectors(directory: str, *, kinds: tuple[str, ...] = VECTOR_KINDS, generated: int = 10, special: bool = True,
                  seed: int = 0) -> dict:
    """Write golden (float64, float32), ``generated`` Hypothesis cases per profile (seeded) and, with ``special``,
    the special cases of every kind in ``kinds`` to ``directory``, first removing the case files an earlier run's
    manifest there lists. Returns the manifest (also written as ``manifest.json``)."""
    unknown = [kind for kind in kinds if kind not in VECTOR_KINDS]
    if unknown:
        raise ValueError(f"kinds: unknown {', '.join(unknown)}; expected some of {', '.join(VECTOR_KINDS)} (the "
                         "fused-token-statistics kind has no vectors)")
    if not isinstance(generated, int) or generated < 0:
        raise ValueError(f"generated: expected a non-negative integer, got {generated!r}")
    os.makedirs(directory, exist_ok=True)
    _remove_previous(directory)
    entries = []
    for kind in kinds:
        batches = [("golden", golden_cases(kind))]
        if generated:
            batches.append(("generated", [case for profile in GENERATED_PROFILES[kind]
                                          for case in _sample_generated(kind, profile, generated, seed)]))
        if special:
            batches.append(("special", special_cases(kind)))
        folder = os.path.join(directory, kind)
        os.makedirs(folder, exist_ok=True)
        for source, cases in batches:
            for number, case in enumerate(cases, 1):
                stem = f"{source}-{number:03d}-{_slug(case.name)[:48]}.{case.dtype}"
                case_id = f"{kind}/{stem}"
                with open(os.path.join(folder, stem + ".json"), "w", encoding="utf-8") as handle:
                    json.dump(_case_json(case, case_id, source), handle, ensure_ascii=False, separators=(",", ":"))
                    handle.write("\n")
                np.savez_compressed(os.path.join(folder, stem + ".npz"), **_npz_arrays(case))
                entries.append({"id": case_id, "kind": kind, "source": source, "name": case.name,
                                "dtype": case.dtype, "json": f"{kind}/{stem}.json", "npz": f"{kind}/{stem}.npz"})
    manifest = {"schema": "otb-spec-vectors", "schema_version": VECTOR_SCHEMA_VERSION,
                "otb_spec_version": __version__, "seed": seed, "generated_per_profile": generated,
                "cases": entries}
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, ensure_ascii=False)
        handle.write("\n")
    with open(os.path.join(directory, "schema.json"), "w", encoding="utf-8") as handle:
        json.dump(vector_json_schema(), handle, indent=1, ensure_ascii=False)
        handle.write("\n")
    return manifest


def read_vector(path: str) -> tuple[Case, dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Read a vector's JSON file: ``(case, expected outputs, {output: (rtol, atol)})`` as NumPy arrays."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if data.get("schema") != VECTOR_SCHEMA or data.get("schema_version") != VECTOR_SCHEMA_VERSION:
        raise ValueError(f"path: {path} is not an {VECTOR_SCHEMA} v{VECTOR_SCHEMA_VERSION} file")
    inputs = data["inputs"]
    arrays = {name: (np.array(value, dtype=object) if name == "group_ids" else _decode(value))
              for name, value in inputs.items()}
    options = data["options"]
    # the values are exact in the vector's dtype; with_dtype puts them in the arrays the verifier uses for it
    case = Case(data["kind"], data["name"], "float64", note=data.get("note", ""),
                handle_zero_tail=options.get("handle_zero_tail", True), epsilon=options.get("epsilon", 1e-8),
                **arrays).with_dtype(data["dtype"])
    expected = {name: _decode(value) for name, value in data["expected"].items()}
    tolerances = {}
    for name, tolerance in data["tolerance"].items():
        shape = expected[name].shape
        rtol = tolerance["rtol"]
        atol = tolerance["atol"]
        tolerances[name] = (np.broadcast_to(_decode(rtol) if isinstance(rtol, list) else float(rtol), shape),
                            np.broadcast_to(_decode(atol) if isinstance(atol, list) else
                                            _decode([atol])[0], shape))
    return case, expected, tolerances


def vector_json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a vector file."""
    number = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}

    array = {"type": "array", "items": {"oneOf": [number, {"$ref": "#/$defs/array"}]}}   # nested lists of numbers
    tolerance = {"type": "object", "required": ["rtol", "atol", "reason"],
                 "properties": {"rtol": {"oneOf": [number, {"$ref": "#/$defs/array"}]},
                                "atol": {"oneOf": [number, {"$ref": "#/$defs/array"}]},
                                "reason": {"type": "string"}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://otb-spec/schemas/{VECTOR_SCHEMA}-v{VECTOR_SCHEMA_VERSION}.json",
        "title": "otb-spec conformance vector",
        "type": "object",
        "required": ["schema", "schema_version", "id", "kind", "function", "source", "name", "dtype",
                     "compute_dtype", "options", "inputs", "expected", "tolerance", "rule"],
        "properties": {
            "schema": {"const": VECTOR_SCHEMA},
            "schema_version": {"const": VECTOR_SCHEMA_VERSION},
            "otb_spec_version": {"type": "string"},
            "id": {"type": "string"},
            "kind": {"enum": list(VECTOR_KINDS)},
            "function": {"type": "string"},
            "source": {"enum": ["golden", "generated", "special"]},
            "name": {"type": "string"},
            "note": {"type": "string"},
            "dtype": {"enum": ["float64", "float32", "bfloat16", "float16"]},
            "compute_dtype": {"enum": ["float64", "float32"]},
            "options": {"type": "object", "properties": {"epsilon": {"type": "number", "minimum": 0},
                                                         "handle_zero_tail": {"type": "boolean"},
                                                         "align": {"enum": ["valid_token"]}},
                        "additionalProperties": False},
            "inputs": {"type": "object",
                       "properties": {"rewards": {"$ref": "#/$defs/array"},
                                      "response_mask": {"$ref": "#/$defs/array"},
                                      "group_ids": {"type": "array", "items": {"type": ["string", "integer"]}},
                                      "log_probs": {"$ref": "#/$defs/array"},
                                      "sum_pi_squared": {"$ref": "#/$defs/array"},
                                      "is_weights": {"oneOf": [{"type": "null"}, {"$ref": "#/$defs/array"}]},
                                      "logits": {"$ref": "#/$defs/array"}},
                       "additionalProperties": False},
            "expected": {"type": "object", "additionalProperties": {"$ref": "#/$defs/array"}},
            "tolerance": {"type": "object", "additionalProperties": tolerance},
            "rule": {"type": "string"},
        },
        "$defs": {"array": array},
    }
