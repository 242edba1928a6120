"""Inputs made for their role: the one implementation verification, benchmarks and every pass use.

Shapes. Set ``index`` binds each symbolic dim once (the same name gets the same size in every input):
batch-like dims ``1 << index``, sequence-like ``8 << index`` (capped by the position table), a key/value
cache's past length that sequence length (0 in set 1, so both the first call and a later one are
covered), a mask spanning ``past + sequence``, raw audio the samples its convolution stack needs for that
many frames (wav2vec2: 400 for one), spectrogram frames and image sides what the position table after the
stack fixes (Whisper's 3000 frames, ViT's 224 pixels), else at least the stack's minimum. Dims whose
names are sums (``past_sequence + sequence``) are evaluated. ``JobConfig.shapes`` overrides all of it.
A seq2seq decoder's inputs over the encoder's sequence (its states, its mask, the cross-attention cache)
share one encoder length, ``12 << index`` unless bound (never 0, unlike the self-attention past); a set after
a past decodes one token per row, as generation does.

A merged decoder (``use_cache_branch``, ``core.inputs.graph``) gets sets for both of its branches: set 0 and
every third after it run the no-cache branch (the first generation step: the decoder's tokens, encoder states,
and every cache a dummy ``NO_CACHE_PAST`` long, as Optimum's runtime feeds it; the branch never reads them),
the others the cache branch with the self-attention cache growing from set to set; the set's name and
``why`` say which branch ran. Sizes a caller binds (``feeds_for_sizes``) run the cache branch, which honours
every one of them, except a past bound to 0: the first step, the no-cache branch.

Values. Token ids uniform below the vocabulary of the table they index, ids the graph compares them with
kept out except a position marker (BART's ``</s>``) at each row's last valid token; right-padded attention
masks (optimum #978 and ORT #18945: random masks give false alarms), ones over the past; token types below
the type table; positions counting on from the past; labels with 20% -100; N(0, 1) floats.

Guesses. When the original model refuses a generated set, ``InputSet.next_guess`` gives the next plausible
one: longer sequences, larger images, then every compared id as a row-end marker, then no padding, then
integers below the float inputs' sizes, then batches a multiple of the rows the graph folds its leading axis into
(``ModelFacts.row_group``: a video tower's frames per clip), then one row per set (an export that runs at batch 1
only). Each set
records the guess that ran and the ones refused (``InputSet.provenance``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from core.errors import InvalidInputError, InvalidModelError
from core.inputs.graph import InputRole, ModelFacts, analyze, dim_role
from core.inputs.specs import InputSet, InputSpec, graph_inputs, load_samples

IGNORE_INDEX = -100
# The cache a merged decoder's no-cache branch is fed and ignores: Optimum's ONNX Runtime classes feed 1 position
# (transformers.js feeds 0); both are valid calls of the file.
NO_CACHE_PAST = 1


@dataclasses.dataclass(frozen=True)
class Guess:
    name: str
    seq_scale: int = 1
    all_markers: bool = False
    padding: bool = True
    empty_past: bool = True  # set 1 may try a past of length 0
    # Integers not read from a table are drawn below the smallest free axis of the float inputs: they index
    # rows of those inputs (a graph network's edge_index into its nodes, gathered and scattered).
    ints_within_sizes: bool = False
    one_row: bool = False  # every set at batch 1: an export that runs at its example's batch of 1 only
    image_scale: int = 1  # free sides of an image input times this (a pyramid pooled to 6 bins at 1/32 scale)
    grouped_rows: bool = False  # batches a multiple of the rows the graph folds its leading axis into


GUESSES = (
    Guess("role-based"),
    Guess("longer sequences", seq_scale=4, empty_past=False),
    # UperNet's pyramid pooling exported by dynamo needs 128 pixels a side; the first guess gives 64
    Guess("larger images (each free side 4x)", image_scale=4),
    Guess("every compared id at each row's end", seq_scale=4, all_markers=True, empty_past=False),
    Guess("no padding", seq_scale=4, all_markers=True, padding=False, empty_past=False),
    Guess("integers below the float inputs' free sizes (indices into their rows)", ints_within_sizes=True),
    # X-CLIP's video tower takes a clip's frames flattened into the batch and folds them back: 1 row fails
    Guess("batches in the graph's row groups (it folds its leading axis)", grouped_rows=True),
    # torch's opset-23 Llama export runs at batch 1 only: its RotaryEmbedding's cos/sin caches keep the
    # example's batch of 1, which ONNX's op must match to the input's
    Guess("one row (the model refused every batch above 1)", one_row=True),
)
_EXPR = re.compile(r"^[\w.]+(\s+[+\-]\s+[\w.]+)+$")  # exporters write sums with spaces: "past + sequence"


def _evaluate(expr: str, bound: Mapping[str, int]) -> int | None:
    """A dim name like ``past_sequence + sequence``, with its names bound: its value; None otherwise."""
    if not _EXPR.match(expr):
        return None
    total, sign = 0, 1
    for i, token in enumerate(re.split(r"\s+([+\-])\s+", expr.strip())):
        if i % 2:
            sign = 1 if token == "+" else -1
            continue
        if token.isdigit():
            value = int(token)
        elif token in bound:
            value = bound[token]
        else:
            return None
        total += sign * value
    return total


class InputSynthesis:
    """Input sets for one model, from its graph (``core.inputs.graph``); keeps only small facts."""

    def __init__(self, model: onnx.ModelProto | ir.Model, *, seed: int = 0) -> None:
        self.specs: list[InputSpec] = graph_inputs(model)
        self.facts: ModelFacts = analyze(model)
        self.seed = seed

    # ------------------------------------------------------------------------------------------ shapes

    def _role(self, name: str) -> InputRole:
        return self.facts.roles[name]

    def cache_branch(self, index: int) -> bool | None:
        """For a merged decoder, whether set ``index`` runs the branch that reads the cache (module
        docstring); None for other models."""
        if not any(r.role == "use_cache_branch" for r in self.facts.roles.values()):
            return None
        return index % 3 != 0

    def _lengths(self, index: int, guess: Guess) -> tuple[int, int]:
        """(sequence, past) lengths of set ``index`` under ``guess``, within the position table. A language
        model's batch of several rows after a past decodes one token each: generation never sends a batch of
        prompts after a cache (ORT's GroupQueryAttention refuses one)."""
        seq = (8 << index) * guess.seq_scale
        # A merged decoder's cache branch is never called on an empty cache (its no-cache branch is the first
        # step), so its sets keep a past.
        empty = index == 1 and guess.empty_past and self.cache_branch(index) is None
        past = 0 if empty or not self.facts.has_past else seq
        cap = self._positions()
        if cap:
            seq = min(seq, cap // 2 if self.facts.has_past else cap)
            past = min(past, cap - seq)
        generation = self.facts.causal_lm or self.facts.encoder_decoder
        if generation and past > 0 and index > 0:  # batch 1 << index > 1
            seq = 1
        return max(seq, 1), past

    def _rows(self, guess: Guess) -> int:
        """The batch of a set's first index under ``guess``: 1, or the graph's row group."""
        return self.facts.row_group if guess.grouped_rows else 1

    def _guess_after(self, index: int) -> int | None:
        """The guess tried after ``GUESSES[index]``, skipping one that would repeat the first (row groups of 1)."""
        following = index + 1
        while following < len(GUESSES) and GUESSES[following].grouped_rows and self.facts.row_group == 1:
            following += 1
        return following if following < len(GUESSES) else None

    def _positions(self) -> int | None:
        """Positions the table serves, None without one: RoBERTa-style tables start 2 rows in (padding offset)."""
        cap = self.facts.max_positions
        return (cap - 2 if cap > 4 else cap) if cap else None

    def _provenance(self, shapes: Mapping[str, tuple[int, ...]], guess: Guess, source: str) -> dict[str, Any]:
        """A set's provenance (``InputSet.provenance``) before any refused guess: each input's role and why."""
        roles = self.facts.roles

        def why(name: str) -> str:
            if guess.ints_within_sizes and roles[name].role == "int":
                return "integer input not read from a table: below the smallest free axis of the float inputs"
            return roles[name].why

        return {
            "source": source,
            "guess": guess.name,
            "inputs": {n: {"role": roles[n].role, "shape": list(s), "why": why(n)} for n, s in shapes.items()},
            "attempts": [],
        }

    def bind(
        self,
        index: int,
        guess: Guess = GUESSES[0],
        override: Mapping[str, Sequence[int]] | None = None,
        preset: Mapping[str, int] | None = None,
        cache: bool | None = None,
    ) -> dict[str, tuple[int, ...]]:
        """Concrete shapes of every input; ``override`` (the config's shapes) and ``preset`` (symbolic dim
        name -> size) bind first. ``cache``: a merged decoder's branch (default: ``cache_branch(index)``)."""
        by_name = {s.name: s for s in self.specs}
        bound: dict[str, int] = dict(preset or {})
        overrides = dict(override or {})
        for name, shape in overrides.items():
            spec = by_name.get(name)
            if spec is None:
                raise InvalidInputError(
                    f"shapes names {name!r}, which is not a graph input (inputs: {', '.join(by_name)})",
                    code="SHAPES_INVALID",
                )
            if spec.dims and len(shape) != spec.rank:
                raise InvalidInputError(
                    f"shapes gives {name!r} rank {len(shape)}, the graph expects rank {spec.rank}",
                    code="SHAPES_INVALID",
                )
            for axis, (dim, size) in enumerate(zip(spec.dims, shape, strict=False)):
                if size < 0:
                    raise InvalidInputError(f"shapes gives {name!r} a negative dim", code="SHAPES_INVALID")
                if isinstance(dim, int) and dim != size:
                    raise InvalidInputError(
                        f"shapes gives {name!r} size {size} on axis {axis}, the graph fixes it to {dim}",
                        code="SHAPES_INVALID",
                    )
                if isinstance(dim, str):
                    bound.setdefault(dim, int(size))
        seq, past = self._lengths(index, guess)
        batch = 1 if guess.one_row else self._rows(guess) << index
        no_cache = (self.cache_branch(index) if cache is None else cache) is False
        if no_cache:  # dummy caches, the cross-attention one too; the encoder's length binds the rest
            past = NO_CACHE_PAST
            for spec in self.specs:
                role = self._role(spec.name)
                if role.role == "cross_key_values" and role.past_axis is not None and role.past_axis < spec.rank:
                    dim = spec.dims[role.past_axis]
                    if isinstance(dim, str):
                        bound.setdefault(dim, NO_CACHE_PAST)
        # Past lengths first: a mask named like the ids' sequence then still spans past + new tokens.
        for spec in self.specs:
            role = self._role(spec.name)
            if role.role == "past_key_values" and role.past_axis is not None and role.past_axis < spec.rank:
                dim = spec.dims[role.past_axis]
                if isinstance(dim, str):
                    bound.setdefault(dim, past)
        past_len = 0
        for spec in self.specs:
            role = self._role(spec.name)
            if role.role == "past_key_values" and role.past_axis is not None and role.past_axis < spec.rank:
                dim = spec.dims[role.past_axis]
                past_len = bound.get(dim, past) if isinstance(dim, str) else int(dim or 0)
                break
        if no_cache:
            past_len = 0  # a mask or positions over the new tokens alone
        if self.facts.has_past:
            seq = self._bound_new_tokens(bound, seq)
        encoder = self.encoder_axes(cross_cache=not no_cache)
        enc_len = self._encoder_length(bound, overrides, index, guess, encoder) if encoder else 0
        for spec in self.specs:
            dim = spec.dims[encoder[spec.name]] if spec.name in encoder else None
            if isinstance(dim, str):
                bound.setdefault(dim, enc_len)
        shapes: dict[str, tuple[int, ...]] = {}
        pending: list[tuple[str, int, str]] = []
        for spec in self.specs:
            if spec.name in overrides:
                shapes[spec.name] = tuple(int(s) for s in overrides[spec.name])
                continue
            role = self._role(spec.name)
            shape: list[int] = []
            for axis, dim in enumerate(spec.dims):
                if isinstance(dim, int):
                    shape.append(dim)
                elif isinstance(dim, str) and dim in bound:
                    shape.append(bound[dim])
                elif isinstance(dim, str) and _EXPR.match(dim):
                    pending.append((spec.name, axis, dim))
                    shape.append(-1)
                elif encoder.get(spec.name) == axis:
                    shape.append(enc_len)
                else:
                    size = self._size(
                        role, spec, axis, dim, batch=batch, seq=seq, past=past_len, image_scale=guess.image_scale
                    )
                    if isinstance(dim, str):
                        bound[dim] = size
                    shape.append(size)
            shapes[spec.name] = tuple(shape)
        for name, axis, dim in pending:
            value = _evaluate(dim, bound)
            if value is None:  # a mask over past + new tokens, named by an expression we cannot read
                value = seq + past_len if self._role(name).role == "attention_mask" else seq
            fixed = list(shapes[name])
            fixed[axis] = value
            shapes[name] = tuple(fixed)
        if not no_cache and past_len and self.cache_branch(index) is not None:
            self._mask_over_past(shapes, overrides, past_len)
        return shapes

    def _mask_over_past(
        self, shapes: dict[str, tuple[int, ...]], overrides: Mapping[str, Sequence[int]], past: int
    ) -> None:
        """A merged decoder-only file declares its inputs with the no-cache decoder's dims (Optimum's merge
        takes the first file's), so its mask shares the ids' sequence name; the cache branch reads a mask over
        past + new tokens."""
        new = next((s[-1] for n, s in shapes.items() if self._role(n).role == "token_ids" and s), None)
        for spec in self.specs:
            role = self._role(spec.name)
            if new is None or role.role != "attention_mask" or role.cross or spec.name in overrides or not spec.rank:
                continue
            fixed = list(shapes[spec.name])
            fixed[-1] = new + past
            shapes[spec.name] = tuple(fixed)

    def encoder_axes(self, cross_cache: bool = True) -> dict[str, int]:
        """Input -> its axis over the encoder's sequence: encoder states (axis 1), a cross-attention mask (its
        last), a cross-attention cache (its length axis; left out when ``cross_cache`` is False: a merged
        decoder's no-cache branch gets a dummy one). One length binds them all."""
        out = {}
        for spec in self.specs:
            role = self._role(spec.name)
            if role.role == "encoder_states" and spec.rank == 3:
                out[spec.name] = 1
            elif role.role == "attention_mask" and role.cross and spec.rank:
                out[spec.name] = spec.rank - 1
            elif (
                cross_cache
                and role.role == "cross_key_values"
                and role.past_axis is not None
                and role.past_axis < spec.rank
            ):
                out[spec.name] = role.past_axis
        return out

    def _encoder_length(
        self,
        bound: Mapping[str, int],
        overrides: Mapping[str, Sequence[int]],
        index: int,
        guess: Guess,
        encoder: Mapping[str, int],
    ) -> int:
        """The encoder's sequence length of set ``index``: what the caller bound or the graph fixes on any
        input over it, else ``12 << index`` (unlike the decoder's lengths, so a mixed-up axis fails)."""
        by_name = {s.name: s for s in self.specs}
        for name, axis in encoder.items():
            dim = by_name[name].dims[axis]
            if name in overrides and len(overrides[name]) > axis:
                return int(overrides[name][axis])
            if isinstance(dim, int):
                return dim
            if isinstance(dim, str) and dim in bound:
                return bound[dim]
        return (12 << index) * guess.seq_scale

    def _bound_new_tokens(self, bound: Mapping[str, int], default: int) -> int:
        """The new tokens' length where the caller bound the ids' sequence dim: a mask that spans past + new
        tokens under a name of its own (TorchScript's ``total_sequence``) must follow it, not the guess."""
        for spec in self.specs:
            dim = spec.dims[-1] if spec.dims else None
            if self._role(spec.name).role == "token_ids" and isinstance(dim, str) and dim in bound:
                return bound[dim]
        return default

    def _size(
        self,
        role: InputRole,
        spec: InputSpec,
        axis: int,
        dim: str | None,
        *,
        batch: int,
        seq: int,
        past: int,
        image_scale: int = 1,
    ) -> int:
        if axis == 0 and dim_role(dim, axis) == "batch":
            return batch
        spatial = _spatial_start(role, spec.rank)
        if spatial == 2 and axis == 1 and role.channels:
            return role.channels
        if spatial is not None and axis >= spatial:
            step_axis = axis - spatial
            if role.exact_out:
                return role.min_length(role.exact_out, step_axis)
            if role.role == "audio":
                return role.min_length(seq, step_axis)
            return max(seq, role.min_length(1, step_axis)) * image_scale
        if role.role == "attention_mask" and self.facts.has_past and axis == spec.rank - 1:
            return seq + past
        if role.role == "past_key_values" and axis == role.past_axis:
            return past
        return batch if dim_role(dim, axis) == "batch" else seq

    # ------------------------------------------------------------------------------------------ values

    def feeds(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        rng: np.random.Generator,
        guess: Guess = GUESSES[0],
        cache: bool | None = None,
    ) -> dict[str, np.ndarray]:
        """Values for ``shapes``; ``cache``: the branch a merged decoder runs (the one its shapes were bound
        for), the cache branch when not given."""
        cache = True if cache is None else cache
        past = self._past_length(shapes) if cache else 0
        feeds = {s.name: self._values(s, shapes[s.name], rng, guess, past, cache=cache) for s in self.specs}
        self._place_markers(feeds, guess)
        self._place_offsets(feeds, rng)
        self._place_lengths(feeds, rng)
        if guess.ints_within_sizes:
            self._ints_within_sizes(feeds, rng)
        return feeds

    def _free_sizes(self, feeds: Mapping[str, np.ndarray], keep: Callable[[InputSpec, int], bool]) -> list[int]:
        """The sizes ``feeds`` give the free (not fixed by the graph) axes of the inputs that ``keep(spec, axis)``
        accepts."""
        return [
            feeds[spec.name].shape[axis]
            for spec in self.specs
            if spec.name in feeds
            for axis, dim in enumerate(spec.dims)
            if not isinstance(dim, int) and keep(spec, axis)
        ]

    def _ints_within_sizes(self, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Every plain integer input (no table bounds it) redrawn below the smallest free axis of the float
        inputs (``Guess.ints_within_sizes``); nothing when no float input has a free axis."""
        sizes = self._free_sizes(feeds, lambda spec, _axis: spec.dtype.kind == "f")
        if not sizes or min(sizes) < 1:
            return
        for name, role in self.facts.roles.items():
            if role.role == "int" and name in feeds:
                feeds[name] = rng.integers(0, min(sizes), size=feeds[name].shape).astype(feeds[name].dtype)

    def _place_lengths(self, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """A row's valid length (an ASR encoder's ``length`` beside its features) is at least 1 (a row of
        none divides by zero and masks every position) and at most the longest free axis of the other inputs
        past the batch (the time axis of ``[batch, features, time]`` or ``[batch, time, features]``)."""
        for name, role in self.facts.roles.items():
            lengths = feeds.get(name)
            if role.role != "lengths" or lengths is None or lengths.ndim != 1 or not lengths.size:
                continue
            free = self._free_sizes(feeds, lambda spec, axis, name=name: spec.name != name and axis > 0)
            longest = max(free, default=1)
            values = rng.integers(1, longest + 1, size=lengths.size)
            values[0] = longest  # one full row, as a batch padded to its longest member has
            feeds[name] = values.astype(lengths.dtype)

    def _place_offsets(self, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """An EmbeddingBag's offsets start each bag in the flat indices: ascending from 0 and at most their
        length (the longest other 1-D integer input), so that every bag reads indices and none runs backwards."""
        for name, role in self.facts.roles.items():
            offsets = feeds.get(name)
            if role.role != "offsets" or offsets is None or offsets.ndim != 1 or not offsets.size:
                continue
            flat = [v.shape[0] for n, v in feeds.items() if n != name and v.ndim == 1 and v.dtype.kind in "iu"]
            length = max(flat, default=offsets.size)
            starts = np.sort(rng.integers(0, length + 1, size=offsets.size))
            starts[0] = 0
            feeds[name] = starts.astype(offsets.dtype)

    def _past_length(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        for spec in self.specs:
            role = self._role(spec.name)
            if (
                role.role == "past_key_values"
                and role.past_axis is not None
                and len(shapes[spec.name]) > role.past_axis
            ):
                return int(shapes[spec.name][role.past_axis])
        return 0

    def _values(
        self,
        spec: InputSpec,
        shape: tuple[int, ...],
        rng: np.random.Generator,
        guess: Guess,
        past: int,
        *,
        cache: bool = True,
    ) -> np.ndarray:
        role, dtype = self._role(spec.name), spec.dtype
        kind = role.role
        if kind == "use_cache_branch":
            return np.full(shape, role.cache_value if cache else not role.cache_value, dtype=bool)
        if kind == "attention_mask":  # a language model's generation pads nothing (InputSynthesis.why)
            if role.cross:  # over the encoder's sequence: no past in it
                return _mask(shape, rng, 0, guess.padding).astype(dtype)
            return _mask(shape, rng, past, guess.padding and not self.facts.causal_lm).astype(dtype)
        if kind == "bool":
            return rng.integers(0, 2, size=shape).astype(bool)
        if kind == "strings":
            return np.asarray(role.words, dtype=object)[rng.integers(0, len(role.words), size=shape)]
        if kind == "token_type_ids":
            return rng.integers(0, role.high or 2, size=shape).astype(dtype)
        if kind == "position_ids" and shape:
            return np.broadcast_to(np.arange(past, past + shape[-1]), shape).astype(dtype)
        if kind == "labels":
            labels = rng.integers(0, role.high or 10, size=shape)
            labels[rng.random(size=shape) < 0.2] = IGNORE_INDEX
            return labels.astype(dtype)
        if kind in ("token_ids", "int", "position_ids", "offsets", "lengths"):  # the last two: placed after
            high = max(role.high or 1, 1)
            ids = rng.integers(0, high, size=shape)
            special = set(role.avoid) | set(role.markers)
            if special and len(special) < high:
                for _ in range(len(special)):  # move each special id to the next ordinary one
                    hit = np.isin(ids, list(special))
                    if not hit.any():
                        break
                    ids[hit] = (ids[hit] + 1) % high
            return ids.astype(dtype)
        if dtype.kind == "f":
            return rng.standard_normal(size=shape).astype(dtype)
        if dtype.name == "bfloat16":  # samples.npz cannot help: numpy has no bfloat16 to store them in
            raise InvalidModelError(
                f"input {spec.name!r} is bfloat16: ONNX Runtime's Python API takes no bfloat16 arrays and its CPU "
                "kernels run few bfloat16 ops, so this service cannot run the model; export it with float16 or "
                "float32 inputs and weights",
                code="UNSUPPORTED_INPUT",
            )
        raise InvalidModelError(
            f"input {spec.name!r} has dtype {dtype}, for which no inputs can be generated; upload samples.npz",
            code="UNSUPPORTED_INPUT",
        )

    def _place_markers(self, feeds: dict[str, np.ndarray], guess: Guess) -> None:
        """Each row's last valid token becomes the id the graph selects positions by (BART's ``</s>``)."""
        masks = [
            feeds[n] for n, r in self.facts.roles.items() if r.role == "attention_mask" and not (r.decoder or r.cross)
        ]
        for name, role in self.facts.roles.items():
            markers = role.markers or ((role.avoid[-1:]) if guess.all_markers else ())
            ids = feeds.get(name)
            if role.role != "token_ids" or not markers or ids is None or ids.ndim < 1 or ids.shape[-1] == 0:
                continue
            seq = ids.shape[-1]
            mask = next((m for m in masks if m.ndim == ids.ndim and m.shape[:-1] == ids.shape[:-1]), None)
            if mask is not None and mask.shape[-1] >= seq:
                valid = (np.asarray(mask)[..., -seq:] != 0).sum(axis=-1)
            else:
                valid = np.full(ids.shape[:-1], seq)
            last = np.maximum(valid, 1) - 1
            np.put_along_axis(ids, last[..., None].astype(np.int64), markers[0], axis=-1)

    # ------------------------------------------------------------------------------------------- sets

    def input_set(
        self, index: int, guess_index: int = 0, override: Mapping[str, Sequence[int]] | None = None
    ) -> InputSet:
        guess = GUESSES[guess_index]
        cache = self.cache_branch(index)
        shapes = self.bind(index, guess, override, cache=cache)
        rng = np.random.default_rng([self.seed, index] if guess_index == 0 else [self.seed, index, guess_index])
        feeds = self.feeds(shapes, rng, guess, cache)
        roles = self.facts.roles
        provenance = self._provenance(shapes, guess, "shapes" if override else "generated")
        if (why := self.why(shapes, cache)) is not None:
            provenance["why"] = why
        following = self._guess_after(guess_index)
        retry = None
        if override is None and following is not None:

            def retry() -> InputSet:
                return self.input_set(index, following)

        name = _set_name(shapes)
        if cache is not None:
            flag = next(n for n, r in roles.items() if r.role == "use_cache_branch")
            value = roles[flag].cache_value if cache else not roles[flag].cache_value
            name += f" ({flag}={value}: the {'cache' if cache else 'no-cache'} branch)"
        return InputSet(name, feeds, provenance, retry)

    def serving_set(self, length: int, guess_name: str | None = None) -> InputSet | None:
        """One full row of ``length`` tokens (within the position table) under the guess ``guess_name`` (the
        one the job's sets ran under): a length teams serve, where a fused attention's gain shows that the
        generated sets' 8-32 tokens hide. None for a model without token ids over a free sequence dim (images,
        audio: their sets are full-sized already) or with a key/value cache (decode is timed as decode)."""
        if self.facts.has_past or self.cache_branch(0) is not None:
            return None
        free = self.free_dims()
        ids = [s for s in self.specs if self._role(s.name).role == "token_ids"]
        if not any(isinstance(d, str) and free.get(d, {}).get("role") == "sequence" for s in ids for d in s.dims):
            return None
        cap = self._positions()
        if cap:
            length = min(length, cap)
        table = self.facts.max_positions
        why = f"a serving length: one row of {length} tokens"
        why += f" (the position table holds {table})" if table else ""
        return self._one_row(free, length, guess_name, why, "serving length")

    def serving_image_set(self, side: int, guess_name: str | None = None) -> InputSet | None:
        """One image of ``side`` x ``side`` pixels where the graph leaves the image size free (a convnet, a ViT
        that interpolates its position table, Optimum's dynamic height and width): the generated sets take their
        sides from the text lengths (8-32 pixels), which say little about serving. None where no image input has
        a free side (a position table fixes it: the sets are full-sized already)."""
        if side <= 0:
            return None
        free = self.free_dims()
        sides = {
            dim
            for spec in self.specs
            if self._role(spec.name).role == "pixel_values"
            for axis, dim in enumerate(spec.dims)
            if axis >= 2 and isinstance(dim, str) and dim in free
        }
        if not sides:
            return None
        why = f"a serving size: one image of {side} x {side} pixels (the graph leaves the size free)"
        return self._one_row(free, side, guess_name, why, "serving size")

    def _one_row(
        self, free: dict[str, dict[str, Any]], size: int, guess_name: str | None, why: str, label: str
    ) -> InputSet:
        """One row (batch 1, no past) with every other free dim at ``size`` (or its minimum), under the guess
        ``guess_name``; named ``<shapes> (<label>)``, ``why`` in its provenance."""
        guess = next((g for g in GUESSES if g.name == guess_name), GUESSES[0])
        rows = self._rows(guess)
        sizes = {
            dim: rows if plan["role"] == "batch" else 0 if plan["role"] == "past" else max(size, plan["min"])
            for dim, plan in free.items()
        }
        shapes = self.bind(0, guess, preset=sizes)
        feeds = self.feeds(shapes, np.random.default_rng([self.seed, size]), guess)
        provenance = self._provenance(shapes, guess, "generated")
        provenance["why"] = why
        return InputSet(f"{_set_name(shapes)} ({label})", feeds, provenance)

    def why(self, shapes: Mapping[str, tuple[int, ...]], cache: bool | None = None) -> str | None:
        """For a decoder-only language model, a seq2seq decoder or a merged decoder (``cache``: the branch it
        runs), why its set is shaped as it is (the report shows it); None for other models, whose sets follow
        the module's rules alone."""
        if cache is not None:
            flag = next(n for n, r in self.facts.roles.items() if r.role == "use_cache_branch")
            value = self._role(flag).cache_value if cache else not self._role(flag).cache_value
            if not cache:
                ids = next((s for n, s in shapes.items() if self._role(n).role == "token_ids" and s), (1, 0))
                return (
                    f"merged decoder, {flag}={value}: the no-cache branch (the first generation step, "
                    f"decoder_model.onnx's graph), {ids[0]} row(s) of {ids[-1]} token(s); every cache input a "
                    f"dummy {NO_CACHE_PAST} position(s) long, as Optimum's runtime feeds it, which this branch "
                    "never reads"
                )
            inner = self._seq2seq_why(shapes) if self.facts.encoder_decoder else self._lm_why(shapes)
            return (
                f"merged decoder, {flag}={value}: the cache branch (every later step, decoder_with_past's "
                f"graph); {inner}"
            )
        if self.facts.encoder_decoder:
            return self._seq2seq_why(shapes)
        if not self.facts.causal_lm:
            return None
        return self._lm_why(shapes)

    def _lm_why(self, shapes: Mapping[str, tuple[int, ...]]) -> str:
        batch = next((s[0] for n, s in shapes.items() if self._role(n).role == "token_ids" and s), 1)
        seq = next((s[-1] for n, s in shapes.items() if self._role(n).role == "token_ids" and s), 0)
        past = self._past_length(shapes)
        if past and seq == 1:
            call = f"decode: {batch} row(s) of 1 new token on a past of {past}"
        elif past:
            call = f"a prompt of {seq} tokens after a past of {past} (batch {batch})"
        else:
            call = f"prefill: {batch} row(s) of {seq} tokens on an empty past"
        return (
            f"decoder-only language model, {call}; unpadded attention mask, positions counting on from the "
            "past: the calls generation makes. A padded row's pad positions hold values no caller reads, "
            "which a fused attention (GroupQueryAttention) need not reproduce; padded batches are verified "
            "on samples.npz when uploaded"
        )

    def _seq2seq_why(self, shapes: Mapping[str, tuple[int, ...]]) -> str:
        encoder = self.encoder_axes()
        enc = next((shapes[n][axis] for n, axis in encoder.items() if len(shapes[n]) > axis), 0)
        ids = next((s for n, s in shapes.items() if self._role(n).role == "token_ids" and s), (1, 0))
        call = f"{ids[0]} row(s) of {ids[-1]} token(s)"
        if self.facts.has_past:
            call += f" on a self-attention cache of {self._past_length(shapes)}"
        fixed = any(self._role(n).role == "cross_key_values" for n in encoder)
        return f"seq2seq decoder, {call}; {', '.join(encoder)} span one encoder sequence of {enc}" + (
            " (the cross-attention cache: as long as the encoder's output, never growing)" if fixed else ""
        )

    def generate(self, count: int, shapes: Sequence[Mapping[str, Sequence[int]]] | None = None) -> list[InputSet]:
        overrides: list[Mapping[str, Sequence[int]] | None] = list(shapes) if shapes else [None] * count
        return [self.input_set(i, 0, o) for i, o in enumerate(overrides)]

    def feeds_for_sizes(self, sizes: Mapping[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Feeds with the symbolic dims in ``sizes`` bound (a trace call of ``shape_profile``); the dims it
        does not name (a mask over past + new tokens, audio samples) follow from them. A merged decoder runs
        its cache branch, unless ``sizes`` bind the past to 0: that call is the first step, its no-cache
        branch (a prefill, as Optimum's runtime makes it)."""
        cache = True
        for spec in self.specs:
            role = self._role(spec.name)
            if role.role == "past_key_values" and role.past_axis is not None and role.past_axis < spec.rank:
                dim = spec.dims[role.past_axis]
                if isinstance(dim, str) and sizes.get(dim) == 0 and self.cache_branch(0) is not None:
                    cache = False
                break
        return self.feeds(self.bind(0, GUESSES[0], preset=sizes, cache=cache), rng, cache=cache)

    def feeds_at(self, batch: int, sequence: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Feeds with every batch-like dim at ``batch`` and every sequence-like one (and a past) at
        ``sequence``, within the minimum the graph needs (audio samples). A decoder-only language model with a
        cache decodes one new token per row of a batch of several after its past, as generation does (ORT's
        GroupQueryAttention refuses several rows of several new tokens on a past)."""
        decoding = self.facts.causal_lm and self.facts.has_past and batch > 1
        sizes = {
            dim: batch
            if plan["role"] == "batch"
            else 1
            if decoding and plan["role"] == "sequence"
            else max(sequence, plan["min"])
            for dim, plan in self.free_dims().items()
        }
        return self.feeds_for_sizes(sizes, rng)

    def free_dims(self) -> dict[str, dict[str, Any]]:
        """Symbolic dims a caller may choose, in order of first appearance: ``{"role": "batch" | "sequence" |
        "past", "min": smallest valid size}``. Dims fixed by the graph (image sides read from a position
        table) or derived (sums, a mask over past + new tokens) are left out."""
        out: dict[str, dict[str, Any]] = {}
        derived: set[str] = set()
        encoder = self.encoder_axes()
        encoder_dim = None  # the first dim over the encoder's sequence is free; the others follow it
        for spec in self.specs:
            role = self._role(spec.name)
            for axis, dim in enumerate(spec.dims):
                if not isinstance(dim, str) or dim in out or dim in derived:
                    continue
                if encoder.get(spec.name) == axis:
                    if encoder_dim is None:
                        encoder_dim = dim
                        out[dim] = {"role": "sequence", "min": 1}
                    else:
                        derived.add(dim)
                    continue
                spatial = _spatial_start(role, spec.rank)
                if _EXPR.match(dim) or (spatial is not None and axis >= spatial and role.exact_out):
                    derived.add(dim)
                    continue
                if role.role == "past_key_values" and axis == role.past_axis:
                    out[dim] = {"role": "past", "min": 0}
                elif axis == 0 and dim_role(dim, axis) == "batch":
                    out[dim] = {"role": "batch", "min": 1}
                elif spatial is not None and axis >= spatial:
                    out[dim] = {"role": "sequence", "min": role.min_length(1, axis - spatial)}
                elif role.role == "attention_mask" and self.facts.has_past and axis == spec.rank - 1:
                    derived.add(dim)
                else:
                    out[dim] = {"role": dim_role(dim, axis).replace("seq", "sequence"), "min": 1}
        return out


def _spatial_start(role: InputRole, rank: int) -> int | None:
    """The first axis a convolution stack slides over: raw audio's last ([batch, samples], or [batch, 1,
    samples] with its channel), the axes after [batch, channels] of features and pixels; None for other roles."""
    if role.role == "audio":
        return rank - 1
    return 2 if role.role in ("features", "pixel_values") else None


def _mask(shape: tuple[int, ...], rng: np.random.Generator, past: int, padding: bool) -> np.ndarray:
    """1 for valid tokens then 0 for padding, per row; each row has a valid token; row 0 is full. Over a
    past, the past positions are all valid and the padding falls in the new tokens."""
    if len(shape) < 1 or 0 in shape or not padding:
        return np.ones(shape, dtype=np.int64)
    total = shape[-1]
    past = min(past, total - 1)
    seq = total - past
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    lengths = rng.integers(1, seq + 1, size=rows)
    lengths[0] = seq
    mask = (np.arange(total)[None, :] < past + lengths[:, None]).astype(np.int64)
    return mask.reshape(shape)


def _set_name(shapes: Mapping[str, tuple[int, ...]]) -> str:
    return "; ".join(f"{k}={'x'.join(str(d) for d in v) or 'scalar'}" for k, v in shapes.items())


def generate_input_sets(
    model: onnx.ModelProto | ir.Model,
    count: int,
    *,
    seed: int = 0,
    shapes: Sequence[Mapping[str, Sequence[int]]] | None = None,
) -> list[InputSet]:
    """``count`` generated input sets (or one per entry of ``shapes`` when given)."""
    return InputSynthesis(model, seed=seed).generate(count, shapes)


def index_ranges(model: onnx.ModelProto | ir.Model) -> dict[str, int]:
    """Integer inputs read as indices into a constant table (token ids, token types): the values' bound."""
    return {
        name: int(role.high)
        for name, role in analyze(model).roles.items()
        if role.role in ("token_ids", "token_type_ids") and role.high
    }


def serving_input_set(
    synthesis: InputSynthesis, sets: Sequence[InputSet], *, length: int, image_side: int = 0
) -> InputSet | None:
    """``synthesis.serving_set`` (the synthesis that made ``sets``, so the graph is read once) when it outgrows
    the generated ``sets``, else for an image model of free size ``synthesis.serving_image_set``: None when the
    model has neither, or when it is no larger than the largest of ``sets`` (it would tell the gate nothing
    new)."""
    if not sets:
        return None
    guess = sets[0].provenance.get("guess")
    serving = synthesis.serving_set(length, guess) if length > 0 else None
    rank = 2  # token rows [batch, tokens]
    if serving is None:
        serving, rank = synthesis.serving_image_set(image_side, guess), 4  # images [batch, channels, h, w]
    if serving is None:
        return None
    return serving if _last_dim(serving, rank) > max(_last_dim(s, rank) for s in sets) else None


def _last_dim(input_set: InputSet, rank: int) -> int:
    """The largest last dim among the set's feeds of ``rank`` (tokens of a row, the side of an image)."""
    return max((a.shape[-1] for a in input_set.feeds.values() if a.ndim == rank), default=0)


def make_input_sets(
    model: onnx.ModelProto | ir.Model,
    *,
    count: int,
    seed: int = 0,
    shapes: Sequence[Mapping[str, Sequence[int]]] | None = None,
    samples_path: Path | None = None,
    synthesis: InputSynthesis | None = None,
) -> list[InputSet]:
    """The input sets of a job: explicit shapes win, then samples.npz, else ``count`` generated sets.
    ``synthesis``: the model's, when the caller keeps it for more sets (``serving_input_set``)."""
    if shapes:
        return (synthesis or InputSynthesis(model, seed=seed)).generate(len(shapes), shapes)
    if samples_path is not None:
        return [load_samples(samples_path, model)]
    return (synthesis or InputSynthesis(model, seed=seed)).generate(count)
