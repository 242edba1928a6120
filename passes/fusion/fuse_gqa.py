"""fuse_gqa: each causal self-attention of a decoder LLM becomes one ``com.microsoft::GroupQueryAttention``.

Re-implements what onnxruntime-genai's model builder emits (GQA, ``do_rotary=0``), but from the ONNX graph a
team already has, as TorchScript or dynamo export it, with or without a KV cache. ORT's python optimizer has
no such fusion for Llama-like decoders; onnxscript's ``ort_fusions/gqa.py`` needs a pure causal mask and one
exporter's node sequence. Here the structure is matched by math (``_gqa_match``) and what cannot be read from
the structure is measured (``_gqa_probe``): heads, kv heads and head size from one run, and the additive mask
run on its own at many shapes, which must be causal (+ a sliding window, which becomes
``local_window_size``) plus key padding from ``attention_mask``.

Before (one layer, Llama-like, cache; q and k rotated or not: they are opaque values here)::

    q[B,H,S,D] ------------------------------------------------------------+
    past_k --Concat(k_new)--> present.N.key --repeat_kv--Transpose--> MatMul --*scale--+mask--Softmax--+
    past_v --Concat(v_new)--> present.N.value --repeat_kv-------------------------------------------> MatMul
                                                                          --Transpose(0,2,1,3)--> out[B,S,H,D]
After::

    seqlens_k = Cast<int32>(ReduceSum(attention_mask, 1)) - 1        (once per graph)
    total_sequence_length = Cast<int32>(Shape(attention_mask)[1])
    q, k_new, v_new --[B,S,N*D]--> GroupQueryAttention(past_k, past_v, seqlens_k, total_sequence_length,
        num_heads, kv_num_heads, scale) --> out --Reshape[0,0,H,D]--> (the layer's output projection)
                                        --> present.N.key, present.N.value (the graph's outputs, same names)

A value that is ``Transpose(0,2,1,3)`` of [B,S,N,D] enters GQA as ``Reshape(x, [0,0,-1])`` (no copy; read
through a fused qkv's Slice/Split after the head Transpose, which then slices the [B,S,N,3D] view itself, and
through Reshapes to the value's own shape: ``_head_layout``, GPT-NeoX and Falcon); a
heads-first ``RotaryEmbedding`` of such a value (fuse_rotary's) is redone on that flat value with
``num_heads`` set, so no Transpose is left on either side of it; any other value through
``Transpose(0,2,1,3)`` first. Without a cache GQA runs with an empty past, and a present the graph outputs
(Optimum's no-cache branch) is GQA's own present, the new keys and values heads first (its Transposes gone:
``_gqa_rewrite._presents_without_past`` says when that is exact). The export's own head split
and merge around it (``Reshape`` to [B,S,N,D] before ``Reshape[0,0,-1]``, ``Reshape[0,0,H,D]`` before its
``Reshape`` back to [B,S,H*D]) are then no-op pairs where the leading dims provably match, and are folded
(``_gqa_reshapes``): the projection goes straight into RotaryEmbedding/GQA and GQA's output straight into
the output projection (8 Reshapes per layer and their shape arithmetic fewer per decode step).

A sliding window (Mistral) becomes ``local_window_size``; the export's crop of the past to the window before
attention (``past[:, :, -(W - 1):]``) is then redundant and dropped, GQA reading the cache input itself
(``_gqa_rewrite.rewrite_gqa`` says why that is exact); its crop of the present stays: the graph's outputs are
defined cropped. The job's own input sets keep the cache below the window, so the pass hands the engine sets
at its edge (``PassResult.verify_inputs``: one token after a cache of W - 1 and of W, two rows, a short prompt
across it; up to ``window_edge_up_to`` positions), on which this and every later stage is verified too.

Soft-capped scores (Gemma 2's ``cap * tanh(scores / cap)`` between the scale and the mask) become GQA's
``softcap``, also where the mask is not causal (T5Gemma's encoder): GQA with ``causal=0``, the mask as its
``attention_bias`` and every key counted. Attention sinks (GPT-OSS's learned logit per head in each row's
softmax, or Granite SWA's same sink as a scale of the context, ``sigmoid(logsumexp(scores) - sink)``) become its
``head_sink``; multi-query attention whose one kv head MatMul broadcasts over the query
heads (Falcon's eager attention, no repeat_kv) becomes ``kv_num_heads=1``. MultiHeadAttention has none of
them, so the fallback declines all three.

Rotary inside GQA (``do_rotary=1`` on the packed QKV projection, as the model builder emits) is not done:
the graphs take ``position_ids`` as an input, and ORT 1.32's CPU GroupQueryAttention ignores its
``position_ids`` input on a first prompt (an empty past), rotating by 0..S-1 instead: measured 1.6 max abs
difference on q-derived outputs with other position ids, exact on decode and on a prompt after a past. Only
positions provably derived from ``seqlens_k`` would make it exact, and an input proves nothing.

Fallback: ``com.microsoft::MultiHeadAttention`` on the repeated keys and values with the graph's own mask as
``attention_bias`` (the cache Concat stays), exact for any mask, padding and batch, where GQA does not fit:
a mask that is not causal + key padding, a head size ORT's CPU GQA refuses (not a multiple of 8), multi-head
latent attention with ``attention='mha'`` (DeepSeek, MiniCPM3: values narrower than keys, both expanded from a
cached latent after the cache, so no cache Concat feeds them; MHA takes them flat, ``[B, T, H*d]`` each, which
measured slower than the unfused graph, so ``auto`` leaves them with that reason), or sample
inputs GQA cannot compute like the graph (a padded mask; a batch of prompts after a cache, which ORT's GQA
refuses). ``attention`` chooses: ``auto`` (GQA where it fits, else MHA), ``gqa`` only, ``mha`` only. A job
without samples verifies on ``core.inputs``' sets for a decoder-only language model, the calls generation
makes (unpadded; prefill with batch 2; one token per row on a past with batch 4; a batch-1 prompt after a
past), which GQA fits; samples a user uploads with padding or several prompts after a cache get MHA.

Masks: GQA assumes right padding: row b holds ``seqlens_k[b] + 1`` valid positions, all at the start. With
an all-ones mask (and with right padding on the valid positions of a prompt) it computes what the graph
does. With LEFT padding it does not: the graph masks the padded keys wherever they are, GQA counts them as
the first positions of the row. Feed right-padded batches (or batch 1) to the fused model.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._subgraphs import in_branches
from passes.fusion import _gqa_rewrite as rewrite
from passes.fusion import _kernel_fit as kernel_fit
from passes.fusion import _key_transpose as key_transpose
from passes.fusion import _score_mask_order as score_mask_order
from passes.fusion._gqa_match import Site, match_sites
from passes.fusion._gqa_probe import Feeder, MaskKind, ProbeError, measure_shapes, probe_mask
from passes.fusion._gqa_reshapes import fold_head_reshapes, reading
from passes.fusion._rotary_cache import DEFAULT_MAX_POSITIONS, metadata_max_positions

LEFT_PADDING = (
    "GQA reads each row's length from seqlens_k = sum(attention_mask) - 1 and assumes right padding: a "
    "left-padded batch gives other values than the original (verify and serve with right padding or batch 1)"
)


MLA_SLOWER = kernel_fit.LATENT_SLOWER  # fuse_transformer's SDPA rule and the report read the same measurement


class FuseGqaOptions(PassOptions):
    attention: Literal["auto", "gqa", "mha"] = Field(
        "auto",
        description="'auto': GroupQueryAttention where it fits the mask, head size and sample inputs, else "
        "MultiHeadAttention (exact for any mask and padding), except on multi-head latent attention, measured "
        "slower so; 'gqa': GroupQueryAttention only; 'mha': MultiHeadAttention wherever it fits (MLA too).",
    )
    local_window: bool = Field(
        True,
        description="Fuse a sliding-window mask (Mistral) as GQA's local_window_size; False leaves those layers to "
        "MultiHeadAttention (or unfused with attention='gqa').",
    )
    max_probe_length: int = Field(
        16384,
        ge=64,
        description="Longest cache (positions) at which the mask is run to find a sliding window; a window wider "
        "than this is not detected.",
    )
    window_edge_up_to: int = Field(
        8192,
        ge=0,
        description="With a sliding window of W keys, the job also verifies this and every later pass at the "
        "window's edge (one token after a cache of W - 1 and of W, two rows of one token, short prompts up to "
        "and across it), each set spanning at most this many positions (nor more than the model's "
        "max_position_embeddings metadata, else 4096, fuse_rotary's table); the notes name the sets left out.",
    )


class FuseGqa(Pass[FuseGqaOptions]):
    name = "fuse_gqa"
    summary = "Fuse each decoder self-attention (KV cache or none) into GroupQueryAttention, else MultiHeadAttention."
    exact = True  # within float tolerance: the fused kernels reassociate the sums
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        if (branches := in_branches(self, model, ctx)) is not None:  # a merged decoder: fuse inside its If
            return branches
        # Scores masked before their scale or through a causal Where (CodeGen, GPT-Neo) are first put in the
        # order the match reads; an edit that stands even where nothing fuses, so the result says it changed.
        reordered = 0 if ctx.target == "tensorrt" else score_mask_order.rules.apply_to_model(model)
        # A key transposed to [B, h, d, S] from another layout (dynamo's cached MiniCPM3) gets the matcher's form
        split = 0 if ctx.target == "tensorrt" else key_transpose.split_permuted(model)
        sites, declined = match_sites(model.graph)
        notes: dict[str, Any] = {"attention_layers": len(sites) + len(declined), "padding": LEFT_PADDING}

        def unfused(non_matches: list[NonMatch]) -> PassResult:
            counts = {k: v for k, v in (("scores_reordered", reordered), ("key_transposes_split", split)) if v}
            return PassResult(model, bool(reordered or split), counts, non_matches, notes)

        if ctx.target == "tensorrt":
            reason = "TensorRT parses standard ONNX only: contrib attention ops would fall back"
            return PassResult(model, False, {}, [NonMatch(reason)], notes)
        capped = {id(site) for site in sites if _bidirectional_candidate(site)}
        sites = [s for s in sites if id(s) in capped or not _declined_without_causal_structure(s, declined)]
        if not sites:
            return unfused(declined)
        feeder = Feeder(model)
        if (why := feeder.unfeedable()) is not None:
            return unfused([*declined, NonMatch(f"shape probe: {why}")])
        masks: dict[int, MaskKind | str] = {}  # by mask value: layers share one
        if not self._any_causal(model, feeder, sites, masks) and not capped:
            # No layer's mask is causal (an encoder-decoder's padding and cross masks, a decoder fed no mask of
            # its own): each is declined for its mask, before the whole model is run to measure shapes.
            for site in sites:
                head = f"attention layer {site.layer} (node {site.softmax.name})"
                why = masks.get(id(site.mask), "not causal self-attention")
                declined.append(NonMatch(f"{head}: {why}", node=site.softmax.name, op_type="Softmax"))
            notes["masks"] = []
            return unfused(declined)
        try:
            probed = [v for site in sites for v in site.probed()]
            shapes = measure_shapes(model, feeder, probed + [s.mask for s in sites if s.mask is not None])
        except ProbeError as exc:
            return unfused([*declined, NonMatch(f"shape probe: {exc}")])
        unfit = _samples_unfit(ctx.samples, feeder) or _static_unfit(feeder)
        plans: list[tuple[Site, tuple[int, int, int], str, MaskKind]] = []
        for site in sites:
            head = f"attention layer {site.layer} (node {site.softmax.name})"
            try:  # a layer that is not causal self-attention (an encoder's) is fuse_transformer's to fuse
                sizes = _sizes(site, shapes, feeder.probe_shape)
            except ProbeError as exc:
                declined.append(NonMatch(f"{head}: {exc}", node=site.softmax.name, op_type="Softmax"))
                continue
            try:
                kind = self._causal(model, feeder, site, masks)
            except ProbeError as exc:
                why = str(exc)
                if id(site) in capped:  # soft-capped scores MultiHeadAttention cannot take: GQA without causality
                    unfit_bidirectional = self._why_not_bidirectional(site, shapes, sizes, feeder)
                    if unfit_bidirectional is None:
                        plans.append((site, sizes, "gqa_bidirectional", MaskKind(None, 0)))
                        continue
                    why += f"; bidirectional GroupQueryAttention (its soft-cap): {unfit_bidirectional}"
                declined.append(NonMatch(f"{head}: {why}", node=site.softmax.name, op_type="Softmax"))
                continue
            latent = _why_not_gqa_keys(site, shapes, sizes, feeder)
            why_not = latent or self._why_not_gqa(sizes, kind, unfit)
            if why_not is None:
                plans.append((site, sizes, "gqa", kind))
                continue
            mha = "attention='gqa'" if self.options.attention == "gqa" else _mha_unfit(site, shapes, sizes, feeder)
            if mha is None and latent and self.options.attention == "auto":
                mha = MLA_SLOWER
            if mha is None:
                plans.append((site, sizes, "mha", kind))
                reason = f"{head}: fused as MultiHeadAttention, not GroupQueryAttention: {why_not}"
            else:
                reason = f"{head}: not fused: GroupQueryAttention does not fit ({why_not}); MultiHeadAttention: {mha}"
            declined.append(NonMatch(reason, node=site.softmax.name, op_type="Softmax"))
        notes["masks"] = [
            {"window": k.window, "proven_up_to": k.proven} for k in masks.values() if not isinstance(k, str)
        ]
        if not plans:
            return unfused(declined)
        if any(op == "gqa" for _, _, op, _ in plans):
            assert feeder.mask_name is not None  # probe_mask refused otherwise
            lengths = rewrite.lengths(model.graph, feeder.mask_name)
        if any(op == "gqa_bidirectional" for _, _, op, _ in plans):
            assert feeder.mask_name is not None  # _why_not_bidirectional refused otherwise
            every_key = rewrite.full_lengths(model.graph, feeder.mask_name)
        crops_dropped = 0
        with reading(model.graph):  # ranks and dims where values carry no shapes (a merged decoder's branches)
            for site, sizes, op, kind in plans:
                if op == "gqa_bidirectional":
                    rewrite.rewrite_gqa(model.graph, site, every_key, sizes, None, bias=site.mask)
                elif op == "gqa":
                    crops_dropped += rewrite.rewrite_gqa(model.graph, site, lengths, sizes, kind.window)
                else:
                    rewrite.rewrite_mha(model.graph, site, sizes, shapes[site.v_all.name][3])
        folded = fold_head_reshapes(model.graph)
        common_passes.RemoveUnusedNodesPass()(model)
        model.graph.sort()
        model.opset_imports.setdefault("com.microsoft", 1)
        notes["layers"] = [
            {"layer": s.layer, "op": op, "heads": h, "kv_heads": kv, "head_size": d, "scale": s.scale,
             "cache": s.k_past is not None, **({"softcap": s.softcap} if s.softcap else {}),
             **({"sinks": True} if s.sink is not None else {})}
            for s, (h, kv, d), op, _ in plans
        ]  # fmt: skip
        windows = {k.window for _, _, _, k in plans if k.window is not None}
        edge, notes["window_edge"] = self._window_edge(model, feeder, max(windows, default=None))
        counts = {
            "fused_gqa": sum(op.startswith("gqa") for _, _, op, _ in plans),
            "bidirectional": sum(op == "gqa_bidirectional" for _, _, op, _ in plans),
            "fused_mha": sum(op == "mha" for _, _, op, _ in plans),
            "windowed": sum(k.window is not None and op == "gqa" for _, _, op, k in plans),
            "head_reshapes_folded": folded,
            "past_crops_dropped": crops_dropped,
            "scores_reordered": reordered,
            "key_transposes_split": split,
        }
        return PassResult(model, True, counts, declined, notes, verify_inputs=edge)

    def _window_edge(
        self, model: ir.Model, feeder: Feeder, window: int | None
    ) -> tuple[dict[str, dict[str, np.ndarray]], str | None]:
        """Input sets at the edge of a sliding window of ``window`` keys, where GQA's ``local_window_size``
        takes over from the export's mask and its crops of the cache (a present one position too long went
        unseen once: the job's own sets stay below the window), and what the notes say about them. No set
        goes past ``window_edge_up_to`` positions, nor past the model's ``max_position_embeddings`` metadata,
        else fuse_rotary's table (its RotaryEmbedding refuses a position beyond its rows; a table in the graph
        bounds them by its own rows)."""
        if window is None:
            return {}, None
        if feeder.fixed.keys() & {"seq", "past"}:
            return {}, f"the window of {window} keys: not verified at its edge: the export fixes its lengths"
        positions = min(self.options.window_edge_up_to, metadata_max_positions(model) or DEFAULT_MAX_POSITIONS)
        for node in model.graph:  # a rotary table already in the graph (fuse_rotary ran first) bounds them too
            if node.op_type == "RotaryEmbedding" and len(node.inputs) > 2 and node.inputs[2] is not None:
                table = ir.convenience.get_const_tensor(node.inputs[2])
                positions = min(positions, table.shape[0]) if table is not None else positions
        if feeder.has_past:
            cases = {
                f"1 token after a cache of {window - 1}": (1, 1, window - 1),  # the present's crop cuts one
                f"2 rows of 1 token after a cache of {window - 1}": (2, 1, window - 1),
                f"2 tokens after a cache of {window - 2}": (1, 2, window - 2),
                f"1 token after a cache of {window}": (1, 1, window),  # the window leaves the first key out
                f"3 tokens after a cache of {window - 2}": (1, 3, window - 2),
            }
        else:
            cases = {f"a prompt of {window + 1}": (1, window + 1, 0)}
        sets = {
            f"fuse_gqa window edge: {n}": feeder.feeds(*shape)
            for n, shape in cases.items()
            if sum(shape[1:]) <= positions
        }
        beyond = [n for n, shape in cases.items() if sum(shape[1:]) > positions]
        if not beyond:
            return sets, f"verified at the window of {window} keys where the upload runs"
        limit = f"{positions} positions (window_edge_up_to, max_position_embeddings or rotary table)"
        return sets, f"the window of {window} keys: not verified at {', '.join(beyond)}: beyond {limit}"

    def _any_causal(self, model, feeder: Feeder, sites: list[Site], masks: dict[int, MaskKind | str]) -> bool:
        """Probe each distinct mask once (into ``masks``, which ``_causal`` reads); whether any is causal."""
        causal = False
        for site in sites:
            try:
                self._causal(model, feeder, site, masks)
                causal = True
            except ProbeError:
                pass
        return causal

    def _causal(self, model, feeder: Feeder, site: Site, masks: dict[int, MaskKind | str]) -> MaskKind:
        """The layer's mask kind (causal, its window), probed once per distinct mask value; ProbeError when
        the layer's mask is not causal plus key padding."""
        if site.mask is None:
            raise ProbeError("found no mask added to the scores: attention over every key is not causal")
        key = id(site.mask)
        if key not in masks:  # layers share one mask value
            try:
                masks[key] = probe_mask(model, feeder, site.mask, self.options.max_probe_length)
            except ProbeError as exc:
                masks[key] = f"not causal self-attention: mask probe: {exc}"
        kind = masks[key]
        if isinstance(kind, str):
            raise ProbeError(kind)
        return kind

    def _why_not_bidirectional(
        self, site: Site, shapes: dict[str, tuple[int, ...]], sizes: tuple[int, int, int], feeder: Feeder
    ) -> str | None:
        """Why a soft-capped layer whose mask is not causal cannot be GroupQueryAttention with ``causal=0``, its
        mask as ``attention_bias`` and every key counted (``seqlens_k`` = S - 1), or None. ORT 1.32's CPU kernel
        caps the scores before it adds the bias, the order T5Gemma's encoder computes (measured: 4.6e-7 against
        that order, 1.78 against the other); padding and windows are in the bias."""
        if self.options.attention != "auto":
            return f"attention={self.options.attention!r}"
        if sizes[2] % 8:
            return f"head size {sizes[2]}: ORT's CPU GroupQueryAttention needs a multiple of 8"
        if feeder.mask_name is None or feeder.has_past:
            return "no single attention_mask input without a cache to count the keys by"
        mask = shapes.get(str(site.mask.name)) if site.mask is not None else None
        batch, seq, _ = feeder.probe_shape
        if mask is None or len(mask) != 4 or mask[0] not in (1, batch) or mask[1] not in (1, sizes[0]):
            return f"the mask has shape {mask}, not [1 or {batch}, 1 or {sizes[0]}, {seq}, {seq}]"
        if mask[2:] != (seq, seq):
            return f"the mask has shape {mask}, not [.., {seq}, {seq}] at {seq} tokens"
        return None

    def _why_not_gqa(self, sizes: tuple[int, int, int], kind: MaskKind, unfit: str | None) -> str | None:
        if self.options.attention == "mha":
            return "attention='mha'"
        if sizes[2] % 8:
            return f"head size {sizes[2]}: ORT's CPU GroupQueryAttention needs a multiple of 8"
        if kind.window is not None and not self.options.local_window:
            return f"the mask has a sliding window of {kind.window} keys and local_window is off"
        return unfit


