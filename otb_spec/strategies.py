"""Public Hypothesis strategies for property-testing OTB implementations (yours or ours).

    from hypothesis import given
    from otb_spec import strategies as otb_st

    @given(otb_st.rollout_batches(max_groups=3, padding="right", holes=False))
    def test_my_otb_matches_reference(batch):
        ...

All options are keyword-only and validated when the strategy is built (a bad option raises
:class:`hypothesis.errors.InvalidArgument` at once, naming it). The strategies hold no global state; under
``derandomize=True`` they draw the same examples every run. Arrays of more than ``4096`` elements are filled from a
NumPy generator seeded by Hypothesis (drawing each element through Hypothesis would be too slow); smaller arrays are
drawn element by element, so Hypothesis can shrink them value by value — except rewards, always seeded (element-wise
draws made about half the batches reward-free: Hypothesis's simplest value, 0, fills the end of many examples). Likewise
per-group and per-row choices (group sizes and ids, the batch order, each row's length, padding side and holes) are
drawn one by one for up to ``64`` groups and rows, and from a seeded generator above that, so trainer-sized batches
(``min_groups=256, min_group_size=8``, thousands of positions) draw without tripping Hypothesis's size limits.

Strategies:

* :func:`rollout_batches` — :class:`otb_spec.RolloutBatch` with rewards, masks (right/left padding, tool-output holes,
  empty rows), shuffled non-contiguous groups with int/str/uuid/object ids, singleton groups, IS weights, and
  log-probs and Σπ² consistent with a policy (optionally with the logits they come from);
* :func:`group_ids` — [B] ids for given group sizes, shuffled;
* :func:`logits` — logit arrays, including extreme magnitudes and −inf entries;
* :func:`token_statistics` — (log π(y), Σπ²) pairs consistent with some policy, without logits;
* :func:`lm_head_inputs` — hidden states, an LM head, sampled tokens and a temperature, for fused-linear kernels
  (:func:`otb_spec.token_statistics_from_hidden`), from flat to sharply peaked softmaxes;
* :func:`toy_policies` and :func:`toy_tasks` — small enumerable policies (tabular or shared parameters) and tasks with
  random rewards, for exact checks of gradient identities.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, NamedTuple, Sequence

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.extra import numpy as hnp

from otb_spec import _portable as portable
from otb_spec.estimators import RolloutBatch
from otb_spec.proxy import sum_pi_squared as _sum_pi_squared
from otb_spec.proxy import token_log_probs as _token_log_probs
from otb_spec.toy import EnumerablePolicy, EnumerableTask

__all__ = ["rollout_batches", "group_ids", "logits", "token_statistics", "lm_head_inputs", "LMHeadCase", "toy_policies",
           "toy_tasks"]

_PADDINGS = ("right", "left", "any")
_ID_KINDS = ("int", "str", "uuid", "object", "trainer", "any")
_CONCRETE_ID_KINDS = ("int", "str", "uuid", "object")
_REWARD_STYLES = ("terminal", "dense", "sparse", "any")
_FILLS = ("junk", "trainer", "zero")
_FLOAT_DTYPES = ("float64", "float32")
_ELEMENTWISE_LIMIT = 4096
_ROWWISE_LIMIT = 64


# ----------------------------------------------------------------------------------------------------------------------
# Option checking


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{name}={value!r}: expected an integer")
    if value < minimum:
        raise InvalidArgument(f"{name}={value!r}: must be ≥ {minimum}")
    return int(value)


def _check_sequence(name: str, value: Any, what: str) -> list:
    """A list of the items of a sequence option (a tuple, a list or a 1-D array), or InvalidArgument naming it."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)) or \
            isinstance(value, np.ndarray) and value.ndim != 1:
        raise InvalidArgument(f"{name}={value!r}: expected a sequence of {what} (a tuple or a list)")
    return list(value)


def _check_range(low_name: str, low: int, high_name: str, high: int) -> None:
    if low > high:
        raise InvalidArgument(f"{low_name}={low} exceeds {high_name}={high}")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise InvalidArgument(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}")
    return str(value)


def _check_optional_bool(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r}: expected True, False or None (= sometimes)")
    return value


def _check_float(name: str, value: Any, minimum: float, *, inclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidArgument(f"{name}={value!r}: expected a number")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (not inclusive and value == minimum):
        raise InvalidArgument(f"{name}={value!r}: must be finite and {'≥' if inclusive else '>'} {minimum}")
    return value


def _check_dtype(value: Any) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as exc:
        raise InvalidArgument(f"dtype={value!r}: not a NumPy dtype") from exc
    if dtype.name not in _FLOAT_DTYPES:
        raise InvalidArgument(f"dtype={value!r}: expected float32 or float64")
    return dtype


# ----------------------------------------------------------------------------------------------------------------------
# Value arrays


def _values(draw: Any, shape: tuple[int, ...], low: float, high: float, label: str) -> np.ndarray:
    """float64 array of ``shape`` with values in [low, high]: element-wise Hypothesis draws when small, else seeded
    (bit-portable draws: the same seed gives the same values on every machine)."""
    size = int(np.prod(shape))
    if size <= _ELEMENTWISE_LIMIT:
        elements = st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False)
        return draw(hnp.arrays(np.float64, shape, elements=elements), label=label)
    return _seeded(draw, label).uniform(low, high, shape)


