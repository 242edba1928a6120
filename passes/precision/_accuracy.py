"""How a quantized model compares with the original: per-output accuracy, the pass's budget, and the ORT
runs (graph optimizations off) of the model files both quantization passes write.

For a language model a tensor tolerance says little: a logits cosine of 0.997 can still flip the greedy token
at 4% of positions (issue 19). Where the graph has a logits output (the float output an LM head MatMul
reaches) and the samples carry token ids, the budget also measures, under teacher forcing, next-token top-1
agreement, the max logit difference and the perplexity of the sample tokens under each model (``TokenProbe``).
The sequences are the context's samples (the user's samples.npz when sent, else the verification inputs, whose
uniform random ids are no text: a caller may then judge on sequences drawn from the original model itself,
``sample_texts``); a KV-cache decoder gets each of them as a prefill (empty past, positions from 0), so every
position of the sequence is predicted from the true tokens before it. A seq2seq decoder's prefill keeps its
encoder context whole (the cross-attention cache or encoder states and the mask over the encoder's sequence,
as ``core.inputs.analyze`` reads them from the graph): emptied with the self-attention cache, the probe judged
the greedy tokens of a decoder that saw no source, which no user runs. Perplexity is only meaningful where
those samples are real text, so it is reported always and gated only when asked.

Shared by the driver (``_quantization.py``) and the sensitivity ranking (``_sensitivity.py``); it imports
neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from core.config import Tolerance
from core.inputs import InputRole, cache_pairs


@dataclass
class OutputAccuracy:
    """How one output of the quantized model compares with the original's, worst over the samples."""

    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0
    # Share of the elements outside the job's atol + rtol * |ref| (``compare_arrays``' ``elements``); None
    # when measured without it.
    beyond: float | None = None

    def to_dict(self) -> dict[str, float]:
        out = {
            "max_abs": round_sig(self.max_abs),
            "rel_l2": round_sig(self.rel_l2),
            "cosine": round_sig(self.cosine, 8),
        }
        if self.beyond is not None:
            out["beyond_tolerance"] = round_sig(self.beyond)
        return out


def round_sig(x: float, digits: int = 4) -> float:
    if not math.isfinite(x) or x == 0:
        return float(x)
    return float(f"{x:.{digits}g}")


def compare_arrays(ref: np.ndarray, got: np.ndarray, elements: Tolerance | None = None) -> OutputAccuracy:
    """``got`` against ``ref``; with ``elements``, also the share of elements outside its atol + rtol * |ref|,
    as the engine's verification counts them (``numpy.isclose``, the bounds of ``ref``'s dtype)."""
    r = np.asarray(ref, dtype=np.float64).ravel()
    g = np.asarray(got, dtype=np.float64).ravel()
    if r.shape != g.shape:
        return OutputAccuracy(math.inf, math.inf, -1.0, None if elements is None else 1.0)
    if not r.size:
        return OutputAccuracy(beyond=None if elements is None else 0.0)
    beyond = None
    if elements is not None:
        beyond = 1.0 - float(np.count_nonzero(elements.close(r, g, np.asarray(ref).dtype))) / r.size
    diff = g - r
    if not np.all(np.isfinite(diff)):
        return OutputAccuracy(math.inf, math.inf, -1.0, beyond)
    nr, ng = float(np.linalg.norm(r)), float(np.linalg.norm(g))
    max_abs = float(np.abs(diff).max())
    rel = float(np.linalg.norm(diff)) / nr if nr else (0.0 if not ng else math.inf)
    cosine = float(np.dot(r, g)) / (nr * ng) if nr and ng else (1.0 if nr == ng else 0.0)
    return OutputAccuracy(max_abs, rel, cosine, beyond)


def worst(acc: Sequence[OutputAccuracy]) -> OutputAccuracy:
    shares = [a.beyond for a in acc if a.beyond is not None]
    return OutputAccuracy(
        max((a.max_abs for a in acc), default=0.0),
        max((a.rel_l2 for a in acc), default=0.0),
        min((a.cosine for a in acc), default=1.0),
        max(shares) if shares else None,
    )