def _bidirectional_candidate(site: Site) -> bool:
    """A layer GroupQueryAttention may take with ``causal=0`` should its mask not be causal: soft-capped scores
    (which MultiHeadAttention cannot cap) without a cache or sinks, and a mask to pass as its bias."""
    return bool(site.softcap) and site.k_past is None and site.mask is not None and site.sink is None


_CAUSAL_OPS = frozenset({"Range", "Trilu"})


def _declined_without_causal_structure(site: Site, declined: list[NonMatch]) -> bool:
    """Decline, before any run, a layer whose mask cannot be causal: none at all, or one computed from no
    ``Range``/``Trilu`` and no triangular table (an encoder's padding mask). Running the mask probe on every
    encoder layer cost seconds per job; the probe still proves the layers this lets through."""
    head = f"attention layer {site.layer} (node {site.softmax.name})"
    if site.mask is None:
        why = "found no mask added to the scores: attention over every key is not causal"
    elif _has_causal_source(site.mask):
        return False
    else:
        why = "its mask derives from no Range, Trilu or 2-D table: a padding mask, not a causal one"
    declined.append(NonMatch(f"{head}: not causal self-attention: {why}", node=site.softmax.name, op_type="Softmax"))
    return True


def _has_causal_source(mask: ir.Value, budget: int = 400) -> bool:
    seen: set[int] = set()
    stack = [mask]
    while stack and len(seen) < budget:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is not None and len(tensor.shape) >= 2 and min(tensor.shape[-2:]) >= 2:
            return True  # a lower-triangular buffer (GPT-2's `bias`), sliced at run time
        node = value.producer()
        if node is None:
            continue
        if node.op_type in _CAUSAL_OPS:
            return True
        stack.extend(v for v in node.inputs if v is not None)
    return len(seen) >= budget  # too deep to tell: let the probe decide