def _seeded(draw: Any, label: str) -> portable.PortableRandom:
    """A bit-portable generator seeded by one Hypothesis draw (for draws too many to make one by one)."""
    return portable.PortableRandom(draw(st.integers(0, 2**32 - 1), label=f"{label} (seed)"))


def _row_integers(draw: Any, count: int, low: int, high: int, label: str) -> list[int]:
    """``count`` integers in [low, high] (inclusive): one Hypothesis draw each up to ``_ROWWISE_LIMIT``, else
    seeded."""
    if count <= _ROWWISE_LIMIT:
        return draw(st.lists(st.integers(low, high), min_size=count, max_size=count), label=label)
    return _seeded(draw, label).integers(low, high + 1, count).tolist()


# ----------------------------------------------------------------------------------------------------------------------
# group ids


def group_ids(sizes: Sequence[int], *, kind: str = "any", shuffle: bool = True) -> st.SearchStrategy[np.ndarray]:
    """[Σ sizes] group ids, ``sizes[g]`` members with the g-th id, shuffled unless ``shuffle=False``.

    Args:
      sizes: members per group (each ≥ 1).
      kind: ``"int"`` (non-negative int64: sparse small ints; or ids that only int64 tells apart — neighbours
        above 2²⁴, equal in float32, or pairs 2³² apart, equal in int32; all below 2⁵³, exact in JSON and float64),
        ``"str"`` (``"prompt-17"``), ``"uuid"`` (uuid4-format strings),
        ``"object"`` (object array mixing ints, strings and tuples — not orderable, so implementations must hash),
        ``"trainer"`` (one of int, str, uuid: what trainers use — verl's uids are strings), or ``"any"``.
      shuffle: permute the batch so groups are not contiguous.

    One draw (``.example()`` is random: yours will differ): ``group_ids([2, 1], kind="str").example()`` →
    ``array(['prompt-9', 'prompt-0', 'prompt-9'], ...)``.
    """
    sizes = [_check_int(f"sizes[{index}]", size, 1)
             for index, size in enumerate(_check_sequence("sizes", sizes, "group sizes, e.g. [2, 1]"))]
    if not sizes:
        raise InvalidArgument("sizes: need at least one group")
    kind = _check_choice("kind", kind, _ID_KINDS)
    if not isinstance(shuffle, bool):
        raise InvalidArgument(f"shuffle={shuffle!r}: expected True or False")
    return _group_ids(sizes, kind, shuffle)


def _int64_only_codes(draw: Any, codes: list[int]) -> list[int]:
    """``codes`` as they are, or distinct ids that a port narrowing them loses: neighbours just above 2²⁴ (float32
    holds only every other integer there) or the previous group's code + 2³² (the same int32). Below 2⁵³."""
    width = draw(st.sampled_from(("small", "float32 neighbours", "int32 aliases")), label="group id width")
    if width == "float32 neighbours":
        return [2**24 + position for position in range(len(codes))]
    if width == "int32 aliases":
        return [codes[position - position % 2] + position % 2 * 2**32 for position in range(len(codes))]
    return codes


def _group_codes(draw: Any, n_groups: int) -> list[int]:
    """``n_groups`` distinct integers in [0, max(10⁶, 2·n_groups)]: one by one up to ``_ROWWISE_LIMIT`` groups, else
    seeded (draws in order of first appearance, repeats dropped, until there are enough)."""
    universe = max(10**6, 2 * n_groups)
    if n_groups <= _ROWWISE_LIMIT:
        return draw(st.lists(st.integers(0, universe), min_size=n_groups, max_size=n_groups, unique=True),
                    label="group codes")
    generator = _seeded(draw, "group codes")
    codes: list[int] = []
    seen: set[int] = set()
    while len(codes) < n_groups:
        for code in generator.integers(0, universe + 1, 2 * n_groups).tolist():
            if code not in seen and len(codes) < n_groups:
                seen.add(code)
                codes.append(code)
    return codes


@st.composite
def _group_ids(draw: Any, sizes: list[int], kind: str, shuffle: bool) -> np.ndarray:
    n_groups = len(sizes)
    if kind == "any":
        kind = draw(st.sampled_from(_CONCRETE_ID_KINDS), label="group id kind")
    elif kind == "trainer":
        kind = draw(st.sampled_from(_CONCRETE_ID_KINDS[:3]), label="group id kind")
    codes = _group_codes(draw, n_groups)
    if kind == "int":
        names: list[Any] = _int64_only_codes(draw, codes)
    elif kind == "str":
        names = [f"prompt-{code}" for code in codes]
    elif kind == "uuid":
        # the code in the top 48 bits, clear of the version and variant bits (which version=4 overwrites: a code in
        # bits 64–127 lost its bits 12–15 there, and codes 2¹² apart became one uuid)
        names = [str(uuid.UUID(int=code << 80, version=4)) for code in codes]
    else:
        makers = [lambda c: c, lambda c: f"p{c}", lambda c: ("prompt", c)]
        names = [makers[position % 3](code) for position, code in enumerate(codes)]
    ids = [names[g] for g, size in enumerate(sizes) for _ in range(size)]
    order = list(range(len(ids)))
    if shuffle and len(ids) <= _ROWWISE_LIMIT:
        order = draw(st.permutations(order), label="batch order")
    elif shuffle:
        order = _seeded(draw, "batch order").permutation(len(ids)).tolist()
    array = np.empty(len(ids), dtype=object)
    array[:] = [ids[position] for position in order]
    if kind == "int":
        return array.astype(np.int64)
    if kind in ("str", "uuid"):
        return array.astype(str)
    return array