@dataclass
class TokenAccuracy(OutputAccuracy):
    """The logits output under teacher forcing: the tensor figures (``max_abs`` is the max logit difference)
    plus next-token agreement and perplexity, over every position of every sequence."""

    positions: int = 0
    flipped: int = 0  # positions whose greedy (argmax) token differs from the original's
    perplexity_original: float | None = None
    perplexity_quantized: float | None = None

    @property
    def top1_agreement(self) -> float:
        return 1.0 - self.flipped / self.positions if self.positions else 1.0

    @property
    def perplexity_increase(self) -> float | None:
        if self.perplexity_original is None or self.perplexity_quantized is None:
            return None
        return self.perplexity_quantized / self.perplexity_original - 1.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **super().to_dict(),
            "max_logit_diff": round_sig(self.max_abs),
            "top1_agreement": round_sig(self.top1_agreement, 6),
            "flipped": self.flipped,
            "positions": self.positions,
        }
        if self.perplexity_original is not None and self.perplexity_quantized is not None:
            out["perplexity"] = {
                "original": round_sig(self.perplexity_original, 6),
                "quantized": round_sig(self.perplexity_quantized, 6),
            }
        return out


@dataclass
class Budget:
    min_cosine: float
    max_rel_error: float | None
    max_abs_error: float | None
    min_top1_agreement: float | None = None
    max_perplexity_increase: float | None = None
    # The job's tolerance (``PassContext.tolerance``, or the pass's ``tolerance`` option): every float output
    # measured with it (``measure(elements=...)``) keeps its share of elements outside atol + rtol * |ref| and
    # its cosine within it, as the engine's verification will require.
    elements: Tolerance | None = None

    def misses(self, accuracy: dict[str, OutputAccuracy]) -> list[str]:
        """Why ``accuracy`` misses the budget, one line per failed output and criterion; empty when it holds."""
        problems = []
        elements = self.elements
        min_cosine = self.min_cosine if elements is None else max(self.min_cosine, elements.min_cosine)
        for name, a in accuracy.items():
            if isinstance(a, TokenAccuracy):
                if self.min_top1_agreement is not None and a.top1_agreement < self.min_top1_agreement:
                    problems.append(
                        f"{name}: top-1 agreement {a.top1_agreement:.4f} < {self.min_top1_agreement} ({a.flipped} "
                        f"of {a.positions} greedy tokens flipped, max logit diff {a.max_abs:.4g})"
                    )
                increase = a.perplexity_increase
                limit = self.max_perplexity_increase
                if limit is not None and increase is not None and increase > limit:
                    problems.append(
                        f"{name}: perplexity {a.perplexity_quantized:.5g} vs {a.perplexity_original:.5g} "
                        f"(+{increase:.2%} > +{limit:.2%})"
                    )
            if a.cosine < min_cosine:
                problems.append(f"{name}: cosine {a.cosine:.6f} < {min_cosine}")
            if elements is not None and a.beyond is not None and a.beyond > elements.max_mismatch_ratio:
                problems.append(
                    f"{name}: {a.beyond:.2%} of elements outside the job's tolerance (atol={elements.atol:g} "
                    f"rtol={elements.rtol:g}; it allows {elements.max_mismatch_ratio:.2%})"
                )
            if self.max_rel_error is not None and a.rel_l2 > self.max_rel_error:
                problems.append(f"{name}: relative L2 error {a.rel_l2:.4g} > {self.max_rel_error}")
            if self.max_abs_error is not None and a.max_abs > self.max_abs_error:
                problems.append(f"{name}: max abs error {a.max_abs:.4g} > {self.max_abs_error}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_cosine": self.min_cosine,
            "max_rel_error": self.max_rel_error,
            "max_abs_error": self.max_abs_error,
            "min_top1_agreement": self.min_top1_agreement,
            "max_perplexity_increase": self.max_perplexity_increase,
            **({} if self.elements is None else {"job_tolerance": self.elements.model_dump()}),
        }