def _samples_unfit(samples: list[dict[str, np.ndarray]], feeder: Feeder) -> str | None:
    """Why GroupQueryAttention would not compute what the graph does on the job's sample inputs (which
    verify the pass), or None: a mask with zeros (GQA places each row's tokens by its count), or several
    rows of new tokens after a cache (ORT's GQA refuses a batch of prompts after a past)."""
    for index, sample in enumerate(samples):
        mask = sample.get(feeder.mask_name or "")
        if mask is None or mask.ndim != 2:
            continue
        if not np.all(mask != 0):
            return f"sample {index} has a padded attention mask ({LEFT_PADDING})"
        seq = max((sample[n].shape[-1] for n in feeder.sequence_inputs if n in sample), default=mask.shape[1])
        if mask.shape[0] > 1 and seq > 1 and mask.shape[1] > seq:
            return (
                f"sample {index} holds {mask.shape[0]} rows of {seq} new tokens after a cache of "
                f"{mask.shape[1] - seq}, which ORT's GroupQueryAttention refuses (batch 1 only there)"
            )
    return None


def _static_unfit(feeder: Feeder) -> str | None:
    """Why GroupQueryAttention cannot compute the calls an export with fixed lengths takes, or None: several
    new tokens after a cache, in a batch the graph fixes above 1 or leaves dynamic (ORT's GQA refuses a batch
    of prompts after a past, and such a graph runs at no other lengths)."""
    fixed = feeder.fixed
    seq, past, batch = fixed.get("seq", 0), fixed.get("past", 0), fixed.get("batch")
    if seq > 1 and past > 0 and (batch is None or batch > 1):
        rows = "a dynamic batch" if batch is None else f"batch {batch}"
        return (
            f"the export fixes {seq} new tokens after a cache of {past} with {rows}: ORT's GroupQueryAttention "
            "refuses several rows of new tokens after a cache"
        )
    return None