# ----------------------------------------------------------------------------------------------------------------------
# token statistics and logits


def token_statistics(shape: tuple[int, ...], *, min_vocab_size: int = 2,
                     max_vocab_size: int = 2**17) -> st.SearchStrategy[tuple[np.ndarray, np.ndarray]]:
    """(log π(y), Σπ²) arrays of ``shape`` consistent with some policy over V ∈ [min_vocab_size, max_vocab_size].

    For each position π = π(y) ∈ (0, 1] and Σπ² ∈ [π² + (1 − π)²/(V − 1), π² + (1 − π)²] — every value in that
    interval is Σ_v π_v² of some distribution that gives y probability π (spread the remaining mass 1 − π evenly
    over V − 1 tokens for the lower end, onto one token for the upper end, and continuously in between).
    π ranges from e^{−20} ≈ 2e-9 to 0.999 and, in some draws, exactly 1 at some positions (certain tokens, w = 0).
    Shrinks towards π = ½ — an ordinary token — not towards the degenerate π = 1.
    """
    shape = tuple(_check_int(f"shape[{index}]", n, 0)
                  for index, n in enumerate(_check_sequence("shape", shape, "sizes, e.g. (4, 6)")))
    low = _check_int("min_vocab_size", min_vocab_size, 2)
    high = _check_int("max_vocab_size", max_vocab_size, 2)
    _check_range("min_vocab_size", low, "max_vocab_size", high)
    return _token_statistics(shape, low, high)