def session(path: Path, threads: int = 0) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds_for(sess: Any, samples: Sequence[dict[str, np.ndarray]], limit: int) -> list[dict[str, np.ndarray]]:
    """The samples that give every input of ``sess``, restricted to its inputs, at most ``limit``."""
    names = [i.name for i in sess.get_inputs()]
    feeds = [{n: s[n] for n in names} for s in samples if all(n in s for n in names)]
    return feeds[:limit]


def float_outputs(sess: Any) -> list[str]:
    return [o.name for o in sess.get_outputs() if o.type in ("tensor(float)", "tensor(float16)", "tensor(double)")]


def run_outputs(path: Path, feeds: Sequence[dict[str, np.ndarray]], names: Sequence[str]) -> list[list[np.ndarray]]:
    sess = session(path)
    return [sess.run(list(names), f) for f in feeds]


def measure(
    path: Path,
    feeds: Sequence[dict[str, np.ndarray]],
    names: Sequence[str],
    reference: list[list[np.ndarray]],
    probe: TokenProbe | None = None,
    *,
    elements: Tolerance | None = None,
) -> dict[str, OutputAccuracy]:
    """Per-output accuracy of the model at ``path`` against the reference outputs, worst over the feeds (with
    ``elements``, the share outside it too: ``compare_arrays``); with a ``probe``, also its teacher-forced
    next-token figures under the key ``probe.key``."""
    got = run_outputs(path, feeds, names)
    accuracy = {
        name: worst([compare_arrays(ref[i], out[i], elements) for ref, out in zip(reference, got, strict=True)])
        for i, name in enumerate(names)
    }
    if probe is not None:
        accuracy[probe.key] = probe.measure(path)
    return accuracy


# ------------------------------------------------------------------------------------ next-token figures

# Ops between an LM head and its graph output that keep "the head's output": shape changes, casts and
# elementwise scaling/bias/soft-capping. A norm or a Concat (a KV cache) is not.
_PASS_THROUGH = {
    "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast", "Transpose",
    "Add", "Sub", "Mul", "Div", "Tanh",
}  # fmt: skip


def head_outputs(model: ir.Model) -> dict[str, str]:
    """``{graph output: head node}`` for every output a MatMul/Gemm (or ORT's FusedMatMul, as onnxscript's
    fusions leave a tied head) reaches through ``_PASS_THROUGH`` ops only (found from the graph, never by name)."""
    heads: dict[str, str] = {}
    for output in model.graph.outputs:
        value: ir.Value | None = output
        while value is not None and (node := value.producer()) is not None:
            if (node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx")) or (
                node.op_type == "FusedMatMul" and node.domain == "com.microsoft"  # a tied head, fused by onnxscript
            ):
                if node.name:
                    heads[output.name] = node.name
                break
            if node.op_type not in _PASS_THROUGH or node.domain not in ("", "ai.onnx"):
                break
            # follow the one non-constant input; two computed inputs (a residual Add) end the walk
            computed = [v for v in node.inputs if v is not None and v.const_value is None and v.producer() is not None]
            computed = [v for v in computed if v.producer().op_type != "Constant"]
            value = computed[0] if len(computed) == 1 else None
    return heads


def logits_output(model: ir.Model) -> str | None:
    """The logits output: a float output of rank >= 2 that an LM head reaches, whose last dim is the head
    weight's (the vocabulary) where both are known."""
    producers = {n.name: n for n in model.graph if n.name}
    for output, head in head_outputs(model).items():
        value = next(o for o in model.graph.outputs if o.name == output)
        if value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE):
            continue
        if value.shape is not None and len(value.shape) < 2:
            continue
        node = producers[head]
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        vocab = None
        if weight is not None and weight.const_value is not None and weight.const_value.shape:
            vocab = weight.const_value.shape[0 if node.attributes.get_int("transB", 0) else -1]
        last = value.shape[-1] if value.shape is not None else None
        if isinstance(last, int) and isinstance(vocab, int) and last != vocab:
            continue
        return output
    return None