def _sizes(site: Site, shapes: dict[str, tuple[int, ...]], probe: tuple[int, int, int]) -> tuple[int, int, int]:
    """(heads, kv heads, head size) measured at ``probe`` = (batch, new tokens, past): 1 x 3 new tokens after
    a cache of 2, or the dims the export fixed; ProbeError when a value is not the shape the pattern gives it."""
    q, k_all, v_all = shapes[site.q.name], shapes[site.k_all.name], shapes[site.v_all.name]
    if site.k_bsnd and len(k_all) == 4:  # [B,S,N,D] keys: compare them in the heads-first layout
        k_all = (k_all[0], k_all[2], k_all[1], k_all[3])
        shapes = {**shapes, site.k_rep.name: k_all}
    batch, seq, past = probe
    total = seq + past if site.k_past is not None else seq
    if site.k_past is None and len(k_all) == 4 and k_all[2] == seq + past:
        total = seq + past  # keys computed from a cache upstream (MLA's latent): see _why_not_gqa_keys
    if len(q) != 4 or q[0] != batch or q[2] != seq:
        raise ProbeError(f"q has shape {q} at {seq} new tokens, not [{batch}, heads, {seq}, head_size]")
    heads, head_size = q[1], q[3]
    if len(k_all) != 4 or k_all[0] != batch or k_all[2] != total or k_all[3] != head_size or v_all[:3] != k_all[:3]:
        raise ProbeError(f"key/value have shapes {k_all}/{v_all}, not [{batch}, kv_heads, {total}, {head_size}]")
    kv_heads, v_head = k_all[1], v_all[3] if len(v_all) == 4 else head_size
    expanded = (batch, heads, total, head_size)
    # Multi-query attention may leave its single key/value head unrepeated (Falcon-7B's eager attention):
    # MatMul broadcasts that axis over the query heads, which is what GroupQueryAttention's kv_num_heads=1 does.
    broadcast = (batch, 1, total, head_size)
    if kv_heads == 1 and shapes[site.k_rep.name] == broadcast and shapes[site.v_rep.name][:3] == broadcast[:3]:
        expanded = broadcast
    if shapes[site.k_rep.name] != expanded or shapes[site.v_rep.name] != (*expanded[:3], v_head) or heads % kv_heads:
        raise ProbeError(f"repeated key/value {shapes[site.k_rep.name]} are not {expanded} from {kv_heads} kv heads")
    if site.reshaped is not None and shapes[site.reshaped.name] != shapes[site.context.outputs[0].name]:
        raise ProbeError(
            f"MatMul(probs, v) {shapes[site.context.outputs[0].name]} is reshaped to {shapes[site.reshaped.name]}"
        )
    if shapes[site.out.name] != (batch, seq, heads, v_head):
        raise ProbeError(
            f"the attention output has shape {shapes[site.out.name]}, not [{batch}, {seq}, {heads}, {v_head}]"
        )
    if site.sink is not None and site.sink.size not in (1, heads):
        raise ProbeError(f"the attention sinks hold {site.sink.size} values for {heads} heads")
    return heads, kv_heads, head_size