@st.composite
def _token_statistics(draw: Any, shape: tuple[int, ...], low_vocab: int, high_vocab: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    vocab = draw(st.integers(low_vocab, high_vocab), label="vocab size")
    # −log π = log 2 · e^{κt}, t ∈ [−1, 1]: the simplest draw t = 0 (what Hypothesis shrinks towards) is π = ½, an
    # ordinary token with non-zero energy; t = 1 gives π = e^{−20} ≈ 2e-9, t = −1 gives π = e^{−0.001} ≈ 0.999
    position = _values(draw, shape, -1.0, 1.0, "log π position")
    # (exp and log from otb_spec._portable: the same draw gives the same bits on every machine)
    log2 = float(portable.log(2.0))
    rate = np.where(position >= 0, portable.log(20.0 / log2), portable.log(log2 / 1e-3))
    log_pi = -log2 * portable.exp(position * rate)
    if draw(st.booleans(), label="some certain tokens"):          # π = 1 exactly: w = 0, the zero-energy corner
        log_pi = np.where(_values(draw, shape, 0.0, 1.0, "certain token draws") < 0.3, 0.0, log_pi)
    pi = portable.exp(log_pi)
    spread = _values(draw, shape, 0.0, 1.0, "Σπ² position in its interval")
    rest = np.square(1.0 - pi)
    spp = np.square(pi) + rest * (1.0 / (vocab - 1) + spread * (1.0 - 1.0 / (vocab - 1)))
    return log_pi, np.minimum(spp, 1.0)


def logits(shape: tuple[int, ...], *, vocab_size: int | None = None, min_vocab_size: int = 2,
           max_vocab_size: int = 64, max_abs: float = 30.0, extreme: bool | None = None,
           allow_neg_inf: bool = False, dtype: Any = np.float64) -> st.SearchStrategy[np.ndarray]:
    """Logits of shape ``shape + (V,)``.

    Args:
      shape: leading shape.
      vocab_size: fixed V, or None to draw V ∈ [min_vocab_size, max_vocab_size].
      max_abs: magnitude bound of ordinary logits.
      extreme: also shift whole rows to ±1e4 and spread entries over ±1e4 (None = sometimes).
      allow_neg_inf: set some entries (never a whole row) to −inf.
      dtype: float32 or float64.

    One draw (``.example()`` is random: yours will differ): ``logits((2,), vocab_size=3).example()`` →
    ``array([[ 0.5, -3. , 12.1], [ 0. ,  0. ,  0. ]])``.
    """
    shape = tuple(_check_int(f"shape[{index}]", n, 0)
                  for index, n in enumerate(_check_sequence("shape", shape, "sizes, e.g. (2,)")))
    if vocab_size is not None:
        vocab_size = _check_int("vocab_size", vocab_size, 1)
        min_vocab_size = max_vocab_size = vocab_size
    low = _check_int("min_vocab_size", min_vocab_size, 1)
    high = _check_int("max_vocab_size", max_vocab_size, 1)
    _check_range("min_vocab_size", low, "max_vocab_size", high)
    max_abs = _check_float("max_abs", max_abs, 0.0)
    extreme = _check_optional_bool("extreme", extreme)
    if not isinstance(allow_neg_inf, bool):
        raise InvalidArgument(f"allow_neg_inf={allow_neg_inf!r}: expected True or False")
    dtype = _check_dtype(dtype)
    if max_abs > float(np.finfo(dtype).max):
        raise InvalidArgument(f"max_abs={max_abs!r}: larger than the largest finite {dtype} "
                              f"({float(np.finfo(dtype).max):.4g}); the logits would overflow to ±inf")
    return _logits(shape, low, high, max_abs, extreme, allow_neg_inf, dtype)


@st.composite
def _logits(draw: Any, shape: tuple[int, ...], low: int, high: int, max_abs: float, extreme: bool | None,
            allow_neg_inf: bool, dtype: np.dtype) -> np.ndarray:
    vocab = draw(st.integers(low, high), label="vocab size")
    full = shape + (vocab,)
    values = _values(draw, full, -max_abs, max_abs, "logits")
    if extreme is None:
        extreme = draw(st.booleans(), label="extreme logits")
    if extreme:
        mode = draw(st.sampled_from(["shift", "spread"]), label="extreme mode")
        if mode == "shift":   # whole rows near ±1e4: only differences matter, lse must not overflow
            values = values + _values(draw, shape + (1,), -1e4, 1e4, "row shift")
        else:                 # entries spanning ±1e4: exp underflows for most tokens
            values = values * (1e4 / max(max_abs, 1e-300))
    if allow_neg_inf and vocab > 1:
        excluded = draw(hnp.arrays(bool, full, elements=st.booleans()), label="−inf entries")
        excluded[..., int(draw(st.integers(0, vocab - 1), label="kept token"))] = False
        values = np.where(excluded, -np.inf, values)
    return values.astype(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# hidden states and an LM head


class LMHeadCase(NamedTuple):
    """Inputs of a fused-linear kernel: hidden [*lead, H], weight [V, H], token_ids [*lead] and τ, plus cotangents
    [*lead] for its backward pass (the upstream gradients of log π and of the entropy)."""

    hidden: np.ndarray
    weight: np.ndarray
    token_ids: np.ndarray
    temperature: float
    log_probs_cotangent: np.ndarray
    entropy_cotangent: np.ndarray


def lm_head_inputs(*, lead_shapes: Sequence[tuple[int, ...]] = ((1,), (7,), (2, 5)), min_hidden_size: int = 1,
                   max_hidden_size: int = 24, min_vocab_size: int = 2, max_vocab_size: int = 96,
                   max_logit: float = 40.0, dtype: Any = np.float64) -> st.SearchStrategy[LMHeadCase]:
    """Inputs of :func:`otb_spec.token_statistics_from_hidden` and its gradient.

    The hidden states and the weight are drawn so that the logits z = h·Wᵀ/τ reach about ``max_logit``·s in
    magnitude, s drawn log-uniformly over 1e-3..1 (so flat and sharply peaked softmaxes both occur); the sampled tokens are
    uniform over the vocabulary (so log π(y) ranges down to about −2·max_logit); τ ∈ {1, or drawn in [0.25, 4]}.
    ``dtype`` (float32 or float64) is the precision of hidden and weight: they are exactly representable in it.

    Args:
      lead_shapes: the leading shapes of hidden (one is drawn), e.g. ``(N,)`` or ``(B, T)``.
      min_hidden_size, max_hidden_size: the range of H.
      min_vocab_size, max_vocab_size: the range of V.
      max_logit: the largest |z| aimed at.
      dtype: float32 or float64.

    One draw (random): ``lm_head_inputs(lead_shapes=[(2,)], max_vocab_size=3).example().token_ids`` →
    ``array([2, 0])``.
    """
    shapes = [tuple(_check_int(f"lead_shapes[{index}][{axis}]", n, 1)
                    for axis, n in enumerate(_check_sequence(f"lead_shapes[{index}]", shape,
                                                             "sizes, e.g. (7,) or (2, 5)")))
              for index, shape in enumerate(_check_sequence("lead_shapes", lead_shapes,
                                                            "leading shapes, e.g. [(7,), (2, 5)]"))]
    if not shapes:
        raise InvalidArgument("lead_shapes=[]: expected at least one leading shape")
    low_h = _check_int("min_hidden_size", min_hidden_size, 1)
    high_h = _check_int("max_hidden_size", max_hidden_size, 1)
    _check_range("min_hidden_size", low_h, "max_hidden_size", high_h)
    low_v = _check_int("min_vocab_size", min_vocab_size, 1)
    high_v = _check_int("max_vocab_size", max_vocab_size, 1)
    _check_range("min_vocab_size", low_v, "max_vocab_size", high_v)
    max_logit = _check_float("max_logit", max_logit, 0.0)
    return _lm_head_inputs(shapes, low_h, high_h, low_v, high_v, max_logit, _check_dtype(dtype))


@st.composite
def _lm_head_inputs(draw: Any, shapes: list[tuple[int, ...]], low_h: int, high_h: int, low_v: int, high_v: int,
                    max_logit: float, dtype: np.dtype) -> LMHeadCase:
    lead = draw(st.sampled_from(shapes), label="leading shape")
    n_hidden = draw(st.integers(low_h, high_h), label="hidden size H")
    vocab = draw(st.integers(low_v, high_v), label="vocabulary size V")
    temperature = draw(st.one_of(st.just(1.0), st.floats(0.25, 4.0)), label="temperature")
    # log-uniform over [1e-3, 1], through the bit-portable exponential (the same example on every machine)
    scale = float(portable.exp(draw(st.floats(-3.0, 0.0), label="log10 logit scale") * float(portable.log(10.0))))
    hidden = _values(draw, lead + (n_hidden,), -1.0, 1.0, "hidden")
    weight = _values(draw, (vocab, n_hidden), -1.0, 1.0, "weight")
    # z_v = Σₖ hₖW_vk/τ with uniform entries has standard deviation ≈ c·√H/(3τ) for W ∈ [−c, c]: aim at a standard
    # deviation of max_logit·scale/2, so the largest of the V logits reaches about max_logit·scale
    weight = weight * (1.5 * max_logit * scale * temperature / math.sqrt(n_hidden))
    ids_strategy = hnp.arrays(np.int64, lead, elements=st.integers(0, vocab - 1))
    token_ids = draw(ids_strategy, label="token_ids")
    log_probs_cotangent = _values(draw, lead, -1.0, 1.0, "log_probs_cotangent")
    entropy_cotangent = _values(draw, lead, -1.0, 1.0, "entropy_cotangent")
    return LMHeadCase(hidden.astype(dtype), weight.astype(dtype), token_ids, float(temperature),
                      log_probs_cotangent, entropy_cotangent)


# ----------------------------------------------------------------------------------------------------------------------
# rollout batches


def rollout_batches(
    *,
    min_groups: int = 1,
    max_groups: int = 4,
    min_group_size: int = 1,
    max_group_size: int = 6,
    min_length: int = 1,
    max_length: int = 12,
    padding: str = "any",
    holes: bool | None = None,
    empty_rows: bool | None = None,
    singleton_groups: bool = True,
    id_kind: str = "any",
    shuffle: bool = True,
    is_weights: bool | None = None,
    reward_style: str = "any",
    max_abs_reward: float = 10.0,
    min_abs_reward: float = 0.0,
    fill_masked: str = "junk",
    vocab_size: int | None = None,
    max_vocab_size: int = 2**17,
    logit_scale: float = 4.0,
    dtype: Any = np.float64,
) -> st.SearchStrategy[RolloutBatch]:
    """Batches of rollouts: :class:`otb_spec.RolloutBatch` with ``rewards``, ``response_mask``, ``group_ids``,
    ``log_probs``, ``sum_pi_squared`` and (sometimes) ``is_weights``; ``logits``/``token_ids`` when ``vocab_size``.

    Args:
      min_groups, max_groups: number of prompt groups G.
      min_group_size, max_group_size: members per group (a group of 1 is a singleton).
      min_length, max_length: T, the number of positions.
      padding: ``"right"`` (valid tokens first), ``"left"`` (valid tokens last) or ``"any"`` (per row).
      holes: tool-output spans (mask 0) inside responses: True = in every row long enough, False = never,
        None = sometimes.
      empty_rows: rows with no valid token: True = allowed, False = never, None = rarely.
      singleton_groups: allow groups of one member (``False`` raises the minimum group size to 2).
      id_kind: ``"int"``, ``"str"``, ``"uuid"``, ``"object"``, ``"trainer"`` or ``"any"`` (see :func:`group_ids`).
      shuffle: non-contiguous groups.
      is_weights: rollout importance weights ρ ∈ [0, 3]: True, False, or None (sometimes).
      reward_style: ``"terminal"`` (one reward on the last valid token), ``"dense"`` (every valid token),
        ``"sparse"`` (each valid token at a drawn rate of ½, ¼ or ¾) or ``"any"``. Reward values are either 0/1
        outcomes (each 1 at a drawn rate of ½, ¼ or ¾, as a task's pass/fail) or uniform on [−max_abs_reward,
        max_abs_reward], from a seeded generator (so a batch without any reward is the exception, as in training,
        not the rule; they shrink by their seed, not value by value).
      max_abs_reward: rewards lie in [−max_abs_reward, max_abs_reward].
      min_abs_reward: rewarded positions get |r| ≥ min_abs_reward (> 0: no zero rewards there, and no 0/1 rewards —
        useful where a zero reward would hide a wrong baseline).
      fill_masked: what masked positions hold in rewards, log_probs, sum_pi_squared and is_weights: ``"junk"``
        (arbitrary finite values, log π up to +50 and Σπ² in [−5, 5] included — an implementation that forgets the
        mask gets them wrong, and so may a correct one that forms exp(log π) before masking), ``"trainer"`` (what a
        trainer can leave there: in each batch either the real statistics of the padding token — log π ≤ 0 with a
        consistent Σπ², ρ ∈ [0, 3] — or zeros with ρ = 1; rewards any values up to ``max_abs_reward``, which a
        correct implementation ignores) or ``"zero"`` (rewards 0, log π 0, Σπ² 0, ρ 1, as many trainers pad).
      vocab_size: when set, draw logits [B, T, V] (V = vocab_size) and token ids, and derive log π(y) and Σπ² from
        them exactly; otherwise draw consistent (log π, Σπ²) pairs over V ≤ max_vocab_size (cheaper).
      max_vocab_size: vocabulary bound for the logit-free token statistics.
      logit_scale: standard scale of the drawn logits.
      dtype: float64 or float32 for every float array.

    One draw of ``rollout_batches(max_groups=2, max_group_size=2, max_length=3).example()`` (random)::

      RolloutBatch(rewards=array([[ 0. ,  1. , 41.7], [ 0. ,  0. ,  1. ]]),
                   response_mask=array([[1., 1., 0.], [1., 1., 1.]]),
                   group_ids=array(['prompt-4', 'prompt-4'], dtype='<U8'),
                   log_probs=array([[-0.2, -3.1, -7.5], [...]]), sum_pi_squared=array([[0.7, 0.1, 0.5], [...]]),
                   is_weights=None, ...)
    """
    min_groups = _check_int("min_groups", min_groups, 1)
    max_groups = _check_int("max_groups", max_groups, 1)
    _check_range("min_groups", min_groups, "max_groups", max_groups)
    min_group_size = _check_int("min_group_size", min_group_size, 1)
    max_group_size = _check_int("max_group_size", max_group_size, 1)
    if not isinstance(singleton_groups, bool):
        raise InvalidArgument(f"singleton_groups={singleton_groups!r}: expected True or False")
    if not singleton_groups:
        if max_group_size < 2:
            raise InvalidArgument(f"singleton_groups=False needs max_group_size ≥ 2, got max_group_size="
                                  f"{max_group_size}")
        min_group_size = max(min_group_size, 2)
    _check_range("min_group_size", min_group_size, "max_group_size", max_group_size)
    min_length = _check_int("min_length", min_length, 1)
    max_length = _check_int("max_length", max_length, 1)
    _check_range("min_length", min_length, "max_length", max_length)
    padding = _check_choice("padding", padding, _PADDINGS)
    holes = _check_optional_bool("holes", holes)
    empty_rows = _check_optional_bool("empty_rows", empty_rows)
    id_kind = _check_choice("id_kind", id_kind, _ID_KINDS)
    if not isinstance(shuffle, bool):
        raise InvalidArgument(f"shuffle={shuffle!r}: expected True or False")
    is_weights = _check_optional_bool("is_weights", is_weights)
    reward_style = _check_choice("reward_style", reward_style, _REWARD_STYLES)
    max_abs_reward = _check_float("max_abs_reward", max_abs_reward, 0.0)
    min_abs_reward = _check_float("min_abs_reward", min_abs_reward, 0.0, inclusive=True)
    _check_range("min_abs_reward", min_abs_reward, "max_abs_reward", max_abs_reward)
    fill_masked = _check_choice("fill_masked", fill_masked, _FILLS)
    if vocab_size is not None:
        vocab_size = _check_int("vocab_size", vocab_size, 2)
    max_vocab_size = _check_int("max_vocab_size", max_vocab_size, 2)
    logit_scale = _check_float("logit_scale", logit_scale, 0.0)
    dtype = _check_dtype(dtype)
    return _rollout_batches(min_groups, max_groups, min_group_size, max_group_size, min_length, max_length, padding,
                            holes, empty_rows, id_kind, shuffle, is_weights, reward_style, max_abs_reward,
                            min_abs_reward, fill_masked, vocab_size, max_vocab_size, logit_scale, dtype)


@st.composite
def _rollout_batches(draw: Any, min_groups: int, max_groups: int, min_group_size: int, max_group_size: int,
                     min_length: int, max_length: int, padding: str, holes: bool | None, empty_rows: bool | None,
                     id_kind: str, shuffle: bool, is_weights: bool | None, reward_style: str, max_abs_reward: float,
                     min_abs_reward: float, fill_masked: str, vocab_size: int | None, max_vocab_size: int,
                     logit_scale: float, dtype: np.dtype) -> RolloutBatch:
    n_groups = draw(st.integers(min_groups, max_groups), label="groups")
    sizes = _row_integers(draw, n_groups, min_group_size, max_group_size, "group sizes")
    ids = draw(group_ids(sizes, kind=id_kind, shuffle=shuffle), label="group_ids")
    n_rows = len(ids)
    n_positions = draw(st.integers(min_length, max_length), label="T")
    mask = _draw_mask(draw, n_rows, n_positions, padding, holes, empty_rows)
    valid = mask > 0

    rewards = _draw_rewards(draw, mask, reward_style, max_abs_reward, min_abs_reward)
    if vocab_size is not None:
        logit_values = _values(draw, (n_rows, n_positions, vocab_size), -3.0, 3.0, "logits") * (logit_scale / 3.0)
        if n_rows * n_positions <= _ELEMENTWISE_LIMIT:
            token_ids = draw(hnp.arrays(np.int64, (n_rows, n_positions), elements=st.integers(0, vocab_size - 1)),
                             label="token_ids")
        else:
            token_ids = _seeded(draw, "token_ids").integers(0, vocab_size, (n_rows, n_positions))
        log_probs = _token_log_probs(logit_values, token_ids)
        spp = _sum_pi_squared(logit_values)
    else:
        logit_values = token_ids = None
        log_probs, spp = draw(_token_statistics((n_rows, n_positions), 2, max_vocab_size), label="token statistics")

    weights = None
    use_weights = draw(st.booleans(), label="use is_weights") if is_weights is None else is_weights
    if use_weights:
        # ρ ∈ [0, 3], drawn as 1 + [−1, 2] so that the simplest weight is ρ = 1 (no correction), not ρ = 0
        weights = 1.0 + _values(draw, (n_rows, n_positions), -1.0, 2.0, "is_weights − 1")
        zero_some = draw(st.booleans(), label="some ρ = 0")
        if zero_some:
            weights = np.where(_values(draw, (n_rows, n_positions), 0.0, 1.0, "ρ = 0 draws") < 0.2, 0.0, weights)

    if fill_masked == "trainer":
        rewards = np.where(valid, rewards, _values(draw, mask.shape, -max_abs_reward, max_abs_reward,
                                                   "masked rewards"))
        if draw(st.booleans(), label="padding holds real token statistics"):
            padding_lp, padding_spp = draw(_token_statistics(mask.shape, 2, max_vocab_size),
                                           label="padding token statistics")
            padding_weights = 1.0 + _values(draw, mask.shape, -1.0, 2.0, "masked is_weights − 1")
        else:
            padding_lp, padding_spp, padding_weights = 0.0, 0.0, 1.0
        log_probs = np.where(valid, log_probs, padding_lp)
        spp = np.where(valid, spp, padding_spp)
        if weights is not None:
            weights = np.where(valid, weights, padding_weights)
    elif fill_masked == "junk":
        rewards = np.where(valid, rewards, _values(draw, mask.shape, -99.0, 99.0, "masked rewards"))
        log_probs = np.where(valid, log_probs, _values(draw, mask.shape, -50.0, 50.0, "masked log_probs"))
        spp = np.where(valid, spp, _values(draw, mask.shape, -5.0, 5.0, "masked sum_pi_squared"))
        if weights is not None:
            weights = np.where(valid, weights, _values(draw, mask.shape, 0.0, 50.0, "masked is_weights"))
    else:
        rewards = np.where(valid, rewards, 0.0)
        log_probs = np.where(valid, log_probs, 0.0)
        spp = np.where(valid, spp, 0.0)
        if weights is not None:
            weights = np.where(valid, weights, 1.0)

    def cast(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else np.asarray(array, dtype=dtype)

    return RolloutBatch(rewards=cast(rewards), response_mask=mask.astype(dtype), group_ids=ids,
                        log_probs=cast(log_probs), sum_pi_squared=cast(spp), is_weights=cast(weights),
                        logits=cast(logit_values), token_ids=token_ids)


def _draw_mask(draw: Any, n_rows: int, n_positions: int, padding: str, holes: bool | None,
               empty_rows: bool | None) -> np.ndarray:
    allow_empty = draw(st.integers(0, 9), label="allow empty rows") == 0 if empty_rows is None else empty_rows
    min_valid = 0 if allow_empty else 1
    # drawn as the number of positions *not* used, so that the simplest row (what Hypothesis shrinks towards) is a
    # full response rather than an empty one
    unused = _row_integers(draw, n_rows, 0, n_positions - min_valid, "unused positions per row")
    lengths = [n_positions - count for count in unused]
    if n_rows <= _ROWWISE_LIMIT:        # one Hypothesis draw per choice, so each shrinks on its own
        def side_of_row() -> str:
            return draw(st.sampled_from(["right", "left"]), label="padding side")

        def holes_in_row() -> bool:
            return draw(st.booleans(), label="holes in row")

        def integer(low: int, high: int, label: str) -> int:
            return draw(st.integers(low, high), label=label)
    else:       # one seeded generator for every row's choices (thousands of draws would overrun Hypothesis's buffer)
        generator = _seeded(draw, "row layout")

        def integer(low: int, high: int, label: str) -> int:
            return int(generator.integers(low, high + 1, 1)[0])

        def side_of_row() -> str:
            return ("right", "left")[integer(0, 1, "padding side")]

        def holes_in_row() -> bool:
            return integer(0, 1, "holes in row") == 1
    mask = np.zeros((n_rows, n_positions))
    for row, length in enumerate(lengths):
        side = side_of_row() if padding == "any" else padding
        start = 0 if side == "right" else n_positions - length
        mask[row, start:start + length] = 1.0
        want_holes = holes_in_row() if holes is None else holes
        if want_holes and length >= 3:
            n_holes = integer(1, 2, "holes")
            for _ in range(n_holes):
                hole_start = integer(start + 1, start + length - 2, "hole start")
                hole_length = integer(1, 3, "hole length")
                mask[row, hole_start:min(hole_start + hole_length, start + length - 1)] = 0.0
    return mask


def _draw_rewards(draw: Any, mask: np.ndarray, style: str, max_abs: float, min_abs: float = 0.0) -> np.ndarray:
    """Rewards of ``style`` from a seeded generator: 0/1 outcomes at a rate of ½, ¼ or ¾, or values uniform on
    [−max_abs, max_abs] (folded away from 0 by ``min_abs``). Not element-wise Hypothesis draws, which repeat one fill
    value and, late in an example, fall back to 0: about half the batches held no reward at all."""
    if style == "any":
        style = draw(st.sampled_from(_REWARD_STYLES[:-1]), label="reward style")
    n_rows, n_positions = mask.shape
    binary = min_abs == 0.0 and draw(st.booleans(), label="binary rewards")

    def outcomes(shape: tuple[int, ...], label: str) -> np.ndarray:
        if binary:
            return _bernoulli(draw, shape, label).astype(np.float64)
        return _fold_away_from_zero(_uniform_values(draw, shape, max_abs, label), max_abs, min_abs)

    if style == "terminal":     # one outcome per row, on its last valid token
        row_outcomes = outcomes((n_rows,), "row rewards")
        rewards = np.zeros(mask.shape)
        has_token = mask.any(axis=1)
        last = n_positions - 1 - np.argmax(mask[:, ::-1], axis=1)
        rows = np.flatnonzero(has_token)
        rewards[rows, last[rows]] = row_outcomes[rows]
        return rewards
    values = outcomes(mask.shape, "rewards")
    if style == "dense":
        return values * mask
    return values * mask * _bernoulli(draw, mask.shape, "sparse reward positions")


def _bernoulli(draw: Any, shape: tuple[int, ...], label: str) -> np.ndarray:
    """Independent coin flips at a rate of ½, ¼ or ¾ (drawn), from a seeded generator."""
    rate = draw(st.sampled_from([0.5, 0.25, 0.75]), label=f"{label} (rate)")
    return _seeded(draw, label).random(shape) < rate


def _uniform_values(draw: Any, shape: tuple[int, ...], bound: float, label: str) -> np.ndarray:
    """float64 values uniform on [−bound, bound] from a seeded generator, whatever the size: Hypothesis fills the end of
    many an example with its simplest choices, so element-wise draws there (rewards come late in a batch) are all 0,
    while the simplest seed, 0, still gives varied values. (bound·U, U on [−1, 1): finite for any finite bound.)"""
    return np.multiply(bound, _seeded(draw, label).uniform(-1.0, 1.0, shape))


def _fold_away_from_zero(values: np.ndarray, max_abs: float, min_abs: float) -> np.ndarray:
    """[−max, max] folded onto ±[min, max]: |v| ↦ min + |v|·(max − min)/max, sign(0) = + (unchanged when min = 0)."""
    if min_abs == 0.0:
        return values
    magnitude = min_abs + np.abs(values) * ((max_abs - min_abs) / max_abs)
    return np.where(values < 0, -magnitude, magnitude)


# ----------------------------------------------------------------------------------------------------------------------
# toy policies and tasks

_PARAMETRIZATIONS = ("tabular", "log_linear", "any")


def toy_policies(*, parametrization: str = "any", min_vocab_size: int = 2, max_vocab_size: int = 3,
                 min_horizon: int = 1, max_horizon: int = 3, max_scale: float = 3.0
                 ) -> st.SearchStrategy[EnumerablePolicy]:
    """Enumerable policies (:class:`otb_spec.toy.EnumerablePolicy`) with random parameters of scale ≤ max_scale.

    Args:
      parametrization: ``"tabular"`` (one logit vector per prefix: the proxy is exact), ``"log_linear"`` (shared
        parameters: it is not), or ``"any"``.
      min_vocab_size, max_vocab_size: V, including EOS (≥ 2).
      min_horizon, max_horizon: T (≥ 1). The number of sequences grows like (V − 1)^T; keep V^T small.
      max_scale: standard deviation bound of the parameters (larger → more deterministic policies); the scale is
        drawn in [min(0.1, max_scale), max_scale].

    One draw (random): ``toy_policies().example()`` →
    ``EnumerablePolicy(vocab_size=3, horizon=2, parametrization='tabular', …)``.
    """
    parametrization = _check_choice("parametrization", parametrization, _PARAMETRIZATIONS)
    low_v = _check_int("min_vocab_size", min_vocab_size, 2)
    high_v = _check_int("max_vocab_size", max_vocab_size, 2)
    _check_range("min_vocab_size", low_v, "max_vocab_size", high_v)
    low_t = _check_int("min_horizon", min_horizon, 1)
    high_t = _check_int("max_horizon", max_horizon, 1)
    _check_range("min_horizon", low_t, "max_horizon", high_t)
    if (high_v - 1) ** high_t * high_v > 50_000:
        raise InvalidArgument(f"max_vocab_size={high_v}, max_horizon={high_t}: too many sequences to enumerate")
    max_scale = _check_float("max_scale", max_scale, 0.0)
    return _toy_policies(parametrization, low_v, high_v, low_t, high_t, max_scale)


@st.composite
def _toy_policies(draw: Any, parametrization: str, low_v: int, high_v: int, low_t: int, high_t: int,
                  max_scale: float) -> EnumerablePolicy:
    if parametrization == "any":
        parametrization = draw(st.sampled_from(_PARAMETRIZATIONS[:-1]), label="parametrization")
    vocab = draw(st.integers(low_v, high_v), label="V")
    horizon = draw(st.integers(low_t, high_t), label="T")
    seed = draw(st.integers(0, 2**32 - 1), label="parameter seed")
    scale = draw(st.floats(min(0.1, max_scale), max_scale), label="parameter scale")
    constructor = EnumerablePolicy.tabular if parametrization == "tabular" else EnumerablePolicy.log_linear
    return constructor(vocab, horizon, seed=seed, scale=scale)


def toy_tasks(*, reward_style: str = "any", max_abs_reward: float = 5.0, **policy_options: Any
              ) -> st.SearchStrategy[EnumerableTask]:
    """Tasks (:class:`otb_spec.toy.EnumerableTask`): a :func:`toy_policies` policy with random rewards.

    Args:
      reward_style: ``"terminal"`` (one reward per sequence on its last token), ``"dense"`` (a causal reward on every
        token: rₜ depends on y≤ₜ only), or ``"any"``.
      max_abs_reward: rewards lie in [−max_abs_reward, max_abs_reward].
      **policy_options: forwarded to :func:`toy_policies`.
    """
    reward_style = _check_choice("reward_style", reward_style, ("terminal", "dense", "any"))
    max_abs_reward = _check_float("max_abs_reward", max_abs_reward, 0.0)
    return _toy_tasks(toy_policies(**policy_options), reward_style, max_abs_reward)


@st.composite
def _toy_tasks(draw: Any, policies: st.SearchStrategy[EnumerablePolicy], reward_style: str,
               max_abs_reward: float) -> EnumerableTask:
    policy = draw(policies, label="policy")
    table = policy.sequences
    if reward_style == "any":
        reward_style = draw(st.sampled_from(["terminal", "dense"]), label="reward style")
    elements = st.floats(-max_abs_reward, max_abs_reward, allow_nan=False, allow_subnormal=False)
    if reward_style == "terminal":
        values = draw(hnp.arrays(np.float64, (table.size,), elements=elements), label="sequence rewards")
        return policy.task(policy.terminal_rewards(values))
    values = draw(hnp.arrays(np.float64, (table.n_steps,), elements=elements), label="step rewards")
    return policy.task(policy.step_rewards(values))