def _token_input(inputs: Sequence[Any]) -> str | None:
    ints = [i for i in inputs if i.type in ("tensor(int64)", "tensor(int32)")]
    for i in ints:
        if i.name == "input_ids":
            return str(i.name)
    plain = [i for i in ints if not any(w in i.name.lower() for w in ("mask", "position", "type", "seqlen"))]
    return str(plain[0].name) if plain else None


# Roles (core.inputs.analyze) of the inputs that carry a seq2seq decoder's encoder context.
_ENCODER_ROLES = frozenset({"cross_key_values", "encoder_states"})


def encoder_inputs(roles: Mapping[str, InputRole]) -> frozenset[str]:
    """The inputs that give a seq2seq decoder its encoder context: the cross-attention cache, the encoder's
    states and the mask over the encoder's sequence. Every decoder position attends to all of it, whatever
    the decoder's past, so a prefill keeps it as the sample has it."""
    return frozenset(
        name for name, r in roles.items() if r.role in _ENCODER_ROLES or (r.role == "attention_mask" and r.cross)
    )


def _role_of(roles: Mapping[str, InputRole], name: str, floats: bool) -> str | None:
    """An input's role as the graph gives it; for an input the analysis did not see, the role its name says
    (a float ``*past*`` cache, a ``*mask*``, ``*position*``), else None."""
    if name in roles:
        return roles[name].role
    low = name.lower()
    if "past" in low and floats:
        return "past_key_values"
    return "attention_mask" if "mask" in low else "position_ids" if "position" in low else None


def prefill(sess: Any, sample: dict[str, np.ndarray], roles: Mapping[str, InputRole]) -> dict[str, np.ndarray] | None:
    """``sample`` as a prefill of its tokens: the self-attention cache inputs empty, the attention mask cut to
    the new tokens and the positions counted from 0; the encoder's inputs (``encoder_inputs``) as they are. Each
    input is read by its role in ``roles`` (the graph's: a cache is found by what the graph does with it, not by
    its name). A sample without a self-attention cache, or with an empty one, is fed as it is; None when the
    sample lacks an input or its token ids are not 2-D."""
    inputs = sess.get_inputs()
    tokens = [i for i in inputs if i.name in roles and roles[i.name].role == "token_ids"]
    token = _token_input(tokens) if len(tokens) > 1 else tokens[0].name if tokens else _token_input(inputs)
    if token is None or token not in sample or np.asarray(sample[token]).ndim != 2:
        return None
    ids = np.asarray(sample[token])
    batch, seq = ids.shape
    encoder = encoder_inputs(roles) & {i.name for i in inputs}
    if any(name not in sample for name in encoder):
        return None
    role = {i.name: _role_of(roles, i.name, i.type.startswith("tensor(float")) for i in inputs}
    pasts = {
        i.name: _past_axis(roles.get(i.name))
        for i in inputs
        if role[i.name] == "past_key_values" and i.type.startswith("tensor(float") and i.name not in encoder
    }
    if any(name not in sample for name in pasts):
        return None
    had_past = any(np.asarray(sample[name]).ndim >= 2 and sample[name].shape[axis] for name, axis in pasts.items())
    feed: dict[str, np.ndarray] = {}
    for i in inputs:
        name = i.name
        if name in encoder:
            feed[name] = sample[name]
        elif name in pasts and had_past:
            shape = list(sample[name].shape)
            shape[pasts[name]] = 0
            feed[name] = np.zeros(shape, dtype=sample[name].dtype)
        elif role[name] == "attention_mask" and had_past:
            mask = sample.get(name)
            cut = mask[:, -seq:] if mask is not None and mask.ndim == 2 and mask.shape[1] >= seq else None
            feed[name] = np.ones((batch, seq), dtype=np.dtype(i.type[7:-1])) if cut is None else cut.copy()
        elif role[name] == "position_ids" and had_past:
            dtype = np.dtype(i.type[7:-1])
            feed[name] = _arange_like(sample.get(name), len(i.shape), batch, seq, dtype)
        elif name in sample:
            feed[name] = sample[name]
        else:
            return None
    return feed