def _why_not_gqa_keys(
    site: Site, shapes: dict[str, tuple[int, ...]], sizes: tuple[int, int, int], feeder: Feeder
) -> str | None:
    """Why GroupQueryAttention cannot take the layer's keys and values as the graph computes them, where
    MultiHeadAttention can (multi-head latent attention: transformers caches MLA's compressed latent and
    expands it to every head's keys and values after the cache, whose values are narrower than its keys)."""
    value_head = shapes[site.v_all.name][3]
    if value_head != sizes[2]:
        return (
            f"its value heads are {value_head} wide and its query/key heads {sizes[2]} (multi-head latent "
            "attention); GroupQueryAttention takes one head size"
        )
    keys = shapes[site.k_all.name][1 if site.k_bsnd else 2]
    if site.k_past is None and keys != feeder.probe_shape[1]:
        return (
            "its keys span the cache but no cache Concat makes them (they are computed from a cached latent); "
            "GroupQueryAttention takes the new keys and the cache itself"
        )
    return None


def _mha_unfit(
    site: Site, shapes: dict[str, tuple[int, ...]], sizes: tuple[int, int, int], feeder: Feeder
) -> str | None:
    """None where MultiHeadAttention takes the layer's keys and values as they are (one per query head) and its
    mask as attention_bias ([B|1, H|1, S, T]), else why not."""
    if site.softcap:
        return f"the scores are soft-capped ({site.softcap:g} * tanh(scores / {site.softcap:g})), which it cannot"
    if site.sink is not None:
        return "the softmax has a learned sink logit per head (attention sinks), which it cannot take"
    kv = shapes[site.k_rep.name][2 if site.k_bsnd else 1]
    if kv != sizes[0]:
        return (
            f"the keys and values keep {kv} head(s) for MatMul to broadcast over {sizes[0]} query heads; "
            "MultiHeadAttention takes one per query head"
        )
    if site.mask is None:
        return None
    mask = shapes[site.mask.name]
    total = shapes[site.k_rep.name][2] if not site.k_bsnd else shapes[site.k_rep.name][1]
    batch, seq, _ = feeder.probe_shape
    if len(mask) != 4 or mask[0] not in (1, batch) or mask[1] not in (1, sizes[0]) or mask[2:] != (seq, total):
        return (
            f"the mask has shape {mask} at {batch} x {seq} new tokens, not [1 or {batch}, 1 or {sizes[0]}, "
            f"{seq}, {total}]"
        )
    return None