def _arange_like(given: np.ndarray | None, rank: int, batch: int, seq: int, dtype: Any) -> np.ndarray:
    """Positions 0..seq-1 in a position input's layout: [seq], [batch, seq], or one row per rope section
    ([sections, batch, seq], multimodal rope: a text token's sections all read its position)."""
    positions = np.arange(seq, dtype=dtype)
    if rank == 1:
        return positions
    if rank == 3:
        sections = given.shape[0] if given is not None and given.ndim == 3 else 3
        return np.broadcast_to(positions, (sections, batch, seq)).copy()
    return np.broadcast_to(positions, (batch, seq)).copy()


def _past_axis(role: InputRole | None) -> int:
    """The cache's past-length axis as the graph gives it, else -2 ([..., past, head_size]: TorchScript,
    dynamo and Optimum caches alike)."""
    if role is not None and role.role == "past_key_values" and role.past_axis is not None:
        return role.past_axis
    return -2


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Texts:
    """``sample_texts``' sequences (prefill feeds) and how they were drawn, or why there are none."""

    feeds: Sequence[dict[str, np.ndarray]]
    how: str


# Tokens drawn per sequence by ``sample_texts`` (each one a run of the prefill): positions enough to judge the
# greedy tokens by, at a bounded cost on a large decoder.
TEXT_TOKENS = 48
# Seconds ``sample_texts`` may spend drawing: past them every sequence is cut to the tokens drawn so far (at
# least two). A decoder without a cache runs its whole prefix per position: minutes for a 0.5B one.
DRAW_SECONDS = 30.0


def sample_texts(
    src: Path,
    logits: str | None,
    samples: Sequence[dict[str, np.ndarray]],
    limit: int,
    roles: Mapping[str, InputRole],
    *,
    length: int = TEXT_TOKENS,
    seed: int = 0,
    seconds: float = DRAW_SECONDS,
) -> Texts:
    """Token sequences drawn from the model at ``src`` itself, as prefills of ``length`` tokens at the samples'
    batch sizes, and how.

    The engine's generated inputs hold uniform random token ids. A trained decoder's greedy token on such a
    sequence is decided by small margins, so even every MatMul 8-bit flipped 3 of 44 of them on the trained
    test decoder and int4 was refused for want of text. Each position here is drawn from the model's own
    next-token distribution (temperature 1, seeded) given the tokens before it: text the model finds
    plausible, which is what it will be run on, without a tokenizer or a corpus. A random-weight model's
    distribution is nearly uniform, so its sequences stay as random as before. Only for a causal model (the
    logits of a position unchanged when a later token changes; a masked LM reads both ways).

    Each sample's prefill is resized to ``length`` where every input over its sequence has a role that says
    how (token ids, mask, positions, token types: ``_resized``), so a decode step of one token still yields a
    sequence and 0.99 top-1 agreement is judged on a few hundred positions, not a few dozen; else, or where the
    model refuses that length, it keeps its own length. Drawing stops after ``seconds``: the sequences are then
    cut to the tokens drawn (at least two each; the reason says so). Empty, with the reason, when none can be
    drawn."""
    if logits is None:
        return Texts([], "no logits output")
    sess = session(src)
    token = _token_input(sess.get_inputs())
    if token is None:
        return Texts([], "no token ids input")
    given = [f for f in (prefill(sess, s, roles) for s in samples) if f is not None][:limit]
    resized = [_resized(f, token, length, roles) for f in given]
    feeds = [f for f in resized if f[token].shape[1] > 1]
    first = next(iter(feeds), None)
    quiet, refused = _quiet_refusals()
    try:
        before = None if first is None else sess.run([logits], first, quiet)[0]
    except refused:  # a position table too short
        feeds = [f for f in given if f[token].shape[1] > 1]
        first = next(iter(feeds), None)
        try:
            before = None if first is None else sess.run([logits], first, quiet)[0]
        except refused as exc:
            return Texts([], f"the model does not run on the samples as prefills: {str(exc)[:160]}")
    if first is None or before is None:
        return Texts([], "no sample of two tokens or more")
    ids = first[token]
    if before.ndim != 3 or before.shape[:2] != ids.shape:
        return Texts([], f"the logits ({list(before.shape)}) are not one row per token")
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % before.shape[-1]
    after = sess.run([logits], {**first, token: changed})[0]
    if not np.allclose(before[:, :-1], after[:, :-1], rtol=1e-4, atol=1e-5):
        return Texts([], "not a causal language model: a position's logits depend on later tokens")
    rng = np.random.default_rng(seed)
    names = [i.name for i in sess.get_inputs()]
    pasts = [n for n in names if (r := roles.get(n)) is not None and r.role == "past_key_values"]
    pairs = cache_pairs(pasts, [o.name for o in sess.get_outputs()]) if pasts else None
    deadline = time.monotonic() + seconds
    drawn, cut = [], False
    for feed in feeds:
        stepped = None
        if isinstance(pairs, dict):
            try:
                stepped = _drawn_on_cache(sess, logits, feed, token, roles=roles, pairs=pairs, rng=rng, until=deadline)
            except refused:  # a cache the model does not take back as its past: drawn by prefills instead
                stepped = None
        ids = stepped if stepped is not None else _drawn_by_prefills(sess, logits, feed, token, rng, until=deadline)
        kept = feed
        if ids.shape[1] < feed[token].shape[1]:  # the time ran out: the sequence as far as it was drawn
            cut = True
            kept = _resized(feed, token, ids.shape[1], roles)
            if kept[token].shape[1] != ids.shape[1]:
                break
        drawn.append({**kept, token: ids})
        if time.monotonic() > deadline:
            cut = cut or len(drawn) < len(feeds)
            break
    positions = sum(int(f[token].size) for f in drawn)
    how = f"{len(drawn)} sequence(s), {positions} token(s) drawn from the original model (seed {seed})"
    return Texts(drawn, how + (f"; cut at the {seconds:g} s drawing budget" if cut else ""))


def _quiet_refusals() -> tuple[Any, tuple[type[Exception], ...]]:
    """Run options that keep ORT from logging a refusal the caller expects and handles, and the exceptions it
    raises for one (a shape or length the model does not take)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    quiet = ort_state.RunOptions()
    quiet.log_severity_level = 4
    return quiet, (ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument)


def _drawn_by_prefills(
    sess: Any, logits: str, feed: dict[str, np.ndarray], token: str, rng: Any, *, until: float
) -> np.ndarray:
    """Each position drawn from a prefill of the whole sequence (causal: the later, still undrawn tokens do not
    reach it): one run of every length per position, for a model without a cache. Past ``until`` (monotonic
    seconds), the ids drawn so far (at least two)."""
    ids = feed[token].copy()
    for t in range(1, ids.shape[1]):
        if t > 1 and time.monotonic() > until:
            return ids[:, :t]
        ids[:, t] = _draw(sess.run([logits], {**feed, token: ids})[0][:, t - 1], rng)
    return ids


def _drawn_on_cache(
    sess: Any,
    logits: str,
    feed: dict[str, np.ndarray],
    token: str,
    *,
    roles: Mapping[str, InputRole],
    pairs: Mapping[str, str],
    rng: Any,
    until: float,
) -> np.ndarray | None:
    """Each position drawn from one decode step on the cache the steps before it wrote (present fed back as
    past): a run of one token per position, where ``_drawn_by_prefills`` runs the whole prefix (47 prefills of
    48 tokens against 47 steps of one: a 0.5B decoder's draw would take minutes). None when an input over the
    new tokens has no role that says how to write it for one token (then the caller draws by prefills). Past
    ``until``, the ids drawn so far (at least two)."""
    ids = feed[token].copy()
    step = _resized(feed, token, 1, roles)
    if step is feed:
        return None
    outputs = [logits, *pairs.values()]
    encoder = encoder_inputs(roles)
    for t in range(1, ids.shape[1]):
        if t > 1 and time.monotonic() > until:
            return ids[:, :t]
        got = dict(zip(outputs, sess.run(outputs, step), strict=True))
        ids[:, t] = _draw(got[logits][:, -1], rng)
        following = {}
        for name, value in step.items():
            role = roles.get(name)
            if name == token:
                following[name] = ids[:, t : t + 1].copy()
            elif name in pairs:
                following[name] = got[pairs[name]]
            elif name in encoder or value.ndim == 0:
                following[name] = value
            elif role is not None and role.role == "attention_mask":
                following[name] = np.ones((ids.shape[0], t + 1), value.dtype)
            elif role is not None and role.role == "position_ids":
                following[name] = value + 1
            elif role is not None and role.role == "token_type_ids":
                following[name] = value
            else:
                return None
        step = following
    return ids


def _draw(row: np.ndarray, rng: Any) -> list[int]:
    """One token per batch row from its logits' softmax (temperature 1)."""
    row = row.astype(np.float64)
    probs = np.exp(row - row.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return [int(rng.choice(p.size, p=p)) for p in probs]


# How an input over the new tokens is written at another length, by its role (``core.inputs``).
_RESIZED = {
    "attention_mask": lambda old, batch, length: np.ones((batch, length), old.dtype),
    "token_type_ids": lambda old, batch, length: np.zeros((batch, length), old.dtype),
    "position_ids": lambda old, batch, length: _arange_like(old, old.ndim, batch, length, old.dtype),
}


def _resized(
    feed: dict[str, np.ndarray], token: str, length: int, roles: Mapping[str, InputRole]
) -> dict[str, np.ndarray]:
    """``feed`` (a prefill: empty past) at ``length`` new tokens, its first token kept and the others 0 (to be
    drawn), where every input over the new tokens is one ``_RESIZED`` knows (1-D or 2-D, the sequence last);
    else as it is."""
    ids = feed[token]
    batch, seq = ids.shape
    encoder = encoder_inputs(roles)
    out = dict(feed)
    for name, value in feed.items():
        role = roles.get(name)
        if name == token or name in encoder or value.ndim == 0 or (role is not None and role.role == "past_key_values"):
            continue
        sections = value.ndim == 3 and role is not None and role.role == "position_ids"
        if (
            (value.ndim > 2 and not sections)
            or value.shape[-1] != seq
            or (value.ndim >= 2 and value.shape[-2] != batch)
        ):
            continue  # not over the new tokens
        if role is None or role.role not in _RESIZED or role.cross:
            return feed
        out[name] = _RESIZED[role.role](value, batch, length)
    out[token] = np.zeros((batch, length), ids.dtype)
    out[token][:, 0] = ids[:, 0]
    return out


@dataclass
class TokenProbe:
    """Teacher-forced prefills of the samples' token sequences and the original model's logits on them."""

    logits: str
    token: str
    feeds: list[dict[str, np.ndarray]]
    reference: list[np.ndarray]
    as_prefill: bool = True  # False: the samples as they are (their cache could not be emptied)
    encoder: frozenset[str] = frozenset()  # the inputs over the encoder's sequence (``encoder_inputs``)
    drawn: str | None = None  # the sequences are ``sample_texts``' (how they were drawn), not the samples'

    @property
    def key(self) -> str:
        return f"{self.logits} (teacher forcing)"

    @classmethod
    def build(
        cls,
        src: Path,
        logits: str | None,
        samples: Sequence[dict[str, np.ndarray]],
        limit: int,
        roles: Mapping[str, InputRole],
        *,
        texts: Texts | None = None,
    ) -> TokenProbe | None:
        """None when there is no logits output or no sample carries token ids the model takes. ``roles``: the
        model's input roles (``core.inputs.analyze``), which tell a seq2seq decoder's encoder inputs apart.
        ``texts``: sequences drawn by ``sample_texts``, judged instead of the samples' where there are any."""
        if logits is None:
            return None
        sess = session(src)
        token = _token_input(sess.get_inputs())
        encoder = encoder_inputs(roles)
        if texts is not None and texts.feeds and token is not None:
            reference = [sess.run([logits], f)[0] for f in texts.feeds]
            return cls(logits, token, list(texts.feeds), reference, encoder=encoder, drawn=texts.how)
        feeds = [f for f in (prefill(sess, s, roles) for s in samples) if f is not None][:limit]
        if token is None or not feeds:
            return None
        quiet, refused = _quiet_refusals()
        try:
            reference = [sess.run([logits], f, quiet)[0] for f in feeds]
        except refused:
            # An export that cannot start from an empty cache (a cache the graph reads whole that the roles
            # do not tell apart): the samples as they are (their new tokens) still judge the greedy tokens.
            names = [i.name for i in sess.get_inputs()]
            feeds = [{n: s[n] for n in names} for s in samples if all(n in s for n in names)][:limit]
            if not feeds:
                return None
            reference = [sess.run([logits], f)[0] for f in feeds]
            return cls(logits, token, feeds, reference, as_prefill=False, encoder=encoder)
        return cls(logits, token, feeds, reference, encoder=encoder)

    def run(self, path: Path) -> list[np.ndarray]:
        """The logits of the model at ``path`` on the probe's feeds (graph optimizations off)."""
        return [outputs[0] for outputs in run_outputs(path, self.feeds, [self.logits])]

    def measure(self, path: Path) -> TokenAccuracy:
        return self.figures(self.run(path))

    def figures(self, logits: Sequence[np.ndarray]) -> TokenAccuracy:
        """The next-token figures of ``logits`` (one array per feed, as ``run`` gives) against the reference."""
        got = [[g] for g in logits]
        tensor = worst([compare_arrays(r, g[0]) for r, g in zip(self.reference, got, strict=True)])
        result = TokenAccuracy(tensor.max_abs, tensor.rel_l2, tensor.cosine)
        nll_ref = nll_got = 0.0
        scored = 0
        for feed, ref, outputs in zip(self.feeds, self.reference, got, strict=True):
            out = outputs[0]
            valid = self._valid(feed, ref.shape)
            result.positions += int(valid.sum())
            result.flipped += int(((ref.argmax(-1) != out.argmax(-1)) & valid).sum())
            ids = feed[self.token]
            if ref.ndim == 3 and ref.shape[:2] == ids.shape and ids.shape[1] > 1:
                # logits at t predict token t + 1: the sequence's own next tokens score both models
                target = ids[:, 1:, None]
                keep = valid[:, 1:] & valid[:, :-1]
                nll_ref -= float((np.take_along_axis(_log_softmax(ref[:, :-1]), target, -1)[..., 0] * keep).sum())
                nll_got -= float((np.take_along_axis(_log_softmax(out[:, :-1]), target, -1)[..., 0] * keep).sum())
                scored += int(keep.sum())
        if scored:
            result.perplexity_original = math.exp(nll_ref / scored)
            result.perplexity_quantized = math.exp(nll_got / scored)
        return result

    def positions(self, logits: Sequence[np.ndarray]) -> np.ndarray:
        """``logits`` (one array per feed) as one [positions, vocab] array of the counted positions."""
        rows = [x[self._valid(f, x.shape)] for f, x in zip(self.feeds, logits, strict=True)]
        return np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows])

    def _valid(self, feed: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Positions to count: every one, less the padding a 2-D attention mask marks (batch x sequence). The
        mask over a seq2seq encoder's sequence pads the source, not these positions, even at the same length."""
        valid = np.ones(shape[:-1], dtype=bool)
        for name, value in feed.items():
            if name in self.encoder:
                continue
            if "mask" in name.lower() and value.ndim == 2 and value.shape == valid.shape:
                valid &= value.astype(bool)
        return valid


def save_proto(proto: onnx.ModelProto, path: Path, large: bool) -> None:
    if large:
        onnx.save_model(proto, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))


def load_ir(path: Path) -> ir.Model:
    """Load a model with its external data into memory (the temporary directory is about to go)."""
    return ir.serde.deserialize_model(onnx.load(str(path), load_external_data=True))
